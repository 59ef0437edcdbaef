"""The one checkpoint opener: an HF folder, a MaxText checkpoint or an nvfp4tool training run.

    ckpt = open_checkpoint(path, model_config=None, rope_layout=None, step=None, options=CLI_OPTIONS)
    ckpt.tensors, ckpt.config, ckpt.kind ("hf" | "maxtext" | "run"), ckpt.run, ckpt.precision_map

Every command opens its inputs here: one message and exit code per mistake (2 bad usage, 1 bad data),
options spelled as the caller types them (`OptionNames`). `step=N` restores `<run>/checkpoints/N`.
Design notes: docs/design/checkpoints.md.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
from typing import Any

import numpy as np

from converters.layout import ROPE_LAYOUTS
from converters.tensor_source import DictTensorSource, TensorSource
from nvfp4tool.config import ModelConfig
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError
from nvfp4tool.families import LM_HEAD
from nvfp4tool.run.records import (
    CHECKPOINTS_DIR,
    PRECISION_FILE,
    WEIGHTS_DIR,
    InputAmaxRecord,
    PrecisionMapRecord,
    RunRecord,
)


@dataclasses.dataclass(frozen=True)
class OptionNames:
    """How the caller's user spells the options, as format strings of the option and its value."""

    path: str = "{}"  # the checkpoint argument itself (positional on the command line)
    model_config: str | None = "--model-config {}"  # None: the command cannot take one
    rope_layout: str = "--rope-layout {}"
    step: str = "--step {}"


CLI_OPTIONS = OptionNames()
TRAIN_OPTIONS = OptionNames(
    path="model={}", model_config="model_config={}", rope_layout="rope_layout={}", step="step={}"
)
TEACHER_OPTIONS = dataclasses.replace(TRAIN_OPTIONS, path="teacher={}")  # train's distillation teacher


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """An opened checkpoint (see the module docstring)."""

    tensors: TensorSource
    config: ModelConfig
    path: str  # absolute
    kind: str  # "hf" | "maxtext" | "run"
    weight_files: list[str]  # the files holding the weights (hashed into provenance records)
    aux_dir: str | None  # folder with the tokenizer / generation config files, if any
    options: OptionNames = CLI_OPTIONS
    maxtext_name: str | None = None  # the MaxText model name given as the model config
    rope_layout: str | None = None  # the MaxText side's RoPE layout as given (or of a MaxText source)
    run: RunRecord | None = None
    precision_map: dict[str, str] | None = None
    precision_file: str | None = None  # a run trained with `precision_file=`: its copy (export reads its rules)
    input_amax: dict[str, float] | None = None
    weight_block: str = "1d"
    recipe: dict[str, Any] | None = None  # a run's recipe as the provenance record states it
    step: int | None = None
    # an FP8 block-scaled HF source (`converters.fp8_block.FP8Block`), read dequantized to BF16
    source_quantization: Any = None

    @property
    def definition_files(self) -> list[str]:
        """The files besides the weights that define what the checkpoint computes and how it is
        read: config.json, the generation settings and the tokenizer's files of its folder
        (`converters.hf.AUX_FILE_PATTERNS`); bound with the weights into provenance records. None
        for a MaxText checkpoint (its model config is given apart)."""
        if self.kind == "maxtext" or self.aux_dir is None:
            return []
        from converters.hf import AUX_FILE_PATTERNS

        folder = glob.escape(self.aux_dir)
        found = {os.path.join(self.aux_dir, "config.json")}
        for pattern in AUX_FILE_PATTERNS:
            found.update(glob.glob(os.path.join(folder, pattern)))
        return sorted(f for f in found if os.path.isfile(f))

    def maxtext_rope_layout(self) -> str:
        """The RoPE layout of the MaxText side (the given one, else the MaxText model name's)."""
        return resolve_rope_layout(
            self.rope_layout, self.maxtext_name, self.options, self.path, family=self.config.family
        )


def open_checkpoint(
    path: str | os.PathLike,
    *,
    model_config: str | None = None,
    rope_layout: str | None = None,
    step: int | None = None,
    options: OptionNames = CLI_OPTIONS,
) -> Checkpoint:
    """Open `path` (see the module docstring for what is accepted and the errors)."""
    shown = os.fspath(path)
    kind = checkpoint_kind(shown, options)
    if rope_layout is not None:
        _check_rope_layout(rope_layout, options)
    if step is not None and kind != "run":
        raise NVFP4UsageError(
            f"{shown}: {options.step.format(step)} needs an nvfp4tool training run "
            f"(a folder with {RunRecord.FILE_NAME} and {WEIGHTS_DIR}/)"
        )
    absolute = os.path.abspath(shown)
    given = resolve_model_config(model_config, options) if model_config is not None else None
    maxtext_name = given[1] if given else None
    if kind == "maxtext":
        if given is None:
            raise NVFP4UsageError(_needs_model_config(shown, options))
        from converters.maxtext import MaxTextSource

        layout = resolve_rope_layout(rope_layout, maxtext_name, options, shown, family=given[0].family)
        files = sorted(f for f in glob.glob(os.path.join(absolute, "**", "*"), recursive=True) if os.path.isfile(f))
        aux = model_config if model_config is not None and os.path.isdir(model_config) else None
        return Checkpoint(
            tensors=MaxTextSource(absolute, given[0], layout),
            config=given[0],
            path=absolute,
            kind=kind,
            weight_files=files,
            aux_dir=aux,
            options=options,
            maxtext_name=maxtext_name,
            rope_layout=layout,
        )
    if kind == "hf":
        _refuse_export(shown, options)
    opened = _open_run(absolute, step) if kind == "run" else _open_hf(absolute)
    if rope_layout is not None:  # the MaxText side this source will be written to, if any
        resolve_rope_layout(rope_layout, maxtext_name, options, shown, family=opened.config.family)
    if given is not None and given[0].expected_tensor_shapes() != opened.config.expected_tensor_shapes():
        raise NVFP4ToolError(
            f"{shown}: its config.json describes a different model than {options.model_config.format(model_config)}"
        )
    return dataclasses.replace(opened, options=options, maxtext_name=maxtext_name, rope_layout=rope_layout)


