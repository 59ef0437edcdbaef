"""Eval throughput (issue 24): items/s and requests/s of `nvfp4tool eval`'s models on the shipped
tasks, compilation included and not, and what sharing one forward row per context saves.

    python scripts/bench_eval.py --preset tiny --workdir /work/scratch/bench_eval --json tiny.json
    python scripts/bench_eval.py --preset small --workdir /work/scratch/bench_eval --json small.json \\
        [--limit 16] [--batch-size 8] [--max-length 256] [--models bf16,fp8,nvfp4]

Builds in --workdir/<preset>-v<vocab> (each skipped when already there): a byte-level BPE tokenizer
(`train.tokenizer.train_bpe_tokenizer` on nvfp4tool/data/shakespeare_train.txt) and a random BF16
HF folder of the training preset's shape (`train.presets.preset_config`, weights by
`bench_convert.write_synthetic_hf_folder`), calibration ids (.npy), and its NVFP4 (W4A4) and FP8
exports made by the CLI (`nvfp4tool export --quant nvfp4 / fp8 --calib-data ids.npy`, child
processes). The weights are random: this measures throughput, not accuracy (the scores mean nothing).

Then, in this process, the inputs are opened and checked as `nvfp4tool eval NVFP4 --reference FP8`
does (`evaluate._open_inputs`), and each model in turn (bf16 source, fp8 and nvfp4 as served) is
opened as `nvfp4tool eval` opens it (`evaluate.open_lm`) and runs
`evaluate._simple_evaluate` (lm-eval's `simple_evaluate`) one task at a time, each timed alone:
* nvfp4tool_mc (loglikelihood of each option) and nvfp4tool_gsm (greedy generation): `first` is
  the model's first run of the task (its programs compiled in it), `steady` a second run of the
  same task on the same model (compiled programs reused);
* nvfp4tool_mc_letter (one-token letter answers: every choice of an item is one forward row) with
  `share_prefixes` on (a first run, then a steady one) and off (steady: same rows, same programs),
  the rows run and seconds of each, and the ratio; the per-item acc of the two must be identical
  (the run fails otherwise).
Items/s is the task's items over the wall time of its simple_evaluate call (lm-eval's task and
request building and its scoring included); requests/s counts the backend's requests
(loglikelihood or generate_until), `rows_run` the forward rows the loglikelihood requests took
(share_prefixes is on, the backend's default, for nvfp4tool_mc too: an option whose tokens are a
prefix of another's rides on that row), `backend_s` the time spent inside the backend. `--models`
measures only some of the three. A table is printed; `--json` writes machine facts
(`bench_scale.machine_facts`: cores, RAM, load average at the start and the end, commit), the
versions of jax / lm_eval / transformers, the preset's model, the parameters and every figure.
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

from bench_scale import machine_facts  # noqa: E402

PRESETS = ("tiny", "small")
TASKS = ("nvfp4tool_mc", "nvfp4tool_gsm")  # timed first and steady
LETTER = "nvfp4tool_mc_letter"  # shared rows on vs off
LABELS = ("bf16", "fp8", "nvfp4")
CALIB = (4, 32)  # export --calib-samples, --calib-seq-len
REQUEST_KINDS = ("loglikelihood", "generate_until")
MAX_POSITIONS = 4096  # the source's max_position_embeddings (NVFP4ToolLM's own cap on max_length)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=PRESETS, default="tiny", help="model shape (default: tiny)")
    parser.add_argument(
        "--workdir", default=None, help="where the models are built and kept for later runs (default: a temp folder)"
    )
    parser.add_argument("--limit", type=int, default=None, help="the first N items of each task (default: all)")
    parser.add_argument("--batch-size", type=int, default=8, help="rows per forward (default: 8)")
    parser.add_argument("--max-length", type=int, default=256, help="longest row in tokens (default: 256)")
    parser.add_argument("--vocab-size", type=int, default=512, help="the BPE tokenizer's vocabulary (default: 512)")
    parser.add_argument(
        "--models",
        default=",".join(LABELS),
        help=f"which models to measure, comma-separated (default: {','.join(LABELS)})",
    )
    parser.add_argument("--json", default=None, help="also write the JSON result here")
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models or any(m not in LABELS for m in models):
        parser.error(f"--models {args.models}: expected a comma-separated subset of {','.join(LABELS)}")
    if args.limit is not None and args.limit < 1:
        parser.error(f"--limit must be >= 1, got {args.limit}")
    if not 1 <= args.max_length <= MAX_POSITIONS:
        parser.error(f"--max-length must be in 1..{MAX_POSITIONS}, got {args.max_length}")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        parser.error(f"--json {args.json}: its folder does not exist")

    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_eval-")
    try:
        result = run(args, models, workdir)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print_table(result)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return result


def run(args: argparse.Namespace, models: list[str], workdir: str) -> dict:
    from importlib.metadata import version

    started = time.perf_counter()
    paths, built = build_models(
        os.path.join(workdir, f"{args.preset}-v{args.vocab_size}"), args.preset, args.vocab_size
    )
    result = {
        "preset": args.preset,
        "model": _model_facts(paths["hf"]),
        "machine": machine_facts(),
        "versions": {name: version(name) for name in ("jax", "lm_eval", "transformers")},
        "parameters": {
            "limit": args.limit,
            "batch_size": args.batch_size,
            "max_length": args.max_length,
            "vocab_size": args.vocab_size,
            "calib": list(CALIB),
            "models": models,
        },
        "paths": paths,
        "built_s": built,
        "models": {},
    }
    result["models"] = measure(paths, models, limit=args.limit, batch_size=args.batch_size, max_length=args.max_length)
    result["machine"]["loadavg_1m_end"] = os.getloadavg()[0]
    result["seconds"] = time.perf_counter() - started
    return result


# ------------------------------------------------------------------------------------------ models


def build_models(folder: str, preset: str, vocab_size: int) -> tuple[dict, dict]:
    """The BF16 source (tokenizer + random weights), ids and the two exports under `folder`, each
    made only when missing (a folder appears whole: written under a temporary name, then renamed);
    (paths, seconds each build took)."""
    import numpy as np

    paths = {
        "hf": os.path.join(folder, "hf"),
        "ids": os.path.join(folder, "ids.npy"),
        "nvfp4": os.path.join(folder, "nvfp4"),
        "fp8": os.path.join(folder, "fp8"),
    }
    built = {}
    os.makedirs(folder, exist_ok=True)
    if not os.path.isdir(paths["hf"]):
        t0 = time.perf_counter()
        _log(f"building {paths['hf']} (preset {preset}, random BF16 weights)")
        partial = paths["hf"] + ".partial"
        _write_source(partial, preset, vocab_size)
        os.rename(partial, paths["hf"])
        built["hf"] = time.perf_counter() - t0
    if not os.path.isfile(paths["ids"]):
        with open(os.path.join(paths["hf"], "config.json"), encoding="utf-8") as f:
            vocab = json.load(f)["vocab_size"]
        partial = paths["ids"] + ".partial.npy"
        np.save(partial, np.random.default_rng(0).integers(0, vocab, CALIB, dtype=np.int32))
        os.rename(partial, paths["ids"])
    for quant in ("nvfp4", "fp8"):
        if not os.path.isdir(paths[quant]):
            t0 = time.perf_counter()
            _log(f"exporting {paths[quant]} (--quant {quant})")
            _cli(
                "export",
                paths["hf"],
                "--out",
                paths[quant],
                "--quant",
                quant,
                "--calib-data",
                paths["ids"],
                "--calib-samples",
                str(CALIB[0]),
                "--calib-seq-len",
                str(CALIB[1]),
            )
            built[quant] = time.perf_counter() - t0
    return paths, built


def _write_source(folder: str, preset: str, vocab_size: int) -> None:
    from bench_convert import write_synthetic_hf_folder

    from nvfp4tool.corpus.tokenizer import train_bpe_tokenizer
    from nvfp4tool.train.presets import preset_config

    if os.path.isdir(folder):  # an interrupted earlier build
        shutil.rmtree(folder)
    with open(os.path.join(ROOT, "nvfp4tool", "data", "shakespeare_train.txt"), encoding="utf-8") as f:
        text = f.read()
    os.makedirs(folder)
    tokenizer = train_bpe_tokenizer([text], vocab_size, folder)
    write_synthetic_hf_folder(folder, preset_config(preset, tokenizer.vocab_size, MAX_POSITIONS))


def _cli(*argv: str) -> None:
    """`nvfp4tool ARGV` in a child process (this tree's code, JAX on cpu); its stderr tail on failure."""
    done = subprocess.run(
        [sys.executable, "-c", "from nvfp4tool.cli import main; main()", "-q", *argv],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT),
    )
    if done.returncode != 0:
        raise RuntimeError(f"nvfp4tool {' '.join(argv)} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")


