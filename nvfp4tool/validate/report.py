"""The validation record rendered: rich terminal table, validation.json, validation.md, PNG plots.

    paths = write_reports(record, export_dir, json_copy="v.json")   # json, md, sqnr + kl PNGs
    print_report(record, Console())

validation.json is the record (per-token KL values only as the histogram); validation.md is a
Markdown table ready for a model card.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np

VALIDATION_JSON = "validation.json"
VALIDATION_MD = "validation.md"
SQNR_PNG = "validation_layer_sqnr.png"
KL_PNG = "validation_kl_hist.png"
_KL_BINS = 40
_COLUMNS = (("kl_mean", "KL mean (nats)", "{:.4g}"), ("kl_p99", "KL p99 (nats)", "{:.4g}"),
            ("top1", "top-1 agreement", "{:.2%}"), ("ppl", "perplexity", "{:.4g}"),
            ("ppl_increase", "ppl increase", "{:+.2%}"), ("logit_max_err", "max logit err", "{:.4g}"),
            ("logit_mean_err", "mean logit err", "{:.4g}"))


def write_reports(record: dict[str, Any], export_dir: str, json_copy: str | None = None) -> list[str]:
    """Write validation.json/.md and the two PNGs into `export_dir` (+ a JSON copy); their paths."""
    saved = json_record(record)
    text = json.dumps(_strict_json(saved), indent=1, default=_json_default, allow_nan=False)
    paths = [os.path.join(export_dir, VALIDATION_JSON), os.path.join(export_dir, VALIDATION_MD)]
    with open(paths[0], "w", encoding="utf-8") as f:
        f.write(text)
    with open(paths[1], "w", encoding="utf-8") as f:
        f.write(markdown(record))
    if json_copy:
        with open(json_copy, "w", encoding="utf-8") as f:
            f.write(text)
        paths.append(json_copy)
    paths += plot(record, export_dir)
    return paths


def json_record(record: dict[str, Any]) -> dict[str, Any]:
    """The record as saved: per-token KL replaced by a histogram (counts over log-spaced bins)."""
    saved = {k: v for k, v in record.items() if k != "kl_tokens"}
    top = _kl_top(record)
    saved["kl_histogram"] = {label: _histogram(np.asarray(v), top) for label, v in record["kl_tokens"].items()}
    return saved


def markdown(record: dict[str, Any]) -> str:
    """A model-card section: the metric table vs BF16, generation divergence, worst layers, verdict."""
    labels = [k for k in record["models"] if k != "bf16"]
    lines = ["## Validation", "",
             f"Measured by `nvfp4tool validate` on {record['data']['sequences']} sequences x "
             f"{record['data']['seq_len']} tokens of `{os.path.basename(record['data']['path'])}` "
             f"against the BF16 source (reference: {record['reference']}).", "",
             "| metric (vs BF16) | " + " | ".join(_title(l) for l in labels) + " |",
             "|---|" + "---:|" * len(labels)]
    for key, title, fmt in _COLUMNS:
        lines.append(f"| {title} | " + " | ".join(_fmt(record["models"][l].get(key), fmt) for l in labels) + " |")
    lines.append(f"| BF16 perplexity | {record['models']['bf16']['ppl']:.4g} |" + " |" * (len(labels) - 1))
    gen = record["generation"]
    lines.append(f"| first divergence from BF16 (greedy, {gen['tokens']} tokens, median of "
                 f"{gen['prompts']}) | " + " | ".join(_divergence(gen.get(f"{l}_first_divergence"), gen["tokens"])
                                                      for l in labels) + " |")
    lines += ["", "Worst layers (SQNR in dB, BF16 input activations):", "",
              "| layer | " + " | ".join(f"{_title(l)} weight | {_title(l)} output" for l in labels) + " |",
              "|---|" + "---:|" * (2 * len(labels))]
    for row in record["layers"][:8]:
        lines.append(f"| `{row['name']}` | " + " | ".join(
            f"{_fmt(row.get(f'{l}_weight_sqnr_db'), '{:.1f}')} | {_fmt(row.get(f'{l}_output_sqnr_db'), '{:.1f}')}"
            for l in labels) + " |")
    if "sensitivity" in record:
        found = record["sensitivity"]
        lines += ["", f"Layers to keep in BF16 for a mean KL of {found['kl_target']:g} nats "
                      f"({'met' if found['met'] else 'not met'}, "
                      f"KL {found['trajectory'][-1]['kl_mean']:.4g}): "
                      + (", ".join(f"`{p}`" for p in found["keep_bf16"]) or "none")]
    lines += ["", verdict(record), ""]
    return "\n".join(lines)


def verdict(record: dict[str, Any]) -> str:
    """One line per failed limit (metric, value, limit, by how much), or PASSED."""
    if record["passed"]:
        return "**PASSED** all thresholds."
    return "**FAILED**: " + "; ".join(
        f"{f['metric']} ({f['detail']}) = {f['value']:.4g}, limit {f['limit']:.4g}, off by {f['by']:.4g}"
        for f in record["failures"])


def print_report(record: dict[str, Any], console) -> None:
    """The terminal tables (rich) and the verdict."""
    from rich.table import Table

    labels = [k for k in record["models"] if k != "bf16"]
    table = Table(title=f"{record['export']} vs BF16 (bf16 ppl {record['models']['bf16']['ppl']:.4g})")
    table.add_column("metric")
    for label in labels:
        table.add_column(_title(label), justify="right")
    for key, title, fmt in _COLUMNS:
        table.add_row(title, *(_fmt(record["models"][l].get(key), fmt) for l in labels))
    gen = record["generation"]
    table.add_row(f"first divergence (of {gen['tokens']})",
                  *(_divergence(gen.get(f"{l}_first_divergence"), gen["tokens"]) for l in labels))
    console.print(table)
    layers = Table(title="worst layers (SQNR dB)")
    layers.add_column("layer", overflow="fold")
    for label in labels:
        layers.add_column(f"{_title(label)} weight", justify="right")
        layers.add_column(f"{_title(label)} output", justify="right")
    for row in record["layers"][:8]:
        layers.add_row(row["name"], *(_fmt(row.get(f"{l}_{k}_sqnr_db"), "{:.1f}")
                                      for l in labels for k in ("weight", "output")))
    console.print(layers)
    console.print(verdict(record).replace("**", ""))


def plot(record: dict[str, Any], folder: str) -> list[str]:
    """Per-layer SQNR bars and the per-token KL histogram as PNGs in `folder`; their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [k for k in record["models"] if k != "bf16"]
    rows = record["layers"]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.3 * len(rows)), 4))
    width = 0.8 / max(len(labels), 1)
    for i, label in enumerate(labels):
        values = [_finite(r.get(f"{label}_output_sqnr_db")) for r in rows]
        ax.bar(np.arange(len(rows)) + i * width, values, width, label=f"{_title(label)} output")
    ax.set_xticks(np.arange(len(rows)) + 0.4 - width / 2, [r["name"] for r in rows], rotation=90, fontsize=6)
    ax.set_ylabel("output SQNR (dB)")
    ax.set_title("per-layer output SQNR, worst first")
    ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    sqnr_path = os.path.join(folder, SQNR_PNG)
    fig.savefig(sqnr_path, dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    top = _kl_top(record)
    for label, values in record["kl_tokens"].items():
        hist = _histogram(np.asarray(values), top)
        ax.stairs(hist["counts"], hist["edges"], label=_title(label))
    ax.set_xscale("log")
    ax.set_xlabel("per-token KL to BF16 (nats)")
    ax.set_ylabel("tokens")
    ax.legend()
    fig.tight_layout()
    kl_path = os.path.join(folder, KL_PNG)
    fig.savefig(kl_path, dpi=100)
    plt.close(fig)
    return [sqnr_path, kl_path]


# ------------------------------------------------------------------------------------------
# helpers


def _kl_top(record: dict[str, Any]) -> float:
    """Upper edge shared by every model's KL histogram (so their bins line up)."""
    values = [max(v) for v in record["kl_tokens"].values() if len(v)]
    return max([1e-7, *values]) * 1.0001


def _histogram(values: np.ndarray, top: float) -> dict[str, list]:
    """Counts of KL values over log-spaced bins from 1e-8 nats to `top` (values below go into the first)."""
    edges = np.geomspace(1e-8, top, _KL_BINS + 1)
    counts, _ = np.histogram(np.clip(values, edges[0], edges[-1]), bins=edges)
    return {"edges": edges.tolist(), "counts": counts.tolist()}


def _title(label: str) -> str:
    return label.upper().replace("-WEIGHT-ONLY", " W4A16")


def _fmt(value: float | None, fmt: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return fmt.format(value)


def _divergence(positions: list[int | None] | None, tokens: int) -> str:
    if positions is None:
        return "-"
    filled = [tokens if p is None else p for p in positions]
    median = float(np.median(filled))
    text = "never" if median >= tokens else f"{median:.0f}"
    return f"{text} ({', '.join('-' if p is None else str(p) for p in positions)})"


def _finite(value: float | None) -> float:
    return 0.0 if value is None else (99.0 if math.isinf(value) else value)


def _strict_json(value: Any) -> Any:
    """Non-finite floats as the strings "inf" / "-inf" / "nan" (strict JSON has no Infinity)."""
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(v) for v in value]
    if isinstance(value, (float, np.floating)) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def _json_default(value: Any) -> Any:
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    raise TypeError(f"not JSON-able: {type(value)}")
