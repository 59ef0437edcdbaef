"""The Python API: one function per command, which the CLI calls.

    from nvfp4tool import api
    summary = api.export("hf/m", "out/m-nvfp4", format="compressed-tensors", quant="nvfp4")
    report = api.check("out/m-nvfp4")              # CheckReport: .ok, .problems

A command's arguments are the function's positional ones, its options keywords of the same name
(`--calib-data` -> `calib_data`, `--json` -> `json_copy`) with the same defaults (the library
options' own); each returns what its stage wrote (a summary or run whose `.record` is the typed
record, or the report) and never exits: bad arguments raise NVFP4UsageError, bad data
NVFP4ToolError. Reference: docs/api.md. Design notes: docs/design/cli.md.
"""

from nvfp4tool.api.data import prepare_data, verify_data
from nvfp4tool.api.proof import check, evaluate, validate
from nvfp4tool.api.publish import push, quickstart
from nvfp4tool.api.stages import convert, convert_format, export, plot, train

__all__ = [
    "check",
    "convert",
    "convert_format",
    "evaluate",
    "export",
    "plot",
    "prepare_data",
    "push",
    "quickstart",
    "train",
    "validate",
    "verify_data",
]
