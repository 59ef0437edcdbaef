"""The training job's configuration: one flat frozen dataclass, read from an optional YAML file
and `key=value` overrides (MaxText style: every key overridable on the command line).

    nvfp4tool train model=tiny data=corpus.txt recipe=nvfp4 steps=60 out=runs/a
    nvfp4tool train run.yaml lr=3e-4 resume=true

Every key is checked when the config is built, before anything is created: an unknown key, a
value of the wrong type or out of range, a data/model/tokenizer path that does not exist is a
usage error (`NVFP4UsageError`, exit 2) naming the key; a config file that is not valid UTF-8
YAML is a bad-file error (exit 1) naming the file and line.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from nvfp4tool.corpus.chat import LOSS_ON_CHOICES, OVERLONG, sft_options
from nvfp4tool.corpus.encode import FORMATS as DATA_FORMATS
from nvfp4tool.corpus.loader import parse_mixture
from nvfp4tool.corpus.windows import PACKINGS, whole_documents
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError
from nvfp4tool.model.remat import REMAT_LEVELS
from nvfp4tool.recipes.nvfp4_dot import GEMMS, QUANTIZERS
from nvfp4tool.recipes.precision import RECIPES, RecipeConfig

NEW_RUN_PACKING = "segmented"  # `packing` of a new run that does not set it


def _key(default: Any, text: str) -> Any:
    """A TrainConfig field with its one-line description (`train --help` and `--list-keys` print it)."""
    return dataclasses.field(default=default, metadata={"help": text})


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Every option of `nvfp4tool train` (the names are the CLI's keys; each field's metadata["help"]
    is its one-line description, shown by `nvfp4tool train --help` and `--list-keys`)."""

    # what to train
    model: str = _key(
        "tiny", "tiny | 100m (a preset trained from scratch), an HF folder, a MaxText checkpoint or a run"
    )
    model_config: str | None = _key(None, "MaxText source: an HF config.json or a MaxText model name")
    rope_layout: str | None = _key(None, "MaxText side: interleaved | half (default: from the MaxText name)")
    data: str = _key(
        "",
        "training data: a text / JSONL / Parquet file or folder, a saved dataset, or a token cache "
        "(data prepare); or a mixture A:0.7,B:0.3 of them",
    )
    eval_data: str | None = _key(None, "held-out data, as `data` (default: the last eval_fraction of `data`)")
    eval_fraction: float = _key(0.05, "share of `data` held out for evaluation when eval_data is not given")
    text_field: str = _key("text", "JSONL key / Parquet or dataset column holding the documents")
    packing: str | None = _key(
        None,
        "concat: one stream; segmented: documents apart (fine-tuning rows whole); padded: one per "
        f"row (fine-tuning); default: {NEW_RUN_PACKING}, a resume's: the run's",
    )
    format: str | None = _key(
        None,
        "text | chat | prompt_completion: documents, rows of `messages`, or of `prompt` and `completion` "
        "(default: a token cache's, else text)",
    )
    loss_on: str | None = _key(
        None, "chat: assistant | all; prompt_completion: completion | all (default: the first; a cache's)"
    )
    overlong: str | None = _key(
        None, "chat / prompt_completion: a row longer than seq_len + 1 tokens: drop | truncate (default: drop)"
    )
    tokenizer: str | None = _key(None, "a folder with tokenizer.json, or train (default: the model's, else train)")
    vocab_size: int = _key(1024, "vocabulary size of a tokenizer trained here (tokenizer=train)")
    # precision recipe (see nvfp4tool.recipes.precision)
    recipe: str = _key("bf16", "precision recipe: bf16 | fp8 | fp8-block | nvfp4 (nvfp4tool.recipes.precision)")
    rht: bool = _key(True, "nvfp4 recipe: random Hadamard transform of the weight-gradient GEMM operands")
    stochastic_rounding: bool = _key(True, "nvfp4 recipe: stochastic rounding of the gradients quantized to NVFP4")
    weight_2d: bool = _key(True, "nvfp4 recipe: 16x16 (2D) weight blocks (the weight and its transpose share scales)")
    quantizer: str = _key("auto", "auto | xla | pallas: who quantizes nvfp4's GEMM operands (auto: pallas on GPU)")
    gemm: str = _key(
        "auto", "auto | emulated | native: nvfp4's GEMM (native needs a CUDA GPU; auto: native on Blackwell)"
    )
    bf16_first_layers: int | None = _key(
        None,
        "recipes fp8/nvfp4: the first N blocks stay BF16 (default: the family's, docs/commands/train.md)",
    )
    bf16_last_layers: int | None = _key(
        None,
        "recipes fp8/nvfp4: the last N blocks stay BF16 (default: the family's, docs/commands/train.md)",
    )
    bf16_patterns: tuple[str, ...] = _key((), "fnmatch patterns of linear modules kept in BF16 (recipes fp8/nvfp4)")
    precision_file: str | None = _key(
        None,
        "a precision file (`PATTERN FORMAT` lines, as export's) or a mixed export: its linears train in their own "
        "format, and the run's export keeps them",
    )
    switch_to_bf16_at: float | None = _key(
        None, "switch to BF16 at this step, or this fraction of `steps` if < 1 (default: never)"
    )
    switch_scope: str = _key(
        "forward", "forward | all: what switch_to_bf16_at moves to BF16 (the forward GEMMs, or all)"
    )
    amax_history: int = _key(16, "steps over which each quantized input's amax is tracked (max)")
    remat: str = _key("none", "none | block | full: what the backward pass recomputes (nvfp4tool.model.remat)")
    scan_layers: str = _key(
        "auto",
        "auto | true | false: run each run of alike layers as one lax.scan (compile "
        "time flat in depth; parameters stay per layer); auto: from 12 layers",
    )
    # quantization-aware distillation (nvfp4tool.train.distill)
    teacher: str | None = _key(None, "frozen BF16 teacher: an HF folder, a MaxText checkpoint or a run")
    distill: str = _key("none", "none | kl (KL to the teacher; needs teacher)")
    temperature: float = _key(1.0, "softmax temperature of the distillation KL")
    distill_weight: float = _key(1.0, "loss = w T^2 KL + (1 - w) next-token CE")
    equalize_from: str | None = _key(
        None,
        "an `export --equalize awq|smoothquant` of `model`: start from `model` with its recorded scales folded in "
        "(the same function; QAD from an equalized start)",
    )
    # optimisation
    steps: int = _key(100, "optimizer steps to run (the whole run; a resume continues up to it)")
    seq_len: int = _key(128, "tokens per training sequence")
    batch_size: int = _key(16, "sequences per optimizer step (global, over all devices)")
    grad_accum: int = _key(1, "micro-batches per step (batch_size must divide by it)")
    lr: float = _key(1e-3, "peak learning rate (after warmup)")
    min_lr_ratio: float = _key(0.1, "final lr = lr * min_lr_ratio")
    warmup_steps: int = _key(10, "steps of linear lr warmup from 0")
    schedule: str = _key("cosine", "cosine | wsd (warmup, stable, linear decay over decay_fraction)")
    decay_fraction: float = _key(0.2, "wsd schedule: share of the steps spent decaying the lr linearly")
    weight_decay: float = _key(0.1, "AdamW decoupled weight decay")
    beta1: float = _key(0.9, "AdamW first-moment decay")
    beta2: float = _key(0.95, "AdamW second-moment decay")
    eps: float = _key(1e-8, "AdamW epsilon")
    clip_norm: float = _key(1.0, "global gradient-norm clip")
    seed: int = _key(0, "seed of the initialisation, data order and stochastic rounding")
    loader_threads: int = _key(2, "threads reading training batches ahead (0: read when asked)")
    loader_prefetch: int = _key(8, "training batches read ahead (the loader's buffer)")
    # evaluation, checkpoints, output
    eval_every: int = _key(50, "steps between evaluations (0: only at the end)")
    eval_batches: int = _key(8, "batches of the held-out data per evaluation")
    checkpoint_every: int = _key(0, "steps between checkpoints (0: only the final one)")
    keep_checkpoints: int = _key(3, "most recent checkpoints kept (older ones deleted)")
    out: str = _key("runs/run", "run folder (metrics.jsonl, loss.png, checkpoints/, hf/)")
    resume: bool = _key(False, "continue from the latest checkpoint in `out`")
    force: bool = _key(False, "replace an existing `out` (when not resuming)")
    export_maxtext: bool = _key(False, "also write the final weights as a MaxText checkpoint")
    on_nonfinite: str = _key("stop", "stop | skip (skip the step, keep the weights)")
    # scale-out
    mesh_data: int = _key(-1, "devices on the data axis (-1: what mesh_fsdp leaves)")
    mesh_fsdp: int = _key(1, "devices on the fsdp axis (parameters and optimizer state sharded)")
    coordinator_address: str | None = _key(None, "multi-process: host:port of process 0")
    num_processes: int = _key(1, "multi-process: number of processes (hosts)")
    process_id: int = _key(0, "multi-process: this process's index, 0 .. num_processes - 1")

    def __post_init__(self) -> None:
        """Every key checked before anything is created: a bad one is a usage error naming it."""
        _check_choice("recipe", self.recipe, RECIPES)
        _check_choice("schedule", self.schedule, ("cosine", "wsd"))
        _check_choice("on_nonfinite", self.on_nonfinite, ("stop", "skip"))
        _check_choice("switch_scope", self.switch_scope, ("forward", "all"))
        _check_choice("distill", self.distill, ("none", "kl"))
        _check_choice("remat", self.remat, REMAT_LEVELS)
        _check_choice("scan_layers", str(self.scan_layers).lower(), SCAN_CHOICES)
        _check_choice("quantizer", self.quantizer, QUANTIZERS)
        _check_choice("gemm", self.gemm, GEMMS)
        if self.packing is not None:
            _check_choice("packing", self.packing, PACKINGS)
        for key, choices in (("format", DATA_FORMATS), ("loss_on", LOSS_ON_CHOICES), ("overlong", OVERLONG)):
            if getattr(self, key) is not None:
                _check_choice(key, getattr(self, key), choices)
        if self.format is not None:  # the options of a format it does not have (a cache's is checked by train)
            sft_options(self.format, self.loss_on, self.overlong)
        if self.format is not None and self.packing is not None:  # padded text refused (a cache's: by its rows)
            whole_documents(self.format, self.packing)
        _require(
            "distill",
            self.distill,
            self.distill == "none" or self.teacher is not None,
            "needs teacher=PATH (the model to distill from)",
        )
        _require(
            "teacher",
            self.teacher,
            self.teacher is None or self.distill != "none",
            "needs distill=kl (a teacher is used only for distillation)",
        )
        _require("temperature", self.temperature, self.temperature > 0, "expected a number > 0")
        _require("distill_weight", self.distill_weight, 0 <= self.distill_weight <= 1, "expected a number in [0, 1]")
        if self.rope_layout is not None:
            _check_choice("rope_layout", self.rope_layout, ("interleaved", "half"))
        for name in (
            "steps",
            "seq_len",
            "batch_size",
            "grad_accum",
            "amax_history",
            "eval_batches",
            "keep_checkpoints",
            "vocab_size",
            "mesh_fsdp",
            "num_processes",
            "loader_prefetch",
        ):
            _require(name, getattr(self, name), getattr(self, name) >= 1, "expected an integer >= 1")
        for name in ("warmup_steps", "eval_every", "checkpoint_every", "seed", "loader_threads"):
            _require(name, getattr(self, name), getattr(self, name) >= 0, "expected an integer >= 0")
        for name in ("bf16_first_layers", "bf16_last_layers"):
            _require(
                name,
                getattr(self, name),
                getattr(self, name) is None or getattr(self, name) >= 0,
                "expected an integer >= 0",
            )
        _require(
            "mesh_data",
            self.mesh_data,
            self.mesh_data == -1 or self.mesh_data >= 1,
            "expected -1 (what mesh_fsdp leaves) or an integer >= 1",
        )
        _require(
            "process_id",
            self.process_id,
            0 <= self.process_id < self.num_processes,
            f"expected 0 <= process_id < num_processes={self.num_processes}",
        )
        _require(
            "coordinator_address",
            self.coordinator_address,
            self.num_processes == 1 or self.coordinator_address is not None,
            f"num_processes={self.num_processes} needs coordinator_address=host:port",
        )
        for name in ("lr", "eps", "clip_norm"):
            _require(name, getattr(self, name), getattr(self, name) > 0, "expected a number > 0")
        _require("weight_decay", self.weight_decay, self.weight_decay >= 0, "expected a number >= 0")
        for name in ("min_lr_ratio", "decay_fraction"):
            _require(name, getattr(self, name), 0 <= getattr(self, name) <= 1, "expected a number in [0, 1]")
        for name in ("beta1", "beta2"):
            _require(name, getattr(self, name), 0 <= getattr(self, name) < 1, "expected a number in [0, 1)")
        _require("eval_fraction", self.eval_fraction, 0 < self.eval_fraction < 1, "expected a number in (0, 1)")
        _require(
            "batch_size",
            self.batch_size,
            self.batch_size % self.grad_accum == 0,
            f"not a multiple of grad_accum={self.grad_accum}",
        )
        at = self.switch_to_bf16_at
        _require(
            "switch_to_bf16_at",
            at,
            at is None or 0 < at < 1 or (at == int(at) and 1 <= at <= self.steps),
            f"expected a fraction in (0, 1) or a step in [1, steps={self.steps}]",
        )
        _require("text_field", self.text_field, bool(self.text_field), "cannot be empty")
        if not self.data:
            raise NVFP4UsageError("train config: data=PATH is required")
        parse_mixture(self.data)  # a mixture's entries: PATH:WEIGHT, each weight > 0
        try:
            self.recipe_config()
        except NVFP4ToolError as bad:  # the recipe's own checks, reported as the keys they are
            raise NVFP4UsageError(f"train config: {bad}") from None

    def check_paths(self) -> None:
        """The data and tokenizer paths a run reads exist (usage error naming the key); `model` is
        checked by the one checkpoint opener, as in every command (and so is `teacher`). Not part of construction: a
        finished run's recorded config stays readable after its data moved."""
        for path, _ in parse_mixture(self.data):
            _require("data", path, os.path.exists(path), "not found")
        _require("eval_data", self.eval_data, self.eval_data is None or os.path.exists(self.eval_data), "not found")
        _require(
            "precision_file",
            self.precision_file,
            self.precision_file is None or os.path.exists(self.precision_file),
            "expected a precision file or an export folder: not found",
        )
        _require(
            "equalize_from",
            self.equalize_from,
            self.equalize_from is None or os.path.isdir(self.equalize_from),
            "expected an export folder: no such folder",
        )
        _require(
            "tokenizer",
            self.tokenizer,
            self.tokenizer in (None, "train") or os.path.isdir(self.tokenizer),
            "expected train or a folder with tokenizer.json: no such folder",
        )

    def recipe_config(self) -> RecipeConfig:
        return RecipeConfig(
            name=self.recipe,
            rht=self.rht,
            stochastic_rounding=self.stochastic_rounding,
            weight_2d=self.weight_2d,
            quantizer=self.quantizer,
            gemm=self.gemm,
            bf16_first_layers=self.bf16_first_layers,
            bf16_last_layers=self.bf16_last_layers,
            bf16_patterns=tuple(self.bf16_patterns),
            switch_to_bf16_at=self.switch_to_bf16_at,
            switch_scope=self.switch_scope,
        )

    def resolved_recipe(self) -> RecipeConfig:
        """The recipe with quantizer and gemm resolved on this platform (`RecipeConfig.resolved`):
        what the run trains with and records; gemm=native where it cannot run is a usage error."""
        try:
            return self.recipe_config().resolved()
        except NVFP4UsageError as bad:
            raise NVFP4UsageError(f"train config: {bad}") from None

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


