"""Exact NVFP4 / FP8 numerics in JAX: quantizers, Hadamard transform, block-scaled GEMM, and the
one fp32-accumulating GEMM body every linear layer uses (`dot`), and the pure numpy metrics comparing
a model's logits or outputs to a reference (`metrics`: KL, top-1, perplexity, SQNR). All such math
lives here."""

from __future__ import annotations

from nvfp4tool.numerics.blocks import check_finite, tensor_amax, times_decode_scale
from nvfp4tool.numerics.dot import computed_after, dense, dense_widening, dot_nt, linear_output
from nvfp4tool.numerics.fp8 import (
    FP8Array,
    decode_fp8,
    dequantize_fp8,
    fake_quantize_fp8,
    fake_quantize_fp8_token_groups,
    fp8_decode_scale,
    quantize_fp8,
)
from nvfp4tool.numerics.fp8_gemm import fp8_matmul
from nvfp4tool.numerics.gemm import native_fp4_available, native_gemm_lowers, nvfp4_matmul, nvfp4_operand_matmul
from nvfp4tool.numerics.hadamard import rht16, rht_matrix
from nvfp4tool.numerics.nvfp4 import (
    NVFP4Array,
    NVFP4Operand,
    decode_e2m1,
    decode_nvfp4,
    decode_nvfp4_blocks,
    dequantize_nvfp4,
    encode_nvfp4_blocks,
    fake_quantize_nvfp4,
    nvfp4_block_amax,
    nvfp4_block_products,
    nvfp4_block_scales,
    nvfp4_global_scales,
    nvfp4_operand,
    pack_codes,
    quantize_nvfp4,
    stochastic_bits,
    transpose_2d,
    unpack_codes,
)

__all__ = [
    "FP8Array",
    "NVFP4Array",
    "NVFP4Operand",
    "check_finite",
    "decode_e2m1",
    "decode_fp8",
    "decode_nvfp4",
    "decode_nvfp4_blocks",
    "dense",
    "dequantize_fp8",
    "dequantize_nvfp4",
    "computed_after",
    "dense_widening",
    "dot_nt",
    "encode_nvfp4_blocks",
    "fake_quantize_fp8",
    "fake_quantize_fp8_token_groups",
    "fake_quantize_nvfp4",
    "fp8_decode_scale",
    "linear_output",
    "native_fp4_available",
    "native_gemm_lowers",
    "nvfp4_block_amax",
    "nvfp4_block_products",
    "nvfp4_block_scales",
    "nvfp4_global_scales",
    "nvfp4_matmul",
    "nvfp4_operand",
    "nvfp4_operand_matmul",
    "pack_codes",
    "quantize_fp8",
    "quantize_nvfp4",
    "rht16",
    "rht_matrix",
    "stochastic_bits",
    "tensor_amax",
    "times_decode_scale",
    "transpose_2d",
    "unpack_codes",
    "fp8_matmul",
]
