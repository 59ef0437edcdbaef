"""nvfp4_matmul / nvfp4_operand_matmul: the BF16 emulation vs the fp32 HIGHEST product of the same
dequantized operands (bit-equal on the CPU, within an fp32 summation bound everywhere) and the
fp64 product; dispatch and errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.numerics import (
    NVFP4Operand,
    dequantize_nvfp4,
    native_fp4_available,
    nvfp4_matmul,
    nvfp4_operand,
    nvfp4_operand_matmul,
    quantize_nvfp4,
)

from fixtures.numerics_fixtures import fp32_highest_matmul


@pytest.mark.parametrize("a_shape,n", [((8, 64), 24), ((2, 3, 64), 24), ((64, 4096), 48), ((2, 16, 1024), 32)])
def test_bf16_emulation_equals_fp32_highest_path(a_shape, n):
    """New (bf16 operands, DEFAULT precision) == old (fp32, HIGHEST): the products are the same
    exact values, only the summation order may differ: |new - old| <= K 2^-24 sum_k |a_k b_k| (x
    the global factor); on the CPU XLA sums in the same order: bit-equal."""
    rng = np.random.default_rng(2)
    a = rng.standard_normal(a_shape).astype(np.float32) * 3
    b = rng.standard_normal((n, a_shape[-1])).astype(np.float32) * 0.02
    a_q, b_q = quantize_nvfp4(a), quantize_nvfp4(b, block="2d")
    new = np.asarray(nvfp4_matmul(a_q, b_q, backend="emulated"))
    old, a32, b32, factor = fp32_highest_matmul(a_q, b_q)
    old = np.asarray(old)
    abs_products = np.abs(np.asarray(a32, np.float64)) @ np.abs(np.asarray(b32, np.float64)).T
    bound = a_shape[-1] * 2.0**-24 * abs_products * np.float64(factor)
    assert np.all(np.abs(new.astype(np.float64) - old) <= bound + 1e-30)
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(new.view(np.uint32), old.view(np.uint32))
    # the operand-level entry (what training uses) is the same function
    by_operand = np.asarray(nvfp4_operand_matmul(nvfp4_operand(a), nvfp4_operand(b, block="2d")))
    np.testing.assert_array_equal(by_operand.view(np.uint32), new.view(np.uint32))


@pytest.mark.parametrize("a_shape", [(8, 64), (2, 3, 64)])
def test_emulated_matmul_equals_fp64_product_of_dequantized(a_shape):
    rng = np.random.default_rng(0)
    a_q = quantize_nvfp4(rng.standard_normal(a_shape).astype(np.float32) * 5)
    b_q = quantize_nvfp4(rng.standard_normal((24, 64)).astype(np.float32) * 0.01, block="2d")
    out = nvfp4_matmul(a_q, b_q, backend="emulated")
    assert out.shape == (*a_shape[:-1], 24) and out.dtype == jnp.float32
    a64 = np.asarray(dequantize_nvfp4(a_q), np.float64)
    b64 = np.asarray(dequantize_nvfp4(b_q), np.float64)
    want = a64 @ b64.T
    bound = np.abs(a64) @ np.abs(b64).T  # fp32 accumulation error scales with sum |a||b|
    assert np.all(np.abs(np.asarray(out, np.float64) - want) <= 1e-6 * bound + 1e-30)
    auto = nvfp4_matmul(a_q, b_q, out_dtype=jnp.bfloat16)  # CPU: auto -> emulated
    assert auto.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(auto), np.asarray(out.astype(jnp.bfloat16)))
    jitted = jax.jit(lambda a, b: nvfp4_matmul(a, b, backend="emulated"))(a_q, b_q)
    np.testing.assert_array_equal(np.asarray(jitted), np.asarray(out))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU behaviour")
def test_native_raises_on_cpu_and_auto_is_emulated():
    assert not native_fp4_available()
    a_q = quantize_nvfp4(np.ones((4, 32), np.float32))
    with pytest.raises(NVFP4ToolError, match="native.*CUDA GPU"):
        nvfp4_matmul(a_q, a_q, backend="native")
    with pytest.raises(NVFP4ToolError, match="backend"):
        nvfp4_matmul(a_q, a_q, backend="fast")


def test_shape_errors():
    a_q = quantize_nvfp4(np.ones((4, 32), np.float32))
    with pytest.raises(NVFP4ToolError, match="K differs"):
        nvfp4_matmul(a_q, quantize_nvfp4(np.ones((4, 64), np.float32)))
    with pytest.raises(NVFP4ToolError, match="along K"):
        nvfp4_matmul(a_q, quantize_nvfp4(np.ones((32, 16), np.float32), axis=0))
    a_op = nvfp4_operand(np.ones((4, 32), np.float32))
    with pytest.raises(NVFP4ToolError, match="nvfp4_operand_matmul: K differs"):
        nvfp4_operand_matmul(a_op, nvfp4_operand(np.ones((4, 64), np.float32)))
    with pytest.raises(NVFP4ToolError, match="last axis"):
        nvfp4_operand_matmul(nvfp4_operand(np.ones((32, 16), np.float32), axis=0), a_op)
    with pytest.raises(NVFP4ToolError, match="bfloat16"):
        nvfp4_operand_matmul(a_op, NVFP4Operand(a_op.values.astype(jnp.float32), a_op.s_dec, 1))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
def test_native_agrees_with_emulated_on_gpu():
    rng = np.random.default_rng(1)
    a_q = quantize_nvfp4(rng.standard_normal((2, 128, 256)).astype(np.float32))
    b_q = quantize_nvfp4(rng.standard_normal((64, 256)).astype(np.float32), block="2d")
    emulated = np.asarray(nvfp4_matmul(a_q, b_q, backend="emulated"), np.float64)
    native = np.asarray(nvfp4_matmul(a_q, b_q, backend="native"), np.float64)
    a64 = np.asarray(dequantize_nvfp4(a_q), np.float64)
    b64 = np.asarray(dequantize_nvfp4(b_q), np.float64)
    bound = np.abs(a64) @ np.abs(b64).T
    assert np.all(np.abs(native - emulated) <= 2e-6 * bound + 1e-30)