def _model_facts(hf: str) -> dict:
    from nvfp4tool.checkpoints import open_checkpoint

    config = open_checkpoint(hf).config
    return {
        "parameters": config.num_parameters(),
        "hidden": config.hidden_size,
        "mlp": config.intermediate_size,
        "layers": config.num_layers,
        "heads": config.num_heads,
        "kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "vocab": config.vocab_size,
    }


# ------------------------------------------------------------------------------------------ measuring


def measure(paths: dict, models: list[str], *, limit: int | None, batch_size: int, max_length: int) -> dict:
    """{label: its figures} for each of `models` (bf16, fp8, nvfp4; see the module docstring)."""
    from nvfp4tool import memory
    from nvfp4tool.eval.evaluate import EvalOptions, _open_inputs

    options = EvalOptions(
        tasks=(*TASKS, LETTER), reference=paths["fp8"], limit=limit, batch_size=batch_size, max_length=max_length
    )
    inputs = _open_inputs(paths["nvfp4"], options)  # every check `nvfp4tool eval` makes
    out = {}
    for label, path, step in (
        ("bf16", inputs.source_path, inputs.source_step),
        ("fp8", paths["fp8"], None),
        ("nvfp4", paths["nvfp4"], None),
    ):
        if label not in models:
            continue
        out[label] = measure_model(label, path, step, inputs, options)
        memory.release()
    return out


