"""The checkpoint checker: refuse a broken NVFP4 / FP8 serving checkpoint before it is served.

report = check_checkpoint("out/llama-nvfp4", tp=(1, 2, 4, 8))
for p in report.problems: print(p.line())      # "<module>: <tensor>: <what is wrong>"

formats  which layout a folder claims (`nvfp4tool.formats`: ModelOpt NVFP4 / W4A16 / FP8,
         compressed-tensors nvfp4-pack-quantized / float-quantized), its config problems
files    safetensors headers and index checked against the files; chunked tensor reads
scan     zero / NaN / sign counts of one tensor's data, streamed
model    config.json parsed as the loaders do (an unloadable config is a problem naming the
         key), the tensors against the model it describes (all present, none it lacks beyond
         the layout's quantization and KV-cache scale tensors), unquantized dtypes against its dtype
kv       FP8 KV-cache scales against the configs, each one listed in the report
record   the tensors against the export's provenance record (sha256, dtype, decoded amax)
checker  check_checkpoint: per-module, fused-group and data checks
report   Problem, ModuleStats, KVScaleStats, CheckReport (JSON, rich tables)
"""

from __future__ import annotations

from nvfp4tool.check.checker import check_checkpoint, parse_tp
from nvfp4tool.check.report import CheckReport, KVScaleStats, ModuleStats, Problem, print_report

__all__ = ["CheckReport", "KVScaleStats", "ModuleStats", "Problem", "check_checkpoint", "parse_tp", "print_report"]
