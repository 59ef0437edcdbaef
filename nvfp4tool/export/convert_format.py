"""`convert_format`: lossless conversion of an export between the ModelOpt and compressed-tensors
layouts, tensor by tensor.

The source must pass `check` first. Data and block-scale bytes are copied unchanged; NVFP4 global
scales are reciprocated in fp32 (ModelOpt stores decode scales, compressed-tensors encode scales).
A mixed export converts each linear in its own scheme and keeps every linear's quant.
Design notes: docs/design/export.md.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import time

import numpy as np

from converters.atomic import atomic_output_dir, check_output_path
from converters.hf import INDEX_FILE, HFFolderSource
from nvfp4tool import formats, progress
from nvfp4tool.config import read_hf_config
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError
from nvfp4tool.export.serving_folder import ServingFolder
from nvfp4tool.records.export import ExportRecord


@dataclasses.dataclass(frozen=True)
class FormatConversion:
    """What `convert_format` wrote."""

    out: str
    format: str  # the layout written: "modelopt" | "compressed-tensors"
    seconds: float
    record: ExportRecord | None  # the provenance carried over (None: the source had none)


def convert_format(src: str, out: str, *, to: str, force: bool = False) -> FormatConversion:
    """Convert the export folder `src` into `out` in layout `to`."""
    start = time.perf_counter()
    if to not in formats.FORMATS:
        raise NVFP4ToolError(f"unknown --to {to!r}; choose one of {', '.join(formats.FORMATS)}")
    check_output_path(out, (src,), flag="OUT", force=force)  # before any work (atomic_output_dir checks again)
    layout = formats.describe(src)
    if layout.format == to:
        raise NVFP4ToolError(f"{src}: already in the {to} layout")
    _refuse_what_check_refuses(src)
    source = HFFolderSource(src, check_config=False)
    specs = _module_specs(layout, source.names())  # quantized module -> its source spec
    quantized = set(specs)
    _refuse_what_to_cannot_carry(layout, specs, to, source)
    kv_target = formats.get(to, layout.spec.quant)  # the KV-scale layout is the format's
    kv_names = _kv_names(source.names(), layout.spec, kv_target)  # target name -> source name
    record = ExportRecord.read(src) if ExportRecord.exists(src) else None
    amax = _weight_amax(record, specs)
    files = source.shard_files()
    kv_source = set(kv_names.values())
    with (
        atomic_output_dir(out, force=force, inputs=(src,), flag="OUT") as tmp,
        progress.task("convert-format", total=len(source.names()), unit="tensor") as task,
    ):
        origin: dict[str, tuple[str | None, list[str]]] = {}  # output name -> (quantized module or None, source names)
        shards = []
        for file_name, names in files.items():
            entries = []
            for module, group_names in _units([n for n in names if n not in kv_source], quantized):
                if module:
                    weight_shape = source.shape(f"{module}.{specs[module].suffix('weight')}")
                    unit = _target(specs[module], to).layout(module, *specs[module].nk(weight_shape))
                else:
                    unit = [(n, source.dtype(n), tuple(source.shape(n))) for n in group_names]
                entries.extend(unit)
                origin.update({entry[0]: (module, group_names) for entry in unit})
            # KV-cache scales after the modules, as export writes them
            for target_name in (t for t, n in kv_names.items() if n in names):
                entries.append((target_name, "float32", kv_target.kv_scales.shape))
                origin[target_name] = (None, [kv_names[target_name]])
            shards.append((file_name, entries))
        cache: dict[str, np.ndarray] = {}

        def load(name: str) -> np.ndarray:
            if name not in cache:
                module, group_names = origin[name]
                group = {n: source.get(n) for n in group_names}
                task.advance(len(group_names), description=name)
                if module:
                    group = _target(specs[module], to).from_roles(module, specs[module].to_roles(module, group))
                elif name in kv_names:
                    group = {name: np.asarray(group[kv_names[name]], np.float32).reshape(kv_target.kv_scales.shape)}
                cache.update(group)
            return cache.pop(name)

        def weight_amax(name: str) -> float | None:
            module = origin[name][0]
            if not module or name != f"{module}.{_target(specs[module], to).suffix('weight')}":
                return None
            return amax.get(module)

        folder = ServingFolder(tmp, source_label=src)
        records = folder.write_shards(shards, load, amax=weight_amax)
        index = None
        if os.path.exists(os.path.join(src, INDEX_FILE)):
            with open(os.path.join(src, INDEX_FILE)) as f:
                index = json.load(f)
        folder.write_index(index, records)
        quants = {m: spec.quant for m, spec in specs.items()} if layout.is_mixed else None
        folder.write_configs(read_hf_config(src)[1], kv_target, layout.exclude, layout.kv_cache, quants=quants)
        skip = (*layout.spec.config_files, INDEX_FILE, ExportRecord.FILE_NAME, "*.safetensors")
        folder.copy_files(
            os.path.join(src, f)
            for f in sorted(os.listdir(src))
            if os.path.isfile(os.path.join(src, f)) and not any(fnmatch.fnmatch(f, p) for p in skip)
        )
        converted = None if record is None else dataclasses.replace(record, format=to, tensors=records)
        folder.write_record(converted)
    return FormatConversion(out=out, format=to, seconds=time.perf_counter() - start, record=converted)


# ------------------------------------------------------------------------------------------
# helpers


def _refuse_what_check_refuses(src: str) -> None:
    """NVFP4ToolError with the first problem `check` finds in `src` (nothing is written)."""
    from nvfp4tool.check import check_checkpoint

    report = check_checkpoint(src)
    if not report.ok:
        raise NVFP4ToolError(report.failure("not converted"))


def _refuse_what_to_cannot_carry(layout, specs: dict[str, formats.LayoutSpec], to: str, source) -> None:
    """Before writing: a mixed folder with a quant `to`'s mixed loader does not map, or a linear
    `to`'s layout of its quant cannot hold (`formats.mixed_problem` / `linear_problem`), refused in
    one line (ModelOpt: fp8-block)."""
    if layout.is_mixed:
        problem = formats.mixed_problem(to, {s.quant for s in specs.values()})
        if problem is not None:
            raise NVFP4UsageError(problem)
    for module, spec in specs.items():
        n, k = spec.nk(source.shape(f"{module}.{spec.suffix('weight')}"))
        problem = formats.linear_problem(to, spec.quant, module, n, k)
        if problem is not None:
            raise NVFP4ToolError(f"{module}.weight: {spec.quant} in --to {to}: {problem}")


def _module_specs(layout: formats.FolderLayout, names: list[str]) -> dict[str, formats.LayoutSpec]:
    """Quantized module -> its spec: the modules holding their scheme's marker scale (the weight
    global scale; fp8-block's scale grid; a mixed folder: each module's own scheme), in file order."""
    specs = {}
    for name in names:
        module, _, suffix = name.rpartition(".")
        spec = layout.spec_for(module)
        if spec is not None and suffix == spec.marker_suffix:
            specs[module] = spec
    return specs


def _target(spec: formats.LayoutSpec, to: str) -> formats.LayoutSpec:
    """The layout of `spec`'s quant in the format `to`."""
    return formats.get(to, spec.quant)


