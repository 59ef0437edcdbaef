"""`convert_format`: lossless conversion of an export between the ModelOpt and compressed-tensors
layouts, tensor by tensor.

Data (`weight` <-> `weight_packed`) and block-scale bytes are copied unchanged; NVFP4 global
scales are reciprocated in fp32 (ModelOpt stores decode scales, compressed-tensors encode scales;
the same `1 / x` as compressed-tensors' `ModelOptNvfp4Converter`) and reshaped [] <-> [1]; FP8
scales are only reshaped. config.json's `quantization_config` is rewritten (and ModelOpt's
`hf_quant_config.json` written or dropped); other files are copied. For exports of ours the
round trip is exact: their decode scales satisfy fl(1 / fl(1 / s)) == s (tested).
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import time

import numpy as np

from converters.atomic import atomic_output_dir
from converters.hf import INDEX_FILE, SINGLE_FILE, HFFolderSource, write_safetensors
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.export import compressed_tensors, modelopt
from nvfp4tool.export.plan import ExportPlan

FORMATS = ("modelopt", "compressed-tensors")
_SKIP_FILES = ("config.json", modelopt.HF_QUANT_CONFIG_FILE, INDEX_FILE, "*.safetensors")


def convert_format(src: str, out: str, *, to: str, force: bool = False) -> float:
    """Convert the export folder `src` into `out` in layout `to`; returns seconds taken."""
    start = time.perf_counter()
    if to not in FORMATS:
        raise NVFP4ToolError(f"unknown --to {to!r}; choose one of {', '.join(FORMATS)}")
    fmt, quant, quantized = detect_export(src)
    if fmt == to:
        raise NVFP4ToolError(f"{src}: already in the {to} layout")
    with open(os.path.join(src, "config.json")) as f:
        hf = json.load(f)
    excluded = tuple(hf["quantization_config"].get("ignore") or ())
    plan = ExportPlan(quant=quant, quantized=tuple(quantized), excluded=excluded, groups={})
    source = HFFolderSource(src, check_config=False)
    convert = compressed_tensors.from_modelopt if to == "compressed-tensors" else compressed_tensors.to_modelopt
    quantized_set = set(quantized)
    files = _shard_files(src)
    with atomic_output_dir(out, force=force, inputs=(src,), flag="OUT") as tmp:
        weight_map = {}
        for file_name, names in files.items():
            cache: dict[str, np.ndarray] = {}
            layout, origin = [], {}
            for module, group_names in _units(names, quantized_set):
                entries = [(n, source.dtype(n), tuple(source.shape(n))) for n in group_names]
                if module:
                    entries = compressed_tensors.convert_layout(entries, quant, to_ct=to == "compressed-tensors")
                layout.extend(entries)
                origin.update({entry[0]: (module, group_names) for entry in entries})

            def load(name, origin=origin, cache=cache):
                if name not in cache:
                    module, group_names = origin[name]
                    group = {n: source.get(n) for n in group_names}
                    cache.update(convert(group, quant) if module else group)
                return cache.pop(name)

            write_safetensors(os.path.join(tmp, file_name), layout, load, source_label=src)
            weight_map.update({entry[0]: file_name for entry in layout})
        if len(files) > 1:
            with open(os.path.join(src, INDEX_FILE)) as f:
                index = json.load(f)
            index["weight_map"] = weight_map
            _write_json(os.path.join(tmp, INDEX_FILE), index)
        target = modelopt if to == "modelopt" else compressed_tensors
        hf["quantization_config"] = target.quantization_config(plan)
        _write_json(os.path.join(tmp, "config.json"), hf)
        if to == "modelopt":
            from nvfp4tool import __version__

            _write_json(os.path.join(tmp, modelopt.HF_QUANT_CONFIG_FILE), modelopt.hf_quant_config(
                plan, {"name": "nvfp4tool", "version": __version__}))
        for file_name in sorted(os.listdir(src)):
            path = os.path.join(src, file_name)
            if os.path.isfile(path) and not any(fnmatch.fnmatch(file_name, p) for p in _SKIP_FILES):
                shutil.copy2(path, os.path.join(tmp, file_name))
    return time.perf_counter() - start


def detect_export(folder: str) -> tuple[str, str, list[str]]:
    """(format, quant, quantized module names) of an export folder, from its config and headers."""
    config_path = os.path.join(folder, "config.json")
    try:
        with open(config_path) as f:
            qc = json.load(f).get("quantization_config")
    except FileNotFoundError:
        raise NVFP4ToolError(f"{folder}: no config.json") from None
    if not isinstance(qc, dict):
        raise NVFP4ToolError(f"{config_path}: no quantization_config (not a quantized export)")
    method = qc.get("quant_method")
    if method == "modelopt":
        algo = qc.get("quant_algo")
        quant = {v: k for k, v in modelopt.QUANT_ALGO.items()}.get(algo)
        fmt, marker = "modelopt", ("weight_scale",)
    elif method == "compressed-tensors":
        group = next(iter((qc.get("config_groups") or {}).values()), {})
        if qc.get("format") == "nvfp4-pack-quantized":
            quant = "nvfp4" if group.get("input_activations") else "nvfp4-weight-only"
        elif qc.get("format") == "float-quantized":
            quant = "fp8"
        else:
            quant = None
        fmt, marker = "compressed-tensors", ("weight_scale",)
    else:
        raise NVFP4ToolError(f"{config_path}: quant_method {method!r} is neither modelopt nor "
                             "compressed-tensors")
    if quant is None:
        raise NVFP4ToolError(f"{config_path}: unsupported quantization_config "
                             f"({qc.get('quant_algo') or qc.get('format')})")
    names = HFFolderSource(folder, check_config=False).names()
    quantized = [n.rpartition(".")[0] for n in names if n.rpartition(".")[2] in marker]
    return fmt, quant, quantized


# ------------------------------------------------------------------------------------------
# helpers


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


def _shard_files(folder: str) -> dict[str, list[str]]:
    from converters.hf import read_safetensors_header

    index_path = os.path.join(folder, INDEX_FILE)
    if os.path.exists(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        files: dict[str, list[str]] = {}
        for name, file_name in weight_map.items():
            files.setdefault(file_name, []).append(name)
        return files
    return {SINGLE_FILE: list(read_safetensors_header(os.path.join(folder, SINGLE_FILE)))}


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
