"""nvfp4tool.memory: the --offload decision (auto from the needed and the available memory), peak
RSS, and the CLI's refusal of an unknown mode."""

from __future__ import annotations

import numpy as np
import pytest

from nvfp4tool import memory, progress
from nvfp4tool.errors import NVFP4UsageError

from fixtures.reporters import _Lines

GB = 10**9


@pytest.mark.parametrize(
    "mode, weights, working, devices, available, streamed",
    [
        ("never", 100 * GB, 0, 1, 1 * GB, False),
        ("always", 1, 0, 1, 100 * GB, True),
        ("auto", 6 * GB, 1 * GB, 1, 10 * GB, False),  # 7 GB: within the headroom (80%)
        ("auto", 8 * GB, 1 * GB, 1, 10 * GB, True),  # 9 GB: beyond it
        ("auto", 4 * GB, 5 * GB // 4, 4, 10 * GB, True),  # 4 GB sharded + 4 x 1.25 GB working = 9 GB
        ("auto", 4 * GB, GB // 2, 4, 10 * GB, False),  # 4 + 4 x 0.5 = 6 GB
    ],
)
def test_choose_offload(monkeypatch, mode, weights, working, devices, available, streamed):
    monkeypatch.setattr(memory, "available_bytes", lambda: available)
    lines = _Lines()
    need = weights + devices * working
    previous = progress.use_reporter(lines)
    try:
        assert (
            memory.choose_offload(mode, weights=weights, working=working, what="the model", devices=devices) is streamed
        )
    finally:
        progress.use_reporter(previous)
    if mode == "auto":  # auto says what it chose and why
        (line,) = lines.lines
        assert f"{need / GB:.2f} GB" in line and f"{available / GB:.2f} GB" in line
        assert ("streaming" if streamed else "holding") in line
    else:
        assert lines.lines == []


def test_auto_says_the_streamed_estimate_beside_the_held_one(monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda: 10 * GB)
    lines = _Lines()
    previous = progress.use_reporter(lines)
    try:
        assert not memory.choose_offload("auto", weights=GB, working=GB, what="the model", streamed=GB // 4)
    finally:
        progress.use_reporter(previous)
    (line,) = lines.lines
    assert "the model needs 2.00 GB held (0.25 GB streamed), 10.00 GB available -> holding it" in line


def test_unknown_mode_is_bad_usage():
    with pytest.raises(NVFP4UsageError, match="--offload sometimes"):
        memory.choose_offload("sometimes", weights=1, working=0, what="x")


def test_peak_rss_and_available_memory_are_measured():
    before = memory.peak_rss_bytes()
    block = np.ones(256 * 2**20, np.uint8)  # 256 MiB touched: resident now
    assert memory.peak_rss_bytes() >= max(before, block.nbytes)
    assert 0 < memory.available_bytes()


@pytest.mark.parametrize("command", [["validate", "EXPORT", "--data", "DATA"], ["export", "SRC", "--out", "OUT"]])
def test_cli_refuses_an_unknown_offload_mode(tmp_path, command):
    from click.testing import CliRunner

    from nvfp4tool.cli import cli

    (tmp_path / "EXPORT").mkdir()
    (tmp_path / "DATA").write_text("x")
    args = [str(tmp_path / a) if a.isupper() else a for a in command] + ["--offload", "sometimes"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and "--offload" in result.output
