"""Token-cache throughput: `data prepare` with N worker processes against one single-threaded
`tokenizers` encoder, timed in the same run on the same generated corpus.

    python scripts/bench_data.py --mb 50 --workers 2 --workdir /tmp/bench_data --json /tmp/bench_data/result.json

Generates a JSONL corpus of about --mb MB (documents of 0.5-4 KB of words drawn from the embedded
Shakespeare text, fixed seed) and a byte-level BPE tokenizer (--vocab-size) trained on the embedded
text; then, each in its own process (so each peak RSS is its own): `prepare_cache(workers=N)`, and
the baseline: the same JSONL read line by line and encoded with `Tokenizer.encode_batch` on batches
of 1,000 documents, TOKENIZERS_PARALLELISM=false (one thread). Prints MB/s of source text, tokens/s,
CPU seconds (all processes), peak RSS (prepare: its main process and its largest worker) and the
speed-up, with the speed-up N busy processes get on the machine at that moment (its ceiling on a
shared machine); --json writes them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=1000.0, help="corpus size in MB (default: 1000)")
    parser.add_argument("--workers", type=int, default=2, help="prepare's worker processes (default: 2)")
    parser.add_argument("--vocab-size", type=int, default=8192, help="the BPE tokenizer's vocabulary (default: 8192)")
    parser.add_argument("--workdir", default="/tmp/bench_data", help="corpus, tokenizer and cache (removed after)")
    parser.add_argument("--json", default=None, help="also write the JSON result here")
    parser.add_argument("--run", choices=["prepare", "baseline"], help=argparse.SUPPRESS)  # one measurement
    args = parser.parse_args(argv)
    if args.run:
        return _measure(args)
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    corpus = _corpus(args)
    _tokenizer(args)
    result = {
        "command": "python scripts/bench_data.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "corpus_mb": os.path.getsize(corpus) / 1e6,
        "cpus": os.cpu_count(),
        "workers": args.workers,
    }
    for run in ("baseline", "prepare"):  # each in its own process: its own peak RSS
        done = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--run", run, *_forwarded(args)],
            check=True,
            capture_output=True,
            text=True,
        )
        result[run] = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["prepare"]["tokens"] == result["baseline"]["tokens"], "the two runs saw different tokens"
    result["parallel_capacity"] = _parallel_capacity(args.workers)
    result["speedup"] = result["baseline"]["seconds"] / result["prepare"]["seconds"]
    for run in ("baseline", "prepare"):
        r = result[run]
        rss = f"peak RSS {r['peak_rss_mb']:.0f} MB" + (
            f" (largest worker {r['worker_peak_rss_mb']:.0f} MB)" if "worker_peak_rss_mb" in r else ""
        )
        print(
            f"{run:9s} {r['seconds']:7.1f} s  {result['corpus_mb'] / r['seconds']:6.2f} MB/s  "
            f"{r['tokens'] / r['seconds']:,.0f} tokens/s  CPU {r['cpu_s']:.1f} s  {rss}"
        )
    print(f"prepare (workers={args.workers}) / one single-threaded encoder: {result['speedup']:.2f}x")
    print(
        f"(on this machine now, {args.workers} busy processes get through "
        f"{result['parallel_capacity']:.2f}x the work of one: the ceiling of the speed-up)"
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(json.dumps(result, indent=2) + "\n")
    shutil.rmtree(os.path.join(args.workdir, "cache"), ignore_errors=True)
    return result


def _burn(n: int) -> None:
    total = 0
    for i in range(n):
        total += i


def _parallel_capacity(processes: int, n: int = 40_000_000) -> float:
    """How much more work `processes` busy processes get done than one in the same time (a shared
    machine's free cores: 2.0 on two idle cores)."""
    import multiprocessing

    started = time.perf_counter()
    _burn(n)
    one = time.perf_counter() - started
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_burn, args=(n,)) for _ in range(processes)]
    started = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return processes * one / (time.perf_counter() - started)


def _forwarded(args) -> list[str]:
    return ["--workdir", args.workdir, "--workers", str(args.workers), "--vocab-size", str(args.vocab_size)]


def _corpus(args) -> str:
    """A JSONL file of about `args.mb` MB: documents of random lengths of words from the embedded text."""
    import numpy as np

    from nvfp4tool.corpus.sources import embedded_corpus

    words = np.array(embedded_corpus()[0].read_text(encoding="utf-8").split())
    rng = np.random.default_rng(0)
    path, target, written = os.path.join(args.workdir, "corpus.jsonl"), int(args.mb * 1e6), 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            lines = [
                json.dumps({"text": " ".join(words[rng.integers(0, len(words), size=n)])}) + "\n"
                for n in rng.integers(80, 700, size=1000)
            ]
            text = "".join(lines)
            f.write(text)
            written += len(text.encode("utf-8"))
    return path


def _tokenizer(args) -> str:
    from nvfp4tool.corpus.sources import embedded_corpus, iter_documents
    from nvfp4tool.corpus.tokenizer import train_bpe_tokenizer

    folder = os.path.join(args.workdir, "tokenizer")
    train_bpe_tokenizer(iter_documents(embedded_corpus()[0]), args.vocab_size, folder)
    return folder


def _measure(args) -> dict:
    """One run (in this process): its seconds, tokens and peak RSS, as one JSON line on stdout."""
    from nvfp4tool import progress

    corpus, folder = os.path.join(args.workdir, "corpus.jsonl"), os.path.join(args.workdir, "tokenizer")
    progress.use_reporter(progress.QuietReporter())
    started = time.perf_counter()
    if args.run == "prepare":
        from nvfp4tool.corpus.prepare import prepare_cache

        cache = os.path.join(args.workdir, "cache")
        manifest = prepare_cache([corpus], folder, cache, workers=args.workers, force=True)
        tokens = manifest.tokens - manifest.documents  # without the end-of-text ids the baseline does not add
    else:
        tokens = _baseline(corpus, folder)
    seconds = time.perf_counter() - started
    cpu = sum(
        getattr(resource.getrusage(who), field)
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
        for field in ("ru_utime", "ru_stime")
    )
    result = {"seconds": seconds, "cpu_s": cpu, "tokens": tokens, "peak_rss_mb": _peak_rss_mb(resource.RUSAGE_SELF)}
    if args.run == "prepare":
        result["worker_peak_rss_mb"] = _peak_rss_mb(resource.RUSAGE_CHILDREN)
    print(json.dumps(result))
    return result


def _baseline(corpus: str, folder: str) -> int:
    """One single-threaded tokenizers encoder: the JSONL read line by line, batches of 1,000."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    tokens, batch = 0, []
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            batch.append(json.loads(line)["text"])
            if len(batch) == 1000:
                tokens += sum(len(e.ids) for e in tokenizer.encode_batch(batch, add_special_tokens=False))
                batch = []
    if batch:
        tokens += sum(len(e.ids) for e in tokenizer.encode_batch(batch, add_special_tokens=False))
    return tokens


def _peak_rss_mb(who: int) -> float:
    return resource.getrusage(who).ru_maxrss / 1024  # KiB on Linux


if __name__ == "__main__":
    main()
