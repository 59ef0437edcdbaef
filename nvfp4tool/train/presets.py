"""Named model sizes for pretraining from scratch (Llama 3 shape: GQA, SwiGLU, RoPE 500k without
Llama 3.1's long-context scaling; `1b` has Llama-3.2-1B's dimensions and tied embeddings; the MoE
sizes swap each MLP for 8 SwiGLU experts with top-2 routing: Qwen3-MoE or Mixtral; the hybrid
sizes are Nemotron-H's single-mixer stacks at `tiny`'s width: Mamba-2, attention without RoPE and
relu2 MLPs, `tiny-hybrid-moe` with MoE layers of 8 relu2 experts, top-2 of the sigmoid router, and
a shared expert)."""

from __future__ import annotations

from nvfp4tool.config import ModelConfig
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.families.moe import Experts
from nvfp4tool.families.nemotron_h import HybridExperts, HybridFields, layer_kinds

# name -> (hidden E, layers L, heads H, kv heads KV, head dim D, MLP width F); all multiples of 16
_SHAPES = {
    "tiny": (128, 4, 4, 2, 32, 384),  # ~0.9M parameters + embeddings: minutes on a 2-core CPU
    "small": (384, 6, 6, 2, 64, 1024),  # ~9.4M + embeddings: the accuracy study's model on a CPU
    "100m": (768, 12, 12, 4, 64, 2048),  # ~85M + embeddings: a GPU-sized pretraining run
    "1b": (2048, 16, 32, 8, 64, 8192),  # Llama-3.2-1B: 973M + embeddings (263M at its 128256 tokens)
}
_TIED = {"1b"}  # embeddings tied to the LM head, as Llama-3.2-1B
# MoE sizes: name -> (shape, ModelConfig fields); experts 96 wide (F: mixtral's experts use it)
_TINY_EXPERTS = dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, router_aux_loss_coef=0.001)
_MOE = {
    "tiny-moe": (
        "tiny",
        dict(family="qwen3_moe", qk_norm=True, family_config=Experts(**_TINY_EXPERTS, moe_intermediate_size=96)),
    ),
    "tiny-mixtral": ("tiny", dict(family="mixtral", intermediate_size=96, family_config=Experts(**_TINY_EXPERTS))),
}
# hybrid sizes: name -> hybrid_override_pattern, experts (16 Mamba heads of 8, one group of state 16:
# in_proj 2 x 128 + 2 x 16 + 16 = 304 rows, a multiple of the 16 x 16 weight blocks)
_HYBRID_EXPERTS = HybridExperts(
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=96,
    n_shared_experts=1,
    moe_shared_expert_intermediate_size=96,
    moe_latent_size=None,
    routed_scaling_factor=1.0,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
)
_HYBRID = {"tiny-hybrid": ("M-M-M*-M", None), "tiny-hybrid-moe": ("ME-M*EME", _HYBRID_EXPERTS)}
PRESETS = (*_SHAPES, *_MOE, *_HYBRID)


def preset_config(name: str, vocab_size: int, max_position_embeddings: int) -> ModelConfig:
    """The ModelConfig of a named size for a tokenizer of `vocab_size`."""
    if name not in PRESETS:
        raise NVFP4ToolError(
            f"unknown model size {name!r}; sizes: {', '.join(PRESETS)} (or pass an HF folder or a MaxText checkpoint)"
        )
    if name in _HYBRID:
        return _hybrid_config(name, vocab_size, max_position_embeddings)
    shape, fields = _MOE.get(name, (name, {}))
    E, L, H, KV, D, F = _SHAPES[shape]
    llama = dict(
        family="llama",
        vocab_size=vocab_size,
        hidden_size=E,
        intermediate_size=F,
        num_layers=L,
        num_heads=H,
        num_kv_heads=KV,
        head_dim=D,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=name in _TIED,
        dtype="bfloat16",
    )
    return ModelConfig(**dict(llama, **fields))


def _hybrid_config(name: str, vocab_size: int, max_position_embeddings: int) -> ModelConfig:
    pattern, experts = _HYBRID[name]
    kinds, _ = layer_kinds({"hybrid_override_pattern": pattern})
    E, _, H, KV, D, F = _SHAPES["tiny"]
    fields = HybridFields(
        layer_kinds=kinds,
        mamba_num_heads=16,
        mamba_head_dim=8,
        n_groups=1,
        ssm_state_size=16,
        conv_kernel=4,
        chunk_size=64,
        time_step_limit=(0.0, float("inf")),
        use_conv_bias=True,
        use_bias=False,
        experts=experts,
        hf_layers={"hybrid_override_pattern": pattern},
    )
    return ModelConfig(
        family="nemotron_h",
        vocab_size=vocab_size,
        hidden_size=E,
        intermediate_size=F,
        num_layers=len(kinds),
        num_heads=H,
        num_kv_heads=KV,
        head_dim=D,
        rms_norm_eps=1e-5,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        dtype="bfloat16",
        family_config=fields,
    )
