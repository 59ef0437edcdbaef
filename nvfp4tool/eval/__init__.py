"""Task evaluation (`nvfp4tool eval`): lm-eval tasks on the same items for the BF16 source, an FP8
reference and the NVFP4 export as served, their per-item scores paired.

`evaluate` (the runs, their pairing and verdict; `evaluate_export` is the one call the CLI makes),
`lm_backend` (the lm-eval model `nvfp4tool` over validate's openers; `python -m
nvfp4tool.eval.lm_backend run ...` is lm-eval's own command line with it), `paired` (the paired
statistics), `report` (eval.md, eval.png, the terminal table), `tasks/` (the shipped offline tasks:
YAML, their loaders and data). The record types are `nvfp4tool.records.evaluation`. Import the
submodules; this package imports nothing heavy.
"""
