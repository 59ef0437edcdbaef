"""The checkpoint checker: refuse a broken NVFP4 / FP8 serving checkpoint before it is served.

    report = check_checkpoint("out/llama-nvfp4", tp=(1, 2, 4, 8))
    for p in report.problems: print(p.line())      # "<module>: <tensor>: <what is wrong>"

One module per concern: formats, files, scan, model, kv, record, checker (`check_checkpoint`), report.
Design notes: docs/design/check.md.
"""

from __future__ import annotations

from nvfp4tool.check.checker import check_checkpoint, parse_tp
from nvfp4tool.check.report import CheckReport, KVScaleStats, ModuleStats, Problem, print_report

__all__ = ["CheckReport", "KVScaleStats", "ModuleStats", "Problem", "check_checkpoint", "parse_tp", "print_report"]
