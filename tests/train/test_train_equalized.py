"""QAD from an equalized start (`nvfp4tool train equalize_from=EXPORT`): the student is the model
with the scales an `export --equalize` of it recorded folded in.

* The student's starting weights are, bit for bit, the folded model as a checkpoint stores it
  (`write_hf_folder` of the export's fold: what the export's own check ran), not the original.
* It is the same function: a BF16 distillation run's first KL to the original teacher is the
  fold's rounding (within the export's `FOLD_KL_LIMIT`), while its weights differ from the
  original's; as an NVFP4 student its first KL differs from the unfolded student's (the fold moves
  the quantization grid, which is the point).
* run.json records the folded scales (the export's EqualizationRecord); a record without them, or
  with them for a run without `equalize_from`, is a defect naming run.json; a resume whose export
  now holds other scales is refused, the run untouched.
* Bad input is one line, nothing created: a preset model or a missing folder (exit 2), a folder
  that is no export, an export that was not equalized, an export of another model (exit 1).
"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from converters.hf import HFFolderSource, write_hf_folder
from nvfp4tool import progress
from nvfp4tool.cli import cli
from nvfp4tool.config import ModelConfig
from nvfp4tool.corpus.sources import embedded_corpus
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.export.equalize import FOLD_KL_LIMIT
from nvfp4tool.model.fold import EqualizedSource
from nvfp4tool.records.export import ExportRecord
from nvfp4tool.run.config import load_train_config
from nvfp4tool.run.records import RunRecord
from nvfp4tool.train.metrics import read_metrics
from nvfp4tool.train.trainer import _equalized

from fixtures.file_fixtures import Recorder
from fixtures.kill_fixtures import kill_at
from fixtures.train_fixtures import run_train, train_args

CALIB = ("--calib-samples", "4", "--calib-seq-len", "32")


_args, _run = train_args, run_train


@pytest.fixture(scope="module")
def base(tmp_path_factory, corpus_tokenizer, tiny_run):
    """The tiny preset trained 30 steps (its HF folder), its AWQ export and its plain export."""
    root = tmp_path_factory.mktemp("equalized")
    tokenizer_dir = corpus_tokenizer
    hf = tiny_run.hf_dir
    calib = ["--calib-data", str(embedded_corpus()[0]), *CALIB]
    for name, flags in (("awq", ["--equalize", "awq"]), ("plain", [])):
        result = CliRunner().invoke(
            cli,
            ["export", str(hf), "--out", str(root / name), "--quant", "nvfp4", *calib, *flags],
            catch_exceptions=False,
        )
        assert result.exit_code == 0, result.output
    return {"tokenizer": tokenizer_dir, "hf": hf, "awq": root / "awq", "plain": root / "plain"}


def _qad(base, out, **extra):
    args = dict(
        model=str(base["hf"]), teacher=str(base["hf"]), distill="kl", equalize_from=str(base["awq"]), steps=2, lr=1e-5
    )
    args.update(extra)
    return _run(base["tokenizer"], out, **{k: v for k, v in args.items() if v is not None})


@pytest.mark.slow  # > 15 s of the inner loop (tests/durations.json)
def test_the_student_starts_from_the_folded_model_as_stored(base, tmp_path):
    config = load_train_config(
        None, _args(base["tokenizer"], tmp_path / "x", model=str(base["hf"]), equalize_from=str(base["awq"]))
    )
    from nvfp4tool.checkpoints import open_checkpoint

    source = open_checkpoint(str(base["hf"]))
    folded, record = _equalized(config, source)
    assert record == ExportRecord.read(str(base["awq"])).equalization
    model_config = ModelConfig.from_hf_folder(str(base["hf"]))
    written = tmp_path / "folded"  # the fold as a checkpoint stores it: fp32 products rounded to BF16
    write_hf_folder(
        written, model_config, EqualizedSource.from_record(source.tensors, record, model_config), dtype="bf16"
    )
    stored = HFFolderSource(written).use_names_of(model_config)
    changed = 0
    for name in stored.names():
        ours, theirs = np.asarray(folded.tensors.get(name)), np.asarray(stored.get(name))
        assert ours.dtype == theirs.dtype and ours.tobytes() == theirs.tobytes(), name
        changed += np.asarray(source.tensors.get(name)).tobytes() != ours.tobytes()
    assert changed >= 4 * model_config.num_layers  # the norms, v_proj and up_proj and their readers


@pytest.mark.slow  # > 15 s of the inner loop (tests/durations.json)
def test_the_folded_student_is_the_same_function_on_another_grid(base, tmp_path):
    """BF16 student: its first KL to the teacher is the fold's rounding alone; NVFP4 student: its
    first KL is not the unfolded student's; run.json records the scales."""
    bf16 = read_metrics(_qad(base, tmp_path / "bf16", recipe="bf16", steps=1).out)[0]["kl"]
    assert 0 < bf16 <= FOLD_KL_LIMIT, bf16
    recorded = RunRecord.read(tmp_path / "bf16")
    assert recorded.equalization == ExportRecord.read(str(base["awq"])).equalization
    assert recorded.config["equalize_from"] == str(base["awq"])
    nvfp4 = dict(recipe="nvfp4", bf16_first_layers=0, bf16_last_layers=0, weight_2d=False, steps=1)
    folded = read_metrics(_qad(base, tmp_path / "folded", **nvfp4).out)[0]["kl"]
    plain = read_metrics(_qad(base, tmp_path / "plain", equalize_from=None, **nvfp4).out)[0]["kl"]
    assert folded != plain and folded > 10 * bf16, (folded, plain, bf16)


