"""NVFP4 quantize/dequantize/pack vs the independent oracle (0 mismatched bytes), tables, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.numerics import (
    check_finite,
    decode_e2m1,
    decode_nvfp4,
    decode_nvfp4_blocks,
    dequantize_nvfp4,
    fake_quantize_nvfp4,
    nvfp4_global_scales,
    nvfp4_operand,
    pack_codes,
    quantize_nvfp4,
    unpack_codes,
)

from fixtures import nvfp4_oracle as oracle

E2M1_MIDPOINTS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


def _bits(a) -> np.ndarray:
    """Raw bytes of an array (so -0.0 != 0.0 and NaN == NaN)."""
    a = np.asarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def _quantize_modes(x, eager: bool, **kwargs):
    """The package quantizer under an outer jax.jit, and optionally eagerly (op by op, slow)."""
    modes = {"jit": jax.jit(lambda v: quantize_nvfp4(v, **kwargs))(jnp.asarray(x))}
    if eager:
        with jax.disable_jit():
            modes["eager"] = quantize_nvfp4(x, **kwargs)
    return modes


def assert_matches_oracle(x, *, block="1d", global_amax=None, eager=False):
    """0 mismatched bytes in packed, scales and global_amax (jitted, and eager if asked); decode."""
    want = oracle.quantize(np.asarray(x), block=block, global_amax=global_amax)
    for mode, q in _quantize_modes(x, eager, block=block, global_amax=global_amax).items():
        np.testing.assert_array_equal(np.asarray(q.packed), want["packed"], err_msg=mode)
        np.testing.assert_array_equal(_bits(q.scales), want["scales"], err_msg=mode)
        assert _bits(np.float32(q.global_amax)) == _bits(want["global_amax"]), mode
    decoded = np.asarray(dequantize_nvfp4(q))
    want_decoded = oracle.dequantize(want["packed"], want["scales"], want["global_amax"])
    np.testing.assert_array_equal(_bits(decoded), _bits(want_decoded))
    return want


# ------------------------------------------------------------------ exhaustive tables


def test_e2m1_decode_table_all_16_codes():
    ours = np.asarray(decode_e2m1(jnp.arange(16, dtype=jnp.uint8)))
    want = np.array([oracle.e2m1_value(c) for c in range(16)], np.float32)
    np.testing.assert_array_equal(_bits(ours), _bits(want))
    assert _bits(ours[8]) == _bits(np.float32(-0.0))
    via_ml_dtypes = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(_bits(ours), _bits(via_ml_dtypes))


def test_e4m3_decode_table_all_256_bytes():
    ours = np.asarray(
        jax.lax.bitcast_convert_type(jnp.arange(256, dtype=jnp.uint8), jnp.float8_e4m3fn).astype(jnp.float32)
    )
    want = np.array([oracle.e4m3_value(b) for b in range(256)], np.float32)
    nan = np.isnan(want)
    assert list(np.flatnonzero(nan)) == [0x7F, 0xFF]
    np.testing.assert_array_equal(np.isnan(ours), nan)
    np.testing.assert_array_equal(ours[~nan], want[~nan])
    assert want[0x7E] == 448.0 and want[1] == 2.0**-9


def test_oracle_e4m3_rounding_agrees_with_ml_dtypes():
    """Cross-check the oracle's own table rounding on every midpoint and its neighbours."""
    values = np.array([oracle.e4m3_value(b) for b in range(0x7F)], np.float64)
    mids = ((values[:-1] + values[1:]) / 2).astype(np.float32)
    probes = np.concatenate([mids, np.nextafter(mids, 0), np.nextafter(mids, 1e9), values[:-1]])
    ours = np.array([oracle.e4m3_rne(v) for v in probes.astype(np.float32)], np.uint8)
    np.testing.assert_array_equal(ours, _bits(probes.astype(ml_dtypes.float8_e4m3fn)))


# ------------------------------------------------------------------ oracle agreement


@pytest.mark.parametrize("block", ["1d", "2d"])
def test_random_normal_matches_oracle(block):
    x = np.random.default_rng(0).standard_normal((48, 64)).astype(np.float32)
    assert_matches_oracle(x, block=block, eager=True)


