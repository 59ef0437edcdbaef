"""Pass/fail limits of `nvfp4tool validate` and the check of a validation record against them.

Defaults, from measurements of correct W4A4 RTN exports (16 x 64 tokens; see the report of the
validate work for the commands):

| model                                  | KL mean | KL p99 | top-1 | ppl incr. | layer weight SQNR |
|----------------------------------------|---------|--------|-------|-----------|-------------------|
| tiny trained (Shakespeare, 150 steps)  | 0.0018  | 0.016  | 0.952 | +0.13%    | 20.2-20.6 dB      |
| tiny random llama3 / qwen3 / mistral   | 0.023-0.032 | 0.060-0.078 | 0.51-0.56 | < 0.2% | 20.2-20.7 dB |
| the same exports in FP8 (reference)    | 0.0001-0.003 | 0.001-0.007 | 0.83-0.98 | < 0.2% | ~31.5 dB |
| one block scale x16 in one layer       | 0.00027 (synthetic) | | | | 5.6 dB in that layer |

So: KL mean <= 0.1 and p99 <= 0.5 nats (3x / 6x the worst correct export measured), perplexity
+10%, and every layer's weight SQNR >= 12 dB (8 dB under RTN's ~20.5 dB; the broken block scale
sits at 5.6 dB while barely moving the KL). Top-1 agreement has no default limit: on random models
with near-flat logits it measures tie-breaking (0.51-0.56 for a correct export), not damage.

Non-finite metrics fail whatever the limits (a comparison with NaN is always False, so a NaN
would otherwise pass every limit): NaN anywhere, -inf anywhere, and +inf in every metric but an
SQNR (+inf dB is an exact match). They fail with `by` = inf, also when that metric has no limit
or belongs to the BF16 or FP8 column.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

from nvfp4tool.errors import NVFP4UsageError


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """NVFP4 vs BF16 limits; None disables a limit."""

    max_kl_mean: float | None = 0.10  # nats per token
    max_kl_p99: float | None = 0.5  # nats
    min_top1: float | None = None  # fraction of tokens whose arg-max matches BF16
    max_ppl_increase: float | None = 0.10  # relative: ppl / ppl_bf16 - 1
    min_layer_sqnr_db: float | None = 12.0  # every quantized layer's weight SQNR (RTN on N(0,1): 20.5 dB)

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None and not (isinstance(value, numbers.Real) and math.isfinite(value)):
                raise NVFP4UsageError(f"threshold {field.name}={value!r}: expected a finite number or None")


def check_thresholds(record: dict[str, Any], thresholds: Thresholds, *, label: str) -> list[dict[str, Any]]:
    """Failed limits: [{metric, value, limit, by, detail}], `by` = how far past the limit.

    Every non-finite metric of every model and layer fails first (see the module docstring); the
    limits are then checked on the finite ones.
    """
    model = record["models"][label]
    failures = _non_finite(record)
    for metric, limit, upper in (
        ("kl_mean", thresholds.max_kl_mean, True),
        ("kl_p99", thresholds.max_kl_p99, True),
        ("top1", thresholds.min_top1, False),
        ("ppl_increase", thresholds.max_ppl_increase, True),
    ):
        if limit is not None and _finite(metric, model[metric]):
            failures += _check(metric, model[metric], limit, upper, f"{label} vs bf16")
    if thresholds.min_layer_sqnr_db is not None:
        for row in record["layers"]:
            value = row.get(f"{label}_weight_sqnr_db")
            if value is not None and _finite("weight_sqnr_db", value):
                failures += _check("layer_weight_sqnr_db", value, thresholds.min_layer_sqnr_db, False, row["name"])
    return failures


def _non_finite(record: dict[str, Any]) -> list[dict[str, Any]]:
    """A failure for each non-finite number among the models' metrics and the layers' SQNRs."""
    failures = []
    for name, metrics in record["models"].items():
        for metric, value in metrics.items():
            if isinstance(value, numbers.Real) and not _finite(metric, value):
                failures.append(_non_finite_failure(metric, value, f"{name} model"))
    for row in record["layers"]:
        for metric, value in row.items():
            if metric != "name" and isinstance(value, numbers.Real) and not _finite(metric, value):
                failures.append(_non_finite_failure(metric, value, row["name"]))
    return failures


def _finite(metric: str, value: float) -> bool:
    """True unless NaN or infinite (an SQNR of +inf dB, an exact match, counts as finite here)."""
    return math.isfinite(value) or (value == math.inf and metric.endswith("sqnr_db"))


def _non_finite_failure(metric: str, value: float, where: str) -> dict[str, Any]:
    return {
        "metric": metric,
        "value": value,
        "limit": math.nan,
        "by": math.inf,
        "detail": f"{where}: not a finite number",
    }


def _check(metric: str, value: float, limit: float, upper: bool, detail: str) -> list[dict[str, Any]]:
    failed = value > limit if upper else value < limit
    if not failed:
        return []
    return [
        {
            "metric": metric,
            "value": value,
            "limit": limit,
            "by": value - limit if upper else limit - value,
            "detail": detail,
        }
    ]
