"""The seams: every projection of the model (and the LM head) calls one pluggable function, every
attention hands its keys and values to another, and what they record comes back as a value.

`LinearFn(x_...xK, w_NxK, b_N, name) -> y_...xN` (HF orientation, K the contraction axis); `Tap` /
`KVTap` record, `Plain` makes a LinearFn a Tap; a `Seam` is what the model is called with; `Side`
holds the taps' records and the routers' logits.
Design notes: docs/design/model.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple, Protocol

import jax

from nvfp4tool.model.kv import KVFn, default_kv
from nvfp4tool.numerics import dense


class LinearFn(Protocol):
    """`y = x @ w.T + b` for the linear layer called `name`."""

    def __call__(self, x: jax.Array, w_NxK: jax.Array, b_N: jax.Array | None, *, name: str) -> jax.Array: ...


def default_linear(x: jax.Array, w_NxK: jax.Array, b_N: jax.Array | None, *, name: str) -> jax.Array:
    """Plain dot in the compute dtype (= x.dtype) with fp32 accumulation; bias added in fp32."""
    del name  # every layer is treated the same
    return dense(x, w_NxK, b_N)


class Tap(Protocol):
    """A linear seam that may record: (y, record) where record is None or a pytree of arrays."""

    def __call__(
        self, x: jax.Array, w_NxK: Any, b_N: jax.Array | None, *, name: str, aux: Any
    ) -> tuple[jax.Array, Any]: ...


class KVTap(Protocol):
    """A KV seam that may record: ((k, v), record) where record is None or a pytree of arrays."""

    def __call__(
        self, k_BxTxKVxD: jax.Array, v_BxTxKVxD: jax.Array, *, name: str, aux: Any
    ) -> tuple[tuple[jax.Array, jax.Array], Any]: ...


@dataclasses.dataclass(frozen=True)
class Plain:
    """A LinearFn as a Tap that records nothing."""

    linear: LinearFn

    def __call__(self, x, w_NxK, b_N, *, name, aux):
        return self.linear(x, w_NxK, b_N, name=name), None


@dataclasses.dataclass(frozen=True)
class PlainKV:
    """A KVFn as a KVTap that records nothing."""

    kv: KVFn = default_kv

    def __call__(self, k, v, *, name, aux):
        return self.kv(k, v, name=name), None


class Side(NamedTuple):
    """What a module returns beside its output: records of the taps (module name -> record) and
    the routers' logits (router name -> [B, T, num_experts])."""

    records: dict[str, Any]
    router_logits: dict[str, jax.Array]


def merged(*sides: Side) -> Side:
    """The side results of modules run one after another, in order."""
    return Side(
        {k: v for s in sides for k, v in s.records.items()}, {k: v for s in sides for k, v in s.router_logits.items()}
    )


def _no_aux(layer: int | None) -> None:
    """No aux for any layer."""
    del layer


def _alike(layer: int) -> None:
    """Every layer treated alike."""
    del layer


@dataclasses.dataclass(frozen=True)
class Seam:
    """The seams of one model call (see the module docstring). `aux` is the current layer's."""

    linear: Tap = Plain(default_linear)
    kv: KVTap = PlainKV()
    all_experts: bool = False
    aux_of: Callable[[int | None], Any] = _no_aux
    treatment: Callable[[int], Hashable] = _alike
    aux: Any = None

    @classmethod
    def of(cls, linear: LinearFn, kv: KVFn = default_kv) -> Seam:
        """The seam of a plain LinearFn and KVFn (no records)."""
        return cls(Plain(linear), PlainKV(kv))

    def at(self, layer: int | None) -> Seam:
        """This seam inside layer `layer` (None: the LM head): its aux is `aux_of(layer)`."""
        return dataclasses.replace(self, aux=self.aux_of(layer))

    def with_aux(self, aux: Any) -> Seam:
        """This seam with the layer's aux `aux` (a scanned run's slice of the stacked aux)."""
        return dataclasses.replace(self, aux=aux)

    def project(self, x: jax.Array, w_NxK: Any, b_N: jax.Array | None, name: str) -> tuple[jax.Array, Side]:
        """The linear `name`'s output and its record."""
        y, record = self.linear(x, w_NxK, b_N, name=name, aux=self.aux)
        return y, Side({} if record is None else {name: record}, {})

    def cache(self, k: jax.Array, v: jax.Array, name: str) -> tuple[tuple[jax.Array, jax.Array], Side]:
        """The keys and values the attention `name` caches and uses, and the KV tap's record."""
        kv, record = self.kv(k, v, name=name, aux=self.aux)
        return kv, Side({} if record is None else {name: record}, {})
