"""Precision map, fused groups and the recipe LinearFn plugged into the model's seam."""

from __future__ import annotations

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nvfp4tool.config import ModelConfig
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.model import CausalLM, forward
from nvfp4tool.numerics import dot_nt
from nvfp4tool.recipes.nvfp4_dot import NVFP4Options, nvfp4_dot
from nvfp4tool.recipes.precision import (
    RecipeConfig,
    check_block_widths,
    fused_group,
    group_amax,
    layer_key,
    make_linear,
    precision_map,
    training_seam,
)

CONFIG = ModelConfig(
    family="llama",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_layers=8,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)


def test_default_precision_map_keeps_first_and_last_blocks_and_lm_head():
    pmap = precision_map(RecipeConfig(name="nvfp4"), CONFIG)
    assert pmap["lm_head"] == "bf16"
    by_layer = {i: {pmap[n] for n in pmap if n.startswith(f"model.layers.{i}.")} for i in range(8)}
    # first 1 block and the last ceil(0.15 * 8) = 2 blocks in BF16
    assert [by_layer[i] for i in range(8)] == [{"bf16"}] + [{"nvfp4"}] * 5 + [{"bf16"}] * 2
    assert len(pmap) == 8 * 7 + 1


def test_a_width_the_nvfp4_recipe_cannot_block_is_named_in_one_line():
    """The MLP 40 wide: gate/up's out features and down's in features are not 16-element blocks
    (the backward GEMM quantizes the output gradient along out features); kept in BF16 it trains."""
    config = dataclasses.replace(CONFIG, intermediate_size=40)
    recipe = RecipeConfig(name="nvfp4", bf16_first_layers=1, bf16_last_layers=0)
    with pytest.raises(NVFP4ToolError) as refused:
        check_block_widths(precision_map(recipe, config), config)
    assert str(refused.value).splitlines() == [
        "model.layers.1.mlp.gate_proj: weight 40 x 64 (out x in features) cannot train with the nvfp4 recipe: its "
        "forward and backward GEMMs quantize both widths in 16-element blocks; keep it in BF16 (bf16_patterns) "
        "or use widths that are multiples of 16"
    ]
    check_block_widths(precision_map(dataclasses.replace(recipe, bf16_patterns=("*.mlp.*",)), config), config)
    check_block_widths(precision_map(RecipeConfig(name="fp8"), config), config)  # per-tensor scales: any width


def test_precision_map_options():
    pmap = precision_map(
        RecipeConfig(name="fp8", bf16_first_layers=0, bf16_last_layers=0, bf16_patterns=("*.mlp.down_proj",)), CONFIG
    )
    assert pmap["model.layers.0.self_attn.q_proj"] == "fp8"
    assert pmap["model.layers.7.mlp.up_proj"] == "fp8"
    assert all(v == "bf16" for n, v in pmap.items() if n.endswith("down_proj"))
    assert set(precision_map(RecipeConfig(name="bf16"), CONFIG).values()) == {"bf16"}
    with pytest.raises(NVFP4ToolError, match="unknown recipe"):
        RecipeConfig(name="int4")


def test_switch_step():
    assert RecipeConfig(switch_to_bf16_at=0.8).switch_step(100) == 81
    assert RecipeConfig(switch_to_bf16_at=30).switch_step(100) == 30
    assert RecipeConfig().switch_step(100) is None


def test_fused_groups_share_the_joint_amax():
    assert fused_group("model.layers.3.self_attn.k_proj") == "model.layers.3.self_attn.qkv"
    assert fused_group("model.layers.3.mlp.up_proj") == "model.layers.3.mlp.gate_up"
    assert fused_group("model.layers.3.self_attn.o_proj") == "model.layers.3.self_attn.o_proj"
    weights = {
        "a.self_attn.q_proj": jnp.full((16, 16), 0.5),
        "a.self_attn.k_proj": jnp.full((16, 16), -3.0),
        "a.self_attn.v_proj": jnp.full((16, 16), 1.0),
        "a.mlp.down_proj": jnp.full((16, 16), 2.0),
    }
    amax = group_amax(weights)
    assert float(amax["a.self_attn.qkv"]) == 3.0 and float(amax["a.mlp.down_proj"]) == 2.0


