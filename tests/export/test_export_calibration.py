"""The export record states the calibration that ran (windows, their length, tokens) beside what was
asked; data shorter than asked is said in one line and recorded, and calibrates exactly as the
request it can satisfy would; the GPTQ spill never reaches the output."""

from __future__ import annotations

import os

import numpy as np
import pytest
from click.testing import CliRunner

from nvfp4tool.cli import cli
from nvfp4tool.records.export import ExportRecord

from fixtures.export_fixtures import synthetic_config, synthetic_source

CONFIG = synthetic_config(hidden=64, mlp=128, layers=2, vocab=256, head_dim=16, kv_heads=2, dtype="bfloat16")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("calibration")
    src, _ = synthetic_source(root, CONFIG, seed=7)
    ids = str(root / "short.npy")
    np.save(ids, np.random.default_rng(2).integers(0, CONFIG.vocab_size, (3, 20)))
    return root, src, ids


def _export(src: str, out: str, *args: str):
    result = CliRunner().invoke(cli, ["export", src, "--out", out, *args])
    assert result.exit_code == 0, result.output
    return result.output, ExportRecord.read(out)


def test_the_record_states_the_windows_and_tokens_that_ran(tiny):
    root, src, ids = tiny
    said, record = _export(
        src,
        str(root / "exact"),
        "--calib-data",
        ids,
        "--calib-samples",
        "2",
        "--calib-seq-len",
        "12",
        "--kv-cache",
        "fp8",
    )
    calibration = record.calibration
    assert (calibration.samples, calibration.seq_len, calibration.tokens) == (2, 12, 24)
    assert (calibration.requested_samples, calibration.requested_seq_len) == (2, 12)
    assert calibration.file == "short.npy" and "fewer than asked" not in said


def test_short_data_is_said_recorded_and_calibrates_as_what_it_has(tiny):
    root, src, ids = tiny
    short, exact = str(root / "short"), str(root / "as-asked")
    said, record = _export(src, short, "--calib-data", ids, "--calib-samples", "64", "--calib-seq-len", "32")
    lines = [line for line in said.splitlines() if "fewer than asked" in line]
    assert len(lines) == 1 and ids in lines[0] and "3 calibration window(s) of 20 tokens" in lines[0], said
    assert "--calib-samples 64 x --calib-seq-len 32" in lines[0] and "its 60 tokens" in lines[0]
    calibration = record.calibration
    assert (calibration.samples, calibration.seq_len, calibration.tokens) == (3, 20, 60)
    assert (calibration.requested_samples, calibration.requested_seq_len) == (64, 32)
    # the same bytes as the request the file satisfies: the record says what ran
    _, asked = _export(src, exact, "--calib-data", ids, "--calib-samples", "3", "--calib-seq-len", "20")
    assert asked.input_amax == record.input_amax
    with (
        open(os.path.join(short, "model.safetensors"), "rb") as a,
        open(os.path.join(exact, "model.safetensors"), "rb") as b,
    ):
        assert a.read() == b.read()


@pytest.mark.slow
def test_gptq_weight_only_records_its_calibration_and_publishes_no_spill(tiny):
    root, src, ids = tiny
    out = str(root / "gptq")
    _, record = _export(
        src,
        out,
        "--quant",
        "nvfp4-weight-only",
        "--weight-rounding",
        "gptq",
        "--calib-data",
        ids,
        "--calib-samples",
        "2",
        "--calib-seq-len",
        "16",
    )
    assert record.input_amax is None and record.weight_rounding == "gptq"
    assert (record.calibration.samples, record.calibration.seq_len, record.calibration.tokens) == (2, 16, 32)
    assert sorted(os.listdir(out)) == sorted(
        ["model.safetensors", "config.json", "hf_quant_config.json", ExportRecord.FILE_NAME]
    )
    assert not [n for n in os.listdir(root) if n.startswith(".")]  # no temporary folder, no spill left


def test_the_short_data_warning_prints_under_quiet(tiny, tmp_path):
    """-q silences status lines, not warnings (progress.warn): the one line reaches stderr."""
    root, src, ids = tiny
    args = ["export", src, "--out", str(tmp_path / "q"), "--calib-data", ids, "--calib-samples", "64"]
    result = CliRunner().invoke(cli, ["-q", *args, "--calib-seq-len", "32"])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"warning: {ids} gives 3 calibration window(s)"), result.stderr
