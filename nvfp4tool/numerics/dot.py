"""The one GEMM body of the package: `a @ b.T` with fp32 accumulation, and a linear layer's end.

    y_f32 = dot_nt(x, w_NxK)                        # [..., N] fp32; w cast to x.dtype first
    y = linear_output(y_f32, b_N, x.dtype)          # + fp32(bias), then cast
    y = dense(x, w_NxK, b_N, compute_dtype=bf16)    # the plain (BF16) linear layer: both of the above

`computed_after` / `dense_widening`: widen stored weights only when their GEMM's input exists.
Design notes: docs/design/numerics.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

WIDEN_BYTES = 64 * 2**20  # dense_widening: the most of a weight held widened at once
# ... and for an input of at most FEW_ROWS rows (a decode step's GEMV): a block that stays in the
# CPU's cache between its widening and its product (a 4608 x 576 BF16 weight times one row on the
# CPU: 4.3 ms in 64 MiB blocks, 0.65 ms in 1 MiB ones; docs/benchmarks/generate.md)
# blocks, at most FEW_ROWS_BLOCKS of them (each block is its own code: a 49152-row LM head in 1 MiB
# blocks took seconds more to compile than it saved)
FEW_ROWS, FEW_ROWS_WIDEN_BYTES, FEW_ROWS_BLOCKS = 8, 2**20, 16


def widened_bytes(elements: int) -> int:
    """The most `dense_widening` holds widened to fp32 at once for a weight of `elements` values:
    one block of rows, at most WIDEN_BYTES (a smaller weight: all of it)."""
    return min(WIDEN_BYTES, 4 * elements)


def dot_nt(a: jax.Array, b_NxK: jax.Array, *, precision: jax.lax.Precision | None = None) -> jax.Array:
    """`a @ b.T` for a [..., K] and b [N, K] (b cast to a's dtype), accumulated and returned in
    fp32, [..., N]."""
    return jax.lax.dot_general(
        a,
        b_NxK.astype(a.dtype),
        (((a.ndim - 1,), (1,)), ((), ())),
        precision=precision,
        preferred_element_type=jnp.float32,
    )


def linear_output(y_f32: jax.Array, b_N: jax.Array | None, dtype: jnp.dtype) -> jax.Array:
    """A linear layer's epilogue: add the bias in fp32 (if any), cast the result to `dtype`."""
    if b_N is not None:
        y_f32 = y_f32 + b_N.astype(jnp.float32)
    return y_f32.astype(dtype)


def dense(
    x: jax.Array, w_NxK: jax.Array, b_N: jax.Array | None = None, *, compute_dtype: jnp.dtype | None = None
) -> jax.Array:
    """`x @ w.T + b` in `compute_dtype` (default x.dtype) with fp32 accumulation; x.dtype out."""
    x_c = x if compute_dtype is None else x.astype(compute_dtype)
    return linear_output(dot_nt(x_c, w_NxK), b_N, x.dtype)


def computed_after(x: jax.Array, fn, *args):
    """`fn(*args)`, scheduled after `x` is computed (see the module docstring); same values."""
    first = x.reshape(-1)[0].astype(jnp.float32)  # integers too: XLA folds an integer's `a == a`
    return jax.lax.cond(first == first, fn, fn, *args)  # a float's `a == a` cannot be folded (NaN != NaN)


def dense_widening(x: jax.Array, w_NxK, b_N: jax.Array | None = None, *, widen_rows=None) -> jax.Array:
    """`dense(x, w, b)` for a weight stored narrower than x (BF16 weights in fp32 compute, or a
    stored quantized weight): w is widened to x's dtype only once x exists, in blocks of rows of at
    most WIDEN_BYTES widened, each block after the previous block's product (`computed_after`); the
    blocks' products are concatenated. Each output element is the same dot product; whether its
    bits equal one whole GEMM's depends on how the backend's kernel blocks the problem: on the CPU
    they do for LM heads (32000x2048, 128256x4096) and 14336x4096 projections, not for a 4096x14336
    down_proj on 256 input rows (fp32 rounding). A weight within one block is one GEMM, as `dense`.
    An input of at most FEW_ROWS rows (a decode step) is multiplied in blocks of
    FEW_ROWS_WIDEN_BYTES (at most FEW_ROWS_BLOCKS blocks), which stay in the cache (the block size
    depends only on the shapes, so a weight decoded once and one decoded at every step still run
    the same GEMMs).
    `widen_rows(w, start, stop)` gives rows start:stop of w in x's dtype (default: a cast of w's
    rows; a stored weight passes its decoder); w needs a `.shape` (N, K)."""
    widen_rows = widen_rows or (lambda w, start, stop: w[start:stop].astype(x.dtype))
    n, k = w_NxK.shape
    row_bytes = k * jnp.dtype(x.dtype).itemsize
    if x.size // max(k, 1) <= FEW_ROWS:
        rows = max(FEW_ROWS_WIDEN_BYTES // row_bytes, -(-n // FEW_ROWS_BLOCKS))
    else:
        rows = WIDEN_BYTES // row_bytes
    rows = max(1, min(rows, WIDEN_BYTES // row_bytes))
    parts, last = [], x
    for start in range(0, n, rows):
        # sliced inside the conditional: a slice taken outside would be copied at the program's start
        block = computed_after(last, lambda w, s=start: widen_rows(w, s, min(s + rows, n)), w_NxK)
        last = dot_nt(x, block)
        parts.append(last)
    return linear_output(parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1), b_N, x.dtype)