@pytest.fixture(scope="module")
def model_and_batch():
    model = CausalLM(CONFIG, rngs=nnx.Rngs(0))
    ids = jax.random.randint(jax.random.key(1), (2, 32), 0, CONFIG.vocab_size)
    return model, ids


def test_recipe_linear_uses_the_group_amax_and_records_input_amax(model_and_batch):
    model, ids = model_and_batch
    recipe = RecipeConfig(name="nvfp4", bf16_first_layers=0, bf16_last_layers=0)
    pmap = precision_map(recipe, CONFIG)
    blocks = model.layers
    weights = {
        f"model.layers.{i}.{path}": getattr(getattr(b, part), proj).weight[...]
        for i, b in enumerate(blocks)
        for part, proj, path in [("self_attn", p, f"self_attn.{p}") for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
        + [("mlp", p, f"mlp.{p}") for p in ("gate_proj", "up_proj", "down_proj")]
    }
    amax = group_amax(weights)
    key = jax.random.key(3)
    seam = training_seam(recipe, pmap, CONFIG, key, (amax, {}))
    x = jax.random.normal(jax.random.key(4), (2, 16, 64), jnp.float32)
    name = "model.layers.2.self_attn.k_proj"
    y, side = seam.at(2).project(x, weights[name], None, name)
    np.testing.assert_array_equal(
        np.asarray(y), np.asarray(make_linear(recipe, pmap, key, amax)(x, weights[name], None, name=name))
    )  # the LinearFn and the tap: one implementation
    sink = side.records
    x_bf, w_bf = x.astype(jnp.bfloat16), weights[name].astype(jnp.bfloat16)
    group = amax["model.layers.2.self_attn.qkv"]
    assert float(group) > float(jnp.max(jnp.abs(w_bf)))  # the shared amax is not k's own
    expected = nvfp4_dot(x_bf, w_bf, jax.random.key(0), group, NVFP4Options()).astype(x.dtype)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(expected))
    assert float(sink[name]) == float(jnp.max(jnp.abs(x_bf)))
    # bf16 layers record nothing
    _, head = seam.at(None).project(x, model.lm_head.weight[...], None, "lm_head")
    assert head.records == {}


def test_recipes_change_the_logits_and_bf16_scope_all_undoes_it(model_and_batch):
    model, ids = model_and_batch
    logits = {}
    for name in ("bf16", "fp8", "fp8-block", "nvfp4"):
        recipe = RecipeConfig(name=name, bf16_first_layers=0, bf16_last_layers=0)
        linear = make_linear(recipe, precision_map(recipe, CONFIG), jax.random.key(0))
        logits[name] = np.asarray(forward(model, ids, linear=linear))
    recipe = RecipeConfig(name="nvfp4")
    switched = make_linear(recipe, precision_map(recipe, CONFIG), jax.random.key(0), bf16_scope="all")
    np.testing.assert_array_equal(np.asarray(forward(model, ids, linear=switched)), logits["bf16"])
    err = {
        n: np.abs(logits[n] - logits["bf16"]).mean() / np.abs(logits["bf16"]).mean()
        for n in ("fp8", "fp8-block", "nvfp4")
    }
    assert 0 < err["fp8-block"] and 0 < err["fp8"] < err["nvfp4"] < 0.5, err


def _key_data(key: jax.Array) -> tuple[int, ...]:
    return tuple(np.asarray(jax.random.key_data(key)).ravel().tolist())


def test_layer_keys_differ_by_layer_and_step_and_reproduce():
    """SR key of (seed, step, layer): the trainer's step key (seed folded with the step) folded
    with the layer name; distinct for every layer and step, equal for the same triple."""
    names = CONFIG.linear_names()
    step_keys = {(seed, step): jax.random.fold_in(jax.random.key(seed), step) for seed in (0, 1) for step in (1, 2, 3)}
    keys = {
        (seed, step, name): _key_data(layer_key(k, name)) for (seed, step), k in step_keys.items() for name in names
    }
    assert len(set(keys.values())) == len(keys)  # no two (seed, step, layer) share a key
    again = {
        (seed, step, name): _key_data(layer_key(jax.random.fold_in(jax.random.key(seed), step), name))
        for seed, step, name in keys
    }
    assert again == keys


