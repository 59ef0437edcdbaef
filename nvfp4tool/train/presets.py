"""Named model sizes for pretraining from scratch, as the families declare them (`Family.presets`,
each in its own module: `tiny` ... `1b` in `families/llama.py`), collected through the registry.

    config = preset_config("tiny-moe", vocab_size=512, max_position_embeddings=2048)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nvfp4tool.config import ModelConfig
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.families import REGISTRY, Family


def _collect() -> dict[str, tuple[Family, Mapping[str, Any]]]:
    """name -> (its family, its fields), in registry order; a name two families declare is a bug."""
    found: dict[str, tuple[Family, Mapping[str, Any]]] = {}
    for family in REGISTRY.values():
        for name, fields in family.presets.items():
            if name in found:
                raise AssertionError(f"preset {name!r} declared by {found[name][0].model_type} and {family.model_type}")
            found[name] = (family, fields)
    return found


_DECLARED = _collect()
PRESETS = tuple(_DECLARED)


def preset_config(name: str, vocab_size: int, max_position_embeddings: int) -> ModelConfig:
    """The ModelConfig of a named size for a tokenizer of `vocab_size`."""
    if name not in _DECLARED:
        raise NVFP4ToolError(
            f"unknown model size {name!r}; sizes: {', '.join(PRESETS)} (or pass an HF folder or a MaxText checkpoint)"
        )
    family, fields = _DECLARED[name]
    return ModelConfig(
        **fields,
        family=family.model_type,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
    )
