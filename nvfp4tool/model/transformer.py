"""The causal language model in Flax NNX, for every family: embedding, the family's blocks (the
block of each layer kind, as the family's blocks module registers it: `blocks.py`), final norm and
LM head, run whole or scanned (generation runs it a layer at a time with each block's decode
state: `generate.py`).

Attribute names mirror HF's (`model.layers.3.self_attn.q_proj.weight`). Every projection and the LM
head ("lm_head") go through the linear seam (`linear.py`), keys and values through the KV seam
(`kv.py`); `scan_layers=True` runs each run of like layers as one `jax.lax.scan`.
Design notes: docs/design/model.md.
"""

from __future__ import annotations

import functools
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from nvfp4tool.config import ModelConfig
from nvfp4tool.families import LM_HEAD, LayerAttention, layer_prefix
from nvfp4tool.model.attention import AttentionMask, attention_allowed
from nvfp4tool.model.blocks import make_block
from nvfp4tool.model.layers import Embedding, Linear, RMSNorm
from nvfp4tool.model.linear import LinearFn, Seam, Side, default_linear, merged
from nvfp4tool.model.remat import REMAT_LEVELS, checkpointed
from nvfp4tool.model.rope import layer_cos_sin, rope_tables


class CausalLM(nnx.Module):
    """The whole model: embedding, L blocks, final norm, LM head (absent when tied)."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        param_dtype: jnp.dtype = jnp.float32,
        compute_dtype: jnp.dtype | None = None,
        scan_layers: bool = False,
        remat: str = "none",
        linear: LinearFn = default_linear,
        rngs: nnx.Rngs | None = None,
    ) -> None:
        if remat not in REMAT_LEVELS:
            raise ValueError(f"remat={remat!r}; choose one of {', '.join(REMAT_LEVELS)}")
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = config
        self.compute_dtype = jnp.dtype(compute_dtype or param_dtype)
        self.scan_layers = scan_layers  # run each run of alike layers as one lax.scan (`layer_runs`)
        self.remat = remat  # what the backward pass recomputes (`remat.py`)
        self.linear = linear  # the default seam; forward(..., linear=) overrides it per call
        E = config.hidden_size
        self.embed_tokens = Embedding(
            config.vocab_size, E, param_dtype=param_dtype, rngs=rngs, scale=config.family_spec.embedding_scale(config)
        )
        self.layers = nnx.List(
            [
                make_block(
                    config,
                    *layer_program(config, i),
                    layer_prefix(i),
                    param_dtype=param_dtype,
                    rngs=rngs,
                )
                for i in range(config.num_layers)
            ]
        )
        self.norm = RMSNorm.of(config, E, param_dtype=param_dtype)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(E, config.vocab_size, bias=False, name=LM_HEAD, param_dtype=param_dtype, rngs=rngs)
        )

    def __call__(
        self,
        input_ids_BxT: jax.Array,
        attention_mask_BxT: jax.Array | None = None,
        positions_BxT: jax.Array | None = None,
        *,
        segment_ids_BxT: jax.Array | None = None,
        linear: LinearFn | None = None,
    ) -> jax.Array:
        return forward(
            self, input_ids_BxT, attention_mask_BxT, positions_BxT, segment_ids_BxT=segment_ids_BxT, linear=linear
        )


def forward(
    model: CausalLM,
    input_ids_BxT: jax.Array,
    attention_mask_BxT: jax.Array | None = None,
    positions_BxT: jax.Array | None = None,
    *,
    segment_ids_BxT: jax.Array | None = None,
    linear: LinearFn | None = None,
) -> jax.Array:
    """Logits [B, T, V] in float32 (no cache). Mask: 1 = token, 0 = padding (left or right).
    Segment ids (packed rows: 1, 2, ... per document, 0 = padding): each document is run as if
    alone (`sequence_mask`). With none of the three (unpadded rows at 0..T-1, the training loss)
    attention is causal by structure (`AttentionMask.causal`: flash attention on a GPU), else
    explicit. A jitted program (model structure and `linear` static); under a transformation
    that needs the side results (training), call `forward_side` with a `Seam`.
    """
    graphdef, state = nnx.split(model)
    mask_BxT, positions_BxT, segments_BxT = (
        None if a is None else jnp.asarray(a) for a in (attention_mask_BxT, positions_BxT, segment_ids_BxT)
    )
    return _forward(
        graphdef,
        state,
        jnp.asarray(input_ids_BxT),
        mask_BxT,
        positions_BxT,
        segments_BxT,
        linear=linear or model.linear,
    )


def forward_side(
    model: CausalLM,
    input_ids_BxT: jax.Array,
    attention_mask_BxT: jax.Array | None = None,
    positions_BxT: jax.Array | None = None,
    *,
    segment_ids_BxT: jax.Array | None = None,
    seam: Seam,
) -> tuple[jax.Array, Side]:
    """`forward`'s logits and the side results of the whole model (every layer's, under its own
    name, and the LM head's), through `seam`; traced inline (call it under jit / grad)."""
    input_ids_BxT = jnp.asarray(input_ids_BxT)
    positions_BxT, mask = sequence_mask(
        model.config, input_ids_BxT.shape, attention_mask_BxT, positions_BxT, segment_ids_BxT
    )
    x_BxTxE, side = _blocks(model, input_ids_BxT, positions_BxT, mask, seam)
    logits, head_side = lm_logits(model, x_BxTxE, seam)
    return logits, merged(side, head_side)


