"""The DeepSeek-V3 blocks (`families/deepseek_v3.py`), registered for its two layer kinds:
`MLAttention` (multi-head latent attention), `DeepSeekMoE` (sigmoid-routed experts and a shared
expert) and `MLABlock` (one pre-norm layer). Every linear goes through the linear seam.

The decode state is what vLLM's MLA caches: the normed latent [B, S, kv_lora_rank] and the rotated
shared key k_pe [B, S, qk_rope_head_dim]; each call expands keys and values from it through
kv_b_proj, so decoding from the latent computes what recomputation does.
Design notes: docs/design/model.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from nvfp4tool.config import ModelConfig
from nvfp4tool.families import ROUTER, LayerAttention, deepseek_v3
from nvfp4tool.families.base import O_PROJ, Q
from nvfp4tool.families.deepseek_v3 import KV_A, KV_B, MLA_MLP, MLA_MOE, NORM_EPS, Q_A, Q_B, SHARED, MLAFields
from nvfp4tool.model.attention import AttentionMask, attend
from nvfp4tool.model.blocks import register_blocks
from nvfp4tool.model.layers import MLP, Linear, RMSNorm, mix_experts, sigmoid_router
from nvfp4tool.model.linear import Seam, Side, merged
from nvfp4tool.model.rope import apply_rope


def _linear(k: int, n: int, prefix: str, p, *, param_dtype, rngs) -> Linear:
    return Linear(k, n, bias=False, name=f"{prefix}.{p.attr}", param_dtype=param_dtype, rngs=rngs)


def deinterleave(x: jax.Array) -> jax.Array:
    """DeepSeek's interleaved RoPE pairs (x0, x1), (x2, x3), ... laid out half-split (evens, then
    odds), as transformers' `apply_rotary_pos_emb_interleave` returns them."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


