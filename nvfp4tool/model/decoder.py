"""The block of the Llama and mixture-of-experts groups (Llama, Mistral, Qwen2/3, Qwen3-MoE,
Mixtral): one pre-norm decoder layer, attention + SwiGLU MLP ("attention+mlp") or + `SparseMoE`
("attention+moe"), registered for those families' layer kinds (`blocks.register_blocks`); its
decode state is its attention's keys and values [B, S, KV, D].
Design notes: docs/design/model.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from nvfp4tool.config import ModelConfig
from nvfp4tool.families import ATTENTION_MLP, ATTENTION_MOE, LayerAttention, llama, moe
from nvfp4tool.model.blocks import register_blocks
from nvfp4tool.model.layers import MLP, Attention, RMSNorm, SparseMoE
from nvfp4tool.model.linear import Seam, merged


class DecoderBlock(nnx.Module):
    """One pre-norm decoder layer (its MLP dense, or sparse when `sparse`)."""

    recurrent = False  # keys and values: a padded slot is masked, never summarised

    def __init__(
        self,
        config: ModelConfig,
        layer_name: str,
        *,
        sparse: bool = False,
        attention: LayerAttention,
        param_dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ) -> None:
        E = config.hidden_size
        self.input_layernorm = RMSNorm(E, eps=config.rms_norm_eps, param_dtype=param_dtype)
        self.self_attn = Attention(
            config, f"{layer_name}.self_attn", attention=attention, param_dtype=param_dtype, rngs=rngs
        )
        self.post_attention_layernorm = RMSNorm(E, eps=config.rms_norm_eps, param_dtype=param_dtype)
        mlp = (
            SparseMoE(config, f"{layer_name}.{config.family_spec.block}", param_dtype=param_dtype, rngs=rngs)
            if sparse
            else MLP(config, f"{layer_name}.mlp", param_dtype=param_dtype, rngs=rngs)
        )
        self.mlp_attr = config.family_spec.block if sparse else "mlp"  # HF's attribute: mlp / block_sparse_moe
        setattr(self, self.mlp_attr, mlp)

    def __call__(self, x_BxTxE, cos_BxTxD, sin_BxTxD, mask, cache_kv, write_index, seam: Seam):
        """(the block's output, its (k, v), its side results)."""
        attn_BxTxE, cached, attn_side = self.self_attn(
            self.input_layernorm(x_BxTxE), cos_BxTxD, sin_BxTxD, mask, cache_kv, write_index, seam
        )
        h_BxTxE = x_BxTxE + attn_BxTxE
        mlp_BxTxE, mlp_side = getattr(self, self.mlp_attr)(self.post_attention_layernorm(h_BxTxE), seam)
        return h_BxTxE + mlp_BxTxE, cached, merged(attn_side, mlp_side)

    def empty_state(self, batch: int, length: int, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
        """Its attention's `length` cache slots of zeros: (k, v) [B, S, KV, D] in `dtype`."""
        return self.self_attn.empty_state(batch, length, dtype)


_DENSE = functools.partial(DecoderBlock, sparse=False)
register_blocks(llama.FAMILIES, {ATTENTION_MLP: _DENSE})
register_blocks(moe.FAMILIES, {ATTENTION_MLP: _DENSE, ATTENTION_MOE: functools.partial(DecoderBlock, sparse=True)})
