"""The Llama-family decoder in Flax NNX (Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5, Qwen3, and the
mixture-of-experts Qwen3-MoE and Mixtral).

Pre-norm blocks: RMSNorm (fp32 inside, as HF) -> GQA attention with RoPE (half-split layout,
optional llama3 scaling, optional per-head q/k RMSNorm, optional q/k/v(/o) bias, optional
sliding window) -> residual -> RMSNorm -> SwiGLU MLP, or a sparse MLP (`SparseMoE`: a router
picks the top-k experts of each token, each a SwiGLU MLP) -> residual; final RMSNorm; LM head
(tied or not). Module attribute names mirror HF's, so `model.layers.3.self_attn.q_proj.weight` is the path
of that parameter (see `weights.py`). Every projection goes through the linear seam (`linear.py`);
the LM head too, under the name "lm_head", so a recipe can keep it in high precision by name.
Keys (after RoPE) and values go through the KV seam (`kv.py`, identity by default) before they are
cached and used, under the attention's name ("model.layers.3.self_attn"). The attention math itself
is `attention.attend` (`jax.nn.dot_product_attention`, cuDNN flash attention on a CUDA GPU) under an
`AttentionMask`: causal (with the sliding window) for unpadded rows without a cache, the training
path; an explicit [B, T, S] array (`attention_allowed`) for padding and cached generation.

The seams come in one explicit `linear.Seam`; every module returns its output and its side results
(`linear.Side`: the taps' records, the routers' logits), a block also its keys and values.

Scanned layers (`scan_layers=True`): the parameters stay per layer (`model.layers.3....`, as stored
and checkpointed), and each run of consecutive layers of one kind and one treatment
(`Seam.treatment`: training's precision of each linear) runs as one `jax.lax.scan` over the run's
stacked parameters and stacked per-layer aux (`layer_runs`); the program then traces one block per
run, whose linear names read "model.layers.*....", so compile time stops growing with depth. The
stacking copies the run's weights once per call. Side results come out of the scan stacked and
are given back under each layer's own name.

Remat (`remat="block"|"full"`, `remat.py`): each block runs under `jax.checkpoint`; every linear's
output is tagged (`linear_output`) for the `block` policy to keep.

Padding: `attention_mask_BxT` (1 = token, 0 = padding, left or right) hides padded keys; padded
query rows produce garbage that callers ignore. Default positions are `cumsum(mask) - 1`, so a
left-padded row starts at position 0 like HF's `generate` (HF's plain forward uses 0..T-1 instead:
pass `positions` explicitly to reproduce that).
"""

from __future__ import annotations

import functools
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from nvfp4tool.config import ModelConfig
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.families import ATTENTION_MLP, ATTENTION_MOE, LM_HEAD, layer_prefix
from nvfp4tool.model.attention import AttentionMask, attend, attention_allowed
from nvfp4tool.model.kv import KVFn, default_kv
from nvfp4tool.model.linear import LinearFn, Seam, Side, default_linear, merged
from nvfp4tool.model.remat import REMAT_LEVELS, checkpointed, linear_output
from nvfp4tool.model.rope import apply_rope, inverse_frequencies, rope_cos_sin
from nvfp4tool.numerics import computed_after

_INIT_STD = 0.02  # random init (training from scratch): normal(0, 0.02) weights, zero bias, unit norms


class KVCache(NamedTuple):
    """Keys and values of every layer: [L, B, S, KV, D] each, in the compute dtype."""

    k_LxBxSxKVxD: jax.Array
    v_LxBxSxKVxD: jax.Array


class Linear(nnx.Module):
    """Weight [out, in] (HF orientation), optional bias; calls the linear seam with its HF name."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, name: str,
                 param_dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        self.weight = nnx.Param(
            _INIT_STD * jax.random.normal(rngs.params(), (out_features, in_features), param_dtype))
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
    (Nemotron-H's NemotronHRMSNorm)."""

    def __init__(self, dim: int, *, eps: float, param_dtype: jnp.dtype, scale_in_fp32: bool = False) -> None:
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps
        self.scale_in_fp32 = scale_in_fp32

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.scale_in_fp32:
            return (self.weight[...].astype(jnp.float32) * normed).astype(x.dtype)
        return (self.weight[...].astype(x.dtype) * normed.astype(x.dtype)).astype(x.dtype)


