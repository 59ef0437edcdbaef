"""Mixed per-linear formats (issue 41) composed with the other export passes: GPTQ rounds each NVFP4
linear as a uniform GPTQ export would (its FP8 linears to nearest, its BF16 ones untouched)."""

from __future__ import annotations

import pytest

from nvfp4tool import formats
from nvfp4tool.check import check_checkpoint
from nvfp4tool.records.export import ExportRecord

from fixtures.mixed_fixtures import QUANT_OF, gptq_exports, stored_tensors


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
