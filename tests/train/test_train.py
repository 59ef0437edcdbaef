"""The trainer end to end on the tiny preset: outputs, bit-exact resume, non-finite handling,
the HF folder it writes (loaded by transformers), and the same losses on 8 devices and 2 processes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nvfp4tool.corpus.sources import embedded_corpus
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.run.config import load_train_config
from nvfp4tool.train.metrics import read_metrics
from nvfp4tool.train.trainer import train

from fixtures import REPO_ROOT

REPO = Path(REPO_ROOT)


@pytest.fixture(scope="module")
def tokenizer_dir(corpus_tokenizer):
    return corpus_tokenizer


def _args(tokenizer_dir, out, **extra):
    train_txt, val_txt = embedded_corpus()
    args = dict(
        model="tiny",
        data=str(train_txt),
        eval_data=str(val_txt),
        tokenizer=str(tokenizer_dir),
        recipe="nvfp4",
        steps=6,
        seq_len=32,
        batch_size=8,
        lr=3e-3,
        warmup_steps=2,
        eval_every=3,
        eval_batches=2,
        out=str(out),
        seed=1,
    )
    args.update(extra)
    return [f"{k}={v}" for k, v in args.items()]


def _run(tokenizer_dir, out, **extra):
    return train(load_train_config(None, _args(tokenizer_dir, out, **extra)))


@pytest.mark.slow  # > 15 s of the inner loop (tests/durations.json)
def test_run_outputs_and_bit_exact_resume(tokenizer_dir, tmp_path):
    out = tmp_path / "run"
    full = _run(tokenizer_dir, out, checkpoint_every=3)
    assert sorted(full.losses) == [1, 2, 3, 4, 5, 6]
    assert full.losses[6] < full.losses[1]  # it learns
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"} <= set(records[0])
    assert "eval_loss" in records[2] and "eval_loss" not in records[1]
    for name in (
        "run.json",
        "loss.png",
        "loss.json",
        "hf/config.json",
        "hf/model.safetensors",
        "hf/tokenizer.json",
        "hf/input_amax.json",
        "hf/precision_map.json",
    ):
        assert (out / name).is_file(), name
    amax = json.loads((out / "hf/input_amax.json").read_text())
    pmap = json.loads((out / "hf/precision_map.json").read_text())
    assert set(amax) == {n for n, p in pmap.items() if p == "nvfp4"} and all(v > 0 for v in amax.values())
    final_weights = (out / "hf/model.safetensors").read_bytes()

    # "Kill" after step 3: drop the later checkpoint, resume, and replay steps 4-6.
    import shutil

    shutil.rmtree(out / "checkpoints" / "6")
    resumed = _run(tokenizer_dir, out, checkpoint_every=3, resume=True)
    assert sorted(resumed.losses) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed.losses[step] == full.losses[step], step  # to the last bit
    assert resumed.eval_losses[6] == full.eval_losses[6]
    assert (out / "hf/model.safetensors").read_bytes() == final_weights
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4, 5, 6]


def test_existing_output_needs_force_and_resume_checks_config(tokenizer_dir, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "something").write_text("x")
    with pytest.raises(NVFP4ToolError, match="already exists"):
        _run(tokenizer_dir, out)
    with pytest.raises(NVFP4ToolError, match="not a run folder"):
        _run(tokenizer_dir, tmp_path / "missing", resume=True)


def test_nonfinite_step_stops_or_is_skipped(tokenizer_dir, tmp_path):
    with pytest.raises(NVFP4ToolError, match=r"step \d: non-finite loss"):
        _run(
            tokenizer_dir,
            tmp_path / "stop",
            recipe="bf16",
            lr=1e30,
            warmup_steps=0,
            clip_norm=1e30,
            steps=4,
            checkpoint_every=1,
        )
    skipped = _run(
        tokenizer_dir,
        tmp_path / "skip",
        recipe="bf16",
        lr=1e30,
        warmup_steps=0,
        clip_norm=1e30,
        steps=4,
        on_nonfinite="skip",
    )
    records = read_metrics(tmp_path / "skip")
    assert any(r.get("skipped") for r in records) and len(skipped.losses) == 4


def test_trained_hf_folder_loads_in_transformers_with_our_logits(tokenizer_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from converters.hf import HFFolderSource
    from nvfp4tool.model import forward, model_from_tensors

    out = tmp_path / "run"
    _run(tokenizer_dir, out, recipe="bf16", steps=2, eval_every=0)
    hf_dir = out / "hf"
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    ids = tok("To be, or not to be", return_tensors="pt")["input_ids"]
    ref = AutoModelForCausalLM.from_pretrained(str(hf_dir), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref_logits = ref(ids).logits.numpy()
    source = HFFolderSource(hf_dir)
    ours = forward(model_from_tensors(source.config, source), np.asarray(ids.numpy()))
    assert np.abs(np.asarray(ours) - ref_logits).max() < 1e-4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _subprocess_run(args: list[str], env_extra: dict[str, str]) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **env_extra}
    code = (
        "import sys, json; from nvfp4tool.run.config import load_train_config; "
        "from nvfp4tool.train.trainer import train; "
        "r = train(load_train_config(None, sys.argv[1:])); "
        "print('LOSSES=' + json.dumps(r.losses))"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _losses(proc: subprocess.Popen) -> dict[int, float]:
    output, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, output[-3000:]
    line = [text for text in output.splitlines() if text.startswith("LOSSES=")][-1]
    return {int(k): v for k, v in json.loads(line.removeprefix("LOSSES=")).items()}


@pytest.mark.slow
def test_same_losses_on_8_devices_and_2_processes(tokenizer_dir, tmp_path):
    # the children start first and compile while this process runs the one-device reference
    eight_proc = _subprocess_run(
        _args(tokenizer_dir, tmp_path / "eight", steps=3, eval_every=0, mesh_fsdp=2),
        {"XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"},
    )
    port = _free_port()
    procs = [
        _subprocess_run(
            _args(
                tokenizer_dir,
                tmp_path / "two",
                steps=3,
                eval_every=0,
                mesh_fsdp=2,
                num_processes=2,
                process_id=i,
                coordinator_address=f"127.0.0.1:{port}",
            ),
            {"XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"},
        )
        for i in range(2)
    ]
    try:
        reference = _run(tokenizer_dir, tmp_path / "one", steps=3, eval_every=0).losses
        eight = _losses(eight_proc)
        two = [_losses(p) for p in procs]
    finally:
        for p in (eight_proc, *procs):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert two[0] == two[1]
    for other in (eight, two[0]):
        assert sorted(other) == [1, 2, 3]
        # Sharded reductions sum in another order: the first loss agrees to fp32 noise; after
        # that, 1-ulp gradient differences can flip single FP4 codes (measured: 6e-5 relative at
        # step 3 on 8 devices), so later steps get a small, drift-free bound.
        np.testing.assert_allclose(other[1], reference[1], rtol=1e-5)
        np.testing.assert_allclose([other[s] for s in (2, 3)], [reference[s] for s in (2, 3)], rtol=5e-4)


@pytest.mark.slow  # > 15 s of the inner loop (tests/durations.json)
def test_gradient_accumulation_matches_the_full_batch(tokenizer_dir, tmp_path):
    """Two micro-batches of 4 average to the gradient of the batch of 8 (bf16: no rounding noise
    from quantizers; fp32 sums in another order only)."""
    one = _run(tokenizer_dir, tmp_path / "one", recipe="bf16", steps=3, eval_every=0).losses
    two = _run(tokenizer_dir, tmp_path / "two", recipe="bf16", steps=3, eval_every=0, grad_accum=2).losses
    np.testing.assert_allclose([two[s] for s in (1, 2, 3)], [one[s] for s in (1, 2, 3)], rtol=2e-3)
    assert two[1] == pytest.approx(one[1], rel=1e-5)  # step 1: same weights, same 8 sequences


def test_plot_command_overlays_runs(tokenizer_dir, tmp_path):
    from click.testing import CliRunner

    from nvfp4tool.cli import cli

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(
            "".join(
                json.dumps({"step": s, "loss": 5.0 - 0.1 * s + (0.05 if name == "b" else 0.0)}) + "\n"
                for s in range(1, 6)
            )
        )
    out_png = tmp_path / "cmp.png"
    result = CliRunner().invoke(cli, ["plot", str(tmp_path / "a"), str(tmp_path / "b"), "-o", str(out_png)])
    assert result.exit_code == 0, result.output
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    series = json.loads(out_png.with_suffix(".json").read_text())
    assert series["b"]["gap_pct_vs_first"][0] == pytest.approx(100 * 0.05 / 4.9)


@pytest.mark.slow
def test_fine_tune_from_a_maxtext_checkpoint_and_write_maxtext(tokenizer_dir, tmp_path):
    """Train from a MaxText checkpoint (converted from the tiny run's HF folder) and write the
    final weights as MaxText too; the MaxText output converts back to the run's HF weights."""
    from converters.hf import HFFolderSource
    from nvfp4tool.convert import convert_checkpoint

    base = _run(tokenizer_dir, tmp_path / "base", recipe="bf16", steps=1, eval_every=0)
    convert_checkpoint(str(base.hf_dir), str(tmp_path / "mt"), to="maxtext", rope_layout="half")
    run = _run(
        tokenizer_dir,
        tmp_path / "ft",
        model=str(tmp_path / "mt"),
        model_config=str(base.hf_dir / "config.json"),
        rope_layout="half",
        steps=2,
        eval_every=0,
        export_maxtext=True,
    )
    assert (run.out / "maxtext").is_dir()
    convert_checkpoint(
        str(run.out / "maxtext"),
        str(tmp_path / "back"),
        to="hf",
        model_config=str(base.hf_dir / "config.json"),
        rope_layout="half",
        dtype="bf16",
    )
    ours, back = HFFolderSource(run.hf_dir), HFFolderSource(tmp_path / "back")
    for name in ours.names():
        np.testing.assert_array_equal(np.asarray(back.get(name)), np.asarray(ours.get(name)), err_msg=name)
