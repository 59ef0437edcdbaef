"""QAD with per-linear formats (issue 41): `train precision_file=` a mixed export (or a precision
file) trains each linear in the export's format (NVFP4 W4A4, NVFP4 weight-only, FP8, BF16) over the
recipe's; the run's folder carries the map and its rules, and `export` of the run writes the same
scheme for every linear as the export it started from."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from nvfp4tool.check import check_checkpoint
from nvfp4tool.cli import cli
from nvfp4tool.corpus.sources import embedded_corpus
from nvfp4tool.export.simulate import load_export
from nvfp4tool.formats.precision_file import read_precision_file
from nvfp4tool.records.export import ExportRecord
from nvfp4tool.run.records import PRECISION_FILE, InputAmaxRecord, PrecisionMapRecord

from fixtures.mixed_fixtures import PRECISION_FILE as PRECISION_FILE_TEXT
from fixtures.train_fixtures import run_train


def _schemes(folder: str) -> dict[str, str]:
    served = load_export(folder)
    return {m: served.quant_of(m) for m in served.quantized}


@pytest.mark.slow  # > 15 s of the inner loop (an export, 2 training steps, an export)
def test_qad_from_a_mixed_export_keeps_each_linears_format_through_export(corpus_tokenizer, tiny_run, tmp_path):
    hf = str(tiny_run.hf_dir)  # the tiny preset trained in BF16
    path = tmp_path / "precision.txt"
    path.write_text(PRECISION_FILE_TEXT)  # layers 0 and 1 as the file says, layers 2 and 3 --quant nvfp4
    start = str(tmp_path / "start")
    calib = ["--calib-data", str(embedded_corpus()[0]), "--calib-samples", "4", "--calib-seq-len", "32"]
    made = CliRunner().invoke(cli, ["export", hf, "--out", start, "--precision-file", str(path), *calib])
    assert made.exit_code == 0, made.output
    started = ExportRecord.read(start).precision_map  # {linear: its format or bf16}
    assert {"fp8", "nvfp4-weight-only", "nvfp4", "bf16"} == set(started.values())
    result = run_train(
        corpus_tokenizer,
        tmp_path / "run",
        model=hf,
        recipe="nvfp4",
        steps=2,
        lr=1e-5,
        precision_file=start,
        bf16_first_layers=0,
        bf16_last_layers=0,
    )
    assert all(np.isfinite(v) for v in result.losses.values())
    trained = PrecisionMapRecord.read(result.hf_dir).precisions
    assert trained == started  # the map round-trips: each linear trained in its export's format
    carried = {r.pattern: r.precision for r in read_precision_file(str(result.hf_dir / PRECISION_FILE))}
    assert carried == {m: p for m, p in started.items() if m != "lm_head"}
    tracked = InputAmaxRecord.read(result.hf_dir).amax  # every quantized linear's input amax
    assert set(tracked) == {m for m, p in started.items() if p != "bf16"}
    out = str(tmp_path / "export")
    exported = CliRunner().invoke(cli, ["export", str(tmp_path / "run"), "--out", out])
    assert exported.exit_code == 0, exported.output
    assert _schemes(out) == _schemes(start)  # the export's schemes are the start's
    report = check_checkpoint(out, tp=(1,))
    assert report.ok, [p.line() for p in report.problems]
