"""Tiny random Hugging Face models, one per supported family, built with transformers and saved with
`save_pretrained` (the independent source of truth the JAX model and the converters are tested on).

Use the session-scoped pytest fixture `hf_tiny_models` (import it into a test module:
`from hf_fixtures import hf_tiny_models  # noqa: F401`) or call `build_tiny_model` directly.
Every parameter is re-drawn from a seeded generator (transformers initialises biases to zero and
norms to one, which would hide a model that ignored them).
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

# key -> (config class name, config kwargs). Shared sizes: hidden 64, 2 layers, 4 heads, 2 kv heads.
_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
TINY_SPECS: dict[str, tuple[str, dict[str, Any]]] = {
    # Llama 3.1 style: llama3 RoPE scaling with a small original context so that most wavelengths
    # (16 / low_freq_factor = 16 and 16 / high_freq_factor = 4 positions) are scaled or smoothed.
    "llama3": (
        "LlamaConfig",
        dict(
            _COMMON,
            head_dim=16,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    # Llama 3.2 style: tied embeddings (no lm_head.weight in the file) and llama3 scaling factor 32.
    "llama_tied": (
        "LlamaConfig",
        dict(
            _COMMON,
            head_dim=16,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8,
            },
        ),
    ),
    # Mistral with a sliding window small enough to cut into the test sequences.
    "mistral": ("MistralConfig", dict(_COMMON, head_dim=16, sliding_window=4, rope_theta=10000.0)),
    # Qwen2: bias on q/k/v, none on o_proj.
    "qwen2": ("Qwen2Config", dict(_COMMON, rope_theta=1000000.0)),
    # Qwen3: per-head q/k RMSNorm, and head_dim * heads (128) != hidden (64) as in real Qwen3.
    "qwen3": ("Qwen3Config", dict(_COMMON, head_dim=32, rope_theta=1000000.0)),
    # Qwen3-MoE: 3 layers, the middle one dense (mlp_only_layers); 8 experts of width 32, top-2,
    # renormalised; the router makes the last expert unreachable (see _unreachable_last_expert).
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            _COMMON,
            num_hidden_layers=3,
            head_dim=32,
            rope_theta=1000000.0,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            router_aux_loss_coef=0.01,
        ),
    ),
    # Mixtral: 6 experts of width 128 (intermediate_size), top-2, the last unreachable.
    "mixtral": (
        "MixtralConfig",
        dict(
            _COMMON,
            head_dim=16,
            num_local_experts=6,
            num_experts_per_tok=2,
            rope_theta=1000000.0,
            router_aux_loss_coef=0.02,
        ),
    ),
}
MOE_KEYS = ("qwen3_moe", "mixtral")
FAMILY_KEYS = tuple(TINY_SPECS)


def build_tiny_model(
    key: str,
    out_dir: str,
    *,
    dtype: str = "float32",
    seed: int = 0,
    max_shard_size: str | None = None,
    overrides: dict[str, Any] | None = None,
    fused: bool = False,
) -> str:
    """Build the tiny `key` model (seeded; config kwargs `overrides` on top of its spec), save it with
    `save_pretrained` into `out_dir`. `fused`: save transformers 5's own layout
    (`save_original_format=False`: MoE experts fused into `mlp.experts.gate_up_proj` / `down_proj`).

    Also writes a small tokenizer_config.json so folder copies can be checked. Returns out_dir.
    """
    import torch

    model = build_torch_model(key, seed=seed, overrides=overrides)
    model = model.to(getattr(torch, dtype))
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    if fused:
        kwargs["save_original_format"] = False
    model.save_pretrained(out_dir, **kwargs)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"model_max_length": 512, "tokenizer_class": "PreTrainedTokenizerFast", "fixture": key}, f)
    return out_dir


def build_torch_model(key: str, *, seed: int = 0, overrides: dict[str, Any] | None = None):
    """The tiny `key` model as a transformers fp32 `*ForCausalLM` in eval mode (eager attention)."""
    import torch
    import transformers

    config_class_name, kwargs = TINY_SPECS[key]
    config = getattr(transformers, config_class_name)(**dict(kwargs, **(overrides or {})))
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * noise)  # norms around one, visibly not one
            elif name.endswith(".bias"):
                param.copy_(0.5 * noise)
            else:
                param.copy_(0.08 * noise)
        if key in MOE_KEYS:
            _unreachable_last_expert(model)
    return model.eval()


def _unreachable_last_expert(model) -> None:
    """Router rows 1 = -row 0 and 3 = -row 2, last row 0: experts 0-3 always give two logits >= 0
    = the last expert's, so with top-2 routing the last expert never gets a token (and the tests see
    an expert with no tokens, as real calibration sets do)."""
    for name, param in model.named_parameters():
        if name.endswith(".gate.weight") and param.shape[0] == model.config.num_local_experts:
            param[1] = -param[0]
            param[3] = -param[2]
            param[-1] = 0.0


@pytest.fixture(scope="session")
def hf_tiny_models(tmp_path_factory) -> dict[str, str]:
    """key -> folder of the saved fp32 tiny model, for every family in TINY_SPECS."""
    root = tmp_path_factory.mktemp("hf_tiny")
    return {key: build_tiny_model(key, str(root / key)) for key in FAMILY_KEYS}
