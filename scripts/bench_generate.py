"""Greedy generation per prompt, compilation included: ours in BF16 and NVFP4 as served (a W4A16
RTN export made here) against transformers' `generate` on the same BF16 model, same prompts, same
process, interleaved prompt by prompt (issue 42's goal: ours <= 2x transformers' for both).

    python scripts/bench_generate.py                                   # the tiny preset, random weights
    python scripts/real_model.py /tmp/smollm2 && \
        python scripts/bench_generate.py --model-dir /tmp/smollm2      # SmolLM2-135M
    [--prompt-lens 7,12,23,40 --new-tokens 32 --workdir DIR --json out.json --level auto|0|1]

Ours runs as validate's greedy generation does (`validate.generation.greedy_continuations`, models
held in their stored dtypes computing in fp32, `served_linear`, as many of each model's linear
weights decoded / widened once as `simulate.for_generation` allows (DECODE_ONCE_SHARE), its time
added to that model's first prompt; the rest decoded at every step), every prompt padded to the
bucket of the longest (`longest=`: validate knows all its prompts before it starts), so the first
prompt compiles generation's programs and the others reuse them. transformers runs the BF16
weights upcast to fp32 (`from_pretrained(dtype=float32)`), greedy, exactly --new-tokens (no EOS
stop). Model loading is outside every timing (JAX's persistent cache is off unless the environment
sets it).
Prints a table and writes JSON: per prompt seconds and ratios ours / transformers, ours' time to
the first token (the prefill, its compilation included) and per token from the third on (the
second pays the decode step's compilation), the totals, whether our BF16 tokens equal
transformers', and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=None, help="a BF16 HF folder (default: the tiny preset, random)")
    parser.add_argument("--prompt-lens", default="7,12,23,40", help="one prompt of each length (random token ids)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--workdir", default=None, help="scratch folder for the tiny model and the export")
    parser.add_argument("--json", default=None, help="the results file (default: WORKDIR/bench_generate.json)")
    parser.add_argument(
        "--level",
        choices=("auto", "0", "1"),
        default="auto",
        help="XLA:CPU level of generation's programs: model.generate's choice by size, or forced (for comparisons)",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch's threads for transformers (default: torch's own; on a loaded machine 1 can be several "
        "times faster than 2: SmolLM2, load 4-5, 2 CPUs: 5.5 s a prompt against 20 s)",
    )
    args = parser.parse_args()
    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    if args.level != "auto":
        _generate_module().OPTIMIZE_PARAMS = 0 if args.level == "1" else 1 << 62
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_generate-")
    src = args.model_dir or _tiny_folder(os.path.join(workdir, "tiny"))
    export = os.path.join(workdir, "export-w4a16")
    result = run(src, export, [int(n) for n in args.prompt_lens.split(",")], args.new_tokens)
    path = args.json or os.path.join(workdir, "bench_generate.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(_table(result))
    print(f"results: {path}")


def run(src: str, export: str, lengths: list[int], new_tokens: int) -> dict:
    import jax.numpy as jnp
    import numpy as np
    import torch
    import transformers

    from converters.hf import HFFolderSource
    from nvfp4tool.config import ModelConfig
    from nvfp4tool.export import ExportOptions, export_checkpoint
    from nvfp4tool.export.simulate import for_generation, load_export, served_linear
    from nvfp4tool.model import model_from_tensors
    from nvfp4tool.validate.generation import greedy_continuations

    load_before = os.getloadavg()
    if not os.path.isdir(export):
        export_checkpoint(src, export, ExportOptions(quant="nvfp4-weight-only", show_progress=False))
    config = ModelConfig.from_hf_folder(src)
    bf16 = model_from_tensors(config, HFFolderSource(src), dtype=None, compute_dtype=jnp.float32)
    served = load_export(export).model(jnp.float32)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, config.vocab_size, (1, n)) for n in lengths]

    models, decode_once_s = {}, {}
    for label, model in (("bf16", bf16), ("nvfp4", served)):
        started = time.perf_counter()
        models[label] = for_generation(model, f"bench ({label})")
        decode_once_s[label] = time.perf_counter() - started
    rows = []
    for i, prompt in enumerate(prompts):
        row = {"prompt_len": int(prompt.shape[1])}
        for label, model in models.items():
            stamps = []  # when each token was computed (as validate's progress sees it)
            started = time.perf_counter()
            tokens = greedy_continuations(  # every prompt in the longest's bucket, as validate knows them all
                model,
                served_linear,
                prompt,
                new_tokens,
                on_token=lambda i, t, _: stamps.append(_ready(t)),
                longest=max(lengths),
            )
            row[f"ours_{label}_s"] = time.perf_counter() - started + (decode_once_s[label] if i == 0 else 0)
            row[f"ours_{label}_first_token_s"] = stamps[0] - started  # prefill, its compilation included
            # per token from the third on: the second pays the decode step's compilation in a new bucket
            row[f"ours_{label}_ms_per_token"] = 1e3 * (stamps[-1] - stamps[1]) / max(1, len(stamps) - 2)
            row[f"ours_{label}_tokens"] = tokens[0].tolist()
        started = time.perf_counter()
        with torch.no_grad():
            out = theirs.generate(
                input_ids=torch.tensor(prompt),
                attention_mask=torch.ones(prompt.shape, dtype=torch.long),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        row["transformers_s"] = time.perf_counter() - started
        row["transformers_tokens"] = out[0, prompt.shape[1] :].tolist()
        row["bf16_ratio"] = row["ours_bf16_s"] / row["transformers_s"]
        row["nvfp4_ratio"] = row["ours_nvfp4_s"] / row["transformers_s"]
        row["bf16_tokens_equal_transformers"] = row["ours_bf16_tokens"] == row["transformers_tokens"]
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("_tokens")}), flush=True)  # as it comes
    totals = {k: sum(r[k] for r in rows) for k in ("ours_bf16_s", "ours_nvfp4_s", "transformers_s")}
    return {
        "model": os.path.basename(os.path.normpath(src)),
        "layers": config.num_layers,
        "hidden": config.hidden_size,
        "vocab": config.vocab_size,
        "new_tokens": new_tokens,
        "parameters": config.num_parameters(),
        "optimized_programs": config.num_parameters() >= _generate_module().OPTIMIZE_PARAMS,  # XLA:CPU level 1, else 0
        "decode_once_s": decode_once_s,
        "torch_threads": torch.get_num_threads(),
        "prompts": rows,
        "totals": {
            **totals,
            "bf16_ratio": totals["ours_bf16_s"] / totals["transformers_s"],
            "nvfp4_ratio": totals["ours_nvfp4_s"] / totals["transformers_s"],
        },
        "load_average_before": list(load_before),
        "load_average_after": list(os.getloadavg()),
        "cpus": os.cpu_count(),
    }


def _generate_module():
    """nvfp4tool.model.generate the module (the package exports its function of that name)."""
    import importlib

    return importlib.import_module("nvfp4tool.model.generate")


def _ready(tokens) -> float:
    tokens.block_until_ready()
    return time.perf_counter()


def _tiny_folder(folder: str) -> str:
    """The tiny preset (llama family) in BF16 with random weights, as an HF folder."""
    import dataclasses

    from bench_convert import write_synthetic_hf_folder

    from nvfp4tool.train.presets import preset_config

    if not os.path.exists(os.path.join(folder, "config.json")):
        config = dataclasses.replace(preset_config("tiny", 512, 2048), dtype="bfloat16")
        write_synthetic_hf_folder(folder, config)
    return folder


def _table(result: dict) -> str:
    lines = [
        f"{result['model']}: {result['layers']} layers, hidden {result['hidden']}, vocab {result['vocab']}, "
        f"{result['new_tokens']} new tokens; load average {result['load_average_before'][0]:.2f} -> "
        f"{result['load_average_after'][0]:.2f} on {result['cpus']} CPUs",
        "| prompt | ours BF16 s | ours NVFP4 s | transformers s | BF16 / tr. | NVFP4 / tr. | BF16 tokens = tr. "
        "| BF16 first token s, ms/token | NVFP4 first token s, ms/token |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["prompts"]:
        lines.append(
            f"| {r['prompt_len']} | {r['ours_bf16_s']:.2f} | {r['ours_nvfp4_s']:.2f} | {r['transformers_s']:.2f} | "
            f"{r['bf16_ratio']:.2f}x | {r['nvfp4_ratio']:.2f}x | {r['bf16_tokens_equal_transformers']} | "
            f"{r['ours_bf16_first_token_s']:.2f}, {r['ours_bf16_ms_per_token']:.0f} | "
            f"{r['ours_nvfp4_first_token_s']:.2f}, {r['ours_nvfp4_ms_per_token']:.0f} |"
        )
    t = result["totals"]
    lines.append(
        f"| all | {t['ours_bf16_s']:.2f} | {t['ours_nvfp4_s']:.2f} | {t['transformers_s']:.2f} | "
        f"{t['bf16_ratio']:.2f}x | {t['nvfp4_ratio']:.2f}x | | | |"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
