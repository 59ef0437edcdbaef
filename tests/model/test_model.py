"""The JAX model on its own (no torch): layouts, the linear seam, padding, KV-cache generation.

Agreement with transformers lives in test_hf_model.py; here each property is checked against
another path through our own code that does not share the property's mechanism (scan vs loop,
cache vs recomputation, padded vs unpadded rows).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from converters.tensor_source import DictTensorSource
from nvfp4tool.config import ModelConfig, RopeScaling
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.families import ATTENTION_MLP
from nvfp4tool.families.moe import Experts
from nvfp4tool.model import ModelTensorSource, default_linear, forward, generate, model_from_tensors
from nvfp4tool.model.linear import Seam
from nvfp4tool.model.transformer import forward_side, layer_runs

_BASE = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rms_norm_eps=1e-5,
)
CONFIGS = {
    "llama3": ModelConfig(family="llama", rope_theta=500000.0, **_BASE, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 16)),
    "llama_tied_bias": ModelConfig(
        family="llama", tie_word_embeddings=True, attention_bias=True, o_proj_bias=True, **_BASE
    ),
    "mistral_window": ModelConfig(family="mistral", sliding_window=3, **_BASE),
    "qwen2": ModelConfig(family="qwen2", attention_bias=True, **_BASE),
    "qwen3": ModelConfig(family="qwen3", qk_norm=True, **{**_BASE, "head_dim": 12}),
    # layer 1 dense (mlp_only_layers), layers 0 and 2 sparse: 4 experts of width 16, top-2
    "qwen3_moe": ModelConfig(
        family="qwen3_moe",
        qk_norm=True,
        **{**_BASE, "num_layers": 3},
        family_config=Experts(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            norm_topk_prob=True,
            mlp_only_layers=(1,),
            router_aux_loss_coef=0.001,
        ),
    ),
    "mixtral": ModelConfig(
        family="mixtral",
        **_BASE,
        family_config=Experts(num_experts=3, num_experts_per_tok=2, norm_topk_prob=True, router_aux_loss_coef=0.02),
    ),
}


def random_tensors(config: ModelConfig, seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in config.expected_tensor_shapes().items():
        noise = rng.standard_normal(shape).astype(np.float32)
        value = (
            1.0 + 0.2 * noise
            if name.endswith("norm.weight")
            else (0.3 * noise if name.endswith(".bias") else 0.15 * noise)
        )
        tensors[name] = value.astype(dtype)
    return tensors


def build(key: str, **kwargs):
    config = CONFIGS[key]
    return model_from_tensors(config, DictTensorSource(random_tensors(config)), **kwargs)


def batch(T: int = 9, vocab: int = 97, seed: int = 1):
    """Rows: full, left-padded by 3, right-padded by 2 (padding ids are junk, masked)."""
    ids = np.random.default_rng(seed).integers(0, vocab, size=(3, T))
    mask = np.ones((3, T), np.int32)
    mask[1, :3] = 0
    mask[2, T - 2 :] = 0
    return ids, mask


def tensors_of(model) -> dict[str, np.ndarray]:
    """Every HF-named tensor of a model, through its TensorSource view, in the config's order."""
    view = ModelTensorSource(model)
    return {name: view.get(name) for name in view.names()}


