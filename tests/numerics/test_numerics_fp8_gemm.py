"""fp8_matmul (BF16 operands, fp32 accumulation, scales after the sum or per 128-wide K chunk) vs
the fp64 product of the dequantized operands and vs the former fp32 path (fake-quantize to fp32,
dot at Precision.HIGHEST), within fp32 rounding bounds derived from K.

The two paths are not compared bit for bit: on the CPU XLA sums a bf16 x bf16 -> fp32 dot
(YNNPACK) in a different order than an fp32 dot, so even power-of-two scales give results a few
ulps apart (checked for K = 128 .. 4096).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.numerics import dequantize_fp8, dot_nt, fake_quantize_fp8, fp8_matmul, quantize_fp8

from fixtures import nvfp4_oracle as oracle

BLOCKED = ("block128", "block128x128")

# (a's lead shape [..., M], N, K, (fmt, granularity) of a, of b)
CASES = [
    ((130,), 200, 128, ("e4m3", "tensor"), ("e4m3", "tensor")),
    ((2, 67), 70, 256, ("e5m2", "tensor"), ("e4m3", "tensor")),  # dgrad: E5M2 gradient
    ((130,), 70, 384, ("e4m3", "channel"), ("e4m3", "tensor")),
    ((2, 67), 200, 4096, ("e4m3", "tensor"), ("e4m3", "tensor")),
    ((130,), 200, 128, ("e4m3", "block128"), ("e4m3", "block128x128")),
    ((2, 67), 200, 384, ("e4m3", "block128"), ("e4m3", "block128x128")),
    ((130,), 70, 4096, ("e4m3", "block128"), ("e4m3", "block128")),  # wgrad
    ((67,), 200, 200, ("e4m3", "block128"), ("e4m3", "block128x128")),  # ragged last chunk
    ((67,), 70, 96, ("e4m3", "block128"), ("e4m3", "block128x128")),  # no whole chunk
    ((2, 130), 70, 256, ("e4m3", "block128x128"), ("e4m3", "block128")),
]


def _operand(rng, shape) -> np.ndarray:
    """Heavy-tailed values whose magnitude varies along K and along rows, so that block scales
    differ from chunk to chunk and from tile to tile."""
    k = shape[-1]
    rows = np.geomspace(0.1, 10, shape[-2])[:, None]
    return (rng.standard_t(df=3, size=shape) * np.geomspace(0.01, 50, k) * rows).astype(np.float32)


@pytest.mark.parametrize("lead, n, k, a_spec, b_spec", CASES)
def test_fp8_matmul_vs_fp32_path_and_fp64(lead, n, k, a_spec, b_spec):
    rng = np.random.default_rng(k + n)
    a, b = _operand(rng, (*lead, k)), _operand(rng, (n, k))
    a_q = quantize_fp8(a, fmt=a_spec[0], granularity=a_spec[1])
    b_q = quantize_fp8(b, fmt=b_spec[0], granularity=b_spec[1])
    got = np.asarray(fp8_matmul(a_q, b_q))
    assert got.shape == (*lead, n) and got.dtype == np.float32

    # The former path: operands fake-quantized to fp32, one fp32 dot.
    old = np.asarray(
        dot_nt(
            fake_quantize_fp8(a, fmt=a_spec[0], granularity=a_spec[1]),
            fake_quantize_fp8(b, fmt=b_spec[0], granularity=b_spec[1]),
            precision=jax.lax.Precision.HIGHEST,
        )
    )
    # Roundings per term. fp8_matmul vs the dequantized operands: 2 for the operands' own fp32
    # rounding (data * scale), chunk_len - 1 summing a chunk, 1 for scale_a * scale_b, 1 scaling
    # the partial, chunks - 1 accumulating chunks. The fp32 path: 1 product, K - 1 summing.
    chunks, chunk_len = (-(-k // 128), 128) if a_spec[1] in BLOCKED else (1, k)
    new_roundings, old_roundings = chunk_len + chunks + 2, k
    want, bound_new = oracle.gemm_with_bound(dequantize_fp8(a_q), dequantize_fp8(b_q), new_roundings)
    _, bound_old = oracle.gemm_with_bound(dequantize_fp8(a_q), dequantize_fp8(b_q), old_roundings)
    assert np.all(np.abs(got - want) <= bound_new)
    assert np.all(np.abs(old - want) <= bound_old)
    assert np.all(np.abs(got - old) <= bound_new + bound_old)


@pytest.mark.parametrize(
    "a_shape, b_shape, a_gran, b_gran, match",
    [
        ((8, 128), (4, 128), "tensor", "block128", "'tensor' \\(a\\) and 'block128' \\(b\\) do not pair"),
        ((8, 128), (4, 128), "block128x128", "channel", "do not pair"),
        ((128,), (4, 128), "tensor", "tensor", "operand a .* must be \\[..., M, K\\]"),
        ((8, 128), (2, 4, 128), "tensor", "tensor", "operand b .* must be \\[N, K\\]"),
        ((8, 128), (4, 256), "tensor", "tensor", "K differs"),
    ],
)
def test_fp8_matmul_errors(a_shape, b_shape, a_gran, b_gran, match):
    a_q = quantize_fp8(np.ones(a_shape, np.float32), granularity=a_gran)
    b_q = quantize_fp8(np.ones(b_shape, np.float32), granularity=b_gran)
    with pytest.raises(NVFP4ToolError, match=f"fp8_matmul: .*{match}"):
        fp8_matmul(a_q, b_q)
