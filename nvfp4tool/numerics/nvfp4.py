"""NVFP4 quantize / dequantize / pack / fake-quantize, bit-exact to TE's reference formulas.

In IEEE fp32 with RNE: S_enc = 2688 / gamax, S_dec = 1 / S_enc; one E4M3 scale per 16 elements
along K (K a multiple of 16); x~ = (e2m1(code) * fp32(scale)) * S_dec. Entry points:
`quantize_nvfp4`, `dequantize_nvfp4`, `fake_quantize_nvfp4`, `nvfp4_operand`, `decode_nvfp4`.
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
    flush_subnormal,
    normalize_axis,
    tensor_amax,
    tile_amax,
    times_decode_scale,
    xla_barrier,
)
from nvfp4tool.numerics.constants import (
    E2M1_MAGNITUDES,
    E2M1_MAX,
    E2M1_MIDPOINTS,
    E2M1_SIGN_BIT,
    E2M1_TIE_ROUNDS_UP,
    E4M3_MAX,
    FLT_MAX,
    NVFP4_BLOCK,
    NVFP4_GLOBAL_RANGE,
)

Block = Literal["1d", "2d"]
Rounding = Literal["rne", "stochastic"]


@dataclasses.dataclass(frozen=True)
class NVFP4Array:
    """A tensor in NVFP4: packed E2M1 codes, E4M3 block scales, fp32 global amax (a pytree).

    packed      uint8, like the input but K/2 along `axis` (two codes per byte, low nibble first)
    scales      float8_e4m3fn, like the input but K/16 along `axis` (2d: tile scale per 1x16 slot)
    global_amax float32 scalar: the amax the global scale was derived from (S_enc = 2688 / it)
    shape, dtype, axis, block: static metadata (original shape and dtype, quantized axis >= 0)
    """

    packed: jax.Array
    scales: jax.Array
    global_amax: jax.Array
    shape: tuple[int, ...]
    dtype: np.dtype
    axis: int
    block: str = "1d"


jax.tree_util.register_dataclass(
    NVFP4Array,
    data_fields=["packed", "scales", "global_amax"],
    meta_fields=["shape", "dtype", "axis", "block"],
)


@dataclasses.dataclass(frozen=True)
class NVFP4Operand:
    """What the emulated NVFP4 GEMM consumes (a pytree; nothing packed):

    values  bfloat16, the input's shape: e2m1(code) * e4m3(block scale), exact, WITHOUT S_dec
    s_dec   float32 scalar: the global decode factor, applied to the GEMM's fp32 result
    axis    static: the quantized axis (>= 0)
    """

    values: jax.Array
    s_dec: jax.Array
    axis: int


jax.tree_util.register_dataclass(NVFP4Operand, data_fields=["values", "s_dec"], meta_fields=["axis"])


def quantize_nvfp4(
    x: jax.Array | np.ndarray,
    *,
    axis: int = -1,
    block: Block = "1d",
    global_amax: jax.Array | float | None = None,
    rounding: Rounding = "rne",
    key: jax.Array | None = None,
    name: str = "tensor",
) -> NVFP4Array:
    """Quantize `x` (fp32/bf16/fp16, numpy or jax) to NVFP4 along `axis`.

    `global_amax` given = the shared amax of a fused group (else max|x|). `rounding="stochastic"`
    needs a `jax.random` key; the scales are the same as with RNE. `name` is used in errors.
    """
    x, axis, global_amax = _prepare(x, axis, block, global_amax, rounding, key, name)
    packed, scales, gamax = _quantize_packed(x, global_amax, key, axis=axis, block=block, rounding=rounding)
    return NVFP4Array(
        packed=packed,
        scales=scales,
        global_amax=gamax,
        shape=tuple(x.shape),
        dtype=jnp.dtype(x.dtype),
        axis=axis,
        block=block,
    )


def dequantize_nvfp4(q: NVFP4Array, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """Decode `q`: e2m1(code) * fp32(block_scale) * S_dec, computed in fp32, cast to `dtype`."""
    _, s_dec = nvfp4_global_scales(q.global_amax)
    return decode_nvfp4(q.packed, q.scales, s_dec, axis=q.axis, dtype=dtype)


def fake_quantize_nvfp4(
    x: jax.Array | np.ndarray,
    *,
    axis: int = -1,
    block: Block = "1d",
    global_amax: jax.Array | float | None = None,
    rounding: Rounding = "rne",
    key: jax.Array | None = None,
    dtype: jnp.dtype | None = None,
    name: str = "tensor",
) -> jax.Array:
    """Quantize-dequantize in one fused pass without packing (for training).

    Equal bit for bit to `dequantize_nvfp4(quantize_nvfp4(x, ...), dtype)`; `dtype` defaults to
    x's dtype. No gradient is defined here (rounding has zero derivative): recipes wrap it.
    """
    x, axis, global_amax = _prepare(x, axis, block, global_amax, rounding, key, name)
    out_dtype = jnp.dtype(x.dtype if dtype is None else dtype)
    return _fake_quantize(x, global_amax, key, axis=axis, block=block, rounding=rounding, dtype=out_dtype)


def nvfp4_operand(
    x: jax.Array | np.ndarray,
    *,
    axis: int = -1,
    block: Block = "1d",
    global_amax: jax.Array | float | None = None,
    rounding: Rounding = "rne",
    key: jax.Array | None = None,
    name: str = "tensor",
) -> NVFP4Operand:
    """The emulated GEMM's operand of `x` (see the module docstring): quantized exactly as
    `quantize_nvfp4(x, ...)` (same arguments), not packed; `values` equal
    `decode_nvfp4(q.packed, q.scales, 1.0, axis=, dtype=bfloat16)` of that quantization bit for
    bit, and `s_dec` is its S_dec. No gradient is defined here: recipes wrap it."""
    x, axis, global_amax = _prepare(x, axis, block, global_amax, rounding, key, name)
    values, s_dec = _operand(x, global_amax, key, axis=axis, block=block, rounding=rounding)
    return NVFP4Operand(values=values, s_dec=s_dec, axis=axis)


def transpose_2d(q: NVFP4Array | NVFP4Operand) -> NVFP4Array | NVFP4Operand:
    """The quantization of W.T [K, N] along N from the 16x16 (block "2d") quantization `q` of a
    matrix W [N, K] along K: a 16x16 tile has one amax whichever way it is read, so W.T's tiles
    have the same scales and every element the same code (the recipe's dgrad weight operand is the
    fprop one transposed, bit for bit). N must be a multiple of 16. An `NVFP4Operand` carries no
    block: the caller vouches that it was quantized with block "2d"."""
    if isinstance(q, NVFP4Operand):
        if q.values.ndim != 2 or q.axis != 1:
            raise NVFP4ToolError(
                f"transpose_2d: expected a [N, K] operand along K, got shape {tuple(q.values.shape)} axis {q.axis}"
            )
        return NVFP4Operand(values=q.values.T, s_dec=q.s_dec, axis=1)
    if q.block != "2d" or len(q.shape) != 2 or q.axis != 1 or q.shape[0] % NVFP4_BLOCK != 0:
        raise NVFP4ToolError(
            f"transpose_2d: expected a 16x16-scaled [N, K] array along K with N a "
            f"multiple of {NVFP4_BLOCK}, got shape {q.shape} axis {q.axis} block {q.block}"
        )
    n, k = q.shape
    packed = pack_codes(unpack_codes(q.packed).T)  # [K, N/2]
    # each 1x16 slot of a tile holds the tile's scale: one row per tile, transposed, repeated
    scales = jnp.repeat(q.scales[::NVFP4_BLOCK].T, NVFP4_BLOCK, axis=0)  # [K, N/16]
    return NVFP4Array(
        packed=packed, scales=scales, global_amax=q.global_amax, shape=(k, n), dtype=q.dtype, axis=1, block="2d"
    )


def nvfp4_global_scales(global_amax: jax.Array | float) -> tuple[jax.Array, jax.Array]:
    """(S_enc, S_dec) in fp32 for a tensor or fused-group amax: 2688 / amax and 1 / S_enc."""
    gamax = flush_subnormal(jnp.asarray(global_amax, jnp.float32))
    s_enc = exact_divide(jnp.float32(NVFP4_GLOBAL_RANGE), gamax)
    s_enc = jnp.minimum(s_enc, FLT_MAX)
    s_enc = jnp.where((gamax == 0) | (s_enc == 0), jnp.float32(1.0), s_enc)
    s_dec = flush_subnormal(exact_divide(jnp.float32(1.0), s_enc))
    return s_enc, s_dec


def decode_e2m1(codes: jax.Array) -> jax.Array:
    """fp32 value of uint8 codes 0..15 (bit 3 = sign; code 8 gives -0.0)."""
    magnitude = _e2m1_magnitude(codes & 0x7)
    return jnp.where((codes & E2M1_SIGN_BIT) != 0, -magnitude, magnitude)


def pack_codes(codes: jax.Array) -> jax.Array:
    """uint8 codes [..., K] (values 0..15) -> bytes [..., K/2]: code[2i] | code[2i+1] << 4."""
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    # A sum over the pair axis of code << 0 and code << 4 (max 15 + 15 * 16 = 255: no overflow)
    # instead of two strided slices: XLA would otherwise recompute the whole fused encoder once
    # per slice. The shifts come from an iota, not an array constant, so a Pallas kernel can call
    # this too (kernels cannot capture constants).
    shift = jax.lax.broadcasted_iota(jnp.uint8, pairs.shape, pairs.ndim - 1) * jnp.uint8(4)
    return (pairs << shift).sum(axis=-1, dtype=jnp.uint8)


def unpack_codes(packed: jax.Array) -> jax.Array:
    """bytes [..., K/2] -> uint8 codes [..., K] (inverse of `pack_codes`)."""
    pairs = jnp.stack([packed & 0xF, packed >> 4], axis=-1)
    return pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def nvfp4_block_amax(x_K: jax.Array, block: Block = "1d") -> jax.Array:
    """max|x| per 1x16 block along the last axis, [..., K/16], of fp32 `x_K` [..., K].

    block="2d": the max of the 16x16 tile (16 rows of the second-to-last axis x 16 along K),
    written into each of the tile's 1x16 slots; ragged edge tiles use the rows that exist.
    """
    if block == "2d":
        bamax = tile_amax(jnp.abs(x_K), NVFP4_BLOCK, NVFP4_BLOCK)
        return jnp.repeat(bamax, NVFP4_BLOCK, axis=-2)[..., : x_K.shape[-2], :]
    return jnp.abs(_blocks(x_K)).max(axis=-1)


def nvfp4_block_scales(block_amax: jax.Array, s_enc: jax.Array, *, block_max: float = E2M1_MAX) -> jax.Array:
    """E4M3 block scales mapping each block amax to `block_max`: e4m3(clamp(amax * (S_enc * r)))

    with r = fp32(1 / block_max) (TE >= 2.15 product order; fp32(1/6) for the standard 6, 0.25 for
    the "4" candidate of 4over6). min(sdb, FLT_MAX) is subsumed by the clamp to [0, 448].
    """
    sdb = block_amax * (s_enc * np.float32(1.0 / block_max))
    return jnp.clip(sdb, 0.0, E4M3_MAX).astype(jnp.float8_e4m3fn)  # clamp first: >448 is NaN


def encode_nvfp4_blocks(
    x_Bx16: jax.Array,
    scales: jax.Array,
    s_dec: jax.Array,
    *,
    rounding: Rounding = "rne",
    key: jax.Array | None = None,
    bits: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The one E2M1 encoder: fp32 blocks [..., K/16, 16] against given E4M3 scales [..., K/16].

    enc = min(1 / (fp32(scale) * S_dec), FLT_MAX); code = e2m1(x * enc), RNE (or stochastic)
    saturating at 6, sign bit = sign bit of x. Returns (uint8 codes 0..15, their signed fp32
    values, -0.0 for code 8); XLA drops whichever the caller does not use. Stochastic rounding
    consumes uint32 `bits` shaped like `x_Bx16`, drawn from `key` by `stochastic_bits` when not
    given (a kernel that works on tiles is handed its tile of the same draw). Traced callers
    only: no checks (x finite and flushed, see the module docstring).
    """
    denom = flush_subnormal(scales.astype(jnp.float32) * s_dec)
    enc = jnp.minimum(exact_divide(jnp.float32(1.0), denom), FLT_MAX)  # 1/0 = inf -> FLT_MAX
    # Materialize the per-block values: fused into the per-element loop, XLA would redo the
    # (slow on CPU) E4M3 conversion for each of the 16 elements of a block.
    scales, enc = xla_barrier((scales, enc))
    abs_y = jnp.abs(x_Bx16 * enc[..., None])
    if rounding == "rne":
        index, magnitude = _e2m1_rne(abs_y)
    else:
        bits = stochastic_bits(key, x_Bx16.shape) if bits is None else bits
        index, magnitude = _e2m1_stochastic(abs_y, bits)
    sign = jnp.signbit(x_Bx16)
    codes = index | jnp.where(sign, jnp.uint8(E2M1_SIGN_BIT), jnp.uint8(0))
    return codes, jnp.where(sign, -magnitude, magnitude)