@pytest.mark.parametrize("key", ["llama_tied_bias", "mistral_window", "qwen3", "mixtral", "qwen3_moe"])
def test_scanned_layers_give_the_same_logits(key):
    """Scanned runs of alike layers (qwen3_moe mixes dense and sparse layers: three runs) give
    the unrolled logits; the parameters stay per layer, as stored."""
    ids, mask = batch()
    logits = forward(build(key), ids, mask)
    scanned = build(key, scan_layers=True)
    assert len(scanned.layers) == CONFIGS[key].num_layers
    kinds = [CONFIGS[key].layer_kind(i) for i in range(CONFIGS[key].num_layers)]
    expected = [
        (kind, [i for i, _ in group]) for kind, group in itertools.groupby(enumerate(kinds), key=lambda item: item[1])
    ]
    assert layer_runs(CONFIGS[key], Seam(), scan=True) == expected
    assert layer_runs(CONFIGS[key], Seam(), scan=False) == [(kind, [i]) for i, kind in enumerate(kinds)]
    # Same math; the scanned body is compiled (XLA fuses and reorders fp32 ops), the loop runs op by
    # op: a few fp32 ulps of |logits| ~ 2 apart.
    np.testing.assert_allclose(forward(scanned, ids, mask), logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_tensors_round_trip_bit_exact(scan_layers):
    config = CONFIGS["qwen3"]
    tensors = random_tensors(config)
    model = model_from_tensors(config, DictTensorSource(tensors), scan_layers=scan_layers)
    out = tensors_of(model)
    assert list(out) == list(config.expected_tensor_shapes())
    for name, value in tensors.items():
        assert out[name].dtype == value.dtype and out[name].tobytes() == value.tobytes(), name
    view = ModelTensorSource(model)
    assert view.shape("lm_head.weight") == (97, 32) and view.dtype("lm_head.weight") == "float32"
    assert (
        view.get("model.layers.1.self_attn.k_norm.weight").tobytes()
        == tensors["model.layers.1.self_attn.k_norm.weight"].tobytes()
    )


def test_bf16_tensors_load_exactly_into_fp32_and_bf16():
    config = CONFIGS["llama3"]
    tensors = random_tensors(config, dtype=ml_dtypes.bfloat16)
    as_fp32 = tensors_of(model_from_tensors(config, DictTensorSource(tensors)))
    as_bf16 = tensors_of(model_from_tensors(config, DictTensorSource(tensors), dtype=jnp.bfloat16))
    for name, value in tensors.items():
        np.testing.assert_array_equal(as_fp32[name], value.astype(np.float32))
        assert as_bf16[name].dtype == ml_dtypes.bfloat16 and as_bf16[name].tobytes() == value.tobytes()


def test_wrong_shape_names_the_tensor():
    config = CONFIGS["qwen2"]
    tensors = random_tensors(config)
    tensors["model.layers.1.self_attn.v_proj.bias"] = np.zeros((5,), np.float32)
    with pytest.raises(
        NVFP4ToolError,
        match=r"<memory>: tensor 'model.layers.1.self_attn.v_proj.bias' "
        r"has shape \[5\], the config expects \[16\]",
    ):
        model_from_tensors(config, DictTensorSource(tensors))
    del tensors["model.layers.1.self_attn.v_proj.bias"]
    with pytest.raises(NVFP4ToolError, match="'model.layers.1.self_attn.v_proj.bias' missing"):
        model_from_tensors(config, DictTensorSource(tensors))


@pytest.mark.parametrize("scan_layers", [False, True])
def test_every_linear_goes_through_the_seam(scan_layers):
    config = CONFIGS["llama_tied_bias"]
    seen = []

    def recording(x, w, b, *, name):
        seen.append((name, w.shape, None if b is None else b.shape))
        return default_linear(x, w, b, name=name)

    model = build("llama_tied_bias", scan_layers=scan_layers)
    ids, mask = batch()
    np.testing.assert_allclose(
        forward(model, ids, mask, linear=recording), forward(model, ids, mask), atol=1e-6, rtol=0
    )
    names = [name for name, _, _ in seen]
    expected = config.linear_names()
    if scan_layers:  # one traced block: the layer index reads '*'
        expected = list(
            dict.fromkeys(
                n.replace("model.layers.0.", "model.layers.*.")
                for n in expected
                if not n.startswith("model.layers.") or n.startswith("model.layers.0.")
            )
        )
    assert names == expected
    shapes = {name: (w, b) for name, w, b in seen}
    assert shapes["lm_head"] == ((97, 32), None)  # tied: the embedding table [V, E]
    o_proj = "model.layers.*.self_attn.o_proj" if scan_layers else "model.layers.1.self_attn.o_proj"
    assert shapes[o_proj] == ((32, 32), (32,))


def test_seam_decides_per_layer_by_name():
    model = build("llama3")
    ids, mask = batch()
    base = np.asarray(forward(model, ids, mask))

    def zero_layer1_mlp(x, w, b, *, name):
        y = default_linear(x, w, b, name=name)
        return jnp.zeros_like(y) if name == "model.layers.1.mlp.down_proj" else y

    changed = np.asarray(forward(model, ids, mask, linear=zero_layer1_mlp))
    assert np.abs(changed - base).max() > 1e-2
    model.linear = zero_layer1_mlp  # the model's own default seam is used when none is passed
    np.testing.assert_array_equal(forward(model, ids, mask), changed)


@pytest.mark.parametrize("key", ["llama3", "mistral_window", "qwen3", "qwen3_moe"])
def test_padding_does_not_change_real_tokens(key):
    model = build(key)
    ids, mask = batch()
    logits = np.asarray(forward(model, ids, mask))
    left_alone = np.asarray(forward(model, ids[1:2, 3:]))  # the left-padded row without its padding
    right_alone = np.asarray(forward(model, ids[2:3, :-2]))
    np.testing.assert_allclose(logits[1, 3:], left_alone[0], atol=2e-5, rtol=0)
    np.testing.assert_allclose(logits[2, :-2], right_alone[0], atol=2e-5, rtol=0)
    assert np.isfinite(logits).all()


def test_sliding_window_limits_what_a_token_sees():
    """Window 3 over 2 layers: the output at index t depends on tokens t-4..t only (each layer
    reaches 2 further back)."""
    model = build("mistral_window")
    ids = np.random.default_rng(3).integers(0, 97, size=(1, 8))
    other = ids.copy()
    other[0, 1] = (other[0, 1] + 1) % 97  # change token 1
    a, b = np.asarray(forward(model, ids)), np.asarray(forward(model, other))
    np.testing.assert_allclose(a[0, 6:], b[0, 6:], atol=1e-6, rtol=0)  # index 6 reaches back to 2
    assert np.abs(a[0, 5] - b[0, 5]).max() > 1e-4  # index 5 reaches token 1


def test_jitted_forward_matches_eager():
    """`forward` jits itself when called eagerly; under jax.disable_jit it really runs op by op
    (the linear seam then sees concrete arrays, not tracers: checked)."""
    model = build("qwen2")
    ids, mask = batch()
    traced: dict[str, list[bool]] = {"jit": [], "eager": []}

    def recording(mode):
        def linear(x, w_NxK, b_N, *, name):
            traced[mode].append(isinstance(x, jax.core.Tracer))
            return default_linear(x, w_NxK, b_N, name=name)

        return linear

    jitted = forward(model, ids, mask, linear=recording("jit"))
    with jax.disable_jit():
        eager = forward(model, ids, mask, linear=recording("eager"))
    n_calls = len(CONFIGS["qwen2"].linear_names())
    assert traced == {"jit": [True] * n_calls, "eager": [False] * n_calls}
    np.testing.assert_allclose(jitted, eager, atol=1e-5, rtol=0)


def test_forward_side_returns_the_records_under_the_callers_transform():
    """The training pattern: grad of a jitted loss whose linear tap records per-layer input amax,
    the records coming back as the model's side results (`Seam`, `forward_side`), unrolled or
    scanned, under the layers' own names."""
    model = build("llama3")
    graphdef, state = nnx.split(model)
    ids, _ = batch()

    def recording(x, w, b, *, name, aux):
        return default_linear(x, w, b, name=name), jnp.max(jnp.abs(x))

    def loss(state, ids, scan):
        m = nnx.merge(graphdef, state)
        m.scan_layers = scan
        logits, side = forward_side(m, ids, seam=Seam(recording))
        return jnp.mean(logits**2), side.records

    for scan in (False, True):
        (value, amax), grads = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=2)(
            state, jnp.asarray(ids), scan
        )
        assert set(amax) == set(CONFIGS["llama3"].linear_names())
        np.testing.assert_allclose(value, np.mean(np.asarray(forward(model, ids)) ** 2), rtol=1e-5)
        grad_norms = [float(jnp.abs(g).max()) for g in jax.tree.leaves(grads)]
        assert all(np.isfinite(grad_norms)) and min(grad_norms) > 0


