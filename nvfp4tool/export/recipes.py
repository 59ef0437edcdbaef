"""Named export recipes: the option combinations we stand behind, one TOML file each in
`export/recipe_files/` (`nvfp4tool export --recipe NAME`).

    recipe = read_recipe("w4a16-best")            # summary, measured, its ExportOptions fields
    options = apply_recipe(ExportOptions(calib_data="calib.txt"), "w4a16-best", given={"calib_data"})

A recipe sets ExportOptions fields; an option the user gave (`given`) wins over the recipe's, said
on a line. A recipe that calibrates needs `calib_data`; one with a `keep_bf16_rule` names a rule
its model's family publishes (`Family.keep_bf16_rules`), resolved by the export once the model is open.
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
# the ExportOptions fields a recipe may set (not the output, the source or library-only fields)
SETTABLE = (
    "format",
    "quant",
    "scale_search",
    "weight_rounding",
    "equalize",
    "gptq_damp",
    "gptq_block_scales",
    "weight_block",
    "keep_bf16",
    "calib_samples",
    "calib_seq_len",
    "kv_cache",
)


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
    from nvfp4tool.export.job import ExportOptions

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
    defaults = ExportOptions()
    options = dict(raw.get("options", {}))
    for key, value in options.items():
        default = getattr(defaults, key)
        if key == "keep_bf16":
            if not (isinstance(value, list) and all(isinstance(p, str) for p in value)):
                raise NVFP4ToolError(f"{path}: options.keep_bf16: expected a list of fnmatch patterns")
            options[key] = tuple(value)
        elif default is not None and not isinstance(value, type(default)):
            raise NVFP4ToolError(f"{path}: options.{key} = {value!r}: expected a {type(default).__name__}")
    for key in ("summary", "measured"):
        if not isinstance(raw.get(key), str):
            raise NVFP4ToolError(f"{path}: {key}: expected a string")
    if not isinstance(raw.get("calibration"), bool):
        raise NVFP4ToolError(f"{path}: calibration: expected true or false")
    return Recipe(name, raw["summary"], raw["measured"], raw["calibration"], options, raw.get("keep_bf16_rule"))


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
        if key in given:
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
