"""QAD with per-linear formats (issue 41): `train precision_file=FILE` trains each linear in its own
format (NVFP4 W4A4, NVFP4 weight-only, FP8, BF16) over the recipe's, the run's folder carries the
map and the file, and `export` of the run keeps every linear's format."""

from __future__ import annotations

import numpy as np
from click.testing import CliRunner

from nvfp4tool.check import check_checkpoint
from nvfp4tool.cli import cli
from nvfp4tool.config import ModelConfig
from nvfp4tool.export.simulate import load_export
from nvfp4tool.run.records import PRECISION_FILE, InputAmaxRecord, PrecisionMapRecord

from fixtures.train_fixtures import run_train

PRECISION_FILE_TEXT = """# issue 41: per-linear formats for QAD
model.layers.0.self_attn.* fp8
model.layers.1.mlp.* nvfp4-weight-only
model.layers.1.self_attn.o_proj bf16
"""


def _expected(config: ModelConfig) -> dict[str, str]:
    """The file's formats over recipe nvfp4 with no BF16 blocks, written out by hand."""
    expected = {}
    for m in config.modules.linears:
        if m.keep_dtype:
            expected[m.name] = "bf16"
        elif m.name.startswith("model.layers.0.self_attn."):
            expected[m.name] = "fp8"
        elif m.name.startswith("model.layers.1.mlp."):
            expected[m.name] = "nvfp4-weight-only"
        elif m.name == "model.layers.1.self_attn.o_proj":
            expected[m.name] = "bf16"
        else:
            expected[m.name] = "nvfp4"
    return expected


def test_qad_with_a_precision_file_keeps_each_linears_format_through_export(corpus_tokenizer, tmp_path):
    path = tmp_path / "precision.txt"
    path.write_text(PRECISION_FILE_TEXT)
    result = run_train(
        corpus_tokenizer,
        tmp_path / "run",
        recipe="nvfp4",
        steps=2,
        precision_file=str(path),
        bf16_first_layers=0,
        bf16_last_layers=0,
    )
    assert all(np.isfinite(v) for v in result.losses.values())
    config = ModelConfig.from_hf_folder(str(result.hf_dir))
    expected = _expected(config)
    assert {"fp8", "nvfp4-weight-only", "nvfp4", "bf16"} <= set(expected.values())
    assert PrecisionMapRecord.read(result.hf_dir).precisions == expected  # the map round-trips
    assert (result.hf_dir / PRECISION_FILE).read_bytes() == path.read_bytes()
    tracked = InputAmaxRecord.read(result.hf_dir).amax  # every quantized linear's input amax
    assert set(tracked) == {m for m, p in expected.items() if p != "bf16"}
    out = tmp_path / "export"
    exported = CliRunner().invoke(cli, ["export", str(tmp_path / "run"), "--out", str(out)])
    assert exported.exit_code == 0, exported.output
    served = load_export(str(out))
    assert {m: served.quant_of(m) for m in served.quantized} == {m: p for m, p in expected.items() if p != "bf16"}
    report = check_checkpoint(str(out), tp=(1,))
    assert report.ok, [p.line() for p in report.problems]
