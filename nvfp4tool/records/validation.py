"""The validation result `validation.json` (written by `nvfp4tool validate` into the export, read by
the hub card and `push`).

    record = ValidationRecord.read(export_dir)
    record.passed, record.failures, record.models["nvfp4"]["kl_mean"], record.layers[0].name

No local path (inputs are `Named`); non-finite metrics are stored as "inf", "-inf", "nan".
Design notes: docs/design/records.md.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, ClassVar

from nvfp4tool.records.base import Record
from nvfp4tool.records.names import portable_name

_NON_FINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


@dataclasses.dataclass(frozen=True)
class Named(Record):
    """A folder or file named without a local path: a Hub repo id or its base name, plus hashes."""

    name: str
    sha256: dict[str, str]  # {file path relative to the folder (a file: its name): sha256}

    @classmethod
    def of(cls, path: str, hashes: dict[str, str]) -> Named:
        """`path` named portably (`portable_name`), with `hashes` {absolute file: sha256} made
        relative to it."""
        root = os.path.abspath(path)
        base = os.path.dirname(root) if os.path.isfile(root) else root
        return cls(
            name=portable_name(path),
            sha256={os.path.relpath(os.path.abspath(f), base): h for f, h in sorted(hashes.items())},
        )


@dataclasses.dataclass(frozen=True)
class DataRef(Record):
    """The evaluation data: the file (named, hashed) and the token windows read from it."""

    file: Named
    sequences: int
    seq_len: int
    tokens: int


@dataclasses.dataclass(frozen=True)
class LayerSQNR(Record):
    """One quantized linear: weight and output SQNR (dB) per compared model label."""

    name: str
    weight_sqnr_db: dict[str, float]
    output_sqnr_db: dict[str, float]
    quant: str | None = None  # a mixed export's: this linear's own format (formats.QUANTS); else None


@dataclasses.dataclass(frozen=True)
class Generation(Record):
    """Greedy continuations: the first position where each model leaves BF16's tokens (None: never)."""

    prompts: int
    prompt_len: int
    tokens: int
    first_divergence: dict[str, list[int | None]]  # {model label: one entry per prompt}
    skipped: str | None = None  # why no generation ran (a model too large to hold), else None


@dataclasses.dataclass(frozen=True)
class Histogram(Record):
    edges: list[float]
    counts: list[int]


@dataclasses.dataclass(frozen=True)
class Failure(Record):
    """A failed limit: `by` is how far past the limit the value lies."""

    metric: str
    value: float
    limit: float
    by: float
    detail: str


@dataclasses.dataclass(frozen=True)
class GroupHarm(Record):
    group: str
    kl_mean_alone: float  # mean KL when only this unit (scheme group) is quantized


@dataclasses.dataclass(frozen=True)
class SearchStep(Record):
    """One model the search measured: the units (scheme groups) kept in BF16, its mean KL and its size."""

    kept: list[str]
    kl_mean: float
    step: str = "keep"  # "start" (nothing kept) | "keep" (a round's units added) | "prune" (one dropped again)
    bits_per_weight: float | None = None  # the searched linears: weights + scales, bits per weight
    bits_per_parameter: float | None = None  # the whole model as it would be exported

    def size_text(self) -> str:
        """', 4.52 bits per weight (linears), 5.61 per parameter' (empty for a record written
        before steps had sizes)."""
        if self.bits_per_weight is None or self.bits_per_parameter is None:
            return ""
        return f", {self.bits_per_weight:.2f} bits per weight (linears), {self.bits_per_parameter:.2f} per parameter"


@dataclasses.dataclass(frozen=True)
class Sensitivity(Record):
    """The search for the layers to keep in BF16 (`validate --sensitivity`, export's `upgrade_search`): the last step
    of `trajectory` is the result."""

    kl_target: float
    met: bool
    harm: list[GroupHarm]  # most harmful first
    trajectory: list[SearchStep]
    keep_bf16: list[str]  # fnmatch patterns for `export --keep-bf16`
    precision_map: dict[str, str]  # {linear: "bf16" | quant}


KV_SUFFIX = "+fp8-kv"  # label of the export run with its FP8 KV cache ("nvfp4+fp8-kv")


@dataclasses.dataclass(frozen=True)
class SearchedTarget(Record):
    """What an `export --auto-precision` export was searched for (its auto_precision.json), shown
    beside the KL the held-out text gave."""

    kl_target: float
    margin: float  # the search met calibration KL <= margin x kl_target
    calibration_kl: float  # the chosen mix's measured KL on the calibration windows
    bits_per_weight: float
    calibration_tokens: int
    kv_cache: str | None = None  # "fp8": searched with the FP8 KV cache the export writes (None: older reports)

    def line(self, held_out_kl: float) -> str:
        """The target and the calibration KL beside `held_out_kl` (the run it was searched as:
        `ValidationRecord.searched_line`)."""
        verdict = "within" if held_out_kl <= self.kl_target else "ABOVE"
        kv = " with the FP8 KV cache" if self.kv_cache else ""
        return (
            f"Formats searched by `export --auto-precision {self.kl_target:g}`{kv} on {self.calibration_tokens} "
            f"calibration tokens (not this text): calibration KL {self.calibration_kl:.4g} <= {self.margin:g} x "
            f"target at {self.bits_per_weight:.3f} bits per weight; held-out KL mean here{kv} {held_out_kl:.4g}, "
            f"{verdict} the target {self.kl_target:g}."
        )


