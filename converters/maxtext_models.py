"""MaxText model names -> HF-style config dicts, and each name's RoPE row layout, as the families
declare them (`Family.maxtext_models`, `Family.maxtext_rope_layout`), collected through the registry.

MaxText checkpoints carry no model config: `--model-config llama3.1-8b` names one of `MAXTEXT_MODELS`.
Each name says its RoPE row layout (`rope_layout_for`); a family whose MaxText decoder fixes one
(`family_rope_layout`: Mixtral's and Qwen3-MoE's, half) overrides any.
Design notes: docs/design/converters.md.
"""

from __future__ import annotations

from typing import Any

from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.families import REGISTRY
from nvfp4tool.families.maxtext import NamedModel


def _collect() -> dict[str, NamedModel]:
    """name -> its declaration, in registry order; a name two families declare is a bug."""
    found: dict[str, NamedModel] = {}
    owner: dict[str, str] = {}
    for family in REGISTRY.values():
        for name, model in family.maxtext_models.items():
            if name in found:
                raise AssertionError(f"MaxText model {name!r} declared by {owner[name]} and {family.model_type}")
            found[name], owner[name] = model, family.model_type
    return found


_NAMED = _collect()
MAXTEXT_MODELS: dict[str, Any] = {name: model.hf for name, model in _NAMED.items()}  # name -> config.json dict


def maxtext_hf_config(name: str) -> dict[str, Any]:
    """The HF config.json dict of MaxText model `name` (a fresh copy)."""
    try:
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in MAXTEXT_MODELS[name].items()}
    except KeyError:
        raise NVFP4ToolError(
            f"unknown MaxText model name {name!r}; known: "
            f"{', '.join(MAXTEXT_MODELS)} (or pass an HF config.json / folder)"
        ) from None


def rope_layout_for(name: str) -> str:
    """RoPE row layout MaxText uses for model `name` (its family's declaration: "interleaved" for
    llama3.1-*, else "half")."""
    return _NAMED[name].rope_layout


def interleaved_names() -> list[str]:
    """The MaxText model names whose checkpoints are RoPE-interleaved (the others are half-split)."""
    return [name for name, model in _NAMED.items() if model.rope_layout == "interleaved"]


def family_rope_layout(family: str) -> str | None:
    """The RoPE row layout MaxText's decoder for `family` fixes, or None where the model decides."""
    return REGISTRY[family].maxtext_rope_layout


def check_family_rope_layout(family: str, rope_layout: str, label: str) -> None:
    """NVFP4ToolError if `family` fixes another RoPE layout than `rope_layout` (the library's guard
    under the reader and the writer; the commands refuse the option first, exit 2, in
    `nvfp4tool.checkpoints.resolve_rope_layout`)."""
    fixed = family_rope_layout(family)
    if fixed is not None and rope_layout != fixed:
        raise NVFP4ToolError(
            f"{label}: RoPE layout {rope_layout!r} for {family}, whose MaxText decoder fixes {fixed!r}"
        )