@pytest.mark.parametrize("block", ["1d", "2d"])
def test_student_t_heavy_tails_match_oracle(block):
    x = np.random.default_rng(1).standard_t(df=2, size=(32, 96)).astype(np.float32) * 1e-3
    assert_matches_oracle(x, block=block)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("block", ["1d", "2d"])
def test_half_precision_input_matches_oracle(dtype, block):
    x = (np.random.default_rng(2).standard_normal((32, 64)) * 7).astype(dtype)
    assert_matches_oracle(x, block=block)


@pytest.mark.parametrize("block", ["1d", "2d"])
def test_given_global_amax_matches_oracle(block):
    x = np.random.default_rng(3).standard_normal((32, 48)).astype(np.float32)
    assert_matches_oracle(x, block=block, global_amax=np.float32(10.0))


def test_given_global_amax_below_block_amax_saturates():
    """A fused-group amax smaller than a block's amax clamps the scale at 448 and codes at 6."""
    x = np.zeros((1, 32), np.float32)
    x[0, :16] = np.linspace(-8, 8, 16)
    want = assert_matches_oracle(x, global_amax=np.float32(2.0))
    assert want["scales"][0, 0] == 0x7E  # 448
    codes = np.stack([want["packed"] & 0xF, want["packed"] >> 4], -1).reshape(1, 32)
    assert codes[0, 0] == 0xF and codes[0, 15] == 0x7  # -6 and +6


def test_e2m1_midpoints_exact_and_ties_to_even():
    """Blocks where x * enc lands exactly on every E2M1 midpoint (enc = 1 and enc = 2)."""
    mids = np.array(E2M1_MIDPOINTS, np.float32)
    rows = []
    for enc, block_amax in [(1.0, 6.0), (2.0, 3.0)]:  # S_enc = 1: scale = bamax / 6
        row = np.concatenate([[block_amax], mids / enc, -mids / enc, mids[:1] * 0.5 / enc])
        rows.append(np.pad(row, (0, 32 - row.size)).astype(np.float32))
    x = np.stack(rows)
    x[0, -1] = 2688.0  # global amax block in its own 1x16 block: S_enc = 1
    want = assert_matches_oracle(x, eager=True)
    codes = np.stack([want["packed"] & 0xF, want["packed"] >> 4], -1).reshape(2, 32)
    # midpoints 0.25 .. 5.0 round (ties to even) to 0, 1, 1, 2, 2, 4, 4 (values); codes:
    expected = [0, 2, 2, 4, 4, 6, 6]
    for r in range(2):
        assert codes[r, 0] == 7  # the block amax itself encodes to 6
        assert list(codes[r, 1:8]) == expected
        assert list(codes[r, 8:15]) == [c | 8 for c in expected]  # -0.25 -> code 8 (-0)
        assert codes[r, 15] == 0


def test_e4m3_scale_midpoints_including_subnormals():
    """bamax such that sdb is exactly every E4M3 midpoint (and one ulp either side)."""
    values = np.array([oracle.e4m3_value(b) for b in range(0x7F)], np.float64)
    mids = ((values[:-1] + values[1:]) / 2).astype(np.float32)
    probes = np.concatenate([mids, np.nextafter(mids, 0), np.nextafter(mids, 1e9)])
    x = np.zeros((probes.size + 1, 16), np.float32)
    x[:-1, 0] = probes
    x[:-1, 1] = -probes / 3
    x[-1, 0] = 448.0  # global amax 448: S_enc = 6, S_enc * fp32(1/6) = 1, so sdb = bamax
    assert_matches_oracle(x, eager=True)
    assert_matches_oracle(x[:-1], global_amax=np.float32(448.0))


def test_zero_tiny_and_global_amax_blocks():
    x = np.zeros((4, 32), np.float32)
    x[0, :16] = 0.0  # all-zero block: scale 0, codes 0
    x[1, :16] = np.linspace(-1e-6, 1e-6, 16)  # tiny block: scale underflows to 0
    x[2, :16] = np.random.default_rng(4).standard_normal(16)
    x[3, 16] = -1000.0  # the global-amax block
    want = assert_matches_oracle(x)
    assert want["scales"][0, 0] == 0 and want["scales"][1, 0] == 0
    assert np.all(want["packed"][0, :8] == 0)
    assert want["scales"][3, 1] == 0x7E  # the global-amax block gets scale 448
    decoded = np.asarray(dequantize_nvfp4(quantize_nvfp4(x)))
    assert np.all(decoded[:2, :16] == 0)


