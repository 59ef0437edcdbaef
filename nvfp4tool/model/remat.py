"""Rematerialization of the decoder blocks (`remat=none|block|full`): what the backward pass keeps
from the forward pass and what it recomputes. Every level gives the same numbers; only memory and
time change.

none:  every intermediate the gradient needs is kept (fastest, most memory).
block: each block runs under `jax.checkpoint` keeping its input and the outputs of its linear
       layers (q/k/v/o, gate/up/down, the router: tagged by `linear_output`); the backward
       pass recomputes the norms, RoPE, attention scores and softmax, SwiGLU's product and the
       quantizers of the forward GEMMs, but no forward GEMM. Tagged names, not
       `dots_with_no_batch_dims_saveable`: that policy keys on the primitive, and the recipes'
       quantizers contain dots too (RHT16 is a 16x16 matmul over the whole operand), which it
       would keep.
full:  only each block's input is kept (`nothing_saveable`): the backward pass runs every block's
       forward again.

Trace-time side outputs: a linear seam may fill Python dicts while it is traced (a recipe's
input amax, MoE router logits) and lists them in its `sinks` attribute. `checkpointed` returns
what the block wrote into them as outputs of the checkpointed function and writes those values
(of the caller's trace) back, so no tracer of the checkpoint's own trace leaks.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping

import jax
from jax.ad_checkpoint import checkpoint_name

REMAT_LEVELS = ("none", "block", "full")
LINEAR_OUT = "linear_out"  # the checkpoint name of every linear layer's output
_POLICIES = {"block": jax.checkpoint_policies.save_only_these_names(LINEAR_OUT),
             "full": jax.checkpoint_policies.nothing_saveable}


def linear_output(y: jax.Array) -> jax.Array:
    """`y`, tagged as a linear layer's output (what `block` keeps)."""
    return checkpoint_name(y, LINEAR_OUT)


def sinks(linear: Callable) -> tuple[MutableMapping, ...]:
    """The dicts a linear seam fills at trace time (its `sinks` attribute; none by default)."""
    return tuple(getattr(linear, "sinks", ()))


def checkpointed(call: Callable, level: str, linear: Callable) -> Callable:
    """`call(*pytrees of arrays)` under the checkpoint policy of `level` (`none`: `call` itself);
    `linear` is the seam `call` uses, whose `sinks` are carried out of the checkpoint."""
    if level == "none":
        return call
    filled = sinks(linear)

    def with_side_outputs(*args):
        before = [dict(sink) for sink in filled]
        out = call(*args)
        written = [{k: v for k, v in sink.items() if k not in old or v is not old[k]}
                   for sink, old in zip(filled, before)]
        return out, written

    remat = jax.checkpoint(with_side_outputs, policy=_POLICIES[level])

    def run(*args):
        out, written = remat(*args)
        for sink, values in zip(filled, written):
            sink.update(values)
        return out

    return run
