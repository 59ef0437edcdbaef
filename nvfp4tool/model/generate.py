"""Autoregressive generation with a decode state (greedy or temperature / top-k sampling): each
block's own (`transformer.empty_decode_state`: an attention's KV cache, a recurrent mixer's state).

One jitted program: a prefill over the (left- or right-padded) prompt fills the cache, then a
`lax.scan` decodes one token per step. Generated tokens go to cache slots T, T+1, ...; their
positions continue from each row's own count of real prompt tokens, and padded slots stay masked,
so both padding sides give the same tokens as an unpadded prompt. After a row emits
`eos_token_id`, it continues with `pad_token_id` (as HF's generate).
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.model.attention import AttentionMask, attention_allowed
from nvfp4tool.model.kv import KVFn, default_kv
from nvfp4tool.model.linear import LinearFn
from nvfp4tool.model.transformer import CausalLM, default_positions, empty_decode_state, forward_with_cache


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
) -> jax.Array:
    """New tokens [B, max_new_tokens] (int32) continuing each prompt row.

    attention_mask: 1 = prompt token, 0 = padding (every row needs at least one token).
    greedy=False samples from softmax(logits / temperature), restricted to the top_k largest
    logits when given (ties at the k-th value are all kept), using `key` (required).
    eos_token_id: once a row emits it, the row continues with pad_token_id (default: the EOS id).
    Sampling options are traced, so changing them reuses the compiled program.
    kv: the KV seam every layer's new keys / values pass before they are cached (`model.kv`).
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
    graphdef, state = nnx.split(model)
    return _generate(
        graphdef,
        state,
        prompt_ids_BxT,
        mask_BxT,
        key if key is not None else jax.random.key(0),
        options,
        max_new_tokens=max_new_tokens,
        linear=linear or model.linear,
        kv=kv,
    )


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


@partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "linear", "kv"))
def _generate(graphdef, state, prompt_ids_BxT, mask_BxT, key, options, *, max_new_tokens, linear, kv):
    model = nnx.merge(graphdef, state)
    B, T = prompt_ids_BxT.shape
    S = T + max_new_tokens
    cache = empty_decode_state(model, B, S)
    key_valid_BxS = jnp.concatenate([mask_BxT, jnp.ones((B, max_new_tokens), bool)], axis=-1)

    prompt_positions_BxT = default_positions(mask_BxT)
    first_position_B = jnp.sum(mask_BxT, axis=-1).astype(jnp.int32)
    key_positions_BxS = jnp.concatenate(
        [prompt_positions_BxT, first_position_B[:, None] + jnp.arange(max_new_tokens)], axis=-1
    )
    prompt_mask = AttentionMask.explicit(  # each attention layer narrows it to its window (`within`)
        attention_allowed(jnp.arange(T), key_valid_BxS, None),
        mask_BxT,
        query_positions_BxT=prompt_positions_BxT,
        key_positions_BxS=key_positions_BxS,
    )
    logits_BxTxV, cache = forward_with_cache(
        model, prompt_ids_BxT, prompt_positions_BxT, prompt_mask, cache, 0, linear, kv
    )
    # The next-token logits of a row sit at its last real token (differs from T-1 with right padding).
    last_index_B = T - 1 - jnp.argmax(mask_BxT[:, ::-1], axis=-1)
    next_logits_BxV = jnp.take_along_axis(logits_BxTxV, last_index_B[:, None, None], axis=1)[:, 0]

    def pick(logits_BxV, step_key, done_B):
        token_B = jnp.where(done_B, options.pad_token_id, _select(logits_BxV, step_key, options))
        return token_B, done_B | (token_B == options.eos_token_id)

    key, first_key = jax.random.split(key)
    token_B, done_B = pick(next_logits_BxV, first_key, jnp.zeros((B,), bool))

    def step(carry, i):
        token_B, done_B, cache, key = carry
        slot = T + i  # cache slot of `token_B`
        position_Bx1 = (first_position_B + i)[:, None]
        step_mask = AttentionMask.explicit(
            attention_allowed(slot[None], key_valid_BxS, None),
            query_positions_BxT=position_Bx1,
            key_positions_BxS=key_positions_BxS,
        )
        logits_Bx1xV, cache = forward_with_cache(
            model, token_B[:, None], position_Bx1, step_mask, cache, slot, linear, kv
        )
        key, step_key = jax.random.split(key)
        next_B, done_B = pick(logits_Bx1xV[:, 0], step_key, done_B)
        return (next_B, done_B, cache, key), token_B

    (last_B, _, _, _), tokens_NxB = jax.lax.scan(step, (token_B, done_B, cache, key), jnp.arange(max_new_tokens - 1))
    return jnp.concatenate([tokens_NxB.T, last_B[:, None]], axis=-1).astype(jnp.int32)


def _select(logits_BxV, key, options: _SamplingOptions):
    greedy_B = jnp.argmax(logits_BxV, axis=-1)
    scaled_BxV = logits_BxV / options.temperature
    kth_largest_B = jnp.take(jnp.sort(scaled_BxV, axis=-1), logits_BxV.shape[-1] - options.top_k, axis=-1)
    scaled_BxV = jnp.where(scaled_BxV < kth_largest_B[:, None], -jnp.inf, scaled_BxV)
    sampled_B = jax.random.categorical(key, scaled_BxV, axis=-1)
    return jnp.where(options.greedy, greedy_B, sampled_B).astype(jnp.int32)