def test_bf16_compute_stays_near_fp32():
    ids, mask = batch()
    fp32 = np.asarray(forward(build("llama3"), ids, mask))
    mixed = build("llama3", compute_dtype=jnp.bfloat16)
    assert mixed.layers[0].mlp.up_proj.weight[...].dtype == jnp.float32
    bf16 = np.asarray(forward(mixed, ids, mask))
    assert bf16.dtype == np.float32
    # bf16 keeps 8 significant bits (relative step 2^-8 = 0.4%) through 3 layers: a few percent of
    # the logit range, and the same argmax on most tokens.
    assert np.abs(bf16 - fp32)[mask == 1].max() < 0.05 * np.abs(fp32).max()
    assert (bf16.argmax(-1) == fp32.argmax(-1))[mask == 1].mean() > 0.8


def uncached_greedy(model, ids, mask, steps):
    """Reference: recompute the whole sequence every step (no cache), argmax at each row's last
    real token. The buffer has its final length from the start, future slots masked like padding,
    so every step reuses one compiled forward."""
    B, T = ids.shape
    ids = np.concatenate([ids, np.zeros((B, steps), ids.dtype)], axis=1)
    mask = np.concatenate([mask, np.zeros((B, steps), mask.dtype)], axis=1)
    out = []
    for step in range(steps):
        logits = np.asarray(forward(model, ids, mask))
        last = ids.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=-1)
        token = logits[np.arange(B), last].argmax(-1)
        out.append(token)
        ids[:, T + step], mask[:, T + step] = token, 1
    return np.stack(out, axis=1)


