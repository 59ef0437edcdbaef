"""The other mixers of the hybrid Nemotron-H family (reference sheet section 12), as Flax modules
with HF's attribute names; the Mamba-2 mixer is `model/mamba.py`.

`ReLU2MLP` (down(relu(up(x))^2), no gate), `HybridMoE` (FP32 grouped-sigmoid router, relu2 experts,
shared expert), `HybridBlock` (one `nemotron_h` layer, registered for the family's four layer kinds:
`blocks.register_blocks`; it builds its own decode state). Every linear goes through the linear seam.
Design notes: docs/design/model.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from nvfp4tool.config import ModelConfig
from nvfp4tool.families import ROUTER, LayerAttention, nemotron_h
from nvfp4tool.families.nemotron_h import (
    ACTIVATION,
    ATTENTION,
    KIND_NAMES,
    LATENT,
    MAMBA,
    MLP,
    MOE,
    RELU2,
    HybridFields,
)
from nvfp4tool.model.activations import activation
from nvfp4tool.model.blocks import register_blocks
from nvfp4tool.model.layers import Attention, Linear, RMSNorm, mix_experts, sigmoid_router
from nvfp4tool.model.linear import Seam, Side, merged
from nvfp4tool.model.mamba import Mamba2Mixer, MambaShape, MambaState


class ReLU2MLP(nnx.Module):
    """down(relu(up(x))^2): a `-` layer's mixer, each routed expert, the shared expert."""

    def __init__(
        self, dim: int, width: int, *, prefix: str, bias: bool, param_dtype: jnp.dtype, rngs: nnx.Rngs
    ) -> None:
        for p, (k, n) in zip(RELU2, ((dim, width), (width, dim))):  # up, down: HF's attributes
            setattr(
                self, p.attr, Linear(k, n, bias=bias, name=f"{prefix}.{p.attr}", param_dtype=param_dtype, rngs=rngs)
            )

    def __call__(self, x: jax.Array, seam: Seam) -> tuple[jax.Array, Side]:
        up, down = (getattr(self, p.attr) for p in RELU2)
        u, up_side = up(x, seam)
        y, down_side = down(activation(ACTIVATION)(u), seam)
        return y, merged(up_side, down_side)


