"""`export --auto-precision KL --kv-cache fp8` (issue 41): the search measures what is served with
the FP8 KV cache. A tiny llama with a planted large K amax in layer 0 (a rotary pair of K dims x
PLANT, the q rows that meet them / PLANT: the same scores, but the per-tensor FP8 K scale flushes
every other K value of the layer to zero); the written export served with its stored K / V scales
as validate's +fp8-kv run serves it measures the recorded KL (round-to-nearest and GPTQ), the
recorded measurements differ from the same search without the KV cache, the KV cache alone above
the target is refused, and the record, card and validate line say it."""

from __future__ import annotations

import dataclasses
import math
import os

import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import load_file, save_file

from converters.hf import HFFolderSource
from nvfp4tool.cli import cli
from nvfp4tool.config import ModelConfig
from nvfp4tool.export import ExportOptions, export_checkpoint
from nvfp4tool.export.auto_precision import BITS, MARGIN
from nvfp4tool.export.plan import make_plan
from nvfp4tool.export.simulate import ServedKVTap, load_export, served_linear
from nvfp4tool.model.layerwise import LayerwiseModel
from nvfp4tool.model.linear import Plain
from nvfp4tool.model.transformer import forward
from nvfp4tool.model.weights import model_from_tensors
from nvfp4tool.numerics import metrics
from nvfp4tool.records.export import AutoPrecisionRecord
from nvfp4tool.records.validation import SearchedTarget
from nvfp4tool.validate.runner import searched_target

from fixtures.hf_fixtures import build_tiny_model
from fixtures.validate_fixtures import validation_record

TARGET = 0.025  # without the KV cache uniform W4A4 meets it (~0.014); with it (~0.026) it does not
PLANT = 3e5  # K amax x PLANT in layer 0: its K scale ~ 900 (the other layer's ~ 0.006)
KEEP = "model.layers.0.self_attn.[qkv]_proj"  # the planted q / k rows stay BF16 (NVFP4 would lose the q rows)


