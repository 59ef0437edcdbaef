"""Rematerialization of the decoder blocks (`remat=none|block|full`): what the backward pass keeps
from the forward pass and what it recomputes. Every level gives the same numbers; only memory and
time change. none keeps everything; block keeps each block's input and its linears' outputs (tagged
by `linear_output`); full keeps only each block's input (`nothing_saveable`).
Design notes: docs/design/model.md.
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
