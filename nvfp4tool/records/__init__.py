"""Typed records of the files the stages hand each other; one module per producing stage.

    base        `Record`: the one strict JSON reader/writer every record uses (file name, unknown or
                missing keys, wrong types and non-finite numbers are errors naming the file)
    export      `ExportRecord` (nvfp4tool_export.json: an export's provenance), `SourceRecord`,
                the one file hasher
    validation  `ValidationRecord` (validation.json, published with the export)

Every JSON file one stage writes and another reads is a frozen dataclass here (or in the module
that owns it, registered below) with its FILE_NAME; no stage reads another stage's JSON by string
keys. A training run's records (`RunRecord`, ...) type their content with the TrainConfig, so they
live with it above the recipes, in `nvfp4tool.run.records`; this package imports no stage.
"""

from nvfp4tool.records.base import Record, RecordError

__all__ = ["Record", "RecordError"]
