"""The one GEMM body of the package: `a @ b.T` with fp32 accumulation, and a linear layer's end.

    y_f32 = dot_nt(x, w_NxK)                        # [..., N] fp32; w cast to x.dtype first
    y = linear_output(y_f32, b_N, x.dtype)          # + fp32(bias), then cast
    y = dense(x, w_NxK, b_N, compute_dtype=bf16)    # the plain (BF16) linear layer: both of the above

Every unquantized linear (the model's default seam, the BF16 layers of a recipe, calibration, the
serving simulation) is `dense`; the quantized GEMMs (FP8 baselines, the emulated NVFP4 matmul)
contract their dequantized fp32 operands with `dot_nt(..., precision=HIGHEST)` (no TF32 on GPU).
`precision=None` (XLA's default) is what a BF16 GEMM uses: bf16 products are exact in fp32.

    w32 = computed_after(x, lambda w: w.astype(jnp.float32), w_bf16)   # widened once x exists

`computed_after` is for programs that widen or decode many stored weights (a model held as stored,
run in fp32): XLA schedules a conversion that depends only on a parameter at the start of the
program, so every weight of a layer would sit converted in memory at once; computed inside a
conditional on `x` (both branches the same), each is made only when its GEMM's input exists and
freed after it. The values are the same either way. (A conversion inside a loop whose `x` does not
change between iterations is still hoisted out of it.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def dot_nt(a: jax.Array, b_NxK: jax.Array, *,
           precision: jax.lax.Precision | None = None) -> jax.Array:
    """`a @ b.T` for a [..., K] and b [N, K] (b cast to a's dtype), accumulated and returned in
    fp32, [..., N]."""
    return jax.lax.dot_general(a, b_NxK.astype(a.dtype), (((a.ndim - 1,), (1,)), ((), ())),
                               precision=precision, preferred_element_type=jnp.float32)


def linear_output(y_f32: jax.Array, b_N: jax.Array | None, dtype: jnp.dtype) -> jax.Array:
    """A linear layer's epilogue: add the bias in fp32 (if any), cast the result to `dtype`."""
    if b_N is not None:
        y_f32 = y_f32 + b_N.astype(jnp.float32)
    return y_f32.astype(dtype)


def dense(x: jax.Array, w_NxK: jax.Array, b_N: jax.Array | None = None, *,
          compute_dtype: jnp.dtype | None = None) -> jax.Array:
    """`x @ w.T + b` in `compute_dtype` (default x.dtype) with fp32 accumulation; x.dtype out."""
    x_c = x if compute_dtype is None else x.astype(compute_dtype)
    return linear_output(dot_nt(x_c, w_NxK), b_N, x.dtype)


def computed_after(x: jax.Array, fn, *args):
    """`fn(*args)`, scheduled after `x` is computed (see the module docstring); same values."""
    first = x.reshape(-1)[0]
    return jax.lax.cond(first == first, fn, fn, *args)  # `a == a` cannot be folded (NaN != NaN)