def _weight_amax(record: ExportRecord | None, specs: dict[str, formats.LayoutSpec]) -> dict[str, float]:
    """Quantized module -> its recorded decoded weight amax (carried over to the converted record)."""
    if record is None:
        return {}
    found = {m: record.tensors.get(f"{m}.{spec.suffix('weight')}") for m, spec in specs.items()}
    return {m: t.amax for m, t in found.items() if t is not None and t.amax is not None}


def _kv_names(names: list[str], source: formats.LayoutSpec, target: formats.LayoutSpec) -> dict[str, str]:
    """{target name: source name} of the source's KV-cache scales."""
    renamed = {}
    for name in names:
        found = source.kv_scales.attention_of(name)
        if found is not None:
            attention, which = found
            renamed[target.kv_scales.names(attention)[which == "v"]] = name
    return renamed


def _units(names: list[str], quantized: set[str]):
    """(module or None, names) per unit in file order: a quantized module's tensors together."""
    members: dict[str, list[str]] = {}
    for name in names:
        module = name.rpartition(".")[0]
        if module in quantized:
            members.setdefault(module, []).append(name)
    done = set()
    for name in names:
        module = name.rpartition(".")[0]
        if module not in quantized:
            yield None, [name]
        elif module not in done:
            done.add(module)
            yield module, members[module]