def sequence_mask(
    config: ModelConfig,
    shape_BxT: tuple[int, int],
    attention_mask_BxT: jax.Array | None = None,
    positions_BxT: jax.Array | None = None,
    segment_ids_BxT: jax.Array | None = None,
) -> tuple[jax.Array, AttentionMask]:
    """(positions [B, T], the `AttentionMask`) of rows without a cache: causal by structure when
    no mask, positions or segments are given; else explicit over the real tokens (mask 1, and
    segment != 0), each query seeing its own segment only, positions restarting at 0 at each
    segment (`segment_positions`) unless given. Each attention layer narrows it to its own sliding
    window (`AttentionMask.within`)."""
    if attention_mask_BxT is None and positions_BxT is None and segment_ids_BxT is None:
        return default_positions(jnp.ones(shape_BxT, bool)), AttentionMask.causal()
    mask_BxT = jnp.ones(shape_BxT, bool) if attention_mask_BxT is None else jnp.asarray(attention_mask_BxT).astype(bool)
    segments_BxT = None if segment_ids_BxT is None else jnp.asarray(segment_ids_BxT).astype(jnp.int32)
    if segments_BxT is not None:
        mask_BxT = mask_BxT & (segments_BxT != 0)
    if positions_BxT is not None:
        positions_BxT = jnp.asarray(positions_BxT)
    elif segments_BxT is not None:
        positions_BxT = segment_positions(segments_BxT)
    else:
        positions_BxT = default_positions(mask_BxT)
    allowed_BxTxS = attention_allowed(
        jnp.arange(shape_BxT[1]), mask_BxT, None, positions_BxT, positions_BxT, segments_BxT, segments_BxT
    )
    return positions_BxT, AttentionMask.explicit(
        allowed_BxTxS, mask_BxT, segments_BxT, query_positions_BxT=positions_BxT, key_positions_BxS=positions_BxT
    )


def default_positions(mask_BxT: jax.Array) -> jax.Array:
    """Position of each token = number of real tokens before it (padding does not count)."""
    return jnp.maximum(jnp.cumsum(mask_BxT.astype(jnp.int32), axis=-1) - 1, 0)


def segment_positions(segments_BxT: jax.Array) -> jax.Array:
    """Position of each token in its segment (MaxText's `inputs_position`): slots since the
    segment's first slot, so a packed document counts from 0 as if alone."""
    T = segments_BxT.shape[-1]
    index_T = jnp.arange(T, dtype=jnp.int32)
    starts_BxT = jnp.concatenate(
        [jnp.ones(segments_BxT.shape[:-1] + (1,), bool), segments_BxT[..., 1:] != segments_BxT[..., :-1]], axis=-1
    )
    first_BxT = jax.lax.cummax(jnp.where(starts_BxT, index_T, 0), axis=segments_BxT.ndim - 1)
    return index_T - first_BxT


def final_hidden(
    model: CausalLM, input_ids_BxT: jax.Array, seam: Seam, segment_ids_BxT: jax.Array | None = None
) -> tuple[jax.Array, Side]:
    """The LM head's input [B, T, E] (the last block's output after the final norm) of unpadded
    (or, with segment ids, packed) rows, for a loss that applies the head itself (distillation,
    chunked over the vocabulary with `head_weight`), and the blocks' side results. Call it under a
    transformation (jit / grad), as the train step does."""
    positions_BxT, mask = sequence_mask(model.config, input_ids_BxT.shape, segment_ids_BxT=segment_ids_BxT)
    x_BxTxE, side = _blocks(model, input_ids_BxT, positions_BxT, mask, seam)
    return model.norm(x_BxTxE), side


def head_weight(model: CausalLM) -> jax.Array:
    """The LM head's weight [V, E] (the embedding table when tied)."""
    return model.lm_head.weight.get_value() if model.lm_head is not None else model.embed_tokens.weight[...]


def layer_program(config: ModelConfig, layer: int) -> tuple[str, LayerAttention]:
    """(kind, attention settings) of decoder layer `layer`: what its block program is built of
    (`block_program`); layers alike in both run one program."""
    return config.layer_kind(layer), config.family_spec.layer_attention(config, layer)


def layer_runs(config: ModelConfig, seam: Seam, scan: bool) -> list[tuple[str, list[int]]]:
    """(kind, layers) of each run of consecutive layers of one block program (`layer_program`:
    kind and attention settings, window and RoPE) and one `seam.treatment`, in order; every layer
    its own run when not scanning."""
    runs: list[tuple[str, list[int]]] = []
    previous = None
    for i in range(config.num_layers):
        kind = config.layer_kind(i)
        alike = (layer_program(config, i), seam.treatment(i))
        if scan and runs and alike == previous:
            runs[-1][1].append(i)
        else:
            runs.append((kind, [i]))
        previous = alike
    return runs


