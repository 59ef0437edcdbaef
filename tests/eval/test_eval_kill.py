"""kill -9 of `nvfp4tool eval` while it writes its reports (issue 39; the child and its points:
tests/fixtures/kill_child.py): nothing temporary is ever inside the export, the rerun removes the
temporary sibling the kill left and says so, and push then accepts the export. A temporary file an
older writer left inside an export is refused by push by name (with --no-validation too) and
removed by the next eval."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from nvfp4tool import progress
from nvfp4tool.cli import cli
from nvfp4tool.records.evaluation import EVAL_FILES

from fixtures import REPO_ROOT
from fixtures.file_fixtures import Recorder
from fixtures.kill_fixtures import kill_at

ROOT = Path(REPO_ROOT)
ARGS = ["--tasks", "nvfp4tool_mc", "--limit", "2", "--batch-size", "2"]


@pytest.fixture
def pair(eval_models, tmp_path) -> Path:
    """A copy of the export with its source next to it (where its provenance record finds it)."""
    shutil.copytree(eval_models["hf"], tmp_path / "hf")
    shutil.copytree(eval_models["nvfp4"], tmp_path / "nvfp4")
    return tmp_path / "nvfp4"


def _run(args: list[str]) -> str:
    recorder = Recorder()
    previous = progress.use_reporter(recorder)
    try:
        result = CliRunner().invoke(cli, args)
    finally:
        progress.use_reporter(previous)
    assert result.exit_code == 0, (args, result.output)
    return "\n".join(recorder.lines) + result.output


def _leftovers(export: Path) -> list[str]:
    return sorted(n for n in os.listdir(export) if ".tmp-" in n or n.startswith(".nvfp4tool"))


@pytest.mark.slow
@pytest.mark.parametrize("point", ["start", "reports"])
def test_kill_9_while_eval_writes_its_reports_leaves_nothing_inside_the_export(pair, tmp_path, point, hub_env):
    tmp, pid = kill_at(point, ["eval", str(pair), *ARGS], tmp_path / "ready", ".nvfp4.tmp-")
    assert os.path.dirname(tmp) == str(tmp_path) and os.path.isdir(tmp)  # beside the export, not in it
    assert _leftovers(pair) == []
    moved = [n for n in EVAL_FILES if (pair / n).exists()]
    assert len(moved) == (0 if point == "start" else 1), moved

    said = _run(["eval", str(pair), *ARGS, "--force"])
    assert f"removed {tmp}: temporary folder of an interrupted run (pid {pid})" in said, said
    assert not os.path.exists(tmp) and _leftovers(pair) == []
    assert all((pair / n).is_file() for n in EVAL_FILES)
    assert sorted(os.listdir(tmp_path)) == ["hf", "nvfp4", "ready"]
    _run(["push", str(pair), "--repo-id", "org/m", "--dry-run", "--no-validation"])


@pytest.mark.slow
def test_an_older_writers_temporary_file_is_refused_by_push_and_removed_by_eval(pair, hub_env):
    stale = pair / ".tmp-999999999-eval.json"  # no such pid: the older writer, killed
    stale.write_text("{")
    result = CliRunner().invoke(cli, ["push", str(pair), "--repo-id", "org/m", "--dry-run", "--no-validation"])
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and str(stale) in errors[0] and "pid 999999999" in errors[0], result.output
    assert stale.exists()  # push changes nothing

    said = _run(["eval", str(pair), *ARGS])
    assert f"removed {stale}: temporary file of an interrupted run (pid 999999999)" in said, said
    assert _leftovers(pair) == []
    _run(["push", str(pair), "--repo-id", "org/m", "--dry-run", "--no-validation"])
