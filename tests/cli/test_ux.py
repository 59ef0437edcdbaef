"""What a user sees (issue 26): tables whole when piped, figures that mean what they say, the
sensitivity result as a keep-BF16 file that export reads. On the adversarial corpus's tiny model
(conftest's session fixture `pristine`)."""

from __future__ import annotations

import json
import os
import re

import pytest
from click.testing import CliRunner

from nvfp4tool.cli import cli
from nvfp4tool.export.plan import format_keep_bf16_file, read_keep_bf16_file
from nvfp4tool.export.writer import ExportSummary
from nvfp4tool.records.export import ExportRecord
from nvfp4tool.train.trainer import precision_summary

from fixtures.adversarial_harness import SEQ


def _run(*argv: str):
    return CliRunner().invoke(cli, list(argv), terminal_width=80)  # not a TTY, 80 columns


# ---------------------------------------------------------------------------------------- tables


def test_check_table_is_whole_when_piped_and_json_has_every_cell(pristine, tmp_path):
    shown = _run("check", pristine["mo"], "--tp", "1,2", "--json-out", str(tmp_path / "r.json"))
    assert shown.exit_code == 0, shown.output
    assert "…" not in shown.output
    report = json.loads((tmp_path / "r.json").read_text())
    rows = {line.split()[0]: line.split() for line in shown.output.splitlines() if line.strip().startswith("model.")}
    assert len(rows) == len(report["modules"]) > 0
    for m in report["modules"]:  # every cell of the table, from the JSON
        cells = [
            m["module"],
            f"{m['n']}x{m['k']}",
            f"{m['bits_per_param']:.3g}",
            f"{m['zero_scale_share']:.1%}",
            f"{m['weight_global_scale']:.4g}",
            f"{m['input_global_scale']:.4g}",
            str(m["problems"]),
        ]
        assert rows[m["module"]] == cells
    assert f"{report['format']} {report['quant']}" in shown.output


# ---------------------------------------------------------------------------------------- keep-BF16 file
# (validate --sensitivity writing one: tests/validate/test_validate_cli.py, on its broken export)


def test_export_reads_the_keep_bf16_file_as_repeated_keep_bf16(pristine, tmp_path):
    patterns = ["model.layers.0.self_attn.[qkv]_proj", "model.layers.1.mlp.down_proj"]
    keep_file = tmp_path / "keep_bf16.txt"
    keep_file.write_text(format_keep_bf16_file(patterns, ["from a sensitivity search"]) + "\n# the end\n")
    quant = ("--quant", "nvfp4-weight-only")  # no calibration needed
    by_file = _run(
        "-q", "export", pristine["hf"], "--out", str(tmp_path / "a"), *quant, "--keep-bf16-file", str(keep_file)
    )
    by_flags = _run(
        "-q", "export", pristine["hf"], "--out", str(tmp_path / "b"), *quant, *[f"--keep-bf16={p}" for p in patterns]
    )
    assert by_file.exit_code == 0 and by_flags.exit_code == 0, by_file.output + by_flags.output
    excluded = [json.load(open(tmp_path / n / "hf_quant_config.json"))["quantization"]["exclude_modules"] for n in "ab"]
    assert excluded[0] == excluded[1]
    assert {"model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj", "lm_head"} <= set(excluded[0])
    assert set(ExportRecord.read(str(tmp_path / "a")).layers) == set(ExportRecord.read(str(tmp_path / "b")).layers)


def test_keep_bf16_file_format_round_trips_with_comments():
    text = format_keep_bf16_file(["model.layers.0.mlp.down_proj", "*.q_proj"], ["a comment"])
    assert text.startswith("# a comment\n")
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"keep-{os.getpid()}.txt")
    with open(path, "w") as f:
        f.write(text + "\n   \n*.k_proj   # trailing comment\n*.q_proj\n")
    try:
        assert read_keep_bf16_file(path) == {
            "model.layers.0.mlp.down_proj": f"{path}:3",
            "*.q_proj": f"{path}:4",
            "*.k_proj": f"{path}:7",
        }
    finally:
        os.remove(path)
    with pytest.raises(ValueError):
        format_keep_bf16_file(["two words"])


# ---------------------------------------------------------------------------------------- figures


def test_export_summary_separates_calibration_and_gptq_from_the_write():
    summary = ExportSummary(
        out="o",
        tensors=10,
        quantized_modules=4,
        bf16_bytes_in=270_000_000,
        bytes_written=10**8,
        seconds=644.1,
        calibration_seconds=41.0,
        gptq_seconds=600.0,
    )
    line = summary.line()
    assert line.endswith(
        "in 644.1 s: calibration 41.0 s, GPTQ 600.0 s; read/quantize/write 0.270 GB of bf16 in 3.1 s (0.087 GB/s)"
    )
    assert summary.gb_per_s == pytest.approx(0.27 / 3.1)
    plain = ExportSummary(
        out="o", tensors=10, quantized_modules=4, bf16_bytes_in=10**9, bytes_written=10**8, seconds=2.0
    ).line()
    assert "calibration" not in plain and plain.endswith(
        "in 2.0 s: read/quantize/write 1.000 GB of bf16 in 2.0 s (0.500 GB/s)"
    )


def test_export_with_calibration_times_it_apart(pristine, tmp_path):
    result = _run(
        "export",
        pristine["hf"],
        "--out",
        str(tmp_path / "o"),
        "--calib-data",
        pristine["ids"],
        "--calib-samples",
        "4",
        "--calib-seq-len",
        str(SEQ),
    )
    assert result.exit_code == 0, result.output
    total, calib, write = map(
        float,
        re.search(
            r"in ([\d.]+) s: calibration ([\d.]+) s; read/quantize/write "
            r"[\d.]+ GB of bf16 in ([\d.]+) s",
            result.output,
        ).groups(),
    )
    assert calib > 0 and abs(total - calib - write) <= 0.16  # each rounded to 0.1 s


def test_a_bf16_run_says_it_runs_bf16():
    names = [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.mlp.down_proj",
        "model.layers.1.mlp.down_proj",
        "lm_head",
    ]
    line = precision_summary({n: "bf16" for n in names}, "bf16", [])
    assert line == "recipe bf16: all 4 linear layers run in BF16 (nothing quantized)"
    mixed = precision_summary({**{n: "nvfp4" for n in names[1:3]}, names[0]: "bf16", "lm_head": "bf16"}, "nvfp4", [])
    assert mixed == "recipe nvfp4: 2 of 4 linear layers in nvfp4; kept in bf16: lm_head, model.layers.0"