def measure_model(label: str, path: str, step: int | None, inputs, options) -> dict:
    """One model's figures: opening, each task first and steady, the letter task shared and not."""
    from nvfp4tool.eval.evaluate import open_lm

    t0 = time.perf_counter()
    lm = open_lm(label, path, options, step)
    figures: dict = {"open_s": time.perf_counter() - t0, "how": lm.variant.how, "tasks": {}}
    for task in TASKS:
        figures["tasks"][task] = {
            run: _timed(lm, task, inputs, options, f"{label} {task} {run}")[0] for run in ("first", "steady")
        }
    lm.share_prefixes = True
    first, _ = _timed(lm, LETTER, inputs, options, f"{label} {LETTER} shared first")
    shared, shared_rows = _timed(lm, LETTER, inputs, options, f"{label} {LETTER} shared steady")
    lm.share_prefixes = False
    unshared, unshared_rows = _timed(lm, LETTER, inputs, options, f"{label} {LETTER} unshared steady")
    lm.share_prefixes = True
    acc = same_scores(f"{label} {LETTER}", shared_rows, unshared_rows)
    figures["shared_rows"] = {
        "task": LETTER,
        "first_shared": first,
        "shared": shared,
        "unshared": unshared,
        "identical_acc": True,
        "acc": acc,
        "rows_ratio": unshared["rows_run"] / shared["rows_run"],
        "seconds_ratio": unshared["seconds"] / shared["seconds"],
        "backend_seconds_ratio": unshared["backend_s"] / shared["backend_s"],
    }
    del lm
    return figures