@dataclasses.dataclass(frozen=True)
class Resources(Record):
    """What the validation cost: how each model ran and the process's peak memory."""

    offload: str  # the --offload mode asked for: auto | never | always
    models: dict[str, str]  # {model label ("bf16", "nvfp4", "fp8", "sensitivity"): "held" | "streamed"}
    peak_rss_bytes: int  # the validating process's peak resident set (VmHWM)
    seconds: float  # wall time of the whole validation


@dataclasses.dataclass(frozen=True)
class ValidationRecord(Record):
    """`validation.json`: the NVFP4 export against its BF16 source (and an FP8 reference)."""

    FILE_NAME: ClassVar[str] = "validation.json"

    export: Named
    quant: str  # the export's quant: its label in `models` ("nvfp4", "nvfp4-weight-only")
    format: str
    source: Named
    source_kind: str  # "hf" | "maxtext" | "run"
    source_step: int | None
    reference: str  # "bf16" | "fp8 (exported on the fly from the source)" | "fp8 export"
    reference_export: Named | None  # the --reference folder, when one was given
    data: DataRef
    models: dict[str, dict[str, float]]  # {"bf16": {"ppl"}, <label>: {kl_mean, kl_p99, top1, ...}}
    layers: list[LayerSQNR]  # worst output SQNR of the export first
    generation: Generation
    kl_histogram: dict[str, Histogram]  # per-token KL to BF16 over log-spaced bins, per label
    thresholds: dict[str, float | None]
    failures: list[Failure]
    passed: bool
    sensitivity: Sensitivity | None = None
    resources: Resources | None = None
    # True when `validate --source-mismatch-ok` ran against a source whose weight hashes differ
    # from the export's provenance record (shown on the card); False when they agree
    source_mismatch_ok: bool = False
    # what calibrated the FP8 reference's input scales (`validate --calib-data`, the W4A4 export's
    # input amax, a training run's tracked amax, an FP8 export's own record); None: no FP8 column,
    # or a report written before this field
    reference_calibration: str | None = None
    # the validated source's files that define it besides its weights (`SourceRecord.config_files`):
    # relative file -> sha256; None in a report written before they were bound
    source_config_files: dict[str, str] | None = None
    # an `export --auto-precision` export: the target it was searched for (None: not searched)
    searched: SearchedTarget | None = None

    @classmethod
    def _from_json_fields(cls, obj: dict[str, Any], label: str) -> dict[str, Any]:
        return super()._from_json_fields(_decode(obj), label)

    def to_json(self) -> dict[str, Any]:
        return _encode(dataclasses.asdict(self))

    @property
    def labels(self) -> list[str]:
        """The compared models other than BF16, the export first."""
        return [k for k in self.models if k != "bf16"]

    def searched_as(self, kv_cache: str | None) -> str:
        """The label of the run an `export --auto-precision` export was searched as: the export
        with its FP8 KV cache (`KV_SUFFIX`) when the search ran with one (`kv_cache`) and that run
        is here, else the export."""
        label = self.labels[0]
        return label + KV_SUFFIX if kv_cache and label + KV_SUFFIX in self.models else label

    def searched_line(self) -> str:
        """`searched`'s line beside the held-out KL of the run it was searched as (`searched_as`)."""
        return self.searched.line(self.models[self.searched_as(self.searched.kv_cache)]["kl_mean"])

    @property
    def layer_labels(self) -> list[str]:
        """The labels with per-layer SQNR (not the export's FP8-KV-cache run: the same weights)."""
        return [k for k in self.labels if any(k in r.weight_sqnr_db or k in r.output_sqnr_db for r in self.layers)]


# ------------------------------------------------------------------------------------------
# helpers


def _decode(obj: dict[str, Any]) -> dict[str, Any]:
    """The JSON object with "inf" / "-inf" / "nan" turned into floats in the numeric places."""
    obj = dict(obj)
    if isinstance(obj.get("models"), dict):
        obj["models"] = {k: _numbers(v) for k, v in obj["models"].items()}
    if "thresholds" in obj:
        obj["thresholds"] = _numbers(obj["thresholds"])
    if isinstance(obj.get("layers"), list):
        obj["layers"] = [
            {**row, **{k: _numbers(row.get(k)) for k in ("weight_sqnr_db", "output_sqnr_db") if k in row}}
            if isinstance(row, dict)
            else row
            for row in obj["layers"]
        ]
    if isinstance(obj.get("failures"), list):
        obj["failures"] = [_numbers(f, ("value", "limit", "by")) for f in obj["failures"]]
    found = obj.get("sensitivity")
    if isinstance(found, dict):
        found = dict(found)
        for key, field in (("harm", "kl_mean_alone"), ("trajectory", "kl_mean")):
            if isinstance(found.get(key), list):
                found[key] = [_numbers(item, (field,)) for item in found[key]]
        obj["sensitivity"] = found
    return obj


def _numbers(mapping: Any, keys: tuple[str, ...] | None = None) -> Any:
    if not isinstance(mapping, dict):
        return mapping
    return {
        k: _NON_FINITE.get(v, v) if isinstance(v, str) and (keys is None or k in keys) else v
        for k, v in mapping.items()
    }


def _encode(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value
