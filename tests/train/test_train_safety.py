"""`nvfp4tool train` leaves no debris and no stale state: a failed start creates nothing (and the
corrected command then just works), a resume that cannot continue bit-exactly is refused without
touching the run (run.json byte-identical), and a deleted checkpoint is reported by what exists."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from converters.hf import write_hf_folder
from converters.tensor_source import DictTensorSource
from nvfp4tool.cli import cli
from nvfp4tool.config import ModelConfig
from nvfp4tool.corpus.sources import embedded_corpus
from nvfp4tool.corpus.tokenizer import train_bpe_tokenizer
from nvfp4tool.run.records import RunRecord
from nvfp4tool.train.metrics import read_metrics


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_inputs")
    text = embedded_corpus()[1].read_text(encoding="utf-8")[:12000]
    (root / "corpus.txt").write_text(text, encoding="utf-8")
    train_bpe_tokenizer([text], 300, root / "tokenizer")
    (root / "empty.txt").write_text("")
    (root / "binary.txt").write_bytes(b"\xff\xfe\x00\x81" * 64)
    (root / "bad.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    (root / "corpus_dir").mkdir()
    (root / "corpus_dir" / "a.txt").write_text(text, encoding="utf-8")
    config = ModelConfig(
        family="llama",
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        dtype="float32",
    )
    rng = np.random.default_rng(0)
    write_hf_folder(
        root / "hf_no_tokenizer",
        config,
        DictTensorSource(
            {n: rng.standard_normal(s).astype(np.float32) for n, s in config.expected_tensor_shapes().items()}
        ),
    )
    return root


def _train(*args: str):
    return CliRunner().invoke(cli, ["train", *args])


def _base(inputs: Path, out: Path, **extra) -> list[str]:
    args = dict(
        model="tiny",
        data=inputs / "corpus.txt",
        tokenizer=inputs / "tokenizer",
        recipe="bf16",
        steps=2,
        seq_len=16,
        batch_size=4,
        eval_every=0,
        eval_batches=1,
        out=out,
    )
    args.update(extra)
    return [f"{k}={v}" for k, v in args.items()]


def _tree(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else b"<dir>") for p in sorted(folder.rglob("*"))
    }


# (case, overrides of the base command, exit code)
EARLY_FAILURES = [
    ("missing data", {"data": "{tmp}/nope.txt"}, 2),
    ("empty data", {"data": "{in}/empty.txt"}, 1),
    ("empty data, tokenizer trained here", {"data": "{in}/empty.txt", "tokenizer": "train"}, 1),
    ("binary data", {"data": "{in}/binary.txt"}, 1),
    ("bad JSONL line", {"data": "{in}/bad.jsonl"}, 1),
    ("batch larger than the data", {"batch_size": 4096}, 1),
    ("missing model", {"model": "{tmp}/no-model"}, 2),
    ("model folder without a tokenizer", {"model": "{in}/hf_no_tokenizer", "tokenizer": "None"}, 1),
    ("output inside the data folder", {"data": "{in}/corpus_dir", "out": "{in}/corpus_dir/run"}, 2),
    ("output is the model folder", {"model": "{in}/hf_no_tokenizer", "out": "{in}/hf_no_tokenizer"}, 2),
]


def test_early_failures_create_nothing_and_the_corrected_run_works(inputs, tmp_path):
    out = tmp_path / "run"
    inputs_before = _tree(inputs)
    for case, overrides, code in EARLY_FAILURES:
        values = {k: str(v).replace("{tmp}", str(tmp_path)).replace("{in}", str(inputs)) for k, v in overrides.items()}
        args = [a for a in _base(inputs, Path(values.pop("out", out)), **values) if not a.endswith("=None")]
        result = _train(*args)
        assert result.exit_code == code, (case, result.output)
        errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
        assert len(errors) == 1 and "Traceback" not in result.output, (case, result.output)
        assert os.listdir(tmp_path) == [], case  # no run folder, no tokenizer, nothing
        assert _tree(inputs) == inputs_before, case  # the inputs are untouched (no run inside them)
    result = _train(*_base(inputs, out))
    assert result.exit_code == 0, result.output
    assert RunRecord.exists(out) and (out / "hf" / "model.safetensors").is_file()


def test_missing_model_folder_is_not_found_not_no_tokenizer(inputs, tmp_path):
    result = _train(*_base(inputs, tmp_path / "run", model=tmp_path / "llama", tokenizer="train"))
    assert result.exit_code == 2  # a path that names nothing is bad usage, in every command
    assert result.output.strip().splitlines()[-1] == f"Error: model={tmp_path / 'llama'}: not found"


@pytest.mark.slow  # two short training runs of the tiny model
def test_resume_that_cannot_continue_bit_exactly_is_refused_without_side_effects(inputs, tmp_path):
    data = tmp_path / "data.txt"
    data.write_bytes((inputs / "corpus.txt").read_bytes())
    out = tmp_path / "run"
    base = dict(data=data, tokenizer="train", vocab_size=300, recipe="nvfp4", checkpoint_every=1)
    assert _train(*_base(inputs, out, **base)).exit_code == 0
    run_json = (out / RunRecord.FILE_NAME).read_bytes()
    assert RunRecord.read(out).weight_block == "2d"
    before = _tree(out)

    refused = [
        ({"recipe": "bf16"}, "recipe 'nvfp4' -> 'bf16'"),
        ({"weight_2d": "false"}, "weight_2d True -> False"),  # once silently made exports 1d
        ({"steps": 3}, "steps 2 -> 3"),
        ({"seed": 7}, "seed 0 -> 7"),
        ({"scan_layers": "true"}, "scan_layers 'auto' -> 'true'"),
    ]  # another program: bits may differ
    for overrides, expected in refused:
        result = _train(*_base(inputs, out, **{**base, **overrides}), "resume=true")
        assert result.exit_code == 1, (overrides, result.output)
        assert "cannot resume bit-exactly" in result.output and expected in result.output, result.output
        assert _tree(out) == before, overrides

    data.write_text(data.read_text() + " and some other text", encoding="utf-8")
    result = _train(*_base(inputs, out, **base), "resume=true")
    assert result.exit_code == 1 and "the training data" in result.output, result.output
    assert _tree(out) == before  # the tokenizer trained on the old data is not reused
    data.write_bytes((inputs / "corpus.txt").read_bytes())

    # a resume that can continue does, and leaves run.json as the run started
    import shutil

    shutil.rmtree(out / "checkpoints" / "2")
    result = _train(*_base(inputs, out, **base, eval_every=1), "resume=true")
    assert result.exit_code == 0, result.output
    assert (out / RunRecord.FILE_NAME).read_bytes() == run_json
    assert [r["step"] for r in read_metrics(out)] == [1, 2]

    # the state of step 1 deleted: the message lists the usable checkpoints only
    shutil.rmtree(out / "checkpoints" / "1" / "state")
    result = CliRunner().invoke(cli, ["export", str(out), "--out", str(tmp_path / "x"), "--step", "1"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines()[-1] == f"Error: {out}: no checkpoint for step 1 (have: 2)"
    assert not (tmp_path / "x").exists()


def test_plot_names_a_broken_metrics_line(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss"\n')
    result = CliRunner().invoke(cli, ["plot", str(tmp_path / "a"), "-o", str(tmp_path / "p.png")])
    assert result.exit_code == 1
    assert f"{tmp_path / 'a' / 'metrics.jsonl'}:2: not valid JSON" in result.output
    assert not (tmp_path / "p.png").exists()
