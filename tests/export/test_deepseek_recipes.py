"""NVIDIA's DeepSeek-R1 NVFP4 recipes shipped as `export --recipe deepseek-r1 / deepseek-r1-v2`
(nvfp4tool/export/recipe_files/): they keep in BF16 exactly what NVIDIA's published checkpoints keep.
(`tests/export/test_recipes.py` exports every recipe and checks the result.)

The full DeepSeek-V3 module names are written out by hand from transformers' DeepseekV3 module tree
and the published config (61 layers, the first 3 dense, q_lora_rank 1536, 256 routed experts + 1
shared); the deepseek_v3 family's own names are tested on its tiny fixture config."""

from __future__ import annotations

import fnmatch
import re

import pytest

from nvfp4tool.export import recipes

LAYERS, DENSE, EXPERTS = 61, 3, 256
ATTENTION_LORA = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
ATTENTION_NO_LORA = ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")  # q_lora_rank null (V2-Lite)
MLP = ("gate_proj", "up_proj", "down_proj")
# nvidia/DeepSeek-R1-0528-NVFP4's hf_quant_config.json exclude_modules, as ModelOpt matches them
# (fnmatch): lm_head and every layer's self_attn*.
PUBLISHED = ["lm_head"] + [f"model.layers.{i}.self_attn*" for i in range(LAYERS)]


def deepseek_v3_linears(attention=ATTENTION_LORA) -> list[str]:
    names = []
    for i in range(LAYERS):
        names += [f"model.layers.{i}.self_attn.{p}" for p in attention]
        if i < DENSE:
            names += [f"model.layers.{i}.mlp.{p}" for p in MLP]
            continue
        names.append(f"model.layers.{i}.mlp.gate")  # the router
        names += [f"model.layers.{i}.mlp.experts.{e}.{p}" for e in range(EXPERTS) for p in MLP]
        names += [f"model.layers.{i}.mlp.shared_experts.{p}" for p in MLP]
    return names + ["lm_head"]


def kept(names: list[str], patterns) -> set[str]:
    """The names some fnmatch pattern matches (one regex of them all: ~50k names x 62 patterns)."""
    matches = re.compile("|".join(fnmatch.translate(p) for p in patterns)).match
    return {n for n in names if matches(n)}


def _patterns(name: str) -> tuple[str, ...]:
    recipe = recipes.read_recipe(name)
    assert recipe.calibration and recipe.options["quant"] == "nvfp4" and recipe.keep_bf16_rule is None
    return recipe.options["keep_bf16"]


@pytest.mark.parametrize("attention", [ATTENTION_LORA, ATTENTION_NO_LORA], ids=["q_lora", "q_proj"])
def test_deepseek_r1_keeps_what_nvidias_published_exclude_modules_keep(attention):
    names = deepseek_v3_linears(attention)
    ours = kept(names, _patterns("deepseek-r1"))
    assert ours == kept(names, PUBLISHED)
    assert len(ours) == LAYERS * len(attention) + 1  # every MLA linear and lm_head, no MLP / expert


@pytest.mark.parametrize("attention", [ATTENTION_LORA, ATTENTION_NO_LORA], ids=["q_lora", "q_proj"])
def test_deepseek_r1_v2_quantizes_o_proj_too(attention):
    """ptq.py's default: "*attn*" disabled, then "*wo*" (o_proj) quantized."""
    names = deepseek_v3_linears(attention)
    ours = kept(names, _patterns("deepseek-r1-v2"))
    assert ours == kept(names, PUBLISHED) - {n for n in names if n.endswith(".self_attn.o_proj")}


def test_the_recipe_files_cite_their_sources():
    for name in ("deepseek-r1", "deepseek-r1-v2"):
        with open(f"{recipes.FOLDER}/{name}.toml") as f:
            header = f.read()
        assert "https://huggingface.co/nvidia/DeepSeek-R1-0528" in header and "ptq.py" in header, name


@pytest.mark.parametrize("q_lora_rank", [24, None], ids=["q_lora", "q_proj"])
def test_the_recipes_on_the_tiny_deepseek_v3_family(q_lora_rank):
    """The deepseek_v3 family's own module names (tests/fixtures/deepseek_fixtures.py's tiny config,
    MLP widths made multiples of 16): the export plan under each recipe keeps what NVIDIA's patterns
    keep, plus the routers nvfp4tool never quantizes; dense MLPs and both kinds of experts are NVFP4."""
    from transformers import DeepseekV3Config

    from nvfp4tool.config import ModelConfig
    from nvfp4tool.export.plan import make_plan

    from fixtures.deepseek_fixtures import BASE

    options = dict(BASE, intermediate_size=48, moe_intermediate_size=16, q_lora_rank=q_lora_rank)
    config = ModelConfig.from_hf_config(DeepseekV3Config(**options).to_dict())
    names = config.linear_names()
    routers = {n for n in names if n.endswith(".mlp.gate")}
    published = ["lm_head"] + [f"model.layers.{i}.self_attn*" for i in range(config.num_layers)]
    for recipe, dropped in (("deepseek-r1", ()), ("deepseek-r1-v2", (".self_attn.o_proj",))):
        plan = make_plan(config, "nvfp4", keep_bf16=_patterns(recipe))
        assert set(plan.excluded) == {n for n in kept(names, published) if not n.endswith(dropped)} | routers
        for part in (".mlp.gate_proj", ".mlp.experts.0.up_proj", ".mlp.shared_experts.down_proj"):
            assert any(n.endswith(part) for n in plan.quantized), (recipe, part)
