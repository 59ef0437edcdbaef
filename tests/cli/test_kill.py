"""kill -9 of every writing command at deterministic points (tests/fixtures/kill_child.py): never a
complete-looking broken output, an existing output intact (or restored), and a rerun that succeeds,
removes the temporary folder the kill left and says so.

Per command and point: the child runs the command on a tiny model and is SIGKILLed at the point;
then the output folder must be absent (or the previous output, unchanged), and the rerun (in
process, with --force where an output existed) must leave exactly the output, equal to an
uninterrupted run's, next to nothing else. A GPTQ export is killed during its GPTQ pass, during the
write and before the rename (its spill lies inside the output's temporary folder, so the same
cleaning covers it), and SIGTERM'd (cli.main: nothing left at all, without a rerun).
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from converters.atomic import MARKER_FILE
from converters.hf import HFFolderSource, write_hf_folder
from converters.maxtext import MaxTextSource
from converters.tensor_source import DictTensorSource
from nvfp4tool import progress
from nvfp4tool.cli import cli
from nvfp4tool.config import ModelConfig

from fixtures import REPO_ROOT
from fixtures.file_fixtures import Recorder
from fixtures.kill_fixtures import kill_at

ROOT = Path(REPO_ROOT)
CONFIG = ModelConfig(
    family="llama",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    dtype="bfloat16",
)

# command -> (arguments with {hf}, {mt}, {export}, {out} placeholders, output kind)
COMMANDS = {
    "convert hf->maxtext": (["convert", "{hf}", "{out}", "--to", "maxtext", "--rope-layout", "half"], "maxtext"),
    "convert maxtext->hf": (
        ["convert", "{mt}", "{out}", "--to", "hf", "--model-config", "{hf}", "--rope-layout", "half"],
        "hf",
    ),
    "convert hf->hf": (["convert", "{hf}", "{out}", "--to", "hf", "--dtype", "fp32", "--max-shard-size", "40KB"], "hf"),
    "export": (["export", "{hf}", "--out", "{out}", "--quant", "nvfp4-weight-only"], "hf"),
    "convert-format": (["convert-format", "{export}", "{out}", "--to", "compressed-tensors"], "hf"),
}
CASES = [(command, point) for command in COMMANDS for point in ("start", "mid", "publish")] + [
    ("convert hf->hf", "replace"),
    ("export", "replace"),
    ("convert hf->maxtext", "replace"),
]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    """The tiny inputs ({hf}, {mt}, {export}) and each command's uninterrupted output."""
    root = tmp_path_factory.mktemp("kill")
    rng = np.random.default_rng(0)
    tensors = {n: (rng.standard_normal(s) * 0.1).astype(np.float32) for n, s in CONFIG.expected_tensor_shapes().items()}
    paths = {"hf": str(root / "hf"), "mt": str(root / "mt"), "export": str(root / "export")}
    write_hf_folder(paths["hf"], CONFIG, DictTensorSource(tensors), dtype="bf16")
    _cli(["convert", paths["hf"], paths["mt"], "--to", "maxtext", "--rope-layout", "half"])
    _cli(["export", paths["hf"], "--out", paths["export"], "--quant", "nvfp4-weight-only"])
    for command, (args, _) in COMMANDS.items():
        _cli(_fill(args, paths, str(root / "reference" / command.replace(" ", "_").replace(">", ""))))
    return paths


def _reference(inputs: dict[str, str], command: str) -> str:
    return str(Path(inputs["hf"]).parent / "reference" / command.replace(" ", "_").replace(">", ""))


def _fill(args: list[str], paths: dict[str, str], out: str) -> list[str]:
    return [a.format(out=out, **paths) for a in args]


def _cli(args: list[str]):
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, (args, result.output)
    return result


def _rerun(args: list[str]) -> str:
    """Run the command again in process (exit 0); what it said: status lines, from a recording
    reporter or rendered by the CLI itself, and its output."""
    recorder = Recorder()
    previous = progress.use_reporter(recorder)
    try:
        result = _cli(args)
    finally:
        progress.use_reporter(previous)
    return "\n".join(recorder.lines) + result.output


