"""Training `tiny-deepseek` (the deepseek_v3 family's preset) with the NVFP4 recipe: every MLA
projection, dense MLP, routed and shared expert in NVFP4 outside the BF16 blocks, the routers kept;
2 steps of finite loss; the run's HF folder loads in transformers' DeepseekV3ForCausalLM with the
logits our model computes from it (router in FP32, correction bias untouched by training)."""

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


@pytest.mark.slow  # compiles an NVFP4 train step of a MoE model
def test_tiny_deepseek_trains_two_steps_and_loads_in_transformers(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors import safe_open
    from transformers import DeepseekV3ForCausalLM

    data = tmp_path / "train.txt"
    data.write_text(open("nvfp4tool/data/shakespeare_train.txt", encoding="utf-8").read()[:60000])
    out = tmp_path / "run"
    args = ["train", "model=tiny-deepseek", f"data={data}", "recipe=nvfp4", "steps=2", "seq_len=32", "scan_layers=true"]
    result = CliRunner().invoke(cli, [*args, "batch_size=2", "eval_every=0", "vocab_size=512", f"out={out}"])
    assert result.exit_code == 0, result.output
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert len(losses) == 2 and all(np.isfinite(losses))
    hf = out / "hf"
    with safe_open(str(hf / "model.safetensors"), framework="numpy") as f:
        assert f.get_slice("model.layers.1.mlp.gate.weight").get_dtype() == "F32"
        assert f.get_slice("model.layers.1.mlp.experts.0.up_proj.weight").get_dtype() == "BF16"
        assert not f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias").any()
    reference = DeepseekV3ForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager").eval()
    config = ModelConfig.from_hf_folder(hf)
    model = model_from_tensors(config, HFFolderSource(hf))
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 10))
    with torch.no_grad():
        want = reference(input_ids=torch.from_numpy(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(forward(model, jnp.asarray(ids))), want, rtol=1e-4, atol=1e-4)
