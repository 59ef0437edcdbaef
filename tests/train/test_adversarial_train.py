"""The adversarial corpus of `nvfp4tool train`'s recent features: quantization-aware distillation
(the teacher, its settings, its weights on resume), MoE training (the load-balancing loss weight)
and resume (a changed recipe or distillation setting). Each case is one bad input, run in-process
by `adversarial_harness.run_case`: exit code, one `Error:` line naming the key / file, nothing
created or changed. Fixtures (module-scoped, ~10 s): a two-step distillation run of a tiny
synthetic HF model (the pristine one's shape, a 320-token vocabulary) against a copy of itself (its checkpoints
kept), the tokenizer it ran with, another
tokenizer of the same size, and a tiny Mixtral."""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import ClassVar

import pytest
from bench_convert import write_synthetic_hf_folder
from click.testing import CliRunner

from nvfp4tool.cli import cli
from nvfp4tool.corpus.tokenizer import train_bpe_tokenizer
from nvfp4tool.run.records import RunRecord

from fixtures.adversarial_harness import (
    BF16_INF,
    BF16_NAN,
    CONFIG,
    TEXT,
    WEIGHTS,
    Case,
    World,
    drop_tensor,
    edit_json,
    poke,
    registrar,
    run_case,
    truncate,
)

CASES: list[Case] = []
case = registrar(CASES)
TOKENS = 300  # the run's byte-level BPE tokenizer (at most; >= 257); the student and teacher embed VOCAB
VOCAB = 320


@pytest.fixture(scope="module")
def train_world(pristine, tmp_path_factory) -> dict[str, str]:
    """The pristine fixtures plus "data", "tok", "other_tok", "teacher", "qad" (a finished two-step
    distillation run with both checkpoints) and "moe" (a tiny BF16 Mixtral HF folder)."""
    from fixtures.hf_fixtures import build_tiny_model

    root = tmp_path_factory.mktemp("adversarial-train")
    paths = dict(
        pristine,
        data=str(root / "t.txt"),
        tok=str(root / "tok"),
        other_tok=str(root / "other-tok"),
        student=str(root / "student"),
        teacher=str(root / "teacher"),
        qad=str(root / "qad"),
        moe=str(root / "moe"),
    )
    with open(paths["data"], "w") as f:
        f.write(TEXT)
    train_bpe_tokenizer([TEXT], TOKENS, paths["tok"])
    train_bpe_tokenizer([TEXT[::-1]], TOKENS, paths["other_tok"])  # same size, other merges
    write_synthetic_hf_folder(paths["student"], dataclasses.replace(CONFIG, vocab_size=VOCAB), seed=5)
    shutil.copytree(paths["student"], paths["teacher"])
    result = CliRunner().invoke(cli, ["-q", "train", *_qad_args(paths, paths["teacher"], paths["qad"])])
    assert result.exit_code == 0, result.output
    assert result.stderr == "", result.stderr  # --quiet: no progress or compile lines (test_progress_lines.py)
    assert RunRecord.read(paths["qad"]).teacher is not None
    build_tiny_model("mixtral", paths["moe"], dtype="bfloat16")
    return paths


def _qad_args(paths: dict[str, str], teacher: str, out: str, *extra: str) -> list[str]:
    """The distillation run's arguments (a resume passes them again, with resume=true)."""
    return [
        f"model={paths['student']}",
        f"tokenizer={paths['tok']}",
        f"data={paths['data']}",
        f"teacher={teacher}",
        "distill=kl",
        "temperature=2.0",
        "distill_weight=0.5",
        "steps=2",
        "seq_len=16",
        "batch_size=2",
        "eval_every=0",
        "eval_batches=1",
        "checkpoint_every=1",
        f"out={out}",
        *extra,
    ]


class _Paths:
    """The module fixture's paths, for the builders (set by the test before each case runs)."""

    current: ClassVar[dict[str, str]] = {}