def _tensors(folder: str, kind: str) -> dict[str, bytes]:
    source = HFFolderSource(folder, check_config=False) if kind == "hf" else MaxTextSource(folder, CONFIG, "half")
    return {n: source.get(n).tobytes() for n in source.names()}


@pytest.mark.slow
@pytest.mark.parametrize("command, point", CASES, ids=[f"{c}@{p}" for c, p in CASES])
def test_kill_9_leaves_no_broken_output_and_the_rerun_cleans_up(inputs, tmp_path, command, point):
    args, kind = COMMANDS[command]
    out = tmp_path / "outs" / "out"
    reference = _tensors(_reference(inputs, command), kind)
    existing = point == "replace"
    if existing:  # a previous output, to be replaced with --force
        shutil.copytree(_reference(inputs, command), out)
        (out / "previous.txt").write_text("the previous output")
    args = _fill(args, inputs, str(out)) + (["--force"] if existing else [])

    tmp, pid = kill_at(point, args, tmp_path / "ready")

    left = sorted(os.listdir(out.parent))
    assert os.path.basename(tmp) in left and os.path.basename(tmp).startswith(".out.tmp-")
    written = [name for name in os.listdir(tmp) if name != MARKER_FILE]
    assert bool(written) == (point != "start"), written  # killed before / while / after writing
    if existing:  # moved aside, not lost: the rerun puts it back before replacing it
        assert "out" not in left and any(name.startswith(".out.old-") for name in left), left
    else:
        assert "out" not in left, left  # never a complete-looking broken output

    said = _rerun(args)
    assert f"removed {tmp}: temporary folder of an interrupted run (pid {pid})" in said, said
    assert sorted(os.listdir(out.parent)) == ["out"]
    assert not (out / "previous.txt").exists()
    assert _tensors(str(out), kind) == reference


@pytest.fixture(scope="module")
def tokenizer_dir(corpus_tokenizer) -> str:
    return str(corpus_tokenizer)


@pytest.mark.slow
@pytest.mark.parametrize("point", ["start", "publish"])
def test_kill_9_in_trains_final_write_and_the_resume_cleans_up(tokenizer_dir, tmp_path, point):
    """train's final HF folder (run/hf) is written atomically too: killed while writing it, the
    run has no hf/ (only its checkpoints), and resume=true writes it and removes the debris."""
    from nvfp4tool.corpus.sources import embedded_corpus

    train_txt, val_txt = embedded_corpus()
    run = tmp_path / "run"
    args = [
        "train",
        "model=tiny",
        f"data={train_txt}",
        f"eval_data={val_txt}",
        f"tokenizer={tokenizer_dir}",
        "recipe=bf16",
        "steps=2",
        "seq_len=32",
        "batch_size=8",
        "eval_every=0",
        f"out={run}",
        "seed=1",
    ]
    tmp, pid = kill_at(point, args, tmp_path / "ready", tmp_prefix=".hf.tmp-")  # not the run folder's
    assert Path(tmp).parent == run and Path(tmp).name.startswith(".hf.tmp-")
    assert not (run / "hf").exists()  # no complete-looking broken folder

    said = _rerun(args + ["resume=true"])
    assert f"removed {tmp}: temporary folder of an interrupted run (pid {pid})" in said, said
    assert not any(name.startswith(".hf.") for name in os.listdir(run))
    assert len(HFFolderSource(run / "hf").names()) == len(HFFolderSource(run / "hf").config.expected_tensor_shapes())


