"""Block helpers: exact division under XLA, subnormal flushing, tile reduction and expansion."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4tool.numerics.blocks import exact_divide, expand_tiles, flush_subnormal, tile_amax


def test_exact_divide_is_ieee_division_under_jit():
    """XLA turns a / broadcast(b) into a * (1/b); exact_divide must not be turned."""
    a = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
    b = np.float32(0.3)
    want = a / b  # numpy: correctly rounded fp32 division
    ours = np.asarray(jax.jit(exact_divide)(a, b))
    np.testing.assert_array_equal(ours, want)
    by_constant = np.asarray(jax.jit(lambda v: exact_divide(v, jnp.float32(0.3)))(a))
    np.testing.assert_array_equal(by_constant, want)
    if jax.default_backend() == "cpu":  # tripwire for the XLA:CPU rewrite this helper exists for
        plain = np.asarray(jax.jit(lambda v, w: v / w)(a, b))
        assert (plain != want).any(), "XLA no longer rewrites the division: simplify exact_divide"


def test_flush_subnormal_keeps_sign():
    x = jnp.asarray(np.array([1e-39, -1e-39, 2.0**-126, -3.0, 0.0], np.float32))
    out = np.asarray(jax.jit(flush_subnormal)(x))
    want = np.array([0.0, -0.0, 2.0**-126, -3.0, 0.0], np.float32)
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))


def test_tile_amax_ragged_and_expand():
    x = np.abs(np.random.default_rng(1).standard_normal((2, 20, 40))).astype(np.float32)
    got = np.asarray(tile_amax(jnp.asarray(x), 16, 16))
    assert got.shape == (2, 2, 3)
    assert got[1, 1, 2] == x[1, 16:, 32:].max() and got[0, 0, 0] == x[0, :16, :16].max()
    rows = np.asarray(tile_amax(jnp.asarray(x), 1, 16))
    assert rows.shape == (2, 20, 3) and rows[0, 5, 2] == x[0, 5, 32:].max()
    back = np.asarray(expand_tiles(jnp.asarray(got), 16, 16, x.shape))
    assert back.shape == x.shape and back[1, 19, 39] == got[1, 1, 2]
