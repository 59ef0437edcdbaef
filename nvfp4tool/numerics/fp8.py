"""FP8 (E4M3 / E5M2) current-scaling quantizers: the FP8 baselines the NVFP4 recipe is compared to.

scale = amax / fmt_max (an fp32 decode scale, `fp8_decode_scale`, or a given static `scale=`),
data = fp8_rne(clamp(x / scale)), x~ = fp32(data) * scale; amax per granularity along K (the last
axis): "tensor", "channel", "block128", "block128x128" (ragged edge tiles: ceil, their own amax).
`fake_quantize_fp8_token_groups`: the dynamic per-token-group activation quantization of the
fp8-block format (vLLM's per_token_group_quant_fp8: scale = max(amax, 1e-10) / 448).
`fp8_gemm.fp8_matmul` multiplies two.
Design notes: docs/design/numerics.md.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.numerics.blocks import (
    check_finite,
    check_scale_scalar,
    exact_divide,
    expand_tiles,
    flush_subnormal,
    tile_amax,
    times_decode_scale,
)
from nvfp4tool.numerics.constants import FP8_BLOCK, FP8_MAX

Fmt = Literal["e4m3", "e5m2"]
Granularity = Literal["tensor", "channel", "block128", "block128x128"]

_FP8_DTYPES = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}


@dataclasses.dataclass(frozen=True)
class FP8Array:
    """A tensor in FP8 with fp32 decode scales (a pytree).

    data   float8_e4m3fn or float8_e5m2, the input's shape
    scale  float32 decode scale(s), shape per granularity (module docstring)
    shape, dtype, fmt, granularity: static metadata
    """

    data: jax.Array
    scale: jax.Array
    shape: tuple[int, ...]
    dtype: np.dtype
    fmt: str
    granularity: str


jax.tree_util.register_dataclass(
    FP8Array, data_fields=["data", "scale"], meta_fields=["shape", "dtype", "fmt", "granularity"]
)


def quantize_fp8(
    x: jax.Array | np.ndarray, *, fmt: Fmt = "e4m3", granularity: Granularity = "tensor", name: str = "tensor"
) -> FP8Array:
    """Quantize `x` to FP8 with current (amax) scaling at the given granularity."""
    x = jnp.asarray(x)
    _validate(x, fmt, granularity, name)
    check_finite(x, name)
    data, scale = _quantize(x, fmt=fmt, granularity=granularity)
    return FP8Array(
        data=data, scale=scale, shape=tuple(x.shape), dtype=jnp.dtype(x.dtype), fmt=fmt, granularity=granularity
    )


def dequantize_fp8(q: FP8Array, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """fp32(data) * scale, cast to `dtype`."""
    return decode_fp8(q.data, q.scale, granularity=q.granularity, dtype=dtype)


def decode_fp8(
    data: jax.Array | np.ndarray,
    scale: jax.Array | np.ndarray | float,
    *,
    granularity: Granularity = "tensor",
    dtype: jnp.dtype = jnp.float32,
) -> jax.Array:
    """Decode stored FP8 bytes with their stored decode scale(s): fp32(data) * scale (flushed)."""
    return _dequantize(
        jnp.asarray(data), jnp.asarray(scale, jnp.float32), granularity=granularity, dtype=jnp.dtype(dtype)
    )


def fake_quantize_fp8(
    x: jax.Array | np.ndarray,
    *,
    fmt: Fmt = "e4m3",
    granularity: Granularity = "tensor",
    dtype: jnp.dtype | None = None,
    scale: jax.Array | float | None = None,
    name: str = "tensor",
) -> jax.Array:
    """Quantize-dequantize in one pass; equals dequantize_fp8(quantize_fp8(x), dtype).

    `scale` given (granularity "tensor" only): a static decode scale (e.g. a stored
    `input_scale`, what a serving engine applies to activations) instead of amax / fmt_max.
    """
    x = jnp.asarray(x)
    _validate(x, fmt, granularity, name)
    check_finite(x, name)
    if scale is not None:
        if granularity != "tensor":
            raise NVFP4ToolError(f"tensor '{name}': a static FP8 scale needs granularity 'tensor', got {granularity!r}")
        scale = check_scale_scalar(scale, "static FP8 scale", name, positive=True)
    out_dtype = jnp.dtype(x.dtype if dtype is None else dtype)
    return _fake_quantize(x, scale, fmt=fmt, granularity=granularity, dtype=out_dtype)


DYNAMIC_EPS = 1e-10  # vLLM per_token_group_quant_fp8's eps: the amax floor of a dynamic group scale


def fake_quantize_fp8_token_groups(
    x: jax.Array | np.ndarray, *, dtype: jnp.dtype | None = None, name: str = "tensor"
) -> jax.Array:
    """x as an engine's dynamic per-token-group E4M3 quantization leaves it (vLLM's
    `per_token_group_quant_fp8`, group 128, no power-of-two scale rounding): per row of the last
    axis and 128 columns, s = fl(max(amax, 1e-10) / 448), x~ = fp32(e4m3(clamp(x / s))) * s.
    The last axis must be a multiple of 128 (vLLM asserts it); NVFP4ToolError otherwise."""
    x = jnp.asarray(x)
    _validate(x, "e4m3", "block128", name)
    if x.shape[-1] % FP8_BLOCK:
        raise NVFP4ToolError(
            f"tensor '{name}' shape {tuple(x.shape)}: dynamic FP8 group quantization needs the last axis "
            f"a multiple of {FP8_BLOCK}"
        )
    check_finite(x, name)
    return _fake_quantize_groups(x, dtype=jnp.dtype(x.dtype if dtype is None else dtype))


def fp8_decode_scale(amax: jax.Array | float, fmt: Fmt = "e4m3") -> jax.Array:
    """fp32 decode scale amax / fmt_max (flushed); 1 where that is 0 (all-zero input)."""
    scale = flush_subnormal(exact_divide(jnp.asarray(amax, jnp.float32), jnp.float32(FP8_MAX[fmt])))
    return jnp.where(scale == 0, jnp.float32(1.0), scale)


# ------------------------------------------------------------------------------------------
# helpers


def _validate(x: jax.Array, fmt: str, granularity: str, name: str) -> None:
    if fmt not in _FP8_DTYPES:
        raise NVFP4ToolError(f"tensor '{name}': fmt must be 'e4m3' or 'e5m2', got {fmt!r}")
    if granularity not in ("tensor", "channel", "block128", "block128x128"):
        raise NVFP4ToolError(f"tensor '{name}': unknown FP8 granularity {granularity!r}")
    if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise NVFP4ToolError(f"tensor '{name}': dtype {x.dtype} cannot be quantized to FP8")
    min_ndim = 2 if granularity in ("channel", "block128x128") else 1
    if x.ndim < min_ndim:
        raise NVFP4ToolError(
            f"tensor '{name}' shape {tuple(x.shape)}: granularity {granularity!r} needs a {min_ndim}-D or larger input"
        )


def _tile(granularity: str, shape: tuple[int, ...]) -> tuple[int, int]:
    """(tile_rows, tile_cols) of a granularity for an input of `shape` (K last)."""
    return {"channel": (1, shape[-1]), "block128": (1, FP8_BLOCK), "block128x128": (FP8_BLOCK, FP8_BLOCK)}[granularity]


def _scale_per_element(scale: jax.Array, granularity: str, shape: tuple[int, ...]) -> jax.Array:
    if granularity == "tensor":
        return scale
    return expand_tiles(scale, *_tile(granularity, shape), shape)


def _encode(
    x: jax.Array, fmt: str, granularity: str, scale: jax.Array | None = None, eps: float | None = None
) -> tuple[jax.Array, jax.Array]:
    """(fp8 data, decode scale) for x; the scale from the amax unless a static one is given
    (`eps`: the amax floored at eps, as a dynamic engine quantizer does, instead of 1 for 0)."""
    x32 = flush_subnormal(x.astype(jnp.float32))
    if scale is None:
        abs_x = jnp.abs(x32)
        if granularity == "tensor":
            amax = abs_x.max()
        else:
            amax = tile_amax(abs_x, *_tile(granularity, x.shape))
        if eps is None:
            scale = fp8_decode_scale(amax, fmt)
        else:
            scale = flush_subnormal(exact_divide(jnp.maximum(amax, jnp.float32(eps)), jnp.float32(FP8_MAX[fmt])))
    fmt_max = jnp.float32(FP8_MAX[fmt])
    scaled = exact_divide(x32, _scale_per_element(scale, granularity, x.shape))
    data = jnp.clip(scaled, -fmt_max, fmt_max).astype(_FP8_DTYPES[fmt])
    return data, scale


def _decode(data: jax.Array, scale: jax.Array, granularity: str) -> jax.Array:
    return times_decode_scale(data, _scale_per_element(scale, granularity, data.shape))


@functools.partial(jax.jit, static_argnames=("fmt", "granularity"))
def _quantize(x, *, fmt, granularity):
    return _encode(x, fmt, granularity)


@functools.partial(jax.jit, static_argnames=("granularity", "dtype"))
def _dequantize(data, scale, *, granularity, dtype):
    return _decode(data, scale, granularity).astype(dtype)


@functools.partial(jax.jit, static_argnames=("fmt", "granularity", "dtype"))
def _fake_quantize(x, scale, *, fmt, granularity, dtype):
    return _decode(*_encode(x, fmt, granularity, scale), granularity).astype(dtype)


@functools.partial(jax.jit, static_argnames=("dtype",))
def _fake_quantize_groups(x, *, dtype):
    return _decode(*_encode(x, "e4m3", "block128", eps=DYNAMIC_EPS), "block128").astype(dtype)
