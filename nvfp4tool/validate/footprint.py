"""What a validation holds above the process's fixed overhead (imports, compiled programs), per model:
the estimate `--offload auto` compares with the available memory and prints.

    need = footprint(config, stored, options, samples=S, seq_len=T)   # a Footprint (bytes)
    need.held, need.streamed, need.working                            # whole model / one layer / besides weights

Each term has one owner, shared with eval where they are the same: a held forward
(`layerwise.held_forward_bytes`), a streamed model's weights and windows (`layerwise.streamed_bytes`),
what the per-token metrics hold (`metrics.working_bytes`), generation's decoded copies
(`simulate.DECODE_ONCE_SHARE`).
Design notes: docs/design/validate.md.
"""

from __future__ import annotations

from typing import NamedTuple

from nvfp4tool.config import ModelConfig
from nvfp4tool.export.simulate import DECODE_ONCE_SHARE
from nvfp4tool.model.layerwise import held_forward_bytes, streamed_bytes
from nvfp4tool.numerics import metrics


class Footprint(NamedTuple):
    """A model's estimated peak above the fixed overhead, in bytes."""

    weights: int  # its weights as stored
    working: int  # held: what it needs besides its weights (the larger of `compare` and `generation`)
    streamed: int  # streamed: outer tensors, one layer, the windows' hidden states and `compare`

    @property
    def held(self) -> int:
        return self.weights + self.working


def compare_bytes(config: ModelConfig, batch: int, seq_len: int) -> int:
    """One batch of the logits pass and its comparison, the larger of two phases: the forward
    (`held_forward_bytes`) beside the last batch's logits; then its fp32 logits and the reference
    batch (read from the spool, or the spooled copy) with what the per-token metrics hold
    (`metrics.working_bytes`)."""
    logits = 4 * batch * seq_len * config.vocab_size
    forward = held_forward_bytes(config, batch, seq_len) + logits
    compared = 2 * logits + metrics.working_bytes(batch * seq_len, config.vocab_size)
    return max(forward, compared)


def generation_bytes(config: ModelConfig, weights: int, prompts: int, prompt_len: int, gen_tokens: int) -> int:
    """Greedy generation by a held model of `weights` stored bytes: the weights decoded once (at
    most `DECODE_ONCE_SHARE` of them, `simulate.for_generation`), the fp32 KV cache of every
    prompt and the prefill's forward."""
    cache = 2 * 4 * config.num_layers * config.num_kv_heads * config.head_dim * prompts * (prompt_len + gen_tokens)
    return int(DECODE_ONCE_SHARE * weights) + cache + held_forward_bytes(config, prompts, prompt_len)


def footprint(config: ModelConfig, stored: dict[str, int], options, *, samples: int, seq_len: int) -> Footprint:
    """The Footprint of a model whose tensors as stored are `stored` ({name: bytes}), validated on
    `samples` windows of `seq_len` tokens with `options` (a ValidateOptions: batch size, prompts)."""
    weights = sum(stored.values())
    compare = compare_bytes(config, min(options.batch_size, samples), seq_len)
    prompt_len = min(options.prompt_len, seq_len)
    generation = generation_bytes(config, weights, min(options.prompts, samples), prompt_len, options.gen_tokens)
    return Footprint(
        weights=weights,
        working=max(compare, generation),
        streamed=streamed_bytes(config, stored, samples, seq_len) + compare,
    )