def checkpoint_kind(path: str, options: OptionNames = CLI_OPTIONS) -> str:
    """ "run", "hf" or "maxtext"; NVFP4UsageError "PATH: not found" (the path spelled as the user
    gave it, e.g. `model=PATH`) / NVFP4ToolError "PATH: neither ..." otherwise."""
    from converters.maxtext import is_maxtext_checkpoint

    if not os.path.exists(path):
        raise NVFP4UsageError(f"{options.path.format(path)}: not found")
    if RunRecord.exists(path):
        if not os.path.isdir(os.path.join(path, WEIGHTS_DIR)):
            raise NVFP4ToolError(
                f"{path}: a training run without final weights ({WEIGHTS_DIR}/ is "
                "missing): it has not finished; resume it with resume=true"
            )
        return "run"
    if os.path.isfile(os.path.join(path, "config.json")) and glob.glob(
        os.path.join(glob.escape(path), "*.safetensors")
    ):
        return "hf"
    if is_maxtext_checkpoint(path):
        return "maxtext"
    raise NVFP4ToolError(
        f"{path}: neither an HF folder (config.json + *.safetensors), a MaxText Orbax "
        f"checkpoint (<base>/<step>/items) nor an nvfp4tool training run "
        f"({RunRecord.FILE_NAME} + {WEIGHTS_DIR}/)"
    )


def resolve_model_config(spec: str, options: OptionNames = CLI_OPTIONS) -> tuple[ModelConfig, str | None]:
    """(config, MaxText model name or None) from a MaxText model name, an HF config.json or folder."""
    from converters import maxtext_models

    if spec in maxtext_models.MAXTEXT_MODELS:
        hf = maxtext_models.maxtext_hf_config(spec)
        return ModelConfig.from_hf_config(hf, source=f"MaxText model {spec}"), spec
    if os.path.exists(spec):
        return ModelConfig.from_hf_folder(spec), None
    raise NVFP4UsageError(
        f"{(options.model_config or '{}').format(spec)}: neither a file/folder nor a "
        f"known MaxText model name ({', '.join(maxtext_models.MAXTEXT_MODELS)})"
    )


def resolve_rope_layout(
    explicit: str | None,
    maxtext_name: str | None,
    options: OptionNames = CLI_OPTIONS,
    path: str | None = None,
    *,
    family: str | None = None,
) -> str:
    """The MaxText side's RoPE layout: the one `family`'s MaxText decoder fixes (an `explicit` other
    one is exit 2), else `explicit`, else the MaxText model name's; else exit 2."""
    from converters import maxtext_models

    fixed = maxtext_models.family_rope_layout(family) if family is not None else None
    if fixed is not None:
        if explicit is not None and explicit != fixed:
            _check_rope_layout(explicit, options)
            raise NVFP4UsageError(
                f"{options.rope_layout.format(explicit)}: MaxText's {family} decoder "
                f"uses the {fixed}-split RoPE layout, fixed by the family; drop the "
                f"option (or pass {options.rope_layout.format(fixed)})"
            )
        return fixed
    if explicit is not None:
        return _check_rope_layout(explicit, options)
    if maxtext_name is not None:
        return maxtext_models.rope_layout_for(maxtext_name)
    where = f"{path}: " if path else ""
    config_hint = f", or a MaxText model name as {options.model_config.format('NAME')}" if options.model_config else ""
    raise NVFP4UsageError(
        f"{where}which RoPE layout does the MaxText side use? pass "
        f"{options.rope_layout.format('interleaved|half')}{config_hint} "
        f"({', '.join(maxtext_models.interleaved_names())} are interleaved, the others half)"
    )


def run_steps(run_dir: str) -> list[int]:
    """The steps of a run with a usable checkpoint (a `<step>/state` folder), ascending."""
    base = os.path.join(run_dir, CHECKPOINTS_DIR)
    names = os.listdir(base) if os.path.isdir(base) else []
    return sorted(int(n) for n in names if re.fullmatch(r"\d+", n) and os.path.isdir(os.path.join(base, n, "state")))