def abstract_block(config: ModelConfig, kind: str, attention: LayerAttention) -> nnx.Module:
    """A block of layer kind `kind` with attention settings `attention` and no values, named
    `model.layers.*` (the names a scanned or layer-by-layer block program sees); it computes in
    its input's dtype."""
    return nnx.eval_shape(
        lambda: make_block(config, kind, attention, layer_prefix("*"), param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    )


@functools.lru_cache(maxsize=64)
def block_program(config: ModelConfig, kind: str, attention: LayerAttention) -> nnx.GraphDef:
    """The graphdef of `abstract_block(config, kind, attention)`: one program for every layer of
    the kind with those settings (`layer_program`)."""
    return nnx.split(abstract_block(config, kind, attention))[0]


def real_name(name: str, layer: int | None) -> str:
    """The module a block program's `name` stands for in layer `layer` (None: the LM head)."""
    return name if layer is None else name.replace(layer_prefix("*"), layer_prefix(layer))


def _stacked(trees: list) -> object:
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _blocks(model: CausalLM, input_ids_BxT, positions_BxT, mask, seam: Seam):
    """Embedding and the blocks, no decode state: (the last block's output [B, T, E], the side
    results under each layer's own names)."""
    x_BxTxE = embed(model, input_ids_BxT)
    tables = rope(model, positions_BxT)

    def run_block(graphdef, state, x_BxTxE, aux, layer):
        """One block, under the model's remat policy: (output, side)."""

        def call(state, x_BxTxE, aux, layer_args):
            y, _, side = nnx.merge(graphdef, state)(x_BxTxE, *layer_args, None, 0, seam.with_aux(aux))
            return y, side

        layer_args = (*layer_cos_sin(model.config, tables, layer), mask)  # its layer's (cos, sin)
        return checkpointed(call, model.remat)(state, x_BxTxE, aux, layer_args)

    sides = []
    for _, layers in layer_runs(model.config, seam, model.scan_layers):
        first = layers[0]
        if len(layers) == 1:
            x_BxTxE, side = run_block(*nnx.split(model.layers[first]), x_BxTxE, seam.aux_of(first), first)
            sides.append(side)
            continue
        states = _stacked([nnx.split(model.layers[i])[1] for i in layers])
        auxes = _stacked([seam.aux_of(i) for i in layers])
        graphdef = block_program(model.config, *layer_program(model.config, first))

        def body(x, per_layer, graphdef=graphdef, first=first):
            state, aux = per_layer
            return run_block(graphdef, state, x, aux, first)

        x_BxTxE, side = jax.lax.scan(body, x_BxTxE, (states, auxes))
        for j, i in enumerate(layers):  # the stacked side results, under each layer's own name
            sides.append(
                Side(
                    {real_name(n, i): jax.tree.map(lambda a, j=j: a[j], r) for n, r in side.records.items()},
                    {real_name(n, i): a[j] for n, a in side.router_logits.items()},
                )
            )
    return x_BxTxE, merged(*sides)


def without_layers(model: CausalLM) -> CausalLM:
    """A shallow copy of `model` without its decoder layers: embedding, final norm and LM head
    (what runs around a layer-by-layer loop)."""
    outer = nnx.merge(*nnx.split(model))
    outer.layers = nnx.List([])
    return outer


def embed(model: CausalLM, input_ids_BxT: jax.Array) -> jax.Array:
    """The first layer's input [B, T, E] in the compute dtype."""
    return model.embed_tokens(input_ids_BxT).astype(model.compute_dtype)


def rope(model: CausalLM, positions_BxT: jax.Array) -> tuple:
    """(cos, sin) [B, T, dim] of the positions, in the compute dtype, once per distinct RoPE
    setting of the layers (`rope.rope_tables`; a layer's: `rope.layer_cos_sin`); empty for a
    family without positional encoding."""
    return rope_tables(model.config, positions_BxT, model.compute_dtype)


def lm_logits(model: CausalLM, x_BxTxE: jax.Array, seam: Seam) -> tuple[jax.Array, Side]:
    """The last layer's output -> final norm -> LM head (or the tied embedding): fp32 [B, T, V],
    and the head's side results."""
    logits, side = seam.at(None).project(model.norm(x_BxTxE), head_weight(model), None, LM_HEAD)
    return logits.astype(jnp.float32), side


@partial(jax.jit, static_argnames=("graphdef", "linear"))
def _forward(graphdef, state, input_ids_BxT, attention_mask_BxT, positions_BxT, segment_ids_BxT, *, linear):
    """`forward`'s body (mask, positions and segments None or arrays, as `forward_side` takes them)."""
    return forward_side(
        nnx.merge(graphdef, state),
        input_ids_BxT,
        attention_mask_BxT,
        positions_BxT,
        segment_ids_BxT=segment_ids_BxT,
        seam=Seam.of(linear),
    )[0]
