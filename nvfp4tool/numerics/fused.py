"""Fused NVFP4 quantizers as Pallas kernels: one read of the input, the consumer's output written.

`fused_quantize(x_RxK, global_amax, ...)` quantizes a 2-D matrix along its last axis (or, with
`transpose=True`, along its first) exactly as `quantize_nvfp4` does, in one kernel: 1d or 2d
blocks, RNE or stochastic rounding, optional RHT; `mode` "packed" or "operand". CPU: interpret mode.
Design notes: docs/design/numerics.md.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.numerics.blocks import (
    check_finite,
    check_scale_scalar,
    flush_subnormal,
    without_xla_barriers,
)
from nvfp4tool.numerics.constants import NVFP4_BLOCK
from nvfp4tool.numerics.hadamard import rht16_last_axis, rht_matrix
from nvfp4tool.numerics.nvfp4 import (
    Block,
    NVFP4Array,
    NVFP4Operand,
    Rounding,
    check_nvfp4_args,
    decode_nvfp4_blocks,
    encode_nvfp4_blocks,
    nvfp4_block_amax,
    nvfp4_block_scales,
    nvfp4_global_scales,
    pack_codes,
)

Mode = Literal["packed", "operand"]

_TILE_ROWS = 32  # rows of the quantized operand per kernel instance (a multiple of 16)


def fused_quantize(
    x: jax.Array,
    global_amax: jax.Array | float,
    *,
    mode: Mode = "packed",
    rounding: Rounding = "rne",
    bits: jax.Array | None = None,
    block: Block = "1d",
    rht: bool = False,
    transpose: bool = False,
    interpret: bool | None = None,
    name: str = "tensor",
) -> NVFP4Array | NVFP4Operand:
    """Quantize the 2-D `x` (or x.T when `transpose`) along its last axis in one Pallas kernel.

    Returns an `NVFP4Array` (mode "packed") or an `NVFP4Operand` (mode "operand"), equal bit for
    bit to `quantize_nvfp4` (or `nvfp4_operand`) of op with the same block=, global_amax=,
    rounding=, key=, where op = rht16(x or x.T) or x or x.T, when
    `bits == stochastic_bits(key, op.shape)`.
    `interpret=None`: interpret mode on the CPU backend, compiled elsewhere. Bad options, shapes,
    bits, or a concrete non-finite `x`: NVFP4ToolError naming `name`.
    """
    x = jnp.asarray(x)
    op_shape = _check(x, mode, rounding, bits, block, transpose, name)
    check_finite(x, name)
    gamax = check_scale_scalar(global_amax, "global_amax", name)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    outs = _fused_call(
        x,
        gamax.reshape(1),
        bits,
        mode=mode,
        rounding=rounding,
        block=block,
        rht=rht,
        transpose=transpose,
        interpret=interpret,
    )
    if mode == "operand":
        return NVFP4Operand(values=outs, s_dec=nvfp4_global_scales(gamax)[1], axis=1)
    packed, scales = outs
    return NVFP4Array(
        packed=packed, scales=scales, global_amax=gamax, shape=op_shape, dtype=jnp.dtype(x.dtype), axis=1, block=block
    )


# ------------------------------------------------------------------------------------------
# helpers


def _check(
    x: jax.Array, mode: str, rounding: str, bits: jax.Array | None, block: str, transpose: bool, name: str
) -> tuple[int, int]:
    """Validate the options; return the quantized operand's shape (x's, or x.T's)."""
    if x.ndim != 2:
        raise NVFP4ToolError(
            f"tensor '{name}' shape {tuple(x.shape)}: the fused quantizers take a 2-D matrix (flatten batch axes first)"
        )
    check_nvfp4_args(x, 0 if transpose else 1, block, "rne", None, name)
    op_shape = (x.shape[1], x.shape[0]) if transpose else tuple(x.shape)
    if mode not in ("packed", "operand"):
        raise NVFP4ToolError(f"tensor '{name}': mode must be 'packed' or 'operand', got {mode!r}")
    if rounding not in ("rne", "stochastic"):
        raise NVFP4ToolError(f"tensor '{name}': rounding must be 'rne' or 'stochastic', got {rounding!r}")
    if rounding == "stochastic":
        if bits is None or bits.dtype != jnp.uint32 or tuple(bits.shape) != op_shape:
            got = "none" if bits is None else f"{bits.dtype} {tuple(bits.shape)}"
            raise NVFP4ToolError(
                f"tensor '{name}': stochastic rounding needs uint32 bits of the "
                f"quantized operand's shape {op_shape}, got {got}"
            )
    elif bits is not None:
        raise NVFP4ToolError(f"tensor '{name}': random bits given without stochastic rounding")
    return op_shape


