"""`nvfp4tool validate` through click: exit 0 and the reports on a correct export, exit 1 naming
the layer on an export with one block scale x16."""

from __future__ import annotations

import os
import re

import pytest
from click.testing import CliRunner

from nvfp4tool.cli import cli
from nvfp4tool.export.plan import read_keep_bf16_file
from nvfp4tool.records.validation import ValidationRecord
from nvfp4tool.validate import report

from fixtures.validate_fixtures import BROKEN_MODULE, SEQ_LEN, build_exports

SMALL = ["--samples", "4", "--seq-len", str(SEQ_LEN), "--prompts", "2", "--prompt-len", "8", "--gen-tokens", "8"]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return build_exports(str(tmp_path_factory.mktemp("validate_cli")))


@pytest.mark.slow  # makes and calibrates the FP8 reference on the fly
def test_good_export_exits_0_and_writes_the_reports(paths, tmp_path):
    # FP8 reference made on the fly, source found through the provenance record
    copy = tmp_path / "v.json"
    result = CliRunner().invoke(
        cli, ["validate", paths["nvfp4"], "--reference", "fp8", "--data", paths["ids"], "--json", str(copy), *SMALL]
    )
    assert result.exit_code == 0, result.output
    for name in report.REPORT_FILES:
        if name == report.KEEP_BF16_TXT:  # --sensitivity only
            continue
        assert os.path.isfile(os.path.join(paths["nvfp4"], name)), name
    saved = ValidationRecord.read_file(copy)
    assert saved.passed and saved.reference.startswith("fp8")
    assert set(saved.models) == {"bf16", "nvfp4", "fp8"}
    assert "KL mean" in result.output and "PASSED" in result.output


def test_broken_export_exits_1_and_names_the_layer(paths):
    result = CliRunner().invoke(
        cli,
        [
            "validate",
            paths["broken"],
            "--reference",
            paths["fp8"],
            "--source",
            paths["src"],
            "--data",
            paths["ids"],
            *SMALL,
            "--sensitivity",
            "--kl-target",
            "1",
        ],
    )
    assert result.exit_code == 1, result.output
    assert "validation failed: layer_weight_sqnr_db" in result.output
    assert BROKEN_MODULE in result.output.splitlines()[-1]
    assert "sensitivity: KL target 1.0 met" in result.output
    # piped: every pass reports timestamped progress lines, ending in a done line (test_progress_lines.py)
    assert all(
        re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ ", line)
        for line in result.stderr.splitlines()
        if not line.startswith("Error:")
    ), result.stderr
    for stage, unit in (
        ("bf16 logits", "window"),  # held: each batch of windows through every layer
        ("nvfp4 logits", "window"),
        ("sensitivity", "group"),
        ("sensitivity search", "pass"),
    ):
        assert re.search(rf"Z {stage}: done, \d+(/\d+)? {unit}\b.* elapsed ", result.stderr), (stage, result.stderr)
    saved = ValidationRecord.read(paths["broken"])
    assert not saved.passed and saved.layers[0].name == BROKEN_MODULE
    # issue 26: the tables whole when piped (CliRunner: no terminal, 80 columns), the sensitivity result
    # as a keep-BF16 file and a short export command that reads it (not a long --keep-bf16 line)
    assert "…" not in result.output
    keep_file = os.path.join(paths["broken"], report.KEEP_BF16_TXT)
    assert list(read_keep_bf16_file(keep_file)) == saved.sensitivity.keep_bf16
    assert f"  nvfp4tool export {paths['src']} --out OUT --keep-bf16-file {keep_file}" in result.output.splitlines()
    assert "--keep-bf16 '" not in result.output
    for row in saved.layers[:8]:  # the worst-layers table: whole names and the record's values
        weight, output = row.weight_sqnr_db["nvfp4"], row.output_sqnr_db["nvfp4"]
        assert re.search(rf"{re.escape(row.name)}[\s│]+{weight:.1f}[\s│]+{output:.1f}", result.output), row.name
    for harm in saved.sensitivity.harm:  # the sensitivity table: every group, its KL alone, not kept
        assert re.search(rf"{re.escape(harm.group)}[\s│]+{harm.kl_mean_alone:.4g}[\s│]+no", result.output), harm


def test_unknown_reference_is_one_line_error(paths):
    result = CliRunner().invoke(
        cli, ["validate", paths["nvfp4"], "--reference", "int8", "--data", paths["ids"], *SMALL]
    )
    assert result.exit_code == 2  # bad usage, refused by the option type before anything loads
    assert (
        "Error: Invalid value for '--reference': 'int8' is not fp8, bf16 or an existing export folder." in result.output
    )


def test_bad_counts_are_one_line_errors(paths):
    result = CliRunner().invoke(cli, ["validate", paths["nvfp4"], "--data", paths["ids"], *SMALL, "--gen-tokens", "0"])
    assert result.exit_code == 2  # bad usage, refused by the option type before anything loads
    assert (
        result.output.strip().splitlines()[-1] == "Error: Invalid value for '--gen-tokens': 0 is not in the range x>=1."
    )


@pytest.mark.parametrize("flag", ["--samples", "--seq-len"])
def test_bad_sample_count_names_the_validate_flag(paths, flag):
    result = CliRunner().invoke(
        cli,
        [
            "validate",
            paths["nvfp4"],
            "--reference",
            "bf16",
            "--source",
            paths["src"],
            "--data",
            paths["ids"],
            *SMALL,
            flag,
            "0",
        ],
    )
    assert result.exit_code == 2, result.output
    assert f"'{flag}'" in result.output and "--calib" not in result.output


def test_json_copy_into_a_missing_folder_is_refused_before_anything_runs(paths, tmp_path):
    before = sorted(os.listdir(paths["nvfp4"]))
    result = CliRunner().invoke(
        cli,
        ["validate", paths["nvfp4"], "--data", paths["ids"], *SMALL, "--json", str(tmp_path / "missing" / "v.json")],
    )
    assert result.exit_code == 2, result.output
    assert "--json" in result.output
    assert sorted(os.listdir(paths["nvfp4"])) == before and not (tmp_path / "missing").exists()
