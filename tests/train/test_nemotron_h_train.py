"""Training the hybrid nemotron_h family: the NVFP4 recipe on every linear of every layer kind
(Mamba in/out_proj, attention, relu2 MLPs, experts, the shared expert), the family's BF16 blocks
(the paper's first 2 and last 8 of 62, scaled by depth), the router in FP32 and its correction
bias untouched by training. The trained HF folder in transformers' NemotronHForCausalLM with our
logits, and the pipeline after it, are the family conformance suite's
(tests/quickstart/test_conformance.py)."""

from __future__ import annotations

import os

import pytest

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


@pytest.mark.slow  # the conformance suite's trained hybrid MoE (tests/fixtures/conformance_fixtures.py)
def test_training_leaves_the_correction_bias_and_the_fp32_router(conformance):
    """No gradient reaches the router's correction bias (it only chooses experts): the trained
    folder holds the source's bias bit for bit; the router stays FP32 in the BF16 folder. (That the
    trained folder loads in transformers with our logits, exports, checks and validates: the
    conformance suite.)"""
    from safetensors import safe_open

    source = conformance.source("nemotron_h_moe")  # ME*EM-: layer 1 is sparse
    trained = conformance.run("nemotron_h_moe") / "hf"
    bias = "backbone.layers.1.mixer.gate.e_score_correction_bias"
    with (
        safe_open(str(trained / "model.safetensors"), framework="numpy") as f,
        safe_open(os.path.join(source, "model.safetensors"), framework="numpy") as g,
    ):
        assert f.get_slice("backbone.layers.1.mixer.gate.weight").get_dtype() == "F32"
        assert f.get_slice("backbone.layers.1.mixer.experts.0.up_proj.weight").get_dtype() == "BF16"
        assert f.get_slice(bias).get_dtype() == g.get_slice(bias).get_dtype()
        assert f.get_tensor(bias).tobytes() == g.get_tensor(bias).tobytes()
