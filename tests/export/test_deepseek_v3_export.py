"""Exporting the deepseek_v3 family, on the family conformance suite's exports of its trained tiny
model (both layouts x W4A4 / W4A16 / FP8, RTN; checked at TP 1 and 2, every module decompressed by
compressed-tensors and the FP8 KV cache's refusal there: tests/quickstart/test_conformance.py):
every MLA projection, dense MLP, routed and shared expert quantized, the routers and their
correction bias in FP32, q_a_proj and kv_a_proj_with_mqa under one global scale (vLLM's fused GEMM);
TP 8 reported (4 heads); transformers + compressed-tensors load our compressed-tensors exports with
our decoded weights bit for bit; GPTQ passes check at TP 2.
"""

from __future__ import annotations

import json
import os

import pytest

from nvfp4tool.check import check_checkpoint
from nvfp4tool.config import ModelConfig
from nvfp4tool.export.simulate import load_export

from fixtures.conformance_fixtures import FORMATS, QUANTS
from fixtures.export_fixtures import assert_fp8_weights_bit_exact, assert_linear_weights_bit_exact

torch = pytest.importorskip("torch")

FAMILY = "deepseek_v3"  # its entry in conformance_fixtures.FAMILIES


@pytest.fixture(scope="module")
def exports(conformance):
    """(fmt, quant) -> the suite's export folder; "source": the trained HF folder they were made from."""
    out = {(fmt, quant): str(conformance.export(FAMILY, fmt, quant)) for fmt in FORMATS for quant in QUANTS}
    return dict(out, source=str(conformance.run(FAMILY) / "hf"))


def _plain_and_experts(config: ModelConfig) -> tuple[int, int]:
    """How many quantized linears are not routed experts (5 MLA projections a layer, the dense
    layers' 3, the MoE layers' shared expert's 3) and how many are."""
    f = config.family_config
    dense, moe = f.first_k_dense_replace, config.num_layers - f.first_k_dense_replace
    return 5 * config.num_layers + 3 * dense + 3 * moe, 3 * f.n_routed_experts * moe


def _dtypes(folder: str) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(os.path.join(folder, "model.safetensors"), framework="numpy") as f:
        return {n: f.get_slice(n).get_dtype() for n in f.keys()}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("quant", QUANTS)
def test_every_linear_quantized_the_router_fp32_and_the_latent_projections_fused(exports, fmt, quant):
    folder = exports[fmt, quant]
    ours = load_export(folder)
    config = ours.config
    kinds = {m.split(".", 3)[3].split(".")[1] for m in ours.quantized}
    assert kinds == {
        "q_a_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_b_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "experts",
        "shared_experts",
    }
    assert len(ours.quantized) == sum(_plain_and_experts(config))
    routers = [
        f"model.layers.{i}.mlp.gate" for i in range(config.family_config.first_k_dense_replace, config.num_layers)
    ]
    qc = json.loads(open(os.path.join(folder, "config.json")).read())["quantization_config"]
    assert sorted(qc.get("ignore", qc.get("exclude_modules"))) == sorted(routers + ["lm_head"])
    names, source = _dtypes(folder), _dtypes(exports["source"])
    for router in routers:
        assert names[f"{router}.weight"] == names[f"{router}.e_score_correction_bias"] == "F32"
    norm = "model.layers.0.self_attn.kv_a_layernorm.weight"
    assert names[norm] == source[norm]  # kept as stored
    if quant != "fp8":  # q_a_proj and kv_a_proj_with_mqa: vLLM's one fused_qkv_a_proj GEMM, one global scale
        a = ours.get("model.layers.0.self_attn.q_a_proj.weight")
        b = ours.get("model.layers.0.self_attn.kv_a_proj_with_mqa.weight")
        assert float(a.s_dec) == float(b.s_dec)


def test_a_degree_that_does_not_split_the_heads_is_reported(exports):
    report = check_checkpoint(exports["compressed-tensors", "nvfp4"], tp=(8,))
    assert not report.ok
    assert any("num_attention_heads = 4 does not split into 8" in p.message for p in report.problems)


@pytest.mark.peers
@pytest.mark.parametrize("quant", ("nvfp4", "nvfp4-weight-only"))
def test_transformers_loads_our_weights_bit_exact(exports, quant):
    """transformers holds each plain linear as we decode it (the routed experts, fused in its memory,
    are compared on compressed-tensors' own decompression by the suite)."""
    import transformers

    folder = exports["compressed-tensors", quant]
    ours = load_export(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    model(torch.tensor([[3, 4, 5, 6, 7, 8]]))  # the first forward decompresses
    plain = [m for m in ours.quantized if ".experts." not in m]
    assert assert_linear_weights_bit_exact(model, ours) == len(plain) == _plain_and_experts(ours.config)[0]


@pytest.mark.peers
def test_transformers_loads_the_fp8_export_bit_exact(exports):
    import transformers

    folder = exports["compressed-tensors", "fp8"]
    ours = load_export(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    model(torch.tensor([[3, 4, 5, 6, 7, 8]]))
    assert assert_fp8_weights_bit_exact(model, folder, ours) == _plain_and_experts(ours.config)[0]


@pytest.mark.slow  # GPTQ's layer-by-layer pass over the suite's trained DeepSeek-V3
def test_gptq_export_passes_check_at_tp_2_and_lowers_the_output_error(conformance, exports, tmp_path):
    """`--weight-rounding gptq` on MLA and DeepSeekMoE (each layer's block program, the routed and
    shared experts calibrated on their own tokens): the export passes check with vLLM's TP 2 splits,
    its record says GPTQ lowered the linears' output error against RTN, and the weights moved."""
    import numpy as np

    from nvfp4tool.records.export import ExportRecord

    from fixtures.conformance_fixtures import invoke

    out = tmp_path / "gptq"
    run = conformance.run(FAMILY)
    quant = "nvfp4-weight-only"
    args = ("--format", "compressed-tensors", "--quant", quant, "--weight-rounding", "gptq")
    invoke("-q", "export", run, "--out", out, *args, *conformance.calib)
    report = check_checkpoint(str(out), tp=(1, 2))
    assert report.ok, [p.message for p in report.problems]
    record = ExportRecord.read(str(out))
    assert record.weight_rounding == "gptq" and record.gptq.mean_output_err_reduction > 0
    gptq, rtn = load_export(str(out)), load_export(exports["compressed-tensors", quant])
    assert gptq.quantized == rtn.quantized
    moved = [
        m for m in gptq.quantized if not np.array_equal(np.asarray(gptq.dequantized(m)), np.asarray(rtn.dequantized(m)))
    ]
    assert {m.split(".")[3] for m in moved} == {"self_attn", "mlp"}  # MLA and the MLPs
    assert any(".experts." in m for m in moved) and any(".shared_experts." in m for m in moved)
