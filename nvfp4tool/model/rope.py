"""Rotary position embedding in HF's half-split layout, each layer at its family's setting.

    rotation = layer_rotation(config, 3)              # Rotation(dim, theta, scaling) or None
    tables = rope_tables(config, positions, dtype)    # one (cos, sin) per distinct setting
    cos, sin = tables[rotation_index(config, 3)]

The inverse frequencies are computed once in float32 numpy, step for step as transformers does
(`_compute_default_rope_parameters`, then the scaling type's own function), so tiny models that put
most wavelengths in a scaled band match HF to float32 rounding. Every scaling type's math lives
here, in `SCALED` (rope_type -> function), keyed as config.json names it ("llama3", "linear", "yarn").
Design notes: docs/design/model.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4tool.config import ModelConfig
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.families.rope_scaling import yarn_mscale


@dataclasses.dataclass(frozen=True)
class Rotation:
    """One layer's RoPE: the rotated width, the base and the scaling record (or None)."""

    dim: int
    theta: float
    scaling: Any = None


def _llama3(inv_freq: np.ndarray, rotation: Rotation) -> tuple[np.ndarray, float]:
    """transformers' `_compute_llama3_parameters`: long wavelengths slowed by `factor`, short ones
    kept, the band between interpolated linearly in 1/wavelength."""
    scaling = rotation.scaling
    old_context = np.float32(scaling.original_max_position_embeddings)
    low_freq_wavelen = old_context / np.float32(scaling.low_freq_factor)
    high_freq_wavelen = old_context / np.float32(scaling.high_freq_factor)
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / np.float32(scaling.factor), inv_freq)
    smooth = (old_context / wavelen - np.float32(scaling.low_freq_factor)) / np.float32(
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / np.float32(scaling.factor) + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32), 1.0


def _linear(inv_freq: np.ndarray, rotation: Rotation) -> tuple[np.ndarray, float]:
    """transformers' `_compute_linear_scaling_rope_parameters`: every frequency divided by `factor`."""
    return (inv_freq / np.float32(rotation.scaling.factor)).astype(np.float32), 1.0


