"""Training MoE models with the NVFP4 recipe: every expert its own quantized linears (an expert's
gate/up one fused group), routers in BF16, `*.experts.*` keeps experts BF16, input amax per expert
(an expert without tokens records none). `nvfp4tool train` end to end on Qwen3-MoE and Mixtral (the
aux loss logged, the HF folder with its per-expert names, the precision map and amax of every
expert) is the family conformance suite's (tests/quickstart/test_conformance.py)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nvfp4tool.checkpoints import open_checkpoint
from nvfp4tool.corpus.batch import Batch
from nvfp4tool.corpus.sources import embedded_corpus
from nvfp4tool.model import CausalLM, model_from_tensors
from nvfp4tool.recipes.precision import RecipeConfig, fused_group, group_amax, precision_map
from nvfp4tool.run.config import load_train_config
from nvfp4tool.train.presets import preset_config
from nvfp4tool.train.step import StepFns, linear_weight

from fixtures.hf_fixtures import build_tiny_model
from fixtures.train_fixtures import CORPUS_VOCAB

VOCAB = CORPUS_VOCAB  # corpus_tokenizer's


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-mixtral"])
def test_precision_map_and_fused_groups_name_every_expert(preset):
    config = preset_config(preset, VOCAB, 256)
    gate, up, down = config.family_spec.expert_attrs
    recipe = RecipeConfig(name="nvfp4", bf16_first_layers=0, bf16_last_layers=0)
    pmap = precision_map(recipe, config)
    routers = config.router_names()
    experts = [n for n in pmap if ".experts." in n]
    assert len(experts) == config.num_layers * config.family_config.num_experts * 3
    assert all(pmap[n] == "bf16" for n in routers) and all(pmap[n] == "nvfp4" for n in experts)
    # the CLI's key: one pattern keeps every expert in BF16, and nothing else
    kept = load_train_config(
        None,
        [
            f"data={embedded_corpus()[0]}",
            "recipe=nvfp4",
            "bf16_first_layers=0",
            "bf16_last_layers=0",
            "bf16_patterns=*.experts.*",
        ],
    ).recipe_config()
    assert kept.bf16_patterns == ("*.experts.*",)
    kept_map = precision_map(kept, config)
    assert {n for n, p in kept_map.items() if p == "bf16"} == {"lm_head", *routers, *experts}
    # gate/up of one expert: one group and one global amax; each expert its own
    expert = f"{config.mlp_prefix(1)}.experts.3"
    assert fused_group(f"{expert}.{gate}") == fused_group(f"{expert}.{up}") == f"{expert}.gate_up"
    assert fused_group(f"{expert}.{down}") == f"{expert}.{down}"
    model = CausalLM(config, rngs=nnx.Rngs(0))
    weights = {n: linear_weight(model, n) for n in experts}
    amax = group_amax(weights)
    assert float(amax[f"{expert}.gate_up"]) == max(
        float(jnp.max(jnp.abs(weights[f"{expert}.{p}"].astype(jnp.bfloat16)))) for p in (gate, up)
    )
    assert (
        len(
            {
                float(amax[f"{config.mlp_prefix(1)}.experts.{e}.gate_up"])
                for e in range(config.family_config.num_experts)
            }
        )
        > 1
    )


def test_input_amax_is_per_expert_and_an_expert_without_tokens_records_none(tmp_path):
    """The mixtral fixture's router never picks its last expert: that expert's rows are all zero,
    so its input amax is 0, while every other expert records its routed tokens' max."""
    folder = build_tiny_model("mixtral", str(tmp_path / "mixtral"))
    source = open_checkpoint(folder)
    config = source.config
    model = model_from_tensors(config, source.tensors, dtype=jnp.float32, compute_dtype=jnp.bfloat16)
    recipe = RecipeConfig(name="nvfp4", bf16_first_layers=0, bf16_last_layers=0)
    graphdef, params = nnx.split(model)
    fns = StepFns(graphdef, recipe, precision_map(recipe, config), optimizer=None, grad_accum=1)
    windows = np.random.default_rng(0).integers(3, config.vocab_size, (4, 17))
    loss, (amax, parts) = jax.jit(fns.loss)(params.to_pure_dict(), Batch(windows), jax.random.key(0))
    assert math.isfinite(float(loss)) and float(parts["aux_loss"]) > 0
    assert set(amax) == set(fns.quantized) and not set(amax) & set(config.router_names())
    last = config.family_config.num_experts - 1
    for layer in range(config.num_layers):
        for e in range(config.family_config.num_experts):
            for proj in config.family_spec.expert_attrs:
                value = float(amax[f"{config.mlp_prefix(layer)}.experts.{e}.{proj}"])
                assert value == 0.0 if e == last else value > 0, (layer, e, proj)
