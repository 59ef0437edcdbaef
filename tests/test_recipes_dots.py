"""The recipes' custom VJPs: each of the three GEMMs equals the GEMM of explicitly quantized operands."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_oracle as oracle
from nvfp4tool.numerics import (
    dequantize_fp8,
    dequantize_nvfp4,
    dot_nt,
    fp8_matmul,
    nvfp4_matmul,
    quantize_fp8,
    quantize_nvfp4,
    rht16,
)
from nvfp4tool.recipes import FP8Options, NVFP4Options, fp8_dot, nvfp4_dot

T, K, N = 64, 96, 48


@pytest.fixture(scope="module")
def operands():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((T, K)).astype(np.float32)
    w = (rng.standard_normal((N, K)) * 0.05).astype(np.float32)
    dy = rng.standard_normal((T, N)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(w), jnp.asarray(dy)


def _vjp(fn, x, w, dy):
    y, pullback = jax.vjp(fn, x, w)
    dx, dw = pullback(dy)
    return y, dx, dw


@pytest.mark.parametrize("weight_2d", [True, False])
@pytest.mark.parametrize("rht", [True, False])
def test_nvfp4_gemms_equal_explicit_quantized_gemms_rne(operands, rht, weight_2d):
    x, w, dy = operands
    options = NVFP4Options(rht=rht, stochastic_rounding=False, weight_2d=weight_2d)
    key = jax.random.key(0)
    y, dx, dw = _vjp(jax.jit(lambda a, b: nvfp4_dot(a, b, key, options=options)), x, w, dy)

    block = "2d" if weight_2d else "1d"
    y_ref = nvfp4_matmul(quantize_nvfp4(x), quantize_nvfp4(w, block=block))
    dx_ref = nvfp4_matmul(quantize_nvfp4(dy), quantize_nvfp4(w.T, block=block))
    dy_t, x_t = (rht16(dy.T), rht16(x.T)) if rht else (dy.T, x.T)
    dw_ref = nvfp4_matmul(quantize_nvfp4(dy_t), quantize_nvfp4(x_t))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(dx_ref))
    np.testing.assert_array_equal(np.asarray(dw), np.asarray(dw_ref))

    # ... and those GEMMs are the products of the dequantized operands (fp64 reference).
    def deq64(q):
        return np.asarray(dequantize_nvfp4(q), np.float64)

    np.testing.assert_allclose(np.asarray(y), deq64(quantize_nvfp4(x)) @ deq64(quantize_nvfp4(w, block=block)).T,
                               rtol=1e-5, atol=1e-5)


def test_nvfp4_2d_weight_is_the_same_in_fprop_and_dgrad(operands):
    _, w, _ = operands
    w_rows = dequantize_nvfp4(quantize_nvfp4(w, block="2d"))
    w_cols = dequantize_nvfp4(quantize_nvfp4(w.T, block="2d"))
    np.testing.assert_array_equal(np.asarray(w_rows), np.asarray(w_cols).T)


def test_rht_cancels_in_wgrad(operands):
    """With RHT the wgrad still estimates dY^T X: H H^T = I inside the token contraction."""
    x, w, dy = operands
    exact = np.asarray(dy.T @ x, np.float64)
    rel = {}
    for rht in (True, False):
        options = NVFP4Options(rht=rht, stochastic_rounding=False)
        _, _, dw = _vjp(lambda a, b: nvfp4_dot(a, b, jax.random.key(0), options=options), x, w, dy)
        rel[rht] = np.linalg.norm(np.asarray(dw) - exact) / np.linalg.norm(exact)
    # Two 4-bit operands: ~0.13 relative error either way; a transform that did not cancel
    # would give an error of order 1.
    assert rel[True] < 0.2 and rel[False] < 0.2, rel


def test_nvfp4_stochastic_rounding_gradients_are_unbiased(operands):
    """E[dX] over SR keys = dY @ W~ (W~ the 2D-quantized weight): the mean converges, a sample does not."""
    x, w, dy = operands
    options = NVFP4Options(rht=False, stochastic_rounding=True)
    grad = jax.jit(lambda k: jax.vjp(lambda a: nvfp4_dot(a, w, k, options=options), x)[1](dy)[0])
    n_keys = 256
    samples = np.stack([np.asarray(grad(k)) for k in jax.random.split(jax.random.key(1), n_keys)])
    w_q = np.asarray(dequantize_nvfp4(quantize_nvfp4(w, block="2d")), np.float64)
    expected = np.asarray(dy, np.float64) @ w_q
    err_one = np.linalg.norm(samples[0] - expected) / np.linalg.norm(expected)
    err_mean = np.linalg.norm(samples.mean(0) - expected) / np.linalg.norm(expected)
    # Independent SR noise shrinks as 1/sqrt(n) = 1/16; allow a factor 2 for the residual
    # correlation of keys and the scales (which are RNE, not random).
    assert err_mean < err_one / 8, (err_one, err_mean)
    assert err_one > 0.01  # SR is really on


# (fmt, granularity) of activation, weight, gradient per FP8 scaling mode
FP8_SPECS = {"tensor": (("e4m3", "tensor"), ("e4m3", "tensor"), ("e5m2", "tensor")),
             "block": (("e4m3", "block128"), ("e4m3", "block128x128"), ("e4m3", "block128"))}


@pytest.fixture(scope="module")
def fp8_operands():
    """Contraction lengths 300 (fprop), 136 (dgrad), 200 (wgrad): ragged 128-chunks in each."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((200, 300)) * np.geomspace(0.1, 10, 300)).astype(np.float32)
    w = (rng.standard_normal((136, 300)) * 0.05).astype(np.float32)
    dy = rng.standard_normal((200, 136)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(w), jnp.asarray(dy)


@pytest.mark.parametrize("scaling", ["tensor", "block"])
def test_fp8_gemms_equal_explicit_quantized_gemms(fp8_operands, scaling):
    x, w, dy = fp8_operands
    y, dx, dw = _vjp(jax.jit(lambda a, b: fp8_dot(a, b, FP8Options(scaling=scaling))), x, w, dy)
    act, wgt, grad = FP8_SPECS[scaling]
    gemms = {"fprop": (y, (x, act), (w, wgt)), "dgrad": (dx, (dy, grad), (w.T, wgt)),
             "wgrad": (dw, (dy.T, grad), (x.T, act))}
    for name, (got, (a, a_spec), (b, b_spec)) in gemms.items():
        a_q = quantize_fp8(a, fmt=a_spec[0], granularity=a_spec[1])
        b_q = quantize_fp8(b, fmt=b_spec[0], granularity=b_spec[1])
        np.testing.assert_array_equal(np.asarray(got), np.asarray(fp8_matmul(a_q, b_q)), err_msg=name)
        # ... and the former formulation (fake-quantized fp32 operands, one fp32 dot) within the
        # fp32 rounding bounds of both (tests/test_numerics_fp8_gemm.py derives them).
        k = a.shape[-1]
        chunks, chunk_len = (-(-k // 128), 128) if scaling == "block" else (1, k)
        a_deq, b_deq = dequantize_fp8(a_q), dequantize_fp8(b_q)
        old = dot_nt(a_deq, b_deq, precision=jax.lax.Precision.HIGHEST)
        _, bound = oracle.gemm_with_bound(a_deq, b_deq, (chunk_len + chunks + 2) + k)
        assert np.all(np.abs(np.asarray(got, np.float64) - np.asarray(old)) <= bound), name
    # and they really are quantized: not the fp32 product
    assert np.abs(np.asarray(y) - np.asarray(x @ w.T)).max() > 1e-4
