"""export and convert-format refuse an output that is, contains or lies inside their input (or the
calibration file), `--force` or not: exit 2, one `Error:` line naming the flag, nothing touched.
(convert's cases: tests/converters/test_convert_bad_input.py; the rule itself: tests/converters/test_atomic.py.)"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from converters.hf import write_hf_folder
from converters.tensor_source import DictTensorSource
from nvfp4tool.cli import cli
from nvfp4tool.config import ModelConfig

CONFIG = ModelConfig(
    family="llama",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    dtype="bfloat16",
)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """work/hf (a model), work/export (its W4A16 export), work/calib/ids.npy."""
    root = tmp_path_factory.mktemp("overlap") / "work"
    rng = np.random.default_rng(0)
    tensors = {n: (rng.standard_normal(s) * 0.1).astype(np.float32) for n, s in CONFIG.expected_tensor_shapes().items()}
    write_hf_folder(root / "hf", CONFIG, DictTensorSource(tensors), dtype="bf16")
    result = CliRunner().invoke(
        cli, ["export", str(root / "hf"), "--out", str(root / "export"), "--quant", "nvfp4-weight-only"]
    )
    assert result.exit_code == 0, result.output
    (root / "calib").mkdir()
    np.save(root / "calib" / "ids.npy", rng.integers(0, CONFIG.vocab_size, (2, 16)))
    return root


CASES = [  # (id, arguments with {w} = the work folder, words)
    (
        "export --out SRC",
        ["export", "{w}/hf", "--out", "{w}/hf", "--quant", "nvfp4-weight-only", "--force"],
        "--out {w}/hf: is the input {w}/hf",
    ),
    (
        "export --out inside SRC",
        ["export", "{w}/hf", "--out", "{w}/hf/q", "--quant", "nvfp4-weight-only"],
        "--out {w}/hf/q: lies inside the input {w}/hf",
    ),
    (
        "export --out a parent of SRC",
        ["export", "{w}/hf", "--out", "{w}", "--quant", "nvfp4-weight-only", "--force"],
        "--out {w}: contains the input {w}/hf",
    ),
    (
        "export --out the calibration folder",
        ["export", "{w}/hf", "--out", "{w}/calib", "--calib-data", "{w}/calib/ids.npy", "--force"],
        "--out {w}/calib: contains the input {w}/calib/ids.npy",
    ),
    (
        "convert-format OUT = SRC",
        ["convert-format", "{w}/export", "{w}/export", "--to", "compressed-tensors", "--force"],
        "OUT {w}/export: is the input {w}/export",
    ),
    (
        "convert-format OUT a parent of SRC",
        ["convert-format", "{w}/export", "{w}", "--to", "compressed-tensors", "--force"],
        "OUT {w}: contains the input {w}/export",
    ),
]


def snapshot(root: Path) -> dict[str, bytes | None]:
    return {
        os.path.relpath(os.path.join(folder, name), root): (
            None if os.path.isdir(os.path.join(folder, name)) else open(os.path.join(folder, name), "rb").read()
        )
        for folder, dirs, files in os.walk(root)
        for name in dirs + files
    }


@pytest.mark.parametrize("case, args, words", CASES, ids=[c[0] for c in CASES])
def test_output_overlapping_an_input_is_refused(work, case, args, words):
    before = snapshot(work.parent)
    result = CliRunner().invoke(cli, [a.format(w=work) for a in args])
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert result.exit_code == 2 and len(errors) == 1, result.output
    assert words.format(w=work) in errors[0], errors[0]
    assert snapshot(work.parent) == before
