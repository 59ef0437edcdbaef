"""nvfp4tool.families.deepseek_v3: the family's config.json facts against transformers 5.25's
DeepseekV3Config / DeepseekV3ForCausalLM and vLLM's reading (vllm/model_executor/models/deepseek_v2.py):
the published DeepSeek-V3 config parsed, written back and counted (671B total / 37B active), the
module table against transformers' modules and its tensor-parallel plan, what the two would compute
differently refused in one line naming the key (MaxText: tests/converters/test_maxtext_deepseek.py)."""

from __future__ import annotations

import json
import math

import pytest

from nvfp4tool.config import ModelConfig
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.families import fused_group, get_family, projection_of
from nvfp4tool.families.deepseek_v3 import MLAFields, parameter_count

# deepseek-ai/DeepSeek-V3's config.json (its quantization_config and auto_map left out)
YARN = {
    "beta_fast": 32,
    "beta_slow": 1,
    "factor": 40,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
    "type": "yarn",
}
PUBLISHED = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc",
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "aux_loss_alpha": 0.001,
    "seq_aux": True,
    "hidden_act": "silu",
    "max_position_embeddings": 163840,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "rope_scaling": YARN,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "use_cache": True,
}


def test_the_published_config_parses_writes_back_and_counts_671b_total_37b_active():
    config = ModelConfig.from_hf_config(PUBLISHED)
    f = config.family_config
    assert isinstance(f, MLAFields) and (f.q_lora_rank, f.kv_lora_rank, f.qk_head_dim) == (1536, 512, 192)
    assert config.head_dim == 64  # the RoPE width, as transformers derives it
    kinds = [config.layer_kind(i) for i in range(61)]
    assert kinds == ["mla+mlp"] * 3 + ["mla+moe"] * 58
    written = config.to_hf_config()
    scaling = {("rope_type" if k == "type" else k): v for k, v in YARN.items()}  # written as transformers 5 names it
    assert {k: written[k] for k in PUBLISHED} == {**PUBLISHED, "rope_scaling": scaling}
    attention = config.family_spec.layer_attention(config, 0)
    assert attention.rope_dim == 64 and attention.softmax_scale == 192**-0.5 * (0.1 * math.log(40) + 1) ** 2
    assert ModelConfig.from_hf_config(written) == config
    total, active = parameter_count(config)
    assert (total, active) == (671_026_419_200, 37_552_297_472)
    assert round(total / 1e9) == 671 and int(active / 1e9) == 37  # DeepSeek's 671B / 37B


@pytest.mark.parametrize(
    "change, says",
    [
        ({"scoring_func": "softmax"}, "scoring_func='softmax' unsupported"),
        ({"topk_method": "greedy"}, "topk_method='greedy' unsupported"),
        ({"moe_layer_freq": 2}, "moe_layer_freq=2 unsupported"),
        ({"rms_norm_eps": 1e-5}, "rms_norm_eps=1e-05 unsupported"),
        ({"attention_bias": True}, "attention_bias=true unsupported"),
        ({"n_group": 3}, "n_routed_experts=256 is not a multiple of n_group=3"),
        ({"num_key_value_heads": 64}, "num_key_value_heads must equal num_attention_heads"),
        ({"kv_lora_rank": None}, "deepseek_v3 needs kv_lora_rank"),
        ({"num_local_experts": 128}, "n_routed_experts=256 and num_local_experts=128 disagree"),
    ],
)
def test_what_transformers_and_vllm_would_compute_differently_is_refused(change, says):
    hf = {k: v for k, v in {**PUBLISHED, **change}.items() if v is not None}
    with pytest.raises(NVFP4ToolError) as e:
        ModelConfig.from_hf_config(hf, source="ckpt/config.json")
    assert says in str(e.value) and str(e.value).startswith("ckpt/config.json") and "\n" not in str(e.value)


def test_a_config_saved_by_transformers_is_read_and_gains_what_vllm_reads():
    from transformers import DeepseekV3Config

    from fixtures.deepseek_fixtures import NO_LORA

    hf = json.loads(DeepseekV3Config(**NO_LORA).to_json_string())
    assert "scoring_func" not in hf and "topk_method" not in hf  # vLLM's defaults would be softmax, no bias
    config = ModelConfig.from_hf_config(hf)
    assert config.family_config.q_lora_rank is None and config.head_dim == hf["head_dim"] == NO_LORA["qk_rope_head_dim"]
    written = config.to_hf_config()
    assert (written["scoring_func"], written["topk_method"]) == ("sigmoid", "noaux_tc")
    assert {k: written[k] for k in hf if k not in ("transformers_version",)} == {
        k: v for k, v in hf.items() if k != "transformers_version"
    }


@pytest.mark.peers
@pytest.mark.parametrize("key", ["lora", "no-lora"])
def test_the_module_table_is_transformers_modules_with_its_tp_plan(key):
    """Every nn.Linear and router of transformers' model is a row with its shape (its experts: the
    fused gate_up_proj / down_proj, one row per expert and projection here); the splits are
    transformers' base_model_tp_plan where it lists the module, vLLM's replicated q_a_proj /
    kv_a_proj_with_mqa (transformers' own 'mla_kv_a_proj' plan is its own scheme)."""
    import fnmatch

    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from fixtures.deepseek_fixtures import LORA, NO_LORA

    hf_config = DeepseekV3Config(**(LORA if key == "lora" else NO_LORA))
    model = DeepseekV3ForCausalLM(hf_config)
    config = ModelConfig.from_hf_config(json.loads(hf_config.to_json_string()))
    table = config.modules
    modules = dict(model.named_modules())
    hf_linears = {
        n: tuple(m.weight.shape)
        for n, m in modules.items()
        if isinstance(m, torch.nn.Linear) or type(m).__name__.endswith("TopkRouter")
    }
    assert {m.name: m.shape for m in table.linears if m.expert is None} == hf_linears
    for layer in (1, 2):
        experts = modules[f"model.layers.{layer}.mlp.experts"]
        E, two_F, H = experts.gate_up_proj.shape
        rows = [m for m in table.linears if m.layer == layer and m.expert is not None]
        assert len(rows) == 3 * E and {m.shape for m in rows if m.role == "down"} == {
            tuple(experts.down_proj.shape[1:])
        }
    plan = {"colwise": "column", "rowwise": "row"}
    for m in table.linears:
        wanted = [v for p, v in hf_config.base_model_tp_plan.items() if fnmatch.fnmatch(m.name, f"model.{p}")]
        if wanted and wanted[0] in plan:
            assert m.split == plan[wanted[0]], m.name
        if m.layer is not None:
            assert m.group == fused_group(m.name) and projection_of(m.name) is not None, m.name
    attention = "model.layers.0.self_attn"
    assert table[f"{attention}.kv_a_proj_with_mqa"].split == "none"
    if key == "lora":
        assert table[f"{attention}.q_a_proj"].group == table[f"{attention}.kv_a_proj_with_mqa"].group
        assert table[f"{attention}.q_b_proj"].split == "column"
    assert table.routers() == ["model.layers.1.mlp.gate", "model.layers.2.mlp.gate"]
    assert table.kept() == {"model.layers.1.mlp.gate", "model.layers.2.mlp.gate", "lm_head"}
    assert get_family("deepseek_v3").tp_problems(config, 2) == []
    assert "does not split into 8" in get_family("deepseek_v3").tp_problems(config, 8)[0]