class Embedding(nnx.Module):
    """Token embedding table [V, E] (HF `model.embed_tokens.weight`)."""

    def __init__(self, vocab_size: int, dim: int, *, param_dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        self.weight = nnx.Param(_INIT_STD * jax.random.normal(rngs.params(), (vocab_size, dim), param_dtype))

    def __call__(self, ids_BxT: jax.Array) -> jax.Array:
        table_VxE = self.weight[...]
        if table_VxE.dtype == jnp.float32:  # training's parameters
            return jnp.take(table_VxE, ids_BxT, axis=0)
        # A table held as stored (BF16): XLA:CPU gathers from it through an fp32 copy of the whole
        # table, which generation's decode loop hoisted out of the loop and held (262 MB for 32000 x
        # 2048, 2.1 GB for 128256 x 4096); looked up once the ids exist, the copy stays inside the gather.
        return computed_after(ids_BxT, lambda table: jnp.take(table, ids_BxT, axis=0), table_VxE)


class Attention(nnx.Module):
    """GQA self-attention: q/k/v projections, optional q/k norm, RoPE, masked softmax, o_proj."""

    def __init__(self, config: ModelConfig, prefix: str, *, param_dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        E, D = config.hidden_size, config.head_dim
        H, KV = config.num_heads, config.num_kv_heads

        def proj(name: str, k: int, n: int, bias: bool) -> Linear:
            return Linear(k, n, bias=bias, name=f"{prefix}.{name}", param_dtype=param_dtype, rngs=rngs)

        self.q_proj = proj("q_proj", E, H * D, config.attention_bias)
        self.k_proj = proj("k_proj", E, KV * D, config.attention_bias)
        self.v_proj = proj("v_proj", E, KV * D, config.attention_bias)
        self.o_proj = proj("o_proj", H * D, E, config.o_proj_bias)
        norm = lambda: RMSNorm(D, eps=config.rms_norm_eps, param_dtype=param_dtype)  # noqa: E731
        self.q_norm = norm() if config.qk_norm else None
        self.k_norm = norm() if config.qk_norm else None
        self.num_heads, self.num_kv_heads, self.head_dim = H, KV, D
        self.name = prefix  # the KV seam's name of this layer

    def __call__(self, x_BxTxE: jax.Array, cos_BxTxD: jax.Array, sin_BxTxD: jax.Array,
                 mask: AttentionMask, cache_kv: tuple[jax.Array, jax.Array] | None,
                 write_index: jax.Array | int, seam: Seam):
        """Returns (y_BxTxE, (k, v), side): k/v the updated cache [B, S, KV, D] (or this chunk's,
        no cache)."""
        B, T, _ = x_BxTxE.shape
        H, KV, D = self.num_heads, self.num_kv_heads, self.head_dim
        q, q_side = self.q_proj(x_BxTxE, seam)
        k, k_side = self.k_proj(x_BxTxE, seam)
        v, v_side = self.v_proj(x_BxTxE, seam)
        q_BxTxHxD, k_BxTxKVxD, v_BxTxKVxD = q.reshape(B, T, H, D), k.reshape(B, T, KV, D), v.reshape(B, T, KV, D)
        if self.q_norm is not None:
            q_BxTxHxD, k_BxTxKVxD = self.q_norm(q_BxTxHxD), self.k_norm(k_BxTxKVxD)
        q_BxTxHxD = apply_rope(q_BxTxHxD, cos_BxTxD, sin_BxTxD)
        k_BxTxKVxD = apply_rope(k_BxTxKVxD, cos_BxTxD, sin_BxTxD)
        (k_BxTxKVxD, v_BxTxKVxD), kv_side = seam.cache(k_BxTxKVxD, v_BxTxKVxD, self.name)
        if cache_kv is None:
            k_BxSxKVxD, v_BxSxKVxD = k_BxTxKVxD, v_BxTxKVxD
        else:
            start = (0, write_index, 0, 0)
            k_BxSxKVxD = jax.lax.dynamic_update_slice(cache_kv[0], k_BxTxKVxD.astype(cache_kv[0].dtype), start)
            v_BxSxKVxD = jax.lax.dynamic_update_slice(cache_kv[1], v_BxTxKVxD.astype(cache_kv[1].dtype), start)
        out_BxTxHxD = attend(q_BxTxHxD, k_BxSxKVxD.astype(x_BxTxE.dtype), v_BxSxKVxD.astype(x_BxTxE.dtype),
                             mask)
        y_BxTxE, o_side = self.o_proj(out_BxTxHxD.reshape(B, T, H * D), seam)
        return y_BxTxE, (k_BxSxKVxD, v_BxSxKVxD), merged(q_side, k_side, v_side, kv_side, o_side)


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); projections named gate_proj/up_proj/down_proj (a dense
    MLP, a Qwen3-MoE expert) or `names` (a Mixtral expert: w1/w3/w2)."""

    def __init__(self, config: ModelConfig, prefix: str, *, width: int | None = None,
                 names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 param_dtype: jnp.dtype, rngs: nnx.Rngs) -> None:
        E, F = config.hidden_size, width or config.intermediate_size
        self.names = names
        for attr, k, n in zip(names, (E, E, F), (F, F, E)):
            setattr(self, attr, Linear(k, n, bias=False, name=f"{prefix}.{attr}", param_dtype=param_dtype, rngs=rngs))

    def __call__(self, x_BxTxE: jax.Array, seam: Seam) -> tuple[jax.Array, Side]:
        gate, up, down = (getattr(self, attr) for attr in self.names)
        g_BxTxF, gate_side = gate(x_BxTxE, seam)
        u_BxTxF, up_side = up(x_BxTxE, seam)
        y_BxTxE, down_side = down(jax.nn.silu(g_BxTxF) * u_BxTxF, seam)
        return y_BxTxE, merged(gate_side, up_side, down_side)


def route(router_logits_BxTxN: jax.Array, k: int, normalize: bool,
          weights_dtype: jnp.dtype = jnp.float32) -> tuple[jax.Array, jax.Array]:
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



def route_grouped_sigmoid(router_logits_BxTxN: jax.Array, k: int, *, correction_bias_N: jax.Array, n_group: int,
                          topk_group: int, normalize: bool, scaling: float) -> tuple[jax.Array, jax.Array]:
    """Top-k routing as Nemotron-H / DeepSeek-V3 (transformers' `NemotronHTopkRouter`): sigmoid
    scores in fp32; the correction bias is added only to choose: the experts split into `n_group`
    groups, each group scored by the sum of its two best biased scores, the `topk_group` best
    groups kept, then the k best biased scores among their experts; the weights are the chosen
    experts' unbiased scores, renormalised (`normalize`, + 1e-20 as the reference) and times
    `scaling` (`routed_scaling_factor`). The same return as `route` (fp32 weights). For the
`nemotron_h` family, not registered yet: no model calls it today."""
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
        self.gate = Linear(config.hidden_size, config.experts.num_experts, bias=False, name=f"{prefix}.gate",
                           param_dtype=param_dtype, rngs=rngs)
        self.experts = nnx.List([
            MLP(config, f"{prefix}.experts.{e}", width=config.expert_intermediate_size,
                names=config.expert_projections, param_dtype=param_dtype, rngs=rngs)
            for e in range(config.experts.num_experts)])
        self.top_k, self.normalize = config.experts.num_experts_per_tok, config.experts.norm_topk_prob
        self.weights_in_logits_dtype = config.family_spec.routing_weights_in_logits_dtype  # as transformers

    def __call__(self, x_BxTxE: jax.Array, seam: Seam) -> tuple[jax.Array, Side]:
        """(the output, side results: the experts' records, the router's logits under its name)."""
        logits_BxTxN, router_side = self.gate(x_BxTxE, seam)
        weights_BxTxN, chosen_BxTxN = route(logits_BxTxN, self.top_k, self.normalize,
                                            logits_BxTxN.dtype if self.weights_in_logits_dtype else jnp.float32)
        out_BxTxE = jnp.zeros(x_BxTxE.shape, jnp.float32)
        sides = [router_side, Side({}, {self.gate.name: logits_BxTxN})]
        for e, expert in enumerate(self.experts):
            routed_BxTxE = x_BxTxE if seam.all_experts else jnp.where(chosen_BxTxN[..., e:e + 1], x_BxTxE, 0)
            y_BxTxE, expert_side = expert(routed_BxTxE, seam)
            y_BxTxE = y_BxTxE * weights_BxTxN[..., e:e + 1]  # dtype promotion as torch
            out_BxTxE = out_BxTxE + y_BxTxE.astype(jnp.float32)
            sides.append(expert_side)
        return out_BxTxE.astype(x_BxTxE.dtype), merged(*sides)


class Block(nnx.Module):
    """One pre-norm decoder layer (its MLP dense, or sparse when `sparse`)."""

    def __init__(self, config: ModelConfig, layer_name: str, *, sparse: bool = False, param_dtype: jnp.dtype,
                 rngs: nnx.Rngs) -> None:
        E = config.hidden_size
        self.input_layernorm = RMSNorm(E, eps=config.rms_norm_eps, param_dtype=param_dtype)
        self.self_attn = Attention(config, f"{layer_name}.self_attn", param_dtype=param_dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(E, eps=config.rms_norm_eps, param_dtype=param_dtype)
        mlp = (SparseMoE(config, f"{layer_name}.{config.expert_block}", param_dtype=param_dtype, rngs=rngs)
               if sparse else MLP(config, f"{layer_name}.mlp", param_dtype=param_dtype, rngs=rngs))
        self.mlp_attr = config.expert_block if sparse else "mlp"  # HF's attribute: mlp / block_sparse_moe
        setattr(self, self.mlp_attr, mlp)

    def __call__(self, x_BxTxE, cos_BxTxD, sin_BxTxD, mask, cache_kv, write_index, seam: Seam):
        """(the block's output, its (k, v), its side results)."""
        attn_BxTxE, cached, attn_side = self.self_attn(self.input_layernorm(x_BxTxE), cos_BxTxD, sin_BxTxD,
                                                       mask, cache_kv, write_index, seam)
        h_BxTxE = x_BxTxE + attn_BxTxE
        mlp_BxTxE, mlp_side = getattr(self, self.mlp_attr)(self.post_attention_layernorm(h_BxTxE), seam)
        return h_BxTxE + mlp_BxTxE, cached, merged(attn_side, mlp_side)


# The block class of each layer kind a family declares (`families.base`): a family with a new kind
# (a hybrid's "mamba", "attention", "mlp", "moe") adds its block class here.
BLOCKS = {ATTENTION_MLP: functools.partial(Block, sparse=False), ATTENTION_MOE: functools.partial(Block, sparse=True)}


def make_block(config: ModelConfig, kind: str, layer_name: str, *, param_dtype: jnp.dtype, rngs: nnx.Rngs) -> nnx.Module:
    """A block of layer kind `kind` named `layer_name` (`model.layers.3`, or `model.layers.*`)."""
    if kind not in BLOCKS:
        raise NVFP4ToolError(f"{config.family}: layer kind {kind!r} has no block in the model "
                             f"(kinds with blocks: {', '.join(BLOCKS)})")
    return BLOCKS[kind](config, layer_name, param_dtype=param_dtype, rngs=rngs)


class CausalLM(nnx.Module):
    """The whole model: embedding, L blocks, final norm, LM head (absent when tied)."""

    def __init__(self, config: ModelConfig, *, param_dtype: jnp.dtype = jnp.float32,
                 compute_dtype: jnp.dtype | None = None, scan_layers: bool = False,
                 remat: str = "none", linear: LinearFn = default_linear, rngs: nnx.Rngs | None = None) -> None:
        if remat not in REMAT_LEVELS:
            raise ValueError(f"remat={remat!r}; choose one of {', '.join(REMAT_LEVELS)}")
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = config
        self.compute_dtype = jnp.dtype(compute_dtype or param_dtype)
        self.scan_layers = scan_layers  # run each run of alike layers as one lax.scan (`layer_runs`)
        self.remat = remat  # what the backward pass recomputes (`remat.py`)
        self.linear = linear  # the default seam; forward(..., linear=) overrides it per call
        E = config.hidden_size
        self.embed_tokens = Embedding(config.vocab_size, E, param_dtype=param_dtype, rngs=rngs)
        self.layers = nnx.List([make_block(config, config.layer_kind(i), layer_prefix(i), param_dtype=param_dtype,
                                           rngs=rngs) for i in range(config.num_layers)])
        self.norm = RMSNorm(E, eps=config.rms_norm_eps, param_dtype=param_dtype)
        self.lm_head = None if config.tie_word_embeddings else Linear(
            E, config.vocab_size, bias=False, name=LM_HEAD, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, input_ids_BxT: jax.Array, attention_mask_BxT: jax.Array | None = None,
                 positions_BxT: jax.Array | None = None, *, linear: LinearFn | None = None) -> jax.Array:
        return forward(self, input_ids_BxT, attention_mask_BxT, positions_BxT, linear=linear)


def forward(model: CausalLM, input_ids_BxT: jax.Array, attention_mask_BxT: jax.Array | None = None,
            positions_BxT: jax.Array | None = None, *, linear: LinearFn | None = None) -> jax.Array:
    """Logits [B, T, V] in float32 (no cache). Mask: 1 = token, 0 = padding (left or right).
    With neither a mask nor positions (unpadded rows at 0..T-1, the training loss) attention is
    causal by structure (`AttentionMask.causal`: flash attention on a GPU), else explicit.
    A jitted program (model structure and `linear` static); under a transformation that needs the
    side results (training), call `forward_side` with a `Seam`.
    """
    graphdef, state = nnx.split(model)
    mask_BxT = None if attention_mask_BxT is None else jnp.asarray(attention_mask_BxT)
    positions_BxT = None if positions_BxT is None else jnp.asarray(positions_BxT)
    return _forward(graphdef, state, jnp.asarray(input_ids_BxT), mask_BxT, positions_BxT, linear=linear or model.linear)


def forward_side(model: CausalLM, input_ids_BxT: jax.Array, attention_mask_BxT: jax.Array | None = None,
                 positions_BxT: jax.Array | None = None, *, seam: Seam) -> tuple[jax.Array, Side]:
    """`forward`'s logits and the side results of the whole model (every layer's, under its own
    name, and the LM head's), through `seam`; traced inline (call it under jit / grad)."""
    input_ids_BxT = jnp.asarray(input_ids_BxT)
    window = model.config.sliding_window
    if attention_mask_BxT is None and positions_BxT is None:
        positions_BxT, mask = default_positions(jnp.ones(input_ids_BxT.shape, bool)), AttentionMask.causal(window)
    else:
        mask_BxT = (jnp.ones(input_ids_BxT.shape, bool) if attention_mask_BxT is None
                    else jnp.asarray(attention_mask_BxT).astype(bool))
        positions_BxT = default_positions(mask_BxT) if positions_BxT is None else jnp.asarray(positions_BxT)
        mask = AttentionMask.explicit(attention_allowed(jnp.arange(input_ids_BxT.shape[1]), mask_BxT, window,
                                                        positions_BxT, positions_BxT))
    x_BxTxE, _, side = _blocks(model, input_ids_BxT, positions_BxT, mask, None, 0, seam)
    logits, head_side = lm_logits(model, x_BxTxE, seam)
    return logits, merged(side, head_side)


def default_positions(mask_BxT: jax.Array) -> jax.Array:
    """Position of each token = number of real tokens before it (padding does not count)."""
    return jnp.maximum(jnp.cumsum(mask_BxT.astype(jnp.int32), axis=-1) - 1, 0)


def forward_with_cache(model: CausalLM, input_ids_BxT: jax.Array, positions_BxT: jax.Array,
                       mask: AttentionMask, cache: KVCache | None, write_index: jax.Array | int,
                       linear: LinearFn, kv: KVFn = default_kv) -> tuple[jax.Array, KVCache | None]:
    """The model body: logits [B, T, V] (float32) and the cache with this chunk written at
    `write_index` (None in, None out: keys are then this chunk's own); keys and values pass the
    KV seam `kv` before they are written."""
    seam = Seam.of(linear, kv)
    x_BxTxE, new_cache, _ = _blocks(model, input_ids_BxT, positions_BxT, mask, cache, write_index, seam)
    return lm_logits(model, x_BxTxE, seam)[0], new_cache


def final_hidden(model: CausalLM, input_ids_BxT: jax.Array, seam: Seam) -> tuple[jax.Array, Side]:
    """The LM head's input [B, T, E] (the last block's output after the final norm) of unpadded
    rows, for a loss that applies the head itself (distillation, chunked over the vocabulary with
    `head_weight`), and the blocks' side results. Call it under a transformation (jit / grad), as
    the train step does."""
    positions_BxT = default_positions(jnp.ones(input_ids_BxT.shape, bool))
    mask = AttentionMask.causal(model.config.sliding_window)
    x_BxTxE, _, side = _blocks(model, input_ids_BxT, positions_BxT, mask, None, 0, seam)
    return model.norm(x_BxTxE), side


def head_weight(model: CausalLM) -> jax.Array:
    """The LM head's weight [V, E] (the embedding table when tied)."""
    return model.lm_head.weight.get_value() if model.lm_head is not None else model.embed_tokens.weight[...]


def layer_runs(config: ModelConfig, seam: Seam, scan: bool) -> list[tuple[str, list[int]]]:
    """(kind, layers) of each run of consecutive layers of one kind and one `seam.treatment`, in
    order; every layer its own run when not scanning."""
    runs: list[tuple[str, list[int]]] = []
    previous = None
    for i in range(config.num_layers):
        kind = config.layer_kind(i)
        alike = (kind, seam.treatment(i))
        if scan and runs and alike == previous:
            runs[-1][1].append(i)
        else:
            runs.append((kind, [i]))
        previous = alike
    return runs


def abstract_block(config: ModelConfig, kind: str) -> nnx.Module:
    """A block of layer kind `kind` with no values, named `model.layers.*` (the names a scanned or
    layer-by-layer block program sees); it computes in its input's dtype."""
    return nnx.eval_shape(lambda: make_block(config, kind, layer_prefix("*"), param_dtype=jnp.float32,
                                             rngs=nnx.Rngs(0)))


@functools.lru_cache(maxsize=64)
def block_program(config: ModelConfig, kind: str) -> nnx.GraphDef:
    """The graphdef of `abstract_block(config, kind)`: one program for every layer of the kind."""
    return nnx.split(abstract_block(config, kind))[0]


def real_name(name: str, layer: int | None) -> str:
    """The module a block program's `name` stands for in layer `layer` (None: the LM head)."""
    return name if layer is None else name.replace(layer_prefix("*"), layer_prefix(layer))


def _stacked(trees: list) -> object:
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _blocks(model: CausalLM, input_ids_BxT, positions_BxT, mask, cache, write_index, seam: Seam):
    """Embedding and the blocks: (the last block's output [B, T, E], the updated cache, the side
    results under each layer's own names)."""
    x_BxTxE = embed(model, input_ids_BxT)
    cos_BxTxD, sin_BxTxD = rope(model, positions_BxT)
    layer_args = (cos_BxTxD, sin_BxTxD, mask)

    def run_block(graphdef, state, x_BxTxE, cache_kv, aux):
        """One block, under the model's remat policy: (output, (k, v), side)."""
        def call(state, x_BxTxE, cache_kv, aux, layer_args):
            return nnx.merge(graphdef, state)(x_BxTxE, *layer_args, cache_kv, write_index, seam.with_aux(aux))
        return checkpointed(call, model.remat)(state, x_BxTxE, cache_kv, aux, layer_args)

    new_cache, sides = cache, []
    for kind, layers in layer_runs(model.config, seam, model.scan_layers):
        first, count = layers[0], len(layers)
        if count == 1:
            cache_kv = None if cache is None else (new_cache.k_LxBxSxKVxD[first], new_cache.v_LxBxSxKVxD[first])
            x_BxTxE, (k, v), side = run_block(*nnx.split(model.layers[first]), x_BxTxE, cache_kv,
                                              seam.aux_of(first))
            if cache is not None:  # an in-place update of layer i under jit
                new_cache = KVCache(new_cache.k_LxBxSxKVxD.at[first].set(k), new_cache.v_LxBxSxKVxD.at[first].set(v))
            sides.append(side)
            continue
        states = _stacked([nnx.split(model.layers[i])[1] for i in layers])
        auxes = _stacked([seam.aux_of(i) for i in layers])
        run_cache = None if cache is None else (new_cache.k_LxBxSxKVxD[first:first + count],
                                                new_cache.v_LxBxSxKVxD[first:first + count])
        graphdef = block_program(model.config, kind)

        def body(x, per_layer, graphdef=graphdef):
            state, aux, cache_kv = per_layer
            x, cached, side = run_block(graphdef, state, x, cache_kv, aux)
            return x, (cached if cache_kv is not None else None, side)

        x_BxTxE, (kvs, side) = jax.lax.scan(body, x_BxTxE, (states, auxes, run_cache))
        if cache is not None:
            new_cache = KVCache(new_cache.k_LxBxSxKVxD.at[first:first + count].set(kvs[0]),
                                new_cache.v_LxBxSxKVxD.at[first:first + count].set(kvs[1]))
        for j, i in enumerate(layers):  # the stacked side results, under each layer's own name
            sides.append(Side({real_name(n, i): jax.tree.map(lambda a, j=j: a[j], r) for n, r in side.records.items()},
                              {real_name(n, i): a[j] for n, a in side.router_logits.items()}))
    return x_BxTxE, new_cache, merged(*sides)


def embed(model: CausalLM, input_ids_BxT: jax.Array) -> jax.Array:
    """The first layer's input [B, T, E] in the compute dtype."""
    return model.embed_tokens(input_ids_BxT).astype(model.compute_dtype)


def rope(model: CausalLM, positions_BxT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) [B, T, D] of the positions, in the compute dtype."""
    return rope_cos_sin(positions_BxT, inverse_frequencies(model.config), model.compute_dtype)


def lm_logits(model: CausalLM, x_BxTxE: jax.Array, seam: Seam) -> tuple[jax.Array, Side]:
    """The last layer's output -> final norm -> LM head (or the tied embedding): fp32 [B, T, V],
    and the head's side results."""
    logits, side = seam.at(None).project(model.norm(x_BxTxE), head_weight(model), None, LM_HEAD)
    return logits.astype(jnp.float32), side


@partial(jax.jit, static_argnames=("graphdef", "linear"))
def _forward(graphdef, state, input_ids_BxT, attention_mask_BxT, positions_BxT, *, linear):
    """`forward`'s body (mask and positions None or arrays, as `forward_side` takes them)."""
    return forward_side(nnx.merge(graphdef, state), input_ids_BxT, attention_mask_BxT, positions_BxT,
                        seam=Seam.of(linear))[0]
