"""Run metrics: `metrics.jsonl` (one JSON object per step), loss-curve PNGs, run overlays.

Each line: {"step" (from 1), "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"}, headed
(`step_header`) by the step and, for the nvfp4 recipe, the GEMM path that step ran ("quantizer":
xla | pallas, "gemm": emulated | native, as `run.json`'s `gemm_backend`: a resumed run may
continue on another machine), plus
"aux_loss" for an MoE model (the routers' load-balancing loss, unweighted; "loss" includes it times
`router_aux_loss_coef`), "kl" for a distillation run (the KL to the teacher; "ce", the next-token
cross-entropy, when `distill_weight` < 1 mixes it in), "eval_loss" on evaluation steps (the
next-token cross-entropy, also for distillation, plus "eval_kl" there) and "skipped": true for a
skipped non-finite step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.records.base import iter_jsonl

METRICS_FILE = "metrics.jsonl"


def step_header(step: int, backend: dict[str, str] | None) -> dict[str, Any]:
    """The first keys of a step's record: "step", then the resolved GEMM backend's "quantizer"
    and "gemm" (`RecipeConfig.backend()`; None for a recipe without one: no keys)."""
    return {"step": step, **(backend or {})}


def append_metrics(run_dir: str | Path, record: dict[str, Any]) -> None:
    with open(Path(run_dir) / METRICS_FILE, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record) + "\n")


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise NVFP4ToolError(f"{run_dir}: no {METRICS_FILE} (not an nvfp4tool training run)")
    records = []
    for number, record in iter_jsonl(path, allow_nan=True):  # a skipped step's loss is NaN
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise NVFP4ToolError(f'{path}:{number}: expected an object with an integer "step"')
        records.append(record)
    return records


def truncate_metrics(run_dir: str | Path, last_step: int) -> None:
    """Drop records after `last_step` (a resumed run rewrites the steps it replays)."""
    path = Path(run_dir) / METRICS_FILE
    if path.is_file():
        kept = [r for r in read_metrics(run_dir) if r["step"] <= last_step]
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))


def plot_runs(run_dirs: list[str | Path], out_png: str | Path, labels: list[str] | None = None) -> dict:
    """Overlay the runs' train (and eval) loss; with 2+ runs, a second panel shows each run's
    relative loss gap to the first. Returns the plotted series (also written as JSON beside it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = labels or [Path(d).name for d in run_dirs]
    series = {}
    for label, run_dir in zip(labels, run_dirs):
        records = read_metrics(run_dir)
        series[label] = {
            "step": [r["step"] for r in records if "loss" in r],
            "loss": [r["loss"] for r in records if "loss" in r],
            "eval_step": [r["step"] for r in records if "eval_loss" in r],
            "eval_loss": [r["eval_loss"] for r in records if "eval_loss" in r],
        }
    panels = 2 if len(run_dirs) > 1 else 1
    fig, axes = plt.subplots(panels, 1, figsize=(8, 4 * panels), squeeze=False)
    ax = axes[0][0]
    for label, s in series.items():
        (line,) = ax.plot(s["step"], s["loss"], label=f"{label} train", linewidth=1)
        if s["eval_step"]:
            ax.plot(s["eval_step"], s["eval_loss"], "o--", color=line.get_color(), label=f"{label} eval")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats)")
    ax.legend()
    ax.grid(alpha=0.3)
    if panels == 2:
        base = series[labels[0]]
        base_loss = dict(zip(base["step"], base["loss"]))
        gap_ax = axes[1][0]
        for label in labels[1:]:
            s = series[label]
            steps = [t for t in s["step"] if t in base_loss]
            pairs = zip(s["step"], s["loss"])
            gaps = [100 * (loss - base_loss[t]) / base_loss[t] for t, loss in pairs if t in base_loss]
            s["gap_pct_vs_first"] = gaps
            gap_ax.plot(steps, gaps, label=f"{label} vs {labels[0]}", linewidth=1)
        gap_ax.axhline(0, color="black", linewidth=0.5)
        gap_ax.set_xlabel("step")
        gap_ax.set_ylabel("train loss gap (%)")
        gap_ax.legend()
        gap_ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    Path(out_png).with_suffix(".json").write_text(json.dumps(series))
    return series