def _resume(w: World, *extra: str, teacher: str | None = None) -> list[str]:
    """Resume a copy of the distillation run (teacher: the original, unless given)."""
    paths = _Paths.current
    return ["train", *_qad_args(paths, teacher or paths["teacher"], w.copy("qad"), "resume=true", *extra)]


def _fresh(w: World, *extra: str, teacher: str | None = None) -> list[str]:
    """A new distillation run into the case's folder (teacher: a copy in the case's folder)."""
    paths = _Paths.current
    return ["train", *_qad_args(paths, teacher or w.copy("teacher"), w.path("run"), *extra)]


def _teacher_with(w: World, change) -> str:
    teacher = w.copy("teacher")
    change(os.path.join(teacher, WEIGHTS))
    return teacher


# ---- resume: the teacher's bytes are the run's ---------------------------------------------


@case("train/resume-with-one-byte-of-the-teacher-changed", 1)
def _(w):
    teacher = _teacher_with(w, lambda f: poke(f, "model.norm.weight", lambda old: bytes([old[0] ^ 1]) + old[1:]))
    return _resume(w, teacher=teacher), ("teacher's weights", f"teacher={teacher}", "model.safetensors differs")


@case("train/resume-with-the-teacher-config-changed", 1)
def _(w):
    teacher = w.copy("teacher")
    edit_json(os.path.join(teacher, "config.json"), lambda c: c.update(rope_theta=c["rope_theta"] * 2))
    return _resume(w, teacher=teacher), ("the teacher's model config", f"teacher={teacher}")


@case("train/resume-with-a-retrained-teacher", 1)
def _(w):
    teacher = w.path("teacher")  # the same model, other weights (another seed), at the same path
    write_synthetic_hf_folder(teacher, dataclasses.replace(CONFIG, vocab_size=VOCAB), seed=6)
    return _resume(w, teacher=teacher), ("teacher's weights", "model.safetensors differs")


@case("train/resume-of-a-run-json-without-teacher-hashes", 1)
def _(w):
    args = _resume(w)
    edit_json(RunRecord.path(w.path("qad")), lambda r: [r.pop("teacher"), r.pop("teacher_model_config")])
    return args, ("records no teacher weight hashes", "teacher=")


@case("train/resume-with-the-teacher-gone", 2)
def _(w):
    return _resume(w, teacher=w.path("moved-teacher")), ("teacher=", "not found")


@case("train/resume-with-a-changed-temperature", 1)
def _(w):
    return _resume(w, "temperature=3.0"), ("temperature 2.0 -> 3.0",)


@case("train/resume-with-a-changed-distill-weight", 1)
def _(w):
    return _resume(w, "distill_weight=1.0"), ("distill_weight 0.5 -> 1.0",)


@case("train/resume-with-a-changed-recipe", 1)
def _(w):
    return _resume(w, "recipe=nvfp4"), ("recipe 'bf16' -> 'nvfp4'",)


@case("train/resume-without-distillation", 1)
def _(w):
    args = [a for a in _resume(w) if not a.startswith("teacher=")]
    return [a if a != "distill=kl" else "distill=none" for a in args], ("distill 'kl' -> 'none'",)


# ---- the teacher itself -------------------------------------------------------------------


@case("train/teacher-with-another-vocabulary", 1)
def _(w):
    args = _fresh(w)
    return [a if not a.startswith("model=") else "model=tiny" for a in args], ("teacher=", "vocabulary")


@case("train/teacher-with-another-tokenizer", 1)
def _(w):
    teacher = w.copy("teacher")
    for name in os.listdir(_Paths.current["other_tok"]):  # a loadable tokenizer, another one
        shutil.copy(os.path.join(_Paths.current["other_tok"], name), teacher)
    return _fresh(w, teacher=teacher), (f"teacher={teacher}", "tokenizer")


@case("train/distill-without-teacher", 2)
def _(w):
    return [a for a in _fresh(w) if not a.startswith("teacher=")], ("distill=", "teacher=PATH")


