"""README.md's Python examples, run as written: the API one on a tiny Llama (an HF folder with its
tokenizer) and the numerics one."""

from __future__ import annotations

import os
import re
import shutil

import numpy as np

from nvfp4tool.records.export import ExportRecord
from nvfp4tool.records.validation import ValidationRecord

from fixtures import REPO_ROOT
from fixtures.eval_fixtures import write_tiny_llama


def _python_blocks() -> list[str]:
    """The ```python blocks of README.md's "Python API" section, in order."""
    with open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("## Python API\n") :]
    section = section[: section.index("\n## ", 1)]
    return re.findall(r"^```python\n(.*?)^```", section, re.MULTILINE | re.DOTALL)


def _run(block: str) -> dict:
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(block, "README.md", "exec"), namespace)
    return namespace


def test_the_readme_has_the_two_python_examples():
    blocks = _python_blocks()
    assert len(blocks) == 2
    assert "from nvfp4tool import api" in blocks[0]
    assert "decode_nvfp4" in blocks[1].split("\n\n", 2)[1]  # imported before it is called


def test_the_readme_api_example_runs_and_returns_the_records_it_wrote(tmp_path, monkeypatch, capsys):
    write_tiny_llama(str(tmp_path / "my-model"), seed=5)
    shutil.copy(os.path.join(REPO_ROOT, "nvfp4tool", "data", "shakespeare_val.txt"), tmp_path / "val.txt")
    monkeypatch.chdir(tmp_path)

    found = _run(_python_blocks()[0])

    summary, report, run = found["summary"], found["report"], found["run"]
    assert summary.record == ExportRecord.read(tmp_path / "my-model-w4a16")
    assert (summary.record.quant, summary.record.format) == ("nvfp4-weight-only", "compressed-tensors")
    assert summary.quantized_modules == len(summary.record.layers) == 14  # 2 layers x 7 linears
    assert report.ok and report.tp == (1, 2) and report.quant == "nvfp4-weight-only"
    assert run.record == ValidationRecord.read(tmp_path / "my-model-w4a16")
    assert run.record.reference == "bf16" and set(run.record.models) == {"bf16", "nvfp4-weight-only"}
    assert run.record.data.sequences == 4 and run.record.data.seq_len == 32
    kl = run.record.models["nvfp4-weight-only"]["kl_mean"]
    assert 0 < kl < 1
    assert capsys.readouterr().out.splitlines()[-1] == f"nvfp4-weight-only True {run.record.passed} {kl}"


def test_the_readme_numerics_example_runs():
    found = _run(_python_blocks()[1])

    w_hat, q = np.asarray(found["w_hat"]), found["q"]
    assert w_hat.shape == (64, 128) and np.asarray(found["y"]).shape == (8, 64)
    np.testing.assert_array_equal(w_hat, np.asarray(found["dequantize_nvfp4"](q)))  # engines' decode = ours
    assert np.all(np.isfinite(w_hat))
