"""The HF <-> MaxText layout table: exact inverses, the query-scale round trip over every bf16 value,
the RoPE permutation, and the MaxText model-name configs (no torch, no Orbax)."""

from __future__ import annotations

import math
import re

import ml_dtypes
import numpy as np
import pytest

from converters import layout, maxtext_models
from nvfp4tool.config import ModelConfig
from nvfp4tool.families.moe import Experts


def _config(head_dim: int = 8, tied: bool = False) -> ModelConfig:
    return ModelConfig(
        family="llama",
        vocab_size=40,
        hidden_size=24,
        intermediate_size=36,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=head_dim,
        tie_word_embeddings=tied,
    )


def _rule(hf_suffix: str) -> layout.Rule:
    return next(r for r in layout.TABLE if r.hf.endswith(hf_suffix))


@pytest.mark.parametrize("head_dim", [8, 16, 48, 64, 80, 128, 256])
def test_query_scale_round_trip_is_exact_for_every_bf16_value(head_dim):
    bits_N = np.arange(2**16, dtype=np.uint16)
    finite = np.isfinite(bits_N.view(ml_dtypes.bfloat16).astype(np.float32))
    bits_N = bits_N[finite]
    config = _config(head_dim)
    q_rule = _rule("q_proj.weight")
    # every finite bf16 bit pattern, laid out as a [H*D, E] = [4*head_dim, n/(4*head_dim)] q_proj
    rows = config.num_heads * head_dim
    usable = len(bits_N) // rows * rows
    q_bf16 = bits_N[:usable].view(ml_dtypes.bfloat16).reshape(rows, -1)
    stored = layout.hf_to_maxtext(q_rule, q_bf16, config, "interleaved", "float32")
    np.testing.assert_array_equal(  # the stored kernel is exactly the fp32 product
        stored, layout.hf_to_maxtext(q_rule, q_bf16.astype(np.float32), config, "interleaved", "float32")
    )
    back = layout.maxtext_to_hf(q_rule, stored, config, "interleaved", "bfloat16")
    assert back.view(np.uint16).tolist() == q_bf16.view(np.uint16).tolist()


def _gemma3(hidden: int) -> ModelConfig:
    from nvfp4tool.families.gemma3 import FULL, SLIDING, Gemma3Fields

    return ModelConfig(
        family="gemma3_text",
        vocab_size=40,
        hidden_size=hidden,
        intermediate_size=36,
        num_layers=6,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        qk_norm=True,
        sliding_window=4,
        tie_word_embeddings=True,
        family_config=Gemma3Fields(
            layer_types=(SLIDING,) * 5 + (FULL,), rope=((FULL, 1e6, None), (SLIDING, 1e4, None))
        ),
    )


