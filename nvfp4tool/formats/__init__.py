"""Serving layouts, declared once: one `LayoutSpec` per (format x quant) the tool writes.

    spec = get("compressed-tensors", "nvfp4")
    layout = describe("out/llama-nvfp4")                 # what a folder is: .format, .quant, .spec
    layout.spec_for("model.layers.0.mlp.up_proj")        # a mixed folder: that linear's spec (None: BF16)

Modules: `modelopt`, `compressed_tensors` (the layouts), `spec` (`LayoutSpec`, `TensorSpec`, file names).
Design notes: docs/design/formats.md.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from converters.fp8_block import is_fp8_block_config
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError
from nvfp4tool.families import fused_position
from nvfp4tool.formats import compressed_tensors, modelopt
from nvfp4tool.formats.spec import (
    BITS,
    CONFIG_FILE,
    FP8_GRANULARITY,
    GLOBAL_ROLES,
    HF_QUANT_CONFIG_FILE,
    KV_CACHES,
    MIXED,
    NVFP4_QUANTS,
    PRECISIONS,
    QUANTS,
    ROLES,
    STATIC_INPUT_QUANTS,
    KVScaleSpec,
    LayoutSpec,
    TensorSpec,
    quant_title,
)
from nvfp4tool.records.base import RecordError, read_json_file

FORMATS = (modelopt.FORMAT, compressed_tensors.FORMAT)
SPECS: dict[tuple[str, str], LayoutSpec] = {
    **{(modelopt.FORMAT, q): s for q, s in modelopt.SPECS.items()},
    **{(compressed_tensors.FORMAT, q): s for q, s in compressed_tensors.SPECS.items()},
}

__all__ = [
    "BITS",
    "CONFIG_FILE",
    "FORMATS",
    "FP8_GRANULARITY",
    "GLOBAL_ROLES",
    "HF_QUANT_CONFIG_FILE",
    "KV_CACHES",
    "MIXED",
    "NVFP4_QUANTS",
    "PRECISIONS",
    "QUANTS",
    "STATIC_INPUT_QUANTS",
    "ROLES",
    "SPECS",
    "FolderLayout",
    "KVScaleSpec",
    "LayoutSpec",
    "TensorSpec",
    "describe",
    "get",
    "is_quantized_export",
    "linear_problem",
    "merged_problem",
    "mixed_configs",
    "mixed_problem",
    "quant_title",
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
    """What a folder's configs declare: its layout, exclusion list and targets, and config problems.
    A mixed folder (`quant == MIXED`) has `schemes`: (spec, targets) per config group in config
    order, and `spec` is its first scheme's (what is the same for every scheme: format, KV scales)."""

    spec: LayoutSpec
    exclude: tuple[str, ...]  # exclude_modules / ignore as written (patterns)
    exclude_source: str  # the file the exclusion list came from
    targets: tuple[str, ...]  # compressed-tensors config_groups targets ("Linear" for ModelOpt)
    problems: tuple[tuple[str, str], ...]  # (file, message) of every config defect found
    kv_cache: str | None = None  # the quantized KV cache the configs announce (KV_CACHES), or None
    schemes: tuple[tuple[LayoutSpec, tuple[str, ...]], ...] = ()  # mixed: (spec, targets) per group

    @property
    def format(self) -> str:
        return self.spec.format

    @property
    def quant(self) -> str:
        return MIXED if self.schemes else self.spec.quant

    @property
    def is_mixed(self) -> bool:
        return bool(self.schemes)

    @property
    def specs(self) -> tuple[LayoutSpec, ...]:
        """Every spec the folder's linears may carry (one for a uniform folder)."""
        return tuple(dict.fromkeys(s for s, _ in self.schemes)) if self.schemes else (self.spec,)

    def excluded_by(self, module: str) -> str | None:
        return self.spec.excluded_by(module, self.exclude)

    def targeted(self, module: str, is_linear: bool) -> bool:
        """Whether the config's targets cover `module` (ModelOpt: every linear layer)."""
        if self.schemes:
            return self.scheme_matches(module) != []
        return any((is_linear and t == "Linear") or self.spec.matches(module, t) for t in self.targets)

    def spec_for(self, module: str) -> LayoutSpec | None:
        """The spec `module` is stored in: a uniform folder's for every module; a mixed folder's
        first scheme whose targets name it (exact names or `re:` regexes as vLLM's
        `find_matched_target` tries them, in config order), None when none does (BF16)."""
        if not self.schemes:
            return self.spec
        matches = self.scheme_matches(module)
        return matches[0] if matches else None

    def scheme_matches(self, module: str) -> list[LayoutSpec]:
        """The specs of every scheme whose targets name `module`, in config order."""
        return [spec for spec, targets in self.schemes if any(spec.matches(module, t) for t in targets)]


