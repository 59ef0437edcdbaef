"""A finished two-step NVFP4 training run, built once per session and shared by
tests/test_gemm_backend.py and tests/test_adversarial_backend.py (import `nvfp4_run` into the test
module; pytest makes one fixture per importing module, so the built paths are kept here too): a
synthetic 1-block HF student (the pristine model's widths, a 320-token vocabulary), a byte-level
BPE tokenizer, a text file, and the run (every linear but lm_head in nvfp4, grad_accum=2, both
checkpoints kept) trained with quantizer / gemm left "auto"."""

from __future__ import annotations

import dataclasses

import pytest
from adversarial_harness import CONFIG, TEXT
from bench_convert import write_synthetic_hf_folder
from click.testing import CliRunner

from nvfp4tool.cli import cli
from nvfp4tool.train.tokenizer import train_bpe_tokenizer

VOCAB = 320  # the student's embedding; the tokenizer has at most 300 tokens
_BUILT: dict[str, str] = {}  # the session's run, once built


def run_args(paths: dict[str, str], out: str, *extra: str) -> list[str]:
    """The run's `train` arguments (a resume passes them again, with resume=true)."""
    return [
        f"model={paths['student']}",
        f"tokenizer={paths['tok']}",
        f"data={paths['data']}",
        "recipe=nvfp4",
        "bf16_first_layers=0",
        "bf16_last_layers=0",
        "steps=2",
        "seq_len=16",
        "batch_size=4",
        "grad_accum=2",
        "eval_every=0",
        "eval_batches=1",
        "checkpoint_every=1",
        f"out={out}",
        *extra,
    ]


@pytest.fixture(scope="session")
def nvfp4_run(tmp_path_factory) -> dict[str, str]:
    """ "data", "tok", "student" and "nvrun" (the finished run; the adversarial World copies these
    keys); "log" holds the run's output."""
    if _BUILT:
        return dict(_BUILT)
    root = tmp_path_factory.mktemp("nvfp4-run")
    paths = dict(
        data=str(root / "t.txt"), tok=str(root / "tok"), student=str(root / "student"), nvrun=str(root / "nvrun")
    )
    with open(paths["data"], "w") as f:
        f.write(TEXT)
    train_bpe_tokenizer([TEXT], 300, paths["tok"])
    write_synthetic_hf_folder(paths["student"], dataclasses.replace(CONFIG, vocab_size=VOCAB, num_layers=1), seed=5)
    result = CliRunner().invoke(cli, ["train", *run_args(paths, paths["nvrun"])])
    assert result.exit_code == 0, result.output
    paths["log"] = result.output
    _BUILT.update(paths)
    return dict(paths)
