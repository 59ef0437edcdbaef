"""Greedy continuations of the same prompts by each model (for the first-divergence position)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from nvfp4tool.model import KVFn, default_kv, generate
from nvfp4tool.model.generate import OnToken, bucket
from nvfp4tool.model.kv import LayerKV


def greedy_continuations(
    model,
    linear,
    prompts_BxT: np.ndarray,
    new_tokens: int,
    kv: KVFn | LayerKV = default_kv,
    on_token: OnToken | None = None,
    longest: int | None = None,
) -> np.ndarray:
    """[B, new_tokens] greedy tokens continuing each prompt (no EOS stop: every row runs to the end),
    keys and values cached through the KV seam `kv`; `on_token` as `generate`'s. `longest`: the
    longest prompt the caller will run (default: these), so that prompts run one at a time share
    one prompt bucket and cache length: one compilation of generation's programs."""
    prompt_bucket = bucket(max(longest or 0, prompts_BxT.shape[1]))
    tokens = generate(
        model,
        jnp.asarray(prompts_BxT, jnp.int32),
        new_tokens,
        greedy=True,
        linear=linear,
        kv=kv,
        on_token=on_token,
        prompt_bucket=prompt_bucket,
        cache_len=bucket(prompt_bucket + new_tokens),
    )
    return np.asarray(tokens)
