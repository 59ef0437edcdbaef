"""Convert throughput: HF -> MaxText and MaxText -> HF on a synthetic Llama-shaped model.

    python scripts/bench_convert.py --size-gb 2 [--dtype bf16] [--workdir /tmp/bench_convert] [--append]

Builds a random HF folder (safetensors written tensor by tensor) of about --size-gb of source
bytes, times `convert_checkpoint` in both directions (scanned MaxText, fp32 storage) and prints
GB/s of output bytes; --append adds the result and the exact command to docs/benchmarks/convert.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

import ml_dtypes  # noqa: F401 (registers bfloat16 / float8 / float4 with numpy)
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from converters.hf import write_safetensors
from nvfp4tool.config import ModelConfig
from nvfp4tool.convert import convert_checkpoint


def synthetic_config(
    *,
    hidden: int,
    mlp: int,
    layers: int,
    vocab: int,
    head_dim: int = 128,
    kv_heads: int | None = None,
    dtype: str = "bfloat16",
    **fields,
) -> ModelConfig:
    """A Llama-shaped config (untied lm_head, hidden // head_dim query heads) with the given sizes;
    `fields`: further ModelConfig fields (e.g. rope_scaling, max_position_embeddings)."""
    heads = hidden // head_dim
    return ModelConfig(
        family="llama",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads or heads,
        head_dim=head_dim,
        dtype=dtype,
        rope_theta=500000.0,
        **fields,
    )


def write_synthetic_hf_folder(out_dir: str, config: ModelConfig, *, seed: int = 0) -> str:
    """An HF folder of random tensors (config dtype), each generated and written one at a time."""
    import json

    os.makedirs(out_dir, exist_ok=True)
    shapes = config.expected_tensor_shapes()
    rng = np.random.default_rng(seed)

    def make(name: str) -> np.ndarray:
        return (0.02 * rng.standard_normal(shapes[name], dtype=np.float32)).astype(config.dtype)

    write_safetensors(
        os.path.join(out_dir, "model.safetensors"), [(n, config.dtype, s) for n, s in shapes.items()], make
    )
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config.to_hf_config(), f, indent=2)
    return out_dir


def config_for_size(size_gb: float, dtype: str) -> ModelConfig:
    """hidden 2048, mlp 8192, vocab 32000; as many layers as reach about `size_gb` of source bytes."""
    probe = synthetic_config(hidden=2048, mlp=8192, layers=1, vocab=32000, dtype=dtype)
    itemsize = np.dtype(dtype).itemsize
    per_layer = (probe.num_parameters() - 2 * 32000 * 2048 - 2048) * itemsize
    fixed = (2 * 32000 * 2048 + 2048) * itemsize
    layers = max(1, round((size_gb * 1e9 - fixed) / per_layer))
    return synthetic_config(hidden=2048, mlp=8192, layers=layers, vocab=32000, dtype=dtype)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=2.0, help="source model size in GB")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="HF source dtype")
    parser.add_argument("--workdir", default="/tmp/bench_convert")
    parser.add_argument("--append", action="store_true", help="append the result to docs/benchmarks/convert.md")
    args = parser.parse_args(argv)

    dtype = {"bf16": "bfloat16", "fp32": "float32"}[args.dtype]
    config = config_for_size(args.size_gb, dtype)
    shutil.rmtree(args.workdir, ignore_errors=True)
    hf_dir = write_synthetic_hf_folder(os.path.join(args.workdir, "hf"), config)
    source_bytes = os.path.getsize(os.path.join(hf_dir, "model.safetensors"))
    print(
        f"synthetic model: {config.num_layers} layers, hidden 2048, mlp 8192, vocab 32000, "
        f"{config.num_parameters():,} parameters, {source_bytes / 1e9:.2f} GB {args.dtype}"
    )
    rows = []
    to_maxtext = convert_checkpoint(
        hf_dir, os.path.join(args.workdir, "mt"), to="maxtext", rope_layout="half", dtype="fp32"
    )
    rows.append(("HF (%s) -> MaxText (fp32, scanned)" % args.dtype, source_bytes, to_maxtext))
    to_hf = convert_checkpoint(
        os.path.join(args.workdir, "mt"),
        os.path.join(args.workdir, "hf2"),
        to="hf",
        model_config=hf_dir,
        rope_layout="half",
    )
    rows.append(("MaxText (fp32, scanned) -> HF (%s)" % args.dtype, to_maxtext.bytes_written, to_hf))
    lines = []
    for label, read_bytes, summary in rows:
        line = (
            f"| {label} | {read_bytes / 1e9:.2f} | {summary.bytes_written / 1e9:.2f} | "
            f"{summary.seconds:.1f} | {read_bytes / 1e9 / summary.seconds:.3f} | {summary.gb_per_s:.3f} |"
        )
        lines.append(line)
        print(line)
    if args.append:
        _append(lines, args, config)
    shutil.rmtree(args.workdir, ignore_errors=True)


def _append(lines: list[str], args: argparse.Namespace, config: ModelConfig) -> None:
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "benchmarks", "convert.md")
    command = f"python scripts/bench_convert.py --size-gb {args.size_gb:g} --dtype {args.dtype}"
    header = (
        ""
        if os.path.exists(path) and "## Throughput" in open(path).read()
        else "\n## Throughput\n\n"
        "Converted with `nvfp4tool.convert.convert_checkpoint` (what `nvfp4tool convert` runs), "
        "one tensor / one stacked parameter in memory at a time. GB/s = GB read (or written) / "
        "wall seconds.\n"
    )
    with open(path, "a", encoding="utf-8") as f:
        f.write(header)
        f.write(
            f"\n`{command}` ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores, "
            f"{config.num_layers} layers x (hidden 2048, mlp 8192), vocab 32000):\n\n"
            "| direction | GB read | GB written | seconds | GB/s read | GB/s written |\n"
            "|---|---|---|---|---|---|\n"
        )
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
