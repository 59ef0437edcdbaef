"""`nvfp4tool quickstart`: the whole pipeline on the embedded tiny model and corpus.

    pretrain (BF16) -> fine-tune (NVFP4 recipe) -> export NVFP4 (compressed-tensors, W4A4)
    -> export FP8 (ModelOpt W8A8, the reference) -> validate NVFP4 against FP8 and BF16
    -> task accuracy (the shipped lm-eval tasks, paired; skipped without lm-eval) -> check
    -> push --dry-run (model card with both tables, no upload)

Every stage is the library call its CLI command makes; each prints its result and where its files
are, and the figures are collected in `<out>/quickstart.json` (with the machine it ran on, the date,
the wall time and the peak RSS: `scripts/quickstart_table.py` turns that file into the README's table).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import resource
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nvfp4tool import progress
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.records.validation import ValidationRecord


@dataclasses.dataclass(frozen=True)
class QuickstartOptions:
    """Sizes of the quickstart (defaults: about two minutes on an idle 2-core CPU).

    Validation and eval run each model (BF16, FP8, NVFP4) with the same shapes, so each model's
    forward and greedy generation is compiled once, in validation, and eval reuses the programs:
    eval runs its requests in batches of `eval_batch_size` rows padded to a power-of-two length
    (the shipped tasks' prompts are 45-57 tokens with the quickstart's tokenizer: 64 =
    `prompt_len` = `seq_len`) and nvfp4tool_gsm generates up to 24 tokens (`gen_tokens`);
    validation runs `val_samples` x `seq_len` tokens in batches of `eval_batch_size` and as many
    prompts of `prompt_len` tokens. Other sizes work too (then each stage compiles its own)."""

    out: str = "nvfp4tool-quickstart"
    pretrain_steps: int = 150
    finetune_steps: int = 100
    seq_len: int = 64
    batch_size: int = 16
    vocab_size: int = 512
    eval_batch_size: int = 8  # rows per forward / prompts per generation, in validation and eval
    val_samples: int = 32  # held-out sequences of seq_len tokens validation compares the models on
    prompt_len: int = 64  # validation's greedy-generation prompts: the first prompt_len tokens
    gen_tokens: int = 24  # greedy continuation length compared in validation
    eval_tasks: tuple[str, ...] = ("nvfp4tool_mc_letter", "nvfp4tool_gsm")  # the shipped offline tasks
    eval_limit: int | None = None  # items per task (None: all: 40 multiple-choice, 24 generative)
    seed: int = 0
    force: bool = False


def run_quickstart(options: QuickstartOptions, echo: Callable[[str], None] = progress.info) -> dict[str, Any]:
    """Run every stage; return (and write to `<out>/quickstart.json`) the figures of each."""
    from nvfp4tool.check import check_checkpoint
    from nvfp4tool.corpus.sources import embedded_corpus
    from nvfp4tool.export import ExportOptions, export_checkpoint
    from nvfp4tool.hub.upload import PushOptions, push_checkpoint
    from nvfp4tool.run.config import TrainConfig
    from nvfp4tool.train.trainer import train
    from nvfp4tool.validate.runner import ValidateOptions, validate_export

    started = time.perf_counter()
    out = _prepare(Path(options.out), options.force)
    train_txt, val_txt = embedded_corpus()
    figures: dict[str, Any] = {}
    machine = machine_description()
    echo(f"machine: {machine['cpu']}, {machine['cores']} cores, {machine['platform']}; {machine['date']}")
    common = dict(
        data=str(train_txt),
        eval_data=str(val_txt),
        seq_len=options.seq_len,
        batch_size=options.batch_size,
        seed=options.seed,
        eval_batches=8,
        force=True,
    )

    with _stage(echo, "1/8 pretrain a tiny Llama in BF16", figures, "pretrain") as record:
        result = train(
            TrainConfig(
                model="tiny",
                tokenizer="train",
                vocab_size=options.vocab_size,
                recipe="bf16",
                steps=options.pretrain_steps,
                lr=3e-3,
                warmup_steps=20,
                eval_every=max(1, options.pretrain_steps // 3),
                out=str(out / "pretrain-bf16"),
                **common,
            )
        )
        record.update(_train_figures(result))
        echo(f"  {train_line(record)}; run in {record['run']}")

    with _stage(echo, "2/8 fine-tune with the NVFP4 recipe", figures, "finetune") as record:
        result = train(
            TrainConfig(
                model=str(out / "pretrain-bf16" / "hf"),
                recipe="nvfp4",
                steps=options.finetune_steps,
                lr=1e-3,
                warmup_steps=10,
                eval_every=max(1, options.finetune_steps // 2),
                out=str(out / "finetune-nvfp4"),
                **common,
            )
        )
        record.update(_train_figures(result))
        echo(f"  {train_line(record)}; run in {record['run']}")

    run_dir = out / "finetune-nvfp4"
    nvfp4_dir, fp8_dir = out / "export-nvfp4", out / "export-fp8"
    with _stage(echo, "3/8 export NVFP4 (compressed-tensors, W4A4)", figures, "export_nvfp4") as record:
        summary = export_checkpoint(
            str(run_dir),
            str(nvfp4_dir),
            ExportOptions(format="compressed-tensors", quant="nvfp4", force=True, show_progress=False),
        )
        record.update(
            out=str(nvfp4_dir), quantized_modules=summary.quantized_modules, bytes_written=summary.bytes_written
        )
        echo("  " + summary.line())

    with _stage(echo, "4/8 export FP8 (ModelOpt W8A8), the reference", figures, "export_fp8") as record:
        summary = export_checkpoint(
            str(run_dir), str(fp8_dir), ExportOptions(format="modelopt", quant="fp8", force=True, show_progress=False)
        )
        record.update(
            out=str(fp8_dir), quantized_modules=summary.quantized_modules, bytes_written=summary.bytes_written
        )
        echo("  " + summary.line())

    with _stage(echo, "5/8 validate NVFP4 against FP8 and BF16", figures, "validate") as record:
        run = validate_export(
            str(nvfp4_dir),
            ValidateOptions(
                data=str(val_txt),
                reference=str(fp8_dir),
                seq_len=options.seq_len,
                samples=options.val_samples,
                batch_size=options.eval_batch_size,
                prompts=options.eval_batch_size,
                prompt_len=options.prompt_len,
                gen_tokens=options.gen_tokens,
            ),
        )
        validation = run.record
        record.update(
            passed=validation.passed,
            sequences=validation.data.sequences,
            seq_len=validation.data.seq_len,
            metrics=_validation_figures(validation),
            files=run.files,
        )
        echo(f"  on {record['sequences']} x {record['seq_len']} tokens of held-out text:")
        for model, metrics in record["metrics"].items():
            echo("  " + model_line(model, metrics))
        echo(f"  {'PASSED' if validation.passed else 'FAILED'}; report in {nvfp4_dir / 'validation.md'}")
        if not validation.passed:
            raise NVFP4ToolError(
                f"{nvfp4_dir}: validation failed: " + "; ".join(f"{f.metric} ({f.detail})" for f in validation.failures)
            )

    with _stage(
        echo, "6/8 task accuracy: lm-eval tasks on BF16, FP8 and NVFP4, paired item by item", figures, "eval"
    ) as record:
        record.update(_eval_stage(nvfp4_dir, fp8_dir, options))
        for line in eval_lines(record):
            echo("  " + line)

    with _stage(echo, "7/8 check the export", figures, "check") as record:
        report = check_checkpoint(str(nvfp4_dir), tp=(1, 2))
        record.update(
            ok=report.ok,
            problems=[p.line() for p in report.problems],
            modules=len(report.modules),
            tensors=report.tensors_checked,
            tp=list(report.tp),
        )
        echo("  " + report.summary_line())
        if not report.ok:
            raise NVFP4ToolError(f"{nvfp4_dir}: check failed: {record['problems']}")

    with _stage(echo, "8/8 push --dry-run (model card, nothing uploaded)", figures, "push") as record:
        lines: list[str] = []
        result = push_checkpoint(
            nvfp4_dir,
            PushOptions(repo_id="your-org/nvfp4tool-quickstart-nvfp4", dry_run=True),
            echo=lines.append,
            warn=lines.append,  # its placeholder repo has no base_model or license to warn about
        )
        card_path = out / "MODEL_CARD.md"
        card_path.write_text(str(result.card))
        record.update(files=len(result.files), card=str(card_path))
        echo(f"  {len(result.files)} files would be uploaded; model card written to {card_path}")

    machine["wall_seconds"] = round(time.perf_counter() - started, 1)
    machine["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, 2)  # KiB on Linux
    if hasattr(os, "getloadavg"):
        machine["load_average"] = round(os.getloadavg()[0], 2)  # the machine's 1-minute load: figures vary with it
    figures["machine"] = machine
    (out / "quickstart.json").write_text(json.dumps(figures, indent=1, default=str))
    load = f", load average {machine['load_average']:.1f}" if "load_average" in machine else ""
    echo(
        f"\nall stages passed in {machine['wall_seconds']:.0f} s wall (peak RSS {machine['peak_rss_gb']:.2f} GB"
        f"{load}); figures in {out / 'quickstart.json'}"
    )
    return figures


def machine_description() -> dict[str, Any]:
    """The machine the figures come from: CPU model, usable cores, JAX platform, date (UTC)."""
    import jax

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), cpu)
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": cpu,
        "cores": cores,
        "platform": jax.default_backend(),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }


# ------------------------------------------------------------------------------------------
# helpers


def _prepare(out: Path, force: bool) -> Path:
    if out.exists() and any(out.iterdir()):
        if not force:
            raise NVFP4ToolError(f"{out}: already exists (pass --force to replace it)")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    return out


class _stage:
    """Prints the stage's title, times it, and records its figures under `figures[key]`."""

    def __init__(self, echo, title: str, figures: dict, key: str) -> None:
        self.echo, self.title, self.figures, self.key = echo, title, figures, key

    def __enter__(self) -> dict:
        self.echo(f"\n== {self.title}")
        self.start = time.perf_counter()
        self.figures[self.key] = {}
        return self.figures[self.key]

    def __exit__(self, *exc) -> bool:
        self.figures[self.key]["seconds"] = round(time.perf_counter() - self.start, 1)
        return False


