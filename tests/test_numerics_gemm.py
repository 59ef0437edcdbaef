"""nvfp4_matmul: emulated path vs the fp64 product of the dequantized operands; dispatch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.numerics import dequantize_nvfp4, native_fp4_available, nvfp4_matmul, quantize_nvfp4


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
