"""`nvfp4tool validate` of a mixed-precision export (issue 41): each linear served and judged in its
own format. The worst-layers rows carry each linear's format, and each one's weight SQNR is its
format's quantization of the source weight, computed by the numpy oracle (FP8 per tensor, NVFP4
W4A4 / W4A16 against its fused group's amax)."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from converters.hf import HFFolderSource
from nvfp4tool.cli import cli
from nvfp4tool.families import fused_group
from nvfp4tool.records.validation import ValidationRecord

from fixtures import nvfp4_oracle as oracle
from fixtures.mixed_fixtures import QUANT_OF

TITLES = {"nvfp4": "NVFP4", "nvfp4-weight-only": "NVFP4 W4A16", "fp8": "FP8"}


def _oracle_weight(source: HFFolderSource, module: str, quant: str) -> np.ndarray:
    w = np.asarray(source.get(f"{module}.weight"), np.float32)
    if quant == "fp8":
        data, scale = oracle.quantize_fp8(w, "e4m3", None, None)
        return data * scale
    group = [m for m in QUANT_OF if fused_group(m) == fused_group(module)]
    amax = np.float32(max(np.abs(np.asarray(source.get(f"{m}.weight"), np.float32)).max() for m in group))
    q = oracle.quantize(w, block="1d", global_amax=amax)
    return oracle.dequantize(q["packed"], q["scales"], q["global_amax"]).reshape(w.shape)


def _sqnr_db(ref: np.ndarray, approx: np.ndarray) -> float:
    ref = ref.astype(np.float64)
    return float(10 * np.log10(np.sum(ref**2) / np.sum((ref - approx.astype(np.float64)) ** 2)))


def test_validate_serves_and_reports_each_linear_of_a_mixed_export_in_its_format(mixed_eval_export, tmp_path):
    export = str(shutil.copytree(mixed_eval_export["export"], tmp_path / "export"))
    small = ["--samples", "4", "--seq-len", "32", "--prompts", "1", "--prompt-len", "8", "--gen-tokens", "4"]
    result = CliRunner().invoke(
        cli,
        [
            "validate",
            export,
            "--source",
            mixed_eval_export["hf"],
            "--reference",
            "bf16",
            "--data",
            mixed_eval_export["ids"],
        ]
        + small,
    )
    assert result.exit_code in (0, 1) and os.path.isfile(os.path.join(export, "validation.json")), result.output
    record = ValidationRecord.read(export)
    assert result.exit_code == (0 if record.passed else 1), result.output
    assert record.quant == "mixed" and set(record.models) == {"bf16", "mixed"}
    assert {row.name: row.quant for row in record.layers} == QUANT_OF  # layer 1's BF16 o_proj: no row
    source = HFFolderSource(mixed_eval_export["hf"])
    # every NVFP4 linear and one FP8 one (the FP8 oracle divides element by element in Python: slow)
    for row in (r for r in record.layers if r.quant != "fp8" or r.name == "model.layers.0.self_attn.q_proj"):
        expected = _sqnr_db(
            np.asarray(source.get(f"{row.name}.weight"), np.float32), _oracle_weight(source, row.name, row.quant)
        )
        assert abs(row.weight_sqnr_db["mixed"] - expected) < 1e-3, (row.name, row.weight_sqnr_db, expected)
    assert all(np.isfinite(row.output_sqnr_db["mixed"]) for row in record.layers)  # each served GEMM measured
    fp8 = [r.weight_sqnr_db["mixed"] for r in record.layers if r.quant == "fp8"]
    nvfp4 = [r.weight_sqnr_db["mixed"] for r in record.layers if r.quant != "fp8"]
    assert min(fp8) > max(nvfp4) + 5  # FP8's 3 mantissa bits against E2M1's 1: far above
    with open(os.path.join(export, "validation.md"), encoding="utf-8") as f:
        md = f.read()
    assert "| layer | format | MIXED weight | MIXED output |" in md
    for row in record.layers[:8]:
        assert f"| `{row.name}` | {TITLES[row.quant]} |" in md
    assert "format" in result.output


def test_sensitivity_of_a_mixed_export_keeps_each_units_own_ladder(mixed_eval_export):
    """validate --sensitivity on the mixed export: each unit (scheme group) climbs from its own format
    to BF16, never to another format; the search starts from the export as served (the KL validation
    measured through its own model); its keep-BF16 patterns with the export's precision file give
    back the formats it found."""
    from nvfp4tool.config import ModelConfig
    from nvfp4tool.export.plan import make_plan
    from nvfp4tool.formats.precision_file import parse_precision_text
    from nvfp4tool.validate.runner import ValidateOptions, open_inputs, run_validation
    from nvfp4tool.validate.sensitivity import keep_bf16_file_text, sensitivity

    from fixtures.mixed_fixtures import PRECISION_FILE

    options = ValidateOptions(
        data=mixed_eval_export["ids"],
        source=mixed_eval_export["hf"],
        reference="bf16",
        samples=4,
        seq_len=32,
        batch_size=4,
        prompts=1,
        prompt_len=8,
        gen_tokens=4,
    )
    with open_inputs(mixed_eval_export["export"], options) as inputs:
        record = run_validation(inputs)
        target = 0.5 * record.models["mixed"]["kl_mean"]
        found = sensitivity(inputs, kl_target=target)
    assert {h.group for h in found.harm} == {fused_group(m) for m in QUANT_OF}  # dense: scheme group = fused group
    assert found.trajectory[0].kl_mean == pytest.approx(record.models["mixed"]["kl_mean"], rel=1e-6)
    assert found.met and found.trajectory[-1].kl_mean <= target < found.trajectory[0].kl_mean
    assert {m: p for m, p in found.precision_map.items() if p != "bf16"} == {
        m: q for m, q in QUANT_OF.items() if found.precision_map[m] != "bf16"
    }
    assert set(found.precision_map) == set(QUANT_OF) and "bf16" in found.precision_map.values()
    assert len(set(found.precision_map.values()) - {"bf16"}) >= 2  # units of several formats stayed as they were
    # sizes by the export's stored bits: FP8 8 bits, NVFP4 4.5 (+ a few bytes of scales per module), kept 16
    config = ModelConfig.from_hf_folder(mixed_eval_export["hf"])
    shapes = config.expected_tensor_shapes()
    weights = {m: int(np.prod(shapes[f"{m}.weight"])) for m in QUANT_OF}
    for step in found.trajectory:
        kept = {m for m in QUANT_OF if fused_group(m) in step.kept}
        bits = {m: 16 if m in kept else 8 if QUANT_OF[m] == "fp8" else 4.5 for m in QUANT_OF}
        expected = sum(n * bits[m] for m, n in weights.items()) / sum(weights.values())
        assert expected <= step.bits_per_weight <= expected + 8 * 16 * len(weights) / sum(weights.values())
    plan = make_plan(config, "nvfp4", rules=parse_precision_text(PRECISION_FILE, "p"), keep_bf16=found.keep_bf16)
    assert {m: plan.quant_of(m) for m in plan.quantized} == {
        m: p for m, p in found.precision_map.items() if p != "bf16"
    }
    # the command the keep-BF16 file gives names the precision file: it keeps layers in BF16 only
    assert "--keep-bf16-file keep_bf16.txt --precision-file PRECISION_FILE" in keep_bf16_file_text(found)
