"""MaxText model names -> HF-style config dicts, and each name's RoPE row layout.

MaxText checkpoints carry no model config: `--model-config llama3.1-8b` names one of these.
Sources: the numbers (emb dim, heads, kv heads, layers, mlp dim, head dim, vocab, norm epsilon,
rope_max_timescale, logits_via_embedding) are MaxText's `MaxText/configs/models/<name>.yml`
(AI-Hypercomputer/maxtext, read 2026-11-30) for llama2-7b, llama2-13b, llama3-8b, llama3.1-8b,
llama3.1-70b and mistral-7b (no `rope_max_timescale` there -> MaxText's default 10000, i.e.
Mistral-7B-v0.1). llama3.2-1b/3b have no yml in the copy we could read: their numbers are Meta's
published HF configs (Llama-3.2-1B / -3B config.json: tied embeddings, llama3 RoPE scaling
factor 32), as are the llama3 RoPE scaling parameters of 3.1 (factor 8) and the token ids.
RoPE layout: reference sheet section 6 -- `llama3.1-*` interleaved, every other name half-split.
"""

from __future__ import annotations

from typing import Any

from nvfp4tool.errors import NVFP4ToolError

_LLAMA2 = dict(vocab_size=32000, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
               bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
_LLAMA3 = dict(vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
               bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=False)


def _llama3_scaling(factor: float) -> dict[str, Any]:
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


def _llama(shape: tuple[int, int, int, int, int, int], base: dict[str, Any], **extra: Any) -> dict[str, Any]:
    hidden, heads, kv_heads, layers, mlp, head_dim = shape
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "num_hidden_layers": layers, "intermediate_size": mlp, "head_dim": head_dim,
            "torch_dtype": "bfloat16", **base, **extra}


_LLAMA31 = dict(_LLAMA3, max_position_embeddings=131072, rope_scaling=_llama3_scaling(8.0))
_LLAMA32 = dict(_LLAMA31, tie_word_embeddings=True, rope_scaling=_llama3_scaling(32.0))

# name -> HF config.json dict; (hidden, heads, kv heads, layers, mlp, head_dim)
MAXTEXT_MODELS: dict[str, dict[str, Any]] = {
    "llama2-7b": _llama((4096, 32, 32, 32, 11008, 128), _LLAMA2),
    "llama2-13b": _llama((5120, 40, 40, 40, 13824, 128), _LLAMA2),
    "llama3-8b": _llama((4096, 32, 8, 32, 14336, 128), _LLAMA3),
    "llama3.1-8b": _llama((4096, 32, 8, 32, 14336, 128), _LLAMA31),
    "llama3.1-70b": _llama((8192, 64, 8, 80, 28672, 128), _LLAMA31),
    "llama3.2-1b": _llama((2048, 32, 8, 16, 8192, 64), _LLAMA32),
    "llama3.2-3b": _llama((3072, 24, 8, 28, 8192, 128), _LLAMA32),
    "mistral-7b": {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
                   "hidden_act": "silu", "hidden_size": 4096, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "num_hidden_layers": 32, "intermediate_size": 14336,
                   "head_dim": 128, "vocab_size": 32000, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                   "max_position_embeddings": 32768, "sliding_window": 4096, "bos_token_id": 1,
                   "eos_token_id": 2, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
}


def maxtext_hf_config(name: str) -> dict[str, Any]:
    """The HF config.json dict of MaxText model `name` (a fresh copy)."""
    try:
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in MAXTEXT_MODELS[name].items()}
    except KeyError:
        raise NVFP4ToolError(f"unknown MaxText model name {name!r}; known: "
                             f"{', '.join(MAXTEXT_MODELS)} (or pass an HF config.json / folder)") from None


def rope_layout_for(name: str) -> str:
    """RoPE row layout MaxText uses for model `name`: "interleaved" for llama3.1-*, else "half"."""
    return "interleaved" if name.startswith("llama3.1-") else "half"
