"""Validation of a serving export against its BF16 source and an FP8 reference.

`runner` (the three models on the same batches; `validate_export` is the one call the CLI makes),
`generation` (greedy continuations), `thresholds` (pass/fail), `report` (terminal, JSON, Markdown,
PNGs), `sensitivity` (which layers to keep in BF16 for a KL target); the metrics themselves are
`nvfp4tool.numerics.metrics` (export's fold check uses them too). Import the submodules; this
package imports nothing heavy (the CLI reads the threshold defaults without loading JAX).
"""
