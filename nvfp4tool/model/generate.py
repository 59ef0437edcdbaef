"""Autoregressive generation with a decode state (greedy or temperature / top-k sampling): each
block's own (`Block.empty_state`: an attention's KV cache, a recurrent mixer's state).

Jitted programs of ONE decoder layer (one per layer structure, called from a Python loop over the
layers, each layer's decode state donated) and small ones around them (embedding and mask, LM head
and the pick), each compiled once per (graphdef, bucket, batch) and reused across layers, prompts,
prompt lengths, token counts and models of one shape (the weights are arguments). A prefill over
the prompt left-padded to a power-of-two `bucket` fills a cache of a bucketed length, then one
decode step per token (`on_token` sees each token and its logits). Generated tokens go to cache
slots Tb, Tb+1, ...; positions continue from each row's own count of real prompt tokens, padded
slots stay masked, so padding (either side, any amount) gives the tokens of an unpadded prompt.
After a row emits `eos_token_id`, it continues with `pad_token_id` (as HF's generate).
Design notes: docs/design/model.md.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.model.attention import AttentionMask, attention_allowed
from nvfp4tool.model.kv import KVFn, LayerKV, default_kv
from nvfp4tool.model.linear import LinearFn, Seam
from nvfp4tool.model.rope import layer_cos_sin
from nvfp4tool.model.transformer import (
    CausalLM,
    block_program,
    default_positions,
    embed,
    layer_program,
    lm_logits,
    rope,
    without_layers,
)

MIN_BUCKET = 16  # the shortest padded prompt and cache (slots)
# XLA:CPU's LLVM passes (level 1) for a model of at least OPTIMIZE_PARAMS parameters, off (level 0)
# below: a small model's generation time is compiling (tiny preset, first prompt: 15.3 s -> 9.3 s
# with the passes off), a large one's is the generated code that decodes / widens its stored
# weights at every step, 20-30x slower unoptimized (a 4608 x 576 NVFP4 weight's decode and one-row
# GEMM: 351 ms -> 15 ms; docs/benchmarks/generate.md). The level follows the config, so every
# variant of one model (BF16, NVFP4, decoded once or not) runs the same code; fp semantics are the
# same (no fast math either way) but a one-row GEMM's summation order differs between the levels.
# On the CPU only: a GPU's fused kernels are generated code, which the passes make fast.
OPTIMIZE_PARAMS = 2**24
_CPU_COMPILER_OPTIONS = {False: {"xla_backend_optimization_level": 0}, True: {"xla_backend_optimization_level": 1}}

OnToken = Callable[[int, jax.Array, jax.Array], None]  # (index of the new token, tokens [B], their logits [B, V])


def generate(
    model: CausalLM,
    prompt_ids_BxT: jax.Array,
    max_new_tokens: int,
    *,
    attention_mask: jax.Array | None = None,
    greedy: bool = True,
    temperature: float = 1.0,
    top_k: int | None = None,
    key: jax.Array | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    linear: LinearFn | None = None,
    kv: KVFn | LayerKV = default_kv,
    on_token: OnToken | None = None,
    prompt_bucket: int | None = None,
    cache_len: int | None = None,
) -> jax.Array:
    """New tokens [B, max_new_tokens] (int32) continuing each prompt row.

    attention_mask: 1 = prompt token, 0 = padding (every row needs at least one token).
    greedy=False samples from softmax(logits / temperature), restricted to the top_k largest
    logits when given (ties at the k-th value are all kept), using `key` (required).
    eos_token_id: once a row emits it, the row continues with pad_token_id (default: the EOS id).
    Sampling options are traced, so changing them reuses the compiled programs.
    kv: the KV seam every layer's new keys / values pass before they are cached (`model.kv`; a
    `LayerKV` for one whose parameters differ per layer: a block program sees `model.layers.*`).
    prompt_bucket / cache_len: the padded prompt and cache lengths (default `bucket(T)` and
    `bucket(prompt_bucket + max_new_tokens)`); a caller that knows all its prompts up front passes
    those of the longest, so every prompt runs the same compiled programs.
    on_token(i, tokens_B, logits_BxV): called as each new token i is chosen (from the fp32 logits
    it was chosen from; arrays still on the device: blocking on them is the caller's choice).
    """
    prompt_ids_BxT = jnp.asarray(prompt_ids_BxT, jnp.int32)
    B, T = prompt_ids_BxT.shape
    mask_BxT = jnp.ones((B, T), bool) if attention_mask is None else jnp.asarray(attention_mask).astype(bool)
    if max_new_tokens <= 0:
        raise NVFP4ToolError(f"generate: max_new_tokens must be > 0, got {max_new_tokens}")
    if not bool(jnp.all(jnp.any(mask_BxT, axis=-1))):
        raise NVFP4ToolError("generate: a prompt row has no tokens (its attention mask is all zeros)")
    recurrent = _recurrent_kinds(model)
    if recurrent and not bool(jnp.all(mask_BxT[:, 1:] >= mask_BxT[:, :-1])):
        raise NVFP4ToolError(
            f"generate: a model with recurrent layers ({', '.join(recurrent)}) needs left-padded prompts "
            "(a recurrent state cannot skip padding after the prompt, as HF's generate requires too)"
        )
    if not greedy and key is None:
        raise NVFP4ToolError("generate: sampling (greedy=False) needs a PRNG key")
    if not greedy and not temperature > 0:
        raise NVFP4ToolError(f"generate: temperature must be > 0, got {temperature}")
    vocab_size = model.config.vocab_size
    if top_k is not None and not 1 <= top_k <= vocab_size:
        raise NVFP4ToolError(f"generate: top_k must be in 1..{vocab_size}, got {top_k}")
    options = _SamplingOptions(
        greedy=jnp.asarray(greedy),
        temperature=jnp.asarray(temperature if not greedy else 1.0, jnp.float32),
        top_k=jnp.asarray(top_k or vocab_size, jnp.int32),
        eos_token_id=jnp.asarray(-1 if eos_token_id is None else eos_token_id, jnp.int32),
        pad_token_id=jnp.asarray(
            pad_token_id if pad_token_id is not None else (eos_token_id if eos_token_id is not None else 0), jnp.int32
        ),
    )
    padded = prompt_bucket or bucket(T)  # left padding: masked slots, as a left-padded row always was
    cache_len = cache_len or bucket(padded + max_new_tokens)
    if padded < T or cache_len < padded + max_new_tokens:
        raise NVFP4ToolError(
            f"generate: prompt_bucket {padded} / cache_len {cache_len} cannot hold a prompt of {T} tokens "
            f"and {max_new_tokens} new ones"
        )
    prompt_ids_BxT = jnp.pad(prompt_ids_BxT, ((0, 0), (padded - T, 0)))
    mask_BxT = jnp.pad(mask_BxT, ((0, 0), (padded - T, 0)))
    linear, key = linear or model.linear, key if key is not None else jax.random.key(0)
    programs = _programs(jax.default_backend(), model.config.num_parameters() >= OPTIMIZE_PARAMS)
    layers = _Layers.of(model, Seam.of(linear) if isinstance(kv, LayerKV) else Seam.of(linear, kv), kv)
    cache = layers.empty_cache(B, cache_len)
    x_BxTxE, tables, prompt_mask, carry, last_index_B = programs.prefill_in(
        layers.outer_graphdef, layers.outer_state, prompt_ids_BxT, mask_BxT, key, cache_len=cache_len
    )
    x_BxTxE = layers.run(programs.layer, x_BxTxE, tables, prompt_mask, cache, jnp.asarray(0, jnp.int32))
    carry, logits_BxV = programs.prefill_out(
        layers.outer_graphdef, layers.outer_state, x_BxTxE, last_index_B, carry, options, seam=layers.head_seam
    )
    tokens = [carry.token_B]
    for i in range(max_new_tokens):
        if on_token is not None:
            on_token(i, carry.token_B, logits_BxV)
        if i + 1 < max_new_tokens:
            x_Bx1xE, tables, step_mask = programs.step_in(layers.outer_graphdef, layers.outer_state, carry)
            x_Bx1xE = layers.run(programs.layer, x_Bx1xE, tables, step_mask, cache, carry.slot)
            carry, logits_BxV = programs.step_out(
                layers.outer_graphdef, layers.outer_state, x_Bx1xE, carry, options, seam=layers.head_seam
            )
            tokens.append(carry.token_B)
    return jnp.stack(tokens, axis=-1).astype(jnp.int32)


def bucket(length: int) -> int:
    """The padded length of `length` slots: the next power of two, at least MIN_BUCKET (so a
    program serves every length up to it)."""
    return max(MIN_BUCKET, 1 << (max(length, 1) - 1).bit_length())


def _recurrent_kinds(model: CausalLM) -> list[str]:
    """The layer kinds whose blocks' decode state summarises the past (`blocks.Block.recurrent`)."""
    kinds = (model.config.layer_kind(i) for i, layer in enumerate(model.layers) if layer.recurrent)
    return list(dict.fromkeys(kinds))


class _SamplingOptions(NamedTuple):
    greedy: jax.Array  # bool: argmax instead of sampling
    temperature: jax.Array  # float32 > 0
    top_k: jax.Array  # int32: sample among the k largest logits (V = no restriction)
    eos_token_id: jax.Array  # int32, -1 = none
    pad_token_id: jax.Array  # int32: emitted after EOS


class _Carry(NamedTuple):
    """What a decode step reads besides the cache: the token to feed and where it goes."""

    token_B: jax.Array  # int32: the last token chosen (the next step's input)
    done_B: jax.Array  # bool: the row emitted EOS
    key: jax.Array  # PRNG key
    slot: jax.Array  # int32 []: the cache slot of token_B
    position_B: jax.Array  # int32: token_B's position (the row's real tokens before it)
    key_valid_BxS: jax.Array  # bool: the cache slots that are not padding
    key_positions_BxS: jax.Array  # int32: each cache slot's position


@dataclasses.dataclass
class _Layers:
    """A model split for generation: its outer modules (embedding, final norm, LM head) and each
    decoder layer as (its block program's graphdef, its weights, its aux), so the layers alike
    (`transformer.layer_program`) share one compiled program; the seam every layer runs."""

    model: CausalLM
    outer_graphdef: nnx.GraphDef
    outer_state: nnx.State
    blocks: list[tuple[nnx.GraphDef, nnx.State, Any]]
    seam: Seam
    head_seam: Seam

    @classmethod
    def of(cls, model: CausalLM, seam: Seam, kv: KVFn | LayerKV) -> _Layers:
        if isinstance(kv, LayerKV):
            seam = dataclasses.replace(seam, kv=kv.tap)
        aux_of = kv.aux_of if isinstance(kv, LayerKV) else (lambda layer: None)
        config = model.config
        outer_graphdef, outer_state = nnx.split(without_layers(model))
        blocks = [
            (block_program(config, *layer_program(config, i)), nnx.state(model.layers[i]), aux_of(i))
            for i in range(config.num_layers)
        ]
        return cls(model, outer_graphdef, outer_state, blocks, seam, seam.at(None))

    def empty_cache(self, batch: int, length: int) -> list:
        """Each layer's decode state before a prefill of `length` slots (None: it keeps none)."""
        return [layer.empty_state(batch, length, self.model.compute_dtype) for layer in self.model.layers]

    def run(self, program, x_BxTxE, tables, mask: AttentionMask, cache: list, write_index):
        """x through every layer in order, each layer's decode state replaced in `cache` (donated)."""
        for i, (graphdef, state, aux) in enumerate(self.blocks):
            cos, sin = layer_cos_sin(self.model.config, tables, i)
            x_BxTxE, cache[i] = program(
                graphdef, state, x_BxTxE, cos, sin, mask, cache[i], write_index, aux, seam=self.seam
            )
            if _in_process_collectives(x_BxTxE):
                # XLA:CPU runs a program's devices on one thread pool: two layer programs in flight
                # at once, each with an all-reduce, can leave one waiting for a device thread the
                # other holds (a CI run aborted on a 40 s rendezvous timeout, 2 CPU devices on 2 cores)
                x_BxTxE.block_until_ready()
        return x_BxTxE


def _in_process_collectives(x: jax.Array) -> bool:
    """x spans several CPU devices (its programs' collectives meet inside this process)."""
    devices = x.sharding.device_set
    return len(devices) > 1 and next(iter(devices)).platform == "cpu"


def _prefill_in(graphdef, state, prompt_ids_BxT, mask_BxT, key, *, cache_len):
    """The prompt embedded, its RoPE tables and mask over a cache of `cache_len` slots, the
    carry before the first token, and each row's last real slot."""
    outer = nnx.merge(graphdef, state)
    B, T = prompt_ids_BxT.shape
    key_valid_BxS = jnp.concatenate([mask_BxT, jnp.ones((B, cache_len - T), bool)], axis=-1)
    prompt_positions_BxT = default_positions(mask_BxT)
    first_position_B = jnp.sum(mask_BxT, axis=-1).astype(jnp.int32)
    key_positions_BxS = jnp.concatenate(
        [prompt_positions_BxT, first_position_B[:, None] + jnp.arange(cache_len - T)], axis=-1
    )
    prompt_mask = AttentionMask.explicit(  # each attention layer narrows it to its window (`within`)
        attention_allowed(jnp.arange(T), key_valid_BxS, None),
        mask_BxT,
        query_positions_BxT=prompt_positions_BxT,
        key_positions_BxS=key_positions_BxS,
    )
    # The next-token logits of a row sit at its last real token (differs from T-1 with right padding).
    last_index_B = T - 1 - jnp.argmax(mask_BxT[:, ::-1], axis=-1)
    carry = _Carry(
        jnp.zeros((B,), jnp.int32),
        jnp.zeros((B,), bool),
        key,
        jnp.asarray(T, jnp.int32),
        first_position_B,
        key_valid_BxS,
        key_positions_BxS,
    )
    return embed(outer, prompt_ids_BxT), rope(outer, prompt_positions_BxT), prompt_mask, carry, last_index_B


def _prefill_out(graphdef, state, x_BxTxE, last_index_B, carry: _Carry, options, *, seam):
    """The first new token from the last layer's output at each row's last real slot: (carry, its
    logits [B, V])."""
    x_Bx1xE = jnp.take_along_axis(x_BxTxE, last_index_B[:, None, None], axis=1)
    logits_BxV = lm_logits(nnx.merge(graphdef, state), x_Bx1xE, seam)[0][:, 0]
    key, first_key = jax.random.split(carry.key)
    token_B, done_B = _pick(logits_BxV, first_key, carry.done_B, options)
    return carry._replace(token_B=token_B, done_B=done_B, key=key), logits_BxV


def _step_in(graphdef, state, carry: _Carry):
    """carry.token_B embedded at its position, its RoPE tables and its mask over the cache."""
    outer = nnx.merge(graphdef, state)
    position_Bx1 = carry.position_B[:, None]
    step_mask = AttentionMask.explicit(
        attention_allowed(carry.slot[None], carry.key_valid_BxS, None),
        query_positions_BxT=position_Bx1,
        key_positions_BxS=carry.key_positions_BxS,
    )
    return embed(outer, carry.token_B[:, None]), rope(outer, position_Bx1), step_mask


def _step_out(graphdef, state, x_Bx1xE, carry: _Carry, options, *, seam):
    """The next token from the last layer's output: (the carry of the next step, its logits [B, V])."""
    logits_BxV = lm_logits(nnx.merge(graphdef, state), x_Bx1xE, seam)[0][:, 0]
    key, step_key = jax.random.split(carry.key)
    token_B, done_B = _pick(logits_BxV, step_key, carry.done_B, options)
    carry = carry._replace(
        token_B=token_B, done_B=done_B, key=key, slot=carry.slot + 1, position_B=carry.position_B + 1
    )
    return carry, logits_BxV


def _layer(graphdef, state, x_BxTxE, cos_BxTxD, sin_BxTxD, mask, cache, write_index, aux, *, seam):
    """One decoder layer over a prefill chunk or one token: (its output, its decode state with the
    chunk written at `write_index`)."""
    y_BxTxE, cache, _ = nnx.merge(graphdef, state)(
        x_BxTxE, cos_BxTxD, sin_BxTxD, mask, cache, write_index, seam.with_aux(aux)
    )
    return y_BxTxE, cache


def _pick(logits_BxV, key, done_B, options: _SamplingOptions):
    """The next token of each row (pad_token_id after EOS) and the rows done after it."""
    token_B = jnp.where(done_B, options.pad_token_id, _select(logits_BxV, key, options))
    return token_B, done_B | (token_B == options.eos_token_id)


def _select(logits_BxV, key, options: _SamplingOptions):
    greedy_B = jnp.argmax(logits_BxV, axis=-1)
    scaled_BxV = logits_BxV / options.temperature
    kth_largest_B = jnp.take(jnp.sort(scaled_BxV, axis=-1), logits_BxV.shape[-1] - options.top_k, axis=-1)
    scaled_BxV = jnp.where(scaled_BxV < kth_largest_B[:, None], -jnp.inf, scaled_BxV)
    sampled_B = jax.random.categorical(key, scaled_BxV, axis=-1)
    return jnp.where(options.greedy, greedy_B, sampled_B).astype(jnp.int32)


class _Programs(NamedTuple):
    prefill_in: Callable
    prefill_out: Callable
    step_in: Callable
    step_out: Callable
    layer: Callable  # a prefill chunk's or a step's (two shapes), its decode state donated


def _programs(backend: str, optimize: bool = False) -> _Programs:
    """The jitted programs of `backend` (on the CPU with `_CPU_COMPILER_OPTIONS[optimize]`), each
    compiled once per shape and shared by every model and layer of that shape: the same objects
    however the arguments are spelled (`functools.cache` keys `(b,)` and `(b, False)` apart)."""
    return _jitted(backend, bool(optimize))


@functools.cache
def _jitted(backend: str, optimize: bool) -> _Programs:
    options = _CPU_COMPILER_OPTIONS[optimize] if backend == "cpu" else None
    return _Programs(
        prefill_in=jax.jit(_prefill_in, static_argnames=("graphdef", "cache_len"), compiler_options=options),
        prefill_out=jax.jit(_prefill_out, static_argnames=("graphdef", "seam"), compiler_options=options),
        step_in=jax.jit(_step_in, static_argnames=("graphdef",), compiler_options=options),
        step_out=jax.jit(_step_out, static_argnames=("graphdef", "seam"), compiler_options=options),
        layer=jax.jit(
            _layer, static_argnames=("graphdef", "seam"), donate_argnames=("cache",), compiler_options=options
        ),
    )
