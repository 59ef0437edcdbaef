"""NVFP4 x NVFP4 matrix product `a @ b.T` with TE's GEMM semantics, emulated or native.

    y = nvfp4_operand_matmul(a_op, b_op)   # NVFP4Operands (nvfp4_operand / fused_quantize): training
    y = nvfp4_matmul(a_q, b_q)             # packed NVFP4Arrays: emulated, or native on Blackwell

Products summed in fp32; S_dec_a * S_dec_b applied once at the end. Backends: emulated, native, auto.
Design notes: docs/design/numerics.md.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.numerics.blocks import flush_subnormal
from nvfp4tool.numerics.constants import NVFP4_BLOCK
from nvfp4tool.numerics.dot import dot_nt
from nvfp4tool.numerics.nvfp4 import NVFP4Array, NVFP4Operand, decode_nvfp4, nvfp4_global_scales

Backend = Literal["auto", "emulated", "native"]


def nvfp4_matmul(
    a_q: NVFP4Array, b_q: NVFP4Array, *, out_dtype: jnp.dtype = jnp.float32, backend: Backend = "auto"
) -> jax.Array:
    """`a @ b.T` for a [..., M, K] and b [N, K], both NVFP4 along K; returns [..., M, N]."""
    _check_layout("nvfp4_matmul", a_q.shape, a_q.axis, b_q.shape, b_q.axis)
    if backend == "auto":
        backend = "native" if native_fp4_available() else "emulated"
    if backend == "emulated":
        fn = _matmul_emulated
    elif backend == "native":
        if not native_gemm_lowers():
            raise NVFP4ToolError(
                f"nvfp4_matmul backend='native' needs a CUDA GPU (jax.nn.scaled_matmul has no "
                f"lowering on {jax.default_backend()!r}); use backend='emulated' or 'auto'"
            )
        fn = _matmul_native
    else:
        raise NVFP4ToolError(f"nvfp4_matmul: backend must be 'auto', 'emulated' or 'native', got {backend!r}")
    out = fn(a_q.packed, a_q.scales, a_q.global_amax, b_q.packed, b_q.scales, b_q.global_amax)
    return out.astype(out_dtype)


def nvfp4_operand_matmul(a_op: NVFP4Operand, b_op: NVFP4Operand, *, out_dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """`a @ b.T` for operands a [..., M, K] and b [N, K], both along K (`nvfp4_operand`, or a
    fused quantizer's mode "operand"): the BF16 emulation (module docstring); [..., M, N]."""
    _check_layout("nvfp4_operand_matmul", a_op.values.shape, a_op.axis, b_op.values.shape, b_op.axis)
    if a_op.values.dtype != jnp.bfloat16 or b_op.values.dtype != jnp.bfloat16:
        raise NVFP4ToolError(
            f"nvfp4_operand_matmul: operand values must be bfloat16, got {a_op.values.dtype} and {b_op.values.dtype}"
        )
    out = _operand_matmul(a_op.values, a_op.s_dec, b_op.values, b_op.s_dec)
    return out.astype(out_dtype)


def native_gemm_lowers() -> bool:
    """True where backend "native" can run at all: `jax.nn.scaled_matmul` lowers on a CUDA GPU
    (natively on compute capability >= 10, rewritten to a dequantize + dot on Hopper); on the CPU
    it has no lowering."""
    return jax.default_backend() == "gpu"


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


def _check_layout(fn: str, a_shape: tuple[int, ...], a_axis: int, b_shape: tuple[int, ...], b_axis: int) -> None:
    if len(a_shape) < 2 or a_axis != len(a_shape) - 1:
        raise NVFP4ToolError(
            f"{fn}: operand a (shape {tuple(a_shape)}) must be [..., M, K] "
            f"quantized along its last axis, got axis {a_axis}"
        )
    if len(b_shape) != 2 or b_axis != 1:
        raise NVFP4ToolError(
            f"{fn}: operand b (shape {tuple(b_shape)}) must be [N, K] quantized along K (axis 1), got axis {b_axis}"
        )
    if a_shape[-1] != b_shape[-1]:
        raise NVFP4ToolError(f"{fn}: K differs: a {tuple(a_shape)} vs b {tuple(b_shape)}")


def _global_factor(amax_a: jax.Array, amax_b: jax.Array) -> jax.Array:
    """S_dec_a * S_dec_b in fp32."""
    return flush_subnormal(nvfp4_global_scales(amax_a)[1] * nvfp4_global_scales(amax_b)[1])


@jax.jit
def _operand_matmul(a_values, a_s_dec, b_values, b_s_dec):
    """The emulation: bf16 operands, DEFAULT precision, fp32 accumulation; then S_dec_a * S_dec_b."""
    out_MxN = dot_nt(a_values, b_values)
    return out_MxN * flush_subnormal(a_s_dec * b_s_dec)


@jax.jit
def _matmul_emulated(a_packed, a_scales, a_amax, b_packed, b_scales, b_amax):
    # The operands without the global scale (S_dec = 1): exact in bf16.
    a_MxK = decode_nvfp4(a_packed, a_scales, jnp.float32(1.0), dtype=jnp.bfloat16)
    b_NxK = decode_nvfp4(b_packed, b_scales, jnp.float32(1.0), dtype=jnp.bfloat16)
    return _operand_matmul(a_MxK, nvfp4_global_scales(a_amax)[1], b_NxK, nvfp4_global_scales(b_amax)[1])


@jax.jit
def _matmul_native(a_packed, a_scales, a_amax, b_packed, b_scales, b_amax):
    lead_shape, k = a_packed.shape[:-1], a_packed.shape[-1] * 2
    a_1xMxK = _as_float4(a_packed).reshape(1, -1, k)
    b_1xNxK = _as_float4(b_packed).reshape(1, -1, k)
    a_scales_1xMxKb = a_scales.reshape(1, -1, k // NVFP4_BLOCK)
    b_scales_1xNxKb = b_scales.reshape(1, -1, k // NVFP4_BLOCK)
    out = jax.nn.scaled_matmul(a_1xMxK, b_1xNxK, a_scales_1xMxKb, b_scales_1xNxKb, preferred_element_type=jnp.float32)
    out_MxN = out.reshape(*lead_shape, b_packed.shape[0])
    return out_MxN * _global_factor(a_amax, b_amax)


def _as_float4(packed: jax.Array) -> jax.Array:
    """uint8 [..., K/2] -> float4_e2m1fn [..., K]; the bitcast splits low nibble first."""
    pairs = jax.lax.bitcast_convert_type(packed, jnp.float4_e2m1fn)  # [..., K/2, 2]
    return pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2)
