"""The quickstart-sized MoE pipeline, CLI command after CLI command (in-process): train a tiny
Qwen3-MoE (`tiny-moe`: 8 experts, top-2) for a few steps with the NVFP4 recipe -> export NVFP4 W4A4
in both layouts with an FP8 KV cache (all-experts calibration) and an FP8 reference -> check every
export -> validate the NVFP4 export (its +fp8-kv row too) against BF16 and FP8."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from nvfp4tool.checkpoints import open_checkpoint
from nvfp4tool.cli import cli
from nvfp4tool.corpus.sources import embedded_corpus

pytestmark = pytest.mark.slow


def invoke(*args) -> str:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_pipeline")
    train_txt, val_txt = embedded_corpus()
    run = root / "run"
    invoke(
        "train",
        "model=tiny-moe",
        f"data={train_txt}",
        f"eval_data={val_txt}",
        "tokenizer=train",
        "vocab_size=384",
        "recipe=nvfp4",
        "steps=6",
        "seq_len=32",
        "batch_size=8",
        "lr=3e-3",
        "warmup_steps=1",
        "eval_every=0",
        "eval_batches=1",
        f"out={run}",
        "seed=0",
    )
    calib = ("--calib-data", val_txt, "--calib-samples", 4, "--calib-seq-len", 32)
    exports = {}
    for fmt in ("compressed-tensors", "modelopt"):
        exports[fmt] = root / f"nvfp4-{fmt}"
        invoke("export", run, "--out", exports[fmt], "--format", fmt, "--quant", "nvfp4", *calib, "--kv-cache", "fp8")
    exports["fp8"] = root / "fp8"
    invoke("export", run, "--out", exports["fp8"], "--format", "modelopt", "--quant", "fp8", *calib)
    return run, exports, val_txt


def test_every_export_passes_check_with_every_expert_and_kv_scale(pipeline):
    run, exports, _ = pipeline
    config = open_checkpoint(str(run / "hf")).config
    assert config.family == "qwen3_moe" and config.family_config.num_experts == 8
    for fmt in ("compressed-tensors", "modelopt"):
        folder = exports[fmt]
        invoke("check", folder)
        provenance = json.loads((folder / "nvfp4tool_export.json").read_text())
        text = json.dumps(provenance)
        for layer in range(config.num_layers):  # every expert of every sparse layer was calibrated
            for e in range(config.family_config.num_experts):
                assert f"{config.mlp_prefix(layer)}.experts.{e}." in text
        assert "kv" in text
    invoke("check", exports["fp8"])


def test_validate_reports_the_moe_export_and_its_fp8_kv_cache(pipeline):
    _, exports, val_txt = pipeline
    folder = exports["compressed-tensors"]
    result = CliRunner().invoke(
        cli,
        [
            "validate",
            str(folder),
            "--reference",
            str(exports["fp8"]),
            "--data",
            str(val_txt),
            "--samples",
            "4",
            "--seq-len",
            "32",
            "--prompts",
            "1",
            "--prompt-len",
            "8",
            "--gen-tokens",
            "4",
            "--max-kl-mean",
            "10",
            "--max-kl-p99",
            "50",
            "--max-ppl-increase",
            "10",
            "--min-layer-sqnr",
            "0",
        ],
    )
    assert result.exit_code == 0, result.output
    record = json.loads((folder / "validation.json").read_text())
    models = record["models"]
    assert {"nvfp4", "nvfp4+fp8-kv", "fp8"} <= set(models)
    for label in ("nvfp4", "nvfp4+fp8-kv", "fp8"):
        assert all(math.isfinite(v) for v in models[label].values() if isinstance(v, float)), label
    assert models["nvfp4"]["kl_mean"] != models["nvfp4+fp8-kv"]["kl_mean"]  # the KV cache is simulated
