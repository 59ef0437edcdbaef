"""Rotary position embedding in HF's half-split layout, with llama3 frequency scaling.

The inverse frequencies are computed once in float32 numpy, step for step as transformers does
(`_compute_default_rope_parameters` / `_compute_llama3_parameters`), so tiny models that put most
wavelengths in the scaled band match HF to float32 rounding. The base and scaling are each
layer's as its family gives them (`Family.layer_attention`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4tool.config import ModelConfig, RopeScaling
from nvfp4tool.errors import NVFP4ToolError


def layer_frequencies(config: ModelConfig) -> np.ndarray | None:
    """The inverse frequencies every layer's attention rotates by (its family's `layer_attention`:
    base and scaling); None when the family has no positional encoding. The model computes one
    (cos, sin) for all its layers, so layers with different RoPE settings are refused here."""
    family = config.family_spec
    settings = {
        (a.rope_theta, a.rope_scaling) for a in (family.layer_attention(config, i) for i in range(config.num_layers))
    }
    if len(settings) > 1:
        raise NVFP4ToolError(
            f"model config ({config.family}): layers with different RoPE bases or scaling are not "
            f"supported by this model yet"
        )
    ((theta, scaling),) = settings
    return None if theta is None else inverse_frequencies(config.head_dim, theta, scaling)


def inverse_frequencies(D: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """inv_freq_{D/2} (float32) of head width `D`: theta^(-2i/D), then llama3 `scaling` when given."""
    exponent = np.arange(0, D, 2, dtype=np.int64).astype(np.float32) / np.float32(D)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponent)).astype(np.float32)
    if scaling is None:
        return inv_freq
    old_context = np.float32(scaling.original_max_position_embeddings)
    low_freq_wavelen = old_context / np.float32(scaling.low_freq_factor)
    high_freq_wavelen = old_context / np.float32(scaling.high_freq_factor)
    wavelen = np.float32(2 * math.pi) / inv_freq
    # Long wavelengths (beyond the original context) are slowed down by `factor` ...
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / np.float32(scaling.factor), inv_freq)
    # ... short ones kept, and the band between them interpolated linearly in 1/wavelength.
    smooth = (old_context / wavelen - np.float32(scaling.low_freq_factor)) / np.float32(
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / np.float32(scaling.factor) + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(positions_BxT: jax.Array, inv_freq_half: np.ndarray, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape [B, T, D] (angles computed in float32, then cast to `dtype`, as HF)."""
    angles_BxTxHalf = positions_BxT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq_half)
    angles_BxTxD = jnp.concatenate([angles_BxTxHalf, angles_BxTxHalf], axis=-1)
    return jnp.cos(angles_BxTxD).astype(dtype), jnp.sin(angles_BxTxD).astype(dtype)


def apply_rope(x_BxTxHxD: jax.Array, cos_BxTxD: jax.Array, sin_BxTxD: jax.Array) -> jax.Array:
    """Rotate pairs (x[i], x[i + D/2]) by the position angle: x*cos + rotate_half(x)*sin."""
    half = x_BxTxHxD.shape[-1] // 2
    rotated = jnp.concatenate([-x_BxTxHxD[..., half:], x_BxTxHxD[..., :half]], axis=-1)
    return x_BxTxHxD * cos_BxTxD[:, :, None, :] + rotated * sin_BxTxD[:, :, None, :]
