"""The records of a training run: `run.json`, and the export hand-off `input_amax.json` and
`precision_map.json` (written by `nvfp4tool train`, read by resume, export and validate).

    RunRecord.read(run_dir)                  <run>/run.json: the run's configuration, data and teacher hashes
    InputAmaxRecord.read(run_dir / "hf")     {linear: max|input|} tracked in training
    PrecisionMapRecord.read(run_dir / "hf")  {linear: "bf16" | "nvfp4" | "nvfp4-weight-only" | "fp8" | "fp8-block"}
    run_dir / "hf" / PRECISION_FILE          the rules of the run's `precision_file=` (export reads them)

Design notes: docs/design/records.md.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, ClassVar

from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.records.base import Record, RecordError, _json_type, fields_from_json
from nvfp4tool.records.corpus import CorpusSft
from nvfp4tool.records.export import EqualizationRecord, SourceRecord

WEIGHTS_DIR = "hf"  # a run's final weights
CHECKPOINTS_DIR = "checkpoints"  # a run's <step>/state Orbax checkpoints
TOKENIZER_DIR = "tokenizer"  # a tokenizer trained by the run
PRECISION_FILE = "precision.txt"  # beside the final weights: the precision file the run trained with

if TYPE_CHECKING:
    from nvfp4tool.recipes.precision import RecipeConfig
    from nvfp4tool.run.config import TrainConfig


@dataclasses.dataclass(frozen=True)
class RunRecord(Record):
    """`<run>/run.json`: what a run was started with (written once, before its first step)."""

    FILE_NAME: ClassVar[str] = "run.json"

    config: dict[str, Any]  # every TrainConfig key (TrainConfig.to_dict())
    model_config: dict[str, Any]  # the model's HF config.json dict
    # of the training data's bytes (its files in reading order); a token cache: of its manifest,
    # which records every shard's sha256 (corpus.cache.manifest_sha256)
    data_sha256: str
    eval_data_sha256: str | None  # of `eval_data`, as data_sha256 (None: split off the training data)
    tokenizer_sha256: str  # of the tokenizer's serialized tokenizer.json
    train_windows: int
    eval_windows: int
    devices: int
    processes: int
    # a distillation run's teacher, named as an export names its source: portable name, kind, and
    # the sha256 of each weight file (an HF folder's safetensors, a run's hf/ weights, every file of
    # a MaxText checkpoint); with the HF config of the model it was read as. None: no teacher, or a
    # run.json written before teachers were recorded (such a run cannot be resumed)
    teacher: SourceRecord | None = None
    teacher_model_config: dict[str, Any] | None = None
    # the nvfp4 recipe's GEMM path as the run resolved it at its start (`RecipeConfig.backend()`):
    # {"quantizer": "xla" | "pallas", "gemm": "emulated" | "native"}; None: another recipe, or a
    # run.json written before it was recorded
    gemm_backend: dict[str, str] | None = None
    # `equalize_from=`: the scales folded into the model before the first step (the export's
    # EqualizationRecord as it was read; a resume compares them); None: no fold
    equalization: EqualizationRecord | None = None
    # a mixture `data=A:0.7,B:0.3`: {source path: weight}, normalised to sum to 1, in the given
    # order (data_sha256 hashes each source's hash and weight); None: one source
    data_weights: dict[str, float] | None = None
    # fine-tuning rows (format chat / prompt_completion): loss_on, overlong, the rows dropped /
    # truncated and the tokens carrying loss (a token cache's as its manifest has them), for each
    # source of `data` in order (None: a text source) and for `eval_data`; None: no fine-tuning
    # rows, or a run.json written before they were recorded
    data_sft: list[CorpusSft | None] | None = None
    eval_data_sft: CorpusSft | None = None
    # the share of the training rows' tokens that are padding (packing=segmented / padded of
    # fine-tuning rows keep each document whole in a row; 0.0: rows cut from the stream); None: a
    # run.json written before it was recorded
    padding_share: float | None = None

    @classmethod
    def _from_json_fields(cls, obj: dict[str, Any], label: str) -> dict[str, Any]:
        fields = super()._from_json_fields(obj, label)
        config = _train_config(fields["config"], label)  # the config must be one TrainConfig accepts
        for key in ("teacher", "teacher_model_config"):
            if fields.get(key) is not None and config.teacher is None:
                raise RecordError(f"{label}: {key}: recorded for a run without a teacher (config.teacher is null)")
        if (fields.get("teacher") is None) != (fields.get("teacher_model_config") is None):
            raise RecordError(f"{label}: teacher and teacher_model_config must be recorded together")
        _check_gemm_backend(fields.get("gemm_backend"), config, label)
        if (fields.get("equalization") is None) != (config.equalize_from is None):
            raise RecordError(f"{label}: equalization: must be recorded exactly when config.equalize_from is set")
        return fields

    def train_config(self) -> TrainConfig:
        """The run's TrainConfig (every key checked; a RecordError names run.json if one is off)."""
        return _train_config(self.config, self.FILE_NAME)

    def recipe_config(self) -> RecipeConfig:
        return self.train_config().recipe_config()

    @property
    def packing(self) -> str:
        """How the run packs documents: as recorded, concat for a run.json written before the key."""
        return self.config.get("packing") or LEGACY_PACKING

    @property
    def weight_block(self) -> str:
        """ "2d" when the run trained NVFP4 with 16x16 weight scaling (its export must match), else "1d"."""
        recipe = self.recipe_config()
        return "2d" if recipe.name == "nvfp4" and recipe.weight_2d else "1d"


