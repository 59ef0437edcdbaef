"""Precision recipes: the functions that plug into the model's linear seam (bf16, fp8, nvfp4)."""

from nvfp4tool.recipes.fp8_dot import FP8Options, fp8_dot
from nvfp4tool.recipes.nvfp4_dot import NVFP4Options, nvfp4_dot

__all__ = ["FP8Options", "NVFP4Options", "fp8_dot", "nvfp4_dot"]
