"""A QAD fine-tune of a real 30-layer model (SmolLM2-135M, `scripts/real_model.py`) as a user runs it,
scanned vs unrolled layers side by side: compile time of the first train step, peak RSS, and
the step time of the steps after it.

Each variant is `nvfp4tool train model=M teacher=M distill=kl recipe=nvfp4 seq_len=128
batch_size=4 ...` in its own process (so its peak RSS is its own: `ru_maxrss` of that process),
one after the other; compile seconds are read from the trainer's "compiled train step in ..."
line, step time as the median `step_time_s` of `metrics.jsonl` after step 1. Writes a table and
`--json` (rewritten after each variant, "complete": false until the last).

    pip install -e ".[test,bench]"
    python scripts/bench_qad.py --work /tmp/qad --steps 4 --json qad.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from real_model import smollm2_folder  # noqa: E402

# The child: the CLI in-process, then its own peak RSS (Linux ru_maxrss: KiB) on the last line.
_CHILD = (
    "import resource, sys\n"
    "from nvfp4tool.cli import main\n"
    "try:\n    main(sys.argv[1:])\n"
    "except SystemExit as done:\n    code = done.code or 0\n"
    "else:\n    code = 0\n"
    "print('peak_rss_bytes', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)\n"
    "sys.exit(code)\n"
)
_COMPILED = re.compile(r"compiled train step in (?:(\d+)m)?([\d.]+) ?s")


def _seconds(match: re.Match) -> float:
    return 60 * int(match.group(1) or 0) + float(match.group(2))


def run_variant(name: str, scan: bool, model: str, data: str, work: str, steps: int, timeout: float) -> dict:
    out = os.path.join(work, name)
    args = [
        "train",
        f"model={model}",
        f"teacher={model}",
        "distill=kl",
        "recipe=nvfp4",
        "seq_len=128",
        "batch_size=4",
        f"data={data}",
        f"steps={steps}",
        "eval_every=0",
        "lr=1e-5",
        "warmup_steps=1",
        f"out={out}",
        "force=true",
        f"scan_layers={'true' if scan else 'false'}",
    ]
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, *args], capture_output=True, text=True, check=False, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {
            "variant": name,
            "scan_layers": scan,
            "ok": False,
            "error": f"did not finish in {timeout:.0f} s",
            "wall_s": time.perf_counter() - start,
        }
    wall = time.perf_counter() - start
    text = done.stdout + done.stderr
    compiled = _COMPILED.search(text)
    peak = re.search(r"peak_rss_bytes (\d+)", text)
    result = {
        "variant": name,
        "scan_layers": scan,
        "ok": done.returncode == 0,
        "wall_s": wall,
        "compile_s": _seconds(compiled) if compiled else None,
        "peak_rss_bytes": int(peak.group(1)) if peak else None,
    }
    if done.returncode != 0:
        result["error"] = text.strip().splitlines()[-1] if text.strip() else f"exit {done.returncode}"
        return result
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    train = [r for r in rows if "step_time_s" in r]
    result["step_s"] = statistics.median(r["step_time_s"] for r in train[1:]) if len(train) > 1 else None
    result["losses"] = [r["loss"] for r in train]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True, help="folder for the model and the runs")
    parser.add_argument("--data", default=os.path.join(ROOT, "nvfp4tool", "data", "shakespeare_train.txt"))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--variants", default="scanned,unrolled")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per variant")
    parser.add_argument("--json")
    args = parser.parse_args()
    os.makedirs(args.work, exist_ok=True)
    model = smollm2_folder(os.path.join(args.work, "smollm2-135m"))
    results = []
    for name in args.variants.split(","):
        results.append(run_variant(name, name == "scanned", model, args.data, args.work, args.steps, args.timeout))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {
                        "complete": len(results) == len(args.variants.split(",")),
                        "steps": args.steps,
                        "results": results,
                    },
                    f,
                    indent=1,
                )
    print(f"{'variant':10} {'compile s':>10} {'peak RSS GB':>12} {'step s':>8}  losses")
    for r in results:
        if not r["ok"]:
            print(f"{r['variant']:10} failed: {r['error']}")
            continue
        print(
            f"{r['variant']:10} {r['compile_s']:>10.1f} {r['peak_rss_bytes'] / 1e9:>12.2f} "
            f"{r['step_s'] or float('nan'):>8.2f}  {', '.join(f'{x:.4f}' for x in r['losses'])}"
        )
    by = {r["variant"]: r for r in results if r["ok"]}
    if {"scanned", "unrolled"} <= set(by):
        print(
            f"compile ratio scanned/unrolled {by['scanned']['compile_s'] / by['unrolled']['compile_s']:.3f}, "
            f"peak RSS ratio {by['scanned']['peak_rss_bytes'] / by['unrolled']['peak_rss_bytes']:.3f}"
        )


if __name__ == "__main__":
    main()
