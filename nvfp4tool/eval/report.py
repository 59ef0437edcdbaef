"""The eval record rendered: the terminal table, eval.md (the model-card table), eval.png (paired
differences with their 95% intervals per task), and the files written (eval.json, eval_items.json).

    paths = write_reports(record, items, export_dir, json_copy="e.json")
    print_report(record, console)

Every file is written into a temporary sibling folder of the export first and renamed in once all
of them are complete (`converters.atomic.write_files`, validate's writer too): a killed eval leaves
no temporary file inside the export, and the next run removes the sibling.
"""

from __future__ import annotations

import os
from typing import Any

from nvfp4tool.formats import quant_title
from nvfp4tool.records.base import write_json
from nvfp4tool.records.evaluation import EVAL_MD, EVAL_PNG, EvalItems, EvalRecord

_TITLES = {"bf16": "BF16", "fp8": "FP8"}  # the reference models; the export's column: `_title`


def _title(record: EvalRecord, label: str) -> str:
    """A model's column title: the export ("nvfp4", the candidate's label) by its quant ("NVFP4",
    "NVFP4 W4A16", "Mixed (NVFP4/FP8/BF16)": `formats.quant_title`), the references by name."""
    if label == "nvfp4":
        return record.quant_title or quant_title(record.quant)
    return _TITLES.get(label, label)


def write_reports(record: EvalRecord, items: EvalItems, export_dir: str, json_copy: str | None = None) -> list[str]:
    """eval.json, eval_items.json, eval.md and eval.png into `export_dir` (+ a JSON copy) through the
    one report writer (`converters.atomic.write_files`); their paths."""
    from converters.atomic import write_files

    def write(stage: str) -> None:
        write_json(EvalRecord.path(stage), record.to_json())
        write_json(EvalItems.path(stage), items.to_json(), indent=None)
        with open(os.path.join(stage, EVAL_MD), "w", encoding="utf-8") as f:
            f.write(markdown(record))
        plot(record, os.path.join(stage, EVAL_PNG))

    names = [EvalRecord.FILE_NAME, EvalItems.FILE_NAME, EVAL_MD, EVAL_PNG]
    paths = write_files(export_dir, names, write)
    if json_copy:
        write_json(json_copy, record.to_json())
        paths.append(json_copy)
    return paths


