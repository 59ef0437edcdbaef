"""`nvfp4tool eval` of a mixed-precision export (issue 41): the export runs as served (each linear
in its own format) and its column is named by what it is, "Mixed (NVFP4/NVFP4 W4A16/FP8/BF16)",
not "NVFP4"; a W4A16 export's column reads "NVFP4 W4A16"."""

from __future__ import annotations

import dataclasses
import os
import shutil

import pytest
from click.testing import CliRunner

from nvfp4tool.cli import cli
from nvfp4tool.eval import report
from nvfp4tool.records.evaluation import EvalRecord

MIXED_TITLE = "Mixed (NVFP4/NVFP4 W4A16/FP8/BF16)"  # the fixture's precision file, in formats.PRECISIONS order


@pytest.mark.slow  # > 15 s of the inner loop (lm-eval over two models)
def test_eval_runs_a_mixed_export_and_names_its_column_by_its_formats(mixed_eval_export, tmp_path):
    export = str(shutil.copytree(mixed_eval_export["export"], tmp_path / "export"))
    result = CliRunner().invoke(
        cli,
        ["eval", export, "--source", mixed_eval_export["hf"], "--tasks", "nvfp4tool_mc", "--limit", "4"]
        + ["--batch-size", "4", "--max-length", "64"],
    )
    assert result.exit_code == 0, result.output
    record = EvalRecord.read(export)
    assert record.quant == "mixed" and record.quant_title == MIXED_TITLE
    assert record.labels == ["bf16", "nvfp4"] and record.tasks["nvfp4tool_mc"]["nvfp4"]["n"] == 4
    assert f"{MIXED_TITLE} - BF16" in result.output
    with open(os.path.join(export, "eval.md"), encoding="utf-8") as f:
        md = f.read()
    assert f"| {MIXED_TITLE} (± se) |" in md and f"| {MIXED_TITLE} - BF16 [95% CI] |" in md
    assert "| NVFP4 (± se) |" not in md
    w4a16 = report.markdown(dataclasses.replace(record, quant="nvfp4-weight-only", quant_title=None))
    assert "| NVFP4 W4A16 (± se) |" in w4a16 and "| NVFP4 W4A16 - BF16 [95% CI] |" in w4a16
