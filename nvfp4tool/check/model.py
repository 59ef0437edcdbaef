"""The folder's tensors against the model its config.json describes (supported families only).

When config.json parses as a `ModelConfig` (Llama / Mistral / Qwen2 / Qwen3), every tensor the
model needs must be in the folder with its shape: a non-linear tensor (embedding, norm, bias) as
is, a linear layer either unquantized with its [N, K] weight or quantized with N x K (unpacked)
equal to the model's. This catches layers an exporter silently skipped and transposed or
mis-sized packed weights. Other architectures (MoE, vision) are skipped: `None` is returned.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping

from nvfp4tool.check.files import TensorEntry
from nvfp4tool.check.formats import CONFIG
from nvfp4tool.check.report import ModuleStats, Problem
from nvfp4tool.config import ModelConfig
from nvfp4tool.errors import NVFP4ToolError


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
    problems = []
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