@pytest.mark.slow
def test_kill_9_while_rechunking_a_maxtext_stack_the_rerun_removes_the_scratch(inputs, tmp_path, monkeypatch):
    """A MaxText checkpoint saved by plain Orbax (chunks span layers) is re-chunked into a scratch
    folder in the system temporary folder; killed mid-read, the next run removes that folder."""
    import orbax.checkpoint as ocp

    tree = ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).restore(os.path.join(inputs["mt"], "0", "items"))
    orbax_saved = str(tmp_path / "orbax")
    manager = ocp.CheckpointManager(orbax_saved, item_names=("items",))
    manager.save(0, args=ocp.args.Composite(items=ocp.args.PyTreeSave(tree)))
    manager.wait_until_finished()
    system_tmp = tmp_path / "system-tmp"
    system_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(system_tmp))
    args = _fill(COMMANDS["convert maxtext->hf"][0], {**inputs, "mt": orbax_saved}, str(tmp_path / "out"))

    _, pid = kill_at("mid", args, tmp_path / "ready")
    scratch = [p for p in system_tmp.iterdir() if p.name.startswith("nvfp4tool-maxtext-")]
    assert len(scratch) == 1, scratch
    assert [p for p in scratch[0].iterdir() if p.name != MARKER_FILE]  # re-chunked stacks left behind

    monkeypatch.setattr("tempfile.tempdir", str(system_tmp))
    said = _rerun(args)
    assert f"removed {scratch[0]}: scratch folder of an interrupted run (pid {pid})" in said, said
    assert not scratch[0].exists()
    assert _tensors(str(tmp_path / "out"), "hf") == _tensors(_reference(inputs, "convert maxtext->hf"), "hf")


GPTQ_EXPORT = [
    "export",
    "{hf}",
    "--out",
    "{out}",
    "--quant",
    "nvfp4-weight-only",
    "--weight-rounding",
    "gptq",
    "--calib-data",
    "{ids}",
    "--calib-samples",
    "4",
    "--calib-seq-len",
    "16",
]


@pytest.fixture(scope="module")
def gptq_reference(inputs) -> dict[str, str]:
    """The inputs plus calibration ids ({ids}) and an uninterrupted GPTQ export of {hf} ("reference")."""
    root = Path(inputs["hf"]).parent
    paths = dict(inputs, ids=str(root / "gptq-ids.npy"), reference=str(root / "reference" / "gptq"))
    np.save(paths["ids"], np.random.default_rng(1).integers(0, CONFIG.vocab_size, (4, 16)))
    _cli(_fill(GPTQ_EXPORT, paths, paths["reference"]))
    return paths


@pytest.mark.slow
@pytest.mark.parametrize("point", ["gptq", "write", "publish"])
def test_kill_9_during_a_gptq_export_leaves_only_what_the_rerun_cleans(gptq_reference, tmp_path, point):
    """GPTQ's spilled records lie inside the output's temporary folder: killed during the GPTQ
    pass, during the write or after it (before the rename), the run leaves that one marked folder
    (spill included), and the rerun into the same output removes it and writes the clean bytes."""
    out = tmp_path / "outs" / "out"
    args = _fill(GPTQ_EXPORT, gptq_reference, str(out))

    tmp, pid = kill_at(point, args, tmp_path / "ready")

    assert sorted(os.listdir(out.parent)) == [os.path.basename(tmp)]  # nothing else next to the output
    assert os.path.basename(tmp).startswith(".out.tmp-") and (Path(tmp) / MARKER_FILE).exists()
    spill = Path(tmp) / ".gptq-spill"
    if point == "publish":
        assert not spill.exists()  # removed before publishing
    else:
        assert len(list(spill.iterdir())) >= 2 * 2  # the first two linears' codes and scales at least
    assert (Path(tmp) / "model.safetensors").exists() == (point != "gptq")

    said = _rerun(args)
    assert f"removed {tmp}: temporary folder of an interrupted run (pid {pid})" in said, said
    assert sorted(os.listdir(out.parent)) == ["out"]
    assert sorted(os.listdir(out)) == sorted(os.listdir(gptq_reference["reference"]))
    assert _tensors(str(out), "hf") == _tensors(gptq_reference["reference"], "hf")


@pytest.mark.slow
def test_sigterm_during_a_gptq_export_removes_every_temporary(gptq_reference, tmp_path, point="gptq"):
    """SIGTERM (cli.main turns it into SystemExit) unwinds the export: no output, no temporary
    folder, no spill, without a rerun; exit status 143."""
    out = tmp_path / "outs" / "out"
    ended: list = []
    kill_at(
        point, _fill(GPTQ_EXPORT, gptq_reference, str(out)), tmp_path / "ready", sig=signal.SIGTERM, returncode=ended
    )
    assert ended[0][0] == 128 + signal.SIGTERM, ended
    assert not out.parent.exists() or os.listdir(out.parent) == [], os.listdir(out.parent)
