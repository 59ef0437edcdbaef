"""Named export recipes: the option combinations we stand behind, one TOML file each in
`export/recipe_files/` (`nvfp4tool export --recipe NAME`).

    recipe = read_recipe("w4a16-best")            # summary, measured, its ExportOptions fields
    options = apply_recipe(options, "w4a16-best", given=set_fields(options))

A recipe sets ExportOptions fields; an option set to other than its default (`given`) wins over
the recipe's, said on a line (the CLI refuses one typed at its default that the recipe sets
otherwise); keep-BF16 patterns add to the recipe's. A recipe that calibrates needs `calib_data`;
a `keep_bf16_rule` names a rule of the model's family (`Family.keep_bf16_rules`), applied by the
export once the model is open.
Design notes: docs/design/export.md.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Collection
from typing import Any

from nvfp4tool import progress
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError

FOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recipe_files")
_TOP_KEYS = {"summary", "measured", "calibration", "keep_bf16_rule", "options"}
# the ExportOptions fields a recipe may set (not the output, the source or library-only fields) and
# the TOML type of each (tests/export/test_recipes.py holds it to ExportOptions' defaults)
SETTABLE = {
    "format": str,
    "quant": str,
    "scale_search": str,
    "weight_rounding": str,
    "equalize": str,
    "gptq_damp": float,
    "gptq_block_scales": str,
    "weight_block": str,
    "keep_bf16": list,
    "calib_samples": int,
    "calib_seq_len": int,
    "kv_cache": str,
}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One recipe file, checked."""

    name: str
    summary: str  # one line: what it exports
    measured: str  # what it gave on a real model (from the benchmarks)
    calibration: bool  # needs calib_data
    options: dict[str, Any]  # ExportOptions field -> value
    keep_bf16_rule: str | None = None  # a family's published keep-BF16 rule (`Family.keep_bf16_rules`)


def names() -> list[str]:
    """Every shipped recipe, sorted."""
    return sorted(f[: -len(".toml")] for f in os.listdir(FOLDER) if f.endswith(".toml"))


def read_recipe(name: str) -> Recipe:
    """The recipe `name`; NVFP4UsageError for an unknown name, NVFP4ToolError naming the file and key
    for a malformed file."""
    if name not in names():
        raise NVFP4UsageError(f"--recipe {name!r}: unknown; recipes: {', '.join(names())}")
    path = os.path.join(FOLDER, f"{name}.toml")
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise NVFP4ToolError(f"{path}: not TOML ({e})") from None
    unknown = sorted(set(raw) - _TOP_KEYS) + sorted(f"options.{k}" for k in raw.get("options", {}) if k not in SETTABLE)
    if unknown:
        raise NVFP4ToolError(f"{path}: {unknown[0]}: not a recipe key (options: {', '.join(SETTABLE)})")
    options = dict(raw.get("options", {}))
    for key, value in options.items():
        if key == "keep_bf16":
            if not (isinstance(value, list) and all(isinstance(p, str) for p in value)):
                raise NVFP4ToolError(f"{path}: options.keep_bf16: expected a list of fnmatch patterns")
            options[key] = tuple(value)
        elif not isinstance(value, SETTABLE[key]) or isinstance(value, bool):
            raise NVFP4ToolError(f"{path}: options.{key} = {value!r}: expected a {SETTABLE[key].__name__}")
    for key in ("summary", "measured"):
        if not isinstance(raw.get(key), str):
            raise NVFP4ToolError(f"{path}: {key}: expected a string")
    if not isinstance(raw.get("calibration"), bool):
        raise NVFP4ToolError(f"{path}: calibration: expected true or false")
    return Recipe(name, raw["summary"], raw["measured"], raw["calibration"], options, raw.get("keep_bf16_rule"))


def set_fields(options) -> set[str]:
    """The recipe-settable fields of `options` (ExportOptions) set to other than their defaults."""
    defaults = type(options)()
    return {key for key in SETTABLE if getattr(options, key) != getattr(defaults, key)}


def apply_recipe(options, name: str, given: Collection[str] = ()):
    """`options` (ExportOptions) with recipe `name`'s fields set, except those in `given` (the
    options the user gave: they win, each difference said once); its name recorded in `recipe`."""
    recipe = read_recipe(name)
    if recipe.calibration and options.calib_data is None:
        raise NVFP4UsageError(
            f"--recipe {name}: calibrates ({recipe.summary}): give --calib-data PATH "
            "(text or .npy token ids; nvfp4tool/data/shakespeare_train.txt ships with the package)"
        )
    changes = {}
    for key, value in recipe.options.items():
        if key == "keep_bf16":  # the user's patterns add to the recipe's
            changes[key] = tuple(dict.fromkeys(value + tuple(options.keep_bf16)))
        elif key in given:
            if getattr(options, key) != value:
                flag = "--" + key.replace("_", "-")
                progress.info(f"--recipe {name}: {flag} {getattr(options, key)!r} given, over the recipe's {value!r}")
            continue
        changes[key] = value
    return dataclasses.replace(options, **changes, recipe=name)


def rule_patterns(name: str, config) -> dict[str, str]:
    """Recipe `name`'s keep-BF16 patterns for `config`'s model from its family's published rule:
    pattern -> where it comes from (for `export.plan.make_plan`'s messages); {} without a rule.
    NVFP4ToolError when the model's family publishes no such rule."""
    recipe = read_recipe(name)
    if recipe.keep_bf16_rule is None:
        return {}
    rules = config.family_spec.keep_bf16_rules
    if recipe.keep_bf16_rule not in rules:
        raise NVFP4ToolError(
            f"--recipe {name}: {recipe.keep_bf16_rule} is a rule of another family; this model is "
            f"{config.family} (its rules: {', '.join(rules) or 'none'})"
        )
    where = f"recipe {name} ({recipe.keep_bf16_rule})"
    return {p: where for p in rules[recipe.keep_bf16_rule](config)}