@pytest.mark.parametrize(
    "key, scan_layers",
    [("llama3", False), ("mistral_window", False), ("qwen3_moe", False), ("mixtral", True), ("qwen3", True)],
)
@pytest.mark.slow  # > 15 s of the inner loop (tests/durations.json)
def test_cached_generation_equals_uncached_loop(key, scan_layers):
    model = build(key, scan_layers=scan_layers)
    ids, mask = batch()
    cached = np.asarray(generate(model, ids, 7, attention_mask=mask))
    assert cached.shape == (3, 7) and cached.dtype == np.int32
    np.testing.assert_array_equal(cached, uncached_greedy(model, ids, mask, 7))
    if key == "mistral_window":  # padding does not change a row's continuation (window included)
        unpadded = np.stack([np.append(ids[1, 3:], 0), ids[2, :7]])  # the rows' real tokens (6, 7) ...
        unpadded_mask = np.array([[1] * 6 + [0], [1] * 7])  # ... the 6 right-padded by one
        np.testing.assert_array_equal(
            cached[1:], np.asarray(generate(model, unpadded, 7, attention_mask=unpadded_mask))
        )


def test_sampling_and_eos():
    model = build("llama3")
    ids, mask = batch()
    greedy = np.asarray(generate(model, ids, 6, attention_mask=mask))
    top1 = generate(model, ids, 6, attention_mask=mask, greedy=False, top_k=1, key=jax.random.key(5))
    np.testing.assert_array_equal(top1, greedy)

    def draw(seed):
        return np.asarray(
            generate(model, ids, 6, attention_mask=mask, greedy=False, temperature=2.0, key=jax.random.key(seed))
        )

    np.testing.assert_array_equal(draw(1), draw(1))
    assert not np.array_equal(draw(1), draw(2))
    eos = int(greedy[0, 2])  # pretend the third greedy token of row 0 is EOS
    stopped = np.asarray(generate(model, ids, 6, attention_mask=mask, eos_token_id=eos, pad_token_id=96))
    first = np.argmax(greedy == eos, axis=1)
    for row in range(3):
        if (greedy[row] == eos).any():
            np.testing.assert_array_equal(stopped[row, : first[row] + 1], greedy[row, : first[row] + 1])
            assert (stopped[row, first[row] + 1 :] == 96).all()
        else:
            np.testing.assert_array_equal(stopped[row], greedy[row])


def test_generate_rejects_bad_requests():
    model = build("llama3")
    ids = np.zeros((2, 4), np.int32)
    with pytest.raises(NVFP4ToolError, match="no tokens"):
        generate(model, ids, 3, attention_mask=np.array([[1, 1, 1, 1], [0, 0, 0, 0]]))
    with pytest.raises(NVFP4ToolError, match="needs a PRNG key"):
        generate(model, ids, 3, greedy=False)


def test_sparse_mlp_shows_each_expert_only_its_tokens_unless_calibrating():
    """Each expert's GEMMs see the rows of the tokens routed to it (the others zero, as a ragged
    dispatch would compute them); a seam asking for all experts shows every token to every expert
    and leaves the logits unchanged."""
    config = CONFIGS["qwen3_moe"]
    model = build("qwen3_moe")
    ids, mask = batch()

    def zero_rows(x, w, b, *, name, aux):
        return default_linear(x, w, b, name=name), jnp.sum(jnp.all(x == 0, axis=-1))

    @nnx.jit(static_argnums=1)
    def run(model, all_experts):
        logits, side = forward_side(model, ids, mask, seam=Seam(zero_rows, all_experts=all_experts))
        return logits, side.records

    routed_logits, routed = run(model, False)
    every_logits, every = run(model, True)
    np.testing.assert_array_equal(np.asarray(routed_logits), np.asarray(every_logits))
    tokens = ids.size
    for layer in (0, 2):
        experts = [f"model.layers.{layer}.mlp.experts.{e}.gate_proj" for e in range(config.family_config.num_experts)]
        zero = np.array([int(routed[n]) for n in experts])
        # top-2 of 4: every token leaves 2 experts out, so 2 * tokens zero rows in all
        assert zero.sum() == 2 * tokens and (zero > 0).all(), zero
        assert all(int(every[n]) == 0 for n in experts)
        assert int(routed[f"model.layers.{layer}.mlp.gate"]) == 0  # the router sees every token
    assert int(routed["model.layers.1.mlp.gate_proj"]) == 0  # the dense layer is dense


