"""Export throughput and peak memory on a synthetic BF16 Llama-shaped model, side by side with
compressed-tensors' own NVFP4 compressor on the same tensors.

    python scripts/bench_export.py --hidden 4096 --mlp 16384 --layers 2 --vocab 32768

Each measurement runs in its own child process (peak RSS = VmHWM of that child):
* ours-export:   `export_checkpoint(..., quant="nvfp4-weight-only")`, end to end (read, amax pass,
                 quantize + per-layer error, write the shards, configs, provenance with sha256)
* ours-quantize: for each quantized linear: read + `quantize_weight` (RTN) only
* ct-quantize:   for each quantized linear: read + compressed-tensors' global scale
                 (`generate_gparam`), block scales (`calculate_qparams`) and
                 `NVFP4PackedCompressor.compress` (quantize + pack) in torch on CPU
Throughput is GB of BF16 weights in per second. The first child line of each kind is a tiny
warm-up model (its peak is the fixed overhead: imports, compilation, thread pools).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--mlp", type=int, default=16384)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--workdir", default=None, help="scratch folder (default: a temp folder)")
    parser.add_argument("--kinds", default="ours-export,ours-quantize,ct-quantize")
    args = parser.parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_export-")
    try:
        src = os.path.join(workdir, "src")
        _generate(src, args.hidden, args.mlp, args.layers, args.vocab)
        results = {kind: measure(kind, src, workdir) for kind in args.kinds.split(",")}
        for kind, r in results.items():
            print(
                f"{kind:14s} {r['gb_per_s']:.3f} GB/s of bf16 in  ({r['bf16_gb']:.2f} GB in "
                f"{r['seconds']:.1f} s), peak RSS {r['peak_gb']:.2f} GB "
                f"(fixed overhead {r['overhead_gb']:.2f} GB)"
            )
        if "ours-quantize" in results and "ct-quantize" in results:
            print(
                f"quantize throughput ratio ours / compressed-tensors: "
                f"{results['ours-quantize']['gb_per_s'] / results['ct-quantize']['gb_per_s']:.2f}"
            )
        print(json.dumps(results))
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


def measure(kind: str, src: str, workdir: str) -> dict:
    """Run `kind` in a child on a tiny warm-up model then on `src`; its timings and peak RSS."""
    tiny = os.path.join(workdir, "tiny")
    if not os.path.isdir(tiny):
        _generate(tiny, 256, 512, 1, 512)
    result = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", kind, tiny, src, os.path.join(workdir, f"out-{kind}")],
        capture_output=True,
        text=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        cwd=ROOT,
    )
    if result.returncode != 0:
        raise RuntimeError(f"{kind} child failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _generate(folder: str, hidden: int, mlp: int, layers: int, vocab: int) -> None:
    """A synthetic BF16 HF folder, written by a child process (its memory never counts)."""
    if os.path.isdir(folder):
        return
    code = (
        "import sys; sys.path[:0] = [%r, %r]; from bench_convert import *; "
        "write_synthetic_hf_folder(%r, synthetic_config(hidden=%d, mlp=%d, layers=%d, vocab=%d, "
        "dtype='bfloat16'))"
    ) % (ROOT, os.path.join(ROOT, "scripts"), folder, hidden, mlp, layers, vocab)
    subprocess.run([sys.executable, "-c", code], check=True)


def _child(kind: str, tiny: str, src: str, out: str) -> None:
    overhead = None
    for i, folder in enumerate((tiny, src)):
        start = time.perf_counter()
        bf16_bytes = _RUNNERS[kind](folder, f"{out}-{i}")
        seconds = time.perf_counter() - start
        if i == 0:
            overhead = _vm_hwm()
    peak = _vm_hwm()
    print(
        json.dumps(
            {
                "kind": kind,
                "seconds": seconds,
                "bf16_gb": bf16_bytes / 1e9,
                "gb_per_s": bf16_bytes / 1e9 / seconds,
                "peak_gb": peak / 1e9,
                "overhead_gb": overhead / 1e9,
                "peak_bytes": peak,
                "overhead_bytes": overhead,
                "largest_tensor_bytes": _largest(src),
            }
        )
    )


def _ours_export(folder: str, out: str) -> int:
    from nvfp4tool.export import ExportOptions, export_checkpoint

    summary = export_checkpoint(folder, out, ExportOptions(quant="nvfp4-weight-only", show_progress=False, force=True))
    return summary.bf16_bytes_in


def _ours_quantize(folder: str, out: str) -> int:
    import jax.numpy as jnp
    import numpy as np

    from converters.hf import HFFolderSource
    from nvfp4tool.export.scale_search import quantize_weight

    source, total = HFFolderSource(folder), 0
    for name in _quantized_weights(source):
        w = source.get(name)
        amax = np.float32(jnp.max(jnp.abs(jnp.asarray(w))))
        quantize_weight(w, global_amax=amax, name=name)
        total += w.nbytes
    return total


def _ct_quantize(folder: str, out: str) -> int:
    import torch
    from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4A16
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    from converters.hf import HFFolderSource

    scheme = QuantizationScheme(targets=["Linear"], **NVFP4A16)
    source, total = HFFolderSource(folder), 0
    for name in _quantized_weights(source):
        w = torch.from_numpy(source.get(name).view("int16").copy()).view(torch.bfloat16)
        global_scale = generate_gparam(w.min().float(), w.max().float())
        blocks = w.reshape(w.shape[0], -1, 16)
        scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), scheme.weights, global_scale=global_scale)
        NVFP4PackedCompressor.compress(
            {"weight": w, "weight_scale": scale, "weight_global_scale": global_scale}, scheme
        )
        total += w.numel() * 2
    return total


def _quantized_weights(source) -> list[str]:
    return [f"{n}.weight" for n in source.config.linear_names() if n != "lm_head"]


def _largest(folder: str) -> int:
    from converters.hf import HFFolderSource

    source = HFFolderSource(folder)
    return max(2 * int(__import__("numpy").prod(source.shape(n))) for n in source.names())


def _vm_hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


_RUNNERS = {"ours-export": _ours_export, "ours-quantize": _ours_quantize, "ct-quantize": _ct_quantize}

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(*sys.argv[2:6])
    else:
        main()