class MLAttention(nnx.Module):
    """Multi-head latent attention: queries from q_proj (or q_a_proj -> q_a_layernorm ->
    q_b_proj), the latent and the shared rotated key from kv_a_proj_with_mqa (the latent through
    kv_a_layernorm), keys' nope part and values from kv_b_proj, o_proj."""

    def __init__(
        self, config: ModelConfig, prefix: str, *, attention: LayerAttention, param_dtype: jnp.dtype, rngs: nnx.Rngs
    ) -> None:
        f: MLAFields = config.family_config
        E, H = config.hidden_size, config.num_heads
        self.softmax_scale = attention.softmax_scale  # 1/sqrt(qk_head_dim), times YaRN's mscale^2
        make = functools.partial(_linear, prefix=prefix, param_dtype=param_dtype, rngs=rngs)
        if f.q_lora_rank is None:
            self.q_proj = make(E, H * f.qk_head_dim, p=Q)
        else:
            self.q_a_proj = make(E, f.q_lora_rank, p=Q_A)
            self.q_a_layernorm = RMSNorm(f.q_lora_rank, eps=NORM_EPS, param_dtype=param_dtype)
            self.q_b_proj = make(f.q_lora_rank, H * f.qk_head_dim, p=Q_B)
        self.kv_a_proj_with_mqa = make(E, f.kv_lora_rank + f.qk_rope_head_dim, p=KV_A)
        self.kv_a_layernorm = RMSNorm(f.kv_lora_rank, eps=NORM_EPS, param_dtype=param_dtype)
        self.kv_b_proj = make(f.kv_lora_rank, H * (f.qk_nope_head_dim + f.v_head_dim), p=KV_B)
        self.o_proj = make(H * f.v_head_dim, E, p=O_PROJ)
        self.fields, self.num_heads = f, H

    def __call__(self, x_BxTxE, cos_BxTxD, sin_BxTxD, mask: AttentionMask, state, write_index, seam: Seam):
        """(y_BxTxE, the decode state (latent, k_pe) with this chunk written, or this chunk's, side)."""
        f, H = self.fields, self.num_heads
        B, T, _ = x_BxTxE.shape
        sides = []
        if f.q_lora_rank is None:
            q, side = self.q_proj(x_BxTxE, seam)
            sides.append(side)
        else:
            q_a, side_a = self.q_a_proj(x_BxTxE, seam)
            q, side_b = self.q_b_proj(self.q_a_layernorm(q_a), seam)
            sides += [side_a, side_b]
        q_BxTxHxQ = q.reshape(B, T, H, f.qk_head_dim)
        q_nope, q_pe = q_BxTxHxQ[..., : f.qk_nope_head_dim], q_BxTxHxQ[..., f.qk_nope_head_dim :]
        ckv, side = self.kv_a_proj_with_mqa(x_BxTxE, seam)
        sides.append(side)
        latent_BxTxR = self.kv_a_layernorm(ckv[..., : f.kv_lora_rank])
        k_pe_BxTx1xP = ckv[..., f.kv_lora_rank :][:, :, None, :]
        if f.rope_interleave:
            q_pe, k_pe_BxTx1xP = deinterleave(q_pe), deinterleave(k_pe_BxTx1xP)
        q_pe, k_pe_BxTx1xP = apply_rope(q_pe, cos_BxTxD, sin_BxTxD), apply_rope(k_pe_BxTx1xP, cos_BxTxD, sin_BxTxD)
        k_pe_BxTxP = k_pe_BxTx1xP[:, :, 0, :]
        if state is None:
            latent_BxSxR, k_pe_BxSxP = latent_BxTxR, k_pe_BxTxP
        else:
            latent_BxSxR = jax.lax.dynamic_update_slice(
                state[0], latent_BxTxR.astype(state[0].dtype), (0, write_index, 0)
            )
            k_pe_BxSxP = jax.lax.dynamic_update_slice(state[1], k_pe_BxTxP.astype(state[1].dtype), (0, write_index, 0))
        kv, side = self.kv_b_proj(latent_BxSxR.astype(x_BxTxE.dtype), seam)
        sides.append(side)
        S = kv.shape[1]
        kv_BxSxHxW = kv.reshape(B, S, H, f.qk_nope_head_dim + f.v_head_dim)
        k_nope, v_BxSxHxV = kv_BxSxHxW[..., : f.qk_nope_head_dim], kv_BxSxHxW[..., f.qk_nope_head_dim :]
        k_pe_BxSxHxP = jnp.broadcast_to(k_pe_BxSxP.astype(x_BxTxE.dtype)[:, :, None, :], (B, S, H, f.qk_rope_head_dim))
        k_BxSxHxQ = jnp.concatenate([k_nope, k_pe_BxSxHxP], axis=-1)
        q_BxTxHxQ = jnp.concatenate([q_nope, q_pe], axis=-1)
        # the values padded with zeros to the query width (one head width for the kernel, as vLLM
        # pads them); the padding adds exact zeros and is cut off after
        v_BxSxHxQ = jnp.pad(v_BxSxHxV, ((0, 0), (0, 0), (0, 0), (0, f.qk_head_dim - f.v_head_dim)))
        out = attend(q_BxTxHxQ, k_BxSxHxQ, v_BxSxHxQ, mask, self.softmax_scale)[..., : f.v_head_dim]
        y, side = self.o_proj(out.reshape(B, T, H * f.v_head_dim), seam)
        sides.append(side)
        return y, (latent_BxSxR, k_pe_BxSxP), merged(*sides)

    def empty_state(self, batch: int, length: int, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
        """`length` slots of zeros: (latent [B, S, kv_lora_rank], k_pe [B, S, qk_rope_head_dim])."""
        f = self.fields
        return jnp.zeros((batch, length, f.kv_lora_rank), dtype), jnp.zeros((batch, length, f.qk_rope_head_dim), dtype)


class DeepSeekMoE(nnx.Module):
    """The router (`gate`, FP32, with its FP32 `e_score_correction_bias`) picks each token's experts
    (`layers.route_grouped_sigmoid`), the routed SwiGLU experts' weighted sum (`layers.mix_experts`)
    plus the shared experts' MLP of every token."""

    def __init__(self, config: ModelConfig, prefix: str, *, param_dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        f: MLAFields = config.family_config
        n, E = f.n_routed_experts, config.hidden_size
        router = Linear(E, n, bias=False, name=f"{prefix}.{ROUTER.attr}", param_dtype=jnp.float32, rngs=rngs)
        router.e_score_correction_bias = nnx.Param(jnp.zeros((n,), jnp.float32))
        setattr(self, ROUTER.attr, router)  # HF's attribute: `gate`
        width = f.moe_intermediate_size
        self.experts = nnx.List(
            [MLP(config, f"{prefix}.experts.{e}", width=width, param_dtype=param_dtype, rngs=rngs) for e in range(n)]
        )
        shared = MLP(config, f"{prefix}.{SHARED}", width=width * f.n_shared_experts, param_dtype=param_dtype, rngs=rngs)
        setattr(self, SHARED, shared)
        self.routing = f

    def __call__(self, x_BxTxE: jax.Array, seam: Seam) -> tuple[jax.Array, Side]:
        r = self.routing
        router = getattr(self, ROUTER.attr)
        weights_BxTxN, chosen_BxTxN, router_side = sigmoid_router(router, x_BxTxE, r, seam)
        routed_BxTxE, experts_side = mix_experts(self.experts, x_BxTxE, weights_BxTxN, chosen_BxTxN, seam)
        shared_BxTxE, shared_side = getattr(self, SHARED)(x_BxTxE, seam)
        out = routed_BxTxE.astype(x_BxTxE.dtype) + shared_BxTxE
        return out, merged(router_side, experts_side, shared_side)


class MLABlock(nnx.Module):
    """One DeepSeek-V3 layer: input_layernorm -> self_attn (MLA) -> residual ->
    post_attention_layernorm -> mlp (dense SwiGLU or `DeepSeekMoE`) -> residual."""

    recurrent = False  # a latent cache: padded slots are masked, never summarised

    def __init__(
        self,
        config: ModelConfig,
        layer_name: str,
        *,
        sparse: bool,
        attention: LayerAttention,
        param_dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ) -> None:
        E = config.hidden_size
        self.input_layernorm = RMSNorm(E, eps=config.rms_norm_eps, param_dtype=param_dtype)
        self.self_attn = MLAttention(
            config, f"{layer_name}.self_attn", attention=attention, param_dtype=param_dtype, rngs=rngs
        )
        self.post_attention_layernorm = RMSNorm(E, eps=config.rms_norm_eps, param_dtype=param_dtype)
        mlp = DeepSeekMoE if sparse else MLP
        self.mlp = mlp(config, f"{layer_name}.mlp", param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x_BxTxE, cos_BxTxD, sin_BxTxD, mask, state, write_index, seam: Seam):
        """(the block's output, its decode state, its side results)."""
        attn_BxTxE, state, attn_side = self.self_attn(
            self.input_layernorm(x_BxTxE), cos_BxTxD, sin_BxTxD, mask, state, write_index, seam
        )
        h_BxTxE = x_BxTxE + attn_BxTxE
        mlp_BxTxE, mlp_side = self.mlp(self.post_attention_layernorm(h_BxTxE), seam)
        return h_BxTxE + mlp_BxTxE, state, merged(attn_side, mlp_side)

    def empty_state(self, batch: int, length: int, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
        """Its attention's latent decode state (`MLAttention.empty_state`)."""
        return self.self_attn.empty_state(batch, length, dtype)


register_blocks(
    deepseek_v3.FAMILIES,
    {
        MLA_MLP: functools.partial(MLABlock, sparse=False),
        MLA_MOE: functools.partial(MLABlock, sparse=True),
    },
)
