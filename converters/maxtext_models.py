"""MaxText model names -> HF-style config dicts, and each name's RoPE row layout.

MaxText checkpoints carry no model config: `--model-config llama3.1-8b` names one of `MAXTEXT_MODELS`
(numbers from MaxText's model ymls and the published HF configs). `llama3.1-*` is interleaved, every
other name half-split; `family_rope_layout` fixes Mixtral's and Qwen3-MoE's (half).
Design notes: docs/design/converters.md.
"""

from __future__ import annotations

from typing import Any

from nvfp4tool.errors import NVFP4ToolError

_LLAMA2 = dict(
    vocab_size=32000,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=4096,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
_LLAMA3 = dict(
    vocab_size=128256,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=8192,
    bos_token_id=128000,
    eos_token_id=128001,
    tie_word_embeddings=False,
)


def _llama3_scaling(factor: float) -> dict[str, Any]:
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


def _llama(shape: tuple[int, int, int, int, int, int], base: dict[str, Any], **extra: Any) -> dict[str, Any]:
    hidden, heads, kv_heads, layers, mlp, head_dim = shape
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "num_hidden_layers": layers,
        "intermediate_size": mlp,
        "head_dim": head_dim,
        "torch_dtype": "bfloat16",
        **base,
        **extra,
    }


_LLAMA31 = dict(_LLAMA3, max_position_embeddings=131072, rope_scaling=_llama3_scaling(8.0))
_LLAMA32 = dict(_LLAMA31, tie_word_embeddings=True, rope_scaling=_llama3_scaling(32.0))


def _mixtral(shape: tuple[int, int, int, int, int, int], vocab: int, context: int, aux_loss: float) -> dict[str, Any]:
    hidden, heads, kv_heads, layers, mlp, experts = shape
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "num_hidden_layers": layers,
        "intermediate_size": mlp,
        "head_dim": 128,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e6,
        "max_position_embeddings": context,
        "sliding_window": None,
        "num_local_experts": experts,
        "num_experts_per_tok": 2,
        "router_aux_loss_coef": aux_loss,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def _qwen3_moe(shape: tuple[int, int, int, int, int, int], rope_theta: float) -> dict[str, Any]:
    hidden, heads, kv_heads, layers, expert_mlp, experts = shape
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "num_hidden_layers": layers,
        "intermediate_size": expert_mlp,
        "head_dim": 128,
        "vocab_size": 151936,
        "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta,
        "max_position_embeddings": 262144,
        "num_experts": experts,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": expert_mlp,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 0.001,
        "attention_bias": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


# name -> HF config.json dict; (hidden, heads, kv heads, layers, mlp, head_dim); mixtral: (hidden,
# heads, kv heads, layers, mlp, experts); qwen3 MoE: (hidden, heads, kv heads, layers, expert mlp, experts)
MAXTEXT_MODELS: dict[str, dict[str, Any]] = {
    "llama2-7b": _llama((4096, 32, 32, 32, 11008, 128), _LLAMA2),
    "llama2-13b": _llama((5120, 40, 40, 40, 13824, 128), _LLAMA2),
    "llama3-8b": _llama((4096, 32, 8, 32, 14336, 128), _LLAMA3),
    "llama3.1-8b": _llama((4096, 32, 8, 32, 14336, 128), _LLAMA31),
    "llama3.1-70b": _llama((8192, 64, 8, 80, 28672, 128), _LLAMA31),
    "llama3.2-1b": _llama((2048, 32, 8, 16, 8192, 64), _LLAMA32),
    "llama3.2-3b": _llama((3072, 24, 8, 28, 8192, 128), _LLAMA32),
    "mistral-7b": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "hidden_act": "silu",
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 32,
        "intermediate_size": 14336,
        "head_dim": 128,
        "vocab_size": 32000,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "mixtral-8x7b": _mixtral((4096, 32, 8, 32, 14336, 8), 32000, 32768, 0.02),
    "mixtral-8x22b": _mixtral((6144, 48, 8, 56, 16384, 8), 32768, 65536, 0.001),
    "qwen3-30b-a3b": _qwen3_moe((2048, 32, 4, 48, 768, 128), 1e7),
    "qwen3-235b-a22b": _qwen3_moe((4096, 64, 4, 94, 1536, 128), 5e6),
    "qwen3-480b-a35b": _qwen3_moe((6144, 96, 8, 62, 2560, 160), 1e7),
}


def maxtext_hf_config(name: str) -> dict[str, Any]:
    """The HF config.json dict of MaxText model `name` (a fresh copy)."""
    try:
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in MAXTEXT_MODELS[name].items()}
    except KeyError:
        raise NVFP4ToolError(
            f"unknown MaxText model name {name!r}; known: "
            f"{', '.join(MAXTEXT_MODELS)} (or pass an HF config.json / folder)"
        ) from None


def rope_layout_for(name: str) -> str:
    """RoPE row layout MaxText uses for model `name`: "interleaved" for llama3.1-*, else "half"."""
    return "interleaved" if name.startswith("llama3.1-") else "half"


# Families whose MaxText decoder fixes the RoPE row layout (any model of the family, named or not).
FAMILY_ROPE_LAYOUTS = {"mixtral": "half", "qwen3_moe": "half"}


def family_rope_layout(family: str) -> str | None:
    """The RoPE row layout MaxText's decoder for `family` fixes, or None where the model decides."""
    return FAMILY_ROPE_LAYOUTS.get(family)


def check_family_rope_layout(family: str, rope_layout: str, label: str) -> None:
    """NVFP4ToolError if `family` fixes another RoPE layout than `rope_layout` (the library's guard
    under the reader and the writer; the commands refuse the option first, exit 2, in
    `nvfp4tool.checkpoints.resolve_rope_layout`)."""
    fixed = family_rope_layout(family)
    if fixed is not None and rope_layout != fixed:
        raise NVFP4ToolError(
            f"{label}: RoPE layout {rope_layout!r} for {family}, whose MaxText decoder fixes {fixed!r}"
        )
