"""The adversarial corpus of a training run's files as the stages above them read them: run.json
(checked against the TrainConfig when read, `nvfp4tool.run.records` + `nvfp4tool.run.config`),
precision_map.json and input_amax.json, opened by the one checkpoint opener for `convert`
(`nvfp4tool.convert`), `export` and `validate --source`. These files moved below the opener and
the trainer (issue 22, "clean floors"); each case is one defect in one of them, run in-process by
`adversarial_harness.run_case`: exit code, one `Error:` line naming the file and key, nothing
created or changed.

Fixture (module-scoped, no training): a run folder written with the run's own record classes
around a copy of the pristine HF model, every block trained in NVFP4 (run.json, hf/ with the
weights, precision_map.json and input_amax.json); `test_the_run_fixture_exports_and_converts`
shows it is one the stages accept, so each case fails for its one defect.
"""

from __future__ import annotations

import os
import shutil

import pytest
from click.testing import CliRunner

from nvfp4tool.cli import cli

from fixtures.adversarial_harness import BINARY, SEQ, Case, World, edit_json, registrar, run_case

CASES: list[Case] = []
case = registrar(CASES)


@pytest.fixture(scope="module")
def run_world(pristine, tmp_path_factory) -> dict[str, str]:
    """The pristine fixtures plus "run": a finished NVFP4 training run of the pristine model."""
    from converters.hf import HFFolderSource
    from nvfp4tool.recipes.precision import precision_map
    from nvfp4tool.run.config import TrainConfig
    from nvfp4tool.run.records import WEIGHTS_DIR, InputAmaxRecord, PrecisionMapRecord, RunRecord

    root = tmp_path_factory.mktemp("adversarial-runs")
    run = root / "run"
    shutil.copytree(pristine["hf"], run / WEIGHTS_DIR)
    data = root / "t.txt"
    data.write_text("To be, or not to be.\n")
    config = TrainConfig(model=pristine["hf"], data=str(data), recipe="nvfp4", bf16_first_layers=0, bf16_last_layers=0)
    model_config = HFFolderSource(str(run / WEIGHTS_DIR)).config
    pmap = precision_map(config.recipe_config(), model_config)
    PrecisionMapRecord(pmap).write(run / WEIGHTS_DIR)
    InputAmaxRecord({n: 1.5 for n, p in pmap.items() if p != "bf16"}).write(run / WEIGHTS_DIR)
    RunRecord(
        config=config.to_dict(),
        model_config=model_config.to_hf_config(),
        data_sha256="a" * 64,
        eval_data_sha256=None,
        tokenizer_sha256="b" * 64,
        train_windows=8,
        eval_windows=1,
        devices=1,
        processes=1,
    ).write(run)
    return dict(pristine, run=str(run))


def _run_with(w: World, file: str, change) -> str:
    """A copy of the run with `change` applied to its JSON file `file` (relative to the run)."""
    run = w.copy("run")
    edit_json(os.path.join(run, file), change)
    return run


def _export(w: World, src: str, *args: str) -> list[str]:
    return ["export", src, "--out", w.path("out"), *args]


def _convert(w: World, src: str) -> list[str]:
    return ["convert", src, w.path("out"), "--to", "hf"]


def _validate(w: World, source: str) -> list[str]:
    return [
        "validate",
        w.copy("mo"),
        "--data",
        w.copy("ids", "ids.npy"),
        "--reference",
        "bf16",
        "--samples",
        "4",
        "--seq-len",
        str(SEQ),
        "--prompts",
        "1",
        "--prompt-len",
        "8",
        "--gen-tokens",
        "4",
        "--source",
        source,
    ]


# ---- run.json: the TrainConfig it ran with, checked when read --------------------------------


@case("convert/run-json-with-an-unknown-recipe", 1)
def _(w):
    run = _run_with(w, "run.json", lambda r: r["config"].update(recipe="int8"))
    return _convert(w, run), ("run.json", "recipe")


@case("export/run-json-config-missing-a-key", 1)
def _(w):
    run = _run_with(w, "run.json", lambda r: r["config"].pop("weight_2d"))
    return _export(w, run), ("run.json", "weight_2d")


@case("export/run-json-config-with-an-unknown-key", 1)
def _(w):
    run = _run_with(w, "run.json", lambda r: r["config"].update(weight_2dd=True))
    return _export(w, run), ("run.json", "weight_2dd")


@case("export/run-json-config-value-of-the-wrong-type", 1)
def _(w):
    run = _run_with(w, "run.json", lambda r: r["config"].update(stochastic_rounding="yes"))
    return _export(w, run), ("run.json", "stochastic_rounding")


@case("export/run-json-with-a-teacher-hash-but-no-teacher", 1)
def _(w):
    run = _run_with(
        w,
        "run.json",
        lambda r: r.update(teacher={"name": "t", "kind": "hf", "step": None, "files": {}}, teacher_model_config={}),
    )
    return _export(w, run), ("run.json", "teacher", "without a teacher")


@case("validate/source-run-json-not-json", 1)
def _(w):
    run = w.copy("run")
    w.file("run/run.json", BINARY)
    return _validate(w, run), ("run.json",)


# ---- the final weights' maps -----------------------------------------------------------------


@case("export/run-precision-map-with-an-unknown-precision", 1)
def _(w):
    run = _run_with(w, "hf/precision_map.json", lambda m: m.update({"model.layers.0.mlp.down_proj": "int4"}))
    return _export(w, run), ("precision_map.json", "model.layers.0.mlp.down_proj")


@case("export/run-input-amax-negative", 1)
def _(w):
    run = _run_with(w, "hf/input_amax.json", lambda m: m.update({"model.layers.1.mlp.up_proj": -1.0}))
    return _export(w, run), ("input_amax.json", "model.layers.1.mlp.up_proj")


@case("convert/run-input-amax-not-a-number", 1)
def _(w):
    run = _run_with(w, "hf/input_amax.json", lambda m: m.update({"model.layers.0.self_attn.q_proj": "big"}))
    return _convert(w, run), ("input_amax.json", "model.layers.0.self_attn.q_proj")


@case("export/run-step-without-a-checkpoint", 1)
def _(w):
    return _export(w, w.copy("run"), "--step", "3"), ("no checkpoint for step 3",)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_and_changes_nothing(case, run_world, tmp_path, monkeypatch, hub_env):
    run_case(case, run_world, tmp_path, monkeypatch)


def test_the_run_fixture_exports_and_converts(run_world, tmp_path):
    """The untouched run is one the stages accept: its export uses the tracked input amax, and
    convert writes its final weights, so each case above is refused for its one defect."""
    from nvfp4tool.records.export import ExportRecord

    runner = CliRunner()
    result = runner.invoke(cli, ["-q", "export", run_world["run"], "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    record = ExportRecord.read(tmp_path / "out")
    assert record.source.kind == "run" and record.weight_block == "2d" and record.calibration is None
    assert record.recipe["recipe"] == "nvfp4"
    assert record.input_amax and set(record.input_amax.values()) == {1.5}  # the run's tracked amax
    result = runner.invoke(cli, ["-q", "convert", run_world["run"], str(tmp_path / "hf"), "--to", "hf"])
    assert result.exit_code == 0, result.output
    assert "config.json" in os.listdir(tmp_path / "hf")