def _tile_cols(k: int) -> int:
    """The largest of 256, 128, ..., 16 that divides K (a multiple of 16)."""
    cols = 256
    while k % cols:
        cols //= 2
    return cols


@functools.partial(jax.jit, static_argnames=("mode", "rounding", "block", "rht", "transpose", "interpret"))
def _fused_call(x, gamax_1, bits, *, mode, rounding, block, rht, transpose, interpret):
    """Build and run the pallas_call for one configuration."""
    rows, k = (x.shape[1], x.shape[0]) if transpose else x.shape
    tile_rows, tile_cols = _TILE_ROWS, _tile_cols(k)
    grid = (pl.cdiv(rows, tile_rows), k // tile_cols)
    op_tile = pl.BlockSpec((tile_rows, tile_cols), lambda i, j: (i, j))
    in_specs = [
        pl.BlockSpec((1,), lambda i, j: (0,)),
        pl.BlockSpec((tile_cols, tile_rows), lambda i, j: (j, i)) if transpose else op_tile,
    ]
    inputs = [gamax_1, x]
    if rht:
        in_specs.append(pl.BlockSpec((16, 16), lambda i, j: (0, 0)))
        inputs.append(rht_matrix())
    if rounding == "stochastic":
        in_specs.append(op_tile)
        inputs.append(bits)
    if mode == "operand":
        out_shape = jax.ShapeDtypeStruct((rows, k), jnp.bfloat16)
        out_specs = op_tile
    else:
        out_shape = (
            jax.ShapeDtypeStruct((rows, k // 2), jnp.uint8),
            jax.ShapeDtypeStruct((rows, k // NVFP4_BLOCK), jnp.float8_e4m3fn),
        )
        out_specs = (
            pl.BlockSpec((tile_rows, tile_cols // 2), lambda i, j: (i, j)),
            pl.BlockSpec((tile_rows, tile_cols // NVFP4_BLOCK), lambda i, j: (i, j)),
        )
    kernel = functools.partial(
        _kernel, xla=interpret, n_rows=rows, mode=mode, rounding=rounding, block=block, rht=rht, transpose=transpose
    )
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(),
    )(*inputs)


def _kernel(*refs, xla, **options):
    """The tile body, traced with the XLA guards when XLA compiles it (interpret mode) and
    without them for the Triton lowering (which has no barrier and no rewrites to guard against)."""
    with contextlib.nullcontext() if xla else without_xla_barriers():
        _tile(*refs, **options)


def _tile(gamax_ref, x_ref, *refs, n_rows, mode, rounding, block, rht, transpose):
    """One tile: [rows, cols] of the quantized operand, cols a whole number of 16-blocks."""
    refs = list(refs)
    h_ref = refs.pop(0) if rht else None
    bits_ref = refs.pop(0) if rounding == "stochastic" else None
    x_RxC = x_ref[...].T if transpose else x_ref[...]
    if rht:
        x_RxC = rht16_last_axis(x_RxC, h_ref[...])  # rounded to x's dtype, as rht16 returns it
    tile_rows, tile_cols = x_RxC.shape
    row = pl.program_id(0) * tile_rows + jax.lax.broadcasted_iota(jnp.int32, x_RxC.shape, 0)
    # Rows past the end of a ragged last tile hold unspecified values: zero them (a zero cannot
    # raise a 2d tile's max of |x|; their outputs are dropped).
    x32_RxC = jnp.where(row < n_rows, flush_subnormal(x_RxC.astype(jnp.float32)), 0.0)
    s_enc, s_dec = nvfp4_global_scales(gamax_ref[0])
    scales_RxB = nvfp4_block_scales(nvfp4_block_amax(x32_RxC, block), s_enc)
    blocks_RxBx16 = x32_RxC.reshape(tile_rows, tile_cols // NVFP4_BLOCK, NVFP4_BLOCK)
    bits_RxBx16 = None if bits_ref is None else bits_ref[...].reshape(blocks_RxBx16.shape)
    codes_RxBx16, values_RxBx16 = encode_nvfp4_blocks(
        blocks_RxBx16, scales_RxB, s_dec, rounding=rounding, bits=bits_RxBx16
    )
    if mode == "operand":
        # S_dec = 1: the product of code value and block scale, which the GEMM scales after.
        operand = decode_nvfp4_blocks(values_RxBx16, scales_RxB, jnp.float32(1.0))
        refs[0][...] = operand.reshape(tile_rows, tile_cols).astype(jnp.bfloat16)
    else:
        packed_ref, scales_ref = refs
        packed_ref[...] = pack_codes(codes_RxBx16.reshape(tile_rows, tile_cols))
        scales_ref[...] = scales_RxB
