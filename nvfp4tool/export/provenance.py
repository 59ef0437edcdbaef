"""Builds the export's provenance record (`nvfp4tool.records.export.ExportRecord`,
`nvfp4tool_export.json`) from what the writer knows.

Nothing machine-specific goes in: the source is named by its Hub id when it is a Hub cache
snapshot (`.../models--ORG--NAME/snapshots/<rev>`), else by its folder name, plus the sha256 of
each weight file relative to it; calibration data by file name + sha256; written files relative
to the export.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

import nvfp4tool
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.records.export import (
    CalibrationRecord,
    EqualizationRecord,
    ExportRecord,
    GPTQRecord,
    LayerErrorRecord,
    SourceRecord,
    TensorRecord,
    ToolRecord,
    sha256_file,
)


def build_record(
    *,
    source: Any,
    options: Any,
    plan: Any,
    weight_block: str,
    input_amax_origin: str,
    calibration: CalibrationRecord | None,
    layer_errors: dict[str, dict[str, float]],
    input_amax: dict[str, float] | None,
    files_written: list[str],
    tensors: dict[str, TensorRecord],
    kv_amax: dict[str, tuple[float, float]] | None = None,
    gptq: GPTQRecord | None = None,
    equalization: EqualizationRecord | None = None,
) -> ExportRecord:
    """The record of one export (see the module docstring)."""
    return ExportRecord(
        tool=ToolRecord(name="nvfp4tool", version=nvfp4tool.__version__),
        source=SourceRecord.of(source),
        format=options.format,
        quant=plan.quant,
        scale_search=options.scale_search,
        weight_block=weight_block,
        recipe=source.recipe,
        precision_map={
            n: "bf16" if n in plan.excluded else plan.quant_of(n) for n in (*plan.quantized, *plan.excluded)
        },
        exclude_modules=tuple(plan.excluded),
        input_amax_origin=input_amax_origin,
        calibration=calibration,
        input_amax=input_amax,
        layers={m: LayerErrorRecord(**e) for m, e in layer_errors.items()},
        files=tuple(files_written),
        tensors=dict(tensors),
        kv_cache=options.kv_cache,
        kv_amax=kv_amax,
        weight_rounding=options.weight_rounding,
        gptq=gptq,
        equalize=options.equalize,
        equalization=equalization,
        export_recipe=options.recipe,
    )


def gptq_record(*, damp: float, block_size: int, errors: dict[str, Any], block_scales: str = "original") -> GPTQRecord:
    """The GPTQ settings and the mean output-error reduction over the quantized linears (`errors`:
    module -> `gptq.GPTQError`)."""
    reductions = [1.0 - e.output_rel_err / e.rtn_output_rel_err for e in errors.values() if e.rtn_output_rel_err]
    return GPTQRecord(
        damp=float(damp),
        block_size=block_size,
        act_order="static: 16-column blocks by descending sum of diag(H)",
        mean_output_err_reduction=float(np.mean(reductions)) if reductions else 0.0,
        block_scales=block_scales,
    )


def calibration_record(
    path: str, ids_SxL: np.ndarray, *, requested: tuple[int, int], routed_tokens: dict[str, int] | None = None
) -> CalibrationRecord:
    """The calibration data (of the input scales and / or the KV-cache scales) by file name and
    sha256, the windows that ran (`ids_SxL`, as read) and what was asked (`requested`: samples,
    seq_len); with `routed_tokens` (MoE: expert -> tokens its router sent it), all-experts
    calibration and those counts."""
    samples, seq_len = (int(d) for d in ids_SxL.shape)
    return CalibrationRecord(
        file=os.path.basename(path),
        sha256=sha256_file(path),
        samples=samples,
        seq_len=seq_len,
        tokens=samples * seq_len,
        requested_samples=int(requested[0]),
        requested_seq_len=int(requested[1]),
        all_experts=bool(routed_tokens),
        routed_tokens=routed_tokens or None,
    )


def locate_source(export_dir: str) -> tuple[str, int | None]:
    """(path, step) of an export's source, found by the name its record gives, next to the export
    folder or in the working directory, and only if its weight files' sha256 match the record
    (the record holds no path). NVFP4ToolError asking for --source otherwise."""
    record = ExportRecord.read(export_dir)
    where = ExportRecord.path(export_dir)
    name = record.source.name
    candidates = [os.path.join(os.path.dirname(os.path.abspath(export_dir)), name), os.path.abspath(name)]
    for folder in dict.fromkeys(candidates):
        if (
            os.path.isdir(folder)
            and record.source.files
            and all(
                os.path.isfile(os.path.join(folder, f)) and sha256_file(os.path.join(folder, f)) == digest
                for f, digest in record.source.files.items()
            )
        ):
            return folder, record.source.step
    raise NVFP4ToolError(
        f"{where}: the source {name!r} (recorded by name and file hashes, not by path) "
        f"is neither next to the export nor in the working directory with the same "
        f"weights; pass --source PATH"
    )
