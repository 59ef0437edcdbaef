"""A training run's files, below the stages that open and write them.

    config   `TrainConfig`: every option of `nvfp4tool train` (YAML + key=value overrides)
    records  `RunRecord` (run.json: the TrainConfig it ran with, its data and teacher hashes),
             `InputAmaxRecord` (input_amax.json), `PrecisionMapRecord` (precision_map.json), and
             the run folder's layout (`WEIGHTS_DIR`, `CHECKPOINTS_DIR`, `TOKENIZER_DIR`)

The trainer (`nvfp4tool.train`) writes a run; the one checkpoint opener (`nvfp4tool.checkpoints`)
reads it for export, validate, convert and a teacher, which is why both live below the two: run.json
is checked against the TrainConfig when it is read. Import the submodules; this package imports
nothing.
"""
