"""Pure metrics comparing a model's logits, weights, outputs and generations to a reference.

Every function takes arrays and returns arrays or numbers; nothing here runs a model. The per-token
functions work through the tokens in chunks of at most `CHUNK_BYTES` of float64 per temporary, so
a batch of a 128k-vocabulary model costs a few chunks, not several float64 copies of its logits;
each token's value is the same whatever the chunking.

    kl_T = token_kl(ref_logits_BxTxV, logits_BxTxV).ravel()     # nats, KL(P_ref || P)
    agree_T = top1_agree(ref_logits_BxTxV, logits_BxTxV).ravel()
    nll_T = next_token_nll(logits_BxTxV, ids_BxT).ravel()        # perplexity(nll_T) = exp(mean)
    sqnr_db(w_ref, w_quantized)                                  # 10 log10(|ref|^2 / |ref - q|^2)
    first_divergence(ref_tokens_N, tokens_N)                     # index of the first difference or None
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

CHUNK_BYTES = 16 * 2**20  # float64 bytes per temporary of the per-token math


def working_bytes(tokens: int, vocab: int) -> int:
    """The most the per-token functions hold at once besides their inputs, for fp32 logits of
    `tokens` rows of `vocab`: the larger of `next_token_nll`'s (its shifted fp32 copy of the logits
    and 3 float64 chunks: the widened logits, their shifted and their normalized values) and
    `token_kl`'s (5 chunks: both log-softmaxes, exp, difference, product); a chunk is at most
    CHUNK_BYTES (at least one row)."""
    chunk = max(8 * vocab, min(CHUNK_BYTES, 8 * tokens * vocab))
    return max(4 * tokens * vocab + 3 * chunk, 5 * chunk)


def token_kl(ref_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """KL(softmax(ref) || softmax(logits)) over the last axis, in nats, computed in float64."""

    def kl(ref_NxV, logits_NxV):
        log_p, log_q = _log_softmax(ref_NxV), _log_softmax(logits_NxV)
        return np.maximum(np.sum(np.exp(log_p) * (log_p - log_q), axis=-1), 0.0)  # rounding: -1e-17

    return _per_token(kl, ref_logits, logits)


def top1_agree(ref_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """Boolean per token: the arg-max token of `logits` equals the reference's."""
    return np.argmax(ref_logits, axis=-1) == np.argmax(logits, axis=-1)


def next_token_nll(logits_BxTxV: np.ndarray, ids_BxT: np.ndarray) -> np.ndarray:
    """-log p(ids[:, t+1] | ids[:, :t+1]) for t < T-1: shape [B, T-1], nats."""

    def nll(logits_NxV, targets_Nx1):
        return -np.take_along_axis(_log_softmax(logits_NxV), targets_Nx1.astype(np.int64), axis=-1)[:, 0]

    targets = np.asarray(ids_BxT)[:, 1:, None]
    return _per_token(nll, logits_BxTxV[:, :-1], targets)


def perplexity(nll: np.ndarray) -> float:
    """exp(mean NLL)."""
    return float(np.exp(np.mean(nll)))


def logit_errors(ref_logits: np.ndarray, logits: np.ndarray) -> tuple[float, float]:
    """(max |logits - ref|, mean |logits - ref|) over every token and vocabulary entry."""

    def errors(ref_NxV, logits_NxV):
        err = np.abs(np.asarray(logits_NxV, np.float64) - np.asarray(ref_NxV, np.float64))
        return np.stack([err.max(axis=-1), err.sum(axis=-1)], axis=-1)

    per_token = _per_token(errors, ref_logits, logits).reshape(-1, 2)
    return float(per_token[:, 0].max()), float(per_token[:, 1].sum() / np.size(ref_logits))


def sqnr_db(ref: np.ndarray, approx: np.ndarray) -> float:
    """Signal-to-quantization-noise ratio in dB; inf when `approx` equals `ref` exactly."""
    ref64 = np.asarray(ref, np.float64)
    noise = float(np.sum((ref64 - np.asarray(approx, np.float64)) ** 2))
    return sqnr_from_sums(float(np.sum(ref64**2)), noise)


def sqnr_from_sums(signal_power: float, noise_power: float) -> float:
    """10 log10(signal / noise) from accumulated sums of squares (inf for zero noise)."""
    if noise_power == 0.0:
        return math.inf
    if signal_power == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal_power / noise_power)


def first_divergence(ref_tokens: np.ndarray, tokens: np.ndarray) -> int | None:
    """Index of the first position where two token sequences differ; None if they never do."""
    ref_tokens, tokens = np.asarray(ref_tokens), np.asarray(tokens)
    if ref_tokens.shape != tokens.shape:
        raise ValueError(f"token sequences differ in shape: {ref_tokens.shape} vs {tokens.shape}")
    diff = np.flatnonzero(ref_tokens != tokens)
    return int(diff[0]) if diff.size else None


def percentile(values: np.ndarray, q: float) -> float:
    """The q-th percentile (linear interpolation) of a flat array."""
    return float(np.percentile(np.asarray(values, np.float64), q))


# ------------------------------------------------------------------------------------------
# helpers


def _per_token(fn: Callable[..., np.ndarray], *arrays: np.ndarray) -> np.ndarray:
    """fn over [N, last] row chunks of arrays shaped [..., last] (same leading shape); the
    per-token results reshaped to the leading shape (plus fn's trailing axes)."""
    lead = np.shape(arrays[0])[:-1]
    flat = [np.reshape(a, (-1, np.shape(a)[-1])) for a in arrays]
    rows = max(1, CHUNK_BYTES // (8 * max(flat[0].shape[1], 1)))
    parts = [fn(*(a[i : i + rows] for a in flat)) for i in range(0, len(flat[0]), rows)]
    out = np.concatenate(parts) if parts else fn(*flat)
    return out.reshape(*lead, *out.shape[1:])


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.sum(np.exp(x), axis=-1, keepdims=True))
