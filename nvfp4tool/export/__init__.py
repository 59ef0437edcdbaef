"""Serving checkpoints: export (ModelOpt / compressed-tensors, NVFP4 / FP8), format conversion,
and the simulation of what a serving engine computes from an export.

One module per concern: `plan` (what is quantized), `scale_search` (how a weight is quantized),
`modelopt` / `compressed_tensors` (how it is stored), `calibrate` (input amax), `writer` (the
streaming atomic export), `provenance`, `simulate`, `convert_format`. What is read is opened by
`nvfp4tool.checkpoints`.
"""

from __future__ import annotations

from nvfp4tool.export.writer import ExportOptions, ExportSummary, export_checkpoint

__all__ = ["ExportOptions", "ExportSummary", "export_checkpoint"]
