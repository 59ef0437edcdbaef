"""Gemma 3's decoder block (`Gemma3DecoderLayer`), registered for `gemma3_text`'s layer kind.

    x -> input_layernorm -> attention -> post_attention_layernorm -> + x = h
    h -> pre_feedforward_layernorm -> GeGLU MLP -> post_feedforward_layernorm -> + h

Every norm is the family's (1 + w) RMSNorm in fp32 (`RMSNorm.of`), the attention's q/k norms too;
the window, RoPE and query_pre_attn_scalar^-0.5 scale are the layer's `LayerAttention` (local or
global). Its decode state is its attention's keys and values [B, S, KV, D].
Design notes: docs/design/model.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from nvfp4tool.config import ModelConfig
from nvfp4tool.families import ATTENTION_MLP, LayerAttention, gemma3
from nvfp4tool.model.blocks import register_blocks
from nvfp4tool.model.layers import MLP, Attention, RMSNorm
from nvfp4tool.model.linear import Seam, merged


class Gemma3Block(nnx.Module):
    """One Gemma 3 decoder layer, local or global as its `attention` says."""

    recurrent = False  # keys and values: a padded slot is masked, never summarised

    def __init__(
        self, config: ModelConfig, layer_name: str, *, attention: LayerAttention, param_dtype: jnp.dtype, rngs: nnx.Rngs
    ) -> None:
        E = config.hidden_size
        self.input_layernorm = RMSNorm.of(config, E, param_dtype=param_dtype)
        self.self_attn = Attention(
            config, f"{layer_name}.self_attn", attention=attention, param_dtype=param_dtype, rngs=rngs
        )
        self.post_attention_layernorm = RMSNorm.of(config, E, param_dtype=param_dtype)
        self.pre_feedforward_layernorm = RMSNorm.of(config, E, param_dtype=param_dtype)
        self.mlp = MLP(config, f"{layer_name}.mlp", param_dtype=param_dtype, rngs=rngs)
        self.post_feedforward_layernorm = RMSNorm.of(config, E, param_dtype=param_dtype)

    def __call__(self, x_BxTxE, cos_BxTxD, sin_BxTxD, mask, cache_kv, write_index, seam: Seam):
        """(the block's output, its (k, v), its side results)."""
        attn_BxTxE, cached, attn_side = self.self_attn(
            self.input_layernorm(x_BxTxE), cos_BxTxD, sin_BxTxD, mask, cache_kv, write_index, seam
        )
        h_BxTxE = x_BxTxE + self.post_attention_layernorm(attn_BxTxE)
        mlp_BxTxE, mlp_side = self.mlp(self.pre_feedforward_layernorm(h_BxTxE), seam)
        return h_BxTxE + self.post_feedforward_layernorm(mlp_BxTxE), cached, merged(attn_side, mlp_side)

    def empty_state(self, batch: int, length: int, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
        """Its attention's `length` cache slots of zeros: (k, v) [B, S, KV, D] in `dtype`."""
        return self.self_attn.empty_state(batch, length, dtype)


register_blocks(gemma3.FAMILIES, {ATTENTION_MLP: Gemma3Block})
