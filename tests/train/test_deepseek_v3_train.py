"""Training the deepseek_v3 family with the NVFP4 recipe: every MLA projection, dense MLP, routed and
shared expert of `tiny-deepseek` in NVFP4 outside the BF16 blocks, the routers kept; the router in
FP32 and its correction bias untouched by training. The trained HF folder in transformers'
DeepseekV3ForCausalLM with our logits, and the pipeline after it, are the family conformance
suite's (tests/quickstart/test_conformance.py)."""

from __future__ import annotations

import os

import pytest

from nvfp4tool.recipes.precision import RecipeConfig, precision_map
from nvfp4tool.train.presets import preset_config


def test_every_linear_kind_runs_the_recipe():
    config = preset_config("tiny-deepseek", 1024, 256)
    assert [config.layer_kind(i) for i in range(4)] == ["mla+mlp", "mla+moe", "mla+moe", "mla+moe"]
    pmap = precision_map(RecipeConfig(name="nvfp4"), config)
    first, last = config.family_spec.bf16_blocks(4)
    kept = set(range(first)) | set(range(4 - last, 4))
    for m in config.modules.linears:
        assert pmap[m.name] == ("bf16" if m.keep_dtype or m.layer in kept else "nvfp4"), m.name
    quantized = {m.name.split(".", 3)[3].split(".")[1] for m in config.modules.linears if pmap[m.name] == "nvfp4"}
    assert quantized == {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "experts", SHARED}


SHARED = "shared_experts"


@pytest.mark.slow  # the conformance suite's trained DeepSeek-V3 (tests/fixtures/conformance_fixtures.py)
def test_training_leaves_the_correction_bias_and_the_fp32_router(conformance):
    """No gradient reaches the router's correction bias (it only chooses experts): the trained
    folder holds the source's bias bit for bit; the router stays FP32 in the BF16 folder. (That the
    trained folder loads in transformers with our logits, exports, checks and validates: the
    conformance suite.)"""
    from safetensors import safe_open

    source = conformance.source("deepseek_v3")  # layer 0 dense, layer 1 DeepSeekMoE
    trained = conformance.run("deepseek_v3") / "hf"
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    with (
        safe_open(str(trained / "model.safetensors"), framework="numpy") as f,
        safe_open(os.path.join(source, "model.safetensors"), framework="numpy") as g,
    ):
        assert f.get_slice("model.layers.1.mlp.gate.weight").get_dtype() == "F32"
        assert f.get_slice("model.layers.1.mlp.experts.0.up_proj.weight").get_dtype() == "BF16"
        assert f.get_slice(bias).get_dtype() == g.get_slice(bias).get_dtype()
        assert f.get_tensor(bias).tobytes() == g.get_tensor(bias).tobytes()


@pytest.mark.slow  # compiles an NVFP4 train step of a MoE model
def test_tiny_deepseek_trains_with_its_moe_layers_scanned(tmp_path):
    """`scan_layers=true` (tiny-deepseek: 1 dense + 3 DeepSeekMoE layers, its alike MoE layers one
    `lax.scan` over stacked MLA and expert weights; the conformance suite's 2-layer model trains
    unscanned): 2 NVFP4 steps of finite loss; the run's HF folder holds every tensor the config
    expects and the routers' correction bias as initialized (zeros: no gradient reaches it)."""
    import json

    import numpy as np
    from click.testing import CliRunner
    from safetensors import safe_open

    from nvfp4tool.checkpoints import open_checkpoint
    from nvfp4tool.cli import cli

    data = tmp_path / "train.txt"
    data.write_text(open("nvfp4tool/data/shakespeare_train.txt", encoding="utf-8").read()[:60000])
    out = tmp_path / "run"
    args = ["train", "model=tiny-deepseek", f"data={data}", "recipe=nvfp4", "steps=2", "seq_len=32", "scan_layers=true"]
    result = CliRunner().invoke(cli, [*args, "batch_size=2", "eval_every=0", "vocab_size=512", f"out={out}"])
    assert result.exit_code == 0, result.output
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert len(losses) == 2 and all(np.isfinite(losses))
    hf = open_checkpoint(str(out / "hf"))
    assert sorted(hf.tensors.names()) == sorted(hf.config.expected_tensor_shapes())
    with safe_open(str(out / "hf" / "model.safetensors"), framework="numpy") as f:
        assert not f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias").any()
