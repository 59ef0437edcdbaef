"""ModelConfig: HF config.json in and out, validation, the tensor-shape table."""

from __future__ import annotations

import dataclasses
import json

import pytest

from nvfp4tool.config import ModelConfig, RopeScaling
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.families import ATTENTION_MOE

LLAMA31_8B = {  # config.json of Llama 3.1 8B (transformers 4.x style), plus a key we do not model
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "pretraining_tp": 1,
    "initializer_range": 0.02,
    "custom_unmodeled_key": {"kept": [1, 2]},
}
QWEN3_06B = {  # Qwen3-0.6B (head_dim * heads != hidden), transformers 5 rope_parameters style
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "max_position_embeddings": 40960,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 28,
    "dtype": "bfloat16",
}
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "sliding_window": 32768,
    "max_window_layers": 21,
    "torch_dtype": "bfloat16",
}
MISTRAL_7B_V01 = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 32768,
    "sliding_window": 4096,
    "torch_dtype": "bfloat16",
}


def test_llama31_fields_and_round_trip():
    config = ModelConfig.from_hf_config(LLAMA31_8B)
    assert (config.family, config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        "llama",
        32,
        32,
        8,
        128,
    )
    assert config.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    assert config.eos_token_id == (128001, 128008, 128009) and config.dtype == "bfloat16"
    assert config.num_parameters() == 8_030_261_248  # Llama 3.1 8B's published count
    out = config.to_hf_config()
    assert out["custom_unmodeled_key"] == {"kept": [1, 2]} and out["pretraining_tp"] == 1
    assert out["rope_scaling"]["rope_type"] == "llama3" and "rope_parameters" not in out
    assert out["torch_dtype"] == "bfloat16" and "dtype" not in out  # transformers 4.x style kept
    assert out["eos_token_id"] == [128001, 128008, 128009]
    again = ModelConfig.from_hf_config(json.loads(json.dumps(out)))
    assert again == config and again.hf_extra == config.hf_extra


@pytest.mark.parametrize("hf", [QWEN3_06B, QWEN25_05B, MISTRAL_7B_V01], ids=["qwen3", "qwen2", "mistral"])
def test_round_trip_other_families(hf):
    config = ModelConfig.from_hf_config(hf)
    out = config.to_hf_config()
    assert ModelConfig.from_hf_config(json.loads(json.dumps(out))) == config
    for key in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads"):
        assert out[key] == hf[key]
    if "rope_parameters" in hf:  # transformers 5 style stays transformers 5 style
        assert out["rope_parameters"]["rope_theta"] == hf["rope_parameters"]["rope_theta"]
        assert "rope_theta" not in out and out["dtype"] == hf["dtype"] and "torch_dtype" not in out


