"""The provenance record `nvfp4tool_export.json` written next to every export.

What was exported from what, how: tool version, source path and the sha256 of each source weight
file, format / quant / scale search / weight block, the precision map and recipe, calibration data
(path, sha256, samples, seq len) or the run's tracked amax, seed, and per quantized layer its
relative L2 weight error (and, with a scale search, the reduction against RTN).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import nvfp4tool

PROVENANCE_FILE = "nvfp4tool_export.json"


def build_record(*, source: Any, options: Any, plan: Any, weight_block: str,
                 input_amax_origin: str, calibration: dict[str, Any] | None,
                 layer_errors: dict[str, dict[str, float]], input_amax: dict[str, float] | None,
                 files_written: list[str]) -> dict[str, Any]:
    """The JSON-able record (see the module docstring)."""
    return {
        "tool": {"name": "nvfp4tool", "version": nvfp4tool.__version__},
        "source": {"path": source.path, "kind": source.kind, "step": source.step,
                   "files": {os.path.relpath(f, source.path): sha256_file(f)
                             for f in source.weight_files}},
        "format": options.format,
        "quant": options.quant,
        "scale_search": options.scale_search,
        "weight_block": weight_block,
        "recipe": source.recipe,
        "precision_map": {n: ("bf16" if n in plan.excluded else plan.quant)
                          for n in (*plan.quantized, *plan.excluded)},
        "exclude_modules": list(plan.excluded),
        "input_amax_origin": input_amax_origin,
        "calibration": calibration,
        "input_amax": input_amax,
        "seed": options.seed,
        "layers": layer_errors,
        "files": files_written,
    }


def write_record(folder: str, record: dict[str, Any]) -> None:
    with open(os.path.join(folder, PROVENANCE_FILE), "w") as f:
        json.dump(record, f, indent=1)


def sha256_file(path: str, chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()
