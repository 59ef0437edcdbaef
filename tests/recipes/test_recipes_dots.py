"""The recipes' custom VJPs: each of the three GEMMs equals the GEMM of explicitly quantized operands
(and, for NVFP4, the previous fp32 HIGHEST emulation of them); the fused Pallas quantizers
(interpret mode) give the XLA quantizers' values bit for bit; the packed (native) branch."""

from __future__ import annotations

import functools
import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nvfp4tool.errors import NVFP4ToolError
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

from fixtures import nvfp4_oracle as oracle
from fixtures.numerics_fixtures import fp32_highest_matmul

nvfp4_dot_module = importlib.import_module("nvfp4tool.recipes.nvfp4_dot")  # the package exports the function

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

    # ... equal to the previous emulation (fp32 operands, precision HIGHEST): bit-equal on the
    # CPU, else within the fp32 summation bound K 2^-24 sum_k |a_k b_k| (x the global factor).
    for got, (a_q, b_q) in (
        (y, (quantize_nvfp4(x), quantize_nvfp4(w, block=block))),
        (dx, (quantize_nvfp4(dy), quantize_nvfp4(w.T, block=block))),
        (dw, (quantize_nvfp4(dy_t), quantize_nvfp4(x_t))),
    ):
        old, a32, b32, factor = fp32_highest_matmul(a_q, b_q)
        abs_products = np.abs(np.asarray(a32, np.float64)) @ np.abs(np.asarray(b32, np.float64)).T
        bound = a32.shape[-1] * 2.0**-24 * abs_products * np.float64(factor)
        assert np.all(np.abs(np.asarray(got, np.float64) - np.asarray(old)) <= bound + 1e-30)
        if jax.default_backend() == "cpu":
            np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(old).view(np.uint32))

    # ... and those GEMMs are the products of the dequantized operands (fp64 reference).
    def deq64(q):
        return np.asarray(dequantize_nvfp4(q), np.float64)

    np.testing.assert_allclose(
        np.asarray(y), deq64(quantize_nvfp4(x)) @ deq64(quantize_nvfp4(w, block=block)).T, rtol=1e-5, atol=1e-5
    )


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


def _small_operands(lead=(48,)):
    """bf16 x and w as the recipe receives them (T = 48: not a multiple of the 32-row kernel
    tile), fp32 dY."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((*lead, 64)) * 2, jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((32, 64)) * 0.05, jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((*lead, 32)), jnp.float32)
    return x, w, dy


def _bytes(values):
    return [np.asarray(v).view(np.uint16 if v.dtype == jnp.bfloat16 else np.uint32) for v in values]


def _recipe_vjp(x, w, dy, **options):
    key = jax.random.key(3)
    return _vjp(jax.jit(lambda a, b: nvfp4_dot(a, b, key, options=NVFP4Options(**options))), x, w, dy)


@pytest.mark.parametrize(
    "rht,stochastic_rounding,weight_2d,lead",
    [
        (True, True, True, (48,)),  # NVIDIA's recipe: SR and RHT on
        (False, False, False, (2, 24)),  # every piece off; 3-D x
        (False, True, False, (48,)),
    ],
)
def test_nvfp4_pallas_quantizers_equal_xla_bit_for_bit(rht, stochastic_rounding, weight_2d, lead):
    """y, dx, dw with every operand made by one fused kernel call (interpret mode on the CPU)
    are the XLA quantizers' results bit for bit: same amax, same SR bits, same RHT."""
    x, w, dy = _small_operands(lead)
    switches = dict(rht=rht, stochastic_rounding=stochastic_rounding, weight_2d=weight_2d)
    xla = _recipe_vjp(x, w, dy, quantizer="xla", **switches)
    pallas = _recipe_vjp(x, w, dy, quantizer="pallas", **switches)
    for name, a, b in zip(("y", "dx", "dw"), _bytes(xla), _bytes(pallas)):
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert NVFP4Options().quantizer == "auto"