def train_line(record: dict[str, Any]) -> str:
    """A training stage's figures as the quickstart prints them (and the README table shows them)."""
    return (
        f"{record['steps']} steps: loss {record['first_loss']:.3f} -> {record['final_loss']:.3f}, "
        f"eval {record['eval_loss']:.3f}; {record['tokens_per_s']:,.0f} tokens/s (compilation and evaluation "
        f"included)"
    )


def model_line(name: str, metrics: dict[str, Any]) -> str:
    """One validated model's figures vs BF16 as the quickstart prints them (and the README table)."""
    label = name.upper()
    if set(metrics) == {"ppl"}:
        return f"{label}: perplexity {metrics['ppl']:.2f}"
    return (
        f"{label}: KL mean {metrics['kl_mean']:.2g}, p99 {metrics['kl_p99']:.2g}, "
        f"top-1 {100 * metrics['top1']:.1f}%, perplexity {metrics['ppl']:.2f} "
        f"({100 * metrics['ppl_increase']:+.2f}%)"
    )


def _eval_stage(nvfp4_dir: Path, fp8_dir: Path, options: QuickstartOptions) -> dict[str, Any]:
    """`nvfp4tool eval` of the export against its source and the FP8 reference on the shipped tasks
    (the figures: per task the metric, n, each model's score and the paired differences), or the
    reason it was skipped (lm-eval, the `eval` extra, not installed)."""
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        return {"skipped": "lm-eval is not installed (pip install 'nvfp4tool[eval]')"}
    from nvfp4tool.eval.evaluate import EvalOptions, evaluate_export

    run = evaluate_export(
        str(nvfp4_dir),
        EvalOptions(
            tasks=options.eval_tasks,
            reference=str(fp8_dir),
            limit=options.eval_limit,
            seed=options.seed,
            batch_size=options.eval_batch_size,
            max_length=4 * options.seq_len,
        ),
    )
    record = run.record
    keep = ("diff", "ci95", "mcnemar_p", "right_to_wrong", "wrong_to_right")
    return {
        "tasks": {
            task: {
                "metric": entry["metric"],
                "n": entry[record.labels[0]]["n"],
                **{label: entry[label][entry["metric"]] for label in record.labels},
                "paired": {pair: {k: stats[k] for k in keep} for pair, stats in entry["paired"].items()},
            }
            for task, entry in record.tasks.items()
            if entry["metric"] is not None
        },
        "items_per_s": record.resources["items_per_s"],
        "seconds": record.resources["seconds"],
        "files": run.files,
    }


