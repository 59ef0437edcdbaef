"""validate's side of issue 21's chain of custody, on the adversarial corpus's tiny model (conftest's
`pristine`): the untouched source/export pair validates and validation.json hashes what push
uploads; a source with one byte changed is refused naming the file, and `--source-mismatch-ok`
runs and records it; reports are not replaced without --force; the on-the-fly FP8 reference is
calibrated on calibration data, never on --data; a SIGTERM'd validate leaves nothing, and the
scratch of a kill -9 is removed by the next run."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
from click.testing import CliRunner

from nvfp4tool.cli import cli
from nvfp4tool.records.export import ExportRecord, sha256_file
from nvfp4tool.records.validation import ValidationRecord
from nvfp4tool.validate.report import REPORT_FILES
from nvfp4tool.validate.runner import SCRATCH_PREFIX, ValidateOptions, open_inputs

from fixtures import REPO_ROOT
from fixtures.adversarial_harness import CONFIG, DOWN, SEQ, WEIGHTS, poke

ROOT = REPO_ROOT
SMALL = ["--samples", "4", "--seq-len", str(SEQ), "--prompts", "1", "--prompt-len", "8", "--gen-tokens", "2"]


@pytest.fixture
def pair(pristine, tmp_path):
    """Copies of the BF16 source and its ModelOpt NVFP4 export."""
    for key in ("hf", "mo"):
        shutil.copytree(pristine[key], tmp_path / key)
    return str(tmp_path / "hf"), str(tmp_path / "mo"), pristine["ids"]


def _validate(export, source, ids, *args):
    return CliRunner().invoke(
        cli, ["-q", "validate", export, "--source", source, "--data", ids, "--reference", "bf16", *SMALL, *args]
    )


def _hashes(folder):
    return {f: sha256_file(os.path.join(folder, f)) for f in sorted(os.listdir(folder))}


@pytest.mark.slow  # two validations
def test_chain_of_custody_validate_side(pair):
    from nvfp4tool.validate.custody import upload_files

    source, export, ids = pair
    result = _validate(export, source, ids)
    assert result.exit_code == 0, result.output
    record = ValidationRecord.read(export)
    assert not record.source_mismatch_ok
    # the export's hashes: exactly what push uploads, less the reports and the generated card
    uploaded = set(upload_files(export)) - set(REPORT_FILES)
    assert (
        set(record.export.sha256)
        == uploaded
        >= {WEIGHTS, "config.json", "nvfp4tool_export.json", "hf_quant_config.json"}
    )
    assert all(record.export.sha256[f] == sha256_file(os.path.join(export, f)) for f in uploaded)
    assert record.source.sha256 == ExportRecord.read(export).source.files
    # the files that define the source besides its weights are bound too (issue 39)
    assert record.source_config_files == ExportRecord.read(export).source.config_files
    assert set(record.source_config_files) >= {"config.json"}

    before = _hashes(export)
    again = _validate(export, source, ids)  # a rerun does not replace the reports silently
    assert again.exit_code == 1 and "validation.json: already exists; pass --force" in again.output, again.output
    assert _hashes(export) == before

    poke(os.path.join(source, WEIGHTS), f"{DOWN}.weight", lambda b: bytes([b[0] ^ 1]), index=100, size=1)
    refused = _validate(export, source, ids, "--force")
    assert refused.exit_code == 1, refused.output
    error = [line for line in refused.output.splitlines() if line.startswith("Error:")]
    assert len(error) == 1 and os.path.join(source, WEIGHTS) in error[0] and "--source-mismatch-ok" in error[0]
    assert _hashes(export) == before

    forced = _validate(export, source, ids, "--force", "--source-mismatch-ok")
    assert forced.exit_code == 0, forced.output
    assert "note: --source-mismatch-ok" in forced.output and WEIGHTS in forced.output
    record = ValidationRecord.read(export)
    assert record.source_mismatch_ok
    assert record.source.sha256[WEIGHTS] == sha256_file(os.path.join(source, WEIGHTS))


def _fp8_reference(export, data, **kw):
    """(the on-the-fly FP8 reference's provenance record, what the validation records about its
    calibration), and the scratch folder (gone once the inputs are closed)."""
    options = ValidateOptions(data=data, reference="fp8", samples=4, seq_len=SEQ, **kw)
    with open_inputs(export, options) as inputs:
        return ExportRecord.read(os.path.join(inputs.scratch, "fp8")), inputs.reference_calibration, inputs.scratch


def test_fp8_reference_is_calibrated_on_calibration_data_never_on_the_evaluation_data(pristine, tmp_path):
    rng = np.random.default_rng(7)
    other = str(tmp_path / "other.npy")
    np.save(other, rng.integers(0, CONFIG.vocab_size, (8, SEQ)))
    exported = ExportRecord.read(pristine["mo"]).input_amax

    # without --calib-data: the W4A4 export's own calibrated input amax, whatever --data is
    records = [_fp8_reference(pristine["mo"], data) for data in (pristine["ids"], other)]
    for fp8, said, scratch in records:
        assert fp8.input_amax == {m: exported[m] for m in fp8.input_amax} and fp8.input_amax
        assert fp8.calibration is None and said == "the export's input amax (calibrated on `ids.npy`)"
        assert not os.path.exists(scratch)

    # with --calib-data: calibrated on it (not on --data), and recorded
    calib = str(tmp_path / "calib.npy")
    np.save(calib, rng.integers(0, CONFIG.vocab_size, (4, SEQ)))
    amax = []
    for data in (pristine["ids"], other):
        fp8, said, _ = _fp8_reference(pristine["mo"], data, calib_data=calib, calib_samples=4, calib_seq_len=SEQ)
        assert fp8.calibration.file == "calib.npy" and said.startswith("calibration data `calib.npy`")
        amax.append(fp8.input_amax)
    assert amax[0] == amax[1] and amax[0] != {m: exported[m] for m in amax[0]}


# ---- signals and kills ---------------------------------------------------------------------


def _start(pair, system_tmp):
    source, export, ids = pair
    env = {
        **os.environ,
        "TMPDIR": str(system_tmp),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
    }
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "nvfp4tool.cli",
            "-q",
            "validate",
            export,
            "--source",
            source,
            "--data",
            ids,
            "--reference",
            "bf16",
            *SMALL,
            "--samples",
            "8",
            "--gen-tokens",
            "64",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and child.poll() is None:
        spools = glob.glob(os.path.join(system_tmp, SCRATCH_PREFIX + "*", "bf16.logits"))
        if spools:
            return child, os.path.dirname(spools[0])
        time.sleep(0.05)
    child.kill()
    raise AssertionError(f"no spool appeared: {child.communicate()[0].decode()}")


@pytest.mark.slow  # two validate processes
def test_sigterm_leaves_nothing_and_a_kill_9_scratch_is_removed_by_the_next_run(pair, tmp_path, monkeypatch):
    source, export, ids = pair
    system_tmp = tmp_path / "system-tmp"
    system_tmp.mkdir()
    before = _hashes(export)

    child, scratch = _start(pair, system_tmp)
    child.send_signal(signal.SIGTERM)
    output = child.communicate(timeout=120)[0].decode()
    assert child.returncode == 128 + signal.SIGTERM, output
    assert "Traceback" not in output and os.listdir(system_tmp) == [] and _hashes(export) == before

    child, scratch = _start(pair, system_tmp)
    child.send_signal(signal.SIGKILL)
    child.communicate(timeout=60)
    assert os.path.isfile(os.path.join(scratch, "bf16.logits"))  # what a kill -9 leaves
    monkeypatch.setattr(tempfile, "tempdir", str(system_tmp))
    with open_inputs(export, ValidateOptions(data=ids, reference="bf16", source=source, samples=2, seq_len=SEQ)):
        assert not os.path.exists(scratch)  # removed by the next run's scratch folder
    assert os.listdir(system_tmp) == [] and _hashes(export) == before


# ---- a training-run source -----------------------------------------------------------------


@pytest.mark.slow  # trains a tiny run (2 steps, a checkpoint at step 2) and exports it twice
def test_a_run_export_binds_to_the_run_at_its_recorded_step(tmp_path):
    from nvfp4tool.corpus.sources import embedded_corpus, iter_documents
    from nvfp4tool.corpus.tokenizer import train_bpe_tokenizer
    from nvfp4tool.export import ExportOptions, export_checkpoint
    from nvfp4tool.run.config import load_train_config
    from nvfp4tool.train.trainer import train

    train_txt, val_txt = embedded_corpus()
    train_bpe_tokenizer(iter_documents(train_txt), 384, tmp_path / "tok")
    run = tmp_path / "run"
    args = dict(
        model="tiny",
        data=str(train_txt),
        eval_data=str(val_txt),
        tokenizer=str(tmp_path / "tok"),
        recipe="nvfp4",
        steps=2,
        seq_len=32,
        batch_size=4,
        lr=3e-3,
        warmup_steps=1,
        eval_every=0,
        checkpoint_every=2,
        out=str(run),
        seed=1,
    )
    train(load_train_config(None, [f"{k}={v}" for k, v in args.items()]))
    for name, step in (("final", None), ("step2", 2)):
        export_checkpoint(str(run), str(tmp_path / name), ExportOptions(step=step, show_progress=False))
    ids = str(tmp_path / "ids.npy")
    np.save(ids, np.random.default_rng(0).integers(0, 384, (2, 16)))

    for name, step in (("final", None), ("step2", 2)):  # --source RUN: at the step the record names
        options = ValidateOptions(data=ids, reference="fp8", source=str(run), samples=2, seq_len=16)
        with open_inputs(str(tmp_path / name), options) as inputs:
            assert inputs.source.step == step and inputs.source_mismatch is None
            assert inputs.reference_calibration == "the training run's tracked input amax"

    # the run's hf/ folder is other bytes' container than the recorded run: refused, by name
    result = CliRunner().invoke(
        cli,
        [
            "validate",
            str(tmp_path / "final"),
            "--source",
            str(run / "hf"),
            "--data",
            ids,
            "--reference",
            "bf16",
            "--samples",
            "2",
            "--seq-len",
            "16",
        ],
    )
    assert result.exit_code == 1 and "an HF folder" in result.output and "a training run" in result.output, (
        result.output
    )


def test_a_provenance_record_written_before_config_files_were_bound_still_validates(pair):
    """An export record without `source.config_files` (an older nvfp4tool) reads, and only its
    weight files are compared: a source with another config.json is not refused for it."""
    from fixtures.adversarial_harness import edit_json

    source, export, ids = pair
    edit_json(os.path.join(export, ExportRecord.FILE_NAME), lambda r: r["source"].pop("config_files"))
    assert ExportRecord.read(export).source.config_files is None
    edit_json(os.path.join(source, "config.json"), lambda c: c.update(rope_theta=123456.0))
    options = ValidateOptions(data=ids, reference="bf16", samples=4, seq_len=SEQ, source=source)
    with open_inputs(export, options) as inputs:
        assert inputs.source_mismatch is None
