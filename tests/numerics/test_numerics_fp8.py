"""FP8 current-scaling quantizers vs a tiny numpy oracle (ml_dtypes does only the final cast)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.numerics import dequantize_fp8, fake_quantize_fp8, quantize_fp8

from fixtures import nvfp4_oracle as oracle

TILES = {"tensor": (None, None), "channel": (1, None), "block128": (1, 128), "block128x128": (128, 128)}
SCALE_SHAPES = {"tensor": (), "channel": (160, 1), "block128": (160, 3), "block128x128": (2, 3)}


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


@pytest.mark.parametrize("granularity", list(TILES))
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_matches_oracle(fmt, granularity):
    rng = np.random.default_rng(0)
    x = (rng.standard_t(df=3, size=(160, 320)) * np.linspace(0.01, 50, 320)).astype(np.float32)
    x[:16, :128] = 0.0  # a zero block: scale 1, data 0
    q = quantize_fp8(x, fmt=fmt, granularity=granularity)
    assert q.scale.shape == SCALE_SHAPES[granularity]
    assert q.data.dtype == {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}[fmt]
    want_data, want_scale = oracle.quantize_fp8(x, fmt, *TILES[granularity])
    decoded = np.asarray(dequantize_fp8(q))
    np.testing.assert_array_equal(_bits(np.asarray(q.data.astype(jnp.float32))), _bits(want_data))
    np.testing.assert_array_equal(_bits(decoded), _bits(want_data * want_scale))
    assert not np.isnan(decoded).any()
    fake = jax.jit(lambda v: fake_quantize_fp8(v, fmt=fmt, granularity=granularity))(x)
    np.testing.assert_array_equal(_bits(fake), _bits(decoded))


def test_fp8_bf16_input_and_clamp_at_max():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((4, 256)) * 100, jnp.bfloat16)
    q = quantize_fp8(x, granularity="channel")
    data = np.asarray(q.data.astype(jnp.float32))
    assert np.all(np.abs(data).max(axis=1) == 448.0)  # each row's amax maps to the max, no NaN
    want_data, _ = oracle.quantize_fp8(np.asarray(x, np.float32), "e4m3", 1, None)
    np.testing.assert_array_equal(data, want_data)
    assert fake_quantize_fp8(x).dtype == jnp.bfloat16


# (x, static scale): 2.734375 / 7 is exactly the E4M3 midpoint 0.390625, which rounds to even
# (0.375, decoded 2.625); x * fl(1/7) lands above it and would round to 0.40625 (2.84375), so
# this pins a true division.
STATIC_CASES = [(np.float32(2.734375), np.float32(7.0)), (None, np.float32(0.0123456)), (None, np.float32(2.0**-10))]


@pytest.mark.parametrize("x0, scale", STATIC_CASES)
def test_fp8_static_scale_matches_oracle(x0, scale):
    """fake_quantize_fp8(scale=): a stored input_scale as a serving engine applies it:
    clamp(x / scale) to E4M3 (values beyond 448 * scale saturate), times scale."""
    x = (np.random.default_rng(2).standard_normal((8, 64)) * 3).astype(np.float32)
    if x0 is not None:
        x[0, 0] = x0
    want_data, want_scale = oracle.quantize_fp8(x, "e4m3", None, None, static_scale=scale)
    got = jax.jit(lambda v: fake_quantize_fp8(v, scale=scale))(x)
    np.testing.assert_array_equal(_bits(got), _bits(want_data * want_scale))
    if x0 is not None:
        assert float(got[0, 0]) == 2.625
    bf16 = fake_quantize_fp8(jnp.asarray(x, jnp.bfloat16), scale=scale, dtype=jnp.bfloat16)
    assert bf16.dtype == jnp.bfloat16


@pytest.mark.parametrize(
    "scale, granularity, match",
    [
        (0.0, "tensor", "finite and > 0"),
        (np.inf, "tensor", "finite and > 0"),
        (-1.0, "tensor", "finite and > 0"),
        (1.0, "channel", "granularity 'tensor'"),
        (np.ones(2, np.float32), "tensor", "must be a scalar"),
    ],
)
def test_fp8_static_scale_errors(scale, granularity, match):
    with pytest.raises(NVFP4ToolError, match=f"'x'.*{match}"):
        fake_quantize_fp8(np.ones((2, 16), np.float32), granularity=granularity, scale=scale, name="x")


def test_fp8_zero_tensor_scale_one():
    q = quantize_fp8(np.zeros((2, 8), np.float32))
    assert float(q.scale) == 1.0 and not np.asarray(q.data.astype(jnp.float32)).any()


def test_fp8_errors():
    with pytest.raises(NVFP4ToolError, match="'w'.*inf or NaN"):
        quantize_fp8(np.array([1.0, np.nan], np.float32), name="w")
    with pytest.raises(NVFP4ToolError, match="granularity"):
        quantize_fp8(np.ones(4, np.float32), granularity="row")
    with pytest.raises(NVFP4ToolError, match="2-D"):
        quantize_fp8(np.ones(4, np.float32), granularity="channel")
    with pytest.raises(NVFP4ToolError, match="fmt"):
        quantize_fp8(np.ones(4, np.float32), fmt="e3m4")
