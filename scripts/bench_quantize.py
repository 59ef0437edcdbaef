"""Throughput of the NVFP4 quantizers on a large bf16 tensor, against a plain elementwise pass.

Cases (each one jitted, warmed up, median of --runs timed calls with block_until_ready):
  x*2 (bf16)           the elementwise reference: 2 bytes read + 2 written per element
  quantize 1d / 2d     amax, scales, codes, packing (minimal traffic: 2 in + 0.5625 out)
  quantize RHT+1d      rht16 along the last axis, then 1d quantize (the wgrad operand path)
  quantize SR          1d with stochastic rounding
  dequantize           packed + scales -> bf16 (0.5625 in + 2 out)
  fake-quantize 1d     quantize-dequantize without packing (2 in + 2 out)
GB/s counts those minimal bytes; "vs x*2" is the case's time divided by the x*2 time.

Usage: PYTHONPATH=. python3 scripts/bench_quantize.py [--size 4096] [--runs 7] [--json OUT]
(default size: 4096 on CPU, 16384 on GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

from nvfp4tool.numerics import dequantize_nvfp4, fake_quantize_nvfp4, quantize_nvfp4, rht16

NVFP4_BYTES = 0.5625  # 4 bits of code + 8 bits of scale per 16 elements, per element
BF16_BYTES = 2.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=None, help="square tensor side (x16)")
    parser.add_argument("--runs", type=int, default=7, help="timed runs per case (median)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    backend = jax.default_backend()
    size = args.size or (16384 if backend == "gpu" else 4096)
    results = run_benchmarks(size, args.runs)
    print(f"backend={backend} device={jax.devices()[0].device_kind} size={size}x{size} bf16 "
          f"runs={args.runs} jax={jax.__version__}")
    print(f"{'case':<20} {'median ms':>10} {'GB/s':>9} {'vs x*2':>8}")
    for row in results:
        print(f"{row['case']:<20} {row['median_ms']:>10.2f} {row['gb_per_s']:>9.1f} "
              f"{row['time_vs_copy']:>8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": backend, "device": jax.devices()[0].device_kind, "size": size,
                       "runs": args.runs, "jax": jax.__version__, "results": results}, f, indent=2)


def run_benchmarks(size: int, runs: int) -> list[dict]:
    """Time every case on a size x size bf16 N(0,1) tensor; returns one dict per case."""
    x = jax.random.normal(jax.random.key(0), (size, size), jnp.bfloat16)
    key = jax.random.key(1)
    q = jax.jit(quantize_nvfp4)(x)
    elements = size * size
    cases = [
        ("x*2 (bf16)", jax.jit(lambda v: v * 2), (x,), 2 * BF16_BYTES),
        ("quantize 1d", jax.jit(lambda v: quantize_nvfp4(v)), (x,), BF16_BYTES + NVFP4_BYTES),
        ("quantize 2d", jax.jit(lambda v: quantize_nvfp4(v, block="2d")), (x,),
         BF16_BYTES + NVFP4_BYTES),
        ("quantize RHT+1d", jax.jit(lambda v: quantize_nvfp4(rht16(v))), (x,),
         BF16_BYTES + NVFP4_BYTES),
        ("quantize SR", jax.jit(lambda v, k: quantize_nvfp4(v, rounding="stochastic", key=k)),
         (x, key), BF16_BYTES + NVFP4_BYTES),
        ("dequantize", jax.jit(lambda t: dequantize_nvfp4(t, jnp.bfloat16)), (q,),
         NVFP4_BYTES + BF16_BYTES),
        ("fake-quantize 1d", jax.jit(lambda v: fake_quantize_nvfp4(v)), (x,), 2 * BF16_BYTES),
    ]
    results = []
    for name, fn, fn_args, bytes_per_element in cases:
        median_s = _median_time(fn, fn_args, runs)
        results.append({"case": name, "median_ms": median_s * 1e3,
                        "gb_per_s": elements * bytes_per_element / median_s / 1e9})
    copy_ms = results[0]["median_ms"]
    for row in results:
        row["time_vs_copy"] = row["median_ms"] / copy_ms
    return results


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
