"""The decoder blocks of each family, registered by the module that defines them.

    register_blocks(llama.FAMILIES, {ATTENTION_MLP: dense_block})   # in the family's blocks module
    block = make_block(config, kind, attention, "model.layers.3", param_dtype=..., rngs=...)

A family names the module of its blocks (`Family.blocks_module`), imported on first use; that module
registers a block class for each layer kind of its families, so the model knows no family's blocks.
A factory is called `factory(config, layer_name, *, attention, param_dtype, rngs)` (`attention`: the
layer's `LayerAttention`, which a block program of `model.layers.*` cannot read from its name); a
block is called `block(x, cos, sin, mask, state, write_index, seam)` -> (output, state, `Side`),
builds its own decode state (`empty_state(batch, length, dtype)`: None when it keeps none) and says
whether that state is recurrent (`recurrent`: it cannot skip padding after a prompt).
Design notes: docs/design/model.md.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from nvfp4tool.config import ModelConfig
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.families import Family, LayerAttention

MODEL_PACKAGE = "nvfp4tool.model"  # where every family's blocks module lies (the import layers allow no other)


class Block(Protocol):
    """What the model asks of a block (an `nnx.Module`) besides its parameters."""

    recurrent: bool  # its decode state summarises every position it saw, so prompts are left-padded

    def __call__(self, x_BxTxE, cos_BxTxD, sin_BxTxD, mask, state, write_index, seam) -> tuple[jax.Array, Any, Any]:
        """(the block's output, its decode state with this chunk written at `write_index`, its `Side`)."""
        ...

    def empty_state(self, batch: int, length: int, dtype: jnp.dtype) -> Any:
        """Its decode state before a prefill of `length` slots (a pytree of arrays; None: it keeps none)."""
        ...


BlockFactory = Callable[..., nnx.Module]  # (config, layer_name, *, attention, param_dtype, rngs) -> a Block
_REGISTERED: dict[tuple[str, str], BlockFactory] = {}  # (model_type, layer kind) -> its block's factory


def register_blocks(families: Iterable[Family], factories: Mapping[str, BlockFactory]) -> None:
    """Register the block factory of each layer kind in `factories` for every family in `families`
    (called by the family's `blocks_module` when it is imported)."""
    for family in families:
        for kind, factory in factories.items():
            _REGISTERED[(family.model_type, kind)] = factory


def family_blocks(family: Family) -> dict[str, BlockFactory]:
    """Layer kind -> block factory of `family`, its blocks module imported (it registers them)."""
    module = family.blocks_module
    if module is None or not module.startswith(f"{MODEL_PACKAGE}."):
        raise NVFP4ToolError(f"{family.model_type}: the family names no blocks module in {MODEL_PACKAGE}")
    importlib.import_module(module)
    return {kind: factory for (model_type, kind), factory in _REGISTERED.items() if model_type == family.model_type}


def make_block(
    config: ModelConfig,
    kind: str,
    attention: LayerAttention,
    layer_name: str,
    *,
    param_dtype: jnp.dtype,
    rngs: nnx.Rngs,
) -> nnx.Module:
    """A block of layer kind `kind` with attention settings `attention` (its family's
    `layer_attention`) named `layer_name` (`model.layers.3`, or `model.layers.*`)."""
    blocks = family_blocks(config.family_spec)
    if kind not in blocks:
        raise NVFP4ToolError(
            f"{config.family}: layer kind {kind!r} has no block in the model (kinds with blocks: {', '.join(blocks)})"
        )
    return blocks[kind](config, layer_name, attention=attention, param_dtype=param_dtype, rngs=rngs)