def same_scores(what: str, shared: list[dict], unshared: list[dict]) -> float:
    """The mean per-item score (acc) of the letter task's logged samples with share_prefixes on,
    after checking that off gave every item the same prompt and score (RuntimeError otherwise)."""
    from nvfp4tool.eval.evaluate import _per_item

    (metric, on), (metric_off, off) = _per_item(LETTER, shared, "shared"), _per_item(LETTER, unshared, "unshared")
    if not on or metric != metric_off or on != off:
        differ = sorted(d for d in set(on) | set(off) if on.get(d) != off.get(d))
        raise RuntimeError(
            f"{what}: per-item {metric} with share_prefixes on differs from off (doc_ids "
            f"{differ[:10]} of {len(on)} scored shared, {len(off)} unshared)"
        )
    return sum(score for _, score in on.values()) / len(on)


def _timed(lm, task: str, inputs, options, what: str) -> tuple[dict, list[dict]]:
    """({items, seconds, items/s, requests, requests/s, rows run, backend seconds}, logged samples) of
    one simple_evaluate call of `task` alone."""
    from nvfp4tool.eval.evaluate import _simple_evaluate

    counts, timing = dict(lm.counts), dict(lm.timing)
    t0 = time.perf_counter()
    _, samples = _simple_evaluate(lm, [task], inputs, options)
    seconds = time.perf_counter() - t0
    items = inputs.limits[task]
    delta = {k: lm.counts.get(k, 0) - counts.get(k, 0) for k in (*REQUEST_KINDS, "loglikelihood_rows_run")}
    requests = sum(delta[k] for k in REQUEST_KINDS)
    backend = sum(lm.timing.get(k, 0.0) - timing.get(k, 0.0) for k in REQUEST_KINDS)
    row = {
        "items": items,
        "seconds": seconds,
        "items_per_s": items / seconds,
        "requests": requests,
        "requests_per_s": requests / seconds,
        "rows_run": delta["loglikelihood_rows_run"] or None,
        "backend_s": backend,
    }
    _log(f"{what}: {items} items, {requests} requests in {seconds:.1f} s ({row['items_per_s']:.2f} items/s)")
    return row, samples.get(task, [])


# ------------------------------------------------------------------------------------------ output


def print_table(result: dict) -> None:
    model, machine, p = result["model"], result["machine"], result["parameters"]
    print(
        f"\npreset {result['preset']} ({model['parameters']:,} parameters: hidden {model['hidden']}, "
        f"{model['layers']} layers, vocab {model['vocab']}), batch {p['batch_size']}, max length "
        f"{p['max_length']}, limit {p['limit'] or 'all'}; {machine['cores']} cores, load average "
        f"{machine['loadavg_1m']:.2f} at the start, {machine['loadavg_1m_end']:.2f} at the end; "
        f"commit {machine['commit']}"
    )
    print(
        "| model | task | run | items | requests | rows run | s | items/s | requests/s | backend s |\n"
        "|---|---|---|---|---|---|---|---|---|---|"
    )
    for label, figures in result["models"].items():
        for task, runs in figures["tasks"].items():
            for run, r in runs.items():
                print(
                    f"| {label} | {task} | {run} | {r['items']} | {r['requests']} | {r['rows_run'] or '-'} | "
                    f"{r['seconds']:.1f} | "
                    f"{r['items_per_s']:.2f} | {r['requests_per_s']:.1f} | {r['backend_s']:.1f} |"
                )
    print(f"\n| model | {LETTER} | rows run | s | items/s | backend s |\n|---|---|---|---|---|---|")
    for label, figures in result["models"].items():
        s = figures["shared_rows"]
        for run, name in (
            ("first_shared", "shared (first)"),
            ("shared", "shared (steady)"),
            ("unshared", "unshared (steady)"),
        ):
            r = s[run]
            print(
                f"| {label} | {name} | {r['rows_run']} | {r['seconds']:.1f} | "
                f"{r['items_per_s']:.2f} | {r['backend_s']:.1f} |"
            )
        print(
            f"| {label} | unshared / shared | {s['rows_ratio']:.1f}x | {s['seconds_ratio']:.2f}x | | "
            f"{s['backend_seconds_ratio']:.2f}x |"
        )


def _log(message: str) -> None:
    print(f"bench_eval: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
