"""Mixed per-linear formats (issue 41) composed with the other export passes: GPTQ rounds each NVFP4
linear as a uniform GPTQ export would (its FP8 linears to nearest, its BF16 ones untouched); AWQ
scores each linear in its own format, and the equalized export serves no worse than the plain one."""

from __future__ import annotations

import numpy as np
import pytest

from nvfp4tool import formats
from nvfp4tool.check import check_checkpoint
from nvfp4tool.config import ModelConfig
from nvfp4tool.export import equalize as eq
from nvfp4tool.families import folds
from nvfp4tool.model.fold import site_key
from nvfp4tool.records.export import ExportRecord

from fixtures.mixed_fixtures import QUANT_OF, gptq_exports, mixed_export, outlier_model, served_kl, stored_tensors


@pytest.fixture(scope="module")
def gptq(mixed_exports, tmp_path_factory) -> dict[str, str]:
    return gptq_exports(mixed_exports, tmp_path_factory.mktemp("mixed-gptq"))


def test_gptq_rounds_each_nvfp4_linear_of_a_mixed_export_as_a_uniform_gptq_export(mixed_exports, gptq):
    mixed, uniform = stored_tensors(gptq["mixed"]), stored_tensors(gptq["uniform"])
    rtn = stored_tensors(mixed_exports["compressed-tensors"])  # the mixed export without GPTQ
    # layer 0's MLP (NVFP4 W4A4) sees the same inputs in both passes (Hessians are taken through the
    # original layer 0): its codes, block scales and global scales are the uniform GPTQ export's
    first = [m for m, q in QUANT_OF.items() if q == "nvfp4" and m.startswith("model.layers.0.")]
    assert first
    for module in first:
        for suffix in formats.get("compressed-tensors", "nvfp4").suffixes:
            name = f"{module}.{suffix}"
            assert mixed[name] == uniform[name], name
    gptq_rounded = [m for m, q in QUANT_OF.items() if q == "nvfp4"]
    assert any(mixed[f"{m}.weight_packed"] != rtn[f"{m}.weight_packed"] for m in gptq_rounded)  # GPTQ moved codes
    for module in (m for m, q in QUANT_OF.items() if q == "fp8"):  # FP8: round to nearest, as without GPTQ
        for suffix in formats.get("compressed-tensors", "fp8").suffixes:
            assert mixed[f"{module}.{suffix}"] == rtn[f"{module}.{suffix}"], f"{module}.{suffix}"
    kept = "model.layers.1.self_attn.o_proj.weight"  # BF16: the source's bytes
    assert mixed[kept] == rtn[kept] and mixed[kept][0] == "BF16"
    record = ExportRecord.read(gptq["mixed"])
    assert record.weight_rounding == "gptq" and record.gptq is not None
    gptq_errors = {m for m, layer in record.layers.items() if layer.output_rel_err is not None}
    assert gptq_errors == {m for m, q in QUANT_OF.items() if q != "fp8"}  # W4A4 and W4A16 by GPTQ
    report = check_checkpoint(gptq["mixed"], tp=(1, 2))
    assert report.ok, [p.line() for p in report.problems]
    assert report.quant == formats.MIXED


def test_awq_with_a_mixed_plan_scores_each_linear_in_its_format_and_serves_no_worse(mixed_exports, tmp_path):
    src = outlier_model(str(tmp_path / "hf"))
    plain, out = (
        mixed_export(src, str(tmp_path / name), mixed_exports["precision_file"], mixed_exports["calib"], equalize=name)
        for name in ("none", "awq")
    )
    report = check_checkpoint(out, tp=(1, 2))
    assert report.ok, [p.line() for p in report.problems]
    record = ExportRecord.read(out)
    assert record.quant == formats.MIXED and record.equalize == "awq"
    assert record.equalization.check_kl_mean <= eq.FOLD_KL_LIMIT  # the fold is the BF16 model
    config = ModelConfig.from_hf_folder(src)
    searched = [f for f in folds(config) if all(c in QUANT_OF for c in f.consumers)]
    assert set(record.equalization.sites) == {site_key(f) for f in searched}
    # the site whose consumer is layer 1's BF16 o_proj is not scaled (s = 1): o_proj keeps the
    # source's bytes (as in the plain mixed export), and the fold check above ran on the whole model
    assert "model.layers.1.self_attn.o_proj" not in record.equalization.sites
    kept = "model.layers.1.self_attn.o_proj.weight"
    assert stored_tensors(out)[kept] == stored_tensors(plain)[kept]
    ids = np.load(mixed_exports["calib"])
    kl_plain, kl_awq = served_kl(src, plain, ids), served_kl(src, out, ids)
    print(f"served KL vs the BF16 source on the calibration windows: plain {kl_plain:.6g}, awq {kl_awq:.6g}")
    assert kl_awq <= kl_plain
