"""The seams: every projection of the model (and the LM head) calls one pluggable function, every
attention hands its keys and values to another, and what they record comes back as a value.

A `LinearFn` gets the activation `x_...xK`, the weight in HF orientation `w_NxK` (K = the
contraction axis, the one NVFP4 quantizes along), an optional bias `b_N`, and the layer's HF
module name (`"model.layers.3.mlp.gate_proj"`, `"lm_head"`; in a scanned run of layers, or a
layer-by-layer block program, the index is `*`: `"model.layers.*.mlp.gate_proj"`), and returns
`y_...xN` in the dtype of `x`. Recipes (bf16 / fp8 / nvfp4) are LinearFns chosen by name; the
model code never changes. Embedding lookup, norms and attention math (QK^T, softmax, PV) do not
go through the seam.

A `Tap` is a linear seam that records: `tap(x, w, b, name=, aux=) -> (y, record | None)`, `aux`
being what the caller hands the layer (its SR keys and quantized weights in training, another
model's weights, the export's scales); a `KVTap` is the KV seam that records,
`kv_tap(k, v, name=, aux=) -> ((k, v), record | None)`. `Plain` makes a LinearFn a Tap.

A `Seam` is what the model is called with, explicitly: the linear tap, the KV tap, whether sparse
MLPs show every token to every expert (`all_experts`: calibration; the output is unchanged,
unrouted experts still weigh 0), the aux of each layer (`aux_of(i)`, `aux_of(None)` for the LM
head) and which layers are treated alike (`treatment(i)`: consecutive layers of one kind and
one treatment form one scanned run, `model.transformer`). Modules return their side results as
values (`Side`: the taps' records by name and the routers' logits), never through containers
filled while tracing, so `jax.checkpoint` and `jax.lax.scan` carry them like any output.
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