def test_all_zero_tensor():
    x = np.zeros((2, 32), np.float32)
    want = assert_matches_oracle(x)
    assert want["global_amax"] == 0 and not want["packed"].any() and not want["scales"].any()


def test_negative_values_rounding_to_zero_get_code_8():
    x = np.array([[6.0, -0.1, -0.25, 0.1, -0.0, 0.0] + [0.0] * 10], np.float32)
    want = assert_matches_oracle(x)
    codes = np.stack([want["packed"] & 0xF, want["packed"] >> 4], -1).reshape(-1)
    assert list(codes[:6]) == [7, 8, 8, 0, 8, 0]


def test_subnormal_and_extreme_inputs_flush_like_the_oracle():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 32)).astype(np.float32)
    x[0] *= 1e-39  # subnormal values: flushed to signed zero
    x[1] *= 1e-37  # tiny normal values: S_dec becomes subnormal and flushes
    x[2] *= 1e37  # huge values
    for row in x:
        assert_matches_oracle(row[None])
    assert_matches_oracle(x, eager=True)


def test_2d_ragged_rows_and_batch_axes():
    rng = np.random.default_rng(6)
    assert_matches_oracle(rng.standard_normal((40, 32)).astype(np.float32), block="2d")
    assert_matches_oracle(rng.standard_normal((2, 20, 32)).astype(np.float32), block="2d")
    assert_matches_oracle(rng.standard_normal((5, 16)).astype(np.float32), block="2d")


def test_1d_leading_axes():
    assert_matches_oracle(np.random.default_rng(7).standard_normal((2, 3, 32)).astype(np.float32))


# ------------------------------------------------------------------ layout, axis, 2d property


def test_packing_order_matches_float4_bitcast():
    codes = jnp.asarray(np.random.default_rng(8).integers(0, 16, (4, 32)), jnp.uint8)
    values = decode_e2m1(codes).astype(jnp.float4_e2m1fn)
    bitcast = jax.lax.bitcast_convert_type(values.reshape(4, 16, 2), jnp.uint8)
    np.testing.assert_array_equal(np.asarray(pack_codes(codes)), np.asarray(bitcast))
    np.testing.assert_array_equal(np.asarray(unpack_codes(pack_codes(codes))), np.asarray(codes))
    q = quantize_nvfp4(np.array([[6.0, 3.0] + [0.0] * 14], np.float32))
    assert int(q.packed[0, 0]) == 0x57  # element 0 (code 7) low nibble, element 1 (code 5) high