# ------------------------------------------------------------------------------------------
# helpers


def _check_rope_layout(value: str, options: OptionNames) -> str:
    if value not in ROPE_LAYOUTS:
        raise NVFP4UsageError(
            f"{options.rope_layout.format(value)}: unknown RoPE layout; choose one of {', '.join(ROPE_LAYOUTS)}"
        )
    return value


def _needs_model_config(path: str, options: OptionNames) -> str:
    if options.model_config is None:
        return (
            f"{path}: a MaxText checkpoint carries no model config, which this command cannot "
            "take; convert it to an HF folder first (nvfp4tool convert PATH OUT --to hf "
            "--model-config CONFIG)"
        )
    return (
        f"{path}: a MaxText checkpoint carries no model config; pass "
        f"{options.model_config.format('CONFIG')} (an HF config.json / folder, or a MaxText "
        "model name such as llama3.1-8b)"
    )


def _refuse_export(path: str, options: OptionNames) -> None:
    """A serving export (its configs declare a quantization layout) is not a BF16 checkpoint."""
    from nvfp4tool.formats import describe, is_quantized_export

    if is_quantized_export(path):
        layout = describe(path)
        raise NVFP4ToolError(
            f"{options.path.format(path)}: a quantized export ({layout.format} {layout.quant}), not a "
            "BF16 checkpoint; pass the BF16 folder (or training run) it was made from"
        )


def _open_hf(path: str) -> Checkpoint:
    from converters.hf import HFFolderSource

    source = HFFolderSource(path)
    return Checkpoint(
        tensors=source,
        config=source.config,
        path=path,
        kind="hf",
        weight_files=sorted(glob.glob(os.path.join(glob.escape(path), "*.safetensors"))),
        aux_dir=path,
        source_quantization=source.fp8_block,
    )


def _open_run(run_dir: str, step: int | None) -> Checkpoint:
    from converters.hf import HFFolderSource

    record = RunRecord.read(run_dir)
    hf_dir = os.path.join(run_dir, WEIGHTS_DIR)
    pmap: dict[str, str] | None = PrecisionMapRecord.read(hf_dir).precisions
    input_amax: dict[str, float] | None = InputAmaxRecord.read(hf_dir).amax
    source: TensorSource = HFFolderSource(hf_dir)
    config = source.config
    files = sorted(glob.glob(os.path.join(glob.escape(hf_dir), "*.safetensors")))
    if step is not None:
        source, input_amax, files = _restore_step(run_dir, step, source)
    if all(p == "bf16" for n, p in pmap.items() if n != LM_HEAD):
        # A BF16 run trained nothing in low precision and tracked no input amax: its export is
        # post-training quantization with the default plan (calibrate with --calib-data).
        pmap, input_amax = None, None
    recipe = record.recipe_config()
    recipe_json = {
        "recipe": recipe.name,
        "rht": recipe.rht,
        "stochastic_rounding": recipe.stochastic_rounding,
        "weight_2d": recipe.weight_2d,
        "bf16_first_layers": recipe.bf16_first_layers,
        "bf16_last_layers": recipe.bf16_last_layers,
        "bf16_patterns": list(recipe.bf16_patterns),
    }
    return Checkpoint(
        tensors=source,
        config=config,
        path=run_dir,
        kind="run",
        weight_files=files,
        aux_dir=hf_dir,
        run=record,
        precision_map=pmap,
        precision_file=rules if os.path.isfile(rules := os.path.join(hf_dir, PRECISION_FILE)) else None,
        input_amax=input_amax,
        weight_block=record.weight_block,
        recipe=recipe_json,
        step=step,
    )


def _restore_step(run_dir: str, step: int, hf_source: TensorSource):
    """(BF16 tensor source of the step's master weights, its input amax, its files)."""
    import orbax.checkpoint as ocp
    from flax import nnx

    from nvfp4tool.model.weights import ModelTensorSource, model_from_tensors

    steps = run_steps(run_dir)
    if step not in steps:
        raise NVFP4ToolError(f"{run_dir}: no checkpoint for step {step} (have: {', '.join(map(str, steps)) or 'none'})")
    state_dir = os.path.join(run_dir, CHECKPOINTS_DIR, str(step), "state")
    state = ocp.StandardCheckpointer().restore(state_dir)
    model = model_from_tensors(hf_source.config, hf_source)
    graphdef, params = nnx.split(model)
    params.replace_by_pure_dict(state["params"])
    master = ModelTensorSource(nnx.merge(graphdef, params), path=state_dir)
    # The trainer's quantizers read the BF16 rounding of the FP32 master weights.
    tensors = {n: np.asarray(master.get(n)).astype("bfloat16") for n in master.names()}
    amax = {n: float(np.max(np.asarray(h))) for n, h in state.get("amax", {}).items()}
    files = sorted(
        f for f in glob.glob(os.path.join(glob.escape(state_dir), "**", "*"), recursive=True) if os.path.isfile(f)
    )
    return DictTensorSource(tensors, path=state_dir), amax, files
