"""Paired statistics of two models scored on the same items (pure numpy + the standard library).

    stats = paired(candidate_correct, reference_correct)   # 0/1 per item, the same items in order
    stats.diff, stats.se, stats.ci95, stats.mcnemar_p, stats.right_to_wrong, stats.min_detectable

se = sd(d, ddof=1) / sqrt(n) of the per-item differences; ci95 = diff +- 1.96 se; McNemar exact.
Design notes: docs/design/eval.md.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

Z95 = 1.959963984540054  # the two-sided 95% normal quantile
Z_POWER = 0.8416212335729143  # the 80% power normal quantile


@dataclasses.dataclass(frozen=True)
class Paired:
    """The paired comparison candidate - reference (see the module docstring)."""

    n: int
    diff: float  # candidate accuracy - reference accuracy
    se: float | None  # paired standard error of diff
    ci95: tuple[float, float] | None
    unpaired_se: float | None  # sqrt(se_c^2 + se_r^2): what an unpaired comparison would claim
    mcnemar_p: float
    right_to_wrong: int  # items the reference got right and the candidate wrong
    wrong_to_right: int
    flip_rate: float  # (right_to_wrong + wrong_to_right) / n
    min_detectable: float | None


def mean_stderr(scores: np.ndarray) -> float | None:
    """sd(scores, ddof=1) / sqrt(n) (None for n < 2)."""
    scores = np.asarray(scores, np.float64)
    return None if scores.size < 2 else float(np.std(scores, ddof=1) / math.sqrt(scores.size))


def binom_cdf_half(k: int, n: int) -> float:
    """P[Binomial(n, 1/2) <= k]: the terms C(n, i) / 2^n summed in log space (float64, relative error
    ~1e-12 for any n; exact integer sums take seconds at MMLU-Pro's 12,032 items)."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    i = np.arange(k + 1, dtype=np.float64)
    log_terms = (
        math.lgamma(n + 1) - np.array([math.lgamma(x + 1) + math.lgamma(n - x + 1) for x in i]) - n * math.log(2.0)
    )
    top = float(log_terms.max())
    return min(1.0, math.exp(top) * float(np.sum(np.exp(log_terms - top))))


def mcnemar_exact(right_to_wrong: int, wrong_to_right: int) -> float:
    """McNemar's exact two-sided p-value from the two discordant counts."""
    flips = right_to_wrong + wrong_to_right
    return min(1.0, 2.0 * binom_cdf_half(min(right_to_wrong, wrong_to_right), flips))


def paired(candidate: np.ndarray, reference: np.ndarray) -> Paired:
    """Candidate vs reference on the same items (equal-length score arrays in [0, 1])."""
    c, r = np.asarray(candidate, np.float64), np.asarray(reference, np.float64)
    if c.shape != r.shape or c.ndim != 1 or c.size == 0:
        raise ValueError(f"paired: two equal-length non-empty score vectors, got {c.shape} and {r.shape}")
    if not (np.all(np.isfinite(c)) and np.all(np.isfinite(r))):
        raise ValueError("paired: a score is not finite")
    n = int(c.size)
    d = c - r
    binary = bool(np.all((c == 0) | (c == 1)) and np.all((r == 0) | (r == 1)))
    right_to_wrong = int(np.sum((r == 1) & (c == 0))) if binary else int(np.sum(d < 0))
    wrong_to_right = int(np.sum((r == 0) & (c == 1))) if binary else int(np.sum(d > 0))
    se = mean_stderr(d)
    se_c, se_r = mean_stderr(c), mean_stderr(r)
    flip_rate = (right_to_wrong + wrong_to_right) / n
    diff = float(d.mean())
    return Paired(
        n=n,
        diff=diff,
        se=se,
        ci95=None if se is None else (diff - Z95 * se, diff + Z95 * se),
        unpaired_se=None if se_c is None else math.hypot(se_c, se_r),
        mcnemar_p=mcnemar_exact(right_to_wrong, wrong_to_right),
        right_to_wrong=right_to_wrong,
        wrong_to_right=wrong_to_right,
        flip_rate=flip_rate,
        min_detectable=None if n < 2 else (Z95 + Z_POWER) * math.sqrt(max(flip_rate, 1.0 / n) / n),
    )
