"""Issue 22 item 6: one export job, one weight-quantizer interface, one serving-folder writer, and a
GPTQ export that calibrates once (the input amax, the K / V amax and the router counts that a
separate calibration pass measured before come from the GPTQ pass itself, with the same values)."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from nvfp4tool.checkpoints import open_checkpoint
from nvfp4tool.errors import NVFP4UsageError
from nvfp4tool.export import ExportOptions, calibrate, export_checkpoint, gptq_pass, job, writer
from nvfp4tool.export.convert_format import convert_format
from nvfp4tool.export.quantizers import FP8, GPTQ, ScaleSearch, quantizer_for
from nvfp4tool.export.serving_folder import ServingFolder
from nvfp4tool.model.layerwise import LayerwiseModel
from nvfp4tool.numerics import dequantize_nvfp4
from nvfp4tool.recipes.precision import GEMM_INPUT_DTYPE
from nvfp4tool.records.export import ExportRecord

from fixtures.export_fixtures import CALIB_SAMPLES, CALIB_SEQ_LEN, synthetic_config, synthetic_source

CONFIG = synthetic_config(hidden=64, mlp=128, layers=2, vocab=256, head_dim=16, kv_heads=2, dtype="bfloat16")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("export-job")
    src, calib = synthetic_source(root, CONFIG, seed=7)
    return root, src, calib


def _options(calib, **kw) -> ExportOptions:
    return ExportOptions(
        calib_data=calib, calib_samples=CALIB_SAMPLES, calib_seq_len=CALIB_SEQ_LEN, show_progress=False, **kw
    )


def _counting(monkeypatch, module, name, counts):
    real = getattr(module, name)

    def counted(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)


def test_a_gptq_export_calibrates_once_with_the_scales_of_a_separate_calibration(tiny, monkeypatch):
    root, src, calib = tiny
    counts: dict[str, int] = {}
    _counting(monkeypatch, calibrate, "load_calibration_ids", counts)  # job.py imports it at call time
    _counting(monkeypatch, gptq_pass, "open_bf16_model", counts)
    _counting(monkeypatch, calibrate, "open_bf16_model", counts)  # calibrate() opens its model here
    _counting(monkeypatch, LayerwiseModel, "logits", counts)
    _counting(monkeypatch, LayerwiseModel, "sequential", counts)
    records = {}
    real_put = gptq_pass.SpilledRecords.put
    monkeypatch.setattr(
        gptq_pass.SpilledRecords,
        "put",
        lambda self, module, q: (records.__setitem__(module, q), real_put(self, module, q))[1],
    )
    out = str(root / "gptq-w4a4-kv")
    export_checkpoint(src, out, _options(calib, weight_rounding="gptq", kv_cache="fp8"))
    # one tokenization, one model opened, one pass over the windows (before: calibrate() + GPTQ: 2 of each)
    assert counts == {"load_calibration_ids": 1, "open_bf16_model": 1, "sequential": 1}, counts
    record = ExportRecord.read(out)
    assert record.input_amax_origin == "calibration" and record.calibration.tokens == CALIB_SAMPLES * CALIB_SEQ_LEN
    monkeypatch.undo()

    # exactly what a separate calibrate() pass over the ORIGINAL layers measures (the pass's reference
    # stream; job.with_gptq says why not the already-quantized layers'): the written scales are as before
    source = open_checkpoint(src)
    quantized = list(record.input_amax)
    original = calibrate.calibrate(
        source.config,
        source.tensors,
        quantized,
        calib,
        samples=CALIB_SAMPLES,
        seq_len=CALIB_SEQ_LEN,
        tokenizer_dir=None,
        kv_cache=True,
        offload="never",
        ids_SxL=np.load(calib),
    )
    assert record.input_amax == original.input_amax
    assert record.kv_amax == {a: tuple(v) for a, v in original.kv_amax.items()}
    # ... not those through GPTQ's already-quantized layer 0 (what the Hessians of layer 1 see)
    layer0 = {
        f"{m}.weight": np.asarray(dequantize_nvfp4(q, GEMM_INPUT_DTYPE))
        for m, q in records.items()
        if m.startswith("model.layers.0.")
    }

    class Replaced:
        def get(self, name):
            return layer0[name] if name in layer0 else source.tensors.get(name)

    replaced = calibrate.calibrate(
        source.config,
        Replaced(),
        quantized,
        calib,
        samples=CALIB_SAMPLES,
        seq_len=CALIB_SEQ_LEN,
        tokenizer_dir=None,
        offload="always",
        ids_SxL=np.load(calib),
    )
    assert any(original.input_amax[m] != replaced.input_amax[m] for m in quantized if m.startswith("model.layers.1."))
    # the input scales written are the record's input amax
    from nvfp4tool.export.quantizers import input_decode_scale
    from nvfp4tool.export.simulate import load_export

    exported = load_export(out)
    for m in quantized:
        assert exported.get(f"{m}.weight").input_scale == input_decode_scale(record.input_amax[m], "nvfp4"), m


def test_the_job_is_resolved_before_anything_is_created_and_is_frozen(tiny):
    root, src, calib = tiny
    out = str(root / "job-only")
    made = job.prepare_job(src, out, _options(calib))
    assert not os.path.exists(out)
    assert made.input_amax_origin == "calibration" and set(made.input_amax) == set(made.plan.quantized)
    assert made.calibration_ids.shape == (CALIB_SAMPLES, CALIB_SEQ_LEN) and not made.awaits_gptq
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.block = "2d"
    pending = job.prepare_job(src, out, _options(calib, weight_rounding="gptq"))
    assert pending.awaits_gptq and pending.input_amax is None  # measured by the GPTQ pass, in the output's temp
    with pytest.raises(NVFP4UsageError, match="--kv-cache"):
        job.prepare_job(src, out, _options(None, kv_cache="fp8"))
    assert not os.path.exists(out)


def test_one_quantizer_is_chosen_from_the_job(tiny):
    root, src, calib = tiny
    made = job.prepare_job(src, str(root / "q"), _options(calib, scale_search="mse"))
    assert isinstance(quantizer_for(made.plan, "mse", made.block, made.group_amax, None), ScaleSearch)
    fp8 = job.prepare_job(src, str(root / "q"), _options(calib, quant="fp8"))
    assert isinstance(quantizer_for(fp8.plan, "rtn", fp8.block, fp8.group_amax, None), FP8)
    result = gptq_pass.GPTQResult(records=gptq_pass.SpilledRecords(str(root)), errors={})
    assert isinstance(quantizer_for(made.plan, "rtn", made.block, made.group_amax, result), GPTQ)
    # FP8: the recorded amax is that of the decoded weight the roles hold
    module = fp8.plan.quantized[0]
    done = quantizer_for(fp8.plan, "rtn", fp8.block, fp8.group_amax, None).quantize(
        module, fp8.source.tensors.get(f"{module}.weight")
    )
    assert set(done.roles) == {"weight", "weight_global"} and done.roles["weight"].dtype.name == "float8_e4m3fn"
    decoded = done.roles["weight"].astype(np.float32) * done.roles["weight_global"]
    assert done.amax == float(np.abs(decoded).max())


def test_export_and_convert_format_write_through_the_one_serving_folder_writer(tiny, monkeypatch):
    root, src, calib = tiny
    written = []
    real = ServingFolder.write_shards

    def spy(self, shards, load, **kw):
        shards = list(shards)
        written.append([file for file, _ in shards])
        return real(self, shards, load, **kw)

    monkeypatch.setattr(ServingFolder, "write_shards", spy)
    out = str(root / "sharded")
    export_checkpoint(src, out, _options(calib, max_shard_size="40KB"))
    convert_format(out, str(root / "sharded-ct"), to="compressed-tensors")
    assert len(written) == 2 and written[0] == written[1] and len(written[0]) > 1
    # the same shards and index (ModelOpt's hf_quant_config.json is not compressed-tensors')
    assert sorted(os.listdir(root / "sharded-ct")) == sorted(set(os.listdir(out)) - {"hf_quant_config.json"})
    assert writer.GPTQ_SPILL_DIR not in os.listdir(out)
