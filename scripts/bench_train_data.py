"""Train's start-up against the corpus size (issue 43): peak RSS, and seconds from launch to the
first step, of `nvfp4tool train` on a prepared ~10 MB and a ~1 GB token cache.

    python scripts/bench_train_data.py --corpus-large /tmp/bd1g/corpus.jsonl --tokenizer /tmp/bd1g/tokenizer \\
        --workdir /tmp/bt --repeats 3 --json /tmp/bt/result.json
    python scripts/bench_train_data.py --mb-small 1 --mb-large 5 --repeats 1 --workdir /tmp/bt_smoke  # smoke test

The corpora are --corpus-small / --corpus-large, or generated (--mb-small / --mb-large MB) with
bench_data.py's generator, and its tokenizer unless --tokenizer is given. Each is prepared
(`prepare_cache`, --workers processes) into --workdir/cache-{small,large}, kept and reused while its
manifest records the same corpus (path and size) and tokenizer. Then for each --packings value,
small and large interleaved, --repeats times, `nvfp4tool --log-format json train model=tiny
tokenizer=T data=CACHE steps=2 packing=P` runs as a child process (this tree's code,
JAX_PLATFORMS=cpu) and is measured: its peak RSS (`os.wait4` of that child: its `ru_maxrss`), the
seconds from launch to its first step's record in metrics.jsonl (the file's mtime when the record
appears; polled) and to its data being ready (its "rows:" status line), its first train step's
compile seconds, its CPU seconds (/proc/PID/stat) when the first step's record and the "rows:" line
appear (less sensitive to the machine's load than wall time) and over the whole run, and
/proc/loadavg when it starts and ends. One line per run; then per packing the medians, the ratios
large / small and whether each goal (<= 1.10) is met; --json writes the machine facts, every run
and the summary.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]

import bench_data  # noqa: E402  (its corpus generator and tokenizer)
from bench_scale import machine_facts  # noqa: E402

SIZES = ("small", "large")
GOAL = 1.10  # large / small within 10%
POLL_S = 0.02


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus-small", help="a JSONL corpus (default: generated, --mb-small MB)")
    parser.add_argument("--corpus-large", help="a JSONL corpus (default: generated, --mb-large MB)")
    parser.add_argument("--mb-small", type=float, default=10.0, help="generated small corpus, MB (default: 10)")
    parser.add_argument("--mb-large", type=float, default=1000.0, help="generated large corpus, MB (default: 1000)")
    parser.add_argument("--tokenizer", help="tokenizer folder (default: bench_data.py's, made in --workdir)")
    parser.add_argument("--vocab-size", type=int, default=8192, help="a generated tokenizer's vocabulary")
    parser.add_argument("--workdir", default="/tmp/bt", help="corpora, caches, runs and logs (default: /tmp/bt)")
    parser.add_argument("--workers", type=int, default=2, help="prepare's worker processes (default: 2)")
    parser.add_argument("--packings", default="segmented,concat", help="comma-separated (default: segmented,concat)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each (size, packing) (default: 3)")
    parser.add_argument("--steps", type=int, default=2, help="train steps of each run (default: 2)")
    parser.add_argument("--train-arg", action="append", default=[], help="extra key=value for train (repeatable)")
    parser.add_argument("--json", help="also write the JSON result here")
    args = parser.parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    tokenizer = args.tokenizer or _generated_tokenizer(args)
    corpora = {size: getattr(args, f"corpus_{size}") or _generated_corpus(args, size) for size in SIZES}
    caches = {
        size: _cache(corpora[size], tokenizer, os.path.join(args.workdir, f"cache-{size}"), args.workers)
        for size in SIZES
    }
    result = {
        "command": "python scripts/bench_train_data.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine_facts(),
        "corpora": {size: _corpus_facts(corpora[size], caches[size]) for size in SIZES},
        "runs": [],
    }
    packings = args.packings.split(",")
    total, number = len(packings) * len(SIZES) * args.repeats, 0
    for repeat in range(args.repeats):
        for packing in packings:
            for size in SIZES:  # small, large, small, large, ...: the machine is shared
                number += 1
                run = _train(args, tokenizer, caches[size], f"{size}-{packing}-{repeat}")
                run.update(size=size, packing=packing, repeat=repeat)
                result["runs"].append(run)
                print(f"run {number}/{total} {size:5s} {packing:9s} {_describe(run)}", flush=True)
    result["summary"] = _summary(result["runs"], packings)
    _print_summary(result)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(json.dumps(result, indent=2) + "\n")
    return result


# ------------------------------------------------------------------------------------------ inputs


def _generated_tokenizer(args) -> str:
    folder = os.path.join(args.workdir, "tokenizer")
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        bench_data._tokenizer(types.SimpleNamespace(workdir=args.workdir, vocab_size=args.vocab_size))
    return folder


def _generated_corpus(args, size: str) -> str:
    workdir = os.path.join(args.workdir, f"corpus-{size}")
    path = os.path.join(workdir, "corpus.jsonl")
    if not os.path.isfile(path):
        os.makedirs(workdir, exist_ok=True)
        bench_data._corpus(types.SimpleNamespace(workdir=workdir, mb=getattr(args, f"mb_{size}")))
    return path


def _cache(corpus: str, tokenizer: str, folder: str, workers: int) -> str:
    """`folder`, prepared from `corpus` with `tokenizer` unless it already holds that cache."""
    from nvfp4tool import progress
    from nvfp4tool.corpus.cache import is_cache
    from nvfp4tool.corpus.prepare import prepare_cache
    from nvfp4tool.corpus.tokenizer import load_tokenizer, tokenizer_sha256
    from nvfp4tool.records.corpus import CorpusManifest

    corpus = os.path.abspath(corpus)
    if is_cache(folder):
        manifest = CorpusManifest.read(folder)
        same = [(s.name, s.bytes) for s in manifest.sources] == [(corpus, os.path.getsize(corpus))]
        if same and manifest.tokenizer_sha256 == tokenizer_sha256(load_tokenizer(tokenizer)):
            print(f"{folder}: reused (prepared from {corpus})", flush=True)
            return folder
    print(f"{folder}: preparing from {corpus} ({os.path.getsize(corpus) / 1e6:,.0f} MB)", flush=True)
    progress.use_reporter(progress.for_cli(quiet=False, log_format="text"))
    started = time.perf_counter()
    prepare_cache([corpus], tokenizer, folder, workers=workers, force=True)
    print(f"{folder}: prepared in {time.perf_counter() - started:.0f} s", flush=True)
    return folder


def _corpus_facts(corpus: str, cache: str) -> dict:
    from nvfp4tool.records.corpus import CorpusManifest

    manifest = CorpusManifest.read(cache)
    return {
        "corpus": os.path.abspath(corpus),
        "corpus_mb": os.path.getsize(corpus) / 1e6,
        "cache": cache,
        "cache_mb": sum(s.bytes for s in manifest.shards) / 1e6 + manifest.index.bytes / 1e6,
        "tokens": manifest.tokens,
        "documents": manifest.documents,
        "dtype": manifest.dtype,
    }


# ------------------------------------------------------------------------------------------ one run


def _train(args, tokenizer: str, cache: str, name: str) -> dict:
    """One `nvfp4tool train` child: peak RSS, seconds to its first step (and to its data), CPU s."""
    out = os.path.join(args.workdir, "runs", name)
    log = os.path.join(args.workdir, "logs", f"{name}.log")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    os.makedirs(os.path.dirname(log), exist_ok=True)
    packing = name.split("-")[1]
    command = [
        sys.executable,
        "-c",
        "from nvfp4tool.cli import main; main()",
        "--log-format",
        "json",
        "train",
        "model=tiny",
        f"tokenizer={tokenizer}",
        f"data={cache}",
        f"steps={args.steps}",
        f"packing={packing}",
        f"out={out}",
        *args.train_arg,
    ]
    metrics = os.path.join(out, "metrics.jsonl")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    loadavg = _loadavg()
    first_step, exact, cpu, tail = None, True, {"data_ready_cpu_s": None, "first_step_cpu_s": None}, b""
    with open(log, "w") as output, open(log, "rb") as reading:
        launched = time.time()
        proc = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            tail = tail[-100:] + reading.read()  # a line may arrive in pieces
            if cpu["data_ready_cpu_s"] is None and b'"message": "rows: ' in tail:
                cpu["data_ready_cpu_s"] = _cpu_seconds(proc.pid)  # when the line is seen (one poll late at most)
            if first_step is None and os.path.isfile(metrics):
                with open(metrics, "rb") as f:
                    lines = f.read().count(b"\n")
                if lines:  # the first step's record: written when the step's results were read
                    cpu["first_step_cpu_s"] = _cpu_seconds(proc.pid)
                    exact = lines == 1  # else: the second came within one poll; the mtime is its
                    first_step = os.stat(metrics).st_mtime_ns / 1e9 - launched
            time.sleep(POLL_S)
        wall = time.time() - launched
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        with open(log, errors="replace") as f:
            raise RuntimeError(f"{' '.join(command)} failed (exit {proc.returncode}):\n{f.read()[-4000:]}")
    shutil.rmtree(out, ignore_errors=True)
    return {
        "peak_rss_mb": usage.ru_maxrss / 1024,  # KiB on Linux
        "first_step_s": first_step,
        "first_step_exact": exact,
        **_phases(log, launched),
        **cpu,
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "loadavg_start": loadavg,
        "loadavg_end": _loadavg(),
        "log": log,
    }


def _phases(log: str, launched: float) -> dict:
    """From the run's JSON log lines: seconds from launch to its "rows: ..." status line (the data
    opened, its windows counted) and the first train step's compile seconds."""
    found = {"data_ready_s": None, "compile_s": None}
    with open(log, errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(record, dict):
                continue
            if found["data_ready_s"] is None and str(record.get("message", "")).startswith("rows: "):
                stamp = datetime.datetime.fromisoformat(record["time"].replace("Z", "+00:00"))
                found["data_ready_s"] = stamp.timestamp() - launched
            if (
                found["compile_s"] is None
                and record.get("event") == "compile_done"
                and str(record.get("stage", "")).startswith("train step")
            ):
                found["compile_s"] = record["elapsed_s"]
    return found


def _cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system, its threads and waited-for children) process `pid` has used."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return None
    return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _describe(run: dict) -> str:
    def seconds(key: str) -> str:
        return "?" if run[key] is None else f"{run[key]:.1f} s"

    return (
        f"peak RSS {run['peak_rss_mb']:.0f} MB, first step {seconds('first_step_s')}"
        f"{'' if run['first_step_exact'] else ' (approx.)'} (data ready {seconds('data_ready_s')}, "
        f"compile {seconds('compile_s')}), CPU to the first step {seconds('first_step_cpu_s')} (to data ready "
        f"{seconds('data_ready_cpu_s')}), wall {run['wall_s']:.1f} s, CPU {run['cpu_s']:.1f} s, "
        f"load {run['loadavg_start']} .. {run['loadavg_end']}"
    )


