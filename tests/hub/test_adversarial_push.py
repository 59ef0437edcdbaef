"""Adversarial cases for `push`'s chain of custody (issue 21), and the chain-of-custody test.

One export validated for real (module-scoped: a copy of the pristine ModelOpt export `mo`,
`nvfp4tool validate` run in-process against the pristine BF16 source with tiny sizes, `--reference
bf16`), then each case edits a copy of it the way a user, a script or an attacker would after
validation: a weight byte changed (raw, or with the provenance record rewritten to match, so
`check` passes), the provenance record removed or edited, a file added, validation.json's export
or source hashes edited, its verdict or metrics edited, validation.md edited. push must refuse
each with one `Error:` line naming the file, before any staging or upload (`--dry-run` or an
endpoint where nothing listens), and change nothing (`adversarial_harness.run_case`).

`test_chain_of_custody` walks the issue's proof on the same export: the untouched folder
passes (and uploads, byte for byte, to the local test Hub); one weight byte changed, the
provenance record removed, the validated source's hash edited, the provenance's source hash
edited: each refused naming what changed.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
from click.testing import CliRunner

from nvfp4tool.cli import cli

from fixtures.adversarial_harness import DOWN, SEQ, WEIGHTS, Case, World, edit_json, poke, registrar, run_case
from fixtures.hub_server import HubServer

CASES: list[Case] = []
case = registrar(CASES)

LOCAL_NOTHING = "http://127.0.0.1:9"  # nothing listens: push must refuse before it anyway
V = "validation.json"
PROVENANCE = "nvfp4tool_export.json"


@pytest.fixture(scope="module")
def validated(pristine, tmp_path_factory):
    """The pristine fixtures plus "v": the `mo` export, validated by `nvfp4tool validate`."""
    folder = str(tmp_path_factory.mktemp("validated") / "v")
    shutil.copytree(pristine["mo"], folder)
    result = CliRunner().invoke(
        cli,
        [
            "-q",
            "validate",
            folder,
            "--data",
            pristine["ids"],
            "--reference",
            "bf16",
            "--samples",
            "4",
            "--seq-len",
            str(SEQ),
            "--batch-size",
            "4",
            "--prompts",
            "1",
            "--prompt-len",
            "8",
            "--gen-tokens",
            "4",
            "--source",
            pristine["hf"],
        ],
    )
    assert result.exit_code == 0, result.output
    assert result.stderr == "", result.stderr  # --quiet: no progress or compile lines (test_progress_lines.py)
    return {**pristine, "v": folder}


def _dry(folder: str, *args: str) -> list[str]:
    return ["push", folder, "--repo-id", "org/m", "--dry-run", *args]


def _live(folder: str, *args: str) -> list[str]:
    return ["push", folder, "--repo-id", "org/m", "--endpoint", LOCAL_NOTHING, *args]


def _flip_weight_byte(folder: str) -> None:
    poke(os.path.join(folder, WEIGHTS), f"{DOWN}.weight", lambda b: bytes([b[0] ^ 0x11]), size=1)


def _rerecord(folder: str) -> None:
    """Rewrite the provenance record's entries of DOWN as if the export had written the new bytes
    (a check-clean export: only the chain of custody can tell)."""
    from fixtures.validate_fixtures import rerecord

    rerecord(folder, DOWN)


def _rerender(folder: str) -> None:
    """validation.md as validate renders the (edited) validation.json, so the edit under test is the
    only thing that differs."""
    from nvfp4tool.records.validation import ValidationRecord
    from nvfp4tool.validate.report import VALIDATION_MD, markdown

    with open(os.path.join(folder, VALIDATION_MD), "w", encoding="utf-8") as f:
        f.write(markdown(ValidationRecord.read(folder)))


def _edit_validation(folder: str, change) -> str:
    edit_json(os.path.join(folder, V), change)
    _rerender(folder)
    return folder


# ---- the export's files against validation.json --------------------------------------------


@case("push/weight-byte-changed-after-validation", 1)
def _(w):
    v = w.copy("v")
    _flip_weight_byte(v)
    return _dry(v), (os.path.join(v, WEIGHTS), "changed since validation")


@case("push/weight-byte-changed-and-rerecorded-check-clean", 1, hub=True)
def _(w):
    v = w.copy("v")
    _flip_weight_byte(v)
    _rerecord(v)
    return _live(v), (os.path.join(v, WEIGHTS), "changed since validation")


@case("push/provenance-removed-after-validation", 1)
def _(w):
    v = w.copy("v")
    os.remove(os.path.join(v, PROVENANCE))
    return _dry(v), (os.path.join(v, PROVENANCE), "missing")


@case("push/provenance-edited-after-validation", 1, hub=True)
def _(w):
    v = w.copy("v")
    edit_json(os.path.join(v, PROVENANCE), lambda r: r.__setitem__("scale_search", "mse"))
    return _live(v), (os.path.join(v, PROVENANCE), "changed since validation")


@case("push/config-edited-after-validation", 1)
def _(w):
    v = w.copy("v")
    edit_json(os.path.join(v, "config.json"), lambda c: c.__setitem__("license", "mit"))
    return _dry(v), (os.path.join(v, "config.json"), "changed since validation")


@case("push/file-added-after-validation", 1)
def _(w):
    v = w.copy("v")
    w.file("v/tokenizer.json", json.dumps({"model": {"type": "BPE"}}))
    return _dry(v), (os.path.join(v, "tokenizer.json"), "not validated")


@case("push/subfolder-added-after-validation", 1, hub=True)
def _(w):
    v = w.copy("v")
    w.file("v/extra/notes.txt", "written after validation")
    return _live(v), (os.path.join(v, "extra", "notes.txt"), "not validated")


@case("push/weight-file-renamed-after-validation", 1)
def _(w):
    v = w.copy("v")
    os.rename(os.path.join(v, WEIGHTS), os.path.join(v, "model-00001-of-00001.safetensors"))
    return _dry(v), (os.path.join(v, "model-00001-of-00001.safetensors"), "not validated")


@case("push/validation-lists-an-absent-file", 1)
def _(w):
    v = _edit_validation(w.copy("v"), lambda r: r["export"]["sha256"].__setitem__("tokenizer.json", "0" * 64))
    return _dry(v), (os.path.join(v, "tokenizer.json"), "missing")


@case("push/validation-export-hash-edited", 1)
def _(w):
    v = _edit_validation(w.copy("v"), lambda r: r["export"]["sha256"].__setitem__("config.json", "f" * 64))
    return _dry(v), (os.path.join(v, "config.json"), "changed since validation")


@case("push/validation-lists-a-path-outside-the-export", 1)
def _(w):
    w.copy("hf")
    v = _edit_validation(w.copy("v"), lambda r: r["export"]["sha256"].__setitem__("../hf/model.safetensors", "0" * 64))
    return _dry(v), (os.path.join(v, V), "'../hf/model.safetensors'", "not a file inside the export")


@case("push/validation-lists-no-files", 1)
def _(w):
    v = _edit_validation(w.copy("v"), lambda r: r["export"].__setitem__("sha256", {}))
    return _dry(v), (os.path.join(v, "config.json"), "not validated")


@case("push/weight-changed-with-no-validation-flag", 1)
def _(w):
    v = w.copy("v")
    _flip_weight_byte(v)
    return _dry(v, "--no-validation"), (os.path.join(v, WEIGHTS), "changed since validation")


# ---- the validated source against the provenance's ------------------------------------------


@case("push/validation-source-hash-edited", 1)
def _(w):
    v = _edit_validation(w.copy("v"), lambda r: r["source"]["sha256"].__setitem__(WEIGHTS, "e" * 64))
    return _dry(v), (os.path.join(v, V), f"weight file '{WEIGHTS}' differs", "not a validation of this export's source")


@case("push/validation-source-name-edited", 1, hub=True)
def _(w):
    v = _edit_validation(w.copy("v"), lambda r: r["source"].__setitem__("name", "meta-llama/Llama-3.2-1B"))
    return _live(v), (os.path.join(v, V), "'meta-llama/Llama-3.2-1B'", "(same weight files)")


@case("push/validation-source-step-edited", 1)
def _(w):
    v = _edit_validation(w.copy("v"), lambda r: r.__setitem__("source_step", 40))
    return _dry(v), (os.path.join(v, V), "at step 40")


@case("push/validation-source-has-an-extra-weight-file", 1)
def _(w):
    v = _edit_validation(w.copy("v"), lambda r: r["source"]["sha256"].__setitem__("extra.safetensors", "1" * 64))
    return _dry(v), (os.path.join(v, V), "'extra.safetensors'")


@case("push/validation-source-config-hash-edited", 1)
def _(w):
    v = _edit_validation(w.copy("v"), lambda r: r["source_config_files"].__setitem__("config.json", "e" * 64))
    return _dry(v), (os.path.join(v, V), "'config.json' that defines the source differs", "not a validation")


@case("push/validation-source-config-hashes-removed", 1)
def _(w):
    v = _edit_validation(w.copy("v"), lambda r: r.__setitem__("source_config_files", None))
    return _dry(v), (os.path.join(v, V), "no hashes of the source's config")


@case("push/validation-source-has-an-extra-config-file", 1, hub=True)
def _(w):
    v = _edit_validation(
        w.copy("v"), lambda r: r["source_config_files"].__setitem__("generation_config.json", "1" * 64)
    )
    return _live(v), (os.path.join(v, V), "'generation_config.json'")


@case("push/source-mismatch-not-allowed-by-an-edited-flag", 1)
def _(w):
    """source_mismatch_ok false, the hashes differ: the flag is what allows it, nothing else."""
    v = _edit_validation(
        w.copy("v"),
        lambda r: (r["source"]["sha256"].__setitem__(WEIGHTS, "e" * 64), r.__setitem__("source_mismatch_ok", False)),
    )
    return _dry(v), (os.path.join(v, V), "not a validation of this export's source")


# ---- validation.json's own claims -------------------------------------------------------------


@case("push/validation-passed-with-failures", 1)
def _(w):
    failure = {"metric": "kl_mean", "value": 0.5, "limit": 0.1, "by": 0.4, "detail": "nvfp4 vs bf16"}
    v = _edit_validation(w.copy("v"), lambda r: r.__setitem__("failures", [failure]))
    return _dry(v), (os.path.join(v, V), "passed is true but it lists 1 failed limit(s) (kl_mean)")


@case("push/validation-metric-edited-past-its-threshold", 1, hub=True)
def _(w):
    v = _edit_validation(w.copy("v"), lambda r: r["models"]["nvfp4"].__setitem__("kl_mean", 3.0))
    return _live(v), (os.path.join(v, V), "its own metrics fail its thresholds", "kl_mean")


@case("push/validation-layer-sqnr-edited-below-its-threshold", 1)
def _(w):
    v = _edit_validation(w.copy("v"), lambda r: r["layers"][0]["weight_sqnr_db"].__setitem__("nvfp4", 3.0))
    return _dry(v), (os.path.join(v, V), "layer_weight_sqnr_db")


@case("push/validation-metric-nan", 1)
def _(w):
    v = _edit_validation(w.copy("v"), lambda r: r["models"]["nvfp4"].__setitem__("kl_p99", "nan"))
    return _dry(v), (os.path.join(v, V), "kl_p99")


@case("push/validation-threshold-removed", 1)
def _(w):
    v = _edit_validation(w.copy("v"), lambda r: r["thresholds"].pop("max_kl_p99"))
    return _dry(v), (os.path.join(v, V), "missing limit 'max_kl_p99'")


@case("push/validation-threshold-unknown", 1)
def _(w):
    v = _edit_validation(w.copy("v"), lambda r: r["thresholds"].__setitem__("max_anything", 1.0))
    return _dry(v), (os.path.join(v, V), "unknown limit 'max_anything'")


@case("push/validation-quant-edited", 1)
def _(w):
    v = _edit_validation(w.copy("v"), lambda r: r.__setitem__("quant", "nvfp4-weight-only"))
    return _dry(v), (os.path.join(v, V), "modelopt nvfp4-weight-only export")


@case("push/validation-format-edited", 1)
def _(w):
    v = _edit_validation(w.copy("v"), lambda r: r.__setitem__("format", "compressed-tensors"))
    return _dry(v), (os.path.join(v, V), "compressed-tensors nvfp4 export")


@case("push/validation-claims-an-fp8-reference-it-did-not-run", 1)
def _(w):
    v = _edit_validation(w.copy("v"), lambda r: r.__setitem__("reference", "fp8 (exported on the fly from the source)"))
    return _dry(v), (os.path.join(v, V), "no FP8 column")


@case("push/validation-metrics-of-the-export-removed", 1)
def _(w):
    v = _edit_validation(w.copy("v"), lambda r: r["models"].pop("nvfp4"))
    return _dry(v), (os.path.join(v, V), "no metrics of 'nvfp4'")


@case("push/validation-md-edited", 1, hub=True)
def _(w):
    v = w.copy("v")
    with open(os.path.join(v, "validation.md"), "a", encoding="utf-8") as f:
        f.write("\n| KL mean (nats) | 0.00001 |\n")
    return _live(v), (os.path.join(v, "validation.md"), "differs from what validation.json says")


@case("push/validation-json-is-a-folder", 1)
def _(w):
    v = w.copy("v")
    os.remove(os.path.join(v, V))
    os.makedirs(os.path.join(v, V))
    return _dry(v), (os.path.join(v, V),)


@case("push/validation-json-removed-but-md-kept", 1)
def _(w):
    v = w.copy("v")
    os.remove(os.path.join(v, V))
    return _dry(v), (os.path.join(v, V), "no validation report")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
@pytest.mark.slow  # > 15 s of the inner loop (tests/durations.json)
def test_bad_input_is_one_line_and_changes_nothing(case, validated, tmp_path, monkeypatch, hub_env):
    run_case(case, validated, tmp_path, monkeypatch)


# ---------------------------------------------------------------------------------------- chain of custody


def _copy(validated, tmp_path, name):
    return World(str(tmp_path), validated).copy("v", name)


def _dry_run(folder):
    result = CliRunner().invoke(cli, _dry(folder))
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    return result.exit_code, errors, result.output


def test_chain_of_custody(validated, tmp_path, hub_env):
    """The untouched validated export passes and uploads byte for byte; one byte of a weight, the
    provenance record, the validated source's hash or the provenance's source hash changed:
    refused, naming it."""
    untouched = _copy(validated, tmp_path, "untouched")
    code, errors, output = _dry_run(untouched)
    assert code == 0 and errors == [], output
    with HubServer() as hub:
        result = CliRunner().invoke(cli, ["push", untouched, "--repo-id", "org/m", "--endpoint", hub.url])
        assert result.exit_code == 0, result.output
        received = hub.files[("org/m", "main")]
    for name in os.listdir(untouched):
        with open(os.path.join(untouched, name), "rb") as f:
            assert received[name] == f.read(), name
    assert set(received) == {*os.listdir(untouched), "README.md"}

    weight = _copy(validated, tmp_path, "weight")
    _flip_weight_byte(weight)
    code, errors, _ = _dry_run(weight)
    assert code == 1 and len(errors) == 1 and f"{os.path.join(weight, WEIGHTS)}: changed since validation" in errors[0]

    no_record = _copy(validated, tmp_path, "no-record")
    os.remove(os.path.join(no_record, PROVENANCE))
    code, errors, _ = _dry_run(no_record)
    assert code == 1 and len(errors) == 1 and os.path.join(no_record, PROVENANCE) in errors[0]

    source_hash = _copy(validated, tmp_path, "source-hash")
    _edit_validation(source_hash, lambda r: r["source"]["sha256"].__setitem__(WEIGHTS, "e" * 64))
    code, errors, _ = _dry_run(source_hash)
    assert code == 1 and len(errors) == 1
    assert os.path.join(source_hash, V) in errors[0] and f"weight file '{WEIGHTS}' differs" in errors[0]

    provenance_source = _copy(validated, tmp_path, "provenance-source")
    edit_json(
        os.path.join(provenance_source, PROVENANCE), lambda r: r["source"]["files"].__setitem__(WEIGHTS, "d" * 64)
    )
    code, errors, _ = _dry_run(provenance_source)
    assert code == 1 and len(errors) == 1
    assert f"{os.path.join(provenance_source, PROVENANCE)}: changed since validation" in errors[0]


def test_source_mismatch_ok_is_published_with_one_warning_and_the_banner(validated, tmp_path, hub_env):
    """A validation that says `source_mismatch_ok` (validate --source-mismatch-ok) is pushed: one
    Warning line, the card's banner at the top and in the validation section."""
    folder = _copy(validated, tmp_path, "mismatch")
    _edit_validation(
        folder,
        lambda r: (r["source"]["sha256"].__setitem__(WEIGHTS, "e" * 64), r.__setitem__("source_mismatch_ok", True)),
    )
    code, errors, output = _dry_run(folder)
    assert code == 0 and errors == [], output
    warnings = [line for line in output.splitlines() if "validated against a source that is not the export's" in line]
    assert len(warnings) == 1 and f"'{WEIGHTS}' differs" in warnings[0]
    assert re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ )?Warning: ", warnings[0])  # piped: a log line's stamp first
    assert output.count("> **Validated against another source**") == 2
