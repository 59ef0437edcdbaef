"""nvfp4tool.families.nemotron_h: the hybrid family's config.json facts against transformers 5.24's
NemotronHConfig (layer kinds in both spellings, legacy aliases, the infinite time-step limit as
transformers writes it) and the parameter count against NemotronHForCausalLM's own parameters."""

from __future__ import annotations

import json
import math

import pytest

from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.families import nemotron_h as nh

BASE = dict(
    model_type="nemotron_h",
    hidden_size=32,
    vocab_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=48,
    mamba_num_heads=4,
    mamba_head_dim=8,
    ssm_state_size=6,
    n_groups=2,
    conv_kernel=4,
    chunk_size=8,
)
MOE = dict(
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=12,
    n_shared_experts=1,
    moe_shared_expert_intermediate_size=20,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
)
KINDS = ("mamba", "mlp", "mamba", "attention", "mlp")


@pytest.mark.parametrize(
    "spelling",
    [
        {"hybrid_override_pattern": "M-M*-"},
        {"layers_block_type": ["linear_attention", "mlp", "linear_attention", "full_attention", "mlp"]},
        {"layers_block_type": ["mamba", "mlp", "mamba", "attention", "mlp"]},  # legacy names
        {
            "hybrid_override_pattern": "M-M*-",
            "layers_block_type": ["mamba", "mlp", "linear_attention", "attention", "mlp"],
        },
    ],
)
def test_layer_kinds_in_every_spelling_and_written_back_as_given(spelling):
    hf = {**BASE, **spelling}
    fields = nh.parse_hybrid(hf, "config.json")
    assert fields.layer_kinds == KINDS
    out: dict = {}
    nh.emit_hybrid(fields, out)
    for key, value in spelling.items():
        assert out[key] == value
    assert not {"hybrid_override_pattern", "layers_block_type"} - set(spelling) & set(out)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"hybrid_override_pattern": "M-X*"}, "'X' at position 2 is not a layer kind"),
        (
            {"hybrid_override_pattern": "M-M*-", "layers_block_type": ["mamba", "mlp"]},
            "hybrid_override_pattern lists 5 layers, layers_block_type 2 (the first 2 agree); give one, or both equal",
        ),
        (
            {"hybrid_override_pattern": "M-M*-", "layers_block_type": ["mamba", "mlp", "mamba", "mamba", "mlp"]},
            "hybrid_override_pattern says layer 3 is '*' (attention), layers_block_type says 'mamba' (Mamba-2); "
            "give one, or both equal",
        ),
        (
            {"hybrid_override_pattern": "M-M*-", "layers_block_type": ["linear_attention", "moe", "mamba"]},
            "hybrid_override_pattern says layer 1 is '-' (MLP), layers_block_type says 'moe' (MoE), and they "
            "list 5 and 3 layers; give one, or both equal",
        ),
        ({"hybrid_override_pattern": "M-M*-", "num_hidden_layers": 6}, "num_hidden_layers=6"),
        ({"layers_block_type": ["mamba", "hybrid"]}, "layers_block_type[1]: 'hybrid'"),
        (
            {"hybrid_override_pattern": "M-M*-", "mamba_n_groups": 4},
            "n_groups=2 and its alias mamba_n_groups=4 disagree",
        ),
        ({"hybrid_override_pattern": "M-", "mamba_num_heads": 3}, "mamba_num_heads=3 is not a multiple of n_groups=2"),
        ({"hybrid_override_pattern": "M-", "mlp_hidden_act": "silu"}, "mlp_hidden_act='silu' unsupported"),
        ({"hybrid_override_pattern": "M-", "tie_word_embeddings": True}, "never ties lm_head"),
        ({"hybrid_override_pattern": "M-", "time_step_limit": [0.5, 0.1]}, "0 <= low < high"),
        ({"hybrid_override_pattern": "ME", **MOE, "topk_group": 3}, "topk_group must be in 1..n_group=2"),
        ({"hybrid_override_pattern": "ME", **MOE, "n_group": 3}, "n_routed_experts=8 is not a multiple of n_group=3"),
        ({"hybrid_override_pattern": "ME", **MOE, "num_experts_per_tok": 5}, "exceeds the experts of the topk_group=1"),
        ({"hybrid_override_pattern": "ME", **MOE, "n_shared_experts": 2}, "n_shared_experts=2 unsupported"),
        (
            {"hybrid_override_pattern": "ME", **{k: v for k, v in MOE.items() if k != "moe_intermediate_size"}},
            "nemotron_h needs moe_intermediate_size",
        ),
        ({"hybrid_override_pattern": "M-", "mamba_head_dim": None}, "nemotron_h needs mamba_head_dim"),
    ],
)
def test_bad_configs_are_one_line_naming_the_key(change, message):
    hf = {**BASE, **change}
    hf = {k: v for k, v in hf.items() if v is not None}
    with pytest.raises(NVFP4ToolError) as err:
        nh.parse_hybrid(hf, "ckpt/config.json")
    assert message in str(err.value) and str(err.value).startswith("ckpt/config.json: ")
    assert "\n" not in str(err.value)