class _FlatMap(Record):
    """A record stored as a flat JSON object {module name: value} (see the module docstring)."""

    def _values(self) -> dict[str, Any]:
        (field,) = dataclasses.fields(self)
        return getattr(self, field.name)

    @classmethod
    def _check_value(cls, value: Any, label: str) -> Any:
        raise NotImplementedError

    @classmethod
    def _from_json_fields(cls, obj: dict[str, Any], label: str) -> dict[str, Any]:
        (field,) = dataclasses.fields(cls)
        return {field.name: {name: cls._check_value(value, f"{label}: {name}") for name, value in obj.items()}}

    def to_json(self) -> dict[str, Any]:
        values = self._values()
        for name, value in values.items():
            self._check_value(value, f"{self.FILE_NAME}: {name}")
        return dict(values)


@dataclasses.dataclass(frozen=True)
class InputAmaxRecord(_FlatMap):
    """`input_amax.json` beside a run's final weights: each quantized linear's tracked max|input|."""

    FILE_NAME: ClassVar[str] = "input_amax.json"

    amax: dict[str, float]

    @classmethod
    def _check_value(cls, value: Any, label: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RecordError(f"{label}: expected a number, got {_json_type(value)}")
        if not math.isfinite(value) or value < 0:
            raise RecordError(f"{label}: input amax must be a finite number >= 0, got {value}")
        return float(value)


@dataclasses.dataclass(frozen=True)
class PrecisionMapRecord(_FlatMap):
    """`precision_map.json` beside a run's final weights: each linear's training precision."""

    FILE_NAME: ClassVar[str] = "precision_map.json"

    precisions: dict[str, str]

    @classmethod
    def _check_value(cls, value: Any, label: str) -> str:
        from nvfp4tool.recipes.precision import LINEAR_PRECISIONS

        if value not in LINEAR_PRECISIONS:
            raise RecordError(f"{label}: {value!r} is not a precision ({', '.join(LINEAR_PRECISIONS)})")
        return value


# ------------------------------------------------------------------------------------------
# helpers


# TrainConfig keys added after run.json files were written without them (read as the default)
KEYS_ADDED_LATER = (
    "gemm",
    "equalize_from",
    "packing",
    "loader_threads",
    "loader_prefetch",
    "format",
    "loss_on",
    "overlong",
    "precision_file",
)
LEGACY_PACKING = "concat"  # the packing of every run whose run.json predates the key
# what a recorded gemm_backend may hold: the resolved choices (never "auto")
_BACKEND_CHOICES = {"quantizer": ("xla", "pallas"), "gemm": ("emulated", "native")}


def _check_gemm_backend(backend: dict[str, str] | None, config: TrainConfig, label: str) -> None:
    """A recorded backend names both resolved choices, only for an nvfp4 run, and agrees with what
    the config forced (a key not "auto")."""
    if backend is None:
        return
    where = f"{label}: gemm_backend"
    if config.recipe != "nvfp4":
        raise RecordError(f"{where}: recorded for recipe {config.recipe!r} (only nvfp4 has one)")
    if set(backend) != set(_BACKEND_CHOICES):
        raise RecordError(f"{where}: expected the keys {', '.join(_BACKEND_CHOICES)}, got {', '.join(sorted(backend))}")
    for key, choices in _BACKEND_CHOICES.items():
        if backend[key] not in choices:
            raise RecordError(f"{where}: {key}: expected one of {', '.join(choices)}, got {backend[key]!r}")
        forced = getattr(config, key)
        if forced != "auto" and forced != backend[key]:
            raise RecordError(f"{where}: {key}: {backend[key]!r}, but config.{key} is {forced!r}")


def _train_config(values: dict[str, Any], label: str) -> TrainConfig:
    from nvfp4tool.run.config import TrainConfig

    if isinstance(values, dict):
        defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.name in KEYS_ADDED_LATER}
        values = {**defaults, **values}
    typed = fields_from_json(TrainConfig, values, f"{label}: config", require_all=True)
    try:
        return TrainConfig(**typed)
    except NVFP4ToolError as bad:
        raise RecordError(f"{label}: config: {bad}") from None