@pytest.mark.parametrize("key", ["qwen3_moe", "mixtral"])
def test_layerwise_runs_sparse_and_dense_layers_as_forward(key):
    """Held and streamed layer-by-layer runs (one block program per kind of layer) equal forward."""
    from nvfp4tool.model.layerwise import LayerwiseModel
    from nvfp4tool.model.linear import Plain

    config = CONFIGS[key]
    tensors = random_tensors(config)
    model = model_from_tensors(config, DictTensorSource(tensors))
    ids = np.random.default_rng(3).integers(0, config.vocab_size, size=(3, 7))
    expected = np.asarray(forward(model, ids))
    tap = Plain(default_linear)
    held = np.concatenate([np.asarray(y) for _, y in LayerwiseModel.held(model).logits(ids, 2, tap=tap)])
    streamed_model = LayerwiseModel.streamed(config, DictTensorSource(tensors), compute_dtype=jnp.float32)
    streamed = np.concatenate([np.asarray(y) for _, y in streamed_model.logits(ids, 2, tap=tap)])
    np.testing.assert_allclose(held, expected, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(streamed, held)


def _bf16_held(config: ModelConfig):
    """A model held in BF16 (its tensors as stored), computing in fp32: validate's held models."""
    tensors = random_tensors(config, dtype=ml_dtypes.bfloat16)
    return model_from_tensors(config, DictTensorSource(tensors), dtype=None, compute_dtype=jnp.float32)


def test_generation_never_holds_the_bf16_embedding_table_widened(monkeypatch):
    """XLA:CPU gathers from a BF16 table through an fp32 copy of it; neither the prefill nor the
    decode step may hold that copy whole (the old one-program loop hoisted it: 262 MB on a
    32000 x 2048 table). The LM head is widened 1/8 of its rows at a time here."""
    import importlib

    from nvfp4tool.export.simulate import served_linear
    from nvfp4tool.model.kv import default_kv
    from nvfp4tool.numerics import dot

    config = ModelConfig(family="llama", **{**_BASE, "vocab_size": 16384})
    table_f32 = config.vocab_size * config.hidden_size * 4
    monkeypatch.setattr(dot, "WIDEN_BYTES", table_f32 // 8)
    gen = importlib.import_module("nvfp4tool.model.generate")
    layers = gen._Layers.of(_bf16_held(config), Seam.of(served_linear), default_kv)
    options = gen._SamplingOptions(
        jnp.asarray(True), jnp.asarray(1.0), jnp.asarray(config.vocab_size), jnp.asarray(-1), jnp.asarray(0)
    )
    outer, programs = (layers.outer_graphdef, layers.outer_state), gen._programs(jax.default_backend())
    ids, mask = jnp.zeros((2, 16), jnp.int32), jnp.ones((2, 16), bool)
    prefill_in = programs.prefill_in.lower(*outer, ids, mask, jax.random.key(0), cache_len=32).compile()
    x, _, _, carry, last = programs.prefill_in(*outer, ids, mask, jax.random.key(0), cache_len=32)
    prefill_out = programs.prefill_out.lower(*outer, x, last, carry, options, seam=layers.head_seam).compile()
    step_in = programs.step_in.lower(*outer, carry).compile()
    step_out = programs.step_out.lower(*outer, x[:, :1], carry, options, seam=layers.head_seam).compile()
    for program in (prefill_in, prefill_out, step_in, step_out):
        assert program.memory_analysis().temp_size_in_bytes < table_f32


def test_a_layer_program_widens_one_linear_at_a_time():
    """validate's layer program on BF16 weights in fp32: gate and up share their input, yet their
    weights are widened one after the other (each linear after the previous one's output), never
    both at once; the values are the model's forward."""
    from nvfp4tool.export.simulate import served_linear
    from nvfp4tool.model.layerwise import LayerwiseModel, _block_step
    from nvfp4tool.model.linear import Plain
    from nvfp4tool.model.rope import layer_cos_sin
    from nvfp4tool.model.transformer import layer_program

    config = ModelConfig(
        family="llama",
        vocab_size=97,
        hidden_size=256,
        intermediate_size=1024,
        num_layers=1,
        num_heads=4,
        num_kv_heads=4,
        head_dim=64,
        rms_norm_eps=1e-5,
    )
    model = LayerwiseModel.held(_bf16_held(config))
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 8))
    x, tables, allowed = model._embed(ids)
    cos, sin = layer_cos_sin(config, tables, 0)
    graphdef = model._block_graphdefs[layer_program(config, 0)]
    compiled = _block_step.lower(
        graphdef, model._layer(0), x, cos, sin, allowed, None, tap=Plain(served_linear), kv_tap=None, gather=None
    ).compile()
    one_weight_f32 = config.hidden_size * config.intermediate_size * 4
    assert compiled.memory_analysis().temp_size_in_bytes < 1.5 * one_weight_f32  # 1.2 MB; 2.1 MB both at once
    ((_, logits),) = model.logits(ids, batch_size=2, tap=Plain(served_linear))
    expected = forward(model.whole, ids, linear=served_linear)  # one program: other fusions, fp32 rounding
    np.testing.assert_allclose(np.asarray(logits), np.asarray(expected), rtol=1e-5, atol=1e-5)


