"""Serving layouts, declared once: one `LayoutSpec` per (format x quant) the tool writes.

    spec = get("compressed-tensors", "nvfp4")
    layout = describe("out/llama-nvfp4")                 # what a folder is: .format, .quant, .spec

Modules: `modelopt`, `compressed_tensors` (the layouts), `spec` (`LayoutSpec`, `TensorSpec`, file names).
Design notes: docs/design/formats.md.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from converters.fp8_block import is_fp8_block_config
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.formats import compressed_tensors, modelopt
from nvfp4tool.formats.spec import (
    CONFIG_FILE,
    GLOBAL_ROLES,
    HF_QUANT_CONFIG_FILE,
    KV_CACHES,
    QUANTS,
    ROLES,
    KVScaleSpec,
    LayoutSpec,
    TensorSpec,
)
from nvfp4tool.records.base import RecordError, read_json_file

FORMATS = (modelopt.FORMAT, compressed_tensors.FORMAT)
SPECS: dict[tuple[str, str], LayoutSpec] = {
    **{(modelopt.FORMAT, q): s for q, s in modelopt.SPECS.items()},
    **{(compressed_tensors.FORMAT, q): s for q, s in compressed_tensors.SPECS.items()},
}

__all__ = [
    "CONFIG_FILE",
    "FORMATS",
    "GLOBAL_ROLES",
    "HF_QUANT_CONFIG_FILE",
    "KV_CACHES",
    "QUANTS",
    "ROLES",
    "SPECS",
    "FolderLayout",
    "KVScaleSpec",
    "LayoutSpec",
    "TensorSpec",
    "describe",
    "get",
    "is_quantized_export",
]


def get(fmt: str, quant: str) -> LayoutSpec:
    """The spec of (format, quant); NVFP4ToolError naming the unknown one."""
    if fmt not in FORMATS:
        raise NVFP4ToolError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if quant not in QUANTS:
        raise NVFP4ToolError(f"unknown quant {quant!r}; choose one of {', '.join(QUANTS)}")
    return SPECS[(fmt, quant)]


@dataclasses.dataclass(frozen=True)
class FolderLayout:
    """What a folder's configs declare: its layout, exclusion list and targets, and config problems."""

    spec: LayoutSpec
    exclude: tuple[str, ...]  # exclude_modules / ignore as written (patterns)
    exclude_source: str  # the file the exclusion list came from
    targets: tuple[str, ...]  # compressed-tensors config_groups targets ("Linear" for ModelOpt)
    problems: tuple[tuple[str, str], ...]  # (file, message) of every config defect found
    kv_cache: str | None = None  # the quantized KV cache the configs announce (KV_CACHES), or None

    @property
    def format(self) -> str:
        return self.spec.format

    @property
    def quant(self) -> str:
        return self.spec.quant

    def excluded_by(self, module: str) -> str | None:
        return self.spec.excluded_by(module, self.exclude)

    def targeted(self, module: str, is_linear: bool) -> bool:
        """Whether the config's targets cover `module` (ModelOpt: every linear layer)."""
        return any((is_linear and t == "Linear") or self.spec.matches(module, t) for t in self.targets)


def is_quantized_export(folder: str) -> bool:
    """Whether a folder's configs declare a quantization layout (a serving export, not a BF16
    checkpoint): config.json with a `quantization_config`, or ModelOpt's hf_quant_config.json. An
    FP8 block-scaled checkpoint (`converters.fp8_block`: DeepSeek-V3's) is a source, read as BF16."""
    if os.path.isfile(os.path.join(folder, HF_QUANT_CONFIG_FILE)):
        return True
    try:
        config = read_json_file(os.path.join(folder, CONFIG_FILE))
    except RecordError:
        return False
    return (
        isinstance(config, dict)
        and "quantization_config" in config
        and not is_fp8_block_config(config["quantization_config"])
    )


def describe(folder: str) -> FolderLayout:
    """The layout a folder's configs declare (`.format`, `.quant`, `.spec`, `.exclude`), with every
    config problem found (`.problems`, not raised): what the model card, the tools and `check`
    use to know what a folder is.

    Raises NVFP4ToolError only when the folder declares no supported layout at all.
    """
    problems: list[tuple[str, str]] = []
    config = _read_json(folder, CONFIG_FILE, problems)
    hf_quant = (
        _read_json(folder, HF_QUANT_CONFIG_FILE, problems)
        if os.path.exists(os.path.join(folder, HF_QUANT_CONFIG_FILE))
        else None
    )
    qc = (config or {}).get("quantization_config")
    if modelopt.claims(qc, hf_quant):
        quant, exclude, source, found = modelopt.parse(qc, hf_quant)
        if quant is None:
            quantization = (hf_quant or {}).get("quantization")
            algo = (quantization if isinstance(quantization, dict) else {}).get("quant_algo") or (
                qc if isinstance(qc, dict) else {}
            ).get("quant_algo")
            raise NVFP4ToolError(
                f"{folder}: ModelOpt quant_algo {algo!r} is not supported; supported: "
                f"{', '.join(modelopt.QUANT_OF_ALGO)}"
            )
        spec, targets = modelopt.SPECS[quant], ("Linear",)
        kv_cache, kv_problems = modelopt.parse_kv_cache(qc, hf_quant)
    elif compressed_tensors.claims(qc):
        quant, exclude, targets, found, named = compressed_tensors.parse(qc)
        if quant is None:
            raise NVFP4ToolError(
                f"{folder}: compressed-tensors format {named} is not supported; "
                f"supported: {', '.join(sorted(set(compressed_tensors.CT_FORMAT.values())))}"
            )
        spec, source = compressed_tensors.SPECS[quant], CONFIG_FILE
        kv_cache, kv_problems = compressed_tensors.parse_kv_cache(qc)
    else:
        detail = next((m for f, m in problems if f == CONFIG_FILE), None)
        raise NVFP4ToolError(
            f"{os.path.join(folder, CONFIG_FILE)}: "
            + (
                detail
                or f"no quantization_config with quant_method modelopt or compressed-tensors (and no "
                f"{HF_QUANT_CONFIG_FILE}): not an NVFP4/FP8 serving checkpoint"
            )
        )
    problems += found + kv_problems
    patterns = _patterns(exclude, source, problems)
    problems += [(source, f"exclusion list: {why}") for p in patterns if (why := spec.pattern_problem(p))]
    problems += [(CONFIG_FILE, f"config_groups targets: {why}") for t in targets if (why := spec.pattern_problem(t))]
    return FolderLayout(
        spec=spec, exclude=patterns, exclude_source=source, targets=targets, problems=tuple(problems), kv_cache=kv_cache
    )


# ------------------------------------------------------------------------------------------
# helpers


def _patterns(value: Any, source: str, problems: list[tuple[str, str]]) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        problems.append((source, f"exclusion list {value!r} is not a list of names"))
        return ()
    return tuple(value)


def _read_json(folder: str, name: str, problems: list[tuple[str, str]]) -> dict | None:
    path = os.path.join(folder, name)
    if not os.path.lexists(path):
        problems.append((name, "missing"))
        return None
    try:
        value = read_json_file(path)
    except RecordError as bad:  # a folder, binary, not JSON: the reason without the path
        problems.append((name, str(bad).removeprefix(f"{path}: ")))
        return None
    if not isinstance(value, dict):
        problems.append((name, "is not a JSON object"))
        return None
    return value
