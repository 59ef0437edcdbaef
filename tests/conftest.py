"""Shared pytest setup: force JAX onto the CPU with exact fp32 matmuls, common fixtures."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def pristine(tmp_path_factory):
    """The adversarial corpus's read-only originals (`adversarial_harness.build_pristine`), built
    once for `test_adversarial.py` and its friends; a module may define its own `pristine`."""
    from adversarial_harness import build_pristine

    return build_pristine(tmp_path_factory.mktemp("pristine"))


@pytest.fixture
def hub_env(monkeypatch, tmp_path):
    """A token to (never) leak, Xet off, and no request to huggingface.co (see test_push.hub_env)."""
    from huggingface_hub import constants
    from huggingface_hub.utils import _detect_agent

    monkeypatch.setattr(_detect_agent, "_registry", _detect_agent._EMPTY_REGISTRY)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-saved-token"))
    from adversarial_harness import TOKEN

    monkeypatch.setenv("HF_TOKEN", TOKEN)
