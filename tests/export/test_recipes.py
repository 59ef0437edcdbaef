"""Named export recipes (`export --recipe NAME`, nvfp4tool/export/recipes.py, issue 42): every shipped
recipe exports the tiny model and the export passes check with the recipe's settings recorded; the
options you give win over the recipe's (said); a calibrating recipe without --calib-data, a family's
rule on another family's model, an unknown or malformed recipe are refused in one line, nothing
written; nemotron-nano keeps NVIDIA's Nemotron-3-Nano modules in BF16 as the keep-BF16 script
does."""

from __future__ import annotations

import fnmatch
import os

import numpy as np
import pytest
from click.testing import CliRunner

from nvfp4tool.check import check_checkpoint
from nvfp4tool.cli import cli
from nvfp4tool.config import ModelConfig
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.export import recipes
from nvfp4tool.families.nemotron_h import nvidia_nano_keep_bf16
from nvfp4tool.records.export import ExportRecord

from fixtures.hf_fixtures import build_tiny_model
from fixtures.hybrid_fixtures import DENSE, _hf_folder

SMALL = ["--calib-samples", "4", "--calib-seq-len", "16"]  # given: over every recipe's windows


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipes")
    calib = str(root / "calib.npy")
    np.save(calib, np.random.default_rng(0).integers(3, 40, (4, 16)))
    hybrid, _ = _hf_folder(root, DENSE, seed=0)
    return {"llama": build_tiny_model("llama3", str(root / "llama")), "nemotron_h": hybrid, "calib": calib}


def _export(argv):
    return CliRunner().invoke(cli, ["-q", "export", *argv], catch_exceptions=False)


@pytest.mark.parametrize("name", recipes.names())
def test_every_recipe_exports_and_checks(models, tmp_path, name):
    recipe = recipes.read_recipe(name)
    model = models["nemotron_h" if recipe.keep_bf16_rule else "llama"]
    out = str(tmp_path / "out")
    calib = ["--calib-data", models["calib"], *SMALL] if recipe.calibration else []
    result = _export([model, "--out", out, "--recipe", name, *calib])
    assert result.exit_code == 0, result.output
    report = check_checkpoint(out)
    assert report.ok, report.failure("check")
    record = ExportRecord.read(out)
    assert record.export_recipe == name
    expected = {k: v for k, v in recipe.options.items() if k not in ("calib_samples", "calib_seq_len", "keep_bf16")}
    recorded = {
        "quant": record.quant,
        "equalize": record.equalize,
        "weight_rounding": record.weight_rounding,
        "scale_search": record.scale_search,
        "weight_block": record.weight_block,
        "kv_cache": record.kv_cache,
        "gptq_block_scales": None if record.gptq is None else record.gptq.block_scales,
    }
    assert {k: recorded[k] for k in expected} == expected
    if recipe.calibration:  # the windows given on the command line won over the recipe's
        assert (record.calibration.samples, record.calibration.seq_len) == (4, 16)
    if "keep_bf16" in recipe.options:  # every module a pattern names is excluded (deepseek-r1: attention)
        names = ModelConfig.from_hf_folder(model).linear_names()
        wanted = {n for n in names if any(fnmatch.fnmatchcase(n, p) for p in recipe.options["keep_bf16"])}
        assert wanted and wanted <= set(record.exclude_modules)
    if recipe.keep_bf16_rule:
        kept = nvidia_nano_keep_bf16(ModelConfig.from_hf_folder(model))
        assert kept and all(any(m.startswith(p[:-1]) for m in record.exclude_modules) for p in kept)


def test_given_options_win_and_are_said(models, tmp_path):
    out = str(tmp_path / "out")
    result = CliRunner().invoke(
        cli,
        ["export", models["llama"], "--out", out, "--recipe", "w4a4-ptq", "--equalize", "smoothquant"]
        + ["--calib-data", models["calib"], *SMALL],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    assert "--recipe w4a4-ptq: --equalize 'smoothquant' given, over the recipe's 'awq'" in result.output
    record = ExportRecord.read(out)
    assert (record.equalize, record.weight_rounding, record.export_recipe) == ("smoothquant", "gptq", "w4a4-ptq")


@pytest.mark.parametrize(
    "argv, code, message",
    [
        (["--recipe", "w4a16-best"], 2, "--recipe w4a16-best: calibrates"),
        (
            ["--recipe", "nemotron-nano", "--calib-data", "CALIB"],
            1,
            "nvidia-nemotron-3-nano is a rule of another family",
        ),
        (["--recipe", "w4a17"], 2, "Invalid value for '--recipe'"),
        (["--recipe", "w4a4-ptq", "--equalize", "none", "--calib-data", "CALIB"], 2, "sets --equalize awq"),
    ],
)
def test_bad_recipe_use_is_refused_and_writes_nothing(models, tmp_path, argv, code, message):
    out = str(tmp_path / "out")
    argv = [models["calib"] if a == "CALIB" else a for a in argv]
    result = CliRunner().invoke(cli, ["export", models["llama"], "--out", out, *argv])
    assert result.exit_code == code, result.output
    assert message in result.output
    assert not os.path.exists(out)


@pytest.mark.parametrize(
    "text, message",
    [
        (
            'summary = "s"\nmeasured = "m"\ncalibration = true\n[options]\nquant = 4\n',
            "options.quant = 4: expected a str",
        ),
        ('summary = "s"\nmeasured = "m"\ncalibration = true\n[options]\nout = "x"\n', "options.out: not a recipe key"),
        ('summary = "s"\nmeasured = "m"\n', "calibration: expected true or false"),
        ('summary = "s\n', "not TOML"),
    ],
)
def test_a_malformed_recipe_file_is_named(tmp_path, monkeypatch, text, message):
    (tmp_path / "bad.toml").write_text(text)
    monkeypatch.setattr(recipes, "FOLDER", str(tmp_path))
    with pytest.raises(NVFP4ToolError, match="bad.toml: ") as e:
        recipes.read_recipe("bad")
    assert message in str(e.value)


def test_the_settable_types_are_export_options_own():
    from nvfp4tool.export import ExportOptions

    defaults = ExportOptions()
    for key, kind in recipes.SETTABLE.items():
        default = getattr(defaults, key)
        assert default is None or isinstance(list(default) if kind is list else default, kind), key
