"""`check_checkpoint`: verify an NVFP4 / FP8 serving folder before anyone serves or publishes it.

Configs, headers and index, each module, fused groups, KV-cache scales, the model's tensors, every
tensor's data, dtypes, then the provenance record. Problems are collected, never raised; only a
folder that declares no supported format raises NVFP4ToolError. Decoded weights must stay below
`LayoutSpec.element_range` (2688 for NVFP4, 448 for FP8), i.e. S_dec <= 1 (fp8-block: every
block's scale). fp8-block's TP rules are vLLM's `validate_fp8_block_shape` (`_fp8_block_tp_problems`).
Design notes: docs/design/check.md.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections import Counter
from collections.abc import Iterable, Mapping

import numpy as np

from nvfp4tool import progress
from nvfp4tool.check.files import TensorEntry, read_small, read_tensor_table
from nvfp4tool.check.formats import CONFIG, QUANT_SUFFIXES, SCALE_SUFFIXES, detect_format, input_suffix
from nvfp4tool.check.kv import KV_SCALE_SUFFIXES, check_kv_scales
from nvfp4tool.check.model import attention_modules, check_against_model, check_dtypes, read_model_config, stored_shapes
from nvfp4tool.check.record import check_against_record
from nvfp4tool.check.report import CONFIG_LEVEL, CheckReport, ModuleStats, Problem
from nvfp4tool.check.scan import E4M3_CODE, TensorScan, scan_tensor
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError
from nvfp4tool.families import fused_group, is_embedding, projection_of, scheme_group
from nvfp4tool.formats import BITS, SPECS, FolderLayout, LayoutSpec, linear_problem, merged_problem
from nvfp4tool.numerics.constants import FP8_BLOCK, NVFP4_BLOCK

NVFP4_BITS = BITS["nvfp4"]  # 4.5: 4-bit code + 8-bit scale per 16 elements
FP8_BITS = BITS["fp8"]  # 8.0


def check_checkpoint(path: str | os.PathLike, tp: Iterable[int] = (1,)) -> CheckReport:
    """Check the serving checkpoint folder at `path` for tensor-parallel degrees `tp`."""
    folder = os.fspath(path)
    if not os.path.isdir(folder):
        raise NVFP4ToolError(f"{folder}: not a folder")
    degrees = tuple(sorted(set(int(t) for t in tp)))
    if not degrees or min(degrees) < 1:
        raise NVFP4UsageError(f"tensor-parallel degrees must be >= 1, got {list(tp)}")
    layout, problems = detect_format(folder)
    config, config_problems = read_model_config(folder, any(p.tensor == CONFIG for p in problems))
    entries, file_problems = read_tensor_table(folder)
    report = CheckReport(
        path=folder,
        format=layout.format,
        quant=layout.quant,
        tp=degrees,
        problems=problems + config_problems + file_problems,
    )
    if config is not None:  # the family's own tensor-parallel rules (a hybrid's Mamba heads and groups)
        report.problems += [
            Problem(CONFIG_LEVEL, CONFIG, why)
            for t in degrees
            if t > 1
            for why in config.family_spec.tp_problems(config, t)
        ]
    scans: dict[str, TensorScan] = {}
    quantized: dict[str, ModuleStats] = {}
    status: dict[str, str] = {}  # linear module -> "quantized" / "excluded" / "plain"
    # Modules config.json's model lacks are not judged as modules: model.py reports their tensors
    # as not the model's (a lone scale of an expert 6 in a 4-expert layer is that, not a module
    # missing its weight).
    model_modules = None if config is None else {n.rpartition(".")[0] for n in stored_shapes(config)}
    modules = _modules(entries)
    with progress.task("check", total=len(modules), unit="module") as task:
        for module, tensors in modules.items():
            if model_modules is None or module in model_modules:
                stats = _check_module(module, tensors, layout, degrees, scans, report.problems, status)
                if stats is not None:
                    quantized[module] = stats
            task.advance(description=module)
    if layout.is_mixed:
        report.problems += _check_schemes(layout, status)
    if any(s.is_nvfp4 or s.is_fp8_block for s in layout.specs):
        report.problems += _check_fused_groups(quantized, status, layout)
    kv_problems, report.kv_scales = check_kv_scales(
        entries, layout, None if config is None else attention_modules(config)
    )
    report.problems += kv_problems
    report.kv_cache = layout.kv_cache
    reported = {p.module for p in report.problems} | {p.tensor for p in report.problems}
    if config is not None:
        report.problems += check_against_model(config, entries, quantized, layout, reported)
    report.model_checked = config is not None
    report.problems += _check_data(entries, scans, () if config is None else config.family_spec.may_be_zero)
    specs = {m: _spec_of(layout, modules[m], m) for m in quantized}
    report.problems += check_dtypes(
        folder,
        entries,
        specs,
        () if config is None else config.family_spec.stored_fp32 + config.family_spec.kept_as_stored,
    )
    report.problems += check_against_record(folder, entries, layout, specs)
    per_module = Counter(p.module for p in report.problems)
    for stats in quantized.values():
        stats.problems = per_module[stats.module]
    report.modules = list(quantized.values())
    report.tensors_checked = len(entries)
    report.bytes_read = sum(s.bytes_read for s in scans.values())
    return report


def parse_tp(text: str) -> tuple[int, ...]:
    """Parse a --tp list such as "1,2,4,8" into (1, 2, 4, 8); a bad list is a usage error."""
    try:
        degrees = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise NVFP4UsageError(f"--tp {text!r}: expected comma-separated integers, e.g. 1,2,4,8") from None
    if not degrees or min(degrees) < 1:
        raise NVFP4UsageError(f"--tp {text!r}: expected degrees >= 1, e.g. 1,2,4,8")
    return degrees


# ---------------------------------------------------------------------------------------- helpers


def _modules(entries: Mapping[str, TensorEntry]) -> dict[str, dict[str, TensorEntry]]:
    """module path -> {suffix: entry}, modules in natural order (layer 2 before layer 10)."""
    modules: dict[str, dict[str, TensorEntry]] = {}
    for name in sorted(entries, key=_natural_key):
        module, _, suffix = name.rpartition(".")
        modules.setdefault(module, {})[suffix] = entries[name]
    return modules


def _natural_key(name: str) -> list:
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name)]


def _check_module(
    module: str,
    tensors: dict[str, TensorEntry],
    layout: FolderLayout,
    tp: tuple[int, ...],
    scans: dict[str, TensorScan],
    found: list[Problem],
    status: dict[str, str],
) -> ModuleStats | None:
    """Exclusion consistency of one module, and the full checks when it is quantized (against the
    spec of its own scheme in a mixed folder)."""
    spec = _spec_of(layout, tensors, module)
    weight = tensors.get(spec.suffix("weight"), tensors.get("weight"))
    is_linear = weight is not None and len(weight.shape) == 2 and not is_embedding(module)
    low_precision_weight = weight is not None and weight.code in ("U8", E4M3_CODE)
    quant_tensors = [s for s in QUANT_SUFFIXES if s in tensors]
    is_quantized = bool(quant_tensors) or low_precision_weight
    excluded_by = layout.excluded_by(module)
    expected = layout.targeted(module, is_linear) and excluded_by is None
    if is_linear:
        status[module] = "quantized" if is_quantized else ("excluded" if excluded_by else "plain")

    if is_quantized and excluded_by is not None:
        shipped = quant_tensors + ["weight"] * (low_precision_weight and "weight" not in quant_tensors)
        for suffix in shipped:
            found.append(
                Problem(
                    module,
                    f"{module}.{suffix}",
                    f"module is excluded by {excluded_by!r} in {layout.exclude_source} but "
                    f"ships this quantization tensor (vLLM fails to load it)",
                )
            )
        return None
    if not is_quantized:
        if expected and weight is not None:
            key = "ignore" if spec.pattern_style != "fnmatch" else "exclude_modules"
            found.append(
                Problem(
                    module,
                    weight.name,
                    f"linear layer is {weight.code}, neither quantized nor listed in "
                    f"{layout.exclude_source} {key} (a loader expects {spec.quant} "
                    f"tensors for it)",
                )
            )
        return None
    if not expected and weight is not None:  # (a missing weight is reported below)
        found.append(
            Problem(
                module,
                weight.name,
                "ships quantized tensors but is not a linear layer the config targets for quantization",
            )
        )
    if spec.is_nvfp4:
        return _check_nvfp4_module(module, tensors, spec, tp, scans, found)
    if spec.is_fp8_block:
        return _check_fp8_block_module(module, tensors, spec, tp, scans, found)
    return _check_fp8_module(module, tensors, spec, tp, scans, found)


def _check_nvfp4_module(
    module: str,
    tensors: dict[str, TensorEntry],
    spec: LayoutSpec,
    tp: tuple[int, ...],
    scans: dict[str, TensorScan],
    found: list[Problem],
) -> ModuleStats:
    stats = ModuleStats(module, "nvfp4")
    weight_suffix, block_suffix = spec.suffix("weight"), spec.suffix("block_scale")
    weight = tensors.get(weight_suffix)
    block = tensors.get(block_suffix)
    if weight_suffix != "weight" and "weight" in tensors:
        found.append(
            Problem(
                module, f"{module}.weight", f"an unquantized weight beside {weight_suffix} (the module is quantized)"
            )
        )
    if weight is None:
        found.append(
            Problem(
                module, f"{module}.{weight_suffix}", "missing (the module has quantization scales but no packed weight)"
            )
        )
    elif len(weight.shape) != 2:
        found.append(
            Problem(module, weight.name, f"is {weight.code}{list(weight.shape)}, expected U8 [N, K/2] (packed E2M1)")
        )
    else:
        if weight.code != "U8":
            found.append(
                Problem(
                    module,
                    weight.name,
                    f"is {weight.code}{list(weight.shape)}, expected U8 [N, K/2] (packed E2M1, two codes per byte)",
                )
            )
        stats.n = weight.shape[0]
        stats.k = weight.shape[1] * (2 if weight.code == "U8" else 1)
    if block is None:
        found.append(Problem(module, f"{module}.{block_suffix}", "missing (E4M3 block scales)"))
    elif stats.n is not None:
        want = spec.tensor("block_scale").shape(stats.n, stats.k)
        if block.code != E4M3_CODE or block.shape != want:
            found.append(
                Problem(
                    module,
                    block.name,
                    f"is {block.code}{list(block.shape)}, expected "
                    f"F8_E4M3 {list(want)} (one scale per 16 of "
                    f"K = {stats.k})",
                )
            )
    if stats.n is not None:
        if stats.k % NVFP4_BLOCK:
            found.append(Problem(module, weight.name, f"K = {stats.k} is not a multiple of {NVFP4_BLOCK}"))
        stored = weight.nbytes + (block.nbytes if block is not None else 0)
        stats.bits_per_param = 8 * stored / (stats.n * stats.k) if stats.n * stats.k else None
        if stats.bits_per_param is not None and stats.bits_per_param != NVFP4_BITS:
            found.append(
                Problem(
                    module,
                    weight.name,
                    f"stores {stats.bits_per_param:.4g} bits per "
                    f"parameter (weight + block scales over N x K = "
                    f"{stats.n} x {stats.k}); NVFP4 is {NVFP4_BITS}",
                )
            )
        found += _tp_problems(module, weight.name, stats.n, stats.k, tp, NVFP4_BLOCK)
    if block is not None and block.code == E4M3_CODE:
        scan = scans.setdefault(block.name, scan_tensor(block))
        stats.zero_scale_share = scan.zeros / scan.elements if scan.elements else None
        found += _block_scale_problems(module, block, scan)
    _check_scales(module, tensors, spec, stats, found)
    return stats


def _check_fp8_block_module(
    module: str,
    tensors: dict[str, TensorEntry],
    spec: LayoutSpec,
    tp: tuple[int, ...],
    scans: dict[str, TensorScan],
    found: list[Problem],
) -> ModuleStats:
    """An fp8-block linear: E4M3 [N, K], fp32 scales [ceil(N/128), ceil(K/128)] each finite, >= 0
    and <= 1 (decoded |w| <= 448), no input scale (dynamic), K and TP shards on 128 boundaries."""
    stats = _check_fp8_module(module, tensors, spec, tp, scans, found, k_multiple=FP8_BLOCK)
    scale_suffix = spec.suffix("block_scale")
    stray = tensors.get(input_suffix(SPECS[(spec.format, "fp8")]))
    if stray is not None:
        found.append(Problem(module, stray.name, "present in an fp8-block module, whose activations are dynamic"))
    if stats.n is not None:
        why = linear_problem(spec.format, spec.quant, module, stats.n, stats.k)
        if why is not None:
            found.append(Problem(module, f"{module}.{spec.suffix('weight')}", why))
    block = tensors.get(scale_suffix)
    name = f"{module}.{scale_suffix}"
    if block is None:
        found.append(Problem(module, name, "missing (fp32 scale per 128x128 block)"))
        return stats
    if stats.n is None:
        return stats
    want = spec.tensor("block_scale").shape(stats.n, stats.k)
    if block.code != "F32" or block.shape != want:
        found.append(
            Problem(
                module,
                name,
                f"is {block.code}{list(block.shape)}, expected F32 {list(want)} (the ceil(N/{FP8_BLOCK}) x "
                f"ceil(K/{FP8_BLOCK}) grid of N x K = {stats.n} x {stats.k})",
            )
        )
        return stats
    stats.bits_per_param = 8 * (tensors[spec.suffix("weight")].nbytes + block.nbytes) / (stats.n * stats.k)
    scales = read_small(block)
    bad = ~np.isfinite(scales) | (scales < 0)
    if bad.any():
        first = [int(i) for i in np.argwhere(bad)[0]]
        found.append(Problem(module, name, f"{int(bad.sum())} scales not finite and >= 0, first at block {first}"))
    elif scales.size and float(scales.max()) > 1.0:
        first = [int(i) for i in np.argwhere(scales > 1.0)[0]]
        found.append(
            Problem(
                module,
                name,
                f"block {first} scale {float(scales[tuple(first)]):.6g} > 1: the weight decodes to |w| up to "
                f"~{448 * float(scales.max()):.3g}, implausible for a linear layer (a scale stored inverted?)",
            )
        )
    elif scales.size and not scales.any():
        found.append(Problem(module, name, f"all {scales.size} block scales are zero: the whole module decodes to 0"))
    return stats


def _check_fp8_module(
    module: str,
    tensors: dict[str, TensorEntry],
    spec: LayoutSpec,
    tp: tuple[int, ...],
    scans: dict[str, TensorScan],
    found: list[Problem],
    k_multiple: int = 1,
) -> ModuleStats:
    """An FP8 linear's weight, its TP shards (K shards a multiple of `k_multiple`) and, per
    tensor, its scales; fp8-block (`k_multiple` 128) checks its scale grid itself."""
    stats = ModuleStats(module, spec.quant)
    weight = tensors.get(spec.suffix("weight"))
    if weight is None:
        found.append(
            Problem(module, f"{module}.{spec.suffix('weight')}", "missing (the module has scales but no weight)")
        )
    elif len(weight.shape) != 2 or weight.code != E4M3_CODE:
        found.append(Problem(module, weight.name, f"is {weight.code}{list(weight.shape)}, expected F8_E4M3 [N, K]"))
    if weight is not None and len(weight.shape) == 2:
        stats.n, stats.k = weight.shape
        stats.bits_per_param = 8 * weight.nbytes / (stats.n * stats.k) if stats.n * stats.k else None
        if stats.bits_per_param is not None and stats.bits_per_param != FP8_BITS:
            found.append(
                Problem(
                    module, weight.name, f"stores {stats.bits_per_param:.4g} bits per parameter; FP8 is {FP8_BITS:g}"
                )
            )
        if k_multiple > 1:
            found += _fp8_block_tp_problems(module, weight.name, stats.n, stats.k, tp)
        else:
            found += _tp_problems(module, weight.name, stats.n, stats.k, tp, 1)
        if weight.code == E4M3_CODE:
            scan = scans.setdefault(weight.name, scan_tensor(weight))
            if scan.nan:
                found.append(
                    Problem(
                        module,
                        weight.name,
                        f"{scan.nan} NaN codes (0x7F/0xFF), first at {_position(weight.shape, scan.first_nan)}",
                    )
                )
    if k_multiple == 1:
        _check_scales(module, tensors, spec, stats, found)
    return stats


def _fp8_block_tp_problems(module: str, tensor: str, n: int, k: int, tp: tuple[int, ...]) -> list[Problem]:
    """fp8-block's shape rules: K a multiple of 128 (vLLM's per_token_group_quant_fp8 quantizes the
    input in groups of 128 and asserts it); vLLM's validate_fp8_block_shape: at TP t > 1 a
    row-parallel K / t and a column-parallel N / t a multiple of 128, and at TP 1 every shard of a
    merged GEMM but the last (q, k of q/k/v; gate of gate/up) N a multiple of 128."""
    problems = []
    if k % FP8_BLOCK:
        problems.append(
            Problem(
                module,
                tensor,
                f"K = {k} is not a multiple of {FP8_BLOCK}: the engine quantizes the input per 128 columns",
            )
        )
    for t in tp:
        if t > 1:
            problems += _tp_problems(module, tensor, n, k, (t,), FP8_BLOCK, n_multiple=FP8_BLOCK)
    return problems


def _block_scale_problems(module: str, block: TensorEntry, scan: TensorScan) -> list[Problem]:
    problems = []
    if scan.elements and scan.zeros == scan.elements:
        problems.append(
            Problem(module, block.name, f"all {scan.elements} block scales are zero: the whole module decodes to 0")
        )
    if scan.nan:
        problems.append(
            Problem(
                module,
                block.name,
                f"{scan.nan} NaN block scales (E4M3 code 0x7F/0xFF), first at {_position(block.shape, scan.first_nan)}",
            )
        )
    if scan.negative:
        problems.append(
            Problem(module, block.name, f"{scan.negative} negative block scales (sign bit set): decode flips signs")
        )
    return problems


def _check_scales(
    module: str, tensors: dict[str, TensorEntry], spec: LayoutSpec, stats: ModuleStats, found: list[Problem]
) -> None:
    """The two per-tensor scales, and the weight's plausible magnitude (module docstring)."""
    weight_suffix = spec.suffix("weight_global")
    stats.weight_global_scale = _check_global(module, tensors, weight_suffix, spec, found, required=True)
    stats.input_global_scale = _check_global(
        module, tensors, input_suffix(spec), spec, found, required=spec.has_input_scales
    )
    stored = stats.weight_global_scale
    if stored is not None and np.isfinite(stored) and stored > 0:
        s_dec = float(spec.decode_global(stored))
        if not s_dec <= 1.0:
            found.append(
                Problem(
                    module,
                    f"{module}.{weight_suffix}",
                    (
                        f"is {stored:.6g}: the weight decodes to |w| up to ~{s_dec * spec.element_range:.3g} "
                        f"(S_dec = {s_dec:.6g} > 1), implausible for a linear layer (bound "
                        f"{spec.element_range:g}); the reciprocal stored (decode amax/{spec.element_range:g} "
                        f"vs encode {spec.element_range:g}/amax: this layout stores the {spec.convention} "
                        f"scale)?"
                    ),
                )
            )


