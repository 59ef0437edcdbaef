"""Attention (`nvfp4tool.model.attention`): `attend` against the explicit-scores formula, written
here independently in numpy float64 (scores q k^T / sqrt(D) of query head h against kv head
h // (H / KV), masked scores set to fp32's most negative finite value (a fully masked row is then
the mean of v), softmax over the keys, times v); the causal mask by structure against the explicit
one (the window counted alike; the model's logits unchanged); the choice of implementation; and
the cuDNN path lowered for CUDA from the CPU.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src.cudnn import fused_attention_stablehlo
from test_model import CONFIGS, batch, build

from nvfp4tool.model import attention, forward
from nvfp4tool.model import layers as model_layers
from nvfp4tool.model.attention import AttentionMask, attend, attention_allowed, attention_implementation


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
    return AttentionMask.explicit(
        attention_allowed(
            jnp.arange(S - T, S),
            jnp.asarray(valid_BxS),
            window,
            jnp.asarray(positions_BxS[:, S - T :]),
            jnp.asarray(positions_BxS),
        )
    )


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
    "arbitrary_mask": (4, 2, AttentionMask.explicit(jnp.asarray(np.random.default_rng(1).random((2, 6, 6)) < 0.5))),
}


@pytest.mark.parametrize("case", CASES)
def test_attend_equals_the_explicit_scores_formula(case):
    H, KV, mask = CASES[case]
    B, T, S = mask.allowed_BxTxS.shape
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=shape).astype(np.float32) * 3 for shape in ((B, T, H, 8), (B, S, KV, 8), (B, S, KV, 8)))
    out = attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask)
    assert out.shape == (B, T, H, 8) and out.dtype == jnp.float32
    # fp32 rounding of scores (|q k| / sqrt(D) ~ 25) and of the S-term sums: ~1e-6 relative
    np.testing.assert_allclose(np.asarray(out), _reference(q, k, v, mask.allowed_BxTxS), rtol=2e-5, atol=2e-5)


def test_attend_keeps_bf16_inputs_near_the_formula():
    H, KV, mask = CASES["gqa_2_groups"]
    rng = np.random.default_rng(2)
    q, k, v = (rng.normal(size=shape).astype(np.float32) for shape in ((2, 6, H, 8), (2, 6, KV, 8), (2, 6, KV, 8)))
    q16, k16, v16 = (jnp.asarray(a, jnp.bfloat16) for a in (q, k, v))
    out = attend(q16, k16, v16, mask)
    assert out.dtype == jnp.bfloat16
    reference = _reference(*(np.asarray(a.astype(jnp.float32)) for a in (q16, k16, v16)), mask.allowed_BxTxS)
    # probabilities and the output are rounded to bf16 (8 significant bits): a few bf16 ulps
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), reference, rtol=0, atol=3e-2)


@pytest.mark.parametrize("window", [None, 1, 2, 3, 5, 6, 9])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_causal_mask_sees_what_the_explicit_one_allows(window, dtype):
    """causal(W) (jax's is_causal + local_window_size=(W - 1, 0)) against attention_allowed's
    distance < W, over T = 6, GQA 4:2: op by op (not jitted) the same bits, as jax applies either
    mask with the same select before the same fp32 softmax. W = 1 (the query itself only) and
    W = 2 catch an off-by-one; W >= T is plain causal."""
    rng = np.random.default_rng(4)
    q, k, v = (jnp.asarray(rng.normal(size=shape), dtype) for shape in ((2, 6, 4, 8), (2, 6, 2, 8), (2, 6, 2, 8)))
    structured = attend(q, k, v, AttentionMask.causal(window))
    explicit = attend(q, k, v, _causal(_FULL, window=window))
    np.testing.assert_array_equal(np.asarray(structured), np.asarray(explicit))


@pytest.mark.parametrize("key", ["llama3", "mistral_window", "qwen3_moe"])
@pytest.mark.parametrize("compute_dtype", [jnp.float32, jnp.bfloat16])
def test_unpadded_rows_take_the_causal_mask_with_the_same_logits(key, compute_dtype, monkeypatch):
    """forward without a mask (the training loss's call) attends with causal(window); with a mask
    of ones, with the explicit one: the same logits (GQA 4:2; mistral's window 3 < T = 9;
    qwen3_moe's sparse layers). Up to fp32 rounding: compiled, XLA:CPU fuses a constant causal
    mask and a mask parameter differently, and fp32 logits then differ by a few ulps (measured:
    up to 8.3e-7 at |logits| <= 3.3 for llama3 / qwen3_moe; mistral and all bf16 runs equal)."""
    kinds = []

    def recording(q, k, v, mask, scale=None):
        kinds.append(mask.kind)
        return attend(q, k, v, mask, scale)

    monkeypatch.setattr(model_layers, "attend", recording)
    model = build(key, compute_dtype=compute_dtype)
    ids, _ = batch()
    structured = np.asarray(forward(model, ids))
    explicit = np.asarray(forward(model, ids, np.ones(ids.shape, np.int32)))
    layers = CONFIGS[key].num_layers
    assert kinds == ["causal"] * layers + ["explicit"] * layers
    np.testing.assert_allclose(structured, explicit, rtol=0, atol=1e-6 * np.abs(explicit).max())


@pytest.mark.parametrize(
    "platform, dtype, head_dim, seq_len, mask_kind, expected",
    [
        ("cuda", jnp.bfloat16, 64, 2048, "causal", "cudnn"),
        ("cuda", jnp.float16, 128, 4096, "causal", "cudnn"),
        ("cuda", jnp.bfloat16, 8, 2, "causal", "cudnn"),
        ("cuda", jnp.bfloat16, 64, 2048, "explicit", "xla"),  # padding / cache: cuDNN takes no [B, T, S] mask
        ("cuda", jnp.float32, 64, 2048, "causal", "xla"),  # cuDNN's flash kernel: bf16 / fp16 only
        ("cuda", jnp.bfloat16, 12, 2048, "causal", "xla"),  # not a multiple of 8
        ("cuda", jnp.bfloat16, 256, 2048, "causal", "xla"),  # > 128 (cuDNN takes 256 from Hopper on only)
        ("cuda", jnp.bfloat16, 64, 2047, "causal", "xla"),  # odd: jax refuses it for the gradient
        ("cpu", jnp.bfloat16, 64, 2048, "causal", "xla"),
        ("rocm", jnp.bfloat16, 64, 2048, "causal", "xla"),
    ],
)
def test_implementation_choice(platform, dtype, head_dim, seq_len, mask_kind, expected):
    assert attention_implementation(platform, dtype, head_dim, seq_len, mask_kind) == expected


def test_training_attention_lowers_to_cudnn_flash_attention_for_cuda(monkeypatch):
    """The gradient of a bf16 forward without a mask, lowered for CUDA on this CPU: each layer's
    attention is cuDNN's fused kernel, forward and backward, causal with the model's window
    (mistral: W = 3, GQA 4:2). Lowering needs two stand-ins: the platform `attend` sees, and the
    cuDNN version jax asks its CUDA plugin for at trace time (absent from a CPU-only jax)."""
    monkeypatch.setattr(attention, "_platform", lambda: "cuda")
    monkeypatch.setattr(
        fused_attention_stablehlo, "cuda_versions", types.SimpleNamespace(cudnn_get_version=lambda: 91000)
    )
    model = build("mistral_window", compute_dtype=jnp.bfloat16)
    ids, _ = batch(T=8)
    graphdef, state = nnx.split(model)

    def loss(state):
        return jnp.mean(forward(nnx.merge(graphdef, state), ids) ** 2)

    hlo = jax.jit(jax.grad(loss)).trace(state).lower(lowering_platforms=("cuda",)).as_text().replace("\\22", '"')
    layers = CONFIGS["mistral_window"].num_layers
    assert hlo.count("custom_call @__cudnn$fmhaSoftmax(") == layers
    assert hlo.count("custom_call @__cudnn$fmhaSoftmaxBackward(") == layers
    assert hlo.count('"mask_type": "CAUSAL"') == 2 * layers
    assert hlo.count('"sliding_window_length": 3') == 2 * layers
