"""Serving checkpoints: export (ModelOpt / compressed-tensors, NVFP4 / FP8), format conversion,
and the simulation of what a serving engine computes from an export.

One module per concern: `plan` (what is quantized), `job` (`ExportJob`: the resolved inputs of one
export), `quantizers` (the one weight-quantizer interface: scale search, GPTQ, FP8),
`scale_search` (how a weight's scales are chosen), `gptq` (GPTQ rounding with fixed scales) and
`gptq_pass` (its sequential calibration), `calibrate` (input amax; K / V amax for an FP8 KV cache),
`writer` (the streaming atomic export), `serving_folder` (the one writer of serving folders:
shards, index, configs, tensor records; export and convert-format write through it),
`provenance` (the ExportRecord it writes), `simulate`, `convert_format`. What is read is opened by
`nvfp4tool.checkpoints`; how a layout is stored (names, dtypes, shapes, configs) is declared in
`nvfp4tool.formats`, not here.
"""

from __future__ import annotations

from nvfp4tool.export.job import ExportOptions
from nvfp4tool.export.writer import ExportSummary, export_checkpoint

__all__ = ["ExportOptions", "ExportSummary", "export_checkpoint"]
