"""Pass/fail limits of `nvfp4tool validate` and the check of a validation record against them.

Defaults per quant (`defaults_for`), each met by a good export of its kind on SmolLM2-135M
(docs/benchmarks/accuracy-smollm2.md): fp8 KL mean <= 0.1, p99 <= 0.5 nats, perplexity +10%;
nvfp4-weight-only (W4A16) p99 <= 1.0; nvfp4 (W4A4) KL mean <= 0.25, p99 <= 2.0, perplexity +25%;
every layer's weight SQNR >= 12 dB; top-1 agreement has no default limit. Non-finite metrics fail
whatever the limits.
Design notes: docs/design/validate.md.
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


# The limits a good export of each quant meets on SmolLM2-135M, held-out text (accuracy-smollm2.md):
# FP8 0.045 / 0.32 / +4.6%; the `w4a16-best` recipe 0.079 / 0.90 / +8.3%; W4A4 the `w4a4-ptq`
# recipe 0.232 / 1.95 / +22.9% and QAD from the AWQ fold 0.192 / 1.34 / +8.6%. RTN fails each.
QUANT_DEFAULTS = {
    "fp8": Thresholds(),
    "nvfp4-weight-only": Thresholds(max_kl_p99=1.0),
    "nvfp4": Thresholds(max_kl_mean=0.25, max_kl_p99=2.0, max_ppl_increase=0.25),
}


def defaults_for(quant: str) -> Thresholds:
    """The default limits of an export of `quant` (`QUANT_DEFAULTS`; another label: fp8's)."""
    return QUANT_DEFAULTS.get(quant, QUANT_DEFAULTS["fp8"])


def defaults_help(field: str) -> str:
    """`field`'s default per quant, as --help says it: "fp8 0.1, nvfp4-weight-only 0.1, nvfp4 0.25"
    ("12 for every quant" when they agree)."""
    shown = {q: _shown(getattr(t, field)) for q, t in QUANT_DEFAULTS.items()}
    if len(set(shown.values())) == 1:
        return f"{next(iter(shown.values()))} for every quant"
    return ", ".join(f"{q} {value}" for q, value in shown.items())


def _shown(value: float | None) -> str:
    return "off" if value is None else f"{value:g}"


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
