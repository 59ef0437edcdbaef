"""The KV seam: every attention layer hands its keys and values to one pluggable function before
they are cached and attended to.

A `KVFn` gets `k_BxTxKVxD` (after k_norm and RoPE: exactly what a serving engine writes into its
KV cache), `v_BxTxKVxD`, and the attention module's HF name (`"model.layers.3.self_attn"`; with
scanned layers or in a `model.layerwise` block program the index is `*`), and returns the (k, v)
the layer caches and uses, in the same shapes and dtypes. The default is the identity (an exact
no-op); export calibration records the K / V amax through it and validate's served simulation
quantizes them to the FP8 KV cache with the stored scales (`export.simulate.ServedKVTap`, per
layer through a `LayerKV` in generation).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import jax


class KVFn(Protocol):
    """(k, v) as cached and used by the attention called `name`."""

    def __call__(self, k_BxTxKVxD: jax.Array, v_BxTxKVxD: jax.Array, *, name: str) -> tuple[jax.Array, jax.Array]: ...


def default_kv(k_BxTxKVxD: jax.Array, v_BxTxKVxD: jax.Array, *, name: str) -> tuple[jax.Array, jax.Array]:
    """The identity: keys and values cached as computed (a BF16 / fp32 KV cache)."""
    del name  # every layer is treated the same
    return k_BxTxKVxD, v_BxTxKVxD


@dataclasses.dataclass(frozen=True)
class LayerKV:
    """A KV seam whose parameters differ per layer, for a caller that runs every layer with one
    block program (`model.generate`): `tap` (a `model.linear.KVTap`) gets layer i's `aux_of(i)`
    as its aux (an array pytree, traced), so alike layers share one compiled program."""

    tap: Any
    aux_of: Callable[[int], Any] = dataclasses.field(compare=False, hash=False)
