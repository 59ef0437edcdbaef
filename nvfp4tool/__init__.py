"""nvfp4tool: train, quantize, export and validate language models in NVIDIA's NVFP4 format.

Data flow (one subpackage per stage): checkpoint in (`converters/`) -> model (`model/`) ->
quantize (`numerics/`) -> export -> validate -> publish.
"""

__version__ = "0.1.0"
