"""Shared pytest setup: force JAX onto the CPU with exact fp32 matmuls, common fixtures."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
