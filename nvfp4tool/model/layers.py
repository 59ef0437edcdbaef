"""The layers the decoders are built of, in Flax NNX with HF's attribute names: `Linear` (every
projection through the linear seam, `linear.py`), `RMSNorm` (its family's form: `RMSNorm.of`),
`Embedding` (its family's output scale), GQA `Attention` (window, RoPE and softmax scale: its
layer's `LayerAttention`; no RoPE for a family without positional encoding), the gated `MLP`, the
routers (`route`: softmax top-k; `route_grouped_sigmoid`: sigmoid scores with a correction bias,
grouped top-k), the experts' weighted sum (`mix_experts`) and the sparse `SparseMoE`.

Each family's blocks module (`Family.blocks_module`: `decoder.py` for the Llama and MoE groups)
builds its blocks of them, with its own mixers where it has some; `transformer.py` assembles the
blocks into the whole `CausalLM`. Linears are named from the families' `Projection`s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nvfp4tool.config import ModelConfig
from nvfp4tool.families import ATTENTION_PROJECTIONS, ROUTER, SWIGLU, LayerAttention
from nvfp4tool.model.activations import activation
from nvfp4tool.model.attention import AttentionMask, attend
from nvfp4tool.model.linear import Seam, Side, merged
from nvfp4tool.model.remat import linear_output
from nvfp4tool.model.rope import apply_rope
from nvfp4tool.numerics import computed_after

_INIT_STD = 0.02  # random init (training from scratch): normal(0, 0.02) weights, zero bias, unit norms


class Linear(nnx.Module):
    """Weight [out, in] (HF orientation), optional bias; calls the linear seam with its HF name."""

    def __init__(
        self, in_features: int, out_features: int, *, bias: bool, name: str, param_dtype: jnp.dtype, rngs: nnx.Rngs
    ) -> None:
        self.weight = nnx.Param(_INIT_STD * jax.random.normal(rngs.params(), (out_features, in_features), param_dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype)) if bias else None
        self.name = name

    def __call__(self, x: jax.Array, seam: Seam) -> tuple[jax.Array, Side]:
        bias = None if self.bias is None else self.bias[...]
        # get_value(): the weight may be an array or a stored (quantized) pytree the seam decodes
        y, side = seam.project(x, self.weight.get_value(), bias, self.name)
        return linear_output(y), side


class RMSNorm(nnx.Module):
    """x / sqrt(mean(x^2) + eps) * weight, normalised in fp32, scaled in the input dtype (as HF's
    Llama), or with `scale_in_fp32` the weight multiplied in fp32 and only the product cast
    (Nemotron-H's NemotronHRMSNorm), or with `unit_offset` by (1 + weight) in fp32, the weight
    starting at zero (Gemma3RMSNorm). `RMSNorm.of(config, dim)`: its family's form."""

    def __init__(
        self, dim: int, *, eps: float, param_dtype: jnp.dtype, scale_in_fp32: bool = False, unit_offset: bool = False
    ) -> None:
        self.weight = nnx.Param((jnp.zeros if unit_offset else jnp.ones)((dim,), param_dtype))
        self.eps = eps
        self.scale_in_fp32 = scale_in_fp32
        self.unit_offset = unit_offset

    @classmethod
    def of(cls, config: ModelConfig, dim: int, *, param_dtype: jnp.dtype) -> RMSNorm:
        """A norm over `dim` channels in the form `config`'s family declares (`Family.norm_scale_in_fp32`,
        `Family.norm_unit_offset`)."""
        family = config.family_spec
        return cls(
            dim,
            eps=config.rms_norm_eps,
            param_dtype=param_dtype,
            scale_in_fp32=family.norm_scale_in_fp32,
            unit_offset=family.norm_unit_offset,
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.unit_offset:
            return (normed * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        if self.scale_in_fp32:
            return (self.weight[...].astype(jnp.float32) * normed).astype(x.dtype)
        return (self.weight[...].astype(x.dtype) * normed.astype(x.dtype)).astype(x.dtype)


class Embedding(nnx.Module):
    """Token embedding table [V, E] (HF `model.embed_tokens.weight`); its rows multiplied by
    `scale` rounded to the table's dtype when given (Gemma3TextScaledWordEmbedding)."""

    def __init__(
        self, vocab_size: int, dim: int, *, param_dtype: jnp.dtype, rngs: nnx.Rngs, scale: float | None = None
    ) -> None:
        self.weight = nnx.Param(_INIT_STD * jax.random.normal(rngs.params(), (vocab_size, dim), param_dtype))
        self.scale = scale

    def __call__(self, ids_BxT: jax.Array) -> jax.Array:
        table_VxE = self.weight[...]
        if table_VxE.dtype == jnp.float32:  # training's parameters
            rows = jnp.take(table_VxE, ids_BxT, axis=0)
        else:
            # A table held as stored (BF16): XLA:CPU gathers from it through an fp32 copy of the whole
            # table, which generation's decode loop hoisted out of the loop and held (262 MB for 32000 x
            # 2048, 2.1 GB for 128256 x 4096); looked up once the ids exist, the copy stays inside the gather.
            rows = computed_after(ids_BxT, lambda table: jnp.take(table, ids_BxT, axis=0), table_VxE)
        if self.scale is None:
            return rows
        return rows * jnp.asarray(np.float32(self.scale)).astype(rows.dtype)  # as HF: an fp32 scalar cast


class Attention(nnx.Module):
    """GQA self-attention: q/k/v projections, optional q/k norm (its family's form), RoPE (none
    when its layer has no base), masked softmax within its layer's sliding window at its layer's
    scale (`attention`: the family's `layer_attention(config, layer)`), o_proj."""

    def __init__(
        self, config: ModelConfig, prefix: str, *, attention: LayerAttention, param_dtype: jnp.dtype, rngs: nnx.Rngs
    ) -> None:
        E, D = config.hidden_size, config.head_dim
        H, KV = config.num_heads, config.num_kv_heads

        shapes = ((E, H * D), (E, KV * D), (E, KV * D), (H * D, E))
        biases = (config.attention_bias,) * 3 + (config.o_proj_bias,)
        for p, (k, n), bias in zip(ATTENTION_PROJECTIONS, shapes, biases):  # q, k, v, o: HF's attributes
            setattr(
                self, p.attr, Linear(k, n, bias=bias, name=f"{prefix}.{p.attr}", param_dtype=param_dtype, rngs=rngs)
            )
        self.q_norm = RMSNorm.of(config, D, param_dtype=param_dtype) if config.qk_norm else None
        self.k_norm = RMSNorm.of(config, D, param_dtype=param_dtype) if config.qk_norm else None
        self.num_heads, self.num_kv_heads, self.head_dim = H, KV, D
        self.name = prefix  # the KV seam's name of this layer
        self.rope = attention.rope_theta is not None
        self.window = attention.window
        self.scale = attention.softmax_scale  # None: head_dim ** -0.5

    def __call__(
        self,
        x_BxTxE: jax.Array,
        cos_BxTxD: jax.Array,
        sin_BxTxD: jax.Array,
        mask: AttentionMask,
        cache_kv: tuple[jax.Array, jax.Array] | None,
        write_index: jax.Array | int,
        seam: Seam,
    ):
        """Returns (y_BxTxE, (k, v), side): k/v the updated cache [B, S, KV, D] (or this chunk's,
        no cache)."""
        B, T, _ = x_BxTxE.shape
        H, KV, D = self.num_heads, self.num_kv_heads, self.head_dim
        q_proj, k_proj, v_proj, o_proj = (getattr(self, p.attr) for p in ATTENTION_PROJECTIONS)
        q, q_side = q_proj(x_BxTxE, seam)
        k, k_side = k_proj(x_BxTxE, seam)
        v, v_side = v_proj(x_BxTxE, seam)
        q_BxTxHxD, k_BxTxKVxD, v_BxTxKVxD = q.reshape(B, T, H, D), k.reshape(B, T, KV, D), v.reshape(B, T, KV, D)
        if self.q_norm is not None:
            q_BxTxHxD, k_BxTxKVxD = self.q_norm(q_BxTxHxD), self.k_norm(k_BxTxKVxD)
        if self.rope:
            q_BxTxHxD = apply_rope(q_BxTxHxD, cos_BxTxD, sin_BxTxD)
            k_BxTxKVxD = apply_rope(k_BxTxKVxD, cos_BxTxD, sin_BxTxD)
        (k_BxTxKVxD, v_BxTxKVxD), kv_side = seam.cache(k_BxTxKVxD, v_BxTxKVxD, self.name)
        if cache_kv is None:
            k_BxSxKVxD, v_BxSxKVxD = k_BxTxKVxD, v_BxTxKVxD
        else:
            start = (0, write_index, 0, 0)
            k_BxSxKVxD = jax.lax.dynamic_update_slice(cache_kv[0], k_BxTxKVxD.astype(cache_kv[0].dtype), start)
            v_BxSxKVxD = jax.lax.dynamic_update_slice(cache_kv[1], v_BxTxKVxD.astype(cache_kv[1].dtype), start)
        out_BxTxHxD = attend(
            q_BxTxHxD,
            k_BxSxKVxD.astype(x_BxTxE.dtype),
            v_BxSxKVxD.astype(x_BxTxE.dtype),
            mask.within(self.window),  # its layer's sliding window
            scale=self.scale,
        )
        y_BxTxE, o_side = o_proj(out_BxTxHxD.reshape(B, T, H * D), seam)
        return y_BxTxE, (k_BxSxKVxD, v_BxSxKVxD), merged(q_side, k_side, v_side, kv_side, o_side)

    def empty_state(self, batch: int, length: int, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
        """Its KV cache before a prefill: `length` slots of zeros, (k, v) [B, S, KV, D] in `dtype`."""
        shape = (batch, length, self.num_kv_heads, self.head_dim)
        return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


class MLP(nnx.Module):
    """A gated MLP, down(act(gate(x)) * up(x)) with its family's activation (`Family.activation`:
    SwiGLU for silu, GeGLU for gelu_pytorch_tanh); projections named as the families' `SWIGLU`
    (gate_proj/up_proj/down_proj: a dense MLP, a Qwen3-MoE expert) or `names` (a family's expert
    projections: Mixtral's w1/w3/w2)."""

    def __init__(
        self,
        config: ModelConfig,
        prefix: str,
        *,
        width: int | None = None,
        names: tuple[str, ...] = tuple(p.attr for p in SWIGLU),
        param_dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ) -> None:
        E, F = config.hidden_size, width or config.intermediate_size
        self.names = names
        self.activation = config.family_spec.activation  # its name (`model.activations`)
        for attr, k, n in zip(names, (E, E, F), (F, F, E)):
            setattr(self, attr, Linear(k, n, bias=False, name=f"{prefix}.{attr}", param_dtype=param_dtype, rngs=rngs))

    def __call__(self, x_BxTxE: jax.Array, seam: Seam) -> tuple[jax.Array, Side]:
        gate, up, down = (getattr(self, attr) for attr in self.names)
        g_BxTxF, gate_side = gate(x_BxTxE, seam)
        u_BxTxF, up_side = up(x_BxTxE, seam)
        y_BxTxE, down_side = down(activation(self.activation)(g_BxTxF) * u_BxTxF, seam)
        return y_BxTxE, merged(gate_side, up_side, down_side)


def route(
    router_logits_BxTxN: jax.Array, k: int, normalize: bool, weights_dtype: jnp.dtype = jnp.float32
) -> tuple[jax.Array, jax.Array]:
    """Top-k routing as transformers' Qwen3-MoE / Mixtral: softmax over the experts in fp32, the k
    largest probabilities, renormalised to sum to 1 when `normalize`, rounded to `weights_dtype`
    (Qwen3-MoE: the logits' dtype; Mixtral keeps fp32).

    Returns (weights_BxTxN: each expert's weight per token, 0 where not chosen; chosen_BxTxN: bool).
    """
    probs_BxTxN = jax.nn.softmax(router_logits_BxTxN.astype(jnp.float32), axis=-1)
    top_BxTxK, index_BxTxK = jax.lax.top_k(probs_BxTxN, k)
    if normalize:
        top_BxTxK = top_BxTxK / jnp.sum(top_BxTxK, axis=-1, keepdims=True)
    chosen_BxTxKxN = index_BxTxK[..., None] == jnp.arange(probs_BxTxN.shape[-1])
    top_BxTxK = top_BxTxK.astype(weights_dtype)
    weights_BxTxN = jnp.sum(jnp.where(chosen_BxTxKxN, top_BxTxK[..., None], 0), axis=-2)  # one term per expert
    return weights_BxTxN, jnp.any(chosen_BxTxKxN, axis=-2)


def route_grouped_sigmoid(
    router_logits_BxTxN: jax.Array,
    k: int,
    *,
    correction_bias_N: jax.Array,
    n_group: int,
    topk_group: int,
    normalize: bool,
    scaling: float,
) -> tuple[jax.Array, jax.Array]:
    """Top-k routing as Nemotron-H / DeepSeek-V3 (transformers' `NemotronHTopkRouter`): sigmoid
    scores in fp32; the correction bias is added only to choose: the experts split into `n_group`
    groups, each group scored by the sum of its two best biased scores, the `topk_group` best
    groups kept, then the k best biased scores among their experts; the weights are the chosen
    experts' unbiased scores, renormalised (`normalize`, + 1e-20 as the reference) and times
    `scaling` (`routed_scaling_factor`). The same return as `route` (fp32 weights); the router of
    the `nemotron_h` family's MoE layers (`hybrid.HybridMoE`)."""
    scores_BxTxN = jax.nn.sigmoid(router_logits_BxTxN.astype(jnp.float32))
    n = scores_BxTxN.shape[-1]
    biased_BxTxN = scores_BxTxN + correction_bias_N.astype(jnp.float32)
    if n_group > 1:
        grouped_BxTxGxM = biased_BxTxN.reshape(*biased_BxTxN.shape[:-1], n_group, n // n_group)
        group_score_BxTxG = jnp.sum(jax.lax.top_k(grouped_BxTxGxM, 2)[0], axis=-1)
        kept_BxTxG = jnp.any(jax.lax.top_k(group_score_BxTxG, topk_group)[1][..., None] == jnp.arange(n_group), axis=-2)
        biased_BxTxN = jnp.where(jnp.repeat(kept_BxTxG, n // n_group, axis=-1), biased_BxTxN, -jnp.inf)
    index_BxTxK = jax.lax.top_k(biased_BxTxN, k)[1]
    chosen_BxTxKxN = index_BxTxK[..., None] == jnp.arange(n)
    top_BxTxK = jnp.take_along_axis(scores_BxTxN, index_BxTxK, axis=-1)
    if normalize:
        top_BxTxK = top_BxTxK / (jnp.sum(top_BxTxK, axis=-1, keepdims=True) + 1e-20)
    top_BxTxK = top_BxTxK * scaling
    weights_BxTxN = jnp.sum(jnp.where(chosen_BxTxKxN, top_BxTxK[..., None], 0), axis=-2)
    return weights_BxTxN, jnp.any(chosen_BxTxKxN, axis=-2)


def sigmoid_router(router, x_BxTxE: jax.Array, routing, seam: Seam) -> tuple[jax.Array, jax.Array, Side]:
    """A grouped-sigmoid router (Nemotron-H's and DeepSeek-V3's `gate` with its
    `e_score_correction_bias`) run in fp32 on `x`, routed by `route_grouped_sigmoid` with the
    family's `routing` record (num_experts_per_tok, n_group, topk_group, norm_topk_prob,
    routed_scaling_factor): (weights, chosen, the router's side results with its logits)."""
    logits_BxTxN, router_side = router(x_BxTxE.astype(jnp.float32), seam)
    weights_BxTxN, chosen_BxTxN = route_grouped_sigmoid(
        logits_BxTxN,
        routing.num_experts_per_tok,
        correction_bias_N=router.e_score_correction_bias[...],
        n_group=routing.n_group,
        topk_group=routing.topk_group,
        normalize=routing.norm_topk_prob,
        scaling=routing.routed_scaling_factor,
    )
    return weights_BxTxN, chosen_BxTxN, merged(router_side, Side({}, {router.name: logits_BxTxN}))


class SparseMoE(nnx.Module):
    """A sparse MLP: the router (`gate`, [num_experts, E], kept in high precision by every recipe)
    scores each token, `route` picks its top-k experts, and the output is the routing-weighted sum
    of those experts' SwiGLU outputs.

    Experts compute densely: every expert runs on the layer's [B, T] tokens with the rows of tokens
    not routed to it zeroed. Each expert is its own pair of GEMMs through the linear seam under its
    own name (so per-expert scales, precision by pattern and calibration work as for any linear),
    and the forward numbers equal a sorted/ragged dispatch: NVFP4 and FP8 quantize rows independently
    and a zero row does not change a tensor's amax (in NVFP4 training, the weight gradient's 16-token
    Hadamard groups and stochastic rounding run over the zero rows too: same distribution, other
    bits than a compacted dispatch). It costs num_experts / k times the routed FLOPs, which
    the CPU sizes we validate afford; a ragged dispatch (`jax.lax.ragged_dot`) is the GPU speed
    path. A seam that asks for all experts (`Seam.all_experts`, calibration) gets every
    token in every expert (llm-compressor's moe_calibrate_all_experts); the output is unchanged.
    """

    def __init__(self, config: ModelConfig, prefix: str, *, param_dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        experts = config.family_spec.experts(config)  # the family's `moe.Experts`
        router = Linear(
            config.hidden_size,
            experts.num_experts,
            bias=False,
            name=f"{prefix}.{ROUTER.attr}",
            param_dtype=param_dtype,
            rngs=rngs,
        )
        setattr(self, ROUTER.attr, router)  # HF's attribute: `gate`
        self.experts = nnx.List(
            [
                MLP(
                    config,
                    f"{prefix}.experts.{e}",
                    width=config.family_spec.expert_width(config),
                    names=config.family_spec.expert_attrs,
                    param_dtype=param_dtype,
                    rngs=rngs,
                )
                for e in range(experts.num_experts)
            ]
        )
        self.top_k, self.normalize = experts.num_experts_per_tok, experts.norm_topk_prob
        self.weights_in_logits_dtype = config.family_spec.routing_weights_in_logits_dtype  # as transformers

    def __call__(self, x_BxTxE: jax.Array, seam: Seam) -> tuple[jax.Array, Side]:
        """(the output, side results: the experts' records, the router's logits under its name)."""
        router = getattr(self, ROUTER.attr)
        logits_BxTxN, router_side = router(x_BxTxE, seam)
        weights_BxTxN, chosen_BxTxN = route(
            logits_BxTxN,
            self.top_k,
            self.normalize,
            logits_BxTxN.dtype if self.weights_in_logits_dtype else jnp.float32,
        )
        out_BxTxE, experts_side = mix_experts(self.experts, x_BxTxE, weights_BxTxN, chosen_BxTxN, seam)
        return out_BxTxE.astype(x_BxTxE.dtype), merged(router_side, Side({}, {router.name: logits_BxTxN}), experts_side)


def mix_experts(
    experts, x_BxTxE: jax.Array, weights_BxTxN: jax.Array, chosen_BxTxN: jax.Array, seam: Seam
) -> tuple[jax.Array, Side]:
    """The routing-weighted sum (fp32) of the experts' outputs, in expert order (as transformers'
    index_add), and their side results: each expert runs on the tokens routed to it (the others'
    rows zeroed), or on every token when the seam asks for all experts (calibration). Each
    expert's output is multiplied by its weight in their promoted dtype (as torch), then summed in fp32."""
    out_BxTxE = jnp.zeros(x_BxTxE.shape, jnp.float32)
    sides = []
    for e, expert in enumerate(experts):
        routed_BxTxE = x_BxTxE if seam.all_experts else jnp.where(chosen_BxTxN[..., e : e + 1], x_BxTxE, 0)
        y_BxTxE, expert_side = expert(routed_BxTxE, seam)
        out_BxTxE = out_BxTxE + (y_BxTxE * weights_BxTxN[..., e : e + 1]).astype(jnp.float32)
        sides.append(expert_side)
    return out_BxTxE, merged(*sides)
