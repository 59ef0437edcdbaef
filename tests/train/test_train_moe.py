"""Training MoE models with the NVFP4 recipe: every expert its own quantized linears (an expert's
gate/up one fused group), routers in BF16, `*.experts.*` keeps experts BF16, input amax per expert
(an expert without tokens records none), and `nvfp4tool train` end to end on Qwen3-MoE and Mixtral
(HF folders and the MoE presets): the loss falls, the aux loss is logged, the final HF folder opens
with its per-expert names."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner
from flax import nnx

from nvfp4tool.checkpoints import open_checkpoint
from nvfp4tool.cli import cli
from nvfp4tool.corpus.batch import Batch
from nvfp4tool.corpus.sources import embedded_corpus
from nvfp4tool.families import ATTENTION_MOE
from nvfp4tool.model import CausalLM, model_from_tensors
from nvfp4tool.recipes.precision import RecipeConfig, fused_group, group_amax, precision_map
from nvfp4tool.run.config import load_train_config
from nvfp4tool.train.metrics import read_metrics
from nvfp4tool.train.presets import preset_config
from nvfp4tool.train.step import StepFns, linear_weight

from fixtures.hf_fixtures import build_tiny_model
from fixtures.train_fixtures import CORPUS_VOCAB

VOCAB = CORPUS_VOCAB  # corpus_tokenizer's; the HF fixtures are rebuilt with this vocabulary


@pytest.fixture(scope="module")
def tokenizer_dir(corpus_tokenizer):
    return corpus_tokenizer


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


# model: an HF fixture (rebuilt with the tokenizer's vocabulary) or a preset; ~2.5 min each on 2 CPUs
RUNS = ["mixtral"]  # the Qwen3-MoE preset trains in tests/quickstart/test_moe_pipeline.py


@pytest.mark.slow
@pytest.mark.parametrize("model", RUNS)
def test_train_moe_with_the_nvfp4_recipe(model, tokenizer_dir, tmp_path):
    source = (
        model
        if model.startswith("tiny")
        else build_tiny_model(model, str(tmp_path / model), overrides={"vocab_size": VOCAB})
    )
    train_txt, val_txt = embedded_corpus()
    out = tmp_path / "run"
    args = dict(
        model=source,
        data=train_txt,
        eval_data=val_txt,
        tokenizer=tokenizer_dir,
        recipe="nvfp4",
        bf16_first_layers=0,
        bf16_last_layers=0,
        steps=5,
        seq_len=32,
        batch_size=8,
        lr=3e-3,
        warmup_steps=1,
        eval_every=0,
        eval_batches=1,
        out=out,
        seed=1,
    )
    result = CliRunner().invoke(cli, ["train", *(f"{k}={v}" for k, v in args.items())])
    assert result.exit_code == 0, result.output

    records = read_metrics(out)
    losses = [r["loss"] for r in records]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    assert all(math.isfinite(r["aux_loss"]) and r["aux_loss"] > 0 for r in records)

    hf = open_checkpoint(str(out / "hf"))
    config = hf.config
    assert config.family_spec.experts(config) is not None and sorted(hf.tensors.names()) == sorted(
        config.expected_tensor_shapes()
    )
    gate = config.family_spec.expert_attrs[0]
    sparse = [i for i in range(config.num_layers) if config.layer_kind(i) == ATTENTION_MOE]
    assert (
        f"{config.mlp_prefix(sparse[0])}.experts.{config.family_config.num_experts - 1}.{gate}.weight"
        in hf.tensors.names()
    )
    pmap = json.loads((out / "hf/precision_map.json").read_text())
    amax = json.loads((out / "hf/input_amax.json").read_text())
    assert all(pmap[n] == "bf16" for n in config.router_names())
    experts = [n for n in pmap if ".experts." in n]
    assert experts and all(pmap[n] == "nvfp4" for n in experts)
    assert set(amax) == {n for n, p in pmap.items() if p == "nvfp4"}  # every expert, by its own name
    assert all(math.isfinite(v) and v >= 0 for v in amax.values())
    assert sum(amax[n] > 0 for n in experts) >= len(experts) // 2  # the routed experts saw tokens
    model_from_tensors(config, hf.tensors, dtype=jnp.float32)  # the saved weights load
