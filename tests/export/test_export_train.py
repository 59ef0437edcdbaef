"""Export of a training run holds exactly the quantized weights the trainer's forward uses.

A tiny nvfp4 run (3 steps, 2D weight scaling, checkpoint at step 3) is exported. For every
quantized linear, the exported packed codes and block scales must equal those of the trainer's
own fprop weight quantizer applied to the final parameters: `quantize_nvfp4(bf16(w), block="2d",
global_amax=group_amax(...))` (`recipes.nvfp4_dot._fprop` with `recipes.precision.group_amax`, as
`train.step.StepFns.loss` calls them; the final eval forward runs on exactly these parameters).
The input scales come from the run's tracked amax, the BF16 layers of the run are excluded, and
`--step 3` (restoring the Orbax checkpoint) gives the same bytes as the run's final hf/ folder.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from converters.hf import HFFolderSource
from nvfp4tool.corpus.sources import embedded_corpus
from nvfp4tool.export import ExportOptions, export_checkpoint
from nvfp4tool.numerics import nvfp4_global_scales, quantize_nvfp4
from nvfp4tool.recipes.precision import GEMM_INPUT_DTYPE, fused_group, group_amax
from nvfp4tool.records.export import ExportRecord
from nvfp4tool.run.config import load_train_config
from nvfp4tool.train.step import linear_weight
from nvfp4tool.train.trainer import train


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, corpus_tokenizer):
    root = tmp_path_factory.mktemp("run")
    train_txt, val_txt = embedded_corpus()
    args = dict(
        model="tiny",
        data=str(train_txt),
        eval_data=str(val_txt),
        tokenizer=str(corpus_tokenizer),
        recipe="nvfp4",
        steps=3,
        seq_len=32,
        batch_size=8,
        lr=3e-3,
        warmup_steps=1,
        eval_every=3,
        eval_batches=1,
        checkpoint_every=3,
        out=str(root / "run"),
        seed=1,
    )
    train(load_train_config(None, [f"{k}={v}" for k, v in args.items()]))
    return root / "run"


def _final_params_model(run_dir):
    import orbax.checkpoint as ocp
    from flax import nnx

    from nvfp4tool.model.weights import model_from_tensors

    hf = HFFolderSource(run_dir / "hf")
    state = ocp.StandardCheckpointer().restore(str(run_dir / "checkpoints" / "3" / "state"))
    graphdef, params = nnx.split(model_from_tensors(hf.config, hf))
    params.replace_by_pure_dict(state["params"])
    return nnx.merge(graphdef, params)


@pytest.mark.slow
def test_run_export_holds_the_trainers_quantized_weights(run_dir, tmp_path):
    export_checkpoint(str(run_dir), str(tmp_path / "final"), ExportOptions(show_progress=False))
    out = HFFolderSource(tmp_path / "final", check_config=False)
    pmap = json.loads((run_dir / "hf" / "precision_map.json").read_text())
    input_amax = json.loads((run_dir / "hf" / "input_amax.json").read_text())
    quantized = [n for n, p in pmap.items() if p == "nvfp4"]
    assert quantized and len(quantized) < len(pmap)

    model = _final_params_model(run_dir)
    weights = {n: linear_weight(model, n) for n in quantized}
    amax_by_group = group_amax(weights)  # the trainer's fused-group amax over BF16 weights
    for name in quantized:
        trained = quantize_nvfp4(
            weights[name].astype(GEMM_INPUT_DTYPE), block="2d", global_amax=amax_by_group[fused_group(name)]
        )
        assert np.array_equal(out.get(f"{name}.weight"), np.asarray(trained.packed)), name
        assert (
            out.get(f"{name}.weight_scale").view(np.uint8).tobytes()
            == np.asarray(trained.scales).view(np.uint8).tobytes()
        ), name
        assert out.get(f"{name}.weight_scale_2") == np.asarray(nvfp4_global_scales(trained.global_amax)[1])
        group_in = max(np.float32(input_amax[m]) for m in quantized if fused_group(m) == fused_group(name))
        assert out.get(f"{name}.input_scale") == np.asarray(nvfp4_global_scales(group_in)[1])
    header_names = out.names()
    for name, precision in pmap.items():
        if precision == "bf16":
            assert out.dtype(f"{name}.weight") == "bfloat16"
            assert not [
                n
                for n in header_names
                if n.startswith(name + ".") and n != f"{name}.weight" and not n.endswith(".bias")
            ], name
    with open(tmp_path / "final" / "hf_quant_config.json") as f:
        assert sorted(json.load(f)["quantization"]["exclude_modules"]) == sorted(
            n for n, p in pmap.items() if p == "bf16"
        )
    record = ExportRecord.read(tmp_path / "final")
    assert record.weight_block == "2d" and record.input_amax_origin == "training run"
    assert record.recipe["recipe"] == "nvfp4" and record.source.kind == "run"
    assert record.source.name == os.path.basename(str(run_dir)) and "hf/model.safetensors" in record.source.files

    # --step 3 (the Orbax checkpoint's FP32 master weights, rounded to BF16) = the final hf/ folder
    export_checkpoint(str(run_dir), str(tmp_path / "step3"), ExportOptions(step=3, show_progress=False))
    step3 = HFFolderSource(tmp_path / "step3", check_config=False)
    assert step3.names() == header_names
    for name in header_names:
        assert step3.get(name).tobytes() == out.get(name).tobytes(), name
    # the same run with 1d block scales differs (so the 2d default is what makes it exact)
    export_checkpoint(str(run_dir), str(tmp_path / "w1d"), ExportOptions(weight_block="1d", show_progress=False))
    w1d = HFFolderSource(tmp_path / "w1d", check_config=False)
    assert any(w1d.get(f"{n}.weight_scale").tobytes() != out.get(f"{n}.weight_scale").tobytes() for n in quantized)
    assert os.path.isfile(tmp_path / "final" / "tokenizer.json")


def test_a_bf16_run_exports_as_post_training_quantization(tmp_path):
    """A run trained in BF16 has no NVFP4 layers and no tracked amax: exporting it quantizes with
    the default plan and asks for calibration data for W4A4 instead of quantizing nothing."""
    from nvfp4tool.errors import NVFP4ToolError

    train_txt, _ = embedded_corpus()
    run = train(
        load_train_config(
            None,
            [
                "model=tiny",
                f"data={train_txt}",
                "tokenizer=train",
                "vocab_size=300",
                "recipe=bf16",
                "steps=1",
                "seq_len=32",
                "batch_size=8",
                "eval_every=0",
                f"out={tmp_path / 'run'}",
            ],
        )
    )
    with pytest.raises(NVFP4ToolError, match="--calib-data"):
        export_checkpoint(str(run.out), str(tmp_path / "w4a4"), ExportOptions(show_progress=False))
    summary = export_checkpoint(
        str(run.out), str(tmp_path / "w4a16"), ExportOptions(quant="nvfp4-weight-only", show_progress=False)
    )
    assert summary.quantized_modules == 4 * 7  # every decoder linear; lm_head stays BF16
