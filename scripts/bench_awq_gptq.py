"""AWQ and GPTQ side by side with llm-compressor's own modifiers (issue 42): the same model, the same
calibration windows, each export in its own child process, alternated (ours, theirs, ours, theirs)
on the shared machine; then the KL of every result against the BF16 model on held-out windows,
computed by ONE evaluator for all of them.

    python scripts/real_model.py /tmp/smollm2
    python scripts/bench_awq_gptq.py --model-dir /tmp/smollm2 --llmc-python /tmp/llmc-venv/bin/python \
        [--calib-samples 32 --seq-len 256 --eval-samples 16 --rounds 2 --workdir DIR --json out.json]

Kinds (W4A16: NVFP4 weights, 1x16 blocks, BF16 activations; lm_head BF16):
* ours-awq:   `nvfp4tool export --quant nvfp4-weight-only --format compressed-tensors --equalize awq`
* llmc-awq:   `oneshot(recipe=[AWQModifier(), QuantizationModifier(scheme="NVFP4A16")])`
* ours-gptq:  `nvfp4tool export ... --weight-rounding gptq`
* llmc-gptq:  `oneshot(recipe=[GPTQModifier(scheme="NVFP4A16")])`
each with its library's defaults otherwise. Calibration: the first N x L tokens of the package's
nvfp4tool/data/shakespeare_train.txt (our tokenizer path, saved once as .npy and given to both);
held out: the first E x L tokens of shakespeare_val.txt. Ours runs with this worktree's Python,
theirs with --llmc-python (llm-compressor's own virtual environment, never our dependency). Wall
time is the child's, imports and model loading included; peak RSS its ru_maxrss (= VmHWM).

--truncate-layers N runs everything on a copy of the model with its first N decoder layers (written
to WORKDIR/model); --resume keeps the runs WORKDIR/runs.json holds (`--rounds 2 --resume` after a
`--rounds 1` adds the second round). llm-compressor 0.14's AWQ pins cached activations for GPU
copies, which fails on a CPU-only torch: the child turns pinning off there (no numeric effect).

The evaluator runs in the llm-compressor environment for all folders alike: transformers reads each
compressed-tensors folder (`CompressedTensorsConfig(run_compressed=False)`: the weights decompressed
to dense), whose tensors are loaded into a plain fp32 model of the source, and the BF16 model in
fp32; KL(BF16 || quantized) per token, its p99 and the top-1 agreement.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = ("ours-awq", "llmc-awq", "ours-gptq", "llmc-gptq")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True, help="the BF16 HF folder (scripts/real_model.py)")
    parser.add_argument("--llmc-python", required=True, help="the Python of llm-compressor's virtual environment")
    parser.add_argument("--calib-samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--eval-samples", type=int, default=16)
    parser.add_argument(
        "--truncate-layers", type=int, default=0, help="run on the model's first N decoder layers only (0: all)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="how many times each kind runs, alternated")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--resume", action="store_true", help="keep the runs WORKDIR/runs.json holds")
    parser.add_argument("--json", default=None, help="the results file (default: WORKDIR/bench_awq_gptq.json)")
    args = parser.parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_awq_gptq-")
    os.makedirs(workdir, exist_ok=True)
    if args.truncate_layers:
        args.model_dir = _truncated(args.model_dir, os.path.join(workdir, "model"), args.truncate_layers)
    calib, held_out = _windows(args.model_dir, workdir, args.calib_samples, args.eval_samples, args.seq_len)
    kinds = args.kinds.split(",")
    done_path = os.path.join(workdir, "runs.json")
    runs = []
    if args.resume and os.path.exists(done_path):
        with open(done_path) as f:
            runs = json.load(f)
    for r in range(args.rounds):
        for kind in kinds:
            if any(run["kind"] == kind and run["round"] == r for run in runs):
                continue
            out = os.path.join(workdir, f"{kind}-{r}")
            run = _run_child(kind, args, calib, out)
            run["round"] = r
            runs.append(run)
            with open(done_path, "w") as f:
                json.dump(runs, f, indent=2)
            print(
                f"round {r} {kind:10s} wall {run['wall_s']:7.1f} s  peak RSS {run['peak_rss_gb']:.2f} GB  "
                f"load {run['load_before'][0]:.2f} -> {run['load_after'][0]:.2f}",
                flush=True,
            )
    folders = {kind: os.path.join(workdir, f"{kind}-{args.rounds - 1}") for kind in kinds}
    kl = _evaluate(args, folders, held_out)
    result = {
        "model_dir": args.model_dir,
        "calib_windows": [args.calib_samples, args.seq_len],
        "eval_windows": [args.eval_samples, args.seq_len],
        "runs": runs,
        "kl": kl,
        "summary": _summary(runs, kl, kinds),
        "same_bytes_across_rounds": {k: _same_bytes(workdir, k, args.rounds) for k in kinds},
    }
    path = args.json or os.path.join(workdir, "bench_awq_gptq.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(_table(result))
    print(f"results: {path}")


def _truncated(model_dir: str, out: str, layers: int) -> str:
    """A copy of the HF folder with its first `layers` decoder layers (same tensors, fewer layers)."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    if os.path.exists(os.path.join(out, "config.json")):
        return out
    os.makedirs(out)
    for name in os.listdir(model_dir):
        if name != "config.json" and not name.endswith(".safetensors"):
            shutil.copy(os.path.join(model_dir, name), out)
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    config["num_hidden_layers"] = layers
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    kept = {}
    for name in sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors")):
        for key, value in load_file(os.path.join(model_dir, name)).items():
            layer = re.match(r"model\.layers\.(\d+)\.", key)
            if layer is None or int(layer.group(1)) < layers:
                kept[key] = value
    save_file(kept, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out


def _windows(model_dir: str, workdir: str, calib: int, held_out: int, seq_len: int) -> tuple[str, str]:
    """The calibration and held-out token ids as .npy, through the export's own text reader."""
    sys.path[:0] = [ROOT]
    import numpy as np

    from nvfp4tool.export.calibrate import load_calibration_ids

    data = os.path.join(ROOT, "nvfp4tool", "data")
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    paths = []
    for name, count in (("shakespeare_train.txt", calib), ("shakespeare_val.txt", held_out)):
        ids = load_calibration_ids(
            os.path.join(data, name), samples=count, seq_len=seq_len, tokenizer_dir=model_dir, vocab_size=vocab
        )
        if ids.shape != (count, seq_len):
            raise SystemExit(f"{name}: {ids.shape[0]} windows of {ids.shape[1]} tokens, asked {count} x {seq_len}")
        path = os.path.join(workdir, name.replace(".txt", ".npy"))
        np.save(path, ids)
        paths.append(path)
    return paths[0], paths[1]


def _command(kind: str, args, calib: str, out: str) -> list[str]:
    if kind.startswith("ours-"):
        method = ["--equalize", "awq"] if kind == "ours-awq" else ["--weight-rounding", "gptq"]
        return [
            sys.executable, "-m", "nvfp4tool.cli", "export", args.model_dir, "--out", out,
            "--quant", "nvfp4-weight-only", "--format", "compressed-tensors", "--calib-data", calib,
            "--calib-samples", str(args.calib_samples), "--calib-seq-len", str(args.seq_len), "--force", *method,
        ]  # fmt: skip
    return [args.llmc_python, os.path.abspath(__file__), "--llmc-child", kind, args.model_dir, calib, out]


def _run_child(kind: str, args, calib: str, out: str) -> dict:
    """Run one export in a child; its wall time, peak RSS (ru_maxrss) and the load around it."""
    command = _command(kind, args, calib, out)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    load_before = os.getloadavg()
    start = time.perf_counter()
    with open(out + ".log", "w") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        with open(out + ".log") as log:
            raise SystemExit(f"{kind} failed (exit {child.returncode}):\n{log.read()[-4000:]}")
    return {
        "kind": kind,
        "command": " ".join(command),
        "wall_s": wall,
        "peak_rss_gb": usage.ru_maxrss * 1024 / 1e9,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "load_before": list(load_before),
        "load_after": list(os.getloadavg()),
    }


def _evaluate(args, folders: dict[str, str], held_out: str) -> dict:
    here = os.path.abspath(__file__)
    command = [args.llmc_python, here, "--eval-child", args.model_dir, held_out, json.dumps(folders)]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"evaluation failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"evaluation: {time.perf_counter() - start:.1f} s", flush=True)
    return result


def _same_bytes(workdir: str, kind: str, rounds: int) -> bool | None:
    """Whether every round of `kind` wrote the same model.safetensors bytes."""
    import hashlib

    digests = set()
    for r in range(rounds):
        folder = os.path.join(workdir, f"{kind}-{r}")
        files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
        h = hashlib.sha256()
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                h.update(f.read())
        digests.add(h.hexdigest())
    return len(digests) == 1


def _summary(runs: list[dict], kl: dict, kinds: list[str]) -> dict:
    import statistics

    wall = {k: [r["wall_s"] for r in runs if r["kind"] == k] for k in kinds}
    out = {k: {"wall_s_median": statistics.median(v), "wall_s": v} for k, v in wall.items()}
    for method in ("awq", "gptq"):
        ours, theirs = f"ours-{method}", f"llmc-{method}"
        if ours in wall and theirs in wall:
            pairs = [a / b for a, b in zip(wall[ours], wall[theirs])]
            out[f"{method}_wall_ratio_per_round"] = pairs
            out[f"{method}_wall_ratio_median"] = statistics.median(pairs)
            out[f"{method}_kl_ratio"] = kl[ours]["kl_mean"] / kl[theirs]["kl_mean"]
    return out


def _table(result: dict) -> str:
    kinds = list(result["kl"])
    lines = [
        "| export | wall per round (s) | peak RSS (GB) | KL mean | KL p99 | top-1 |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for kind in kinds:
        runs = [r for r in result["runs"] if r["kind"] == kind]
        k = result["kl"][kind]
        walls = ", ".join(f"{r['wall_s']:.0f}" for r in runs)
        lines.append(
            f"| {kind} | {walls} | "
            f"{max(r['peak_rss_gb'] for r in runs):.2f} | {k['kl_mean']:.4f} | {k['kl_p99']:.3f} | "
            f"{100 * k['top1']:.2f}% |"
        )
    s = result["summary"]
    for method in ("awq", "gptq"):
        if f"{method}_wall_ratio_median" in s:
            lines.append(
                f"\n{method}: wall ours / theirs per round "
                f"{', '.join(f'{x:.2f}' for x in s[f'{method}_wall_ratio_per_round'])} "
                f"(median {s[f'{method}_wall_ratio_median']:.2f}x); KL ours / theirs {s[f'{method}_kl_ratio']:.3f}"
            )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------
# children run by llm-compressor's Python (nothing of ours imported)


def _llmc_child(kind: str, model_dir: str, calib: str, out: str) -> None:
    import numpy as np
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not torch.cuda.is_available():
        # llm-compressor 0.14's AWQ pins its cached activations for faster host-to-device copies,
        # which raises "Cannot access accelerator device when none is available" on a CPU-only
        # torch: pinning only speeds up copies to a GPU, so it is skipped here (no numeric effect)
        from llmcompressor.pipelines.cache import IntermediatesCache

        IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
    ids = np.load(calib)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dataset = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": np.ones_like(ids).tolist()})
    if kind == "llmc-awq":
        from llmcompressor.modifiers.quantization import QuantizationModifier
        from llmcompressor.modifiers.transform.awq import AWQModifier

        recipe = [AWQModifier(), QuantizationModifier(targets="Linear", scheme="NVFP4A16", ignore=["lm_head"])]
    else:
        from llmcompressor.modifiers.gptq import GPTQModifier

        recipe = [GPTQModifier(targets="Linear", scheme="NVFP4A16", ignore=["lm_head"])]
    oneshot(
        model=model,
        dataset=dataset,
        recipe=recipe,
        max_seq_length=ids.shape[1],
        num_calibration_samples=ids.shape[0],
    )
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)
    print(f"threads {torch.get_num_threads()}")


def _eval_child(model_dir: str, held_out: str, folders_json: str) -> None:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    ids = torch.from_numpy(np.load(held_out).astype(np.int64))
    folders = json.loads(folders_json)

    def logits_of(model) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([model.eval()(ids[i : i + 4]).logits.float() for i in range(0, len(ids), 4)])

    def decompressed(path: str):
        """The plain fp32 model holding the folder's tensors, its NVFP4 weights decompressed."""
        config = CompressedTensorsConfig(run_compressed=False)
        stored = AutoModelForCausalLM.from_pretrained(path, quantization_config=config).state_dict()
        plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        wanted = plain.state_dict()
        missing = [k for k in wanted if k not in stored]
        if missing:
            raise SystemExit(f"{path}: no tensor {missing[0]} after decompression")
        plain.load_state_dict({k: stored[k].float() for k in wanted})
        return plain

    ref = torch.log_softmax(logits_of(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)), -1)
    result = {}
    for kind, path in folders.items():
        q = torch.log_softmax(logits_of(decompressed(path)), -1)
        kl = (ref.exp() * (ref - q)).sum(-1).flatten()
        result[kind] = {
            "kl_mean": float(kl.mean()),
            "kl_p99": float(torch.quantile(kl, 0.99)),
            "top1": float((ref.argmax(-1) == q.argmax(-1)).float().mean()),
            "folder": path,
        }
    print(json.dumps(result))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--llmc-child":
        _llmc_child(*sys.argv[2:6])
    elif len(sys.argv) > 1 and sys.argv[1] == "--eval-child":
        _eval_child(*sys.argv[2:5])
    else:
        main()
