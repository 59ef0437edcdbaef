"""The 16-point random Hadamard transform (RHT) of the NVFP4 wgrad recipe.

`H = diag(s) @ H16 / 4` with H16 the Sylvester Hadamard matrix and `s` TE's fixed sign vector.
Convention (TE's, sheet section 2): each run of 16 consecutive elements along `axis` is a row
vector multiplied on the right, `chunk @ H`; the inverse is `chunk @ H.T`. For the weight
gradient both operands are transformed along the token axis, `dW = dY^T X = (dY^T H)(X^T H)^T`,
which holds because H is orthonormal (exactly so in fp32: its entries are +-1/4).
The product is computed in fp32 (precision HIGHEST, so no TF32 on GPU) and cast back to the input
dtype; TE likewise rounds the transformed tensor to bf16 for bf16 inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.numerics.blocks import normalize_axis
from nvfp4tool.numerics.constants import RHT_SIGNS, RHT_SIZE


def rht_matrix(dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """H = diag(s) @ H16 / 4, a 16x16 orthonormal matrix with entries +-1/4."""
    sylvester = np.ones((1, 1))
    while sylvester.shape[0] < RHT_SIZE:
        sylvester = np.block([[sylvester, sylvester], [sylvester, -sylvester]])
    h = np.diag(np.asarray(RHT_SIGNS, np.float64)) @ sylvester / np.sqrt(RHT_SIZE)
    return jnp.asarray(h, dtype)


def rht16(x: jax.Array | np.ndarray, axis: int = -1, *, inverse: bool = False, name: str = "tensor") -> jax.Array:
    """Apply `chunk @ H` (or `chunk @ H.T` when `inverse`: H is orthonormal, so that undoes it)
    to 16-element chunks along `axis`."""
    x = jnp.asarray(x)
    axis = normalize_axis(axis, x.ndim, name)
    if x.shape[axis] % RHT_SIZE != 0:
        raise NVFP4ToolError(
            f"tensor '{name}' shape {tuple(x.shape)}: length {x.shape[axis]} of "
            f"axis {axis} is not a multiple of {RHT_SIZE} (RHT chunks)"
        )
    return _rht16(x, axis=axis, inverse=inverse)


def rht16_last_axis(x_K: jax.Array, h_16x16: jax.Array) -> jax.Array:
    """`chunk @ h` for the 16-element chunks along the last axis (a multiple of 16), computed in
    fp32 and cast back to x's dtype: `rht16` with `h = rht_matrix()` (or its transpose), without
    checks, for traced callers such as a fused kernel working on a tile whose last axis starts at
    a multiple of 16 (a kernel takes `h` as an input: it cannot capture array constants)."""
    x32_K = x_K.astype(jnp.float32)
    chunks_Cx16 = x32_K.reshape(-1, RHT_SIZE)  # a 2-D product: what a Triton kernel can lower
    return _chunk_matmul(chunks_Cx16, h_16x16).reshape(x32_K.shape).astype(x_K.dtype)


# ------------------------------------------------------------------------------------------
# helpers


@jax.jit
def _chunk_matmul(chunks_Cx16: jax.Array, h_16x16: jax.Array) -> jax.Array:
    return jnp.dot(chunks_Cx16, h_16x16, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _rht16(x: jax.Array, *, axis: int, inverse: bool) -> jax.Array:
    h = rht_matrix()
    out_K = rht16_last_axis(jnp.moveaxis(x, axis, -1), h.T if inverse else h)
    return jnp.moveaxis(out_K, -1, axis)
