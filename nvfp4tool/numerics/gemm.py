"""NVFP4 x NVFP4 matrix product `a @ b.T` with TE's GEMM semantics, emulated or native.

Semantics: every element is e2m1(code) * fp32(block scale); products are summed in fp32; the two
global decode scales (S_dec_a * S_dec_b, i.e. amax_a * amax_b / 2688^2 up to fp32 rounding of
the reciprocals, the same S_dec that `dequantize_nvfp4` uses) multiply the result once at the end.

Backends:
  "emulated"  decode code * block scale (`decode_nvfp4` with S_dec = 1) in fp32, `dot.dot_nt`
              with fp32 accumulation (precision HIGHEST: no TF32), then the global factor.
              Runs everywhere.
  "native"    `jax.nn.scaled_matmul` on float4_e2m1fn data and float8_e4m3fn scales. Needs a
              CUDA GPU (no CPU lowering in jax 0.10); on Hopper XLA rewrites it to a dequantize +
              dot, on Blackwell (compute capability >= 10) cuDNN runs it on FP4 tensor cores.
  "auto"      "native" where it is native (CUDA compute capability >= 10.0), else "emulated".
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.numerics.blocks import flush_subnormal
from nvfp4tool.numerics.constants import NVFP4_BLOCK
from nvfp4tool.numerics.dot import dot_nt
from nvfp4tool.numerics.nvfp4 import NVFP4Array, decode_nvfp4, nvfp4_global_scales

Backend = Literal["auto", "emulated", "native"]


def nvfp4_matmul(a_q: NVFP4Array, b_q: NVFP4Array, *, out_dtype: jnp.dtype = jnp.float32,
                 backend: Backend = "auto") -> jax.Array:
    """`a @ b.T` for a [..., M, K] and b [N, K], both NVFP4 along K; returns [..., M, N]."""
    _validate(a_q, b_q)
    if backend == "auto":
        backend = "native" if native_fp4_available() else "emulated"
    if backend == "emulated":
        fn = _matmul_emulated
    elif backend == "native":
        platform = jax.default_backend()
        if platform != "gpu":
            raise NVFP4ToolError(
                f"nvfp4_matmul backend='native' needs a CUDA GPU (jax.nn.scaled_matmul has no "
                f"lowering on {platform!r}); use backend='emulated' or 'auto'")
        fn = _matmul_native
    else:
        raise NVFP4ToolError(f"nvfp4_matmul: backend must be 'auto', 'emulated' or 'native', "
                             f"got {backend!r}")
    out = fn(a_q.packed, a_q.scales, a_q.global_amax, b_q.packed, b_q.scales, b_q.global_amax)
    return out.astype(out_dtype)


def native_fp4_available() -> bool:
    """True when the default JAX device is a CUDA GPU with compute capability >= 10.0."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        return False
    capability = getattr(device, "compute_capability", "0")
    try:
        return float(capability) >= 10.0
    except ValueError:
        return False


# ------------------------------------------------------------------------------------------
# helpers


def _validate(a_q: NVFP4Array, b_q: NVFP4Array) -> None:
    if len(a_q.shape) < 2 or a_q.axis != len(a_q.shape) - 1:
        raise NVFP4ToolError(f"nvfp4_matmul: operand a (shape {a_q.shape}) must be [..., M, K] "
                             f"quantized along its last axis, got axis {a_q.axis}")
    if len(b_q.shape) != 2 or b_q.axis != 1:
        raise NVFP4ToolError(f"nvfp4_matmul: operand b (shape {b_q.shape}) must be [N, K] "
                             f"quantized along K (axis 1), got axis {b_q.axis}")
    if a_q.shape[-1] != b_q.shape[-1]:
        raise NVFP4ToolError(f"nvfp4_matmul: K differs: a {a_q.shape} vs b {b_q.shape}")


def _global_factor(amax_a: jax.Array, amax_b: jax.Array) -> jax.Array:
    """S_dec_a * S_dec_b in fp32."""
    return flush_subnormal(nvfp4_global_scales(amax_a)[1] * nvfp4_global_scales(amax_b)[1])


def _scaled_values(packed: jax.Array, scales: jax.Array) -> jax.Array:
    """e2m1(code) * fp32(block scale), without the global scale, [..., K] in fp32 (exact: the
    stored-bytes decode with S_dec = 1)."""
    return decode_nvfp4(packed, scales, jnp.float32(1.0))


@jax.jit
def _matmul_emulated(a_packed, a_scales, a_amax, b_packed, b_scales, b_amax):
    a_MxK = _scaled_values(a_packed, a_scales)
    b_NxK = _scaled_values(b_packed, b_scales)
    out_MxN = dot_nt(a_MxK, b_NxK, precision=jax.lax.Precision.HIGHEST)
    return out_MxN * _global_factor(a_amax, b_amax)


@jax.jit
def _matmul_native(a_packed, a_scales, a_amax, b_packed, b_scales, b_amax):
    lead_shape, k = a_packed.shape[:-1], a_packed.shape[-1] * 2
    a_1xMxK = _as_float4(a_packed).reshape(1, -1, k)
    b_1xNxK = _as_float4(b_packed).reshape(1, -1, k)
    a_scales_1xMxKb = a_scales.reshape(1, -1, k // NVFP4_BLOCK)
    b_scales_1xNxKb = b_scales.reshape(1, -1, k // NVFP4_BLOCK)
    out = jax.nn.scaled_matmul(a_1xMxK, b_1xNxK, a_scales_1xMxKb, b_scales_1xNxKb,
                               preferred_element_type=jnp.float32)
    out_MxN = out.reshape(*lead_shape, b_packed.shape[0])
    return out_MxN * _global_factor(a_amax, b_amax)


def _as_float4(packed: jax.Array) -> jax.Array:
    """uint8 [..., K/2] -> float4_e2m1fn [..., K]; the bitcast splits low nibble first."""
    pairs = jax.lax.bitcast_convert_type(packed, jnp.float4_e2m1fn)  # [..., K/2, 2]
    return pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2)
