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

Side results (input amax, router logits) are outputs of the checkpointed block like any other
(`linear.Side`), so the checkpoint needs no special case.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.ad_checkpoint import checkpoint_name

REMAT_LEVELS = ("none", "block", "full")
LINEAR_OUT = "linear_out"  # the checkpoint name of every linear layer's output
_POLICIES = {
    "block": jax.checkpoint_policies.save_only_these_names(LINEAR_OUT),
    "full": jax.checkpoint_policies.nothing_saveable,
}


def linear_output(y: jax.Array) -> jax.Array:
    """`y`, tagged as a linear layer's output (what `block` keeps)."""
    return checkpoint_name(y, LINEAR_OUT)


def checkpointed(call: Callable, level: str) -> Callable:
    """`call(*pytrees of arrays)` under the checkpoint policy of `level` (`none`: `call` itself)."""
    return call if level == "none" else jax.checkpoint(call, policy=_POLICIES[level])