@case("train/teacher-without-distill", 2)
def _(w):
    return [a for a in _fresh(w) if a != "distill=kl"], ("teacher=", "distill=kl")


@case("train/truncated-teacher", 1)
def _(w):
    teacher = _teacher_with(w, lambda f: truncate(f, 0.5))
    return _fresh(w, teacher=teacher), (WEIGHTS,)


@case("train/teacher-missing-a-tensor", 1)
def _(w):
    teacher = _teacher_with(w, lambda f: drop_tensor(f, "model.layers.1.mlp.up_proj.weight"))
    return _fresh(w, teacher=teacher), ("model.layers.1.mlp.up_proj.weight",)


@case("train/teacher-with-a-nan-weight", 1)
def _(w):
    teacher = _teacher_with(
        w, lambda f: poke(f, "model.layers.0.self_attn.q_proj.weight", lambda old: BF16_NAN, index=10, size=2)
    )
    return _fresh(w, teacher=teacher), (
        os.path.join(teacher, WEIGHTS),
        "model.layers.0.self_attn.q_proj.weight",
        "non-finite",
    )


@case("train/teacher-with-an-infinite-weight", 1)
def _(w):
    teacher = _teacher_with(w, lambda f: poke(f, "lm_head.weight", lambda old: BF16_INF, index=0, size=2))
    return _fresh(w, teacher=teacher), (os.path.join(teacher, WEIGHTS), "lm_head.weight", "non-finite")


@case("train/teacher-config-not-json", 1)
def _(w):
    teacher = w.copy("teacher")
    w.file("teacher/config.json", "{ not json")
    return _fresh(w, teacher=teacher), ("config.json",)


@case("train/teacher-folder-of-nothing", 1)
def _(w):
    teacher = w.folder("empty-teacher")
    w.file("empty-teacher/notes.txt", "no weights here")
    return _fresh(w, teacher=teacher), (teacher,)


@case("train/maxtext-teacher-without-model-config", 2)
def _(w):
    return _fresh(w, teacher=w.copy("mt")), ("mt", "model_config=")


@case("train/teacher-run-without-final-weights", 1)
def _(w):
    run = w.copy("qad", "teacher-run")
    shutil.rmtree(os.path.join(run, "hf"))
    return _fresh(w, teacher=run), ("teacher-run", "has not finished")


@case("train/output-inside-the-teacher", 2)
def _(w):
    teacher = w.copy("teacher")
    args = _fresh(w, teacher=teacher)
    return [a if not a.startswith("out=") else f"out={os.path.join(teacher, 'run')}" for a in args], (teacher,)


@case("train/output-is-the-teacher", 2)
def _(w):
    teacher = w.copy("teacher")
    args = _fresh(w, "force=true", teacher=teacher)
    return [a if not a.startswith("out=") else f"out={teacher}" for a in args], (teacher,)


@case("train/teacher-is-the-run-being-resumed", 2)
def _(w):
    run = w.copy("qad")
    return _resume(w, teacher=run), ("qad",)


@case("train/teacher-is-the-data-file", 1)
def _(w):
    return _fresh(w, teacher=w.file("notes.txt", TEXT)), ("notes.txt",)


@case("train/teacher-hub-id-not-downloaded", 2)
def _(w):
    return _fresh(w, teacher="some-org/some-teacher"), ("teacher=some-org/some-teacher", "not found")


# ---- distillation settings ----------------------------------------------------------------

for _value, _code in (("0", 2), ("-1", 2), ("inf", 2), ("nan", 2), ("1e999", 2), ("hot", 2)):

    @case(f"train/temperature-{_value}", _code)
    def _(w, value=_value):
        return _fresh(w, f"temperature={value}"), ("temperature=",)


for _value in ("1.5", "-0.1", "nan", "half"):

    @case(f"train/distill-weight-{_value}", 2)
    def _(w, value=_value):
        return _fresh(w, f"distill_weight={value}"), ("distill_weight=",)


