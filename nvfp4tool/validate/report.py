"""The validation record rendered: rich terminal table, validation.md, PNG plots (and the record
itself, `nvfp4tool.records.validation.ValidationRecord`, written as validation.json).

    paths = write_reports(record, export_dir, json_copy="v.json")   # json, md, sqnr + kl PNGs
    print_report(record, console)                                   # the CLI passes its console

validation.md is a Markdown table ready for a model card.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from nvfp4tool.records.base import write_json
from nvfp4tool.records.validation import ValidationRecord

VALIDATION_MD = "validation.md"
SQNR_PNG = "validation_layer_sqnr.png"
KL_PNG = "validation_kl_hist.png"
KEEP_BF16_TXT = "keep_bf16.txt"  # --sensitivity's result, an `export --keep-bf16-file`
# what validate writes (KEEP_BF16_TXT with --sensitivity only; a stale one is removed with --force)
REPORT_FILES = (ValidationRecord.FILE_NAME, VALIDATION_MD, SQNR_PNG, KL_PNG, KEEP_BF16_TXT)
_COLUMNS = (
    ("kl_mean", "KL mean (nats)", "{:.4g}"),
    ("kl_p99", "KL p99 (nats)", "{:.4g}"),
    ("top1", "top-1 agreement", "{:.2%}"),
    ("ppl", "perplexity", "{:.4g}"),
    ("ppl_increase", "ppl increase", "{:+.2%}"),
    ("logit_max_err", "max logit err", "{:.4g}"),
    ("logit_mean_err", "mean logit err", "{:.4g}"),
)


def write_reports(record: ValidationRecord, export_dir: str, json_copy: str | None = None) -> list[str]:
    """Write validation.json/.md and the two PNGs into `export_dir` (+ a JSON copy), and with a
    sensitivity result its keep-BF16 file (a stale one, from an earlier --sensitivity, is removed:
    the caller checked that replacing reports is allowed); their paths."""
    from converters.atomic import write_files
    from nvfp4tool.validate.sensitivity import keep_bf16_file_text

    names = [ValidationRecord.FILE_NAME, VALIDATION_MD, SQNR_PNG, KL_PNG]
    names += [KEEP_BF16_TXT] if record.sensitivity is not None else []

    def write(stage: str) -> None:
        record.write(stage)
        with open(os.path.join(stage, VALIDATION_MD), "w", encoding="utf-8") as f:
            f.write(markdown(record))
        plot(record, stage)
        if record.sensitivity is not None:
            with open(os.path.join(stage, KEEP_BF16_TXT), "w", encoding="utf-8") as f:
                f.write(keep_bf16_file_text(record.sensitivity))

    paths = write_files(export_dir, names, write)
    keep_file = os.path.join(export_dir, KEEP_BF16_TXT)
    if record.sensitivity is None and os.path.isfile(keep_file):
        os.remove(keep_file)
    if json_copy:
        write_json(json_copy, record.to_json())
        paths.append(json_copy)
    return paths


def markdown(record: ValidationRecord) -> str:
    """A model-card section: the metric table vs BF16, generation divergence, worst layers, verdict."""
    labels = record.labels
    reference = record.reference + (f" `{record.reference_export.name}`" if record.reference_export else "")
    if record.reference_calibration:
        reference += f"; its input scales from {record.reference_calibration}"
    lines = [
        "## Validation",
        "",
        f"Measured by `nvfp4tool validate` on {record.data.sequences} sequences x "
        f"{record.data.seq_len} tokens of `{record.data.file.name}` "
        f"against the BF16 source `{record.source.name}` (reference: {reference}).",
        "",
        "| metric (vs BF16) | " + " | ".join(_title(label) for label in labels) + " |",
        "|---|" + "---:|" * len(labels),
    ]
    for key, title, fmt in _COLUMNS:
        lines.append(f"| {title} | " + " | ".join(_fmt(record.models[label].get(key), fmt) for label in labels) + " |")
    lines.append(f"| BF16 perplexity | {_fmt(record.models['bf16']['ppl'], '{:.4g}')} |" + " |" * (len(labels) - 1))
    gen = record.generation
    lines.append(
        f"| first divergence from BF16 (greedy, {gen.tokens} tokens, median of "
        f"{gen.prompts}) | " + " | ".join(_divergence(gen, label) for label in labels) + " |"
    )
    kv = [label for label in labels if label not in record.layer_labels]
    if kv:
        lines += [
            "",
            ", ".join(_title(label) for label in kv) + ": the export served with its FP8 KV cache (keys "
            "after RoPE and values quantized to E4M3 with the stored per-layer scales, as vLLM "
            "caches them); its difference to the plain column is the KV cache's effect.",
        ]
    layer_labels = record.layer_labels
    mixed = any(row.quant is not None for row in record.layers)  # each linear's own format shown
    lines += [
        "",
        "Worst layers (SQNR in dB, BF16 input activations):",
        "",
        "| layer | "
        + ("format | " if mixed else "")
        + " | ".join(f"{_title(label)} weight | {_title(label)} output" for label in layer_labels)
        + " |",
        "|---|" + "---|" * mixed + "---:|" * (2 * len(layer_labels)),
    ]
    for row in record.layers[:8]:
        lines.append(
            f"| `{row.name}` | "
            + (f"{_title(row.quant)} | " if mixed else "")
            + " | ".join(
                f"{_fmt(row.weight_sqnr_db.get(label), '{:.1f}')} | {_fmt(row.output_sqnr_db.get(label), '{:.1f}')}"
                for label in layer_labels
            )
            + " |"
        )
    if record.sensitivity is not None:
        found = record.sensitivity
        lines += [
            "",
            f"Layers to keep in BF16 for a mean KL of {found.kl_target:g} nats "
            f"({'met' if found.met else 'not met'}, "
            f"KL {found.trajectory[-1].kl_mean:.4g}{found.trajectory[-1].size_text()}): "
            + (", ".join(f"`{p}`" for p in found.keep_bf16) or "none"),
        ]
    if record.searched is not None:
        lines += ["", record.searched_line()]
    if gen.skipped:
        lines += ["", f"Greedy generation skipped: {gen.skipped}."]
    if record.resources is not None:
        lines += ["", resources_line(record)]
    lines += ["", verdict(record), ""]
    return "\n".join(lines)


def resources_line(record: ValidationRecord) -> str:
    """How each model ran (held / streamed), the peak memory and the wall time."""
    used = record.resources
    return (
        f"Ran with --offload {used.offload} ("
        + ", ".join(f"{label} {how}" for label, how in used.models.items())
        + f"); peak memory {used.peak_rss_bytes / 1e9:.2f} GB, {used.seconds:.0f} s."
    )


def verdict(record: ValidationRecord) -> str:
    """One line per failed limit (metric, value, limit, by how much), or PASSED."""
    if record.passed:
        return "**PASSED** all thresholds."
    return "**FAILED**: " + "; ".join(
        f"{f.metric} ({f.detail}) = {f.value:.4g}, limit {f.limit:.4g}, off by {f.by:.4g}" for f in record.failures
    )


def print_report(record: ValidationRecord, console) -> None:
    """The terminal tables (rich) and the verdict, on the console the CLI passes in."""
    from rich.table import Table

    from nvfp4tool.tables import print_line, print_table

    labels = record.labels
    table = Table(title=f"{record.export.name} vs BF16 (bf16 ppl {_fmt(record.models['bf16']['ppl'], '{:.4g}')})")
    table.add_column("metric")
    for label in labels:
        table.add_column(_title(label), justify="right")
    for key, title, fmt in _COLUMNS:
        table.add_row(title, *(_fmt(record.models[label].get(key), fmt) for label in labels))
    gen = record.generation
    table.add_row(f"first divergence (of {gen.tokens})", *(_divergence(gen, label) for label in labels))
    print_table(console, table)
    if gen.skipped:
        print_line(console, f"greedy generation skipped: {gen.skipped}")
    if record.resources is not None:
        print_line(console, resources_line(record))
    layers = Table(title="worst layers (SQNR dB)")
    layers.add_column("layer", overflow="fold")
    mixed = any(row.quant is not None for row in record.layers)  # each linear's own format shown
    if mixed:
        layers.add_column("format")
    for label in record.layer_labels:
        layers.add_column(f"{_title(label)} weight", justify="right")
        layers.add_column(f"{_title(label)} output", justify="right")
    for row in record.layers[:8]:
        layers.add_row(
            row.name,
            *([_title(row.quant)] if mixed else []),
            *(
                _fmt(sqnr.get(label), "{:.1f}")
                for label in record.layer_labels
                for sqnr in (row.weight_sqnr_db, row.output_sqnr_db)
            ),
        )
    print_table(console, layers)
    if record.sensitivity is not None:
        print_table(console, _sensitivity_table(record.sensitivity))
    if record.searched is not None:
        print_line(console, record.searched_line().replace("`", ""))
    print_line(console, verdict(record).replace("**", ""))


def _sensitivity_table(found) -> Any:
    """--sensitivity: each unit's harm (mean KL with only it quantized), most harmful first,
    whether the search kept it in BF16, and the model's KL after the step that kept it (a step may
    keep several)."""
    from rich.table import Table

    first, last = found.trajectory[0], found.trajectory[-1]
    keeps = [step for step in found.trajectory if step.step == "keep"]
    after = {g: step.kl_mean for step in reversed(keeps) for g in step.kept}  # the first step keeping g
    pruned = {g for step in found.trajectory if step.step == "prune" for g in after if g not in step.kept}
    table = Table(
        title=f"sensitivity (KL target {found.kl_target:g}: {'met' if found.met else 'NOT met'}; "
        f"KL {first.kl_mean:.4g}{first.size_text()} with every group quantized, "
        f"{last.kl_mean:.4g}{last.size_text()} as kept)"
    )
    for column in ("group", "KL alone", "kept in BF16", "KL after keeping it"):
        table.add_column(column, justify="left" if column == "group" else "right")
    for harm in found.harm:
        state = "yes" if harm.group in last.kept else "pruned" if harm.group in pruned else "no"
        table.add_row(
            harm.group, f"{harm.kl_mean_alone:.4g}", state, f"{after[harm.group]:.4g}" if harm.group in after else "-"
        )
    return table


def plot(record: ValidationRecord, folder: str) -> list[str]:
    """Per-layer SQNR bars and the per-token KL histogram as PNGs in `folder`; their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = record.layer_labels
    rows = record.layers
    fig, ax = plt.subplots(figsize=(max(6.0, 0.3 * len(rows)), 4))
    width = 0.8 / max(len(labels), 1)
    for i, label in enumerate(labels):
        values = [_finite(r.output_sqnr_db.get(label)) for r in rows]
        ax.bar(np.arange(len(rows)) + i * width, values, width, label=f"{_title(label)} output")
    ax.set_xticks(np.arange(len(rows)) + 0.4 - width / 2, [r.name for r in rows], rotation=90, fontsize=6)
    ax.set_ylabel("output SQNR (dB)")
    ax.set_title("per-layer output SQNR, worst first")
    ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    sqnr_path = os.path.join(folder, SQNR_PNG)
    fig.savefig(sqnr_path, dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, hist in record.kl_histogram.items():
        ax.stairs(hist.counts, hist.edges, label=_title(label))
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


def _title(label: str) -> str:
    return label.upper().replace("-WEIGHT-ONLY", " W4A16")


def _fmt(value: float | None, fmt: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return fmt.format(value)


def _divergence(gen, label: str) -> str:
    positions, tokens = gen.first_divergence.get(label), gen.tokens
    if positions is None:
        return "skipped" if gen.skipped else "-"
    filled = [tokens if p is None else p for p in positions]
    median = float(np.median(filled))
    text = "never" if median >= tokens else f"{median:.0f}"
    return f"{text} ({', '.join('-' if p is None else str(p) for p in positions)})"


def _finite(value: float | None) -> float:
    """A bar height: missing or NaN as 0, infinite (identical weights) as 99 dB."""
    if value is None or math.isnan(value):
        return 0.0
    return 99.0 if math.isinf(value) else value
