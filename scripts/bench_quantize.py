"""Throughput of the NVFP4 quantizers on a large bf16 tensor, against a plain elementwise pass.

Cases (each one jitted, warmed up, median of --runs timed calls with block_until_ready):
  x*2 (bf16)           the elementwise reference: 2 bytes read + 2 written per element
  quantize 1d / 2d     amax, scales, codes, packing (minimal traffic: 2 in + 0.5625 out)
  quantize RHT+1d      rht16 along the last axis, then 1d quantize (the wgrad operand path)
  quantize SR          1d with stochastic rounding
  dequantize           packed + scales -> bf16 (0.5625 in + 2 out)
  fake-quantize 1d     quantize-dequantize without packing (2 in + 2 out)
  fused ...            the Pallas kernels of numerics/fused.py, given the global amax
                       (computed once outside, as the recipe's amax would be): packed 1d / 2d /
                       RHT+1d / transposed 1d (x
                       [K, N] quantized along K into the [N, K] layout), SR (the 4-byte random
                       bits per element are read too: 2 + 4 in + 0.5625 out), and the bf16
                       operand for the emulated GEMM (1d, transposed 1d: 2 in + 2 out).
                       On CPU they run in Pallas interpret mode, whose time grows with the square
                       of the size (1.0 s per call at 1024^2, 13 s at 2048^2 on the 2-core
                       machine): skipped there unless --fused is
                       given (with a small --size), and then timed once each, which only shows
                       that they run
GB/s counts those minimal bytes; "vs x*2" is the case's time divided by the x*2 time, and
"% x*2 GB/s" (`bw_vs_copy` in the JSON) its GB/s as a fraction of x*2's (issue 13's goal for the
fused kernels on a GPU: >= 80%). A fused
kernel that fails (e.g. does not lower on this GPU) is reported as FAILED with its error, the
other rows still print, and the exit status is 1.

Usage: PYTHONPATH=. python3 scripts/bench_quantize.py [--size 4096] [--runs 7] [--json OUT]
[--fused/--no-fused] (default size: 4096 on CPU, 16384 on GPU; fused cases by default off CPU).
CPU smoke run of every case: ... --size 256 --runs 1 --fused
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from nvfp4tool.numerics import (
    dequantize_nvfp4,
    fake_quantize_nvfp4,
    quantize_nvfp4,
    rht16,
    stochastic_bits,
    tensor_amax,
)
from nvfp4tool.numerics.fused import fused_quantize

NVFP4_BYTES = 0.5625  # 4 bits of code + 8 bits of scale per 16 elements, per element
BF16_BYTES = 2.0
BITS_BYTES = 4.0  # uint32 random bits per element (fused SR reads them)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=None, help="square tensor side (x16)")
    parser.add_argument("--runs", type=int, default=7, help="timed runs per case (median)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument(
        "--fused",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="time the Pallas kernels too (default: unless on CPU)",
    )
    args = parser.parse_args()
    backend = jax.default_backend()
    size = args.size or (16384 if backend == "gpu" else 4096)
    fused = backend != "cpu" if args.fused is None else args.fused
    if not fused:
        print("fused cases skipped (on CPU they run interpreted: add --fused with a small --size)")
    results = run_benchmarks(size, args.runs, fused=fused)
    print(
        f"backend={backend} device={jax.devices()[0].device_kind} size={size}x{size} bf16 "
        f"runs={args.runs} jax={jax.__version__}"
    )
    print(f"{'case':<20} {'median ms':>10} {'GB/s':>9} {'vs x*2':>8} {'% x*2 GB/s':>11}")
    for row in results:
        if "error" in row:
            print(f"{row['case']:<20} FAILED: {row['error']}")
            continue
        print(
            f"{row['case']:<20} {row['median_ms']:>10.2f} {row['gb_per_s']:>9.1f} "
            f"{row['time_vs_copy']:>8.2f} {100 * row['bw_vs_copy']:>10.0f}%"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "backend": backend,
                    "device": jax.devices()[0].device_kind,
                    "size": size,
                    "runs": args.runs,
                    "jax": jax.__version__,
                    "results": results,
                },
                f,
                indent=2,
            )
    if any("error" in row for row in results):
        sys.exit(1)


def run_benchmarks(size: int, runs: int, *, fused: bool) -> list[dict]:
    """Time every case (the fused ones if `fused`) on a size x size bf16 N(0,1) tensor; returns
    one dict per case."""
    x = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)
    key = jax.random.key(1)
    q = jax.jit(quantize_nvfp4)(x)
    gamax = tensor_amax(x)
    bits = stochastic_bits(key, x.shape)
    elements = size * size
    cases = [
        ("x*2 (bf16)", jax.jit(lambda v: v * 2), (x,), 2 * BF16_BYTES),
        ("quantize 1d", jax.jit(lambda v: quantize_nvfp4(v)), (x,), BF16_BYTES + NVFP4_BYTES),
        ("quantize 2d", jax.jit(lambda v: quantize_nvfp4(v, block="2d")), (x,), BF16_BYTES + NVFP4_BYTES),
        ("quantize RHT+1d", jax.jit(lambda v: quantize_nvfp4(rht16(v))), (x,), BF16_BYTES + NVFP4_BYTES),
        (
            "quantize SR",
            jax.jit(lambda v, k: quantize_nvfp4(v, rounding="stochastic", key=k)),
            (x, key),
            BF16_BYTES + NVFP4_BYTES,
        ),
        ("dequantize", jax.jit(lambda t: dequantize_nvfp4(t, jnp.bfloat16)), (q,), NVFP4_BYTES + BF16_BYTES),
        ("fake-quantize 1d", jax.jit(lambda v: fake_quantize_nvfp4(v)), (x,), 2 * BF16_BYTES),
    ]
    fused_cases = [
        ("fused 1d", _fused(), (x, gamax), BF16_BYTES + NVFP4_BYTES),
        ("fused 2d", _fused(block="2d"), (x, gamax), BF16_BYTES + NVFP4_BYTES),
        ("fused RHT+1d", _fused(rht=True), (x, gamax), BF16_BYTES + NVFP4_BYTES),
        ("fused 1d^T", _fused(transpose=True), (x, gamax), BF16_BYTES + NVFP4_BYTES),
        (
            "fused SR",
            jax.jit(lambda v, a, b: fused_quantize(v, a, rounding="stochastic", bits=b)),
            (x, gamax, bits),
            BF16_BYTES + BITS_BYTES + NVFP4_BYTES,
        ),
        ("fused operand 1d", _fused(mode="operand"), (x, gamax), 2 * BF16_BYTES),
        ("fused operand 1d^T", _fused(mode="operand", transpose=True), (x, gamax), 2 * BF16_BYTES),
    ]
    interpreted = jax.default_backend() == "cpu"  # fused_quantize's interpret=None rule
    results = []
    for name, fn, fn_args, bytes_per_element in cases + (fused_cases if fused else []):
        case_runs = 1 if interpreted and name.startswith("fused") else runs
        try:
            median_s = _median_time(fn, fn_args, case_runs)
        except Exception as error:
            if not name.startswith("fused"):
                raise
            # Recorded and reported (exit 1), so the other rows of the run are not lost.
            results.append({"case": name, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"})
            continue
        results.append(
            {
                "case": name,
                "runs": case_runs,
                "median_ms": median_s * 1e3,
                "gb_per_s": elements * bytes_per_element / median_s / 1e9,
            }
        )
    copy = results[0]
    for row in results:
        if "error" not in row:
            row["time_vs_copy"] = row["median_ms"] / copy["median_ms"]
            row["bw_vs_copy"] = row["gb_per_s"] / copy["gb_per_s"]
    return results


def _fused(**options):
    """A jitted fused quantizer of (x, global_amax) with the given options."""
    return jax.jit(lambda v, a: fused_quantize(v, a, **options))


def _median_time(fn, fn_args: tuple, runs: int) -> float:
    jax.block_until_ready(fn(*fn_args))  # compile
    jax.block_until_ready(fn(*fn_args))  # warm up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn(*fn_args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


if __name__ == "__main__":
    main()