@case("train/distill-unknown-kind", 2)
def _(w):
    return _fresh(w, "distill=mse"), ("distill=",)


# ---- MoE training: the load-balancing loss weight -----------------------------------------


def _moe(w: World, coef) -> list[str]:
    moe = w.copy("moe")
    edit_json(os.path.join(moe, "config.json"), lambda c: c.update(router_aux_loss_coef=coef))
    paths = _Paths.current
    return [
        "train",
        f"model={moe}",
        f"tokenizer={paths['tok']}",
        f"data={paths['data']}",
        "steps=1",
        "seq_len=16",
        "batch_size=2",
        "eval_every=0",
        f"out={w.path('run')}",
    ]


@case("train/moe-aux-loss-coef-negative", 1)
def _(w):
    return _moe(w, -0.01), ("router_aux_loss_coef",)


@case("train/moe-aux-loss-coef-infinite", 1)
def _(w):
    args = _moe(w, 0.0)
    config = os.path.join(w.path("moe"), "config.json")
    with open(config) as f:
        text = f.read()
    w.file("moe/config.json", text.replace('"router_aux_loss_coef": 0.0', '"router_aux_loss_coef": 1e999'))
    return args, ("router_aux_loss_coef",)


# ---- data mixtures (data=A:0.7,B:0.3) -----------------------------------------------------


def _mixture(w: World, spec: str) -> list[str]:
    paths = _Paths.current
    return [
        "train",
        f"model={paths['student']}",
        f"tokenizer={paths['tok']}",
        f"data={spec}",
        "steps=1",
        "seq_len=16",
        "batch_size=2",
        "eval_every=0",
        f"out={w.path('run')}",
    ]


@case("train/mixture-entry-without-a-weight", 2)
def _(w):
    spec = f"{_Paths.current['data']}:0.7,{w.copy('data', 'b.txt')}"
    return _mixture(w, spec), (f"data={spec}", "is not PATH:WEIGHT")


@case("train/mixture-weight-zero", 2)
def _(w):
    spec = f"{_Paths.current['data']}:0,{w.copy('data', 'b.txt')}:1"
    return _mixture(w, spec), (f"data={spec}", "weight 0 is not a finite number > 0")


@case("train/mixture-source-given-twice", 2)
def _(w):
    spec = f"{_Paths.current['data']}:1,{_Paths.current['data']}:2"
    return _mixture(w, spec), (f"data={spec}", "is given twice")


@case("train/mixture-source-missing", 2)
def _(w):
    missing = w.path("missing.txt")
    return _mixture(w, f"{_Paths.current['data']}:1,{missing}:1"), (f"data={missing!r}", "not found")


@case("train/resume-with-a-mixture-of-the-run-s-data", 1)
def _(w):
    spec = f"{_Paths.current['data']}:1,{w.copy('data', 'b.txt')}:1"
    return _resume(w, f"data={spec}"), ("cannot resume bit-exactly", "the training data")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
@pytest.mark.slow  # > 15 s of the inner loop (tests/durations.json)
def test_bad_input_is_one_line_and_changes_nothing(case, train_world, tmp_path, monkeypatch, hub_env):
    _Paths.current = train_world
    run_case(case, train_world, tmp_path, monkeypatch)


@pytest.mark.slow
def test_resume_with_the_teacher_moved_continues(train_world, tmp_path, monkeypatch):
    """The teacher is compared by its bytes, not its path: the same weights elsewhere resume."""
    monkeypatch.chdir(tmp_path)
    run, teacher = tmp_path / "qad", tmp_path / "moved-teacher"
    shutil.copytree(train_world["qad"], run)
    shutil.copytree(train_world["teacher"], teacher)
    shutil.rmtree(run / "checkpoints" / "2")
    result = CliRunner().invoke(cli, ["-q", "train", *_qad_args(train_world, str(teacher), str(run), "resume=true")])
    assert result.exit_code == 0, result.output
    assert RunRecord.read(run) == RunRecord.read(train_world["qad"])  # run.json as the run started
