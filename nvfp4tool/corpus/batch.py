"""`Batch`: the rows one training or eval step reads, and which of their tokens carry loss.

Rows are `seq_len + 1` tokens (tokens 0..T-1 predict 1..T). `segments` numbers the documents packed
into a row (1, 2, ... in order; 0 marks padding); None is one stream with no boundaries
(`packing=concat`, the bytes every earlier run trained on). `loss` marks the tokens that are
targets carrying loss (a chat's assistant tokens); None is every token.
Design notes: docs/design/data.md.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Batch(NamedTuple):
    """Rows [B, T+1] and their optional segment ids and loss marks (numpy on the host, jax
    arrays on the device: a NamedTuple is a pytree, None leaves included)."""

    tokens: np.ndarray  # [B, T+1] int32
    segments: np.ndarray | None = None  # [B, T+1] int32: 1, 2, ... per document, 0 = padding
    loss: np.ndarray | None = None  # [B, T+1] bool: token t is a target that carries loss

    def targets_weight(self) -> np.ndarray | None:
        """[B, T] bool, which of the T next-token predictions count (None: all of them): the
        target is in the same document as its input (no prediction across a boundary or from
        or into padding) and carries loss. Written with the arrays' own operators over the last
        axis, so the same rule runs on numpy rows, on jax arrays inside the train step, and on
        a step's micro-batches [A, B/A, T+1]."""
        weight = None
        if self.segments is not None:
            weight = (self.segments[..., 1:] == self.segments[..., :-1]) & (self.segments[..., 1:] != 0)
        if self.loss is not None:
            weight = self.loss[..., 1:] if weight is None else weight & self.loss[..., 1:]
        return weight
