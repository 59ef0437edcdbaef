"""Exporting the deepseek_v3 family (both layouts x W4A4 / W4A16 / FP8, RTN): checked (also at TP 2
with vLLM's tensor-parallel rules, and TP 8 reported: 4 heads), every MLA projection, dense MLP, routed
and shared expert quantized, the routers and lm_head excluded, the router and its correction bias in
FP32; transformers + compressed-tensors load our compressed-tensors exports with our decoded weights
bit for bit (the routed experts, fused in transformers' memory, through compressed-tensors' own
compressor); `--kv-cache fp8` refused in one line before anything is written (vLLM's MLA caches
the latent and k_pe under one k_scale).
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from nvfp4tool.check import check_checkpoint
from nvfp4tool.export import ExportOptions, export_checkpoint
from nvfp4tool.export.simulate import load_export

from fixtures.deepseek_fixtures import EXPORT, hf_folder
from fixtures.export_fixtures import assert_fp8_weights_bit_exact, assert_linear_weights_bit_exact

torch = pytest.importorskip("torch")

FORMATS = ("modelopt", "compressed-tensors")
QUANTS = ("nvfp4", "nvfp4-weight-only", "fp8")
ROUTERS = ["model.layers.1.mlp.gate", "model.layers.2.mlp.gate"]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_exports")
    np.save(root / "calib.npy", np.random.default_rng(0).integers(3, 48, (4, 16)))
    out = {"source": hf_folder(root, EXPORT, seed=6)[0], "calib": str(root / "calib.npy")}
    for fmt in FORMATS:
        for quant in QUANTS:
            calib = (
                {}
                if quant == "nvfp4-weight-only"
                else dict(calib_data=str(root / "calib.npy"), calib_samples=4, calib_seq_len=16)
            )
            out[fmt, quant] = str(root / f"{fmt}-{quant}")
            export_checkpoint(
                out["source"], out[fmt, quant], ExportOptions(format=fmt, quant=quant, show_progress=False, **calib)
            )
    return out


def _dtypes(folder: str) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(os.path.join(folder, "model.safetensors"), framework="numpy") as f:
        return {n: f.get_slice(n).get_dtype() for n in f.keys()}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.slow  # six exports of a MoE model (their calibration compiles), ~2 minutes on 2 cores
def test_export_is_checked_with_every_linear_quantized(exports, fmt, quant):
    folder = exports[fmt, quant]
    report = check_checkpoint(folder, tp=(1, 2))
    assert report.ok, [p.message for p in report.problems]
    ours = load_export(folder)
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
    assert len(ours.quantized) == 3 * 5 + 3 + 2 * (8 * 3 + 3)
    config = json.loads(open(os.path.join(folder, "config.json")).read())
    qc = config["quantization_config"]
    assert sorted(qc.get("ignore", qc.get("exclude_modules"))) == sorted(ROUTERS + ["lm_head"])
    names = _dtypes(folder)
    for router in ROUTERS:
        assert names[f"{router}.weight"] == names[f"{router}.e_score_correction_bias"] == "F32"
    assert names["model.layers.0.self_attn.kv_a_layernorm.weight"] == "F32"  # the FP32 source's, kept
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
    import transformers
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from safetensors.torch import load_file

    folder = exports["compressed-tensors", quant]
    ours = load_export(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    model(torch.tensor(np.random.default_rng(1).integers(3, 48, (2, 12))))  # the first forward decompresses
    plain = [m for m in ours.quantized if ".experts." not in m]
    assert assert_linear_weights_bit_exact(model, ours) == len(plain) == 3 * 5 + 3 + 2 * 3
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    scheme = preset_name_to_scheme("NVFP4" if quant == "nvfp4" else "NVFP4A16", ["Linear"])
    experts = [m for m in ours.quantized if ".experts." in m]
    assert len(experts) == 2 * 8 * 3
    for module in experts:
        state = {s: tensors[f"{module}.{s}"] for s in ("weight_packed", "weight_scale", "weight_global_scale")}
        theirs = NVFP4PackedCompressor.decompress(state, scheme)["weight"]
        mine = np.asarray(jnp.asarray(ours.dequantized(module)).astype(jnp.bfloat16)).view(np.int16)
        assert theirs.view(torch.int16).numpy().tobytes() == mine.tobytes(), module


@pytest.mark.peers
def test_transformers_loads_the_fp8_export_bit_exact(exports):
    import transformers

    folder = exports["compressed-tensors", "fp8"]
    ours = load_export(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    model(torch.tensor(np.random.default_rng(1).integers(3, 48, (2, 12))))
    assert assert_fp8_weights_bit_exact(model, folder, ours) == 3 * 5 + 3 + 2 * 3


def test_fp8_kv_cache_is_refused_in_one_line(exports, tmp_path):
    from click.testing import CliRunner

    from nvfp4tool.cli import cli

    out = tmp_path / "kv"
    args = ["export", exports["source"], "--out", str(out), "--kv-cache", "fp8", "--calib-data", exports["calib"]]
    result = CliRunner().invoke(cli, [*args, "--calib-samples", "4", "--calib-seq-len", "16"])
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and "--kv-cache fp8 is not built for deepseek_v3" in errors[0], result.output
    assert not out.exists()
