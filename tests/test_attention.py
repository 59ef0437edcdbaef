"""The attention core (`transformer.attend`, through `jax.nn.dot_product_attention`) against the
explicit-scores formula it replaced, written here independently in numpy float64: scores
q k^T / sqrt(D) of query head h against kv head h // (H / KV), masked scores set to fp32's most
negative finite value (a fully masked row is then the mean of v), softmax over the keys, times v.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from nvfp4tool.model.transformer import attend, attention_allowed


def _reference(q_BxTxHxD, k_BxSxKVxD, v_BxSxKVxD, allowed_BxTxS):
    q, k, v = (np.asarray(a, np.float64) for a in (q_BxTxHxD, k_BxSxKVxD, v_BxSxKVxD))
    H, KV, D = q.shape[2], k.shape[2], q.shape[3]
    kv_head_H = np.arange(H) // (H // KV)
    scores_BxHxTxS = np.einsum("bthd,bshd->bhts", q, k[:, :, kv_head_H]) / np.sqrt(D)
    scores_BxHxTxS = np.where(np.asarray(allowed_BxTxS)[:, None], scores_BxHxTxS, np.finfo(np.float32).min)
    probs = np.exp(scores_BxHxTxS - scores_BxHxTxS.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bhts,bshd->bthd", probs, v[:, :, kv_head_H])


def _causal(valid_BxS, window=None, T=None):
    """attention_allowed for a prefill (T = S) or the last T query slots of S (a decode step)."""
    valid_BxS = np.asarray(valid_BxS, bool)
    S = valid_BxS.shape[1]
    T = T or S
    positions_BxS = np.maximum(np.cumsum(valid_BxS, -1) - 1, 0)
    return attention_allowed(jnp.arange(S - T, S), jnp.asarray(valid_BxS), window,
                             jnp.asarray(positions_BxS[:, S - T:]), jnp.asarray(positions_BxS))


_FULL = [[1] * 6, [1] * 6]
_PADDED = [[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]  # left- and right-padded rows: fully masked rows too
CASES = {  # name: (H, KV, allowed [B, T, S])
    "causal": (4, 4, _causal(_FULL)),
    "padded": (4, 4, _causal(_PADDED)),
    "gqa_2_groups": (4, 2, _causal(_PADDED)),
    "gqa_1_kv_head": (4, 1, _causal(_FULL)),
    "sliding_window": (4, 2, _causal(_FULL, window=3)),
    "window_padded": (4, 2, _causal(_PADDED, window=2)),
    "decode_step": (4, 2, _causal([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]], T=1)),
    "arbitrary_mask": (4, 2, jnp.asarray(np.random.default_rng(1).random((2, 6, 6)) < 0.5)),
}


@pytest.mark.parametrize("case", CASES)
def test_attend_equals_the_explicit_scores_formula(case):
    H, KV, allowed_BxTxS = CASES[case]
    B, T, S = allowed_BxTxS.shape
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=shape).astype(np.float32) * 3 for shape in
               ((B, T, H, 8), (B, S, KV, 8), (B, S, KV, 8)))
    out = attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), allowed_BxTxS)
    assert out.shape == (B, T, H, 8) and out.dtype == jnp.float32
    # fp32 rounding of scores (|q k| / sqrt(D) ~ 25) and of the S-term sums: ~1e-6 relative
    np.testing.assert_allclose(np.asarray(out), _reference(q, k, v, allowed_BxTxS), rtol=2e-5, atol=2e-5)


def test_attend_keeps_bf16_inputs_near_the_formula():
    H, KV, allowed_BxTxS = CASES["gqa_2_groups"]
    rng = np.random.default_rng(2)
    q, k, v = (rng.normal(size=shape).astype(np.float32) for shape in ((2, 6, H, 8), (2, 6, KV, 8), (2, 6, KV, 8)))
    q16, k16, v16 = (jnp.asarray(a, jnp.bfloat16) for a in (q, k, v))
    out = attend(q16, k16, v16, allowed_BxTxS)
    assert out.dtype == jnp.bfloat16
    reference = _reference(*(np.asarray(a.astype(jnp.float32)) for a in (q16, k16, v16)), allowed_BxTxS)
    # probabilities and the output are rounded to bf16 (8 significant bits): a few bf16 ulps
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), reference, rtol=0, atol=3e-2)