def test_legacy_aliases_are_read_and_kept():
    hf = {
        **{k: v for k, v in BASE.items() if k not in ("n_groups", "conv_kernel", "chunk_size")},
        "hybrid_override_pattern": "M*",
        "mamba_n_groups": 2,
        "mamba_d_conv": 3,
        "mamba_chunk_size": 16,
        "mamba_conv_bias": False,
        "mamba_dt_limit": [0.001, 0.5],
    }
    fields = nh.parse_hybrid(hf, "config.json")
    assert (fields.n_groups, fields.conv_kernel, fields.chunk_size, fields.use_conv_bias) == (2, 3, 16, False)
    assert fields.time_step_limit == (0.001, 0.5)
    out: dict = {}
    nh.emit_hybrid(fields, out)
    for key in ("mamba_n_groups", "mamba_d_conv", "mamba_chunk_size", "mamba_conv_bias", "mamba_dt_limit"):
        assert out[key] == hf[key], key
    assert "n_groups" not in out and "time_step_limit" not in out


def test_transformers_saved_config_round_trips(tmp_path):
    """transformers' own save (a layers_block_type list, the infinite limit as {"__float__": ...})
    parses to the model it was built from, and what we write back transformers reads as the same."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.NemotronHConfig(
        **{k: v for k, v in BASE.items() if k != "model_type"}, hybrid_override_pattern="M-M*E", **MOE
    )
    cfg.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    fields = nh.parse_hybrid(saved, "config.json")
    assert fields.layer_kinds == ("mamba", "mlp", "mamba", "attention", "moe")
    assert fields.time_step_limit == (0.0, math.inf)
    assert fields.experts == nh.HybridExperts(**MOE, moe_latent_size=None)
    out = dict(saved)
    nh.emit_hybrid(fields, out)
    for key in ("layers_block_type", "time_step_limit", "n_groups", "conv_kernel", "chunk_size", *MOE):
        assert out[key] == saved[key], key
    (tmp_path / "config.json").write_text(json.dumps(out))
    again = transformers.AutoConfig.from_pretrained(tmp_path)
    assert again.layers_block_type == cfg.layers_block_type
    assert tuple(again.time_step_limit) == (0.0, math.inf)


@pytest.mark.parametrize(
    "pattern,extra",
    [
        ("M-M*-", {}),
        ("M*-", {"use_bias": True, "mlp_bias": True, "use_conv_bias": False}),
        ("ME*E", MOE),
        ("ME*E", {**MOE, "moe_latent_size": 16, "n_group": 1}),
    ],
)
def test_parameter_count_equals_transformers(pattern, extra):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = {**BASE, "hybrid_override_pattern": pattern, **extra}
    cfg = transformers.NemotronHConfig(**{k: v for k, v in hf.items() if k != "model_type"})
    with torch.device("meta"):
        model = transformers.NemotronHForCausalLM(cfg)
    want_total = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")
    )
    inactive = 0
    for layer in model.model.layers:
        experts = getattr(layer.mixer, "experts", None)
        if experts is not None:
            per_expert = (experts.up_proj.numel() + experts.down_proj.numel()) // extra["n_routed_experts"]
            inactive += (extra["n_routed_experts"] - extra["num_experts_per_tok"]) * per_expert
    assert nh.parameter_count(hf) == (want_total, want_total - inactive)


# The geometry of NVIDIA's published hybrids, in config.json's keys (only what the count depends on),
# and the parameter counts NVIDIA publishes for them. Sources (read 2026-12-03):
#   8B      nvidia/Nemotron-H-8B-Base-8K: NVIDIA-NeMo/Megatron-Bridge
#           tests/unit_tests/models/nemotronh/test_nemotron_h_bridge.py @ ebdef7c1 (its copy of the
#           config.json), = docs/models/nemotron/nemotronh.md @ 067f987d; published: "8B"
#   9B-v2   nvidia/NVIDIA-Nemotron-Nano-9B-v2: the same test file @ 5151999a, = the Megatron-Bridge
#           recipe nemotron_nano_v2.py @ 067f987d; published (model card): 8.89B
#   12B-v2  nvidia/NVIDIA-Nemotron-Nano-12B-v2: the Megatron-Bridge recipe nemotron_nano_v2.py and
#           nemotronh.md @ 067f987d (Megatron keys renamed to config.json's; conv_kernel, biases and
#           untied embeddings as in every other Nemotron-H config, which the recipe does not restate);
#           published (model card): 12.31B
#   30B-A3B nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16: its config.json verbatim in jax-ml/jax-llm-examples
#           nemotron3/tests/model/test_model.py @ d8baecd8; published (NVIDIA's Nemotron 3 page): "31.6B total,
#           3.2B active (3.6B with embeddings)"
_COMMON = dict(
    model_type="nemotron_h",
    vocab_size=131072,
    conv_kernel=4,
    use_conv_bias=True,
    use_bias=False,
    mlp_bias=False,
    tie_word_embeddings=False,
    ssm_state_size=128,
    n_groups=8,
    chunk_size=128,
)
PUBLISHED = {
    "Nemotron-H-8B": dict(
        _COMMON,
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        attention_head_dim=128,
        intermediate_size=21504,
        mamba_num_heads=128,
        mamba_head_dim=64,
        hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    ),
    "Nemotron-Nano-9B-v2": dict(
        _COMMON,
        hidden_size=4480,
        num_attention_heads=40,
        num_key_value_heads=8,
        attention_head_dim=128,
        intermediate_size=15680,
        mamba_num_heads=128,
        mamba_head_dim=80,
        hybrid_override_pattern="M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-",
    ),
    "Nemotron-Nano-12B-v2": dict(
        _COMMON,
        hidden_size=5120,
        num_attention_heads=40,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=20480,
        mamba_num_heads=128,
        mamba_head_dim=80,
        hybrid_override_pattern="M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M-",
    ),
    "Nemotron-3-Nano-30B-A3B": dict(
        _COMMON,
        hidden_size=2688,
        num_attention_heads=32,
        num_key_value_heads=2,
        head_dim=128,
        intermediate_size=1856,
        mamba_num_heads=64,
        mamba_head_dim=64,
        hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        n_routed_experts=128,
        num_experts_per_tok=6,
        moe_intermediate_size=1856,
        n_shared_experts=1,
        moe_shared_expert_intermediate_size=3712,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    ),
}
# name -> (total, active per token, active without the input embedding) as published, in billions
# at the published precision; None: not published (a dense model's active count is its total)
PUBLISHED_COUNTS = {
    "Nemotron-H-8B": ("8", None, None),
    "Nemotron-Nano-9B-v2": ("8.89", None, None),
    "Nemotron-Nano-12B-v2": ("12.31", None, None),
    "Nemotron-3-Nano-30B-A3B": ("31.6", "3.6", "3.2"),
}


def _billions(count: int, like: str) -> str:
    """`count` in billions with as many decimals as the published figure `like`."""
    return f"{count / 1e9:.{len(like.partition('.')[2])}f}"


@pytest.mark.parametrize("name", PUBLISHED)
def test_parameter_counts_of_the_published_hybrids(name):
    """The counts NVIDIA publishes, from the published geometry; and the same count as the
    parameters transformers' NemotronHForCausalLM builds for that config (on the meta device)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = PUBLISHED[name]
    total, active = nh.parameter_count(hf)
    published = dict(zip(("total", "active", "active without embedding"), PUBLISHED_COUNTS[name]))
    ours = {"total": total, "active": active, "active without embedding": active - hf["vocab_size"] * hf["hidden_size"]}
    for what, figure in published.items():
        if figure is not None:
            assert _billions(ours[what], figure) == figure, what
    if "n_routed_experts" not in hf:
        assert active == total
    keys = {k: v for k, v in hf.items() if k != "model_type"}
    if "attention_head_dim" in keys:
        keys["head_dim"] = keys.pop("attention_head_dim")
    cfg = transformers.NemotronHConfig(**keys)
    with torch.device("meta"):
        model = transformers.NemotronHForCausalLM(cfg)
    held = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")
    )
    assert total == held