def test_every_family_registers_a_block_for_each_of_its_layer_kinds():
    """A family's blocks module (in `nvfp4tool.model`) registers a block for every layer kind its
    models use; the kinds are the family's own (a family never gets another family's blocks)."""
    from nvfp4tool.families import REGISTRY
    from nvfp4tool.model.blocks import family_blocks
    from nvfp4tool.train.presets import preset_config

    configs = [
        *CONFIGS.values(),
        *(preset_config(name, 97, 64) for name in ("tiny-hybrid-moe", "tiny-gemma3", "tiny-deepseek")),
    ]
    kinds: dict[str, set[str]] = {}
    for config in configs:
        kinds.setdefault(config.family, set()).update(config.layer_kind(i) for i in range(config.num_layers))
    assert set(kinds) == set(REGISTRY)  # every registered family has a config here
    for model_type, family in REGISTRY.items():
        assert family.blocks_module.startswith("nvfp4tool.model."), model_type
        assert kinds[model_type] <= set(family_blocks(family)), model_type
    assert set(family_blocks(REGISTRY["llama"])) == {ATTENTION_MLP}
    assert set(family_blocks(REGISTRY["nemotron_h"])) == {"mamba", "attention", "mlp", "moe"}
    assert set(family_blocks(REGISTRY["deepseek_v3"])) == {"mla+mlp", "mla+moe"}


def test_the_decode_state_of_generation_is_each_blocks_own():
    """Generation's decode state (`generate._Layers.empty_cache`): each layer's own, in the shapes
    its block builds (an attention's (k, v) [B, S, KV, D] in the compute dtype, a Mamba mixer's
    fp32 conv window and SSM state); None for a layer that keeps none."""
    import importlib

    from nvfp4tool.model.kv import default_kv
    from nvfp4tool.model.mamba import MambaState
    from nvfp4tool.model.transformer import CausalLM
    from nvfp4tool.train.presets import preset_config

    gen = importlib.import_module("nvfp4tool.model.generate")

    def cache(model, batch, length):
        layers = gen._Layers.of(model, Seam(), default_kv)
        return jax.eval_shape(lambda: layers.empty_cache(batch, length))

    moe = nnx.eval_shape(lambda: CausalLM(CONFIGS["qwen3_moe"], compute_dtype=jnp.bfloat16))
    kv = jax.ShapeDtypeStruct((2, 5, 2, 8), jnp.bfloat16)
    assert cache(moe, 2, 5) == [(kv, kv)] * moe.config.num_layers
    config = preset_config("tiny-hybrid-moe", 97, 64)  # M E - M * E M E
    hybrid = nnx.eval_shape(lambda: CausalLM(config))
    shape = hybrid.layers[0].mixer.shape
    mamba = MambaState(
        jax.ShapeDtypeStruct((3, shape.conv_kernel - 1, shape.conv_dim), jnp.float32),
        jax.ShapeDtypeStruct((3, shape.heads, shape.head_dim, shape.state), jnp.float32),
    )
    kv = jax.ShapeDtypeStruct((3, 7, config.num_kv_heads, config.head_dim), jnp.float32)
    kinds = config.family_config.layer_kinds
    assert cache(hybrid, 3, 7) == [{"mamba": mamba, "attention": (kv, kv)}.get(k) for k in kinds]
    assert [layer.recurrent for layer in hybrid.layers] == [k == "mamba" for k in config.family_config.layer_kinds]
