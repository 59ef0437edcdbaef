"""The folder's tensors against the model its config.json describes (supported families only).

When config.json parses as a `ModelConfig` (Llama / Mistral / Qwen2 / Qwen3, Qwen3-MoE / Mixtral),
every tensor the model needs must be in the folder with its shape: a non-linear tensor (embedding,
norm, bias) as is, a linear layer either unquantized with its [N, K] weight or quantized with N x K
(unpacked) equal to the model's. This catches layers (or MoE experts) an exporter silently skipped
and transposed or mis-sized packed weights. A MoE router must not be quantized (engines compute
the routing from its BF16 weight; a too-broad pattern quantizes it). Other architectures (vision)
are skipped: `None` is returned.
`check_dtypes`: the unquantized tensors' dtypes against the dtype config.json declares.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Collection, Mapping

from nvfp4tool.check.files import TensorEntry
from nvfp4tool.check.formats import CONFIG
from nvfp4tool.check.report import ModuleStats, Problem
from nvfp4tool.config import ModelConfig
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.formats import LayoutSpec


def check_against_model(folder: str, entries: Mapping[str, TensorEntry],
                        quantized: Mapping[str, ModuleStats],
                        reported: Collection[str] = ()) -> list[Problem] | None:
    """Problems of the folder's tensors against config.json's model; None when it is not a
    supported model family (nothing checked). Modules and tensors in `reported` (named by earlier
    problems) are skipped: one root cause, one report."""
    try:
        config = ModelConfig.from_hf_folder(os.path.join(folder, CONFIG))
    except NVFP4ToolError:
        return None
    problems = [Problem(router, ", ".join(sorted(n for n in entries if n.rpartition(".")[0] == router)),
                        "MoE router is quantized: routers must stay BF16 (keep it out of the quantized "
                        "modules and list it in the exclusion list)")
                for router in config.router_names() if router in quantized]
    for name, shape in config.expected_tensor_shapes().items():
        module = name.rpartition(".")[0]
        if module in reported or name in reported:
            continue
        if module in quantized and name.endswith(".weight") and len(shape) == 2:
            stats = quantized[module]
            if stats.n is not None and (stats.n, stats.k) != shape:
                problems.append(Problem(module, name, f"quantized weight holds N x K = {stats.n} x "
                                                      f"{stats.k}, but {CONFIG}'s model needs "
                                                      f"{shape[0]} x {shape[1]}"))
        elif name not in entries:
            problems.append(Problem(module, name, f"missing: {CONFIG}'s model needs {list(shape)}"))
        elif entries[name].shape != shape:
            problems.append(Problem(module, name, f"has shape {list(entries[name].shape)}, "
                                                  f"{CONFIG}'s model needs {list(shape)}"))
    return problems


def check_dtypes(folder: str, entries: Mapping[str, TensorEntry], quantized: Collection[str],
                 spec: LayoutSpec) -> list[Problem]:
    """Unquantized floating tensors against config.json's `dtype` / `torch_dtype`: a BF16 tensor
    whose header was relabelled F16 (same size, every value wrong) loads without complaint
    otherwise; an unquantized weight / bias with an integer dtype (F32 relabelled I32) neither.
    Tensors of quantized modules (their dtypes are the layout's) and single-element scales are not
    judged here."""
    try:
        with open(os.path.join(folder, CONFIG), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return []  # reported by the format detection
    declared = config.get("dtype", config.get("torch_dtype")) if isinstance(config, dict) else None
    want = _CODE_OF_TORCH_DTYPE.get(declared) if isinstance(declared, str) else None
    if want is None:
        return []
    layout_suffixes = set(spec.suffixes)
    problems = []
    for name, entry in entries.items():
        module, _, suffix = name.rpartition(".")
        if module in quantized and suffix in layout_suffixes:
            continue
        if entry.code in _INTEGER and suffix in ("weight", "bias"):  # e.g. F32 relabelled I32
            problems.append(Problem(module, name, f"is {entry.code}, not a floating dtype, for an "
                                                  f"unquantized parameter ({CONFIG} says dtype {declared})"))
        elif entry.code in _FLOAT16_32 and math.prod(entry.shape) > 1 and entry.code != want:
            problems.append(Problem(module, name, f"is {entry.code} but {CONFIG} says dtype "
                                                  f"{declared} ({want}): relabelled header?"))
    return problems


_CODE_OF_TORCH_DTYPE = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
_FLOAT16_32 = ("BF16", "F16", "F32")
# Integer dtypes no parameter of ours has (U8 / F8 are quantized data, judged by the module checks).
_INTEGER = ("I8", "I16", "I32", "I64", "U16", "U32", "U64", "BOOL")