def key_table() -> list[tuple[str, str, str, str]]:
    """(key, type, default, description) of every TrainConfig field, in declaration order: what
    `nvfp4tool train --help` and `--list-keys` print (from the fields, so it cannot drift)."""
    hints = typing.get_type_hints(TrainConfig)
    rows = []
    for field in dataclasses.fields(TrainConfig):
        hint = hints[field.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        base = args[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) else hint
        kind = "list of text" if typing.get_origin(base) is tuple else {str: "text"}.get(base, base.__name__)
        rows.append((field.name, kind, _show_default(field.default), field.metadata.get("help", "")))
    return rows


def _show_default(value: Any) -> str:
    """A default as it would be typed in `key=value` (YAML)."""
    if value is None:
        return "unset"
    if value == "" or value == ():
        return "(required)" if value == "" else "[]"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def load_train_config(
    yaml_path: str | None, overrides: list[str], keys: Mapping[str, Any] | None = None
) -> TrainConfig:
    """The YAML file's keys (if any), then each `key=value` override, then `keys` (Python values,
    checked against each key's type as the YAML file's are: `nvfp4tool.api.train`).

    Override values are parsed as YAML (numbers, booleans, [lists]) except for text keys (paths,
    names, patterns), which take the text as typed (`data=yes` is the file "yes", not True).
    Errors: a missing config file, an unknown key or a bad value is a usage error (exit 2) naming
    the key; a config file that is not UTF-8 YAML mapping is a bad-file error naming it (and the
    line).
    """
    values: dict[str, Any] = {}
    if yaml_path:
        values.update(_read_yaml(Path(yaml_path)))
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise NVFP4UsageError(f"train: {item!r}: expected key=value")
        values[key] = _Raw(raw)
    values.update(keys or {})
    return _build(values, yaml_path or "command line")


class _Raw(str):
    """An override's text, parsed by `_coerce` according to its key's type."""


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise NVFP4UsageError(f"{path}: config file not found")
    if path.is_dir():
        raise NVFP4UsageError(f"{path}: is a folder, not a YAML config file")
    try:
        loaded = yaml.safe_load(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as bad:
        raise NVFP4ToolError(f"{path}: not UTF-8 text (byte {bad.start}); expected a YAML config") from None
    except yaml.YAMLError as bad:
        mark = getattr(bad, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(bad, "problem", None) or str(bad).splitlines()[0]
        raise NVFP4ToolError(f"{path}{where}: invalid YAML ({problem})") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict) or not all(isinstance(k, str) for k in loaded):
        raise NVFP4ToolError(f"{path}: expected a mapping of key: value")
    return loaded


def _build(values: dict[str, Any], source: str) -> TrainConfig:
    hints = typing.get_type_hints(TrainConfig)
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise NVFP4UsageError(f"{source}: unknown key(s) {', '.join(unknown)}; known keys: {', '.join(sorted(fields))}")
    config = TrainConfig(**{k: _coerce(k, v, hints[k]) for k, v in values.items()})
    config.check_paths()
    return config


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Check/convert one value to its field's type (int -> float allowed, str -> list for tuples)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    optional = type(None) in typing.get_args(hint)
    base = args[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) else hint
    text_key = base is str or typing.get_origin(base) is tuple
    if isinstance(value, _Raw):
        if not value.strip():
            value = None
        elif text_key and not value.lstrip().startswith("["):
            value = str(value)  # a path, name or pattern, as typed
        else:
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError as bad:
                raise NVFP4UsageError(
                    f"train config: {key}={value}: not a valid value ({getattr(bad, 'problem', None) or 'YAML'})"
                ) from None
    if value is None:
        if optional:
            return None
        raise NVFP4UsageError(f"train config: {key} cannot be empty")
    if base in (int, float) and isinstance(value, str):  # YAML reads "1e-3" (no dot) as a string
        try:
            value = base(value)
        except ValueError:
            pass
    if typing.get_origin(base) is tuple:
        items = value if isinstance(value, list) else [value]
        if all(isinstance(v, str) for v in items):
            return tuple(items)
    elif base is bool:
        if isinstance(value, bool):
            return value
    elif base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif base is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    elif base is str:
        if isinstance(value, str) or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            return str(value)
    expected = "list of text" if typing.get_origin(base) is tuple else getattr(base, "__name__", base)
    raise NVFP4UsageError(f"train config: {key}={value!r} is not a valid {expected}")


SCAN_CHOICES = ("auto", "true", "false")
# scan_layers=auto, measured (docs/benchmarks/train-step.md): a 6-layer step compiles 0.77x as long
# scanned but runs 15-60% slower on a CPU; from 12 layers compiling takes half as long or less
SCAN_FROM_LAYERS = 12


def scans_layers(scan_layers: str, num_layers: int) -> bool:
    """Whether a model of `num_layers` layers trains with scanned runs under `scan_layers`."""
    choice = str(scan_layers).lower()
    return choice == "true" or (choice == "auto" and num_layers >= SCAN_FROM_LAYERS)


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise NVFP4UsageError(f"train config: {key}={value!r}; choose one of {', '.join(choices)}")


def _require(key: str, value: Any, ok: bool, expected: str) -> None:
    if not ok:
        raise NVFP4UsageError(f"train config: {key}={value!r}: {expected}")