def _pct(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{100 * value:+.2f}" if signed else f"{100 * value:.2f}"


def rows(record: EvalRecord) -> tuple[list[str], list[list[str]]]:
    """The table's header and rows: one per task (and `overall`), scores in percent."""
    labels = record.labels
    header = ["task", "metric", "n"] + [f"{_title(record, label)} (± se)" for label in labels]
    pairs = [f"nvfp4-{label}" for label in labels[:-1]]
    for label in labels[:-1]:
        header += [
            f"{_title(record, 'nvfp4')} - {_title(record, label)} [95% CI]",
            "McNemar p",
            "flips r->w / w->r",
            "min detectable",
        ]
    out = []
    entries = list(record.tasks.items()) + (
        [("overall", record.overall)] if len([t for t in record.tasks.values() if t["paired"]]) > 1 else []
    )
    for task, entry in entries:
        metric = entry.get("metric", "score") if task != "overall" else "pooled"
        key = metric if task != "overall" else "score"
        first = entry.get(labels[0], {})
        row = [task, str(metric), str(first.get("n", ""))]
        for label in labels:
            model = entry.get(label, {})
            if key in model:
                row.append(f"{_pct(model[key])} ± {_pct(model.get('stderr'))}")
            else:  # no per-item scores: lm-eval's aggregates
                row.append(", ".join(f"{k} {v:.4g}" for k, v in model.items() if k != "n") or "-")
        for pair in pairs:
            stats = entry["paired"].get(pair)
            if stats is None:
                row += ["-", "-", "-", "-"]
                continue
            ci = stats["ci95"]
            row += [
                f"{_pct(stats['diff'], True)} [{_pct(ci[0], True)}, {_pct(ci[1], True)}]"
                if ci
                else _pct(stats["diff"], True),
                f"{stats['mcnemar_p']:.3g}",
                f"{stats['right_to_wrong']} / {stats['wrong_to_right']} ({100 * stats['flip_rate']:.1f}%)",
                _pct(stats["min_detectable"]),
            ]
        out.append(row)
    return header, out


def markdown(record: EvalRecord) -> str:
    """The model-card section: what ran, the paired table (points), degeneration signs, the verdict."""
    header, body = rows(record)
    reference = f"the FP8 reference `{record.reference.name}`" if record.reference else "no FP8 reference"
    limit = f"the first {record.limit} items of each task" if record.limit else "every item of each task"
    lines = [
        "## Task accuracy",
        "",
        f"Measured by `nvfp4tool eval` (lm-evaluation-harness {record.lm_eval_version}) on {limit}: the BF16 "
        f"source `{record.source.name}`, {reference} and this {record.quant} export as served, on the same "
        "items. Scores in percent; differences are paired (the same items), with the paired standard "
        "error's 95% interval, McNemar's exact p and the flips between the models"
        + (" (prompts in the tokenizer's chat template)." if record.chat_template else ".")
        + (
            f" Sampled tasks ({', '.join(record.sampled_tasks)}): {record.samples} generations per item, each "
            "item's score their mean."
            if record.samples > 1 and record.sampled_tasks
            else ""
        ),
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    generative = [(t, e) for t, e in record.tasks.items() if "mean_output_tokens" in e.get(record.labels[0], {})]
    if generative:
        lines += [
            "",
            "Generation (degeneration signs): mean output tokens, share hitting max_gen_toks, repeated 4-gram rate.",
            "",
            "| task | " + " | ".join(_title(record, x) for x in record.labels) + " |",
            "|" + "---|" * (len(record.labels) + 1),
        ]
        for task, entry in generative:
            cells = [
                f"{entry[x]['mean_output_tokens']:.1f} tok, {100 * entry[x]['hit_max_gen_toks']:.0f}% max, "
                f"{100 * entry[x]['repeated_4gram_rate']:.1f}% rep"
                for x in record.labels
            ]
            lines.append(f"| {task} | " + " | ".join(cells) + " |")
    verdict = (
        ("PASSED" if record.passed else "FAILED: " + "; ".join(record.failures))
        if _judged(record)
        else "no --max-drop threshold set"
    )
    lines += ["", f"Verdict: {verdict}.", ""]
    return "\n".join(lines)


def plot(record: EvalRecord, path: str) -> None:
    """Paired differences (points) with 95% intervals, per task and pair, as a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = [(t, e) for t, e in record.tasks.items() if e["paired"]]
    if len([1 for _ in entries]) > 1:
        entries.append(("overall", record.overall))
    pairs = [f"nvfp4-{label}" for label in record.labels[:-1]]
    fig, ax = plt.subplots(figsize=(6, 1.2 + 0.5 * max(1, len(entries)) * max(1, len(pairs))))
    y = 0
    ticks, names = [], []
    for task, entry in entries:
        for k, pair in enumerate(pairs):
            stats = entry["paired"].get(pair)
            if stats is None:
                continue
            ci = stats["ci95"] or [stats["diff"], stats["diff"]]
            spread = [[100 * (stats["diff"] - ci[0])], [100 * (ci[1] - stats["diff"])]]
            ax.errorbar(
                [100 * stats["diff"]],
                [y],
                xerr=spread,
                fmt="o",
                capsize=4,
                color=f"C{k}",
                label=pair if task == entries[0][0] else None,
            )
            ticks.append(y)
            names.append(f"{task} ({pair})")
            y += 1
    ax.axvline(0, color="gray", lw=0.8)
    for k, (limit, name) in enumerate(
        ((record.max_drop, "-max drop (BF16)"), (record.max_drop_fp8, "-max drop (FP8)"))
    ):
        if limit is not None:
            ax.axvline(-100 * limit, color="red", lw=0.8, ls="--" if k == 0 else ":", label=name)
    ax.set_yticks(ticks, names, fontsize=7)
    ax.set_xlabel("paired difference (points), 95% interval")
    if ticks:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")
    plt.close(fig)


def sections(record: EvalRecord) -> list[tuple[str, list[str], list[list[str]]]]:
    """`rows` split for a log: the scores (task, metric, n, each model) and one table per pair
    (task and its paired columns), so that each fits 120 columns; every cell of `rows` in one of them."""
    header, body = rows(record)
    models = 3 + len(record.labels)
    out = [("task accuracy (percent)", header[:models], [row[:models] for row in body])]
    for k, label in enumerate(record.labels[:-1]):
        cols = slice(models + 4 * k, models + 4 * (k + 1))
        title = f"{_title(record, 'nvfp4')} - {_title(record, label)}, paired differences (points)"
        out.append((title, [header[0]] + header[cols], [[row[0]] + row[cols] for row in body]))
    return out


def print_report(record: EvalRecord, console: Any) -> None:
    """The scores table and one paired table per reference on the terminal (whole when piped,
    `tables.print_table`; each fits 120 columns, `sections`)."""
    from rich.table import Table

    from nvfp4tool.tables import print_line, print_table

    for title, header, body in sections(record):
        table = Table(title=title)
        for name in header:
            table.add_column(name)
        for row in body:
            table.add_row(*row)
        print_table(console, table)
    if _judged(record):
        print_line(console, "eval: PASSED" if record.passed else "eval: FAILED: " + "; ".join(record.failures))


def _judged(record: EvalRecord) -> bool:
    """A threshold was set (--max-drop / --max-drop-fp8): the record carries a verdict."""
    return record.max_drop is not None or record.max_drop_fp8 is not None