def _operands() -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [32, 64], w [64, 64] and the upstream gradient g [32, 64] of one linear call."""
    x = jax.random.normal(jax.random.key(4), (32, 64), jnp.float32)
    w = jax.random.normal(jax.random.key(5), (64, 64), jnp.float32) * 0.1
    g = jax.random.normal(jax.random.key(6), (32, 64), jnp.float32)
    return x, w, g


def _dx(linear, name: str) -> np.ndarray:
    """d(sum(y * g))/dx of one linear call: the dgrad GEMM quantizes g (SR when enabled)."""
    x, w, g = _operands()
    return np.asarray(jax.grad(lambda x: jnp.sum(linear(x, w, None, name=name) * g))(x))


@pytest.mark.parametrize("sr", [True, False])
def test_make_linear_rounds_each_layer_and_step_with_its_own_key(sr: bool):
    """The key make_linear derives is the one the gradient uses: the same layer and step key give
    the same bits; another layer or step key changes them (only with stochastic rounding)."""
    recipe = RecipeConfig(name="nvfp4", bf16_first_layers=0, bf16_last_layers=0, stochastic_rounding=sr)
    pmap = precision_map(recipe, CONFIG)
    a, b = "model.layers.2.self_attn.o_proj", "model.layers.3.self_attn.o_proj"
    step1, step2 = (jax.random.fold_in(jax.random.key(7), step) for step in (1, 2))
    base = _dx(make_linear(recipe, pmap, step1), a)
    np.testing.assert_array_equal(_dx(make_linear(recipe, pmap, step1), a), base)
    for other in (_dx(make_linear(recipe, pmap, step1), b), _dx(make_linear(recipe, pmap, step2), a)):
        assert (not np.array_equal(other, base)) == sr
    if sr:  # and it is exactly nvfp4_dot with the derived key

        def direct(x, w_NxK, b_N, *, name):
            y = nvfp4_dot(
                x.astype(jnp.bfloat16), w_NxK.astype(jnp.bfloat16), layer_key(step1, name), None, NVFP4Options()
            )
            return y.astype(x.dtype)

        np.testing.assert_array_equal(base, _dx(direct, a))


@pytest.mark.parametrize("quantizer", ["xla", "pallas"])
def test_quantizer_flows_from_the_recipe_to_nvfp4_options(monkeypatch, quantizer):
    seen = []
    precision_module = importlib.import_module("nvfp4tool.recipes.precision")
    monkeypatch.setattr(
        precision_module,
        "nvfp4_dot",
        lambda x, w, key, amax, options, weight=None: seen.append(options) or dot_nt(x, w),
    )
    recipe = RecipeConfig(name="nvfp4", quantizer=quantizer, gemm="emulated")
    name = "model.layers.2.mlp.up_proj"
    linear = make_linear(recipe, {name: "nvfp4"}, jax.random.key(0))
    linear(jnp.ones((16, 64)), jnp.ones((128, 64)), None, name=name)
    assert [o.quantizer for o in seen] == [quantizer]
    assert [o.gemm for o in seen] == ["emulated"]  # and so does the gemm
    with pytest.raises(NVFP4ToolError, match="quantizer must be one of"):
        RecipeConfig(name="nvfp4", quantizer="triton")


# ------------------------------------------------------------------------------------------
# a precision file's per-linear formats (issue 41)


def _rules(tmp_path, text: str):
    from nvfp4tool.formats.precision_file import read_precision_file

    path = tmp_path / "precision.txt"
    path.write_text(text)
    return read_precision_file(str(path)), str(path)


def test_a_precision_file_gives_linears_their_own_training_precision(tmp_path):
    rules, path = _rules(
        tmp_path,
        "model.layers.1.self_attn.* fp8\nmodel.layers.2.mlp.* nvfp4-weight-only\nmodel.layers.3.mlp.up_proj bf16\n"
        "model.layers.0.self_attn.o_proj nvfp4\n",
    )
    recipe = RecipeConfig(name="nvfp4")  # keeps blocks 0, 6 and 7 in BF16; a rule overrides that
    pmap = precision_map(recipe, CONFIG, rules)
    plain = precision_map(recipe, CONFIG)
    expected = dict(plain)
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        expected[f"model.layers.1.self_attn.{proj}"] = "fp8"
    for proj in ("gate_proj", "up_proj", "down_proj"):
        expected[f"model.layers.2.mlp.{proj}"] = "nvfp4-weight-only"
    for proj in ("gate_proj", "up_proj"):  # one BF16 member keeps its fused group in BF16
        expected[f"model.layers.3.mlp.{proj}"] = "bf16"
    expected["model.layers.0.self_attn.o_proj"] = "nvfp4"
    assert pmap == expected and pmap["lm_head"] == "bf16"
    split, where = _rules(tmp_path, "model.layers.1.self_attn.q_proj fp8\n")
    with pytest.raises(NVFP4ToolError, match=rf"^{where}:1: fused group model\.layers\.1\.self_attn\.qkv .* split"):
        precision_map(recipe, CONFIG, split)
    unused, where = _rules(tmp_path, "model.layers.9.* fp8\n")
    with pytest.raises(NVFP4ToolError, match=rf"^{where}:1: 'model\.layers\.9\.\*' matches no quantizable linear"):
        precision_map(recipe, CONFIG, unused)


def test_a_weight_only_linear_trains_its_nvfp4_weight_straight_through():
    """W4A16 in training: y = x fq(w)^T with fq the NVFP4 fake quantization (2D 16x16 scales, the
    fused group's amax) in the numpy oracle, x in BF16; dX = dY fq(w), dW = dY^T X."""
    from nvfp4tool.recipes.precision import recipe_gemm

    from fixtures import nvfp4_oracle as oracle

    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.normal(size=(2, 16, 32)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(16, 32)), jnp.bfloat16)
    g = jnp.asarray(rng.normal(size=(2, 16, 16)), jnp.float32)
    amax = jnp.float32(4.0)  # the group's (above this weight's own)
    q = oracle.quantize(np.asarray(w, np.float32), block="2d", global_amax=np.float32(4.0))
    w_q = oracle.dequantize(q["packed"], q["scales"], q["global_amax"]).reshape(16, 32).astype(jnp.bfloat16)
    recipe = RecipeConfig(name="nvfp4", weight_2d=True)

    def loss(x, w):
        y = recipe_gemm(recipe, "nvfp4-weight-only", x, w, None, key=None, amax=amax, weight=None)
        return jnp.sum(y.astype(jnp.float32) * g), y

    (_, y), (dx, dw) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w)
    x32, w_q32 = np.asarray(x, np.float64), np.asarray(w_q, np.float64)
    g64 = np.asarray(g.astype(jnp.bfloat16), np.float64)  # the gradient enters the GEMMs in x's dtype
    forward = np.asarray(x, np.float32) @ w_q32.T.astype(np.float32)  # fp32 accumulation, as the GEMM
    np.testing.assert_array_equal(np.asarray(y), forward.astype(jnp.bfloat16))  # the output in x's dtype
    # each gradient rounded once to BF16 from the exact product (fp32 accumulation: within 1 BF16 ulp)
    np.testing.assert_allclose(np.asarray(dx, np.float64), g64 @ w_q32, rtol=2**-7, atol=1e-6)
    np.testing.assert_allclose(
        np.asarray(dw, np.float64), g64.reshape(-1, 16).T @ x32.reshape(-1, 32), rtol=2**-7, atol=1e-6
    )
    plain = recipe_gemm(recipe, "bf16", x, w, None, key=None, amax=None, weight=None)
    assert not np.array_equal(np.asarray(plain), np.asarray(y))  # the weight was quantized