QWEN3_30B_A3B = {  # Qwen3-30B-A3B's config.json (transformers 4.51 style, the Hub's "num_experts")
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 151936,
}
MIXTRAL_8X7B = {  # Mixtral-8x7B-v0.1's config.json
    "architectures": ["MixtralForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mixtral",
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1e6,
    "router_aux_loss_coef": 0.02,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 32000,
}


@pytest.mark.parametrize(
    "hf, params, linears, experts_key",
    [
        (QWEN3_30B_A3B, 30_532_122_624, 48 * (4 + 1 + 128 * 3) + 1, "num_experts"),  # published counts
        (MIXTRAL_8X7B, 46_702_792_704, 32 * (4 + 1 + 8 * 3) + 1, "num_local_experts"),
        ({**QWEN3_30B_A3B, "num_experts": None, "num_local_experts": 128}, 30_532_122_624, None, "num_local_experts"),
    ],
    ids=["qwen3_moe", "mixtral", "qwen3_moe-transformers5"],
)
def test_moe_fields_sizes_and_round_trip(hf, params, linears, experts_key):
    config = ModelConfig.from_hf_config({k: v for k, v in hf.items() if v is not None})
    assert config.family_spec.experts(config) is not None and config.num_parameters() == params
    if linears is not None:
        assert len(config.linear_names()) == linears
    out = config.to_hf_config()
    assert (
        out[experts_key] == config.family_config.num_experts
        and out["router_aux_loss_coef"] == hf["router_aux_loss_coef"]
    )
    assert ModelConfig.from_hf_config(json.loads(json.dumps(out))) == config
    assert config.router_names()[0] == f"{config.mlp_prefix(0)}.gate"


def test_moe_layer_names_follow_transformers():
    qwen = ModelConfig.from_hf_config(
        {
            **QWEN3_30B_A3B,
            "num_hidden_layers": 4,
            "decoder_sparse_step": 2,
            "mlp_only_layers": [3],
            "num_experts": 2,
            "num_experts_per_tok": 1,
        }
    )
    assert [qwen.layer_kind(i) == ATTENTION_MOE for i in range(4)] == [False, True, False, False]
    shapes = qwen.expected_tensor_shapes()
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (6144, 2048)
    assert shapes["model.layers.1.mlp.gate.weight"] == (2, 2048)
    assert shapes["model.layers.1.mlp.experts.1.down_proj.weight"] == (2048, 768)
    assert qwen.linear_names()[4:9] == [
        "model.layers.0.mlp.gate_proj",
        "model.layers.0.mlp.up_proj",
        "model.layers.0.mlp.down_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.self_attn.k_proj",
    ]
    mixtral = ModelConfig.from_hf_config({**MIXTRAL_8X7B, "num_hidden_layers": 1})
    assert mixtral.linear_names()[4:8] == [
        "model.layers.0.block_sparse_moe.gate",
        "model.layers.0.block_sparse_moe.experts.0.w1",
        "model.layers.0.block_sparse_moe.experts.0.w3",
        "model.layers.0.block_sparse_moe.experts.0.w2",
    ]
    assert mixtral.expected_tensor_shapes()["model.layers.0.block_sparse_moe.experts.7.w2.weight"] == (4096, 14336)


@pytest.mark.parametrize(
    "change, fragment",
    [
        ({"num_experts_per_tok": 0}, "num_experts_per_tok must be in 1..num_experts=128"),
        ({"num_experts_per_tok": 129}, "num_experts_per_tok must be in 1..num_experts=128"),
        ({"num_experts": None}, "missing required key 'num_experts or num_local_experts'"),
        ({"moe_intermediate_size": None}, "missing required key 'moe_intermediate_size'"),
        ({"mlp_only_layers": [48]}, "mlp_only_layers 48 is not a layer index in 0..47"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step must be a positive integer"),
        ({"router_jitter_noise": 0.01}, "router_jitter_noise=0.01 unsupported"),
        ({"num_experts_per_tok": 2.5}, "num_experts_per_tok must be an integer, got 2.5 (float)"),
        ({"num_experts_per_tok": 8.0}, "num_experts_per_tok must be an integer, got 8.0 (float)"),
        ({"num_experts_per_tok": None}, "missing required key 'num_experts_per_tok'"),
        ({"num_experts": "128"}, "num_experts must be an integer"),
        ({"num_local_experts": 64}, "num_experts=128 and num_local_experts=64 disagree"),
        ({"decoder_sparse_step": False}, "decoder_sparse_step must be an integer, got False (bool)"),
        ({"moe_intermediate_size": 768.0}, "moe_intermediate_size must be an integer"),
        ({"mlp_only_layers": [1.0]}, "mlp_only_layers must be an integer, got 1.0"),
        ({"mlp_only_layers": 3}, "mlp_only_layers must be a list of layer indices"),
        ({"norm_topk_prob": "true"}, "norm_topk_prob must be true or false"),
        ({"router_aux_loss_coef": "0.001"}, "router_aux_loss_coef must be a number"),
    ],
    ids=lambda v: str(v)[:30],
)
def test_moe_rejections_name_the_problem(change, fragment):
    hf = {k: v for k, v in {**QWEN3_30B_A3B, **change}.items() if v is not None}
    with pytest.raises(NVFP4ToolError) as error:
        ModelConfig.from_hf_config(hf, source="/m/config.json")
    assert fragment in str(error.value) and str(error.value).startswith("/m/config.json: ")
    with pytest.raises(NVFP4ToolError, match="mixture-of-experts fields are for qwen3_moe and mixtral only"):
        dataclasses.replace(
            ModelConfig.from_hf_config(QWEN3_06B), family_config=ModelConfig.from_hf_config(QWEN3_30B_A3B).family_config
        )


def test_family_specific_options():
    qwen3 = ModelConfig.from_hf_config(QWEN3_06B)
    assert qwen3.qk_norm and not qwen3.attention_bias and qwen3.tie_word_embeddings
    shapes = qwen3.expected_tensor_shapes()
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (16 * 128, 1024)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (1024, 16 * 128)
    assert shapes["model.layers.27.self_attn.k_norm.weight"] == (128,)
    assert "lm_head.weight" not in shapes
    qwen2 = ModelConfig.from_hf_config(QWEN25_05B)
    assert qwen2.attention_bias and not qwen2.o_proj_bias and qwen2.sliding_window is None
    shapes = qwen2.expected_tensor_shapes()
    assert shapes["model.layers.0.self_attn.k_proj.bias"] == (2 * 64,)
    assert "model.layers.0.self_attn.o_proj.bias" not in shapes
    assert qwen2.num_parameters() == 494_032_768  # Qwen2.5-0.5B's published count
    mistral = ModelConfig.from_hf_config(MISTRAL_7B_V01)
    assert mistral.sliding_window == 4096 and mistral.rope_scaling is None
    llama_bias = ModelConfig.from_hf_config({**LLAMA31_8B, "attention_bias": True})
    assert llama_bias.attention_bias and llama_bias.o_proj_bias


def test_linear_names_cover_every_projection():
    config = ModelConfig.from_hf_config({**LLAMA31_8B, "num_hidden_layers": 2})
    names = config.linear_names()
    assert len(names) == 2 * 7 + 1 and names[-1] == "lm_head"
    assert names[:2] == ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"]


@pytest.mark.parametrize(
    "change, fragment",
    [
        ({"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]}, "unsupported architecture 'gemma2'"),
        ({"model_type": None, "architectures": ["FalconForCausalLM"]}, "missing required key 'model_type'"),
        ({"model_type": None}, "missing required key 'model_type' (architectures names 'LlamaForCausalLM')"),
        (
            {"architectures": ["MixtralForCausalLM"]},
            "architectures 'MixtralForCausalLM' is a mixtral model but model_type is 'llama'",
        ),
        ({"architectures": "LlamaForCausalLM"}, "architectures must be a list"),
        ({"rope_scaling": "llama3"}, "rope_scaling must be an object"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "'dynamic' unsupported"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks 'low_freq_factor'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' unsupported"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"num_key_value_heads": 5}, "not a multiple of num_kv_heads=5"),
        ({"vocab_size": 0}, "vocab_size must be a positive integer"),
        ({"hidden_size": "wide"}, "hidden_size must be an integer, got 'wide' (str)"),
        ({"num_hidden_layers": 2.0}, "num_hidden_layers must be an integer, got 2.0 (float)"),
        ({"num_key_value_heads": True}, "num_key_value_heads must be an integer, got True (bool)"),
        ({"max_position_embeddings": "8192"}, "max_position_embeddings must be an integer"),
        ({"eos_token_id": [128001, 1.5]}, "eos_token_id must be an integer, got 1.5"),
        ({"bos_token_id": "<s>"}, "bos_token_id must be an integer"),
        ({"rms_norm_eps": "1e-5"}, "rms_norm_eps must be a number, got '1e-5' (str)"),
        ({"rope_theta": True}, "rope_theta must be a number"),
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, got 'false' (str)"),
        ({"attention_bias": 1}, "attention_bias must be true or false"),
        (
            {"rope_scaling": {**LLAMA31_8B["rope_scaling"], "original_max_position_embeddings": 8192.5}},
            "original_max_position_embeddings must be an integer",
        ),
        ({"vocab_size": None}, "missing required key 'vocab_size'"),
    ],
    ids=lambda v: str(v)[:30],
)
def test_rejections_name_the_problem(change, fragment):
    hf = {k: v for k, v in {**LLAMA31_8B, **change}.items() if v is not None}
    with pytest.raises(NVFP4ToolError) as error:
        ModelConfig.from_hf_config(hf, source="/m/config.json")
    message = str(error.value)
    assert fragment in message and "\n" not in message and message.startswith("/m/config.json: ")
    if "unsupported" in fragment and "architecture" in fragment:
        assert "supported model_type: llama, mistral, qwen2, qwen3" in message and "/m/config.json" in message


def test_qwen_sliding_window_rejected():
    with pytest.raises(NVFP4ToolError, match="per-layer sliding-window"):
        ModelConfig.from_hf_config({**QWEN25_05B, "use_sliding_window": True})


def test_inconsistent_dataclass_rejected():
    config = ModelConfig.from_hf_config(QWEN3_06B)
    with pytest.raises(NVFP4ToolError, match="qk_norm is on exactly for qwen3"):
        dataclasses.replace(config, family="llama")
    with pytest.raises(NVFP4ToolError, match="sliding_window is supported for mistral and mixtral only"):
        dataclasses.replace(config, sliding_window=8)


def test_from_hf_folder_errors(tmp_path):
    with pytest.raises(NVFP4ToolError, match="config.json: no such file"):
        ModelConfig.from_hf_folder(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(NVFP4ToolError, match="not valid JSON"):
        ModelConfig.from_hf_folder(tmp_path)
    (tmp_path / "config.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(NVFP4ToolError, match="config.json: not UTF-8 text"):
        ModelConfig.from_hf_folder(tmp_path)
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").mkdir()
    with pytest.raises(NVFP4ToolError, match="config.json: is a folder"):
        ModelConfig.from_hf_folder(tmp_path)
    (tmp_path / "config.json").rmdir()
    (tmp_path / "config.json").write_text(json.dumps(MISTRAL_7B_V01))
    assert ModelConfig.from_hf_folder(tmp_path).family == "mistral"


def test_transformers_reads_what_we_write():
    """transformers' own config classes parse our config.json to the same numbers."""
    transformers = pytest.importorskip("transformers")
    for hf in (LLAMA31_8B, QWEN3_06B, QWEN25_05B, MISTRAL_7B_V01, QWEN3_30B_A3B, MIXTRAL_8X7B):
        ours = ModelConfig.from_hf_config(hf).to_hf_config()
        theirs = transformers.AutoConfig.for_model(
            **{k: v for k, v in ours.items() if k != "model_type"}, model_type=ours["model_type"]
        )
        assert ModelConfig.from_hf_config(theirs.to_dict()) == ModelConfig.from_hf_config(hf)