def test_run_record_equalization_is_checked(base, tmp_path):
    _qad(base, tmp_path / "run", steps=1)
    obj = json.loads((tmp_path / "run" / "run.json").read_text())
    for mutate in (lambda o: o.pop("equalization"), lambda o: o["config"].update(equalize_from=None)):
        bad = json.loads(json.dumps(obj))
        mutate(bad)
        (tmp_path / "run" / "run.json").write_text(json.dumps(bad))
        with pytest.raises(NVFP4ToolError, match="equalization: must be recorded exactly when") as raised:
            RunRecord.read(tmp_path / "run")
        assert str(raised.value).startswith(str(tmp_path / "run" / "run.json"))


def test_a_resume_with_other_scales_is_refused(base, tmp_path):
    export = tmp_path / "awq"
    shutil.copytree(base["awq"], export)
    out = tmp_path / "run"
    _qad(base, out, equalize_from=str(export), checkpoint_every=1)
    shutil.rmtree(out / "checkpoints" / "2")
    record = json.loads((export / ExportRecord.FILE_NAME).read_text())
    site = next(iter(record["equalization"]["sites"].values()))
    site["alpha"] = 0.123456  # the export now records other scales
    (export / ExportRecord.FILE_NAME).write_text(json.dumps(record))
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    with pytest.raises(NVFP4ToolError, match=r"the folded scales \(equalize_from=.*\) changed"):
        _qad(base, out, equalize_from=str(export), checkpoint_every=1, resume=True)
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


@pytest.mark.parametrize(
    "what,code,message",
    [
        ("preset", 2, "equalize_from=AWQ: needs model=CHECKPOINT"),
        ("missing", 2, "equalize_from='no/such/export': expected an export folder"),
        ("not-export", 1, "not an nvfp4tool export"),
        ("plain", 1, "the export was not equalized"),
        ("other-model", 1, "not the export of model="),
    ],
)
def test_bad_equalize_from_is_one_line_and_creates_nothing(base, tmp_path, monkeypatch, what, code, message):
    monkeypatch.chdir(tmp_path)
    model, export = str(base["hf"]), str(base["awq"])
    if what == "preset":
        model = "tiny"
    elif what == "missing":
        export = "no/such/export"
    elif what == "not-export":
        export = str(base["hf"])
    elif what == "plain":
        export = str(base["plain"])
    elif what == "other-model":
        model = str(tmp_path / "other")
        shutil.copytree(base["hf"], model)
        raw = bytearray((tmp_path / "other" / "model.safetensors").read_bytes())
        raw[-3] ^= 0x01
        (tmp_path / "other" / "model.safetensors").write_bytes(bytes(raw))
    teacher = str(base["hf"]) if what == "preset" else model
    result = CliRunner().invoke(
        cli,
        [
            "train",
            *_args(
                base["tokenizer"], "runs/a", model=model, teacher=teacher, distill="kl", equalize_from=export, steps=1
            ),
        ],
    )
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert result.exit_code == code and len(errors) == 1 and "Traceback" not in result.output, result.output
    assert message.replace("AWQ", export) in errors[0], errors[0]
    assert not (tmp_path / "runs").exists()


def _tamper(site_change):
    """A change of the export's record: `site_change(key, site)` on every site (issue 39)."""

    def change(record):
        for key, site in record["equalization"]["sites"].items():
            site_change(key, site)

    return change