def mixed_configs(
    fmt: str, quants: dict[str, str], excluded: tuple[str, ...], producer: dict[str, str], kv_cache: str | None
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(config.json["quantization_config"], hf_quant_config.json or None) of a mixed export whose
    quantized linears have the quants `quants` ({module: one of QUANTS}, model order)."""
    problem = mixed_problem(fmt, set(quants.values()))
    if problem is not None:
        raise NVFP4UsageError(problem)
    schemes = tuple(
        (SPECS[(fmt, q)], tuple(m for m, mq in quants.items() if mq == q)) for q in QUANTS if q in quants.values()
    )
    if fmt == modelopt.FORMAT:
        return modelopt.mixed_configs(schemes, excluded, producer, kv_cache)
    return compressed_tensors.mixed_config(schemes, excluded, kv_cache), None


def mixed_problem(fmt: str, quants) -> str | None:
    """Why a mixed-precision checkpoint in `fmt` cannot carry one of `quants` so that its engines
    load it (ModelOpt: fp8-block, `modelopt.MIXED_UNSUPPORTED`), or None."""
    if fmt == modelopt.FORMAT:
        bad = next((q for q in quants if q in modelopt.MIXED_UNSUPPORTED), None)
        if bad is not None:
            why = modelopt.MIXED_UNSUPPORTED[bad]
            return f"--format modelopt does not carry {bad} in a mixed-precision file: {why}"
    return None


def linear_problem(fmt: str, quant: str, module: str, n: int, k: int) -> str | None:
    """Why the linear `module` [N, K] cannot be stored as (fmt, quant) so that its engines load it
    (ModelOpt fp8-block: `modelopt.fp8_block_problem`), or None."""
    if fmt == modelopt.FORMAT and quant == "fp8-block":
        return modelopt.fp8_block_problem(module, n, k)
    return None


def merged_problem(quant: str, members: dict[str, int]) -> tuple[str, str] | None:
    """(shard, why) when the shards of one merged GEMM ({module: N}: q/k/v, gate/up) cannot be
    served as `quant`, else None: fp8-block needs every shard's N but the last's (in
    `families.fused_position` order) a multiple of 128, as vLLM's validate_fp8_block_shape does at
    TP 1 (a 128-row block must not straddle two shards)."""
    if quant != "fp8-block":
        return None
    ordered = sorted(members, key=fused_position)
    for module in ordered[:-1]:
        if members[module] % 128:
            last = ordered[-1].rpartition(".")[2]
            return module, (
                f"N = {members[module]} is not a multiple of 128: in a merged fp8-block GEMM only the last shard "
                f"({last}) may end a 128-row block early (vLLM's validate_fp8_block_shape)"
            )
    return None


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
    schemes: tuple[tuple[LayoutSpec, tuple[str, ...]], ...] = ()
    if modelopt.claims(qc, hf_quant) and modelopt.is_mixed(qc, hf_quant):
        parsed, exclude, source, found = modelopt.parse_mixed(qc, hf_quant)
        schemes = tuple((modelopt.SPECS[q], targets) for q, targets in parsed)
        spec, targets = _first_spec(folder, schemes, modelopt.FORMAT), ("Linear",)
        kv_cache, kv_problems = modelopt.parse_kv_cache(qc, hf_quant)
    elif compressed_tensors.is_mixed(qc):
        parsed, exclude, found = compressed_tensors.parse_mixed(qc)
        schemes = tuple((compressed_tensors.SPECS[q], targets) for q, targets in parsed)
        spec, source = _first_spec(folder, schemes, compressed_tensors.FORMAT), CONFIG_FILE
        targets = tuple(t for _, group in schemes for t in group)
        kv_cache, kv_problems = compressed_tensors.parse_kv_cache(qc)
    elif modelopt.claims(qc, hf_quant):
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
        spec=spec,
        exclude=patterns,
        exclude_source=source,
        targets=targets,
        problems=tuple(problems),
        kv_cache=kv_cache,
        schemes=schemes,
    )


# ------------------------------------------------------------------------------------------
# helpers


def _first_spec(folder: str, schemes: tuple, fmt: str) -> LayoutSpec:
    if not schemes:
        raise NVFP4ToolError(f"{folder}: a {fmt} mixed-precision checkpoint whose configs name no supported scheme")
    return schemes[0][0]


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