class HybridMoE(nnx.Module):
    """An `E` layer's mixer (see the module docstring). `experts`: the family's HybridExperts."""

    def __init__(
        self, dim: int, experts, *, prefix: str, mlp_bias: bool, param_dtype: jnp.dtype, rngs: nnx.Rngs
    ) -> None:
        n, width = experts.n_routed_experts, experts.moe_latent_size or dim
        router = Linear(dim, n, bias=False, name=f"{prefix}.{ROUTER.attr}", param_dtype=jnp.float32, rngs=rngs)
        router.e_score_correction_bias = nnx.Param(jnp.zeros((n,), jnp.float32))
        setattr(self, ROUTER.attr, router)  # HF's attribute: `gate`
        self.experts = nnx.List(
            [
                ReLU2MLP(
                    width,
                    experts.moe_intermediate_size,
                    prefix=f"{prefix}.experts.{e}",
                    bias=False,
                    param_dtype=param_dtype,
                    rngs=rngs,
                )
                for e in range(n)
            ]
        )
        self.shared_experts = ReLU2MLP(
            dim,
            experts.moe_shared_expert_intermediate_size,
            prefix=f"{prefix}.shared_experts",
            bias=mlp_bias,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        latent = experts.moe_latent_size is not None
        for p, (k, n) in zip(LATENT, ((dim, width), (width, dim))):  # fc1 / fc2_latent_proj, or None
            setattr(
                self,
                p.attr,
                Linear(k, n, bias=mlp_bias, name=f"{prefix}.{p.attr}", param_dtype=param_dtype, rngs=rngs)
                if latent
                else None,
            )
        self.routing = experts

    def __call__(self, x_BxTxE: jax.Array, seam: Seam) -> tuple[jax.Array, Side]:
        """(the output, side results: every linear's records, the router's logits under its name)."""
        r = self.routing
        router = getattr(self, ROUTER.attr)
        fc1_latent, fc2_latent = (getattr(self, p.attr) for p in LATENT)
        weights_BxTxN, chosen_BxTxN, router_side = sigmoid_router(router, x_BxTxE, r, seam)
        sides = [router_side]
        h_BxTxL = x_BxTxE
        if fc1_latent is not None:
            h_BxTxL, side = fc1_latent(x_BxTxE, seam)
            sides.append(side)
        out_BxTxL, side = mix_experts(self.experts, h_BxTxL, weights_BxTxN, chosen_BxTxN, seam)
        sides.append(side)
        out = out_BxTxL.astype(x_BxTxE.dtype)
        if fc2_latent is not None:
            out, side = fc2_latent(out, seam)
            sides.append(side)
        shared, side = self.shared_experts(x_BxTxE, seam)
        return out + shared, merged(*sides, side)


def mamba_shape(config: ModelConfig) -> MambaShape:
    """The Mamba-2 mixer's sizes from a nemotron_h config (the gated norm's epsilon is the
    blocks' `layer_norm_epsilon`)."""
    f: HybridFields = config.family_config
    return MambaShape(
        heads=f.mamba_num_heads,
        head_dim=f.mamba_head_dim,
        groups=f.n_groups,
        state=f.ssm_state_size,
        conv_kernel=f.conv_kernel,
        chunk=f.chunk_size,
        dt_limit=f.time_step_limit,
        eps=config.rms_norm_eps,
    )


class HybridBlock(nnx.Module):
    """One single-mixer layer of a hybrid decoder: `norm` (RMSNorm, weight applied in fp32) ->
    `mixer` (a layer kind's: Mamba-2, attention without positional encoding, relu2 MLP, MoE) ->
    residual. The same call as `decoder.DecoderBlock` (`blocks.Block`); its decode state is the
    attention's (k, v), the Mamba mixer's `MambaState`, or None (MLP, MoE)."""

    def __init__(
        self,
        config: ModelConfig,
        layer_name: str,
        *,
        kind: str,
        attention: LayerAttention,
        param_dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ) -> None:
        E, prefix = config.hidden_size, f"{layer_name}.mixer"
        self.kind = kind
        self.recurrent = kind == MAMBA  # the SSM state summarises every position it saw, padding too
        self.norm = RMSNorm(E, eps=config.rms_norm_eps, param_dtype=param_dtype, scale_in_fp32=True)
        fields: HybridFields = config.family_config
        if kind == MAMBA:
            self.mixer = Mamba2Mixer(
                E,
                mamba_shape(config),
                prefix=prefix,
                use_bias=fields.use_bias,
                conv_bias=fields.use_conv_bias,
                param_dtype=param_dtype,
                rngs=rngs,
            )
        elif kind == ATTENTION:
            self.mixer = Attention(config, prefix, attention=attention, param_dtype=param_dtype, rngs=rngs)
        elif kind == MLP:
            self.mixer = ReLU2MLP(
                E, config.intermediate_size, prefix=prefix, bias=False, param_dtype=param_dtype, rngs=rngs
            )
        elif kind == MOE:
            self.mixer = HybridMoE(E, fields.experts, prefix=prefix, mlp_bias=False, param_dtype=param_dtype, rngs=rngs)
        else:
            raise ValueError(f"{layer_name}: {kind!r} is not a hybrid layer kind")

    def __call__(self, x_BxTxE, cos_BxTxD, sin_BxTxD, mask, cache, write_index, seam: Seam):
        """(the block's output, its decode state, its side results)."""
        h_BxTxE = self.norm(x_BxTxE)
        cached = None
        if self.kind == MAMBA:
            y_BxTxE, cached, side = self.mixer(
                h_BxTxE, seam, mask_BxT=mask.tokens_BxT, segments_BxT=mask.segments_BxT, state=cache
            )
        elif self.kind == ATTENTION:
            y_BxTxE, cached, side = self.mixer(h_BxTxE, cos_BxTxD, sin_BxTxD, mask, cache, write_index, seam)
        else:
            y_BxTxE, side = self.mixer(h_BxTxE, seam)
        return x_BxTxE + y_BxTxE.astype(x_BxTxE.dtype), cached, side

    def empty_state(self, batch: int, length: int, dtype: jnp.dtype) -> object:
        """Its decode state before a prefill: the attention's `length` KV slots of zeros in `dtype`,
        the Mamba mixer's zero conv window and SSM state (fp32, whatever the length), None (MLP, MoE)."""
        if self.kind == MAMBA:
            return MambaState.zeros(batch, self.mixer.shape)
        if self.kind == ATTENTION:
            return self.mixer.empty_state(batch, length, dtype)
        return None


register_blocks(nemotron_h.FAMILIES, {kind: functools.partial(HybridBlock, kind=kind) for kind in KIND_NAMES})
