"""Greedy continuations of the same prompts by each model (for the first-divergence position)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from nvfp4tool.model import KVFn, default_kv, generate
from nvfp4tool.model.generate import OnToken


def greedy_continuations(
    model, linear, prompts_BxT: np.ndarray, new_tokens: int, kv: KVFn = default_kv, on_token: OnToken | None = None
) -> np.ndarray:
    """[B, new_tokens] greedy tokens continuing each prompt (no EOS stop: every row runs to the end),
    keys and values cached through the KV seam `kv`; `on_token` as `generate`'s."""
    tokens = generate(
        model, jnp.asarray(prompts_BxT, jnp.int32), new_tokens, greedy=True, linear=linear, kv=kv, on_token=on_token
    )
    return np.asarray(tokens)
