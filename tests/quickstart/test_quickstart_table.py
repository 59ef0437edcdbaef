"""scripts/quickstart_table.py: the README's quickstart table from a quickstart.json (fast: a small
synthetic file in the shape `run_quickstart` writes)."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

from fixtures import REPO_ROOT

sys.path.insert(0, os.path.join(REPO_ROOT, "scripts"))
import quickstart_table

FIGURES = {
    "pretrain": {
        "steps": 300,
        "first_loss": 6.2712,
        "final_loss": 3.6841,
        "eval_loss": 3.9443,
        "tokens_per_s": 2535.2,
        "run": "/x/pretrain-bf16",
        "seconds": 250.0,
    },
    "finetune": {
        "steps": 100,
        "first_loss": 3.649,
        "final_loss": 3.4904,
        "eval_loss": 3.857,
        "tokens_per_s": 441.0,
        "run": "/x/finetune-nvfp4",
        "seconds": 200.0,
    },
    "export_nvfp4": {"out": "/x/e", "quantized_modules": 14, "bytes_written": 1_234_567, "seconds": 13.5},
    "export_fp8": {"out": "/x/f", "quantized_modules": 14, "bytes_written": 987_654, "seconds": 5.7},
    "validate": {
        "passed": True,
        "sequences": 16,
        "seq_len": 128,
        "files": [],
        "seconds": 90.0,
        "metrics": {
            "bf16": {"ppl": 46.853},
            "nvfp4": {
                "kl_mean": 0.000786,
                "kl_p99": 0.005445,
                "top1": 0.97021,
                "ppl": 46.870,
                "ppl_increase": 0.000363,
            },
            "fp8": {
                "kl_mean": 4.21e-05,
                "kl_p99": 0.0003025,
                "top1": 0.99316,
                "ppl": 46.8547,
                "ppl_increase": 3.59e-05,
            },
        },
    },
    "eval": {
        "tasks": {
            "nvfp4tool_mc_letter": {
                "metric": "acc",
                "n": 40,
                "bf16": 0.275,
                "fp8": 0.275,
                "nvfp4": 0.3,
                "paired": {
                    "nvfp4-bf16": {
                        "diff": 0.025,
                        "ci95": [-0.024, 0.074],
                        "mcnemar_p": 1.0,
                        "right_to_wrong": 0,
                        "wrong_to_right": 1,
                    },
                    "nvfp4-fp8": {
                        "diff": 0.025,
                        "ci95": [-0.024, 0.074],
                        "mcnemar_p": 1.0,
                        "right_to_wrong": 0,
                        "wrong_to_right": 1,
                    },
                },
            }
        },
        "items_per_s": {"bf16": 1.0},
        "seconds": 60.0,
        "files": [],
    },
    "check": {"ok": True, "problems": [], "modules": 14, "tensors": 81, "tp": [1, 2], "seconds": 1.0},
    "push": {"files": 10, "card": "/x/MODEL_CARD.md", "seconds": 2.0},
    "machine": {
        "cpu": "AMD EPYC 7B13",
        "cores": 2,
        "platform": "cpu",
        "date": "2026-12-01",
        "wall_seconds": 618.4,
        "peak_rss_gb": 1.13,
        "load_average": 3.42,
    },
}


def test_table_shows_the_printed_figures_and_the_machine():
    block = quickstart_table.table(FIGURES)
    assert block.startswith(quickstart_table.BEGIN) and block.endswith(quickstart_table.END)
    assert (
        "2026-12-01 (CPU: AMD EPYC 7B13, 2 cores; JAX on cpu; load average 3.4 at the end): all stages in 618 s "
        "wall, peak RSS 1.13 GB"
        in block
        and "vary with the machine and its load" in block
    )
    rows = {line.split(" | ")[0].lstrip("| "): line for line in block.splitlines() if line.startswith("| ")}
    assert "300 steps: loss 6.271 -> 3.684, eval 3.944; 2,535 tokens/s" in rows["pretrain BF16"]
    assert "100 steps: loss 3.649 -> 3.490, eval 3.857; 441 tokens/s" in rows["fine-tune NVFP4 recipe"]
    assert "14 quantized modules, 0.001 GB" in rows["export"]
    validate = rows["validate vs BF16 on 16 x 128 tokens of held-out text"]
    assert (
        "NVFP4: KL mean 0.00079, p99 0.0054, top-1 97.0%, perplexity 46.87 (+0.04%)" in validate
        and "FP8: KL mean 4.2e-05" in validate
        and "BF16: perplexity 46.85" in validate
        and validate.endswith(": PASSED |")
    )
    assert (
        "nvfp4tool_mc_letter (acc, 40 items): BF16 27.5%, FP8 27.5%, NVFP4 30.0%; NVFP4 - BF16 +2.5 points "
        "[-2.4, +7.4], flips 0/1, McNemar p 1" in rows["task accuracy (lm-eval, paired)"]
    )
    assert "14 quantized modules, 81 tensors, TP 1,2: OK" in rows["check"]
    assert "10 files would be uploaded" in rows["push --dry-run"]
    assert "diverge" not in block  # the quickstart prints no greedy-divergence figures


def test_readme_block_is_replaced_and_the_rest_kept(tmp_path, capsys):
    (tmp_path / "q.json").write_text(json.dumps(FIGURES))
    readme = tmp_path / "README.md"
    readme.write_text(f"# top\n\n{quickstart_table.BEGIN}\nold table\n{quickstart_table.END}\n\n## next\n")
    assert quickstart_table.main([str(tmp_path / "q.json"), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("# top\n\n") and text.endswith("\n\n## next\n") and "old table" not in text
    assert quickstart_table.table(FIGURES) in text
    assert quickstart_table.main([str(tmp_path / "q.json")]) == 0
    assert capsys.readouterr().out.strip().endswith(quickstart_table.END)


@pytest.mark.parametrize("broken", ["{}", "not json", json.dumps({**FIGURES, "machine": {}})])
def test_a_file_of_another_shape_is_one_error_line(tmp_path, capsys, broken):
    (tmp_path / "q.json").write_text(broken)
    assert quickstart_table.main([str(tmp_path / "q.json")]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and re.match(r"Error: .*q\.json: not a quickstart\.json", err)


def test_readme_without_the_block_is_refused_unchanged(tmp_path, capsys):
    (tmp_path / "q.json").write_text(json.dumps(FIGURES))
    readme = tmp_path / "README.md"
    readme.write_text("# no block\n")
    assert quickstart_table.main([str(tmp_path / "q.json"), "--readme", str(readme)]) == 1
    assert readme.read_text() == "# no block\n" and "Error:" in capsys.readouterr().err
