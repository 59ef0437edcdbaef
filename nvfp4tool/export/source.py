"""What an export reads: an HF folder, a MaxText checkpoint, or an nvfp4tool training run.

    src = open_source(path, step=None, model_config=None)
    src.tensors        TensorSource with HF names (one tensor at a time)
    src.precision_map  the run's {linear: "bf16"|"nvfp4"|...} (None for plain checkpoints)
    src.input_amax     the run's tracked {linear: max|input|} (None: calibrate)
    src.weight_block   "2d" for a run trained with 2D weight scaling (so the export holds exactly
                       the trained weights), else "1d"

A run folder is `<run>/run.json` + `<run>/hf/` (the BF16 weights, `input_amax.json`,
`precision_map.json`). `step=N` restores `<run>/checkpoints/N` instead: its FP32 master weights
rounded to BF16 (what the trainer's quantizers read) and the amax history of that state.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Any

import numpy as np

from converters.tensor_source import DictTensorSource, TensorSource
from nvfp4tool.config import ModelConfig
from nvfp4tool.errors import NVFP4ToolError

RUN_FILE = "run.json"
INPUT_AMAX_FILE = "input_amax.json"
PRECISION_MAP_FILE = "precision_map.json"


@dataclasses.dataclass
class ExportSource:
    """An opened export source."""

    tensors: TensorSource
    config: ModelConfig
    path: str
    kind: str  # "hf" | "maxtext" | "run"
    weight_files: list[str]  # files whose sha256 goes into the provenance record
    aux_dir: str | None  # folder whose tokenizer / generation config files are copied
    precision_map: dict[str, str] | None = None
    input_amax: dict[str, float] | None = None
    weight_block: str = "1d"
    recipe: dict[str, Any] | None = None
    step: int | None = None


def open_source(path: str, *, step: int | None = None, model_config: str | None = None,
                rope_layout: str | None = None) -> ExportSource:
    """Open `path` (HF folder, MaxText checkpoint or training run); NVFP4ToolError if none fits.

    MaxText sources need `model_config` (a MaxText model name, which also fixes the RoPE layout,
    or an HF config.json / folder together with `rope_layout` "half" | "interleaved").
    """
    path = os.path.abspath(path)
    if os.path.isfile(os.path.join(path, RUN_FILE)) and os.path.isdir(os.path.join(path, "hf")):
        return _open_run(path, step)
    if step is not None:
        raise NVFP4ToolError(f"{path}: --step needs a training run folder (with {RUN_FILE})")
    from converters.convert import detect_format

    if detect_format(path) == "hf":
        from converters.hf import HFFolderSource

        source = HFFolderSource(path)
        return ExportSource(tensors=source, config=source.config, path=path, kind="hf",
                            weight_files=sorted(glob.glob(os.path.join(path, "*.safetensors"))),
                            aux_dir=path)
    if model_config is None:
        raise NVFP4ToolError(f"{path}: a MaxText checkpoint needs --model-config (a MaxText model "
                             "name or an HF config.json / folder)")
    from converters.convert import load_model_config
    from converters.maxtext import MaxTextSource
    from converters.maxtext_models import rope_layout_for

    config, maxtext_name = load_model_config(model_config)
    if rope_layout is None and maxtext_name is None:
        raise NVFP4ToolError(f"{path}: which RoPE layout does the MaxText checkpoint use? pass "
                             "--rope-layout half|interleaved, or a MaxText model name as --model-config")
    source = MaxTextSource(path, config, rope_layout or rope_layout_for(maxtext_name))
    files = sorted(f for f in glob.glob(os.path.join(path, "**", "*"), recursive=True)
                   if os.path.isfile(f))
    aux = model_config if os.path.isdir(model_config) else None
    return ExportSource(tensors=source, config=config, path=path, kind="maxtext",
                        weight_files=files, aux_dir=aux)


# ------------------------------------------------------------------------------------------
# helpers


def _open_run(run_dir: str, step: int | None) -> ExportSource:
    from converters.hf import HFFolderSource

    hf_dir = os.path.join(run_dir, "hf")
    record = _read_json(os.path.join(run_dir, RUN_FILE))
    train_config = record.get("config", {})
    pmap = _read_json(os.path.join(hf_dir, PRECISION_MAP_FILE))
    amax_path = os.path.join(hf_dir, INPUT_AMAX_FILE)
    input_amax = _read_json(amax_path) if os.path.isfile(amax_path) else None
    source = HFFolderSource(hf_dir)
    files = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
    if step is not None:
        source, input_amax, files = _restore_step(run_dir, step, source)
    if pmap is not None and all(p == "bf16" for n, p in pmap.items() if n != "lm_head"):
        # A BF16 run trained nothing in low precision and tracked no input amax: its export is
        # post-training quantization with the default plan (calibrate with --calib-data).
        pmap, input_amax = None, None
    block = "2d" if (train_config.get("recipe") == "nvfp4"
                     and train_config.get("weight_2d", True)) else "1d"
    recipe = {k: train_config.get(k) for k in ("recipe", "rht", "stochastic_rounding", "weight_2d",
                                                 "bf16_first_layers", "bf16_last_layers",
                                                 "bf16_patterns") if k in train_config}
    return ExportSource(tensors=source, config=ModelConfig.from_hf_folder(hf_dir), path=run_dir,
                        kind="run", weight_files=files, aux_dir=hf_dir, precision_map=pmap,
                        input_amax=input_amax, weight_block=block, recipe=recipe, step=step)


def _restore_step(run_dir: str, step: int, hf_source: TensorSource):
    """(BF16 tensor source of the step's master weights, its input amax, its files)."""
    import orbax.checkpoint as ocp
    from flax import nnx

    from nvfp4tool.model.weights import ModelTensorSource, model_from_tensors

    state_dir = os.path.join(run_dir, "checkpoints", str(step), "state")
    if not os.path.isdir(state_dir):
        steps = sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) if os.path.isdir(
            os.path.join(run_dir, "checkpoints")) else []
        raise NVFP4ToolError(f"{run_dir}: no checkpoint for step {step} (have: {', '.join(steps) or 'none'})")
    state = ocp.StandardCheckpointer().restore(state_dir)
    model = model_from_tensors(hf_source.config, hf_source)
    graphdef, params = nnx.split(model)
    params.replace_by_pure_dict(state["params"])
    master = ModelTensorSource(nnx.merge(graphdef, params), path=state_dir)
    # The trainer's quantizers read the BF16 rounding of the FP32 master weights.
    tensors = {n: np.asarray(master.get(n)).astype("bfloat16") for n in master.names()}
    amax = {n: float(np.max(np.asarray(h))) for n, h in state.get("amax", {}).items()}
    files = sorted(f for f in glob.glob(os.path.join(state_dir, "**", "*"), recursive=True)
                   if os.path.isfile(f))
    return DictTensorSource(tensors, path=state_dir), amax, files


def _read_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise NVFP4ToolError(f"{path}: not found") from None
    except json.JSONDecodeError as bad:
        raise NVFP4ToolError(f"{path}: not valid JSON ({bad})") from None
