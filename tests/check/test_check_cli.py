"""`nvfp4tool check` on the command line: exit codes, the problem lines, the table, --json."""

from __future__ import annotations

import json

import numpy as np
from click.testing import CliRunner

from nvfp4tool.cli import cli

from fixtures.serving_fixtures import build_checkpoint, write_checkpoint

O_PROJ = "model.layers.1.self_attn.o_proj"


def _run(*args: str):
    return CliRunner().invoke(cli, ["check", *args])


def test_valid_checkpoint_exits_0_with_table(tmp_path):
    folder = write_checkpoint(tmp_path / "ok", build_checkpoint("compressed-tensors", "nvfp4"))
    result = _run(folder, "--tp", "1,2,4")
    assert result.exit_code == 0, result.output
    assert "model.layers.0.self_attn.q_proj" in result.output  # a table row
    assert "14 quantized modules" in result.output and ": OK" in result.output


def test_broken_checkpoint_exits_1_naming_module_and_tensor(tmp_path):
    ckpt = build_checkpoint("modelopt", "nvfp4")
    ckpt.tensors["lm_head.input_scale"] = np.array(0.01, np.float32)
    folder = write_checkpoint(tmp_path / "bad", ckpt)
    result = _run(folder)
    assert result.exit_code == 1, result.output
    assert "lm_head: lm_head.input_scale: module is excluded by 'lm_head'" in result.output
    assert "check failed: 1 problem(s)" in result.output
    assert "Traceback" not in result.output


def test_tp8_flags_row_parallel_k(tmp_path):
    folder = write_checkpoint(tmp_path / "ckpt", build_checkpoint("modelopt", "nvfp4"))
    assert _run(folder, "--tp", "4").exit_code == 0
    result = _run(folder, "--tp", "1,2,4,8")
    assert result.exit_code == 1
    assert f"{O_PROJ}: {O_PROJ}.weight: row-parallel K = 64 at TP 8" in result.output


def test_json_output_and_file(tmp_path):
    ckpt = build_checkpoint("modelopt", "fp8")
    ckpt.tensors[f"{O_PROJ}.weight_scale"] = np.array(0.0, np.float32)
    folder = write_checkpoint(tmp_path / "ckpt", ckpt)
    out_file = tmp_path / "report.json"
    result = CliRunner().invoke(cli, ["check", folder, "--json", "--json-out", str(out_file)])
    assert result.exit_code == 1
    report = json.loads(result.stdout)  # stdout is pure JSON; the failure line goes to stderr
    assert report == json.loads(out_file.read_text())
    assert report["ok"] is False and report["format"] == "modelopt" and report["quant"] == "fp8"
    assert report["problems"] == [
        {
            "module": O_PROJ,
            "tensor": f"{O_PROJ}.weight_scale",
            "message": "is 0.0: a global scale must be finite and > 0",
        }
    ]
    assert report["modules_checked"] == 14 and report["tp"] == [1]
    row = next(m for m in report["modules"] if m["module"] == O_PROJ)
    assert row["bits_per_param"] == 8.0 and row["problems"] == 1
    assert "check failed" in result.stderr


def test_bad_tp_is_usage_error(tmp_path):
    folder = write_checkpoint(tmp_path / "ckpt", build_checkpoint("modelopt", "nvfp4"))
    result = _run(folder, "--tp", "2,x")
    assert result.exit_code == 2
    assert "--tp" in result.output


def test_help_has_example():
    result = _run("--help")
    assert result.exit_code == 0 and "Example:" in result.output and "--tp" in result.output


def test_json_is_strict_with_non_finite_scales(tmp_path):
    ckpt = build_checkpoint("modelopt", "nvfp4")
    ckpt.tensors[f"{O_PROJ}.weight_scale_2"] = np.array(np.inf, np.float32)
    folder = write_checkpoint(tmp_path / "ckpt", ckpt)
    result = _run(folder, "--json")
    assert result.exit_code == 1

    def refuse(constant):
        raise AssertionError(f"non-standard JSON constant {constant}")

    report = json.loads(result.stdout, parse_constant=refuse)
    row = next(m for m in report["modules"] if m["module"] == O_PROJ)
    assert row["weight_global_scale"] == "inf"
    assert [p["tensor"] for p in report["problems"]] == [f"{O_PROJ}.weight_scale_2"]
