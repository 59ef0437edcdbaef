"""Pretrain the same small model with each precision recipe and the NVFP4 ablations.

Same seed, data order, tokenizer and schedule for every run; writes a Markdown table (final train
loss, final eval loss, relative eval gap to bf16, tokens/s), `docs/recipe_study.png` (overlaid
curves + gap to bf16) and `docs/recipe_study.json`.

    python scripts/recipe_study.py --data ../shared/data/shakespeare --steps 300 --out runs/study
    python scripts/recipe_study.py --data ../shared/data/shakespeare --model tiny-hybrid --runs bf16,fp8,nvfp4 \
        --out runs/study-hybrid      # the hybrid Nemotron-H preset: docs/recipe_study_tiny-hybrid.*
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nvfp4tool.corpus.sources import iter_documents
from nvfp4tool.corpus.tokenizer import train_bpe_tokenizer
from nvfp4tool.run.config import load_train_config
from nvfp4tool.train.metrics import plot_runs
from nvfp4tool.train.trainer import train

# run name -> recipe overrides
RUNS = {
    "bf16": ["recipe=bf16"],
    "fp8": ["recipe=fp8"],
    "fp8-block": ["recipe=fp8-block"],
    "nvfp4": ["recipe=nvfp4"],
    "nvfp4-no-rht": ["recipe=nvfp4", "rht=false"],
    "nvfp4-no-sr": ["recipe=nvfp4", "stochastic_rounding=false"],
    "nvfp4-no-2d": ["recipe=nvfp4", "weight_2d=false"],
    "nvfp4-all-fp4": ["recipe=nvfp4", "bf16_first_layers=0", "bf16_last_layers=0"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="folder with train.txt and val.txt, or a file")
    parser.add_argument("--out", default="runs/recipe_study")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--runs", default=",".join(RUNS), help="comma-separated subset of " + ",".join(RUNS))
    parser.add_argument("--seed", type=int, default=0, help="model init, SR and data-order seed")
    parser.add_argument("--docs", default="docs")
    parser.add_argument(
        "--stem",
        default=None,
        help="docs/<stem>.png / .json (default: recipe_study, recipe_study_<model> for another model)",
    )
    args = parser.parse_args()

    data = Path(args.data)
    train_file, val_file = (data / "train.txt", data / "val.txt") if data.is_dir() else (data, None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = out / "tokenizer"
    if not (tokenizer_dir / "tokenizer.json").is_file():
        train_bpe_tokenizer(iter_documents(train_file), args.vocab_size, tokenizer_dir)
    common = [
        f"model={args.model}",
        f"data={train_file}",
        f"tokenizer={tokenizer_dir}",
        f"steps={args.steps}",
        f"seq_len={args.seq_len}",
        f"batch_size={args.batch_size}",
        f"lr={args.lr}",
        "warmup_steps=20",
        f"eval_every={max(1, args.steps // 6)}",
        "eval_batches=8",
        f"seed={args.seed}",
        "force=true",
    ]
    if val_file is not None:
        common.append(f"eval_data={val_file}")
    results = {}
    names = args.runs.split(",")
    for name in names:
        t0 = time.perf_counter()
        result = train(load_train_config(None, common + RUNS[name] + [f"out={out / name}"]))
        last = max(result.losses)
        results[name] = {
            "train_loss": result.losses[last],
            "eval_loss": result.eval_losses[last],
            "tokens_per_s": result.tokens_per_s,
            "seconds": time.perf_counter() - t0,
        }
        print(name, results[name], flush=True)
    base = results.get("bf16", results[names[0]])["eval_loss"]
    for r in results.values():
        r["eval_gap_pct_vs_bf16"] = 100 * (r["eval_loss"] - base) / base
    docs = Path(args.docs)
    docs.mkdir(exist_ok=True)
    stem = args.stem or ("recipe_study" if args.model == "tiny" else f"recipe_study_{args.model}")
    suffix = "" if args.seed == 0 else f"_seed{args.seed}"
    plot_runs([out / n for n in names], docs / f"{stem}{suffix}.png", labels=names)
    (docs / f"{stem}{suffix}.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    print("\n| run | final train loss | final eval loss | eval gap vs bf16 | tokens/s |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['train_loss']:.4f} | {r['eval_loss']:.4f} | "
            f"{r['eval_gap_pct_vs_bf16']:+.2f}% | {r['tokens_per_s']:,.0f} |"
        )


if __name__ == "__main__":
    main()
