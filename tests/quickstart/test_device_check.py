"""scripts/device_check.sh (the GPU check) as a CPU smoke test, so that it cannot rot: every step
runs at tiny sizes and passes, summary.json lists each step, the table is printed; a step the time
budget does not cover fails the check (exit 1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures import REPO_ROOT

ROOT = Path(REPO_ROOT)
STEPS = ["quantizers", "bench_quantize", "train_100m", "train_1b", "train_1b_4096", "numerics_pytest"]


def _run(out: Path, **env) -> subprocess.CompletedProcess:
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, JAX_PLATFORMS="cpu", **env)
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "device_check.sh")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def _table_rows(stdout: str) -> dict[str, str]:
    """step name -> its result column, from the printed table."""
    rows = [line.split("|") for line in stdout.splitlines() if line.startswith("| ")]
    return {cells[1].strip(): cells[2].strip() for cells in rows if cells[2].strip()}


@pytest.mark.slow
def test_smoke_run_passes_every_step(tmp_path):
    result = _run(tmp_path, DEVICE_CHECK_SMOKE="1")
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["smoke"] and summary["passed"]
    assert {name: step["passed"] for name, step in summary["steps"].items()} == dict.fromkeys(STEPS, True)
    assert _table_rows(result.stdout) == dict(dict.fromkeys(STEPS, "PASS"), step="result")
    for name in STEPS:  # one JSON per step
        json.loads((tmp_path / f"{name}.json").read_text())
    train = json.loads((tmp_path / "train_100m.json").read_text())
    assert [r["recipe"] for r in train["results"]] == ["bf16", "nvfp4"]
    assert train["results"][1]["x_bf16"] > 0


def test_a_step_out_of_time_fails_the_check(tmp_path):
    result = _run(tmp_path, DEVICE_CHECK_SMOKE="1", DEVICE_CHECK_BUDGET_S="0", DEVICE_CHECK_STEPS="quantizers train_1b")
    assert result.returncode == 1, result.stdout + result.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert not summary["passed"]
    assert {name: step["passed"] for name, step in summary["steps"].items()} == dict(
        dict.fromkeys(STEPS, True), quantizers=False, train_1b=False
    )
    rows = _table_rows(result.stdout)
    assert (rows["quantizers"], rows["train_1b"], rows["bench_quantize"]) == ("FAIL", "FAIL", "skip")
    assert "device_check: FAIL" in result.stdout
