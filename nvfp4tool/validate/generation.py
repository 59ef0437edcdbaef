"""Greedy continuations of the same prompts by each model (for the first-divergence position)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from nvfp4tool.model import generate


def greedy_continuations(model, linear, prompts_BxT: np.ndarray, new_tokens: int) -> np.ndarray:
    """[B, new_tokens] greedy tokens continuing each prompt (no EOS stop: every row runs to the end)."""
    tokens = generate(model, jnp.asarray(prompts_BxT, jnp.int32), new_tokens, greedy=True, linear=linear)
    return np.asarray(tokens)
