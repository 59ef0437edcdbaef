"""Named model sizes for pretraining from scratch (Llama 3 shape: GQA, SwiGLU, RoPE 500k), and
tiny mixture-of-experts shapes of the two MoE families (Qwen3-MoE, Mixtral) for quick MoE runs."""

from __future__ import annotations

from nvfp4tool.config import ModelConfig
from nvfp4tool.errors import NVFP4ToolError

# name -> (family, hidden E, layers L, heads H, kv heads KV, head dim D, MLP / expert width F,
#          MoE fields); every width a multiple of 16 (NVFP4 blocks)
PRESETS = {
    "tiny": ("llama", 128, 4, 4, 2, 32, 384, {}),  # ~0.9M parameters + embeddings: minutes on a 2-core CPU
    "100m": ("llama", 768, 12, 12, 4, 64, 2048, {}),  # ~85M + embeddings: a GPU-sized pretraining run
    # Qwen3-MoE: 8 experts of width 64, top-2 renormalised (q/k norm as Qwen3)
    "tiny-moe": ("qwen3_moe", 128, 4, 4, 2, 32, 64, dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
        qk_norm=True, router_aux_loss_coef=0.001)),
    # Mixtral: 4 experts of width 128, top-2
    "tiny-mixtral": ("mixtral", 128, 4, 4, 2, 32, 128, dict(
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, router_aux_loss_coef=0.02)),
}


def preset_config(name: str, vocab_size: int, max_position_embeddings: int) -> ModelConfig:
    """The ModelConfig of a named size for a tokenizer of `vocab_size`."""
    if name not in PRESETS:
        raise NVFP4ToolError(f"unknown model size {name!r}; sizes: {', '.join(PRESETS)} (or pass an "
                             "HF folder or a MaxText checkpoint)")
    family, E, L, H, KV, D, F, moe = PRESETS[name]
    return ModelConfig(family=family, vocab_size=vocab_size, hidden_size=E, intermediate_size=F,
                       num_layers=L, num_heads=H, num_kv_heads=KV, head_dim=D, rms_norm_eps=1e-5,
                       rope_theta=500000.0, max_position_embeddings=max_position_embeddings,
                       tie_word_embeddings=False, dtype="bfloat16", **moe)
