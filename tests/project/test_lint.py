"""The tree is clean under ruff (lint, import order and format, configured in pyproject.toml)."""

import subprocess
import sys

from fixtures import REPO_ROOT


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=REPO_ROOT, capture_output=True, text=True)


def test_ruff_lint_is_clean():
    done = _ruff("check", "--no-cache", ".")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_ruff_format_is_clean():
    done = _ruff("format", "--check", "--no-cache", ".")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
