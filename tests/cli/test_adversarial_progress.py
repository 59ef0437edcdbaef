"""Adversarial cases for progress in logs (issue 26): a bad `--log-format` or NVFP4TOOL_LOG_FORMAT
is refused as bad usage before anything runs, and a refusal in the middle of a stage, printed as
text or JSON lines (CliRunner's stderr is no terminal), is still exactly one `Error:` line (the
stage's own line says `stopped`), with nothing written (`adversarial_harness.run_case`)."""

from __future__ import annotations

import os

import pytest

from nvfp4tool import progress

from fixtures.adversarial_harness import BF16_NAN, DOWN, SEQ, WEIGHTS, Case, World, poke, registrar, run_case, set_f32

CASES: list[Case] = []
case = registrar(CASES)
ENV: dict[str, str] = {}  # case id -> NVFP4TOOL_LOG_FORMAT for it


def _nan_hf(w: World) -> str:
    hf = w.copy("hf")
    poke(os.path.join(hf, WEIGHTS), f"{DOWN}.weight", lambda _: BF16_NAN, index=6, size=2)
    return hf


def _export(w: World, src: str, *flags: str) -> list[str]:
    return [
        *flags,
        "export",
        src,
        "--out",
        w.path("out"),
        "--calib-data",
        w.copy("ids"),
        "--calib-samples",
        "4",
        "--calib-seq-len",
        str(SEQ),
    ]


@case("export/log-format-unknown", 2)
def _(w):
    return _export(w, w.copy("hf"), "--log-format", "xml"), ("--log-format", "xml")


@case("train/log-format-unknown-before-the-run", 2)
def _(w):
    return [
        "--log-format",
        "plain",
        "train",
        "model=tiny",
        f"data={w.file('t.txt', 'hello world ' * 50)}",
        f"out={w.path('run')}",
    ], ("--log-format", "plain")


@case("convert/log-format-env-unknown", 2)
def _(w):
    ENV["convert/log-format-env-unknown"] = "yaml"
    return ["convert", w.copy("hf"), w.path("out"), "--to", "hf"], ("--log-format", "yaml")


@case("convert/log-format-empty", 2)
def _(w):
    return ["--log-format", "", "convert", w.copy("hf"), w.path("out"), "--to", "hf"], ("--log-format",)


@case("convert/nan-weight-in-text-lines", 1, also=("convert: start, 0/", "convert: stopped, "))
def _(w):
    return ["--log-format", "text", "convert", _nan_hf(w), w.path("out"), "--to", "hf"], (f"{DOWN}.weight",)


@case("convert/nan-weight-in-json-lines", 1, also=('"event": "stopped", "stage": "convert"',))
def _(w):
    return ["--log-format", "json", "convert", _nan_hf(w), w.path("out"), "--to", "maxtext", "--rope-layout", "half"], (
        f"{DOWN}.weight",
    )


@case("convert/nan-weight-json-from-the-env", 1, also=('"event": "start", "stage": "convert"',))
def _(w):
    ENV["convert/nan-weight-json-from-the-env"] = "json"
    return ["convert", _nan_hf(w), w.path("out"), "--to", "hf"], (f"{DOWN}.weight",)


@case("export/nan-weight-in-json-lines", 1)  # refused before any stage starts
def _(w):
    return _export(w, _nan_hf(w), "--log-format", "json"), (f"{DOWN}.weight",)


@case("convert-format/nan-input-scale-in-json-lines", 1)
def _(w):
    mo = w.copy("mo")
    set_f32(os.path.join(mo, WEIGHTS), f"{DOWN}.input_scale", lambda _: float("nan"))
    return ["--log-format", "json", "convert-format", mo, w.path("out"), "--to", "compressed-tensors"], (
        f"{DOWN}.input_scale",
    )


@case("push/no-validation-quiet-json", 1)
def _(w):
    return ["-q", "--log-format", "json", "push", w.copy("mo"), "--repo-id", "org/name", "--dry-run"], (
        "validation.json",
    )


@case("check/not-an-export-in-json-lines", 1)
def _(w):
    return ["--log-format", "json", "check", w.copy("hf")], ("hf",)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_and_changes_nothing(case, pristine, tmp_path, monkeypatch, hub_env):
    monkeypatch.delenv(progress.LOG_FORMAT_ENV, raising=False)

    def build(w: World):
        argv, names = case.build(w)
        if case.id in ENV:
            monkeypatch.setenv(progress.LOG_FORMAT_ENV, ENV[case.id])
        return argv, names

    run_case(Case(case.id, case.code, build, case.also, case.hub), pristine, tmp_path, monkeypatch)
