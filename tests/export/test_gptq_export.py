"""`nvfp4tool export --weight-rounding gptq` on the tiny fixtures: the CLI in-process, `check`, the
provenance's per-linear output errors, the option errors, the sequential pass (layer 1's Hessian
comes from inputs through layer 0's QUANTIZED weights), and a MoE model."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
from click.testing import CliRunner

from nvfp4tool.check import check_checkpoint
from nvfp4tool.cli import cli
from nvfp4tool.config import ModelConfig
from nvfp4tool.export import gptq_pass
from nvfp4tool.export.calibrate import load_calibration_ids, open_bf16_model
from nvfp4tool.export.plan import make_plan
from nvfp4tool.families import ATTENTION_MOE
from nvfp4tool.numerics import dequantize_nvfp4
from nvfp4tool.recipes.precision import GEMM_INPUT_DTYPE
from nvfp4tool.records.export import ExportRecord

from fixtures.export_fixtures import CALIB_SAMPLES, CALIB_SEQ_LEN, synthetic_config, synthetic_source
from fixtures.hf_fixtures import build_tiny_model

CONFIG = synthetic_config(hidden=64, mlp=128, layers=2, vocab=256, head_dim=16, kv_heads=2, dtype="bfloat16")
CALIB = ["--calib-samples", str(CALIB_SAMPLES), "--calib-seq-len", str(CALIB_SEQ_LEN)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gptq")
    src, calib = synthetic_source(root, CONFIG, seed=5)
    return root, src, calib


@pytest.mark.parametrize(
    "fmt, quant, extra",
    [
        ("modelopt", "nvfp4", []),
        pytest.param(
            "compressed-tensors",
            "nvfp4-weight-only",
            ["--weight-block", "2d", "--scale-search", "4over6"],
            marks=pytest.mark.slow,
        ),
        ("compressed-tensors", "nvfp4", ["--gptq-block-scales", "updated"]),
    ],
)
def test_gptq_export_passes_check_and_records_lower_output_errors(tiny, fmt, quant, extra):
    root, src, calib = tiny
    out = str(root / f"{fmt}-{quant}")
    result = CliRunner().invoke(
        cli,
        [
            "export",
            src,
            "--out",
            out,
            "--format",
            fmt,
            "--quant",
            quant,
            "--calib-data",
            calib,
            *CALIB,
            "--weight-rounding",
            "gptq",
            *extra,
        ],
    )
    assert result.exit_code == 0, result.output
    assert "below RTN's" in result.output
    # piped: the sequential pass reports progress lines, one layer a step (test_progress_lines.py)
    assert re.search(r"Z GPTQ: done, 2/2 layer \(100%\).* elapsed ", result.stderr), result.stderr
    report = check_checkpoint(out)
    assert report.ok, [p.line() for p in report.problems]
    record = ExportRecord.read(out)
    assert record.weight_rounding == "gptq"
    assert record.calibration.file == os.path.basename(calib)  # also weight-only: the data GPTQ used
    assert (record.calibration.samples, record.calibration.tokens) == (CALIB_SAMPLES, CALIB_SAMPLES * CALIB_SEQ_LEN)
    assert (record.gptq.damp, record.gptq.block_size) == (0.05, 128)
    assert record.gptq.block_scales == ("updated" if "updated" in extra else "original")
    assert len(record.layers) == 14
    after = np.array([e.output_rel_err for e in record.layers.values()])
    before = np.array([e.rtn_output_rel_err for e in record.layers.values()])
    assert (before > 0).all() and after.mean() < 0.8 * before.mean(), (after, before)
    assert record.gptq.mean_output_err_reduction == pytest.approx(float(np.mean(1 - after / before)))
    assert not [f for f in os.listdir(root) if f.startswith(".")]  # no temporary folder or spill left
    assert ".gptq-spill" not in os.listdir(out)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--weight-rounding", "gptq"], "--weight-rounding gptq needs --calib-data"),
        (
            ["--weight-rounding", "gptq", "--quant", "fp8", "--calib-data", "CALIB"],
            "--quant nvfp4 or nvfp4-weight-only",
        ),
        (["--gptq-block-scales", "updated", "--calib-data", "CALIB"], "it needs --weight-rounding gptq"),
        (
            ["--weight-rounding", "gptq", "--gptq-block-scales", "new", "--calib-data", "CALIB"],
            "Invalid value for '--gptq-block-scales'",
        ),
        *[
            (
                ["--weight-rounding", "gptq", "--gptq-damp", damp, "--calib-data", "CALIB"],
                "Invalid value for '--gptq-damp'",
            )
            for damp in ("0", "-1", "nan", "inf", "1e300", "1.5")
        ],
    ],
)
def test_bad_options_are_usage_errors(tiny, argv, message):
    root, src, calib = tiny
    argv = [calib if a == "CALIB" else a for a in argv]
    result = CliRunner().invoke(cli, ["export", src, "--out", str(root / "bad"), *argv])
    assert result.exit_code == 2, result.output
    assert len([line for line in result.output.splitlines() if message in line]) == 1, result.output
    assert not os.path.exists(root / "bad")


@pytest.mark.parametrize("damp", [0.0, -1.0, float("nan"), float("inf"), 1e300, 1.0000001])
def test_the_library_refuses_a_damp_outside_0_1_too(tiny, damp):
    from nvfp4tool.errors import NVFP4UsageError
    from nvfp4tool.export import ExportOptions, export_checkpoint

    root, src, calib = tiny
    with pytest.raises(NVFP4UsageError, match="--gptq-damp must be > 0.0 and <= 1.0"):
        export_checkpoint(
            src,
            str(root / "bad"),
            ExportOptions(weight_rounding="gptq", gptq_damp=damp, calib_data=calib, show_progress=False),
        )
    assert not os.path.exists(root / "bad")


def test_layer_1_hessian_comes_from_layer_0_quantized(tiny, monkeypatch):
    root, src, calib = tiny
    from nvfp4tool.checkpoints import open_checkpoint

    source = open_checkpoint(src)
    plan = make_plan(source.config, "nvfp4")
    seen = {}
    real = gptq_pass.gptq_quantize

    def spy(w, h, **kw):
        seen[kw["name"]] = np.array(h)
        return real(w, h, **kw)

    monkeypatch.setattr(gptq_pass, "gptq_quantize", spy)
    amax = {}
    for m in plan.quantized:
        amax[plan.group_of(m)] = max(
            amax.get(plan.group_of(m), np.float32(0)),
            np.float32(np.abs(np.asarray(source.tensors.get(f"{m}.weight"), np.float32)).max()),
        )
    result = gptq_pass.run_gptq(
        source.config,
        source.tensors,
        plan,
        amax,
        calib,
        spill_dir=str(root),
        samples=CALIB_SAMPLES,
        seq_len=CALIB_SEQ_LEN,
        tokenizer_dir=None,
        offload="never",
        method="rtn",
        block="1d",
        damp=0.05,
    )
    # the same Hessian recomputed independently: a streamed model whose layer 0 linears are the records
    quantized = {
        f"{m}.weight": np.asarray(dequantize_nvfp4(result.records.get(m), GEMM_INPUT_DTYPE))
        for m in plan.quantized
        if m.startswith("model.layers.0.")
    }

    class Source:
        def get(self, name):
            return quantized[name] if name in quantized else source.tensors.get(name)

    def hessian_of_layer_1_q(tensors):
        model = open_bf16_model(source.config, tensors, seq_len=CALIB_SEQ_LEN, offload="always", what="test")
        found = {}
        tap = gptq_pass._Hessians(frozenset({"model.layers.*.self_attn.q_proj"}))
        ids = load_calibration_ids(
            calib, samples=CALIB_SAMPLES, seq_len=CALIB_SEQ_LEN, tokenizer_dir=None, vocab_size=source.config.vocab_size
        )
        for _ in model.logits(ids, 8, tap=tap, on_record=lambda n, v: found.setdefault(n, np.asarray(v))):
            pass
        return found["model.layers.1.self_attn.q_proj"]

    expected = hessian_of_layer_1_q(Source())
    got = seen["model.layers.1.self_attn.q_proj.weight"]
    original = hessian_of_layer_1_q(source.tensors)
    np.testing.assert_array_equal(got, expected)  # held (the pass) and streamed (here) agree exactly
    # measured: the originals' Hessian differs by ~1e-3 of its max (the quantization error of layer 0)
    assert np.abs(original - expected).max() > 1e-4 * np.abs(expected).max()
    # q, k, v share the Hessian of their input
    np.testing.assert_array_equal(
        seen["model.layers.1.self_attn.q_proj.weight"], seen["model.layers.1.self_attn.v_proj.weight"]
    )


def test_moe_gptq_export(tmp_path):
    src = build_tiny_model("qwen3_moe", str(tmp_path / "hf"))
    calib = str(tmp_path / "calib.npy")
    np.save(calib, np.random.default_rng(0).integers(3, 256, (4, 16)))
    out = str(tmp_path / "out")
    result = CliRunner().invoke(
        cli,
        [
            "export",
            src,
            "--out",
            out,
            "--calib-data",
            calib,
            "--calib-samples",
            "4",
            "--calib-seq-len",
            "16",
            "--weight-rounding",
            "gptq",
        ],
    )
    assert result.exit_code == 0, result.output
    report = check_checkpoint(out)
    assert report.ok, [p.line() for p in report.problems]
    record = ExportRecord.read(out)
    config = ModelConfig.from_hf_folder(src)
    experts = [m for m in record.layers if ".experts." in m]
    assert len(experts) == 3 * config.family_config.num_experts * sum(
        config.layer_kind(i) == ATTENTION_MOE for i in range(config.num_layers)
    )
    assert all(
        e.output_rel_err is not None and e.output_rel_err < e.rtn_output_rel_err
        for m, e in record.layers.items()
        if m.endswith("experts.0.down_proj")
    ), record.layers
    assert json.load(open(os.path.join(out, "config.json")))["quantization_config"]
