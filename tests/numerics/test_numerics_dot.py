"""The one GEMM body (numerics.dot): fp32 accumulation, compute dtype, bias in fp32, dtype out."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from nvfp4tool.numerics import dense, dot_nt, linear_output

F32 = np.float32
RNG = np.random.default_rng(0)
X = RNG.standard_normal((2, 3, 64)).astype(F32)
W = RNG.standard_normal((24, 64)).astype(F32)
B = RNG.standard_normal(24).astype(F32)


def _as(a: np.ndarray, dtype) -> np.ndarray:
    """`a` rounded to `dtype` (None: unchanged), back in float64."""
    return a.astype(np.float64) if dtype is None else a.astype(dtype).astype(np.float64)


# (x dtype, compute dtype, bias?, output tolerance relative to the fp64 product of the rounded
# operands: the fp32 sum order, plus the final rounding to the output dtype)
CASES = [
    (jnp.float32, None, True, 1e-5),
    (jnp.float32, jnp.bfloat16, True, 1e-5),
    (jnp.bfloat16, None, False, 2**-7),
    (jnp.bfloat16, None, True, 2**-7),
]


@pytest.mark.parametrize("x_dtype, compute_dtype, bias, rtol", CASES)
def test_dense_rounds_operands_to_the_compute_dtype_and_adds_bias_in_fp32(x_dtype, compute_dtype, bias, rtol):
    x = jnp.asarray(X, x_dtype)
    y = dense(x, jnp.asarray(W), jnp.asarray(B) if bias else None, compute_dtype=compute_dtype)
    assert y.dtype == x_dtype and y.shape == (2, 3, 24)
    operand = {jnp.bfloat16: ml_dtypes.bfloat16}.get(compute_dtype or x_dtype)
    want = _as(np.asarray(x, F32), operand) @ _as(W, operand).T + (B if bias else 0)
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=rtol, atol=rtol * 8)


def test_dot_nt_accumulates_in_fp32_and_highest_is_full_fp32():
    xb = jnp.asarray(X, jnp.bfloat16)
    y = dot_nt(xb, jnp.asarray(W))  # w cast to bf16: bf16 products are exact in fp32
    assert y.dtype == jnp.float32
    want = _as(X, ml_dtypes.bfloat16) @ _as(W, ml_dtypes.bfloat16).T
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-6, atol=1e-5)
    hi = jax.jit(lambda a, b: dot_nt(a, b, precision=jax.lax.Precision.HIGHEST))(X, W)
    np.testing.assert_allclose(np.asarray(hi), X.astype(np.float64) @ W.T.astype(np.float64), rtol=1e-6, atol=1e-5)


def test_linear_output_adds_the_bias_before_the_cast():
    """1 + 2^-8 is a bf16 tie (rounds to 1.0); with the bias 2^-12 added in fp32 first it rounds
    up to 1 + 2^-7. Casting first and adding in bf16 would give 1.0."""
    y = jnp.full((2, 3), 1.0 + 2.0**-8, jnp.float32)
    b = jnp.full((3,), 2.0**-12, jnp.float32)
    out = linear_output(y, b, jnp.bfloat16)
    assert out.dtype == jnp.bfloat16 and np.all(np.asarray(out, F32) == 1.0 + 2.0**-7)
    assert np.all(np.asarray(linear_output(y, None, jnp.bfloat16), F32) == 1.0)
    assert np.all(np.asarray(linear_output(y, b, jnp.float32)) == F32(1.0 + 2.0**-8 + 2.0**-12))


def test_computed_after_widens_one_weight_at_a_time_with_the_same_values():
    """A chain of GEMMs on BF16 weights in fp32: widening each weight after its input exists keeps
    one widened weight in the program's temporaries instead of all of them, and changes no value."""
    import jax

    from nvfp4tool.numerics import computed_after, dense

    k, count = 512, 6
    widen = lambda w: w.astype(jnp.float32)  # noqa: E731

    def chain(ws, x, after):
        for w in ws:
            x = dense(x, computed_after(x, widen, w) if after else widen(w))
        return x

    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.standard_normal((k, k)) / np.sqrt(k), jnp.bfloat16) for _ in range(count)]
    x = jnp.asarray(rng.standard_normal((8, k)), jnp.float32)
    temp = {}
    outs = {}
    for after in (False, True):
        compiled = jax.jit(lambda ws, x: chain(ws, x, after)).lower(ws, x).compile()
        temp[after] = compiled.memory_analysis().temp_size_in_bytes
        outs[after] = np.asarray(compiled(ws, x))
    np.testing.assert_array_equal(outs[True], outs[False])
    one_weight = k * k * 4
    assert temp[False] >= count * one_weight  # XLA widens every weight up front
    assert temp[True] < 2 * one_weight + 8 * k * 4 * 4, temp


@pytest.mark.parametrize("n, rows, exact", [(1024, 128, True), (1000, 96, False)])
def test_dense_widening_in_row_blocks_is_dense(monkeypatch, n, rows, exact):
    """A weight widened a block of rows at a time gives the one-GEMM values (bit for bit where the
    CPU kernel blocks the same way, as for power-of-two blocks; else within fp32 rounding), bias and
    stored-weight decoders included, and never holds the whole weight widened."""
    import jax

    from nvfp4tool.numerics import dense, dense_widening, dot

    rng = np.random.default_rng(1)
    k = 256
    monkeypatch.setattr(dot, "WIDEN_BYTES", rows * k * 4)
    x = jnp.asarray(rng.standard_normal((2, 5, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((n, k)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((n,)), jnp.float32)
    expected = np.asarray(dense(x, w.astype(jnp.float32), b))
    compiled = jax.jit(dense_widening).lower(x, w, b).compile()
    got = np.asarray(compiled(x, w, b))
    if exact:
        np.testing.assert_array_equal(got, expected)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)  # sums of 256 products of ~N(0, 1)
    assert compiled.memory_analysis().temp_size_in_bytes < n * k * 4 / 2  # never the whole weight widened
    doubled = jax.jit(
        lambda x, w: dense_widening(x, w, widen_rows=lambda w, start, stop: 2 * w[start:stop].astype(jnp.float32))
    )(x, w)
    np.testing.assert_allclose(
        np.asarray(doubled), 2 * np.asarray(dense(x, w.astype(jnp.float32))), rtol=1e-5, atol=2e-4
    )
