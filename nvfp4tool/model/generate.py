"""Autoregressive generation with a decode state (greedy or temperature / top-k sampling): each
block's own (`transformer.empty_decode_state`: an attention's KV cache, a recurrent mixer's state).

Two jitted programs, each compiled once per (graphdef, bucket, batch) and reused across prompts,
prompt lengths, token counts and models of one shape (the weights are arguments): a prefill over
the prompt left-padded to a power-of-two `bucket` fills a cache of a bucketed length, then a decode
step runs once per token from a Python loop (`on_token` sees each token and its logits). Generated
tokens go to cache slots Tb, Tb+1, ...; their positions continue from each row's own count of real
prompt tokens, and padded slots stay masked, so padding (either side, any amount) gives the same
tokens as an unpadded prompt. After a row emits `eos_token_id`, it continues with `pad_token_id`
(as HF's generate).
Design notes: docs/design/model.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.model.attention import AttentionMask, attention_allowed
from nvfp4tool.model.kv import KVFn, default_kv
from nvfp4tool.model.linear import LinearFn
from nvfp4tool.model.transformer import CausalLM, DecodeState, default_positions, empty_decode_state, forward_with_cache

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
    kv: KVFn = default_kv,
    on_token: OnToken | None = None,
) -> jax.Array:
    """New tokens [B, max_new_tokens] (int32) continuing each prompt row.

    attention_mask: 1 = prompt token, 0 = padding (every row needs at least one token).
    greedy=False samples from softmax(logits / temperature), restricted to the top_k largest
    logits when given (ties at the k-th value are all kept), using `key` (required).
    eos_token_id: once a row emits it, the row continues with pad_token_id (default: the EOS id).
    Sampling options are traced, so changing them reuses the compiled programs.
    kv: the KV seam every layer's new keys / values pass before they are cached (`model.kv`).
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
    padded = bucket(T)  # left padding: masked slots, as a left-padded row always was
    prompt_ids_BxT = jnp.pad(prompt_ids_BxT, ((0, 0), (padded - T, 0)))
    mask_BxT = jnp.pad(mask_BxT, ((0, 0), (padded - T, 0)))
    graphdef, state = nnx.split(model)
    linear, key = linear or model.linear, key if key is not None else jax.random.key(0)
    prefill, step = _programs(jax.default_backend(), model.config.num_parameters() >= OPTIMIZE_PARAMS)
    carry, cache, logits_BxV = prefill(
        graphdef,
        state,
        prompt_ids_BxT,
        mask_BxT,
        key,
        options,
        cache_len=bucket(padded + max_new_tokens),
        linear=linear,
        kv=kv,
    )
    tokens = [carry.token_B]
    for i in range(max_new_tokens):
        if on_token is not None:
            on_token(i, carry.token_B, logits_BxV)
        if i + 1 < max_new_tokens:
            carry, cache, logits_BxV = step(graphdef, state, carry, cache, options, linear=linear, kv=kv)
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


def _prefill(graphdef, state, prompt_ids_BxT, mask_BxT, key, options, *, cache_len, linear, kv):
    """The prompt through the model into a fresh cache of `cache_len` slots: (carry, cache, the
    first new token's logits [B, V])."""
    model = nnx.merge(graphdef, state)
    B, T = prompt_ids_BxT.shape
    cache = empty_decode_state(model, B, cache_len)
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
    next_logits_BxV, cache = forward_with_cache(
        model, prompt_ids_BxT, prompt_positions_BxT, prompt_mask, cache, 0, linear, kv, logits_at_B=last_index_B
    )
    key, first_key = jax.random.split(key)
    token_B, done_B = _pick(next_logits_BxV, first_key, jnp.zeros((B,), bool), options)
    carry = _Carry(token_B, done_B, key, jnp.asarray(T, jnp.int32), first_position_B, key_valid_BxS, key_positions_BxS)
    return carry, cache, next_logits_BxV


def _step(graphdef, state, carry: _Carry, cache: DecodeState, options, *, linear, kv):
    """One token: carry.token_B through the model at its slot (the cache updated in place): (the
    carry of the next token, the cache, that token's logits [B, V])."""
    model = nnx.merge(graphdef, state)
    position_Bx1 = carry.position_B[:, None]
    step_mask = AttentionMask.explicit(
        attention_allowed(carry.slot[None], carry.key_valid_BxS, None),
        query_positions_BxT=position_Bx1,
        key_positions_BxS=carry.key_positions_BxS,
    )
    logits_Bx1xV, cache = forward_with_cache(
        model, carry.token_B[:, None], position_Bx1, step_mask, cache, carry.slot, linear, kv
    )
    key, step_key = jax.random.split(carry.key)
    token_B, done_B = _pick(logits_Bx1xV[:, 0], step_key, carry.done_B, options)
    carry = carry._replace(
        token_B=token_B, done_B=done_B, key=key, slot=carry.slot + 1, position_B=carry.position_B + 1
    )
    return carry, cache, logits_Bx1xV[:, 0]


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


def _programs(backend: str, optimize: bool = False):
    """The jitted (prefill, step) of `backend` (on the CPU with `_CPU_COMPILER_OPTIONS[optimize]`),
    each compiled once per shape and shared by every model of that shape: the same two objects
    however the arguments are spelled (`functools.cache` keys `(b,)` and `(b, False)` apart)."""
    return _jitted(backend, bool(optimize))


@functools.cache
def _jitted(backend: str, optimize: bool):
    options = _CPU_COMPILER_OPTIONS[optimize] if backend == "cpu" else None
    prefill = jax.jit(_prefill, static_argnames=("graphdef", "cache_len", "linear", "kv"), compiler_options=options)
    step = jax.jit(
        _step, static_argnames=("graphdef", "linear", "kv"), donate_argnames=("cache",), compiler_options=options
    )
    return prefill, step