def _check_global(
    module: str, tensors: dict[str, TensorEntry], suffix: str, spec: LayoutSpec, found: list[Problem], *, required: bool
) -> float | None:
    """Dtype, shape and value of a per-tensor scale; its value (None when absent or unreadable)."""
    entry = tensors.get(suffix)
    name = f"{module}.{suffix}"
    if entry is None:
        if required:
            found.append(Problem(module, name, "missing"))
        return None
    if not required:
        found.append(
            Problem(module, name, f"present in a {spec.quant} checkpoint, which has no input scales (weight-only)")
        )
        return None
    if entry.code != "F32" or entry.shape != spec.global_shape:
        found.append(
            Problem(module, name, f"is {entry.code}{list(entry.shape)}, expected F32 {list(spec.global_shape)}")
        )
        if entry.code != "F32" or entry.nbytes != 4:
            return None
    value = float(read_small(entry).reshape(-1)[0])
    if not np.isfinite(value) or value <= 0:
        found.append(Problem(module, name, f"is {value}: a global scale must be finite and > 0"))
    return value


def _tp_problems(
    module: str, tensor: str, n: int, k: int, tp: tuple[int, ...], k_multiple: int, n_multiple: int = 1
) -> list[Problem]:
    """Column-parallel layers split N (each shard's N a multiple of `n_multiple`), row-parallel
    layers split K (each shard's K a multiple of `k_multiple`)."""
    problems = []
    projection = projection_of(module)
    split = "none" if projection is None else projection.split
    for t in tp:
        if t == 1:
            continue
        if split == "column" and n % t:
            problems.append(
                Problem(module, tensor, f"column-parallel N = {n} does not split into {t} equal shards (TP {t})")
            )
        elif split == "column" and (n // t) % n_multiple:
            problems.append(
                Problem(
                    module,
                    tensor,
                    f"column-parallel N = {n} at TP {t} gives shards of N = {n // t}, not a multiple of {n_multiple}",
                )
            )
        if split == "row" and (k % t or (k // t) % k_multiple):
            problems.append(
                Problem(
                    module,
                    tensor,
                    f"row-parallel K = {k} at TP {t} gives shards of K = {k / t:g}, not a multiple of {k_multiple}",
                )
            )
    return problems


def _spec_of(layout: FolderLayout, tensors: Mapping[str, TensorEntry], module: str) -> LayoutSpec:
    """The spec a module is judged by: its scheme's (a uniform folder: the one spec); a mixed
    folder's module no scheme names: the layout its tensors are stored in (the other problems then
    name it), else the folder's first spec."""
    found = layout.spec_for(module)
    if found is not None:
        return found
    stored = [s for s in SPECS.values() if s.format == layout.format and set(s.suffixes) <= set(tensors)]
    return max(stored, key=lambda s: len(s.suffixes)) if stored else layout.spec


def _check_schemes(layout: FolderLayout, status: Mapping[str, str]) -> list[Problem]:
    """A mixed folder's schemes: every target names a linear, no linear is named by two schemes
    (vLLM and compressed-tensors take the first match silently: the folder says two things), the
    routed experts of one MoE layer share one scheme (`families.scheme_group`)."""
    problems = []
    linears = list(status)
    for spec, targets in layout.schemes:
        for target in targets:
            if not any(spec.matches(m, target) for m in linears):
                problems.append(
                    Problem(CONFIG_LEVEL, CONFIG, f"{spec.quant} scheme target {target!r} matches no linear layer")
                )
    experts: dict[str, dict[str, str]] = {}  # an MoE layer's routed experts -> {linear: quant}
    for module in linears:
        spec = layout.spec_for(module)
        if status[module] == "quantized" and spec is not None and scheme_group(module).endswith(".experts"):
            experts.setdefault(scheme_group(module), {})[module] = spec.quant
    for group, quants in experts.items():
        if len(set(quants.values())) > 1:
            detail = ", ".join(f"{q} {list(quants.values()).count(q)}" for q in dict.fromkeys(quants.values()))
            problems.append(
                Problem(
                    group,
                    CONFIG,
                    f"the routed experts of one MoE layer are in different schemes ({detail} linears); "
                    f"vLLM runs them as one fused MoE layer with one scheme",
                )
            )
    for module in linears:
        matched = layout.scheme_matches(module)
        if len(matched) > 1:
            problems.append(
                Problem(
                    module,
                    CONFIG,
                    f"named by {len(matched)} schemes' targets ({', '.join(s.quant for s in matched)}); "
                    f"a linear must have one (loaders take the first silently)",
                )
            )
    return problems


def _check_fused_groups(
    quantized: Mapping[str, ModuleStats], status: Mapping[str, str], layout: FolderLayout
) -> list[Problem]:
    """Shards fused into one GEMM by vLLM (q/k/v, gate/up, MoE w1/w3) must share their global
    scales (vLLM takes the max without rescaling block scales), must all be quantized or none and,
    in a mixed folder, share one scheme (vLLM refuses a fused layer whose shards differ)."""
    groups: dict[str, list[str]] = {}
    for module in status:
        group = fused_group(module)
        if group != module:
            groups.setdefault(group, []).append(module)
    problems = []
    for group, members in groups.items():
        states = {m: status[m] for m in members}
        if len(set(states.values())) > 1:
            detail = ", ".join(f"{m.rpartition('.')[2]} {s}" for m, s in states.items())
            problems.append(
                Problem(group, ", ".join(members), f"fused group mixes quantized and unquantized shards ({detail})")
            )
            continue
        specs = {m: layout.spec_for(m) for m in members}
        if len({s.quant for s in specs.values() if s is not None}) > 1:
            detail = ", ".join(f"{m.rpartition('.')[2]} {s.quant if s else 'bf16'}" for m, s in specs.items())
            problems.append(
                Problem(
                    group,
                    ", ".join(members),
                    f"fused group is split across formats ({detail}); vLLM requires one scheme per fused layer",
                )
            )
            continue
        spec = specs[members[0]] or layout.spec
        if spec.is_fp8_block:
            problems += _merged_block_problems(group, members, quantized)
            continue
        if not spec.is_nvfp4:
            continue  # FP8 shards keep their own weight scales (vLLM requantizes to the max)
        for suffix, attr in (
            (spec.suffix("weight_global"), "weight_global_scale"),
            (input_suffix(spec), "input_global_scale"),
        ):
            values = {m: getattr(quantized[m], attr) for m in members if m in quantized}
            values = {m: v for m, v in values.items() if v is not None}
            if len({np.float32(v) for v in values.values()}) > 1:
                detail = ", ".join(f"{m.rpartition('.')[2]} {v:.8g}" for m, v in values.items())
                problems.append(
                    Problem(
                        group,
                        ", ".join(f"{m}.{suffix}" for m in values),
                        f"fused group's {suffix} differ ({detail}); they must be "
                        f"equal (vLLM takes the max without rescaling block scales)",
                    )
                )
    return problems


def _merged_block_problems(group: str, members: list[str], quantized: Mapping[str, ModuleStats]) -> list[Problem]:
    """fp8-block shards of one merged GEMM against `formats.merged_problem` (vLLM's
    validate_fp8_block_shape at TP 1)."""
    sizes = {m: quantized[m].n for m in members if m in quantized and quantized[m].n is not None}
    found = merged_problem("fp8-block", sizes) if len(sizes) == len(members) else None
    return [] if found is None else [Problem(group, found[0], found[1])]


def _check_data(
    entries: Mapping[str, TensorEntry], scans: dict[str, TensorScan], may_be_zero: tuple[str, ...] = ()
) -> list[Problem]:
    """Every tensor streamed once: none all zero (but those the family says may be,
    `Family.may_be_zero`), no non-finite float values. Block scales and global scales are judged
    by their own checks."""
    own_checks = set(SCALE_SUFFIXES) | set(KV_SCALE_SUFFIXES)
    problems = []
    for name in sorted(entries, key=_natural_key):
        entry = entries[name]
        module, _, suffix = name.rpartition(".")
        if suffix in own_checks and (entry.code == E4M3_CODE or len(entry.shape) <= 1):
            continue
        scan = scans.get(name) or scans.setdefault(name, scan_tensor(entry))
        if entry.nbytes and scan.all_zero and not any(fnmatch.fnmatchcase(name, p) for p in may_be_zero):
            problems.append(Problem(module, name, f"all data is zero ({entry.code}{list(entry.shape)})"))
        if scan.nan and entry.code != E4M3_CODE:
            problems.append(
                Problem(
                    module, name, f"{scan.nan} non-finite values, first at {_position(entry.shape, scan.first_nan)}"
                )
            )
    return problems


def _position(shape: tuple[int, ...], flat: int | None) -> str:
    if flat is None or not shape:
        return "index 0"
    return "index " + str(list(int(i) for i in np.unravel_index(flat, shape)))
