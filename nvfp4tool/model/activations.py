"""The MLP activation functions, by the names HF config.json's `hidden_act` gives them.

    act = activation("gelu_pytorch_tanh")   # jax.nn.gelu(approximate=True), transformers' GELUTanh
    y = act(x)

A family declares its activation by name (`Family.activation`: silu for the Llama and MoE groups,
relu2 for a relu(x)^2 MLP); the functions are transformers' definitions (`ACT2FN`), computed in
the input's dtype. An unknown name is NVFP4ToolError naming config.json's `hidden_act`.
Design notes: docs/design/model.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from nvfp4tool.errors import NVFP4ToolError


def _relu2(x: jax.Array) -> jax.Array:
    """relu(x)^2 (transformers' ReLUSquaredActivation)."""
    r = jax.nn.relu(x)
    return r * r


# transformers' ACT2FN name -> the same function
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,  # x * sigmoid(x)
    "swish": jax.nn.silu,  # transformers' alias of silu
    "gelu": functools.partial(jax.nn.gelu, approximate=False),  # exact: x * Phi(x), erf
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),  # the tanh approximation
    "relu": jax.nn.relu,
    "relu2": _relu2,
}


def activation(name: str, source: str = "config.json") -> Callable[[jax.Array], jax.Array]:
    """The function HF's `hidden_act` `name` names; NVFP4ToolError naming `source` and the key otherwise."""
    try:
        return ACTIVATIONS[name]
    except (KeyError, TypeError):
        raise NVFP4ToolError(
            f"{source}: hidden_act {name!r} unsupported; supported: {', '.join(ACTIVATIONS)}"
        ) from None
