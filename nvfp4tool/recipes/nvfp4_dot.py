"""The NVFP4 training GEMMs of one linear layer, as a `jax.custom_vjp` (sheet section 3).

    fprop  Y  = X W^T    X: 1x16 along K, RNE          W: 16x16 2D, RNE
    dgrad  dX = dY W     dY: 1x16 along N, SR          W: the same 2D-quantized values (along N)
    wgrad  dW = dY^T X   dY^T: RHT, 1x16 along T, SR   X^T: RHT, 1x16 along T, RNE

T is the number of tokens (all leading axes of x flattened). Each piece can be switched off for
ablations (`NVFP4Options`). Every GEMM is `nvfp4_matmul` on quantized operands: per-block scales,
fp32 accumulation, global decode scales applied once; emulated on CPU/Hopper, native on Blackwell.
Gradients are straight-through: the quantizers' rounding has no derivative of its own, and the
(fused-group) weight amax gets no gradient.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from nvfp4tool.numerics import dot_nt, nvfp4_matmul, quantize_nvfp4, rht16, tensor_amax


@dataclasses.dataclass(frozen=True)
class NVFP4Options:
    """Switches of the recipe (all on = NVIDIA's recipe; off = an ablation)."""

    rht: bool = True  # random Hadamard transform on both wgrad operands (along tokens)
    stochastic_rounding: bool = True  # SR on the gradient dY (dgrad and wgrad)
    weight_2d: bool = True  # 16x16 weight scales (else 1x16 along K in fprop, along N in dgrad)
    quantize_fprop: bool = True  # False: fprop in the input dtype (the late switch to BF16)


def nvfp4_dot(x_TxK: jax.Array, w_NxK: jax.Array, key: jax.Array,
              w_global_amax: jax.Array | None = None,
              options: NVFP4Options = NVFP4Options()) -> jax.Array:
    """`x @ w.T` in fp32 (x: [..., K], w: [N, K]) with the NVFP4 recipe's forward and backward.

    `key` seeds the stochastic rounding of this layer's gradient; `w_global_amax` is the shared
    amax of the weight's fused group (q/k/v, gate/up), or None for the weight's own amax.
    K, N and the token count must be multiples of 16.
    """
    if w_global_amax is None:
        w_global_amax = tensor_amax(w_NxK)
    lead_shape = x_TxK.shape[:-1]
    y_TxN = _nvfp4_dot(x_TxK.reshape(-1, x_TxK.shape[-1]), w_NxK, key,
                       jax.lax.stop_gradient(jnp.asarray(w_global_amax, jnp.float32)), options)
    return y_TxN.reshape(*lead_shape, w_NxK.shape[0])


# ------------------------------------------------------------------------------------------
# the custom VJP: one block, forward then backward


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _nvfp4_dot(x_TxK, w_NxK, key, w_amax, options):
    return _fprop(x_TxK, w_NxK, w_amax, options)


def _fprop(x_TxK, w_NxK, w_amax, options):
    if not options.quantize_fprop:
        return dot_nt(x_TxK, w_NxK)
    x_q = quantize_nvfp4(x_TxK, axis=-1, block="1d")
    w_q = quantize_nvfp4(w_NxK, axis=-1, block=_weight_block(options), global_amax=w_amax)
    return nvfp4_matmul(x_q, w_q)


def _nvfp4_dot_fwd(x_TxK, w_NxK, key, w_amax, options):
    return _fprop(x_TxK, w_NxK, w_amax, options), (x_TxK, w_NxK, key, w_amax)


def _nvfp4_dot_bwd(options, residuals, dy_TxN):
    x_TxK, w_NxK, key, w_amax = residuals
    dgrad_key, wgrad_key = jax.random.split(key)
    rounding = "stochastic" if options.stochastic_rounding else "rne"
    dy_TxN = dy_TxN.astype(jnp.float32)

    # dgrad: dX = dY W, contracting over N: both operands quantized along N.
    dy_q = quantize_nvfp4(dy_TxN, axis=-1, rounding=rounding, key=dgrad_key)
    w_t_q = quantize_nvfp4(w_NxK.T, axis=-1, block=_weight_block(options), global_amax=w_amax)
    dx_TxK = nvfp4_matmul(dy_q, w_t_q)

    # wgrad: dW = dY^T X, contracting over T: both operands (RHT'd) quantized along T.
    dy_t_NxT, x_t_KxT = dy_TxN.T, x_TxK.T
    if options.rht:
        dy_t_NxT, x_t_KxT = rht16(dy_t_NxT, axis=-1), rht16(x_t_KxT, axis=-1)
    dy_t_q = quantize_nvfp4(dy_t_NxT, axis=-1, rounding=rounding, key=wgrad_key)
    x_t_q = quantize_nvfp4(x_t_KxT, axis=-1)
    dw_NxK = nvfp4_matmul(dy_t_q, x_t_q)

    return dx_TxK.astype(x_TxK.dtype), dw_NxK.astype(w_NxK.dtype), None, None


_nvfp4_dot.defvjp(_nvfp4_dot_fwd, _nvfp4_dot_bwd)


def _weight_block(options: NVFP4Options) -> str:
    return "2d" if options.weight_2d else "1d"