def stochastic_bits(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """The uint32 random bits stochastic rounding consumes, one per element of `shape`.

    The draw does not depend on how `shape` is blocked: the bits of [..., K] reshaped to
    [..., K/16, 16] are the bits of [..., K/16, 16] (jax's default partitionable threefry draws
    each element from its flat index), so a fused kernel can be handed `stochastic_bits(key,
    [..., K])` and match the keyed XLA path bit for bit.
    """
    return jax.random.bits(key, shape, jnp.uint32)


def decode_nvfp4_blocks(values_Bx16: jax.Array, scales: jax.Array, s_dec: jax.Array) -> jax.Array:
    """The one decode product: (e2m1 value * fp32(block scale)) * S_dec in fp32, in this order,
    subnormals flushed; values [..., K/16, 16], scales [..., K/16] -> fp32 [..., K/16, 16]."""
    scale32 = xla_barrier(scales.astype(jnp.float32))  # convert once per block
    return times_decode_scale(values_Bx16 * scale32[..., None], s_dec)


def nvfp4_block_products(packed: jax.Array, scales: jax.Array) -> jax.Array:
    """The decode before its global scale, e2m1(code) * fp32(block scale), held in BFloat16: packed
    uint8 [..., K/2], scales float8_e4m3fn [..., K/16] -> bfloat16 [..., K]. Exact: a product has
    at most 2 + 4 significant bits and lies in [2^-10, 2688] (or is 0, or a NaN scale's NaN), so
    `times_decode_scale(products, S_dec)` is `decode_nvfp4`'s fp32 result bit for bit, in half
    its memory."""
    values_Bx16 = decode_e2m1(_blocks(unpack_codes(packed)))
    products = values_Bx16 * xla_barrier(scales.astype(jnp.float32))[..., None]
    return _unblock(products).astype(jnp.bfloat16)


def decode_nvfp4(
    packed: jax.Array | np.ndarray,
    scales: jax.Array | np.ndarray,
    s_dec: jax.Array | float,
    *,
    axis: int = -1,
    dtype: jnp.dtype = jnp.float32,
    name: str = "tensor",
) -> jax.Array:
    """Decode stored NVFP4 bytes with a stored global decode scale (what a serving engine reads):

    packed uint8 [..., K/2 at axis], scales float8_e4m3fn [..., K/16 at axis], S_dec fp32 scalar;
    returns `e2m1(code) * fp32(scale) * S_dec` as `dtype`. `dequantize_nvfp4` is this with
    S_dec derived from the record's global amax. Wrong dtypes or shapes: NVFP4ToolError naming
    `name`.
    """
    packed, scales = jnp.asarray(packed), jnp.asarray(scales)
    axis = normalize_axis(axis, packed.ndim, name)
    expected = (*packed.shape[:axis], packed.shape[axis] * 2 // NVFP4_BLOCK, *packed.shape[axis + 1 :])
    if packed.dtype != jnp.uint8 or scales.dtype != jnp.float8_e4m3fn:
        raise NVFP4ToolError(
            f"tensor '{name}': NVFP4 needs uint8 codes and float8_e4m3fn scales, got {packed.dtype} and {scales.dtype}"
        )
    if packed.shape[axis] % (NVFP4_BLOCK // 2) != 0 or tuple(scales.shape) != expected:
        raise NVFP4ToolError(
            f"tensor '{name}': codes {tuple(packed.shape)} need scales "
            f"{expected} (one per 16 elements along axis {axis}), "
            f"got {tuple(scales.shape)}"
        )
    return _decode(packed, scales, jnp.asarray(s_dec, jnp.float32), axis=axis, dtype=jnp.dtype(dtype))


def check_nvfp4_args(x: jax.Array, axis: int, block: str, rounding: str, key: jax.Array | None, name: str) -> int:
    """The quantizers' argument checks (dtype, shape, axis, block, rounding, key): NVFP4ToolError
    naming `name`, else the non-negative axis. Values are not looked at (see `check_finite`)."""
    if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise NVFP4ToolError(
            f"tensor '{name}': dtype {x.dtype} cannot be quantized to NVFP4 (expected float32, bfloat16 or float16)"
        )
    if x.ndim == 0:
        raise NVFP4ToolError(f"tensor '{name}': a scalar cannot be quantized to NVFP4")
    axis = normalize_axis(axis, x.ndim, name)
    if x.shape[axis] % NVFP4_BLOCK != 0:
        raise NVFP4ToolError(
            f"tensor '{name}' shape {tuple(x.shape)}: length {x.shape[axis]} of axis {axis} is "
            f"not a multiple of {NVFP4_BLOCK} (NVFP4 blocks are never padded)"
        )
    if block not in ("1d", "2d"):
        raise NVFP4ToolError(f"tensor '{name}': block must be '1d' or '2d', got {block!r}")
    if block == "2d" and x.ndim < 2:
        raise NVFP4ToolError(f"tensor '{name}' shape {tuple(x.shape)}: 2d (16x16) scaling needs at least 2 axes")
    if rounding not in ("rne", "stochastic"):
        raise NVFP4ToolError(f"tensor '{name}': rounding must be 'rne' or 'stochastic', got {rounding!r}")
    if rounding == "stochastic" and key is None:
        raise NVFP4ToolError(f"tensor '{name}': stochastic rounding needs a jax.random key")
    return axis


# ------------------------------------------------------------------------------------------
# helpers


def _prepare(
    x, axis: int, block: str, global_amax, rounding: str, key: jax.Array | None, name: str
) -> tuple[jax.Array, int, jax.Array | None]:
    """Validate the public arguments; (x as a jax array, axis >= 0, global_amax as fp32 or None)."""
    x = jnp.asarray(x)
    axis = check_nvfp4_args(x, axis, block, rounding, key, name)
    check_finite(x, name)
    if global_amax is not None:
        global_amax = check_scale_scalar(global_amax, "global_amax", name)
    return x, axis, global_amax


def _encode(
    x: jax.Array, global_amax: jax.Array | None, key: jax.Array | None, *, axis: int, block: str, rounding: str
):
    """Shared core with K moved last: (codes, values, scales e4m3, S_dec, gamax).

    codes (uint8 with sign bit) and values (their signed fp32 E2M1 value) are blocked
    [..., K/16, 16]; scales [..., K/16].
    """
    x_K = flush_subnormal(jnp.moveaxis(x, axis, -1).astype(jnp.float32))
    gamax = tensor_amax(x_K) if global_amax is None else global_amax
    gamax = flush_subnormal(gamax.astype(jnp.float32))
    s_enc, s_dec = nvfp4_global_scales(gamax)
    scales = nvfp4_block_scales(nvfp4_block_amax(x_K, block), s_enc)
    codes, values = encode_nvfp4_blocks(_blocks(x_K), scales, s_dec, rounding=rounding, key=key)
    return codes, values, scales, s_dec, gamax


def _e2m1_rne(abs_y: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(index 0..7, fp32 magnitude) of E2M1 RNE of |y| (saturating at 6), by midpoint thresholds.

    Both come from the same comparisons; XLA drops whichever the caller does not use (the
    magnitude as a sum of exact steps is cheaper than mapping the index back through a table).
    """
    index = jnp.zeros(abs_y.shape, jnp.uint8)
    magnitude = jnp.zeros(abs_y.shape, jnp.float32)
    steps = np.diff(np.asarray(E2M1_MAGNITUDES, np.float32))  # 0.5, 0.5, 0.5, 0.5, 1, 1, 2
    for midpoint, tie_up, step in zip(E2M1_MIDPOINTS, E2M1_TIE_ROUNDS_UP, steps):
        above = abs_y >= midpoint if tie_up else abs_y > midpoint
        index = index + above.astype(jnp.uint8)
        magnitude = magnitude + jnp.where(above, step, jnp.float32(0.0))
    return index, magnitude


def _e2m1_stochastic(abs_y: jax.Array, bits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(index, magnitude): |y| rounds up with probability (|y| - lo) / (hi - lo); saturates at 6.

    `bits`: uint32 random bits shaped like `abs_y` (`stochastic_bits`)."""
    abs_y = jnp.minimum(abs_y, E2M1_MAX)
    lower = jnp.zeros(abs_y.shape, jnp.uint8)
    for value in E2M1_MAGNITUDES[1:]:
        lower = lower + (abs_y >= value).astype(jnp.uint8)
    lo = _e2m1_magnitude(lower)
    hi = _e2m1_magnitude(jnp.minimum(lower + 1, len(E2M1_MAGNITUDES) - 1).astype(jnp.uint8))
    gap = hi - lo
    p_up = jnp.where(gap > 0, (abs_y - lo) / jnp.where(gap > 0, gap, 1.0), 0.0)
    # u uniform on [0, 1) in steps of 2^-24 from the top 24 random bits (exact in fp32); cheaper
    # than jax.random.uniform on CPU. P(round up) = p_up to within 2^-24.
    u = (bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)
    up = u < p_up
    return lower + up.astype(jnp.uint8), jnp.where(up, hi, lo)


def _e2m1_magnitude(index: jax.Array) -> jax.Array:
    """fp32 magnitude of index 0..7 (a select chain: XLA:CPU gathers from a table are slow)."""
    magnitude = jnp.zeros(index.shape, jnp.float32)
    for i, value in enumerate(E2M1_MAGNITUDES[1:], start=1):
        magnitude = jnp.where(index == i, jnp.float32(value), magnitude)
    return magnitude


@functools.partial(jax.jit, static_argnames=("axis", "block", "rounding"))
def _quantize_packed(x, global_amax, key, *, axis, block, rounding):
    """Quantize and pack; outputs with K (halved / sixteenth) back at `axis`."""
    codes_Bx16, _, scales_K, _, gamax = _encode(x, global_amax, key, axis=axis, block=block, rounding=rounding)
    codes_K = codes_Bx16.reshape(*codes_Bx16.shape[:-2], -1)
    packed = jnp.moveaxis(pack_codes(codes_K), -1, axis)
    return packed, jnp.moveaxis(scales_K, -1, axis), gamax


@functools.partial(jax.jit, static_argnames=("axis", "block", "rounding", "dtype"))
def _fake_quantize(x, global_amax, key, *, axis, block, rounding, dtype):
    """Quantize-dequantize without packing; the same decode product as `decode_nvfp4`."""
    _, values_Bx16, scales_K, s_dec, _ = _encode(x, global_amax, key, axis=axis, block=block, rounding=rounding)
    out_K = _unblock(decode_nvfp4_blocks(values_Bx16, scales_K, s_dec))
    return jnp.moveaxis(out_K, -1, axis).astype(dtype)


@functools.partial(jax.jit, static_argnames=("axis", "block", "rounding"))
def _operand(x, global_amax, key, *, axis, block, rounding):
    """(bf16 e2m1 value * block scale without S_dec, S_dec): the decode product at S_dec = 1."""
    _, values_Bx16, scales_K, s_dec, _ = _encode(x, global_amax, key, axis=axis, block=block, rounding=rounding)
    out_K = _unblock(decode_nvfp4_blocks(values_Bx16, scales_K, jnp.float32(1.0)))
    return jnp.moveaxis(out_K, -1, axis).astype(jnp.bfloat16), s_dec


@functools.partial(jax.jit, static_argnames=("axis", "dtype"))
def _decode(packed, scales, s_dec, *, axis, dtype):
    codes_K = unpack_codes(jnp.moveaxis(packed, axis, -1))
    values_Bx16 = decode_e2m1(_blocks(codes_K))
    out_K = _unblock(decode_nvfp4_blocks(values_Bx16, jnp.moveaxis(scales, axis, -1), s_dec))
    return jnp.moveaxis(out_K, -1, axis).astype(dtype)


def _blocks(x_K: jax.Array) -> jax.Array:
    """[..., K] -> [..., K/16, 16]."""
    return x_K.reshape(*x_K.shape[:-1], x_K.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK)


def _unblock(x_Bx16: jax.Array) -> jax.Array:
    """[..., K/16, 16] -> [..., K]."""
    return x_Bx16.reshape(*x_Bx16.shape[:-2], -1)
