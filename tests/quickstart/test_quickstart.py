"""`nvfp4tool quickstart`, the README's main job, end to end on the embedded model and corpus."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import default_xla_backend

from nvfp4tool.cli import cli

from fixtures import REPO_ROOT


def test_quickstart_refuses_an_existing_folder_without_force(tmp_path):
    (tmp_path / "qs").mkdir()
    (tmp_path / "qs" / "keep.txt").write_text("x")
    result = CliRunner().invoke(cli, ["quickstart", "--out", str(tmp_path / "qs")])
    assert result.exit_code == 1
    assert "already exists" in result.output
    assert (tmp_path / "qs" / "keep.txt").is_file()


def _quickstart_in_child(out: Path, result_file: Path) -> dict:
    """`nvfp4tool quickstart --out OUT` in a child (tests/fixtures/quickstart_child.py) run with the
    XLA flags the suite was started with: its 250 training steps are run time, and with XLA's LLVM
    passes the test takes 162 s of CPU instead of 272 s (the suite's flags, tests/conftest.py)."""
    child = Path(REPO_ROOT) / "tests" / "fixtures" / "quickstart_child.py"
    with default_xla_backend():
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO_ROOT)
        ran = subprocess.run(
            [sys.executable, str(child), str(out), str(result_file)],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
    assert ran.returncode == 0 and result_file.is_file(), (ran.stdout + ran.stderr)[-3000:]
    return json.loads(result_file.read_text())


@pytest.mark.slow
def test_quickstart_runs_every_stage_with_the_defaults(tmp_path):
    out = tmp_path / "qs"
    result = _quickstart_in_child(out, tmp_path / "result.json")
    output = result["output"]
    assert result["exit_code"] == 0, output[-3000:] + result["exception"]
    # greedy generation compiles its outer programs (embedding / LM head, prompt / step) once for
    # the three models (BF16, FP8, NVFP4: 1 each measured) and a decoder layer per weight layout and
    # shape (8 measured, validation's and eval's generation together; before issue 42: one
    # whole-model program per model and prompt length)
    made = result["programs_made"]
    assert made["layer"] <= 8 and all(made[name] <= 1 for name in made if name != "layer"), made
    figures = json.loads((out / "quickstart.json").read_text())
    assert list(figures) == [
        "pretrain",
        "finetune",
        "export_nvfp4",
        "export_fp8",
        "validate",
        "eval",
        "check",
        "push",
        "machine",
    ]
    assert figures["machine"]["cores"] >= 1 and figures["machine"]["wall_seconds"] > 0
    # pretraining learns (a uniform model over the vocabulary would sit at ln(512) = 6.24 nats)
    assert figures["pretrain"]["final_loss"] < figures["pretrain"]["first_loss"] - 1.0
    # the fine-tune continues from the pretrained model (not from scratch) and keeps learning
    pre, fine = figures["pretrain"], figures["finetune"]
    assert (pre["steps"], fine["steps"]) == (150, 100)
    assert fine["first_loss"] < pre["first_loss"] - 1.0
    assert fine["final_loss"] < fine["first_loss"] and fine["eval_loss"] < pre["eval_loss"]
    assert figures["validate"]["passed"] and figures["check"]["ok"]
    tasks = figures["eval"]["tasks"]  # the three variants on the shipped tasks, paired
    assert {t: e["n"] for t, e in tasks.items()} == {"nvfp4tool_mc_letter": 40, "nvfp4tool_gsm": 24}
    assert all(set(e["paired"]) == {"nvfp4-bf16", "nvfp4-fp8"} for e in tasks.values())
    assert "NVFP4 - BF16" in output and "McNemar p" in output
    nvfp4 = figures["validate"]["metrics"]["nvfp4"]
    assert 0 < nvfp4["kl_mean"] and nvfp4["top1"] > 0.8
    for name in (
        "export-nvfp4/validation.md",
        "export-nvfp4/nvfp4tool_export.json",
        "export-fp8/hf_quant_config.json",
        "finetune-nvfp4/loss.png",
        "MODEL_CARD.md",
    ):
        assert (out / name).is_file(), name
    # the README table made from quickstart.json shows only figures this run printed (issue 26)
    sys.path.insert(0, str(Path(REPO_ROOT) / "scripts"))
    import quickstart_table

    for line in quickstart_table.table(figures).splitlines()[1:-1]:
        for figure in re.findall(r"\d[\d,.]*(?:e-\d+)?%?", line):
            assert figure in output, (figure, line)
    card = (out / "MODEL_CARD.md").read_text()
    assert "| KL mean (nats) |" in card and "**PASSED**" in card  # the validation table is on the card
    assert "## Task accuracy" in card and "| nvfp4tool_mc_letter | acc | 40 |" in card  # and eval's
    # nothing push uploads names a path of this machine (issue 9): the export folder's files and the card
    uploaded = [p for p in (out / "export-nvfp4").iterdir() if p.is_file()] + [out / "MODEL_CARD.md"]
    for path in uploaded:
        data = path.read_bytes()
        assert str(tmp_path).encode() not in data and str(out.resolve()).encode() not in data, path.name