def _yarn(inv_freq: np.ndarray, rotation: Rotation) -> tuple[np.ndarray, float]:
    """transformers' `_compute_yarn_parameters`: the frequencies whose rotations over the original
    context lie between beta_fast and beta_slow ramp linearly from theta^(-2i/dim) (extrapolated) to
    theta^(-2i/dim) / factor (interpolated), the correction range rounded outwards unless
    `truncate` is false; the attention factor multiplies cos and sin."""
    s, D, base = rotation.scaling, rotation.dim, rotation.theta
    if s.attention_factor is not None:
        factor = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        factor = yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
    else:
        factor = yarn_mscale(s.factor)

    def correction_dim(rotations: float) -> float:
        return (D * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast or 32), correction_dim(s.beta_slow or 1)
    if s.truncate is not False:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, D - 1)
    high = high + 0.001 if low == high else high  # transformers' guard against a zero-width ramp
    pos_freqs = np.float32(base) ** (np.arange(0, D, 2, dtype=np.int64).astype(np.float32) / np.float32(D))
    interpolated = (np.float32(1.0) / (np.float32(s.factor) * pos_freqs)).astype(np.float32)
    ramp = np.clip((np.arange(D // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolated_share = (np.float32(1) - ramp).astype(np.float32)
    return (interpolated * (1 - extrapolated_share) + inv_freq * extrapolated_share).astype(np.float32), factor


# rope_type -> (default inverse frequencies, the scaling record) -> (scaled inverse frequencies,
# the factor cos and sin are multiplied by: transformers' `attention_factor`)
SCALED: dict[str, Callable[[np.ndarray, Rotation], tuple[np.ndarray, float]]] = {
    "llama3": _llama3,
    "linear": _linear,
    "yarn": _yarn,
}


def frequencies(rotation: Rotation) -> tuple[np.ndarray, float]:
    """(inv_freq [dim/2] float32, attention factor) of `rotation`: theta^(-2i/dim), then its
    scaling type's function (`SCALED`)."""
    D = rotation.dim
    exponent = np.arange(0, D, 2, dtype=np.int64).astype(np.float32) / np.float32(D)
    inv_freq = (np.float32(1.0) / (np.float32(rotation.theta) ** exponent)).astype(np.float32)
    if rotation.scaling is None:
        return inv_freq, 1.0
    scaled = SCALED.get(rotation.scaling.rope_type)
    if scaled is None:
        raise NVFP4ToolError(f"RoPE scaling type {rotation.scaling.rope_type!r} has no frequencies in the model")
    return scaled(inv_freq, rotation)


def inverse_frequencies(D: int, theta: float, scaling: Any) -> np.ndarray:
    """inv_freq_{D/2} (float32) of head width `D` at base `theta`, scaled by `scaling` when given."""
    return frequencies(Rotation(D, theta, scaling))[0]


def layer_rotation(config: ModelConfig, layer: int) -> Rotation | None:
    """Decoder layer `layer`'s RoPE as its family gives it (`Family.layer_attention`); None: the
    layer rotates nothing (no positional encoding)."""
    a = config.family_spec.layer_attention(config, layer)
    return None if a.rope_theta is None else Rotation(a.rope_dim or config.head_dim, a.rope_theta, a.rope_scaling)


@functools.lru_cache(maxsize=64)
def rotations(config: ModelConfig) -> tuple[Rotation, ...]:
    """The distinct RoPE settings of `config`'s layers, in order of first use."""
    found = (layer_rotation(config, i) for i in range(config.num_layers))
    return tuple(dict.fromkeys(r for r in found if r is not None))


def rotation_index(config: ModelConfig, layer: int) -> int | None:
    """Where layer `layer`'s (cos, sin) lies in `rope_tables` (None: it has no RoPE)."""
    rotation = layer_rotation(config, layer)
    return None if rotation is None else rotations(config).index(rotation)


def rope_cos_sin(positions_BxT: jax.Array, rotation: Rotation, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape [B, T, dim] (angles in float32, times the attention factor, then cast to
    `dtype`, as HF)."""
    inv_freq_half, factor = frequencies(rotation)
    angles_BxTxHalf = positions_BxT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq_half)
    angles_BxTxD = jnp.concatenate([angles_BxTxHalf, angles_BxTxHalf], axis=-1)
    cos, sin = jnp.cos(angles_BxTxD), jnp.sin(angles_BxTxD)
    if factor != 1.0:
        cos, sin = cos * np.float32(factor), sin * np.float32(factor)
    return cos.astype(dtype), sin.astype(dtype)


def rope_tables(config: ModelConfig, positions_BxT: jax.Array, dtype: jnp.dtype) -> tuple:
    """(cos, sin) [B, T, dim] of every distinct setting (`rotations`), computed once each."""
    return tuple(rope_cos_sin(positions_BxT, r, dtype) for r in rotations(config))


def layer_cos_sin(config: ModelConfig, tables: tuple, layer: int) -> tuple[jax.Array | None, jax.Array | None]:
    """Layer `layer`'s (cos, sin) from `rope_tables`; (None, None) for a layer without RoPE."""
    index = rotation_index(config, layer)
    return (None, None) if index is None else tables[index]


def apply_rope(x_BxTxHxD: jax.Array, cos_BxTxD: jax.Array, sin_BxTxD: jax.Array) -> jax.Array:
    """Rotate pairs (x[i], x[i + D/2]) by the position angle: x*cos + rotate_half(x)*sin."""
    half = x_BxTxHxD.shape[-1] // 2
    rotated = jnp.concatenate([-x_BxTxHxD[..., half:], x_BxTxHxD[..., :half]], axis=-1)
    return x_BxTxHxD * cos_BxTxD[:, :, None, :] + rotated * sin_BxTxD[:, :, None, :]
