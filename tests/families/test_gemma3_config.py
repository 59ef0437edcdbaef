"""Gemma 3's config.json (`families/gemma3.py`): the Hub's transformers 4 spelling (rope_theta,
rope_local_base_freq, rope_scaling of the global layers, sliding_window_pattern) and transformers
5's (rope_parameters per layer type, layer_types), each read into the same per-layer attention and
written back in its own spelling; what Gemma 3 never uses refused in one line; and the parameter
counts of the published Gemma 3 text models (1B, 4B, 12B, 27B) from their geometry, equal to
transformers' `Gemma3ForCausalLM` built on the meta device.

Geometry: the Hub cards' config.json (google/gemma-3-1b-it; the text_config of gemma-3-{4b,12b,27b}-it,
as MaxText's MaxText/utils/ckpt_conversion/utils/hf_model_configs.py also lists them; vocabulary
262144 for 1B, 262208 for the multimodal checkpoints' text models).
"""

from __future__ import annotations

import json

import pytest

from nvfp4tool.config import LinearRopeScaling, ModelConfig
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.families import LayerAttention

GEMMA3_1B = {  # google/gemma-3-1b-it config.json
    "architectures": ["Gemma3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": None,
    "bos_token_id": 2,
    "cache_implementation": "hybrid",
    "eos_token_id": [1, 106],
    "final_logit_softcapping": None,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "initializer_range": 0.02,
    "intermediate_size": 6912,
    "max_position_embeddings": 32768,
    "model_type": "gemma3_text",
    "num_attention_heads": 4,
    "num_hidden_layers": 26,
    "num_key_value_heads": 1,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0",
    "use_cache": True,
    "vocab_size": 262144,
}
_MULTIMODAL_TEXT = dict(
    GEMMA3_1B,
    max_position_embeddings=131072,
    rope_scaling={"factor": 8.0, "rope_type": "linear"},
    rope_theta=1000000.0,
    sliding_window=1024,
    vocab_size=262208,
)
PUBLISHED = {  # label (billions, as published) -> text geometry
    1: GEMMA3_1B,
    4: dict(_MULTIMODAL_TEXT, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34)
    | dict(num_attention_heads=8, num_key_value_heads=4),
    12: dict(_MULTIMODAL_TEXT, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48)
    | dict(num_attention_heads=16, num_key_value_heads=8),
    27: dict(_MULTIMODAL_TEXT, hidden_size=5376, intermediate_size=21504, num_hidden_layers=62)
    | dict(num_attention_heads=32, num_key_value_heads=16, head_dim=128, query_pre_attn_scalar=168),
}


def test_the_hubs_transformers4_config_reads_into_per_layer_attention_and_back():
    config = ModelConfig.from_hf_config(GEMMA3_1B)
    family = config.family_spec
    assert config.tie_word_embeddings  # Gemma's default: the key is absent
    local = LayerAttention(512, 10000.0, None, softmax_scale=256**-0.5)
    assert [family.layer_attention(config, i) for i in (0, 4, 5, 6)] == [
        local,
        local,
        LayerAttention(None, 1000000.0, None, softmax_scale=256**-0.5),
        local,
    ]
    out = config.to_hf_config()
    assert {k: v for k, v in out.items() if k != "layer_types"} == {
        k: v for k, v in GEMMA3_1B.items() if k != "rope_scaling"
    } | {"rope_scaling": None, "tie_word_embeddings": True}
    assert ModelConfig.from_hf_config(json.loads(json.dumps(out))) == config
    scaled = ModelConfig.from_hf_config(PUBLISHED[27])
    assert scaled.family_spec.layer_attention(scaled, 5) == LayerAttention(
        None, 1000000.0, LinearRopeScaling(8.0), softmax_scale=168**-0.5
    )
    assert scaled.to_hf_config()["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}


def test_transformers5s_rope_parameters_read_and_written_in_their_own_spelling():
    transformers = pytest.importorskip("transformers")
    hf = json.loads(transformers.Gemma3TextConfig(**{k: GEMMA3_1B[k] for k in ("num_hidden_layers",)}).to_json_string())
    hf["rope_parameters"]["full_attention"] = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}
    config = ModelConfig.from_hf_config(hf)
    assert config.family_spec.layer_attention(config, 5).rope_scaling == LinearRopeScaling(8.0)
    out = config.to_hf_config()
    assert out["rope_parameters"] == {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }
    assert "rope_theta" not in out and out["layer_types"] == hf["layer_types"]
    assert ModelConfig.from_hf_config(out) == config


@pytest.mark.parametrize(
    "change, message",
    [
        ({"final_logit_softcapping": 30.0}, r"final_logit_softcapping=30\.0 unsupported for gemma3_text"),
        ({"attn_logit_softcapping": 50.0}, r"attn_logit_softcapping=50\.0 unsupported for gemma3_text"),
        ({"use_bidirectional_attention": True}, r"use_bidirectional_attention=true unsupported"),
        (  # what MaxText's hf_model_configs.py writes for its tanh GELU: the fix said
            {"hidden_activation": "gelu"},
            r"hidden_activation 'gelu' unsupported for gemma3_text; supported: gelu_pytorch_tanh \(MaxText "
            r"writes 'gelu' for the tanh GELU: set it to gelu_pytorch_tanh\)$",
        ),
        ({"layer_types": ["local"] * 26}, r"layer_types must be a list of 'sliding_attention' / 'full_attention'"),
        ({"layer_types": ["full_attention"] * 26}, r"layer_types contradict sliding_window_pattern=6"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, r"RoPE scaling type 'dynamic' unsupported"),
    ],
)
def test_what_gemma3_never_uses_is_refused_in_one_line(change, message):
    with pytest.raises(NVFP4ToolError, match=rf"^/m/config\.json: .*{message}") as info:
        ModelConfig.from_hf_config({**GEMMA3_1B, **change}, source="/m/config.json")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("label", PUBLISHED)
def test_published_parameter_counts_from_their_geometry(label):
    """Ours (the module table's tensors, the tied embedding once) equals transformers' model of
    the same config built on the meta device, and rounds to the published size (the 4B / 12B / 27B
    names count the 0.4B SigLIP vision tower too; their text models: 3.88B, 11.77B, 27.01B)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    ours = ModelConfig.from_hf_config(PUBLISHED[label]).num_parameters()
    text = {k: v for k, v in PUBLISHED[label].items() if k not in ("architectures", "torch_dtype")}
    with torch.device("meta"):
        theirs = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**text)).num_parameters()
    assert ours == theirs
    assert round(ours / 1e9) == label