def test_nvfp4_packed_branch_where_the_fp4_gemm_is_native():
    """gemm="native": every operand is a packed NVFP4Array (the fused kernels in mode "packed";
    dgrad's 16x16 weight is fprop's repacked transposed) and goes to the injected `packed_matmul`
    (`nvfp4_matmul(backend="native")` by default): on the CPU, with the emulated backend standing
    in for it (no monkeypatching), both quantizers give the operand path's values bit for bit,
    with 16x16 and with 1x16 weight scaling."""
    x, w, dy = _small_operands()
    calls = []

    def matmul(a, b):
        calls.append((type(a).__name__, type(b).__name__))
        return nvfp4_matmul(a, b, backend="emulated")

    for weight_2d, quantizers in ((True, ("xla", "pallas")), (False, ("xla",))):
        want = _bytes(_recipe_vjp(x, w, dy, quantizer="xla", gemm="emulated", weight_2d=weight_2d))
        for quantizer in quantizers:
            calls.clear()
            got = _bytes(
                _recipe_vjp(x, w, dy, quantizer=quantizer, gemm="native", packed_matmul=matmul, weight_2d=weight_2d)
            )
            for name, a, b in zip(("y", "dx", "dw"), want, got):
                np.testing.assert_array_equal(a, b, err_msg=f"{quantizer} 2d={weight_2d} {name}")
            # fprop, dgrad, wgrad (jax may trace the forward twice)
            assert len(calls) >= 3 and set(calls) == {("NVFP4Array", "NVFP4Array")}, calls


def test_nvfp4_pallas_recipe_lowers_for_cuda_through_triton(monkeypatch):
    """The recipe's forward and backward with quantizer="pallas", lowered for CUDA on this CPU
    (the kernels compiled, not interpreted): each of the five operands (X, W, dY, RHT'd dY^T and
    X^T) is one Triton kernel (dgrad's 16x16-scaled W is fprop's, transposed), the three GEMMs are
    bf16 x bf16 -> f32 dots."""
    monkeypatch.setattr(
        nvfp4_dot_module, "fused_quantize", functools.partial(nvfp4_dot_module.fused_quantize, interpret=False)
    )
    x, w, dy = _small_operands()
    key = jax.random.key(3)

    def fwd_bwd(a, b, g):
        return _vjp(lambda a, b: nvfp4_dot(a, b, key, options=NVFP4Options(quantizer="pallas")), a, b, g)

    hlo = jax.jit(fwd_bwd).trace(x, w, dy).lower(lowering_platforms=("cuda",)).as_text()
    assert hlo.count("__gpu$xla.gpu.triton") == 5, hlo.count("__gpu$xla.gpu.triton")
    # the three GEMMs; the other dots are the RHT's [.., 16] x [16, 16] in fp32 (the amax of the
    # RHT'd wgrad operands, computed in XLA)
    gemms = re.findall(r"stablehlo.dot_general .*: \(tensor<\w+xbf16>, tensor<\w+xbf16>\) -> tensor<\w+xf32>", hlo)
    rht = re.findall(r"stablehlo.dot_general .*: \(tensor<\w+x16xf32>, tensor<16x16xf32>\)", hlo)
    assert len(gemms) == 3 and len(rht) == 2 and hlo.count("stablehlo.dot_general") == 5, (gemms, rht)


def test_nvfp4_options_reject_an_unknown_quantizer():
    with pytest.raises(NVFP4ToolError, match="quantizer must be one of auto, xla, pallas"):
        NVFP4Options(quantizer="triton")


# (fmt, granularity) of activation, weight, gradient per FP8 scaling mode
FP8_SPECS = {
    "tensor": (("e4m3", "tensor"), ("e4m3", "tensor"), ("e5m2", "tensor")),
    "block": (("e4m3", "block128"), ("e4m3", "block128x128"), ("e4m3", "block128")),
}


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
    gemms = {
        "fprop": (y, (x, act), (w, wgt)),
        "dgrad": (dx, (dy, grad), (w.T, wgt)),
        "wgrad": (dw, (dy.T, grad), (x.T, act)),
    }
    for name, (got, (a, a_spec), (b, b_spec)) in gemms.items():
        a_q = quantize_fp8(a, fmt=a_spec[0], granularity=a_spec[1])
        b_q = quantize_fp8(b, fmt=b_spec[0], granularity=b_spec[1])
        np.testing.assert_array_equal(np.asarray(got), np.asarray(fp8_matmul(a_q, b_q)), err_msg=name)
        # ... and the former formulation (fake-quantized fp32 operands, one fp32 dot) within the
        # fp32 rounding bounds of both (tests/numerics/test_numerics_fp8_gemm.py derives them).
        k = a.shape[-1]
        chunks, chunk_len = (-(-k // 128), 128) if scaling == "block" else (1, k)
        a_deq, b_deq = dequantize_fp8(a_q), dequantize_fp8(b_q)
        old = dot_nt(a_deq, b_deq, precision=jax.lax.Precision.HIGHEST)
        _, bound = oracle.gemm_with_bound(a_deq, b_deq, (chunk_len + chunks + 2) + k)
        assert np.all(np.abs(np.asarray(got, np.float64) - np.asarray(old)) <= bound), name
    # and they really are quantized: not the fp32 product
    assert np.abs(np.asarray(y) - np.asarray(x @ w.T)).max() > 1e-4
