"""Pure metrics comparing a model's logits, weights, outputs and generations to a reference.

Every function takes arrays and returns arrays or numbers; nothing here runs a model.

    kl_T = token_kl(ref_logits_BxTxV, logits_BxTxV).ravel()     # nats, KL(P_ref || P)
    agree_T = top1_agree(ref_logits_BxTxV, logits_BxTxV).ravel()
    nll_T = next_token_nll(logits_BxTxV, ids_BxT).ravel()        # perplexity(nll_T) = exp(mean)
    sqnr_db(w_ref, w_quantized)                                  # 10 log10(|ref|^2 / |ref - q|^2)
    first_divergence(ref_tokens_N, tokens_N)                     # index of the first difference or None
"""

from __future__ import annotations

import math

import numpy as np


def token_kl(ref_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """KL(softmax(ref) || softmax(logits)) over the last axis, in nats, computed in float64."""
    log_p = _log_softmax(ref_logits)
    log_q = _log_softmax(logits)
    kl = np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)
    return np.maximum(kl, 0.0)  # rounding can leave -1e-17 where the distributions are equal


def top1_agree(ref_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """Boolean per token: the arg-max token of `logits` equals the reference's."""
    return np.argmax(ref_logits, axis=-1) == np.argmax(logits, axis=-1)


def next_token_nll(logits_BxTxV: np.ndarray, ids_BxT: np.ndarray) -> np.ndarray:
    """-log p(ids[:, t+1] | ids[:, :t+1]) for t < T-1: shape [B, T-1], nats."""
    log_q = _log_softmax(logits_BxTxV[:, :-1])
    targets = np.asarray(ids_BxT)[:, 1:, None]
    return -np.take_along_axis(log_q, targets, axis=-1)[..., 0]


def perplexity(nll: np.ndarray) -> float:
    """exp(mean NLL)."""
    return float(np.exp(np.mean(nll)))


def logit_errors(ref_logits: np.ndarray, logits: np.ndarray) -> tuple[float, float]:
    """(max |logits - ref|, mean |logits - ref|) over every token and vocabulary entry."""
    err = np.abs(np.asarray(logits, np.float64) - np.asarray(ref_logits, np.float64))
    return float(err.max()), float(err.mean())


def sqnr_db(ref: np.ndarray, approx: np.ndarray) -> float:
    """Signal-to-quantization-noise ratio in dB; inf when `approx` equals `ref` exactly."""
    ref64 = np.asarray(ref, np.float64)
    noise = float(np.sum((ref64 - np.asarray(approx, np.float64)) ** 2))
    return sqnr_from_sums(float(np.sum(ref64 ** 2)), noise)


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


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.sum(np.exp(x), axis=-1, keepdims=True))
