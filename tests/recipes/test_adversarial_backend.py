"""The adversarial corpus of `nvfp4tool train`'s GEMM backend (issue 22 item 4): the `quantizer=` /
`gemm=` keys and the backend a run records in run.json (`gemm_backend`), which a resume reads and
compares. Each case is one bad input, run in-process by `adversarial_harness.run_case`: exit code,
one `Error:` line naming the key / file, nothing created or changed. Fixture: `nvfp4_run`
(tests/fixtures/backend_fixtures.py, a finished two-step NVFP4 run with both checkpoints)."""

from __future__ import annotations

from typing import ClassVar

import jax
import pytest

from nvfp4tool.run.records import RunRecord

from fixtures.adversarial_harness import Case, World, edit_json, registrar, run_case
from fixtures.backend_fixtures import run_args

CASES: list[Case] = []
case = registrar(CASES)
ON_CPU = jax.default_backend() == "cpu"


class _Paths:
    """The fixture's paths, for the builders (set by the test before each case runs)."""

    current: ClassVar[dict[str, str]] = {}


def _fresh(w: World, *extra: str) -> list[str]:
    return ["train", *run_args(_Paths.current, w.path("run"), *extra)]


def _resume(w: World, *extra: str, edit=None) -> list[str]:
    """Resume a copy of the run, its run.json changed by `edit` (a function of the parsed JSON)."""
    run = w.copy("nvrun")
    if edit is not None:
        edit_json(RunRecord.path(run), edit)
    return ["train", *run_args(_Paths.current, run, "resume=true", *extra)]


# ---- the keys -------------------------------------------------------------------------------

if ON_CPU:

    @case("train/gemm-native-without-scaled-matmul-lowering", 2)
    def _(w):
        return _fresh(w, "gemm=native"), ("gemm='native'", "no lowering on 'cpu'", "gemm=emulated")

    @case("train/gemm-native-from-the-yaml-file", 2)
    def _(w):
        return [*_fresh(w)[:1], w.file("run.yaml", "gemm: native\n"), *_fresh(w)[1:]], ("gemm='native'",)


@case("train/gemm-unknown", 2)
def _(w):
    return _fresh(w, "gemm=fp4"), ("gemm='fp4'", "auto, emulated, native")


@case("train/gemm-empty", 2)
def _(w):
    return _fresh(w, "gemm="), ("gemm cannot be empty",)


@case("train/quantizer-unknown", 2)
def _(w):
    return _fresh(w, "quantizer=triton"), ("quantizer='triton'", "auto, xla, pallas")


# ---- a resume: the key and the recorded backend ---------------------------------------------


@case("train/resume-with-gemm-forced", 1)
def _(w):
    return _resume(w, "gemm=emulated"), ("gemm 'auto' -> 'emulated'",)


@case("train/resume-with-quantizer-forced", 1)
def _(w):
    return _resume(w, "quantizer=pallas"), ("quantizer 'auto' -> 'pallas'",)


if ON_CPU:

    @case("train/resume-of-a-run-that-ran-the-native-gemm", 1)
    def _(w):
        return (
            _resume(w, edit=lambda r: r["gemm_backend"].update(gemm="native")),
            ("the nvfp4 GEMM (gemm native -> emulated)", "cannot resume bit-exactly"),
        )


@case("train/resume-of-a-run-json-with-an-unknown-gemm", 1)
def _(w):
    return _resume(w, edit=lambda r: r["gemm_backend"].update(gemm="fp4")), ("run.json", "gemm_backend: gemm", "'fp4'")


@case("train/resume-of-a-run-json-with-gemm-auto-recorded", 1)
def _(w):
    return _resume(w, edit=lambda r: r["gemm_backend"].update(gemm="auto")), (
        "run.json",
        "gemm_backend: gemm",
        "'auto'",
    )


@case("train/resume-of-a-run-json-with-a-backend-key-missing", 1)
def _(w):
    return _resume(w, edit=lambda r: r["gemm_backend"].pop("quantizer")), ("run.json", "gemm_backend", "quantizer")


@case("train/resume-of-a-run-json-whose-backend-is-not-an-object", 1)
def _(w):
    return _resume(w, edit=lambda r: r.update(gemm_backend="xla")), ("run.json", "gemm_backend")


@case("train/resume-of-a-run-json-whose-backend-contradicts-its-config", 1)
def _(w):
    def edit(r):
        r["config"]["quantizer"] = "xla"
        r["gemm_backend"]["quantizer"] = "pallas"

    return _resume(w, edit=edit), ("run.json", "gemm_backend: quantizer", "config.quantizer is 'xla'")


@case("train/resume-of-a-bf16-run-json-with-a-backend", 1)
def _(w):
    return _resume(w, edit=lambda r: r["config"].update(recipe="bf16")), ("run.json", "recorded for recipe 'bf16'")


@case("train/resume-of-a-run-json-with-gemm-not-a-choice", 1)
def _(w):
    return _resume(w, edit=lambda r: r["config"].update(gemm="fast")), ("run.json", "gemm='fast'")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
@pytest.mark.slow  # > 15 s of the inner loop (tests/durations.json)
def test_bad_input_is_one_line_and_changes_nothing(case, nvfp4_run, tmp_path, monkeypatch, hub_env):
    _Paths.current = nvfp4_run
    run_case(case, nvfp4_run, tmp_path, monkeypatch)
