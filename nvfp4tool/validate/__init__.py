"""Validation of a serving export against its BF16 source and an FP8 reference.

`metrics` (pure functions), `runner` (the three models on the same batches; `validate_export` is
the one call the CLI makes), `generation` (greedy continuations), `thresholds` (pass/fail),
`report` (terminal, JSON, Markdown, PNGs), `sensitivity` (which layers to keep in BF16 for a KL
target). Import the submodules; this package imports nothing heavy (the CLI reads the threshold
defaults without loading JAX).
"""
