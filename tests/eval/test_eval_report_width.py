"""eval's results table in a log (issue 42): 2 tasks x 3 models with long task names fit 120 columns
and the printed tables still hold every figure of the record's rows."""

from __future__ import annotations

import io

import numpy as np


def _record():
    from nvfp4tool.eval.evaluate import _paired_dict
    from nvfp4tool.eval.paired import mean_stderr, paired
    from nvfp4tool.records.evaluation import EvalRecord
    from nvfp4tool.records.validation import Named

    rng = np.random.default_rng(0)
    labels = ["bf16", "fp8", "nvfp4"]
    tasks, pooled = {}, {label: [] for label in labels}
    for task in ("mmlu_high_school_european_history", "arc_challenge_chat_zero_shot"):
        scores = {label: rng.integers(0, 2, 200).astype(np.float64) for label in labels}
        entry = {"metric": "acc_norm", "paired": {}}
        for label in labels:
            entry[label] = {"acc_norm": float(scores[label].mean()), "n": 200, "stderr": mean_stderr(scores[label])}
            pooled[label].extend(scores[label].tolist())
        for label in labels[:-1]:
            entry["paired"][f"nvfp4-{label}"] = _paired_dict(paired(scores["nvfp4"], scores[label]))
        tasks[task] = entry
    overall = {"paired": {}}
    for label in labels:
        values = np.array(pooled[label])
        overall[label] = {"score": float(values.mean()), "n": values.size, "stderr": mean_stderr(values)}
    for label in labels[:-1]:
        overall["paired"][f"nvfp4-{label}"] = _paired_dict(paired(np.array(pooled["nvfp4"]), np.array(pooled[label])))
    return EvalRecord(
        export=Named(name="smollm2-135m-nvfp4-w4a4-awq-gptq", sha256={}),
        quant="nvfp4",
        source=Named(name="HuggingFaceTB/SmolLM2-135M", sha256={}),
        reference=Named(name="smollm2-135m-fp8", sha256={}),
        labels=labels,
        tasks=tasks,
        overall=overall,
        limit=200,
        seed=0,
        max_drop=0.02,
        failures=[],
        passed=True,
        lm_eval_version="0.4.13",
        resources={},
    )


def test_eval_table_in_a_log_fits_120_columns_and_holds_every_figure():
    from rich.console import Console

    from nvfp4tool.eval.report import print_report, rows

    record = _record()
    out = io.StringIO()
    print_report(record, Console(file=out, width=80, force_terminal=False, color_system=None))
    lines = out.getvalue().splitlines()
    too_wide = [len(line) for line in lines if len(line) > 120]
    assert not too_wide, f"{len(too_wide)} lines wider than 120 columns: {too_wide}"
    cells = [line.split("│") for line in lines]
    printed = {cell.strip() for line in cells for cell in line}
    header, body = rows(record)
    assert len(body) == 3  # two tasks and overall
    for row in body:
        for value in row:  # every figure whole in one cell, none folded over two lines
            assert value in printed, (value, out.getvalue())
    # each row's figures stay with their task: a task's line holds its name and its figures
    for row in body:
        holding = [line for line in lines if f" {row[0]} " in line]
        assert holding, row[0]