# Stored global decode scales: a typical one, one that is not fl(1 / fl(2688 / amax)) of any
# amax we would write, and one so small that (value * scale) * S_dec flushes to zero.
@pytest.mark.parametrize("s_dec", [np.float32(0.013), np.float32(1 / 3), np.float32(2.0**-120)])
def test_decode_of_stored_bytes_matches_oracle_and_is_dequantize(s_dec):
    """decode_nvfp4 (what the serving simulation reads) with any stored S_dec is the oracle's
    decode; with the S_dec of the record's amax it is dequantize_nvfp4, bit for bit."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((16, 64)).astype(np.float32)
    q = quantize_nvfp4(x)
    got = decode_nvfp4(q.packed, q.scales, s_dec)
    want = oracle.decode(np.asarray(q.packed), _bits(q.scales), s_dec)
    np.testing.assert_array_equal(_bits(got), _bits(want))
    _, own_s_dec = nvfp4_global_scales(q.global_amax)
    np.testing.assert_array_equal(_bits(decode_nvfp4(q.packed, q.scales, own_s_dec)), _bits(dequantize_nvfp4(q)))
    q0 = quantize_nvfp4(x.T, axis=0)
    np.testing.assert_array_equal(_bits(decode_nvfp4(q0.packed, q0.scales, s_dec, axis=0)), _bits(got).T)


def test_decode_refuses_mismatched_bytes():
    q = quantize_nvfp4(np.ones((4, 32), np.float32))
    with pytest.raises(NVFP4ToolError, match=r"'w'.*scales \(4, 2\).*got \(4, 1\)"):
        decode_nvfp4(q.packed, q.scales[:, :1], 1.0, name="w")
    with pytest.raises(NVFP4ToolError, match="'w'.*uint8 codes and float8_e4m3fn scales"):
        decode_nvfp4(q.packed, np.asarray(q.scales).view(np.uint8), 1.0, name="w")


@pytest.mark.parametrize("block", ["1d", "2d"])
def test_axis_0_equals_transposed(block):
    x = np.random.default_rng(9).standard_normal((64, 32)).astype(np.float32)
    q0 = quantize_nvfp4(x, axis=0, block=block)
    qt = quantize_nvfp4(x.T, axis=-1, block=block)
    assert q0.packed.shape == (32, 32) and q0.scales.shape == (4, 32) and q0.axis == 0
    np.testing.assert_array_equal(np.asarray(q0.packed), np.asarray(qt.packed).T)
    np.testing.assert_array_equal(_bits(q0.scales), _bits(qt.scales).T)
    np.testing.assert_array_equal(_bits(dequantize_nvfp4(q0)), _bits(dequantize_nvfp4(qt)).T)


def test_2d_weight_reads_the_same_along_rows_and_columns():
    w = np.random.default_rng(10).standard_normal((48, 64)).astype(np.float32)
    along_k = np.asarray(dequantize_nvfp4(quantize_nvfp4(w, block="2d", axis=1)))
    along_n = np.asarray(dequantize_nvfp4(quantize_nvfp4(w, block="2d", axis=0)))
    np.testing.assert_array_equal(_bits(along_k), _bits(along_n))
    q = quantize_nvfp4(w, block="2d")
    scales = _bits(q.scales)
    assert np.all(scales.reshape(3, 16, 4) == scales.reshape(3, 16, 4)[:, :1, :])


def test_record_is_a_pytree_with_static_metadata():
    x = jnp.ones((16, 32), jnp.bfloat16)
    q = quantize_nvfp4(x)
    leaves, treedef = jax.tree_util.tree_flatten(q)
    assert len(leaves) == 3
    assert q.shape == (16, 32) and q.dtype == jnp.bfloat16 and q.axis == 1 and q.block == "1d"
    assert q.packed.dtype == jnp.uint8 and q.packed.shape == (16, 16)
    assert q.scales.dtype == jnp.float8_e4m3fn and q.scales.shape == (16, 2)
    assert q.global_amax.dtype == jnp.float32 and q.global_amax.shape == ()
    again = jax.tree_util.tree_unflatten(treedef, leaves)
    assert again.shape == q.shape
    out = jax.jit(lambda q: dequantize_nvfp4(q, jnp.bfloat16))(q)
    assert out.dtype == jnp.bfloat16 and np.all(np.asarray(out, np.float32) == 1.0)


# ------------------------------------------------------------------ fake quant


@pytest.mark.parametrize(
    ("kwargs", "dtype"),
    [
        ({}, jnp.float32),
        ({}, jnp.bfloat16),
        ({"block": "2d"}, jnp.float32),
        ({"global_amax": 3.0}, jnp.float32),
        ({"axis": 0}, jnp.bfloat16),
        ({"rounding": "stochastic", "key": jax.random.key(0)}, jnp.float32),
    ],
)
def test_fake_quantize_equals_dequantize_of_quantize(kwargs, dtype):
    x = jnp.asarray(np.random.default_rng(11).standard_normal((32, 48)) * 2, dtype)
    fake = fake_quantize_nvfp4(x, **kwargs)
    assert fake.dtype == dtype
    want = dequantize_nvfp4(quantize_nvfp4(x, **kwargs), dtype)
    np.testing.assert_array_equal(_bits(fake), _bits(want))
    jitted = jax.jit(lambda v: fake_quantize_nvfp4(v, **kwargs))(x)
    np.testing.assert_array_equal(_bits(jitted), _bits(want))


# ------------------------------------------------------------------ the emulated GEMM's operand


def test_operand_values_are_exact_in_bf16_for_every_code_and_scale():
    """e2m1(code) * fp32(e4m3 scale) for all 16 codes x all 126 finite positive E4M3 scales
    (subnormal scales 2^-9 * m included): the bf16 cast changes nothing (<= 6 significant bits,
    nonzero magnitudes in [2^-10, 2688], far from bf16's subnormals)."""
    scale_bytes = np.arange(1, 127, dtype=np.uint8)  # 0x7F is NaN; 0x80.. are negative
    scales = jnp.asarray(scale_bytes.view(ml_dtypes.float8_e4m3fn))
    values = jnp.broadcast_to(decode_e2m1(jnp.arange(16, dtype=jnp.uint8)), (126, 16))
    products = np.asarray(decode_nvfp4_blocks(values, scales, jnp.float32(1.0)))
    as_bf16 = np.asarray(jnp.asarray(products).astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(_bits(as_bf16), _bits(products))  # -0.0 (code 8) kept too
    scales64 = scale_bytes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    want = np.asarray(values, np.float64) * scales64[:, None]
    np.testing.assert_array_equal(products, want)  # the fp32 product itself is exact
    magnitudes = np.abs(products[products != 0])
    assert magnitudes.min() == 2.0**-10 and magnitudes.max() == 2688.0


@pytest.mark.parametrize(
    ("kwargs", "dtype"),
    [
        ({}, jnp.bfloat16),
        ({"block": "2d", "global_amax": 3.0}, jnp.float32),
        ({"axis": 0}, jnp.float16),
        ({"rounding": "stochastic", "key": jax.random.key(0), "block": "2d"}, jnp.bfloat16),
    ],
)
def test_operand_is_the_decode_of_quantize_without_the_global_scale(kwargs, dtype):
    x = jnp.asarray(np.random.default_rng(12).standard_normal((48, 32)) * 3, dtype)
    op = nvfp4_operand(x, **kwargs)
    q = quantize_nvfp4(x, **kwargs)
    assert op.values.dtype == jnp.bfloat16 and op.values.shape == x.shape and op.axis == q.axis
    want = decode_nvfp4(q.packed, q.scales, 1.0, axis=q.axis, dtype=jnp.bfloat16)
    np.testing.assert_array_equal(_bits(op.values), _bits(want))
    assert _bits(np.float32(op.s_dec)) == _bits(np.float32(nvfp4_global_scales(q.global_amax)[1]))
    # times S_dec: the fake-quantized tensor (the same decode product, in the same order)
    fake = fake_quantize_nvfp4(x, dtype=jnp.float32, **kwargs)
    np.testing.assert_array_equal(_bits(op.values.astype(jnp.float32) * op.s_dec), _bits(fake))
    jitted = jax.jit(lambda v: nvfp4_operand(v, **kwargs))(x)
    np.testing.assert_array_equal(_bits(jitted.values), _bits(op.values))


@pytest.mark.parametrize(("block", "low", "high"), [("1d", 0.093, 0.097), ("2d", 0.109, 0.114)])
def test_reference_error_normal(block, low, high):
    x = np.random.default_rng(12).standard_normal((512, 1024)).astype(np.float32)
    err = np.linalg.norm(np.asarray(fake_quantize_nvfp4(x, block=block)) - x) / np.linalg.norm(x)
    assert low < err < high


# ------------------------------------------------------------------ stochastic rounding


def test_stochastic_rounding_is_unbiased_and_picks_neighbours():
    n_samples = 4096
    row = np.random.default_rng(13).standard_normal(32).astype(np.float32) * 2
    row[5] = 7.0  # this block's amax; scale rounding may push x*enc past 6: saturates
    x = np.tile(row, (n_samples, 1))  # every row: same blocks, same scales, own random draws
    q = quantize_nvfp4(x, rounding="stochastic", key=jax.random.key(42))
    q_rne = quantize_nvfp4(x)
    np.testing.assert_array_equal(_bits(q.scales), _bits(q_rne.scales))
    decoded = np.asarray(dequantize_nvfp4(q), np.float64)

    want = oracle.quantize(row[None])
    enc, s_dec = want["enc"][0].astype(np.float64), float(want["s_dec"])
    scale = np.array([oracle.e4m3_value(int(b)) for b in want["scales"][0]]).repeat(16)
    y = np.clip(row * enc, -6, 6)  # what SR rounds, in units of the E2M1 grid
    step = scale * s_dec  # value of one E2M1 unit
    lo_hi = np.array([oracle.e2m1_neighbours(abs(v)) for v in y])
    y_samples = decoded / step
    neighbour = np.isclose(np.abs(y_samples), lo_hi[:, 0], rtol=0, atol=1e-6) | np.isclose(
        np.abs(y_samples), lo_hi[:, 1], rtol=0, atol=1e-6
    )
    assert neighbour.all()
    assert np.all((np.sign(y_samples) == np.sign(y)) | (y_samples == 0))
    gap = lo_hi[:, 1] - lo_hi[:, 0]
    bound = 5 * (gap / 2) / np.sqrt(n_samples) + 1e-5  # 5 standard errors (Bernoulli sd <= gap/2)
    assert np.all(np.abs(y_samples.mean(axis=0) - y) <= bound)
    assert np.abs(y_samples.mean(axis=0) - y).max() > 0  # it is random, not RNE


def test_stochastic_rounding_depends_on_key_only():
    x = np.random.default_rng(14).standard_normal((64, 32)).astype(np.float32)
    a = quantize_nvfp4(x, rounding="stochastic", key=jax.random.key(1))
    b = quantize_nvfp4(x, rounding="stochastic", key=jax.random.key(1))
    c = quantize_nvfp4(x, rounding="stochastic", key=jax.random.key(2))
    np.testing.assert_array_equal(np.asarray(a.packed), np.asarray(b.packed))
    assert (np.asarray(a.packed) != np.asarray(c.packed)).any()


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_non_finite_input_raises_naming_the_tensor(bad, dtype):
    x = np.ones((2, 16), np.float32)
    x[1, 3] = bad
    with pytest.raises(NVFP4ToolError, match="'layers.0.q_proj'.*inf or NaN"):
        quantize_nvfp4(jnp.asarray(x, dtype), name="layers.0.q_proj")
    with pytest.raises(NVFP4ToolError, match="inf or NaN"):
        fake_quantize_nvfp4(x)
    with pytest.raises(NVFP4ToolError, match="'w'"):
        check_finite(x, "w")


def test_k_not_multiple_of_16_raises_with_shape():
    with pytest.raises(NVFP4ToolError, match=r"shape \(4, 24\).*not a multiple of 16"):
        quantize_nvfp4(np.ones((4, 24), np.float32), name="w")
    with pytest.raises(NVFP4ToolError, match=r"shape \(24, 4\)"):
        quantize_nvfp4(np.ones((24, 4), np.float32), axis=1)
    with pytest.raises(NVFP4ToolError, match=r"'x' shape \(4, 24\).*not a multiple of 16"):
        nvfp4_operand(np.ones((4, 24), np.float32), name="x")  # the same checks


def test_bad_options_raise():
    x = np.ones((16, 16), np.float32)
    with pytest.raises(NVFP4ToolError, match="key"):
        quantize_nvfp4(x, rounding="stochastic")
    with pytest.raises(NVFP4ToolError, match="global_amax"):
        quantize_nvfp4(x, global_amax=-1.0)
    with pytest.raises(NVFP4ToolError, match="global_amax"):
        quantize_nvfp4(x, global_amax=np.inf)
    with pytest.raises(NVFP4ToolError, match="2d"):
        quantize_nvfp4(np.ones(32, np.float32), block="2d")
    with pytest.raises(NVFP4ToolError, match="dtype"):
        quantize_nvfp4(np.ones((16, 16), np.int32))
    with pytest.raises(NVFP4ToolError, match="axis"):
        quantize_nvfp4(x, axis=2)


def test_traced_input_skips_value_check_but_jit_works():
    """Inside jit the finite check cannot run: documented; callers check concrete inputs."""
    x = jnp.ones((2, 16)).at[0, 0].set(jnp.inf)
    q = jax.jit(lambda v: quantize_nvfp4(v))(x)  # no raise while tracing
    assert q.packed.shape == (2, 8)
    assert not bool(jax.jit(lambda v: jnp.isfinite(v).all())(x))  # how traced callers check
