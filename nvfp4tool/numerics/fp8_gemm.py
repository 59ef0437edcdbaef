"""FP8 x FP8 matrix product `a @ b.T` with BF16 operands and fp32 accumulation (emulation).

FP8 values are exact in bf16 and their products exact in fp32, so a BF16 dot computes what an FP8
tensor-core GEMM does, up to summation order. Scales constant along K multiply the result once;
scales per 128 along K split the sum into 128-wide chunks, each scaled in fp32.
Design notes: docs/design/numerics.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.numerics.blocks import expand_tiles, flush_subnormal
from nvfp4tool.numerics.constants import FP8_BLOCK
from nvfp4tool.numerics.dot import dot_nt
from nvfp4tool.numerics.fp8 import FP8Array

_ALONG_K_CONSTANT = ("tensor", "channel")  # one scale for all of a row's K
_ALONG_K_BLOCKED = ("block128", "block128x128")  # one scale per 128 of a row's K


def fp8_matmul(a_q: FP8Array, b_q: FP8Array) -> jax.Array:
    """`a @ b.T` in fp32 for a [..., M, K] and b [N, K], both FP8 along K; returns [..., M, N].

    Granularity pairs: both scales constant along K ("tensor" / "channel") or both per 128 along K
    ("block128" / "block128x128"); see the module docstring.
    """
    _validate(a_q, b_q)
    if a_q.granularity in _ALONG_K_CONSTANT:
        return _matmul_per_row(a_q.data, a_q.scale, b_q.data, b_q.scale)
    return _matmul_blocked(
        a_q.data,
        a_q.scale,
        b_q.data,
        b_q.scale,
        a_tiled=a_q.granularity == "block128x128",
        b_tiled=b_q.granularity == "block128x128",
    )


# ------------------------------------------------------------------------------------------
# helpers


def _validate(a_q: FP8Array, b_q: FP8Array) -> None:
    if len(a_q.shape) < 2:
        raise NVFP4ToolError(f"fp8_matmul: operand a (shape {a_q.shape}) must be [..., M, K]")
    if len(b_q.shape) != 2:
        raise NVFP4ToolError(f"fp8_matmul: operand b (shape {b_q.shape}) must be [N, K]")
    if a_q.shape[-1] != b_q.shape[-1]:
        raise NVFP4ToolError(f"fp8_matmul: K differs: a {a_q.shape} vs b {b_q.shape}")
    pair = (a_q.granularity, b_q.granularity)
    if not (all(g in _ALONG_K_CONSTANT for g in pair) or all(g in _ALONG_K_BLOCKED for g in pair)):
        raise NVFP4ToolError(
            f"fp8_matmul: granularities {pair[0]!r} (a) and {pair[1]!r} (b) do not pair: both "
            f"scales must be constant along K ('tensor'/'channel') or both per 128 along K "
            f"('block128'/'block128x128')"
        )


def _bf16_dot(a_data: jax.Array, b_data: jax.Array) -> jax.Array:
    """FP8 data as bf16 (exact), contracted over the last axes with fp32 accumulation."""
    return dot_nt(a_data.astype(jnp.bfloat16), b_data.astype(jnp.bfloat16))


@jax.jit
def _matmul_per_row(a_data, a_scale, b_data, b_scale):
    # a_scale: [] or [..., M, 1]; b_scale: [] or [N, 1] -> a row [N] of the output's columns.
    factor = flush_subnormal(a_scale * b_scale.reshape(-1))
    return _bf16_dot(a_data, b_data) * factor


@functools.partial(jax.jit, static_argnames=("a_tiled", "b_tiled"))
def _matmul_blocked(a_data, a_scale, b_data, b_scale, *, a_tiled, b_tiled):
    a_scale_MxC = _per_row(a_scale, a_tiled, a_data.shape[-2])  # [..., M, C]
    b_scale_CxN = _per_row(b_scale, b_tiled, b_data.shape[-2]).T  # [C, N]

    def chunk_term(a_chunk, b_chunk, c):
        """Chunk c's partial dot, scaled by scale_a[:, c] * scale_b[:, c]."""
        a_scale_Mx1 = jax.lax.dynamic_slice_in_dim(a_scale_MxC, c, 1, axis=-1)
        b_scale_N = jax.lax.dynamic_index_in_dim(b_scale_CxN, c, axis=0, keepdims=False)
        return _bf16_dot(a_chunk, b_chunk) * flush_subnormal(a_scale_Mx1 * b_scale_N)

    def add_chunk(c, acc_MxN):
        start = c * FP8_BLOCK
        return acc_MxN + chunk_term(
            jax.lax.dynamic_slice_in_dim(a_data, start, FP8_BLOCK, axis=-1),
            jax.lax.dynamic_slice_in_dim(b_data, start, FP8_BLOCK, axis=-1),
            c,
        )

    full, k = a_data.shape[-1] // FP8_BLOCK, a_data.shape[-1]
    out_shape = (*a_data.shape[:-1], b_data.shape[0])
    acc_MxN = jnp.zeros(out_shape, jnp.float32)
    if full:  # a loop of no trips still traces its body, which needs a whole chunk
        acc_MxN = jax.lax.fori_loop(0, full, add_chunk, acc_MxN)
    if k % FP8_BLOCK:  # the ragged last chunk: what exists of it, as quantize_fp8's amax
        start = full * FP8_BLOCK
        acc_MxN = acc_MxN + chunk_term(a_data[..., start:], b_data[:, start:], full)
    return acc_MxN


def _per_row(scale: jax.Array, tiled: bool, rows: int) -> jax.Array:
    """Block scales as one per (row, chunk): [..., rows, C] (128x128 tiles repeated over rows)."""
    if not tiled:
        return scale
    return expand_tiles(scale, FP8_BLOCK, 1, (*scale.shape[:-2], rows, scale.shape[-1]))
