"""Exact NVFP4 / FP8 numerics in JAX: quantizers, Hadamard transform, block-scaled GEMM."""

from __future__ import annotations

from nvfp4tool.numerics.blocks import check_finite
from nvfp4tool.numerics.fp8 import FP8Array, dequantize_fp8, fake_quantize_fp8, quantize_fp8
from nvfp4tool.numerics.gemm import native_fp4_available, nvfp4_matmul
from nvfp4tool.numerics.hadamard import inverse_rht16, rht16, rht_matrix
from nvfp4tool.numerics.nvfp4 import (
    NVFP4Array,
    decode_e2m1,
    dequantize_nvfp4,
    e2m1_code_values,
    fake_quantize_nvfp4,
    nvfp4_global_scales,
    pack_codes,
    quantize_nvfp4,
    unpack_codes,
)

__all__ = [
    "FP8Array",
    "NVFP4Array",
    "check_finite",
    "decode_e2m1",
    "dequantize_fp8",
    "dequantize_nvfp4",
    "e2m1_code_values",
    "fake_quantize_fp8",
    "fake_quantize_nvfp4",
    "inverse_rht16",
    "native_fp4_available",
    "nvfp4_matmul",
    "nvfp4_global_scales",
    "pack_codes",
    "quantize_fp8",
    "quantize_nvfp4",
    "rht16",
    "rht_matrix",
    "unpack_codes",
]
