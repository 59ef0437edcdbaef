"""The 16-point random Hadamard transform: exact orthonormality, round trip, wgrad identity."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.numerics import rht16, rht_matrix

SIGNS = [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]


def test_matrix_is_signed_sylvester_and_exactly_orthonormal():
    h = np.asarray(rht_matrix())
    assert h.dtype == np.float32 and set(np.abs(h).ravel()) == {0.25}
    # Sylvester: H16[i, j] = (-1)^popcount(i & j); row i flipped by s[i].
    want = np.array([[SIGNS[i] * (-1) ** bin(i & j).count("1") / 4 for j in range(16)] for i in range(16)], np.float32)
    np.testing.assert_array_equal(h, want)
    np.testing.assert_array_equal(np.asarray(rht_matrix() @ rht_matrix().T), np.eye(16))
    np.testing.assert_array_equal(np.asarray(rht_matrix().T @ rht_matrix()), np.eye(16))


def test_chunks_are_row_vectors_times_h():
    x = np.random.default_rng(0).standard_normal((3, 32)).astype(np.float32)
    h = np.asarray(rht_matrix(), np.float64)
    want = np.concatenate([x[:, :16] @ h, x[:, 16:] @ h], axis=1)
    np.testing.assert_allclose(np.asarray(rht16(x)), want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(rht16(x.T, axis=0)), want.T, rtol=0, atol=1e-6)


def test_inverse_round_trip():
    x = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(rht16(rht16(x), inverse=True)), x, rtol=0, atol=1e-6)
    assert rht16(jnp.asarray(x, jnp.bfloat16)).dtype == jnp.bfloat16


def test_wgrad_identity_along_tokens():
    rng = np.random.default_rng(2)
    tokens, n_out, k_in = 64, 24, 40
    dy_TxN = rng.standard_normal((tokens, n_out)).astype(np.float32)
    x_TxK = rng.standard_normal((tokens, k_in)).astype(np.float32)
    dw_want = dy_TxN.astype(np.float64).T @ x_TxK.astype(np.float64)
    dyt_h = np.asarray(rht16(dy_TxN.T, axis=-1), np.float64)  # dY^T H, chunks along tokens
    xt_h = np.asarray(rht16(x_TxK.T, axis=-1), np.float64)  # X^T H
    dw = dyt_h @ xt_h.T
    np.testing.assert_allclose(dw, dw_want, rtol=0, atol=1e-4 * np.abs(dw_want).max())
    # The same with the transform along axis 0 of the untransposed tensors.
    dw0 = np.asarray(rht16(dy_TxN, axis=0), np.float64).T @ np.asarray(rht16(x_TxK, axis=0))
    np.testing.assert_allclose(dw0, dw_want, rtol=0, atol=1e-4 * np.abs(dw_want).max())


def test_length_not_multiple_of_16_raises():
    with pytest.raises(NVFP4ToolError, match=r"'dy' shape \(4, 24\)"):
        rht16(np.ones((4, 24), np.float32), name="dy")
