"""Adversarial cases of issue 26's "what a user sees" (help ranges, the keep-BF16 file export reads
and validate --sensitivity writes, the quickstart's output folder, check's JSON copy): each builds
one kind of bad input and `run_case` (adversarial_harness) asserts the exit code, one `Error:` line
naming the file / option, no traceback and nothing created, changed or deleted."""

from __future__ import annotations

import os

import pytest

from fixtures.adversarial_harness import BINARY, SEQ, Case, World, registrar, run_case

CASES: list[Case] = []
case = registrar(CASES)

DOWN0 = "model.layers.0.mlp.down_proj"


def _export(w: World, *args: str) -> list[str]:
    return ["export", w.copy("hf"), "--out", w.path("out"), "--quant", "nvfp4-weight-only", *args]


# ---------------------------------------------------------------------------------------- export --keep-bf16-file


@case("export/keep-bf16-file-pattern-matches-no-module", 1)
def _(w):
    keep = w.file("keep.txt", f"# kept\n{DOWN0}\nmodel.layers.9.mlp.down_proj\n")
    return _export(w, "--keep-bf16-file", keep), ("keep.txt:3", "model.layers.9.mlp.down_proj", "matches no")


@case("export/keep-bf16-file-misspelt-wildcard", 1)
def _(w):
    keep = w.file("keep.txt", "*.dwon_proj   # typo\n")
    return _export(w, "--keep-bf16-file", keep), ("keep.txt:1", "*.dwon_proj")


@case("export/keep-bf16-file-two-patterns-on-one-line", 1)
def _(w):
    keep = w.file("keep.txt", f"{DOWN0} model.layers.1.mlp.down_proj\n")
    return _export(w, "--keep-bf16-file", keep), ("keep.txt:1", "one fnmatch pattern")


@case("export/keep-bf16-file-a-command-line-pasted", 1)
def _(w):
    keep = w.file("keep.txt", f"nvfp4tool export src --out out --keep-bf16 '{DOWN0}'\n")
    return _export(w, "--keep-bf16-file", keep), ("keep.txt:1",)


@case("export/keep-bf16-file-binary", 1)
def _(w):
    keep = w.file("keep.txt", BINARY)
    return _export(w, "--keep-bf16-file", keep), ("keep.txt", "not UTF-8")


@case("export/keep-bf16-file-missing", 2)
def _(w):
    return _export(w, "--keep-bf16-file", w.path("nowhere.txt")), ("--keep-bf16-file", "nowhere.txt")


@case("export/keep-bf16-file-is-a-folder", 2)
def _(w):
    return _export(w, "--keep-bf16-file", w.folder("keepdir")), ("--keep-bf16-file", "keepdir")


@case("export/keep-bf16-file-inside-the-replaced-out", 2)
def _(w):
    out = w.folder("out")
    keep = w.file("out/keep.txt", f"{DOWN0}\n")
    return [
        "export",
        w.copy("hf"),
        "--out",
        out,
        "--quant",
        "nvfp4-weight-only",
        "--keep-bf16-file",
        keep,
        "--force",
    ], ("keep.txt", "would destroy")


@case("export/keep-bf16-flag-and-file-flag-pattern-unmatched", 2)
def _(w):
    keep = w.file("keep.txt", f"{DOWN0}\n")
    return _export(w, "--keep-bf16-file", keep, "--keep-bf16", "*.no_such_proj"), ("--keep-bf16", "*.no_such_proj")


# ---------------------------------------------------------------------------------------- validate


@case("validate/sensitivity-keep-file-exists-without-force", 1)
def _(w):
    export = w.copy("mo")
    w.file("mo/keep_bf16.txt", f"{DOWN0}\n")
    return (
        [
            "validate",
            export,
            "--source",
            w.copy("hf"),
            "--data",
            w.copy("ids", "ids.npy"),
            "--reference",
            "bf16",
            "--seq-len",
            str(SEQ),
            "--sensitivity",
        ],
        ("keep_bf16.txt", "--force"),
    )


@case("validate/min-layer-sqnr-not-finite", 2)
def _(w):
    return (
        ["validate", w.copy("mo"), "--data", w.copy("ids", "ids.npy"), "--min-layer-sqnr", "inf"],
        ("--min-layer-sqnr", "not a finite number"),
    )


@case("validate/min-top1-above-one", 2)
def _(w):
    return (
        ["validate", w.copy("mo"), "--data", w.copy("ids", "ids.npy"), "--min-top1", "1.5"],
        ("--min-top1", "0<=x<=1"),
    )


# ------------------------------------------------------------------------- export --to, check, train, quickstart


@case("export/to-a-container-that-is-not-safetensors", 2)
def _(w):
    return _export(w, "--to", "gguf"), ("--to", "gguf")


@case("check/json-out-into-a-missing-folder", 2)
def _(w):
    return ["check", w.copy("mo"), "--json-out", w.path("nowhere/report.json")], ("--json-out", "nowhere")


@case("train/unknown-key-lists-the-known-ones", 2)
def _(w):
    return (
        ["train", "data=" + w.file("c.txt", "text " * 100), "stepz=3", f"out={w.path('run')}"],
        ("stepz", "known keys", "steps"),
    )


@case("quickstart/out-is-a-file", 1)
def _(w):
    return ["quickstart", "--out", w.file("qs", "not a folder")], ("qs",)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_and_changes_nothing(case, pristine, tmp_path, monkeypatch, hub_env):
    run_case(case, pristine, tmp_path, monkeypatch)


def test_every_case_is_for_a_command():
    from nvfp4tool.cli import cli

    assert {c.id.split("/")[0] for c in CASES} <= set(cli.commands)
    assert len({c.id for c in CASES}) == len(CASES) and os.path.basename(__file__).startswith("test_adversarial_")