# ------------------------------------------------------------------------------------------ summary


def _summary(runs: list[dict], packings: list[str]) -> dict:
    """Per packing: the medians of each size and the ratios large / small, each goal met or not."""
    summary = {}
    for packing in packings:
        medians = {}
        for size in SIZES:
            mine = [r for r in runs if r["packing"] == packing and r["size"] == size]
            medians[size] = {
                key: statistics.median(r[key] for r in mine) if all(r[key] is not None for r in mine) else None
                for key in _COLUMNS
            }
        ratios = {
            key: medians["large"][key] / medians["small"][key] if medians["small"][key] else None
            for key in medians["small"]
        }
        summary[packing] = {
            **medians,
            "ratio": ratios,
            "rss_goal_met": ratios["peak_rss_mb"] is not None and ratios["peak_rss_mb"] <= GOAL,
            "first_step_goal_met": ratios["first_step_s"] is not None and ratios["first_step_s"] <= GOAL,
        }
    return summary


def _print_summary(result: dict) -> None:
    facts = result["corpora"]
    print(
        "\ncorpora: "
        + ", ".join(
            f"{size} {facts[size]['corpus_mb']:,.1f} MB -> {facts[size]['tokens']:,} tokens "
            f"({facts[size]['cache_mb']:,.1f} MB cache)"
            for size in SIZES
        )
    )
    print(
        "| packing | | peak RSS MB | first step s | data ready s | compile s | CPU s to first step "
        "| CPU s to data ready | CPU s (whole run) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for packing, row in result["summary"].items():
        for size in SIZES:
            label = f"{size} ({facts[size]['corpus_mb']:,.0f} MB)"
            print(f"| {packing} | {label} | " + " | ".join(_cell(row[size][k]) for k in _COLUMNS) + " |")
        print(
            f"| {packing} | large / small | " + " | ".join(_cell(row["ratio"][k], ratio=True) for k in _COLUMNS) + " |"
        )
    for packing, row in result["summary"].items():
        print(
            f"{packing}: peak RSS goal (large / small <= {GOAL:.2f}) {'met' if row['rss_goal_met'] else 'missed'}; "
            f"first-step goal {'met' if row['first_step_goal_met'] else 'missed'}"
        )


_COLUMNS = ("peak_rss_mb", "first_step_s", "data_ready_s", "compile_s", "first_step_cpu_s", "data_ready_cpu_s", "cpu_s")


def _cell(value, ratio: bool = False) -> str:
    if value is None:
        return "?"
    return f"{value:.3f}" if ratio else f"{value:,.1f}"


if __name__ == "__main__":
    main()