@pytest.fixture(scope="module")
def searched(tmp_path_factory) -> dict[str, str]:
    """The planted source, its calibration windows (2 x 16), the search exported through the CLI
    with --kv-cache fp8 (`kv`) and the same search without it (`plain`)."""
    root = tmp_path_factory.mktemp("auto-kv")
    src = build_tiny_model("llama3", str(root / "hf"))
    tensors = load_file(os.path.join(src, "model.safetensors"))
    head_dim = 16
    for d in (0, head_dim // 2):  # a rotary pair of KV head 0 (rotate_half pairs d with d + 8) ...
        tensors["model.layers.0.self_attn.k_proj.weight"][d] *= PLANT
        for h in (0, 1):  # ... and the query heads that read KV head 0 (4 heads, 2 KV heads)
            tensors["model.layers.0.self_attn.q_proj.weight"][h * head_dim + d] /= PLANT
    save_file(tensors, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
    calib = str(root / "calib.npy")
    np.save(calib, np.random.default_rng(0).integers(0, 256, (4, 16)))  # 2 calibration + 2 searched
    out = {"src": src, "calib": calib, "kv": str(root / "kv"), "plain": str(root / "plain")}
    args = ["export", src, "--out", out["kv"], "--auto-precision", str(TARGET), "--calib-data", calib]
    args += ["--calib-samples", "2", "--calib-seq-len", "16", "--auto-precision-samples", "2"]
    args += ["--keep-bf16", KEEP, "--kv-cache", "fp8"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert "with the FP8 KV cache: calibration KL" in result.output
    options = ExportOptions(
        auto_precision=TARGET,
        auto_precision_samples=2,
        calib_data=calib,
        calib_samples=2,
        calib_seq_len=16,
        keep_bf16=(KEEP,),
    )  # the same search without --kv-cache
    export_checkpoint(src, out["plain"], dataclasses.replace(options, show_progress=False))
    return out


def test_the_written_export_served_with_its_kv_scales_measures_the_recorded_kl(searched):
    """The export as written served with its stored K / V scales as validate serves its +fp8-kv
    model, against the BF16 source on the calibration windows: the recorded final KL. Served
    without its KV scales it measures another KL (the KV cache matters here), and the bits are the
    recorded ones."""
    record = AutoPrecisionRecord.read(searched["kv"])
    final = record.steps[-1]
    ids = np.load(searched["calib"])[2:].astype(np.int32)
    assert load_export(searched["kv"]).kv_cache == "fp8"
    kl = _served_kl(searched["kv"], searched["src"], ids)
    assert kl == pytest.approx(final.measured_kl, rel=1e-3)
    assert kl <= MARGIN * TARGET and record.met
    assert _served_kl(searched["kv"], searched["src"], ids, kv=False) < 0.7 * final.measured_kl
    config = ModelConfig.from_hf_folder(searched["src"])
    exported = load_export(searched["kv"])
    shapes = config.expected_tensor_shapes()
    plan = make_plan(config, "nvfp4", keep_bf16=(KEEP,))
    weights = {m: math.prod(shapes[f"{m}.weight"]) for m in plan.quantized}
    stored = {m: exported.quant_of(m) if m in exported.quantized else "bf16" for m in plan.quantized}
    bits = sum(weights[m] * BITS[stored[m]] for m in weights) / sum(weights.values())
    assert bits == pytest.approx(final.bits_per_weight) and bits > BITS["nvfp4"]


def _served_kl(folder: str, src: str, ids: np.ndarray, *, kv: bool = True) -> float:
    """The export `folder` (load_export, its stored weights) run as validate runs its +fp8-kv model
    (layer by layer, `ServedKVTap` with its stored K / V scales, `kv_aux`; `kv` False: whole, no KV
    cache) against the BF16 source (whole, no KV cache) on the windows `ids`: the mean KL."""
    config = ModelConfig.from_hf_folder(src)
    source = model_from_tensors(config, HFFolderSource(src), dtype=None, compute_dtype=jnp.float32)
    reference = np.asarray(forward(source, ids, linear=served_linear))
    exported = load_export(folder)
    if not kv:
        served = forward(exported.model(jnp.float32), ids, linear=served_linear)
        return float(metrics.token_kl(reference, np.asarray(served)).mean())
    held = LayerwiseModel.held(exported.model(jnp.float32))
    runs = held.logits(ids, 2, tap=Plain(served_linear), aux=exported.kv_aux, kv_tap=ServedKVTap())
    return float(metrics.token_kl(reference, np.concatenate([np.asarray(x) for _, x in runs])).mean())


def test_with_gptq_the_search_measures_the_kv_scales_the_gptq_pass_calibrated(searched, tmp_path):
    """--weight-rounding gptq: the K / V amax come from the GPTQ pass (`with_gptq`), the search runs
    after it; the written export served with its KV scales measures the recorded KL."""
    out = str(tmp_path / "gptq")
    options = ExportOptions(
        auto_precision=TARGET,
        calib_data=searched["calib"],
        calib_samples=2,
        auto_precision_samples=2,
        calib_seq_len=16,
        keep_bf16=(KEEP,),
        kv_cache="fp8",
        weight_rounding="gptq",
        show_progress=False,
    )
    export_checkpoint(searched["src"], out, options)
    record = AutoPrecisionRecord.read(out)
    assert (record.kv_cache, record.weight_rounding) == ("fp8", "gptq") and record.kv_cache_kl > 0
    ids = np.load(searched["calib"])[2:].astype(np.int32)
    assert _served_kl(out, searched["src"], ids) == pytest.approx(record.steps[-1].measured_kl, rel=1e-3)


def test_a_planted_k_amax_moves_the_search_off_the_bf16_kv_cache_one(searched):
    """Every measurement ran with the FP8 KV cache: every unit's BF16 entry is the KV cache's own KL
    (not 0), the uniform points differ from the search without it (FP8 W8A8 several-fold), and so
    does the result: without the KV cache uniform W4A4 meets the target, with it units are upgraded."""
    kv, plain = AutoPrecisionRecord.read(searched["kv"]), AutoPrecisionRecord.read(searched["plain"])
    assert (kv.kv_cache, plain.kv_cache, plain.kv_cache_kl) == ("fp8", None, None)
    floor = kv.kv_cache_kl
    assert 0 < floor < MARGIN * TARGET
    assert all(u.kl_alone["bf16"] == floor for u in kv.units) and all(u.kl_alone["bf16"] == 0 for u in plain.units)
    for f in plain.uniform:
        assert kv.uniform[f]["kl"] != plain.uniform[f]["kl"], f
    assert kv.uniform["fp8"]["kl"] > 5 * plain.uniform["fp8"]["kl"] and kv.uniform["fp8"]["kl"] > floor
    assert kv.uniform["nvfp4"]["kl"] > MARGIN * TARGET >= plain.uniform["nvfp4"]["kl"]
    assert len(plain.steps) == 1 and plain.steps[-1].bits_per_weight == BITS["nvfp4"]
    assert kv.steps[-1].bits_per_weight > BITS["nvfp4"] and kv.steps[-1].measured_kl <= MARGIN * TARGET
    # the additive prediction counts the KV cache's KL once
    assert kv.steps[0].predicted_kl == pytest.approx(floor + sum(u.kl_alone["nvfp4"] - floor for u in kv.units))


def test_record_precision_file_card_and_validate_line_say_the_kv_cache(searched):
    from nvfp4tool.check import check_checkpoint
    from nvfp4tool.hub.card import build_model_card

    record = AutoPrecisionRecord.read(searched["kv"])
    assert "with the FP8 KV cache" in record.precision_file.splitlines()[0]
    report = check_checkpoint(searched["kv"])
    assert report.ok, report.problems
    card = build_model_card(searched["kv"], report, repo_id="me/tiny-auto-kv", validation=None)
    assert f"as served with its FP8 KV cache (alone: KL {record.kv_cache_kl:.4g})" in card
    found = searched_target(searched["kv"])
    assert found.kv_cache == "fp8" and "with the FP8 KV cache on 32" in found.line(0.01)
    assert searched_target(searched["plain"]).kv_cache is None
    # a record written before the KV fields reads as a BF16-KV-cache search
    old = {k: v for k, v in record.to_json().items() if k not in ("kv_cache", "kv_cache_kl")}
    assert AutoPrecisionRecord.from_json(old).kv_cache is None


def test_a_kv_cache_above_the_target_alone_is_refused_in_one_line(searched, tmp_path):
    """The KV cache's own KL (every linear BF16) above the margin: exit 1 naming it, nothing written."""
    out = tmp_path / "o"
    args = ["export", searched["src"], "--out", str(out), "--auto-precision", "0.01", "--calib-data", searched["calib"]]
    args += ["--calib-samples", "2", "--calib-seq-len", "16", "--auto-precision-samples", "2"]
    args += ["--keep-bf16", KEEP, "--kv-cache", "fp8"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1, result.output
    line = result.output.strip().splitlines()[-1]
    assert "--auto-precision 0.01: not met: the FP8 KV cache alone" in line and "--kv-cache none" in line
    assert not out.exists()


def test_validate_sets_the_target_beside_the_run_it_was_searched_as():
    """A validation of an export searched with the FP8 KV cache compares the target with its
    +fp8-kv run's held-out KL; searched without it (or no such run), with the export's."""
    searched = SearchedTarget(
        kl_target=0.02, margin=0.9, calibration_kl=0.015, bits_per_weight=5.0, calibration_tokens=32
    )
    with_kv = dataclasses.replace(searched, kv_cache="fp8")
    models = {"bf16": {"ppl": 9.5}, "nvfp4": {"kl_mean": 0.011}, "nvfp4+fp8-kv": {"kl_mean": 0.031}}
    record = dataclasses.replace(validation_record(), models=models, searched=with_kv)
    assert record.searched_as("fp8") == "nvfp4+fp8-kv" and record.searched_as(None) == "nvfp4"
    assert "held-out KL mean here with the FP8 KV cache 0.031, ABOVE the target 0.02" in record.searched_line()
    record = dataclasses.replace(record, searched=searched)
    assert "held-out KL mean here 0.011, within the target 0.02" in record.searched_line()
    record = dataclasses.replace(validation_record(), searched=with_kv)  # no +fp8-kv run here
    assert record.searched_as("fp8") == "nvfp4" and "0.0123" in record.searched_line()
