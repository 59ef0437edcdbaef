"""Loader throughput against what the train step consumes: rows/s of `nvfp4tool.corpus.loader`
reading memory-mapped windows, over rows/s of the model's step at its measured step time.

    python scripts/bench_loader.py --model tiny --seq-len 128 --batch-size 16 [--sources 2] [--threads 2]

Writes a random uint16 token stream of `--windows` windows of `--seq-len` + 1 tokens to a file and
reads it memory-mapped through `corpus/windows.py`'s `Windows` (as a token cache's shards), times
`--batches` batches through `Loader.iterator()` (one source, or `--sources` equal-weight sources:
a mixture), then compiles and times the preset's train step
(scripts/bench_train_step.py's `compile_step` / `run_step`, recipe `--recipe`) at the same batch.
Prints loader rows/s, step rows/s (batch / median step time) and their ratio (the issue's goal:
>= 20); `--json` writes them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from bench_train_step import H200_DENSE_BF16_TFLOPS, compile_step, run_step

from nvfp4tool.corpus.loader import Loader
from nvfp4tool.corpus.windows import TokenStream, Windows


def mapped_windows(path: Path, num_windows: int, seq_len: int, seed: int) -> Windows:
    """`num_windows` windows of a random uint16 token stream written to `path` and memory-mapped:
    what a token cache's `windows()` reads (`Windows` over `TokenStream`s of `np.memmap` shards)."""
    length = num_windows * seq_len + 1
    tokens = np.memmap(path, dtype=np.uint16, mode="w+", shape=(length,))
    rng = np.random.default_rng(seed)
    for start in range(0, length, 1 << 22):  # bounded memory while writing
        stop = min(start + (1 << 22), length)
        tokens[start:stop] = rng.integers(0, 1024, stop - start, dtype=np.uint16)
    tokens.flush()
    del tokens
    return Windows(TokenStream([np.memmap(path, dtype=np.uint16, mode="r", shape=(length,))]), seq_len)


def loader_rows_per_s(args, folder: Path) -> float:
    sources = [
        mapped_windows(folder / f"tokens{i}.bin", args.windows, args.seq_len, seed=i) for i in range(args.sources)
    ]
    weights = None if args.sources == 1 else [1.0] * args.sources
    loader = Loader(
        sources,
        weights,
        batch_size=args.batch_size,
        seed=0,
        num_batches=args.batches + 1,
        threads=args.threads,
        prefetch=args.prefetch,
    )
    batches = loader.iterator()
    next(batches)  # the threads started, the first epoch's permutation made
    start = time.perf_counter()
    for _ in range(args.batches):
        batch = next(batches)
    elapsed = time.perf_counter() - start
    assert batch.tokens.shape == (args.batch_size, args.seq_len + 1)
    return args.batches * args.batch_size / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--recipe", default="bf16")
    parser.add_argument("--iters", type=int, default=10, help="timed train steps (median)")
    parser.add_argument("--windows", type=int, default=200_000, help="windows per source")
    parser.add_argument("--sources", type=int, default=1, help="sources of an equal-weight mixture")
    parser.add_argument("--batches", type=int, default=3000, help="batches the loader reads, timed")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefetch", type=int, default=8)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-loader-") as folder:
        loader_rate = loader_rows_per_s(args, Path(folder))
    step_args = argparse.Namespace(
        model=args.model,
        vocab_size=args.vocab_size,
        seq_len=args.seq_len,
        iters=args.iters,
        num_layers=None,
        remat="none",
        scan_layers="true",
        peak_tflops=H200_DENSE_BF16_TFLOPS,
    )
    step = run_step(compile_step(args.recipe, step_args, args.batch_size), step_args)
    step_rate = args.batch_size / step["step_time_s"]
    result = {
        **{k: v for k, v in vars(args).items() if k != "json"},
        "loader_rows_per_s": loader_rate,
        "step_time_s": step["step_time_s"],
        "step_rows_per_s": step_rate,
        "ratio": loader_rate / step_rate,
    }
    print(
        f"loader {loader_rate:,.0f} rows/s; {args.model} {args.recipe} step {1e3 * step['step_time_s']:.2f} ms "
        f"= {step_rate:,.0f} rows/s; ratio {loader_rate / step_rate:.1f}x"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
