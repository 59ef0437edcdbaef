"""Quantization-aware distillation in `nvfp4tool train` (teacher=PATH distill=kl): an NVFP4 student
learns the frozen teacher's distribution (the KL to it falls) from each kind of teacher the opener
reads (HF folder, training run, MaxText checkpoint); the teacher's weights stay as they were and
are never part of the checkpointed state; run.json names the teacher with the sha256 of its weight
files; a resumed run replays its steps to the last bit, and is refused once one byte of the
teacher's weights changed; a missing teacher is a usage error (exit 2), a teacher with another vocabulary bad data
(exit 1)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from nvfp4tool.cli import cli
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.run.records import RunRecord
from nvfp4tool.train.metrics import read_metrics

from fixtures.train_fixtures import run_train, train_args

_args, _run = train_args, run_train


@pytest.fixture(scope="module")
def teachers(tmp_path_factory, corpus_tokenizer, tiny_run):
    """The tiny preset trained 30 steps, as a run folder, its HF folder and a MaxText checkpoint."""
    from nvfp4tool.convert import convert_checkpoint

    root = tmp_path_factory.mktemp("teachers")
    base = tiny_run
    convert_checkpoint(str(base.hf_dir), str(root / "maxtext"), to="maxtext", rope_layout="half")
    return {
        "tokenizer": corpus_tokenizer,
        "run": base.out,
        "hf": base.hf_dir,
        "maxtext": root / "maxtext",
        "maxtext_options": dict(model_config=str(base.hf_dir / "config.json"), rope_layout="half"),
    }


def _weights(folder) -> bytes:
    return (folder / "model.safetensors").read_bytes()


@pytest.mark.parametrize(
    "kind", ["hf", pytest.param("run", marks=pytest.mark.slow), pytest.param("maxtext", marks=pytest.mark.slow)]
)
@pytest.mark.slow  # > 15 s of the inner loop (tests/durations.json)
def test_qad_run_lowers_the_kl_to_a_frozen_teacher(teachers, tmp_path, kind):
    """An NVFP4 student from scratch (every block quantized) against the trained teacher: the KL
    falls, the reported eval loss is the next-token CE, the teacher's files are untouched and its
    weights are in no checkpoint; the HF row also resumes bit-exactly."""
    teacher_bytes = _weights(teachers["hf"])
    extra = teachers["maxtext_options"] if kind == "maxtext" else {}
    out = tmp_path / "qad"
    teacher = teachers[kind]
    if kind == "hf":  # a copy: its weights change between the two halves below
        teacher = tmp_path / "teacher"
        shutil.copytree(teachers["hf"], teacher)
    args = dict(
        teacher=str(teacher),
        distill="kl",
        recipe="nvfp4",
        bf16_first_layers=0,
        bf16_last_layers=0,
        temperature=2.0,
        distill_weight=0.75,
        steps=12,
        eval_every=6,
        checkpoint_every=6,
        **extra,
    )
    result = _run(teachers["tokenizer"], out, **args)
    records = read_metrics(out)
    assert {"kl", "ce"} <= set(records[0]) and {"eval_loss", "eval_kl"} <= set(records[5])
    first, last = records[0]["kl"], np.mean([r["kl"] for r in records[-3:]])
    assert last < 0.7 * first, (first, last)
    assert records[-1]["eval_kl"] < records[5]["eval_kl"]
    assert 0 < records[-1]["eval_loss"] < records[0]["ce"]  # the next-token CE, not the mixed loss
    run_config = json.loads((out / "run.json").read_text())["config"]
    assert {k: run_config[k] for k in ("teacher", "distill", "temperature", "distill_weight")} == {
        "teacher": str(teacher),
        "distill": "kl",
        "temperature": 2.0,
        "distill_weight": 0.75,
    }
    assert _weights(teachers["hf"]) == teacher_bytes
    recorded = RunRecord.read(out)  # the teacher as an export names its source: its weight files' sha256
    weights = {"hf": ["model.safetensors"], "run": ["hf/model.safetensors"]}.get(kind)
    assert recorded.teacher.kind == kind and recorded.teacher.name == teacher.name and recorded.teacher.step is None
    if weights is not None:
        assert sorted(recorded.teacher.files) == weights
        assert recorded.teacher.files[weights[0]] == hashlib.sha256((teacher / weights[0]).read_bytes()).hexdigest()
    else:  # MaxText: every file of the checkpoint
        assert len(recorded.teacher.files) > 3 and all(not os.path.isabs(f) for f in recorded.teacher.files)
    assert recorded.teacher_model_config["vocab_size"] == 384

    import orbax.checkpoint as ocp

    state = ocp.StandardCheckpointer().restore(out / "checkpoints" / "12" / "state")
    assert sorted(state) == ["amax", "opt_state", "params", "step"]  # no teacher beside the student
    if kind != "hf":
        return
    shutil.rmtree(out / "checkpoints" / "12")
    final_weights = _weights(result.hf_dir)
    resumed = _run(teachers["tokenizer"], out, resume=True, **args)
    assert sorted(resumed.losses) == list(range(7, 13))
    for step in range(7, 13):
        assert resumed.losses[step] == result.losses[step], step  # to the last bit
    assert resumed.eval_losses[12] == result.eval_losses[12]
    assert read_metrics(out)[-1]["eval_kl"] == records[-1]["eval_kl"]
    assert _weights(result.hf_dir) == final_weights

    # one byte of the teacher's weights changed between the halves: the resume is refused, untouched
    shutil.rmtree(out / "checkpoints" / "12")
    before = _tree(out)
    raw = bytearray(_weights(teacher))
    raw[-3] ^= 0x01  # inside the last tensor's data
    (teacher / "model.safetensors").write_bytes(bytes(raw))
    with pytest.raises(
        NVFP4ToolError,
        match=r"the teacher's weights \(teacher=.*teacher: "
        r"model.safetensors differs\) changed",
    ):
        _run(teachers["tokenizer"], out, resume=True, **args)
    assert _tree(out) == before


def _tree(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _cli_error(teachers, tmp_path, monkeypatch, **extra):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["train", *_args(teachers["tokenizer"], "runs/a", distill="kl", steps=1, **extra)])
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    assert not (tmp_path / "runs").exists()
    return result.exit_code, errors[0]


def test_missing_teacher_is_a_usage_error(teachers, tmp_path, monkeypatch):
    code, error = _cli_error(teachers, tmp_path, monkeypatch, teacher="no/such/teacher")
    assert code == 2 and "teacher=no/such/teacher: not found" in error


def test_teacher_with_another_vocabulary_is_bad_data(teachers, tmp_path, monkeypatch):
    from fixtures.hf_fixtures import build_tiny_model

    other = build_tiny_model("llama3", str(tmp_path / "other"))  # 256 tokens, the student 384
    code, error = _cli_error(teachers, tmp_path, monkeypatch, teacher=other)
    assert code == 1 and f"teacher={other}" in error and "vocabulary" in error


def _teacher_record(tmp_path, **fields):
    from nvfp4tool.records.export import SourceRecord
    from nvfp4tool.run.config import TrainConfig

    config = TrainConfig(data="corpus.txt", teacher="t", distill="kl").to_dict()
    record = dict(
        config=config,
        model_config={"model_type": "llama"},
        data_sha256="a" * 64,
        eval_data_sha256=None,
        tokenizer_sha256="b" * 64,
        train_windows=4,
        eval_windows=1,
        devices=1,
        processes=1,
        teacher=SourceRecord(name="t", kind="hf", step=None, files={"model.safetensors": "c" * 64}),
        teacher_model_config={"model_type": "llama"},
    )
    record.update(fields)
    return RunRecord(**record)


def test_run_record_teacher_round_trips_and_is_checked(tmp_path):
    """run.json keeps the teacher's record (read back as a SourceRecord); a teacher recorded for a run
    without one, or half of the pair, is a defect naming run.json and the key; an older run.json
    without the two keys still reads (its resume is refused by the trainer instead)."""
    _teacher_record(tmp_path).write(tmp_path)
    back = RunRecord.read(tmp_path)
    assert back == _teacher_record(tmp_path) and back.teacher.files == {"model.safetensors": "c" * 64}
    obj = json.loads((tmp_path / "run.json").read_text())
    for mutate, expected in (
        (lambda o: o["config"].update(teacher=None, distill="none"), "teacher: recorded for a run"),
        (lambda o: o.pop("teacher_model_config"), "recorded together"),
        (lambda o: o["teacher"].update(files={"model.safetensors": 3}), "teacher"),
    ):
        bad = json.loads(json.dumps(obj))
        mutate(bad)
        (tmp_path / "run.json").write_text(json.dumps(bad))
        with pytest.raises(NVFP4ToolError, match=expected) as raised:
            RunRecord.read(tmp_path)
        assert str(raised.value).startswith(str(tmp_path / "run.json"))
    older = {k: v for k, v in obj.items() if k not in ("teacher", "teacher_model_config")}
    (tmp_path / "run.json").write_text(json.dumps(older))
    assert RunRecord.read(tmp_path).teacher is None
