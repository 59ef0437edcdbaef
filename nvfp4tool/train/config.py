"""The training job's configuration: one flat frozen dataclass, read from an optional YAML file
and `key=value` overrides (MaxText style: every key overridable on the command line).

    nvfp4tool train model=tiny data=corpus.txt recipe=nvfp4 steps=60 out=runs/a
    nvfp4tool train run.yaml lr=3e-4 resume=true
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError
from nvfp4tool.recipes.precision import RECIPES, RecipeConfig


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Every option of `nvfp4tool train` (the names are the CLI's keys)."""

    # what to train
    model: str = "tiny"  # "tiny" | "100m" (from scratch), an HF folder, or a MaxText checkpoint
    model_config: str | None = None  # MaxText source: an HF config.json or a MaxText model name
    rope_layout: str | None = None  # MaxText side: interleaved | half (default: from the MaxText name)
    data: str = ""  # text / JSONL / Parquet file or folder
    eval_data: str | None = None  # held-out data (default: the last eval_fraction of `data`)
    eval_fraction: float = 0.05
    text_field: str = "text"  # JSONL key / Parquet column holding the documents
    tokenizer: str | None = None  # a folder with tokenizer.json, "train", or None (the model's, else train)
    vocab_size: int = 1024  # of a trained tokenizer
    # precision recipe (see nvfp4tool.recipes.precision)
    recipe: str = "bf16"  # bf16 | fp8 | fp8-block | nvfp4
    rht: bool = True
    stochastic_rounding: bool = True
    weight_2d: bool = True
    bf16_first_layers: int = 1
    bf16_last_layers: int | None = None  # None: ceil(15% of the blocks)
    bf16_patterns: tuple[str, ...] = ()
    switch_to_bf16_at: float | None = None  # step, or fraction of `steps` when < 1
    switch_scope: str = "forward"  # forward | all
    amax_history: int = 16  # steps over which each quantized input's amax is tracked (max)
    # optimisation
    steps: int = 100
    seq_len: int = 128
    batch_size: int = 16  # sequences per optimizer step (global, over all devices)
    grad_accum: int = 1  # micro-batches per step (batch_size must divide by it)
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # final lr = lr * min_lr_ratio
    warmup_steps: int = 10
    schedule: str = "cosine"  # cosine | wsd (warmup, stable, linear decay over decay_fraction)
    decay_fraction: float = 0.2
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0
    seed: int = 0
    # evaluation, checkpoints, output
    eval_every: int = 50  # 0: only at the end
    eval_batches: int = 8
    checkpoint_every: int = 0  # 0: only the final checkpoint
    keep_checkpoints: int = 3
    out: str = "runs/run"
    resume: bool = False  # continue from the latest checkpoint in `out`
    force: bool = False  # replace an existing `out` (when not resuming)
    export_maxtext: bool = False  # also write the final weights as a MaxText checkpoint
    on_nonfinite: str = "stop"  # stop | skip (skip the step, keep the weights)
    # scale-out
    mesh_data: int = -1  # devices on the data axis (-1: what fsdp leaves)
    mesh_fsdp: int = 1  # devices on the fsdp axis (parameters and optimizer state sharded)
    coordinator_address: str | None = None  # multi-process: host:port of process 0
    num_processes: int = 1
    process_id: int = 0

    def __post_init__(self) -> None:
        _check_choice("recipe", self.recipe, RECIPES)
        _check_choice("schedule", self.schedule, ("cosine", "wsd"))
        _check_choice("on_nonfinite", self.on_nonfinite, ("stop", "skip"))
        if self.rope_layout is not None:
            _check_choice("rope_layout", self.rope_layout, ("interleaved", "half"))
        for name in ("steps", "seq_len", "batch_size", "grad_accum", "amax_history", "eval_batches"):
            if getattr(self, name) < 1:
                raise NVFP4UsageError(f"train config: {name} must be >= 1, got {getattr(self, name)}")
        if self.batch_size % self.grad_accum:
            raise NVFP4UsageError(f"train config: batch_size={self.batch_size} is not a multiple of "
                                 f"grad_accum={self.grad_accum}")
        if not self.data:
            raise NVFP4UsageError("train config: data=PATH is required")
        self.recipe_config()  # validates the recipe keys

    def recipe_config(self) -> RecipeConfig:
        return RecipeConfig(name=self.recipe, rht=self.rht, stochastic_rounding=self.stochastic_rounding,
                            weight_2d=self.weight_2d, bf16_first_layers=self.bf16_first_layers,
                            bf16_last_layers=self.bf16_last_layers, bf16_patterns=tuple(self.bf16_patterns),
                            switch_to_bf16_at=self.switch_to_bf16_at, switch_scope=self.switch_scope)

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


def load_train_config(yaml_path: str | None, overrides: list[str]) -> TrainConfig:
    """The YAML file's keys (if any), then each `key=value` override (values parsed as YAML)."""
    values: dict[str, Any] = {}
    if yaml_path:
        path = Path(yaml_path)
        if not path.is_file():
            raise NVFP4ToolError(f"{yaml_path}: config file does not exist")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise NVFP4ToolError(f"{yaml_path}: expected a mapping of key: value")
        values.update(loaded)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise NVFP4UsageError(f"override {item!r}: expected key=value")
        values[key.strip()] = yaml.safe_load(raw) if raw.strip() else None
    return _build(values, yaml_path or "command line")


def _build(values: dict[str, Any], source: str) -> TrainConfig:
    hints = typing.get_type_hints(TrainConfig)
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise NVFP4UsageError(f"{source}: unknown key(s) {', '.join(unknown)}; known keys: "
                             f"{', '.join(sorted(fields))}")
    return TrainConfig(**{k: _coerce(k, v, hints[k]) for k, v in values.items()})


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Check/convert one value to its field's type (int -> float allowed, str -> list for tuples)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    optional = type(None) in typing.get_args(hint)
    if value is None:
        if optional:
            return None
        raise NVFP4UsageError(f"train config: {key} cannot be empty")
    base = args[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) else hint
    if base in (int, float) and isinstance(value, str):  # YAML reads "1e-3" (no dot) as a string
        try:
            value = base(value)
        except ValueError:
            pass
    if typing.get_origin(base) is tuple:
        items = value if isinstance(value, list) else [value]
        return tuple(str(v) for v in items)
    if base is bool:
        if isinstance(value, bool):
            return value
    elif base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif base is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    elif base is str:
        return str(value)
    raise NVFP4UsageError(f"train config: {key}={value!r} is not a valid {getattr(base, '__name__', base)}")


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise NVFP4UsageError(f"train config: {key}={value!r}; choose one of {', '.join(choices)}")