@pytest.mark.parametrize("hidden", [64, 2560, 3840, 5376])
def test_gemma3_embedding_scale_and_norm_offset_over_every_bf16_value(hidden):
    """MaxText's gemma3 embedding is stored times bf16(sqrt(hidden)) (64 -> 8, 2560 -> 50.5, 3840 ->
    62, 5376 -> 73.5: the published 4B / 12B / 27B): a bf16 x bf16 product is exact in fp32, so
    every finite bf16 value comes back (those whose product overflows fp32 are refused by the
    callers). Its norms are stored as 1 + w: every bf16 value with |w| >= 2^-16 comes back; -0.0
    comes back +0.0, and smaller ones may be lost to the fp32 rounding of 1 + w (documented)."""
    config = _gemma3(hidden)
    bits_N = np.arange(2**16, dtype=np.uint16)
    x_N = bits_N.view(ml_dtypes.bfloat16)
    x_N = x_N[np.isfinite(x_N.astype(np.float32))]
    embedding, norm = layout.rules_for(config)[:2]
    assert embedding.embedding_scale and norm.unit_offset
    factor = layout.embedding_factor(config)
    assert factor == {64: 8.0, 2560: 50.5, 3840: 62.0, 5376: 73.5}[hidden]
    table = x_N[: len(x_N) // hidden * hidden].reshape(-1, hidden)
    with np.errstate(over="ignore"):
        stored = layout.hf_to_maxtext(embedding, table, config, "half", "float32")
        np.testing.assert_array_equal(stored, table.astype(np.float32) * factor)
    fits = np.isfinite(stored)
    back = layout.maxtext_to_hf(embedding, stored, config, "half", "bfloat16")
    assert back[fits].view(np.uint16).tolist() == table[fits].view(np.uint16).tolist()
    assert fits.mean() > 0.97 and np.all(np.abs(table[~fits].astype(np.float32)) > 2.0**120)

    stored = layout.hf_to_maxtext(norm, x_N, config, "half", "float32")
    np.testing.assert_array_equal(stored, x_N.astype(np.float32) + np.float32(1))
    back = layout.maxtext_to_hf(norm, stored, config, "half", "bfloat16")
    lost = back.view(np.uint16) != x_N.view(np.uint16)
    assert np.all(np.abs(x_N[lost].astype(np.float32)) < 2.0**-16)
    assert np.signbit(x_N[lost & (x_N == 0)].astype(np.float32)).all() and lost[x_N == 0].sum() == 1  # -0.0


def test_gemma3_27b_scans_ten_blocks_of_six_and_a_remainder_of_two():
    """MaxText's `_apply_gemma3_scanned_blocks` for 62 layers: scan_length 10 blocks of 6, then
    layers 60 and 61 as `layers_remainder/layers_0` and `_1`, unstacked."""
    config = ModelConfig.from_hf_config(maxtext_models.maxtext_hf_config("gemma3-27b"))
    q = next(r for r in layout.rules_for(config) if r.hf.endswith("q_proj.weight"))
    at = {i: layout.placement(q, config, scanned=True, layer=i) for i in (0, 5, 6, 59, 60, 61)}
    path = "decoder/layers/layers_{}/self_attention/query/kernel"
    assert {i: ("/".join(key), index) for i, (key, index) in at.items()} == {
        0: (path.format(0), 0),
        5: (path.format(5), 0),
        6: (path.format(0), 1),
        59: (path.format(5), 9),
        60: ("decoder/layers_remainder/layers_0/self_attention/query/kernel", None),
        61: ("decoder/layers_remainder/layers_1/self_attention/query/kernel", None),
    }
    assert layout.maxtext_shape(q, config, scanned=True, layer=59) == (5376, 10, 32, 128)
    assert layout.maxtext_shape(q, config, scanned=True, layer=61) == (5376, 32, 128)
    assert "/".join(layout.placement(q, config, scanned=False, layer=61)[0]).startswith("decoder/layers_61/")
    assert [r.hf for r in layout.rules_for(config) if "lm_head" in r.hf] == []  # tied: logits_via_embedding


def test_query_scale_value_is_inverse_sqrt_head_dim_in_fp32():
    config = _config(128)
    q = np.ones((config.num_heads * 128, config.hidden_size), np.float32)
    stored = layout.hf_to_maxtext(_rule("q_proj.weight"), q, config, "half", "float32")
    assert stored.shape == (config.hidden_size, config.num_heads, 128)
    assert np.all(stored == np.float32(1 / math.sqrt(128)))


def test_rope_interleave_pairs_the_two_halves():
    x = np.array([[[0, 1, 2, 3, 10, 11, 12, 13]]])  # half-split: reals 0..3, imaginaries 10..13
    assert layout.half_to_interleaved(x).tolist() == [[[0, 10, 1, 11, 2, 12, 3, 13]]]
    assert layout.interleaved_to_half(layout.half_to_interleaved(x)).tolist() == x.tolist()


@pytest.mark.parametrize("rope_layout", layout.ROPE_LAYOUTS)
@pytest.mark.parametrize("tied", [False, True])
def test_every_rule_round_trips_exactly_and_has_the_table_shape(rope_layout, tied):
    config = _config(tied=tied)
    rng = np.random.default_rng(0)
    shapes = config.expected_tensor_shapes()
    rules = layout.rules_for(config)
    assert {layout.hf_name(r, 0) for r in rules} == {n for n in shapes if ".layers." not in n or ".0." in n}
    for rule in rules:
        x = rng.standard_normal(shapes[layout.hf_name(rule, 0)]).astype(ml_dtypes.bfloat16)
        y = layout.hf_to_maxtext(rule, x, config, rope_layout, "float32")
        assert y.shape == layout.maxtext_shape(rule, config, scanned=False)
        stacked_shape = layout.maxtext_shape(rule, config, scanned=True)
        if rule.per_layer:
            assert stacked_shape == y.shape[:1] + (config.num_layers,) + y.shape[1:]
        back = layout.maxtext_to_hf(rule, y, config, rope_layout, "bfloat16")
        assert back.view(np.uint16).tolist() == x.view(np.uint16).tolist(), rule.hf


def test_kernel_orientation_matches_the_sheet():
    """MaxText kernels are [in, out]: x @ kernel == x @ W.T for every linear (q ignoring scale)."""
    config = _config()
    rng = np.random.default_rng(1)
    x_E = rng.standard_normal(config.hidden_size)
    shapes = config.expected_tensor_shapes()
    for name in (
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
    ):
        w = rng.standard_normal(shapes[name])
        kernel = layout.hf_to_maxtext(_rule(name.split(".", 3)[-1]), w, config, "half", "float64")
        np.testing.assert_allclose(np.tensordot(x_E, kernel, axes=1).reshape(-1), w @ x_E, atol=1e-12)
    w_o = rng.standard_normal(shapes["model.layers.0.self_attn.o_proj.weight"])  # [E, H*D]
    out_HxDxE = layout.hf_to_maxtext(_rule("o_proj.weight"), w_o, config, "half", "float64")
    a_HxD = rng.standard_normal((config.num_heads, config.head_dim))
    np.testing.assert_allclose(np.einsum("hd,hde->e", a_HxD, out_HxDxE), w_o @ a_HxD.reshape(-1), atol=1e-12)


def _moe_config(family: str, **overrides) -> ModelConfig:
    """3 experts of width 20, 2 layers, head_dim 8 (mixtral: experts use intermediate_size)."""
    base = dict(
        family=family,
        vocab_size=40,
        hidden_size=24,
        intermediate_size=20,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
    )
    experts = dict(num_experts=3, num_experts_per_tok=2, norm_topk_prob=True)
    if family == "qwen3_moe":
        base.update(qk_norm=True)
        experts.update(moe_intermediate_size=20)
    return ModelConfig(**base, family_config=Experts(**{**experts, **overrides}))


# MaxText's RoutedMoE arrays (E 24, X 3 experts, F 20, L 2), as MaxText's conversion scripts
# build them: router kernel [E, X], experts [X, E, F] / [X, F, E]; scanned: layers at axis 1.
_MOE_SHAPES = {
    "gate/kernel": ((24, 3), (24, 2, 3)),
    "wi_0": ((3, 24, 20), (3, 2, 24, 20)),
    "wi_1": ((3, 24, 20), (3, 2, 24, 20)),
    "wo": ((3, 20, 24), (3, 2, 20, 24)),
}


@pytest.mark.parametrize(
    "family,block,query_scaled", [("mixtral", "MoeBlock_0", True), ("qwen3_moe", "moe_block", False)]
)
def test_moe_rules_cover_every_tensor_with_maxtexts_shapes_and_round_trip(family, block, query_scaled):
    config = _moe_config(family)
    rules = layout.rules_for(config)
    names = [
        layout.hf_name(r, i, e)
        for r in rules
        for i in ([None] if not r.per_layer else range(2))
        for e in layout.experts_of(r, config)
    ]
    assert sorted(names) == sorted(config.expected_tensor_shapes())  # every tensor once, none extra
    rng = np.random.default_rng(2)
    for rule in rules:
        if rule.maxtext.startswith(block):
            part = rule.maxtext.removeprefix(block + "/")
            assert (
                layout.maxtext_shape(rule, config, scanned=False),
                layout.maxtext_shape(rule, config, scanned=True),
            ) == _MOE_SHAPES[part]
            assert layout.sliced_axes(rule, scanned=True) == ((0, 1) if rule.per_expert else (1,))
        x = rng.standard_normal(config.expected_tensor_shapes()[layout.hf_name(rule, 0, 2)])
        x = x.astype(ml_dtypes.bfloat16)
        y = layout.hf_to_maxtext(rule, x, config, "half", "float32")
        back = layout.maxtext_to_hf(rule, y, config, "half", "bfloat16")
        assert back.view(np.uint16).tolist() == x.view(np.uint16).tolist(), rule.hf
        if rule.hf.endswith("q_proj.weight"):  # qwen3's attention scales queries itself
            unscaled = x.astype(np.float32).T.reshape(24, 4, 8)
            scale = np.float32(1 / math.sqrt(8)) if query_scaled else np.float32(1)
            np.testing.assert_array_equal(y, unscaled * scale)


@pytest.mark.parametrize(
    "overrides,option",
    [(dict(mlp_only_layers=(1,)), "mlp_only_layers=[1]"), (dict(decoder_sparse_step=2), "decoder_sparse_step=2")],
)
def test_qwen3_moe_with_dense_layers_has_no_maxtext_layout(overrides, option):
    from nvfp4tool.errors import NVFP4ToolError

    pattern = f"ckpt: qwen3_moe with dense layers .*{re.escape(option)}.* has no MaxText layout"
    with pytest.raises(NVFP4ToolError, match=pattern):
        layout.check_supported(_moe_config("qwen3_moe", **overrides), "ckpt")


# Published parameter counts (HF model cards / config arithmetic), tied embeddings counted once.
_PARAMETERS = {
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama3-8b": 8_030_261_248,
    "llama3.1-8b": 8_030_261_248,
    "llama3.1-70b": 70_553_706_496,
    "llama3.2-1b": 1_235_814_400,
    "llama3.2-3b": 3_212_749_824,
    "mistral-7b": 7_241_732_096,
    "mixtral-8x7b": 46_702_792_704,
    "mixtral-8x22b": 140_630_071_296,
    "qwen3-30b-a3b": 30_532_122_624,
    "qwen3-235b-a22b": 235_093_634_560,
    "qwen3-480b-a35b": 480_154_875_392,
    # transformers' Gemma3ForCausalLM of the same config on the meta device (MaxText's vocabulary 262144)
    "gemma3-4b": 3_880_099_328,
    "gemma3-12b": 11_765_788_416,
    "gemma3-27b": 27_009_002_240,
    "deepseek3-671b": 671_026_419_200,  # DeepSeek's 671B (MTP layer not counted)
}


@pytest.mark.parametrize("name", sorted(maxtext_models.MAXTEXT_MODELS))
def test_maxtext_model_names_build_configs_with_the_published_size(name):
    config = ModelConfig.from_hf_config(maxtext_models.maxtext_hf_config(name), source=name)
    assert config.num_parameters() == _PARAMETERS[name]
    interleaved = name.startswith(("llama3.1-", "deepseek3-"))
    assert maxtext_models.rope_layout_for(name) == ("interleaved" if interleaved else "half")


def test_unknown_model_name_is_a_user_error():
    from nvfp4tool.errors import NVFP4ToolError

    with pytest.raises(NVFP4ToolError, match="unknown MaxText model name 'llama9-1t'"):
        maxtext_models.maxtext_hf_config("llama9-1t")


def test_maxtext_names_and_fixed_layouts_are_the_families_declarations(monkeypatch):
    """What `--model-config NAME` and the RoPE layout read is what each family module declares:
    each name's config.json is of its declaring family, and a name two families declare is refused."""
    from nvfp4tool.families import REGISTRY
    from nvfp4tool.families.maxtext import NamedModel

    for family in REGISTRY.values():
        for name, model in family.maxtext_models.items():
            assert model.hf["model_type"] == family.model_type
            assert maxtext_models.maxtext_hf_config(name) == model.hf
            assert maxtext_models.rope_layout_for(name) == model.rope_layout
        assert maxtext_models.family_rope_layout(family.model_type) == family.maxtext_rope_layout
    twice = {t: type("F", (), {"model_type": t, "maxtext_models": {"m-1b": NamedModel({})}})() for t in ("a", "b")}
    monkeypatch.setattr(maxtext_models, "REGISTRY", twice)
    with pytest.raises(AssertionError, match="'m-1b' declared by a and b"):
        maxtext_models._collect()
