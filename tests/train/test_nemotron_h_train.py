"""Training the hybrid nemotron_h family: the NVFP4 recipe on every linear of every layer kind
(Mamba in/out_proj, attention, relu2 MLPs, experts, the shared expert), the family's BF16 blocks
(the paper's first 2 and last 8 of 62, scaled by depth), the router in FP32 and its correction
bias untouched; the trained run's HF folder is what transformers' NemotronHForCausalLM loads, with
the logits our model computes from it."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner

from converters.hf import HFFolderSource
from nvfp4tool.cli import cli
from nvfp4tool.config import ModelConfig
from nvfp4tool.model import forward, model_from_tensors
from nvfp4tool.recipes.precision import RecipeConfig, precision_map
from nvfp4tool.train.presets import preset_config


@pytest.mark.parametrize("layers, first, last", [(62, 2, 8), (8, 1, 2), (52, 2, 7)])
def test_the_family_keeps_the_papers_blocks_in_bf16(layers, first, last):
    config = preset_config("tiny-hybrid", 1024, 256)
    assert config.family_spec.bf16_blocks(layers) == (first, last)
    assert preset_config("tiny", 1024, 256).family_spec.bf16_blocks(layers)[0] == 1  # Llama's default stays


def test_every_linear_kind_runs_the_recipe():
    config = preset_config("tiny-hybrid-moe", 1024, 256)  # ME-M*EME
    pmap = precision_map(RecipeConfig(name="nvfp4"), config)
    kept_layers = {0, 6, 7}  # ceil(2 x 8 / 62) = 1 first, ceil(8 x 8 / 62) = 2 last
    for m in config.modules.linears:
        want = "bf16" if m.keep_dtype or m.layer in kept_layers else "nvfp4"
        assert pmap[m.name] == want, m.name
    quantized = {m.name.split(".mixer.")[1].split(".")[0] for m in config.modules.linears if pmap[m.name] == "nvfp4"}
    assert quantized == {
        "in_proj",
        "out_proj",
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "up_proj",
        "down_proj",
        "experts",
        "shared_experts",
    }
    overridden = precision_map(RecipeConfig(name="nvfp4", bf16_first_layers=0, bf16_last_layers=0), config)
    assert overridden["model.layers.0.mixer.in_proj"] == "nvfp4"


@pytest.mark.slow  # > 15 s of the inner loop (tests/durations.json)
def test_a_trained_hybrid_loads_in_transformers(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors import safe_open
    from transformers import NemotronHForCausalLM

    data = tmp_path / "train.txt"
    data.write_text(open("nvfp4tool/data/shakespeare_train.txt", encoding="utf-8").read()[:60000])
    out = tmp_path / "run"
    result = CliRunner().invoke(
        cli,
        [
            "train",
            "model=tiny-hybrid-moe",
            f"data={data}",
            "recipe=nvfp4",
            "steps=2",
            "seq_len=32",
            "batch_size=2",
            "eval_every=0",
            "vocab_size=512",
            f"out={out}",
        ],
    )
    assert result.exit_code == 0, result.output
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert losses and all(np.isfinite(losses))
    hf = out / "hf"
    with safe_open(str(hf / "model.safetensors"), framework="numpy") as f:
        assert f.get_slice("backbone.layers.1.mixer.gate.weight").get_dtype() == "F32"
        assert f.get_slice("backbone.layers.1.mixer.experts.0.up_proj.weight").get_dtype() == "BF16"
        # no gradient reaches the correction bias (it only chooses experts): it stays as initialised
        assert not f.get_tensor("backbone.layers.1.mixer.gate.e_score_correction_bias").any()
    reference = NemotronHForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    config = ModelConfig.from_hf_folder(hf)
    model = model_from_tensors(config, HFFolderSource(hf))
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 10))
    with torch.no_grad():
        want = reference(input_ids=torch.from_numpy(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(forward(model, jnp.asarray(ids))), want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_the_hybrid_pipeline_train_export_check_validate(tmp_path):
    """The quickstart-sized hybrid pipeline: train `tiny-hybrid` with the NVFP4 recipe, export
    the run (its precision map and tracked input amax), check it, validate it against the BF16
    weights it was trained to (the FP8 reference made on the fly)."""
    data = tmp_path / "train.txt"
    text = open("nvfp4tool/data/shakespeare_train.txt", encoding="utf-8").read()
    data.write_text(text[:60000])
    val = tmp_path / "val.txt"
    val.write_text(open("nvfp4tool/data/shakespeare_val.txt", encoding="utf-8").read()[:20000])
    runner = CliRunner()
    run = tmp_path / "run"
    result = runner.invoke(
        cli,
        [
            "train",
            "model=tiny-hybrid",
            f"data={data}",
            "recipe=nvfp4",
            "steps=3",
            "seq_len=32",
            "batch_size=2",
            "eval_every=0",
            "vocab_size=512",
            f"out={run}",
        ],
    )
    assert result.exit_code == 0, result.output
    out = tmp_path / "export"
    result = runner.invoke(cli, ["export", str(run), "--out", str(out)])
    assert result.exit_code == 0, result.output
    result = runner.invoke(cli, ["check", str(out)])
    assert result.exit_code == 0 and ": OK" in result.output, result.output
    result = runner.invoke(
        cli,
        [
            "validate",
            str(out),
            "--data",
            str(val),
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
            "--calib-data",
            str(data),
            "--calib-samples",
            "4",
            "--calib-seq-len",
            "32",
            "--max-kl-mean",
            "10",
            "--max-kl-p99",
            "50",
            "--min-top1",
            "0",
            "--max-ppl-increase",
            "10",
        ],
    )
    assert result.exit_code == 0, result.output
    record = json.loads((out / "validation.json").read_text())
    assert record["passed"] and set(record["models"]) >= {"bf16", "nvfp4", "fp8"}
    assert record["generation"]["skipped"] is None
