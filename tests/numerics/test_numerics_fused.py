"""The fused Pallas quantizers (interpret mode on the CPU) vs the XLA quantizers and the oracle.

Every case compares bytes: packed codes and E4M3 scales with `quantize_nvfp4` of the same operand
(x, x.T, and/or rht16 of it) and with the independent oracle (RNE), and the bf16 operand with the
decode of those bytes at S_dec = 1 and with `nvfp4_operand` (the XLA operand). Stochastic rounding:
the same bits give the keyed XLA result, and the mean of many draws is unbiased. Shapes are small: interpret mode
compiles each case.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.numerics import (
    decode_nvfp4,
    dequantize_nvfp4,
    nvfp4_global_scales,
    nvfp4_operand,
    quantize_nvfp4,
    rht16,
    stochastic_bits,
    tensor_amax,
)
from nvfp4tool.numerics.fused import fused_quantize

from fixtures import nvfp4_oracle as oracle

# (block, rht, transpose, dtype, x shape, global amax / max|op|); rows of the operand that are not
# a multiple of the 32-row kernel tile (or of 16 for 2d) exercise the ragged last tile.
RNE_CASES = [
    ("1d", False, False, jnp.bfloat16, (40, 64), 1.0),
    ("1d", False, False, jnp.float32, (32, 48), 1.0),  # K = 48: three 16-column kernel tiles
    ("2d", False, False, jnp.bfloat16, (40, 64), 0.5),  # a shared amax below max|x|: saturates
    ("2d", False, False, jnp.float32, (48, 32), 1.0),
    ("1d", True, False, jnp.bfloat16, (40, 64), 1.0),
    ("1d", True, False, jnp.float32, (32, 32), 1.0),
    ("1d", False, True, jnp.bfloat16, (64, 40), 1.0),  # quantized along the first axis
    ("2d", False, True, jnp.float32, (32, 48), 1.0),
    ("1d", True, True, jnp.bfloat16, (64, 40), 1.0),  # the wgrad operand: RHT of x.T
]


def _operand(x, rht, transpose):
    """What the fused kernel quantizes, built with the XLA ops."""
    op = x.T if transpose else x
    return rht16(op) if rht else op


def _bytes(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(np.uint16)


def _x(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-3, 4, shape))  # blocks of mixed range
    return jnp.asarray(x, dtype)


def _assert_same(fused_packed, fused_operand, want, want_operand):
    """Packed bytes equal `want` (quantize_nvfp4); the operand equals the decode of those bytes at
    S_dec = 1 and `want_operand` (nvfp4_operand), S_dec included."""
    np.testing.assert_array_equal(np.asarray(fused_packed.packed), np.asarray(want.packed))
    np.testing.assert_array_equal(_bytes(fused_packed.scales), _bytes(want.scales))
    decoded = decode_nvfp4(want.packed, want.scales, 1.0, dtype=jnp.bfloat16)
    assert fused_operand.values.dtype == jnp.bfloat16 and fused_operand.axis == 1
    np.testing.assert_array_equal(_bytes(fused_operand.values), _bytes(decoded))
    np.testing.assert_array_equal(_bytes(fused_operand.values), _bytes(want_operand.values))
    assert fused_operand.s_dec == want_operand.s_dec == nvfp4_global_scales(want.global_amax)[1]


@pytest.mark.parametrize("block,rht,transpose,dtype,shape,amax_factor", RNE_CASES)
def test_fused_rne_equals_xla_and_oracle(block, rht, transpose, dtype, shape, amax_factor):
    x = _x(shape, dtype)
    op = _operand(x, rht, transpose)
    gamax = tensor_amax(op) * amax_factor
    kwargs = dict(block=block, rht=rht, transpose=transpose)
    packed = fused_quantize(x, gamax, mode="packed", **kwargs)
    operand = fused_quantize(x, gamax, mode="operand", **kwargs)
    want = quantize_nvfp4(op, block=block, global_amax=gamax)
    _assert_same(packed, operand, want, nvfp4_operand(op, block=block, global_amax=gamax))
    assert (packed.shape, packed.axis, packed.dtype) == (op.shape, 1, op.dtype)
    ref = oracle.quantize(np.asarray(op, np.float32), block=block, global_amax=np.float32(gamax))
    np.testing.assert_array_equal(np.asarray(packed.packed), ref["packed"])
    np.testing.assert_array_equal(_bytes(packed.scales), ref["scales"])
    ref_operand = oracle.decode(ref["packed"], ref["scales"], np.float32(1.0))
    np.testing.assert_array_equal(np.asarray(operand.values, np.float32), ref_operand)  # exact in bf16


@pytest.mark.parametrize(
    "block,rht,transpose,dtype,shape",
    [
        ("1d", False, False, jnp.bfloat16, (40, 64)),
        ("2d", True, True, jnp.float32, (64, 40)),
    ],
)
def test_fused_stochastic_equals_xla_with_the_same_bits(block, rht, transpose, dtype, shape):
    x = _x(shape, dtype, seed=1)
    op = _operand(x, rht, transpose)
    gamax, key = tensor_amax(op), jax.random.key(7)
    bits = stochastic_bits(key, op.shape)
    kwargs = dict(block=block, rht=rht, transpose=transpose, rounding="stochastic", bits=bits)
    packed = fused_quantize(x, gamax, mode="packed", **kwargs)
    operand = fused_quantize(x, gamax, mode="operand", **kwargs)
    want = quantize_nvfp4(op, block=block, global_amax=gamax, rounding="stochastic", key=key)
    _assert_same(
        packed, operand, want, nvfp4_operand(op, block=block, global_amax=gamax, rounding="stochastic", key=key)
    )
    assert (
        np.asarray(packed.packed) != np.asarray(quantize_nvfp4(op, block=block, global_amax=gamax).packed)
    ).any()  # it is not RNE


def test_fused_stochastic_is_unbiased():
    n_samples = 2048
    row = np.random.default_rng(13).standard_normal(32).astype(np.float32) * 2
    x = jnp.asarray(np.tile(row, (n_samples, 1)))  # every row: same blocks, own random bits
    gamax = tensor_amax(x)
    bits = stochastic_bits(jax.random.key(3), x.shape)
    q = fused_quantize(x, gamax, rounding="stochastic", bits=bits)
    decoded = np.asarray(dequantize_nvfp4(q), np.float64)

    want = oracle.quantize(row[None], global_amax=np.float32(gamax))
    enc, s_dec = want["enc"][0].astype(np.float64), float(want["s_dec"])
    scale = np.array([oracle.e4m3_value(int(b)) for b in want["scales"][0]]).repeat(16)
    y = np.clip(row * enc, -6, 6)  # what SR rounds, in units of the E2M1 grid
    y_samples = decoded / (scale * s_dec)
    lo_hi = np.array([oracle.e2m1_neighbours(abs(v)) for v in y])
    gap = lo_hi[:, 1] - lo_hi[:, 0]
    bound = 5 * (gap / 2) / np.sqrt(n_samples) + 1e-5  # 5 standard errors (Bernoulli sd <= gap/2)
    assert np.all(np.abs(y_samples.mean(axis=0) - y) <= bound)
    assert np.abs(y_samples.mean(axis=0) - y).max() > 0  # it is random, not RNE


@pytest.mark.parametrize(
    "kwargs",
    [
        {"mode": "packed", "rounding": "stochastic", "block": "2d", "rht": True, "transpose": True},
        {"mode": "operand"},
    ],
)
def test_fused_lowers_for_cuda_through_triton(kwargs):
    """Cross-lowering on the CPU: every op of the kernel has a Pallas Triton lowering rule (the
    compile of that Triton IR for a GPU needs a GPU and is left to the device check)."""
    x = jnp.zeros((64, 256), jnp.bfloat16)
    shape = (256, 64) if kwargs.get("transpose") else (64, 256)
    bits = jnp.zeros(shape, jnp.uint32) if kwargs.get("rounding") == "stochastic" else None
    fn = jax.jit(lambda v, a, b: fused_quantize(v, a, bits=b, interpret=False, **kwargs))
    lowered = fn.trace(x, jnp.float32(1.0), bits).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text()


@pytest.mark.parametrize(
    "x,kwargs,match",
    [
        (np.zeros((2, 16, 16), np.float32), {}, "2-D"),
        (np.zeros((16, 40), np.float32), {}, "not a multiple of 16"),
        (np.zeros((40, 16), np.float32), {"transpose": True}, "not a multiple of 16"),
        (np.zeros((16, 16), np.int32), {}, "dtype"),
        (np.full((16, 16), np.inf, np.float32), {}, "inf or NaN"),
        (np.zeros((16, 16), np.float32), {"mode": "fp4"}, "mode"),
        (np.zeros((16, 16), np.float32), {"rounding": "stochastic"}, "uint32 bits"),
        (
            np.zeros((16, 32), np.float32),
            {"rounding": "stochastic", "bits": np.zeros((16, 32), np.int32)},
            "uint32 bits",
        ),
        (
            np.zeros((32, 16), np.float32),
            {"rounding": "stochastic", "bits": np.zeros((32, 16), np.uint32), "transpose": True},
            r"shape \(16, 32\)",
        ),
        (np.zeros((16, 16), np.float32), {"bits": np.zeros((16, 16), np.uint32)}, "without"),
    ],
)
def test_fused_bad_arguments(x, kwargs, match):
    with pytest.raises(NVFP4ToolError, match=match):
        fused_quantize(x, 1.0, name="w", **kwargs)
