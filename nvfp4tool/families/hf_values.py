"""Typed reads of config.json values: one rule for every family's parse (ints are JSON integers,
never bools or floats; flags are JSON booleans; a missing key is KeyError unless a default is given)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nvfp4tool.errors import NVFP4ToolError

_REQUIRED = object()


def integer(hf: Mapping[str, Any], key: str, default: Any = _REQUIRED) -> Any:
    """`hf[key]` as an int: a JSON integer, never a bool, a float (2.0 included: transformers' strict
    config classes refuse it) or a string; a missing key (or null, when `default` is given) is `default`;
    missing without a default is KeyError (reported as a missing required key)."""
    value = hf.get(key)
    if value is None:
        if default is _REQUIRED:
            raise KeyError(key)
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise NVFP4ToolError(f"{key} must be an integer, got {value!r} ({type(value).__name__})")
    return value


def number(hf: Mapping[str, Any], key: str, default: Any = _REQUIRED) -> float:
    """`hf[key]` as a float: a JSON number (int or float, never a bool or a string); missing or null
    is `default` (KeyError without one)."""
    value = hf.get(key)
    if value is None:
        if default is _REQUIRED:
            raise KeyError(key)
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise NVFP4ToolError(f"{key} must be a number, got {value!r} ({type(value).__name__})")
    return float(value)


def flag(hf: Mapping[str, Any], key: str, default: bool = False) -> bool:
    """`hf[key]` as a bool: JSON true / false only (the string "false" is not false); missing or
    null is `default`."""
    value = hf.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise NVFP4ToolError(f"{key} must be true or false, got {value!r} ({type(value).__name__})")
    return value
