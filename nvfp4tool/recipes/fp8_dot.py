"""The FP8 baselines' GEMMs of one linear layer, as a `jax.custom_vjp` (sheet section 3).

    "tensor" (TE Float8CurrentScaling)   X, W: E4M3 per tensor;  dY: E5M2 per tensor
    "block"  (the paper's FP8 baseline)  X, dY: E4M3 1x128 along the contraction axis;
                                         W: E4M3 128x128 tiles
Every GEMM quantizes its two operands along the contraction axis (`quantize_fp8`) and contracts
the FP8 data as BF16 operands with fp32 accumulation, applying the scales in fp32 (`fp8_matmul`:
after the whole sum per tensor, after each 128-wide K chunk for block scaling): the products of
two FP8 values are exact in fp32, so this is what an FP8 tensor-core GEMM computes up to the
order of the fp32 sum.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp

from nvfp4tool.numerics import FP8Array, dot_nt, fp8_matmul, quantize_fp8


@dataclasses.dataclass(frozen=True)
class FP8Options:
    """Which FP8 baseline: per-tensor current scaling, or the paper's block scaling."""

    scaling: Literal["tensor", "block"] = "tensor"
    quantize_fprop: bool = True  # False: fprop in the input dtype (the late switch to BF16)


def fp8_dot(x_TxK: jax.Array, w_NxK: jax.Array, options: FP8Options = FP8Options()) -> jax.Array:
    """`x @ w.T` in fp32 (x: [..., K], w: [N, K]) with FP8 forward and backward GEMMs."""
    lead_shape = x_TxK.shape[:-1]
    y_TxN = _fp8_dot(x_TxK.reshape(-1, x_TxK.shape[-1]), w_NxK, options)
    return y_TxN.reshape(*lead_shape, w_NxK.shape[0])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _fp8_dot(x_TxK, w_NxK, options):
    if not options.quantize_fprop:
        return dot_nt(x_TxK, w_NxK)
    return fp8_matmul(_q(x_TxK, "activation", options), _q(w_NxK, "weight", options))


def _fp8_dot_fwd(x_TxK, w_NxK, options):
    return _fp8_dot(x_TxK, w_NxK, options), (x_TxK, w_NxK)


def _fp8_dot_bwd(options, residuals, dy_TxN):
    x_TxK, w_NxK = residuals
    dy_TxN = dy_TxN.astype(jnp.float32)
    # dgrad dX = dY W: contraction over N (the last axis of dY and of W^T).
    dx_TxK = fp8_matmul(_q(dy_TxN, "gradient", options), _q(w_NxK.T, "weight", options))
    # wgrad dW = dY^T X: contraction over T.
    dw_NxK = fp8_matmul(_q(dy_TxN.T, "gradient", options), _q(x_TxK.T, "activation", options))
    return dx_TxK.astype(x_TxK.dtype), dw_NxK.astype(w_NxK.dtype)


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)

# (fmt, granularity) per operand role and scaling mode
_OPERAND_FORMATS = {
    ("tensor", "activation"): ("e4m3", "tensor"),
    ("tensor", "weight"): ("e4m3", "tensor"),
    ("tensor", "gradient"): ("e5m2", "tensor"),
    ("block", "activation"): ("e4m3", "block128"),
    ("block", "weight"): ("e4m3", "block128x128"),
    ("block", "gradient"): ("e4m3", "block128"),
}


def _q(x: jax.Array, role: str, options: FP8Options) -> FP8Array:
    """Quantize one GEMM operand to FP8 along its last axis (the contraction axis)."""
    fmt, granularity = _OPERAND_FORMATS[(options.scaling, role)]
    return quantize_fp8(x, fmt=fmt, granularity=granularity, name=role)
