"""The linear seam: every projection of the model (and the LM head) calls one pluggable function.

A `LinearFn` gets the activation `x_...xK`, the weight in HF orientation `w_NxK` (K = the
contraction axis, the one NVFP4 quantizes along), an optional bias `b_N`, and the layer's HF
module name (`"model.layers.3.mlp.gate_proj"`, `"lm_head"`; with scanned layers the index is
`*`: `"model.layers.*.mlp.gate_proj"`), and returns `y_...xN` in the dtype of `x`. Recipes
(bf16 / fp8 / nvfp4) are LinearFns chosen by name; the model code never changes.
Embedding lookup, norms and attention math (QK^T, softmax, PV) do not go through the seam.
A seam with `routes_all_experts = True` (calibration) asks every sparse MLP to run every expert on
every token (the layer's output is unchanged: unrouted experts still weigh 0).
"""

from __future__ import annotations

from typing import Protocol

import jax

from nvfp4tool.numerics import dense


class LinearFn(Protocol):
    """`y = x @ w.T + b` for the linear layer called `name`."""

    def __call__(self, x: jax.Array, w_NxK: jax.Array, b_N: jax.Array | None, *,
                 name: str) -> jax.Array: ...


def default_linear(x: jax.Array, w_NxK: jax.Array, b_N: jax.Array | None, *, name: str) -> jax.Array:
    """Plain dot in the compute dtype (= x.dtype) with fp32 accumulation; bias added in fp32."""
    del name  # every layer is treated the same
    return dense(x, w_NxK, b_N)


def routes_all_experts(linear: LinearFn) -> bool:
    """Whether the seam asks sparse MLPs to show every token to every expert (see the docstring)."""
    return bool(getattr(linear, "routes_all_experts", False))