def _scaled(factor):
    def change(key, site):
        s = np.frombuffer(base64.b64decode(site["scales"]), "<f4") * np.float32(factor)
        site["scales"] = base64.b64encode(s.astype("<f4").tobytes()).decode()

    return change


def _channel(value):
    def change(key, site):
        s = np.frombuffer(base64.b64decode(site["scales"]), "<f4").copy()
        s[3] = value
        site["scales"] = base64.b64encode(s.tobytes()).decode()

    return change


@pytest.mark.parametrize(
    "what,change,message",
    [
        ("doubled", _scaled(2.0), "its scales did not make the export's model.layers.0.input_layernorm.weight"),
        ("negated", _scaled(-1.0), "channel 0 is -"),
        ("zero", _channel(0.0), "channel 3 is 0.0; every scale must be finite and > 0"),
        ("nan", _channel(np.nan), "channel 3 is nan"),
        ("short", lambda k, s: s.update(scales=s["scales"][:-8]), "scales: "),
        ("not-base64", lambda k, s: s.update(scales="not base64!"), "scales: not base64"),
    ],
)
def test_a_tampered_equalization_record_is_refused_before_anything_is_created(
    base, tmp_path, monkeypatch, what, change, message
):
    """Forged scales (doubled, negated: the same function, other weights), impossible ones (zero,
    NaN), a wrong count or no base64: one line naming the record, the site and the problem, exit
    1, no run folder, the export untouched."""
    monkeypatch.chdir(tmp_path)
    export = tmp_path / "awq"
    shutil.copytree(base["awq"], export)
    record_path = export / ExportRecord.FILE_NAME
    record = json.loads(record_path.read_text())
    _tamper(change)(record)
    record_path.write_text(json.dumps(record))
    before = {p.name: p.read_bytes() for p in export.iterdir()}
    model = str(base["hf"])
    result = CliRunner().invoke(
        cli,
        [
            "train",
            *_args(
                base["tokenizer"],
                "runs/a",
                model=model,
                teacher=model,
                distill="kl",
                equalize_from=str(export),
                steps=1,
            ),
        ],
    )
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert result.exit_code == 1 and len(errors) == 1 and "Traceback" not in result.output, result.output
    first = next(iter(record["equalization"]["sites"]))
    assert str(record_path) in errors[0] and f"equalization site {first!r}" in errors[0], errors[0]
    assert message in errors[0], errors[0]
    assert not (tmp_path / "runs").exists()
    assert {p.name: p.read_bytes() for p in export.iterdir()} == before


@pytest.mark.slow  # a child process per point (tests/fixtures/kill_child.py)
@pytest.mark.parametrize(("point", "prefix"), [("start", "."), ("publish", ".hf.tmp-")])
def test_kill_9_of_an_equalized_start_leaves_nothing_the_rerun_does_not_clean(base, tmp_path, point, prefix):
    """kill -9 of `train equalize_from=` when its run folder is created (nothing in it yet) or when
    its final HF folder is complete but not renamed in: no complete-looking run or hf/ is left; the
    rerun (resume=true after the checkpoints exist) removes the kill's temporary folder, saying so,
    and finishes with the export's scales recorded."""
    run = tmp_path / "run"
    model = str(base["hf"])
    args = [
        "train",
        *_args(
            base["tokenizer"],
            run,
            model=model,
            teacher=model,
            distill="kl",
            equalize_from=str(base["awq"]),
            steps=2,
            lr=1e-5,
            checkpoint_every=1,
        ),
    ]
    tmp, pid = kill_at(point, args, tmp_path / "ready", tmp_prefix=prefix)
    if point == "start":
        assert Path(tmp).parent == tmp_path and not run.exists()
    else:
        assert Path(tmp).parent == run and not (run / "hf").exists()
        args.append("resume=true")
    recorder = Recorder()
    previous = progress.use_reporter(recorder)
    try:
        result = CliRunner().invoke(cli, args)
    finally:
        progress.use_reporter(previous)
    said = "\n".join(recorder.lines) + result.output
    assert result.exit_code == 0, said
    assert f"removed {tmp}: temporary folder of an interrupted run (pid {pid})" in said, said
    assert not Path(tmp).exists() and not any(".tmp-" in p.name for p in [*tmp_path.iterdir(), *run.iterdir()])
    recorded = RunRecord.read(run)
    assert recorded.equalization.to_json() == ExportRecord.read(str(base["awq"])).equalization.to_json()
    assert len(HFFolderSource(run / "hf").names()) == len(HFFolderSource(run / "hf").config.expected_tensor_shapes())