def eval_lines(record: dict[str, Any]) -> list[str]:
    """The task-accuracy stage's figures as the quickstart prints them (and the README table shows
    them): per task each model's score and NVFP4 - BF16 / NVFP4 - FP8 paired, in points."""
    if "skipped" in record:
        return [f"skipped: {record['skipped']}"]
    lines = []
    for task, entry in record["tasks"].items():
        scores = ", ".join(f"{label.upper()} {100 * entry[label]:.1f}%" for label in ("bf16", "fp8", "nvfp4"))
        pairs = []
        for pair, stats in entry["paired"].items():
            low, high = stats["ci95"] or (stats["diff"], stats["diff"])
            pairs.append(
                f"{pair.upper().replace('-', ' - ')} {100 * stats['diff']:+.1f} points "
                f"[{100 * low:+.1f}, {100 * high:+.1f}], flips {stats['right_to_wrong']}/"
                f"{stats['wrong_to_right']}, McNemar p {stats['mcnemar_p']:.2g}"
            )
        lines.append(f"{task} ({entry['metric']}, {entry['n']} items): {scores}; " + "; ".join(pairs))
    return lines


def _train_figures(result) -> dict[str, Any]:
    last = max(result.losses)
    return {
        "steps": result.final_step,
        "first_loss": result.losses[min(result.losses)],
        "final_loss": result.losses[last],
        "eval_loss": result.eval_losses[last],
        "tokens_per_s": result.tokens_per_s,
        "run": str(result.out),
    }


def _validation_figures(validation: ValidationRecord) -> dict[str, dict[str, Any]]:
    """The headline metric of each compared model (whatever the record holds of them)."""
    keys = ("kl_mean", "kl_p99", "top1", "ppl", "ppl_increase")
    return {name: {k: m[k] for k in keys if k in m} for name, m in validation.models.items()}
