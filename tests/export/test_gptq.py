"""GPTQ for NVFP4 (`nvfp4tool.export.gptq`) against an independent slow reference written here from
the paper (Frantar et al. 2022, Algorithm 1, lazy batches) with the fixed NVFP4 scales of the
test oracle and its own E2M1 nearest-code rounding; its output error against RTN's."""

from __future__ import annotations

import numpy as np
import pytest

from nvfp4tool.export.gptq import block_order, gptq_quantize
from nvfp4tool.families import hessian_group as hessian_key
from nvfp4tool.numerics import dequantize_nvfp4, quantize_nvfp4

from fixtures import nvfp4_oracle as oracle

F32 = np.float32


def reference_gptq(w, h, *, block, damp, block_size, act_order, updated_scales=False):
    """(codes [N, K], scales bytes [N, K/16], global amax) of GPTQ with RTN scales, in numpy; with
    `updated_scales`, each 16-column block's RTN scales come from the weights as updated when the
    loop reaches the block (the original GPTQ's groups), else from the original weight."""
    n, k = w.shape
    q = oracle.quantize(w, block=block, global_amax=F32(np.abs(w).max()))
    scale_bytes = q["scales"].copy()
    scale_of = np.vectorize(lambda b: F32(oracle.e4m3_value(int(b))))(scale_bytes).astype(F32)
    enc, s_dec = q["enc"].copy(), q["s_dec"]
    w = w.astype(F32).copy()
    h = h.astype(F32).copy()
    dead = np.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    perm = np.arange(k)
    if act_order:  # whole 16-column blocks by descending diag sum, stable
        sums = np.diag(h).astype(np.float64).reshape(-1, 16).sum(axis=1)
        perm = np.concatenate([np.arange(b * 16, b * 16 + 16) for b in np.argsort(-sums, kind="stable")])
    h = h + F32(damp) * F32(np.mean(np.diag(h))) * np.eye(k, dtype=F32)
    w, h = w[:, perm], h[perm][:, perm]
    u = np.linalg.cholesky(np.linalg.inv(h.astype(np.float64))).T.astype(F32)  # H^-1 = U^T U
    codes = np.zeros((n, k), np.uint8)
    for i in range(0, k, block_size):
        stop = min(i + block_size, k)
        errs = np.zeros((n, stop - i), F32)
        for j in range(i, stop):
            col = perm[j]
            if updated_scales and j % 16 == 0:  # a block's first column (blocks stay whole under the order)
                fresh = oracle.quantize(w[:, j : j + 16], block=block, global_amax=q["global_amax"])
                enc[:, col : col + 16] = fresh["enc"]
                scale_bytes[:, col // 16] = fresh["scales"][:, 0]
                scale_of[:, col // 16] = [F32(oracle.e4m3_value(int(b))) for b in fresh["scales"][:, 0]]
            for r in range(n):
                y = oracle.mul(w[r, j], enc[r, col])
                code = oracle.e2m1_rne(min(abs(y), F32(6.0))) | (0b1000 if np.signbit(w[r, j]) else 0)
                codes[r, col] = code
                deq = oracle.mul(oracle.mul(F32(oracle.e2m1_value(code)), scale_of[r, col // 16]), s_dec)
                errs[r, j - i] = (w[r, j] - deq) / u[j, j]
            w[:, j + 1 : stop] -= np.outer(errs[:, j - i], u[j, j + 1 : stop])
        w[:, stop:] -= errs @ u[i:stop, stop:]
    return codes, scale_bytes, q["global_amax"]


def _codes(packed):
    return np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)


def _correlated_inputs(rng, tokens, k):
    """Calibration-like inputs: correlated channels with a few large ones."""
    mix = rng.standard_normal((k, k)).astype(F32) / np.sqrt(k)
    x = rng.standard_normal((tokens, k)).astype(F32) @ (np.eye(k, dtype=F32) + 0.8 * mix)
    return x * np.where(rng.random(k) < 0.1, 4.0, 1.0).astype(F32)


@pytest.mark.parametrize("block", ["1d", "2d"])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("block_scales", ["original", "updated"])
def test_matches_reference_exactly(block, act_order, block_scales):
    rng = np.random.default_rng(3)
    n, k = 32, 96
    w = rng.standard_normal((n, k)).astype(F32)
    x = _correlated_inputs(rng, 256, k)
    h = x.T @ x
    h[:, 40] = h[40, :] = 0  # a dead column
    codes, scales, gamax = reference_gptq(
        w, h, block=block, damp=0.05, block_size=32, act_order=act_order, updated_scales=block_scales == "updated"
    )
    q, _ = gptq_quantize(
        w, h, block=block, global_amax=gamax, damp=0.05, block_size=32, act_order=act_order, block_scales=block_scales
    )
    if block_scales == "updated":  # the updated weights chose other scales than the original's
        original, _ = gptq_quantize(w, h, block=block, global_amax=gamax, damp=0.05, block_size=32, act_order=act_order)
        assert (np.asarray(original.scales).view(np.uint8) != scales).any()
    np.testing.assert_array_equal(np.asarray(q.scales).view(np.uint8), scales)
    np.testing.assert_array_equal(_codes(np.asarray(q.packed)), codes)
    assert (codes[:, 40] & 0x7 == 0).all()  # a dead column's weights are dropped


@pytest.mark.parametrize("method", ["rtn", "4over6", "mse"])
@pytest.mark.parametrize("block_scales", ["original", "updated"])
def test_lower_output_error_than_rtn(method, block_scales):
    rng = np.random.default_rng(0)
    n, k = 64, 256
    w = rng.standard_normal((n, k)).astype(F32)
    x = _correlated_inputs(rng, 1024, k)
    h = x.T @ x
    q, err = gptq_quantize(w, h, method=method, global_amax=np.abs(w).max(), damp=0.05, block_scales=block_scales)
    assert err.output_rel_err < 0.8 * err.rtn_output_rel_err, err
    assert err.rel_l2 > 0
    # the recorded errors are what they claim: tr(D H D^T) / tr(W H W^T) of the decoded weights
    d = w - np.asarray(dequantize_nvfp4(q))
    expected = np.sqrt(np.sum((d @ h) * d) / np.sum((w @ h) * w))
    assert err.output_rel_err == pytest.approx(float(expected), rel=1e-4)
    if method == "rtn":
        d = w - np.asarray(dequantize_nvfp4(quantize_nvfp4(w, global_amax=np.abs(w).max())))
        assert err.rtn_output_rel_err == pytest.approx(
            float(np.sqrt(np.sum((d @ h) * d) / np.sum((w @ h) * w))), rel=1e-4
        )


def test_block_order_keeps_16_column_blocks_whole_and_is_stable():
    diag = np.concatenate([np.full(16, 1.0), np.full(16, 3.0), np.full(16, 1.0), np.r_[np.full(15, 0.0), 48.0]])
    perm = block_order(diag)  # block sums 16, 48, 16, 48: blocks 1, 3, 0, 2
    np.testing.assert_array_equal(
        perm, np.concatenate([np.arange(16, 32), np.arange(48, 64), np.arange(16), np.arange(32, 48)])
    )


def test_damping_matters():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((16, 64)).astype(F32)
    x = _correlated_inputs(rng, 32, 64)  # fewer tokens than columns: H is singular without damping
    h = x.T @ x
    low, err_low = gptq_quantize(w, h, global_amax=np.abs(w).max(), damp=0.01)
    high, err_high = gptq_quantize(w, h, global_amax=np.abs(w).max(), damp=10.0)
    assert not np.array_equal(np.asarray(low.packed), np.asarray(high.packed))
    assert err_high.output_rel_err <= err_high.rtn_output_rel_err * 1.05  # heavy damping: near RTN


@pytest.mark.parametrize(
    "module, key",
    [
        ("model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.qkv"),
        ("model.layers.0.self_attn.o_proj", "model.layers.0.self_attn.o_proj"),
        ("model.layers.1.mlp.up_proj", "model.layers.1.mlp.gate_up"),
        ("model.layers.1.mlp.experts.5.gate_proj", "model.layers.1.mlp.experts.gate_up"),
        ("model.layers.1.block_sparse_moe.experts.2.w3", "model.layers.1.block_sparse_moe.experts.gate_up"),
        ("model.layers.1.mlp.experts.5.down_proj", "model.layers.1.mlp.experts.5.down_proj"),
    ],
)
def test_hessian_sharing(module, key):
    assert hessian_key(module) == key
