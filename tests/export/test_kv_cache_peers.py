"""FP8 KV-cache scales against the peers (marker: peers): the calibrated scales against transformers'
own keys and values, transformers + compressed-tensors loading our compressed-tensors export, and
compressed-tensors' `ModelOptNvfp4Converter` on our ModelOpt export.

Oracle: transformers' Qwen3 (q/k RMSNorm, so "after k_norm and RoPE" is exercised) in BF16 on the
calibration windows, K captured where its attention gets it back from `apply_rotary_pos_emb` and
V at `v_proj`'s output (forward hook); scale = amax / 448. Our calibration runs our JAX model in
BF16 too; the two BF16 forwards round differently (matmul summation order), so the amax may differ
by a BF16 ulp or two of the input chain: tolerance 2**-6 relative (BF16 has 8 significant bits),
while K before RoPE has a different amax in at least one layer (asserted, so the test can tell the
two apart; at position 0 RoPE is the identity, so a layer's amax may be the same before and after).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from nvfp4tool import formats
from nvfp4tool.export import ExportOptions, export_checkpoint
from nvfp4tool.formats.compressed_tensors import KV_CACHE_SCHEME

from fixtures.hf_fixtures import build_tiny_model

pytestmark = pytest.mark.peers
SAMPLES, SEQ_LEN = 4, 16
RTOL = 2.0**-6


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv-peers")
    src = build_tiny_model("qwen3", str(root / "hf"))
    calib = str(root / "calib.npy")
    np.save(calib, np.random.default_rng(0).integers(0, 256, (SAMPLES, SEQ_LEN)))
    out = {"src": src, "calib": calib}
    for fmt in formats.FORMATS:
        out[fmt] = str(root / fmt)
        export_checkpoint(
            src,
            out[fmt],
            ExportOptions(
                format=fmt,
                calib_data=calib,
                calib_samples=SAMPLES,
                calib_seq_len=SEQ_LEN,
                kv_cache="fp8",
                show_progress=False,
            ),
        )
    return out


def _transformers_kv_amax(src: str, ids: np.ndarray) -> tuple[list[float], list[float], list[float]]:
    """Per layer (max |K after k_norm + RoPE|, max |V|, max |K before RoPE|) of transformers' BF16 model."""
    import torch
    import transformers
    from transformers.models.qwen3 import modeling_qwen3

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    k_after, k_before, v = [], [], []
    original = modeling_qwen3.apply_rotary_pos_emb

    def recording(q, k, *args, **kwargs):
        k_before.append(float(k.abs().max().float()))
        q_embed, k_embed = original(q, k, *args, **kwargs)
        k_after.append(float(k_embed.abs().max().float()))
        return q_embed, k_embed

    hooks = [
        layer.self_attn.v_proj.register_forward_hook(
            lambda module, inputs, output: v.append(float(output.abs().max().float()))
        )
        for layer in model.model.layers
    ]
    modeling_qwen3.apply_rotary_pos_emb = recording
    try:
        with torch.no_grad():
            model(torch.tensor(ids))
    finally:
        modeling_qwen3.apply_rotary_pos_emb = original
        for hook in hooks:
            hook.remove()
    return k_after, v, k_before


@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_kv_scales_are_transformers_k_after_rope_and_v_amax_over_448(exported, fmt):
    from safetensors import safe_open

    k_after, v, k_before = _transformers_kv_amax(exported["src"], np.load(exported["calib"]))
    spec = formats.get(fmt, "nvfp4")
    with safe_open(os.path.join(exported[fmt], "model.safetensors"), "pt") as st:
        stored = {n: st.get_tensor(n).numpy() for n in st.keys() if n.endswith(("k_scale", "v_scale"))}
    for layer in range(len(k_after)):
        k_name, v_name = spec.kv_scales.names(f"model.layers.{layer}.self_attn")
        k_scale, v_scale = float(stored[k_name].reshape(())), float(stored[v_name].reshape(()))
        assert k_scale == pytest.approx(k_after[layer] / 448, rel=RTOL), k_name
        assert v_scale == pytest.approx(v[layer] / 448, rel=RTOL), v_name
        if k_before[layer] != pytest.approx(k_after[layer], rel=RTOL):  # RoPE moved the amax in this layer
            assert k_scale != pytest.approx(k_before[layer] / 448, rel=RTOL), k_name
    assert any(b != pytest.approx(a, rel=RTOL) for a, b in zip(k_after, k_before))  # the data tells them apart


def test_transformers_loads_our_compressed_tensors_export_with_kv_scales(exported):
    """transformers 5 + compressed-tensors 0.20 load the export; whether they attach the KV scales to
    the attention modules depends on compressed-tensors recognising the attention as cached: its
    `is_cached_attention_module` looks for a `past_key_value(s)` argument of the attention's forward,
    which transformers 5 renamed `cache`, so the scales load as unexpected keys and the model runs a
    plain KV cache. If a version attaches them, they must be our stored values."""
    import inspect

    import torch
    import transformers
    from compressed_tensors.quantization.lifecycle.initialize import is_cached_attention_module
    from safetensors import safe_open

    folder = exported["compressed-tensors"]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as st:
        stored = {n: st.get_tensor(n) for n in st.keys() if n.endswith(("k_scale", "v_scale"))}
    for i, layer in enumerate(model.model.layers):
        attention = layer.self_attn
        if is_cached_attention_module(attention):
            for which in ("k", "v"):
                ours = stored[f"model.layers.{i}.self_attn.{which}_scale"]
                assert (
                    getattr(attention, f"{which}_scale")
                    .float()
                    .reshape(-1)
                    .equal(ours.reshape(-1).to(getattr(attention, f"{which}_scale").dtype).float())
                )
        else:
            parameters = inspect.signature(attention.forward).parameters
            assert "past_key_values" not in parameters and "past_key_value" not in parameters
            assert not hasattr(attention, "k_scale")
    with torch.no_grad():
        logits = model(torch.tensor(np.load(exported["calib"])[:1])).logits
    assert torch.isfinite(logits).all()


def test_compressed_tensors_converter_on_our_modelopt_export_gives_our_kv_scales(exported):
    """The converter (with our kv_cache_scheme, scale dtype F32) keeps ModelOpt's KV-scale names
    (`self_attn.k_proj.k_scale`; vLLM's `maybe_remap_kv_scale_name` maps both that and
    `self_attn.k_scale` to `self_attn.attn.k_scale`) and their values: equal, bit for bit, to our
    compressed-tensors export's `self_attn.k_scale` ([1] vs ModelOpt's []); every other tensor
    equal by name as in test_export_peers."""
    import torch
    from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter
    from compressed_tensors.quantization import QuantizationArgs
    from safetensors.torch import load_file

    modelopt = load_file(os.path.join(exported["modelopt"], "model.safetensors"))
    ours = load_file(os.path.join(exported["compressed-tensors"], "model.safetensors"))
    scheme = QuantizationArgs(**KV_CACHE_SCHEME["fp8"], scale_dtype=torch.float32)
    theirs = ModelOptNvfp4Converter(ignore=["lm_head"], targets=[r"re:.*_proj$"], kv_cache_scheme=scheme).validate(
        dict(modelopt)
    )
    mo_kv, ct_kv = formats.get("modelopt", "nvfp4").kv_scales, formats.get("compressed-tensors", "nvfp4").kv_scales
    renamed = {}
    for name in theirs:
        found = mo_kv.attention_of(name)
        renamed[ct_kv.names(found[0])[found[1] == "v"] if found else name] = name
    assert sorted(renamed) == sorted(ours)
    kv = [n for n in ours if ct_kv.attention_of(n)]
    assert len(kv) == 4
    for name, tensor in ours.items():
        other = theirs[renamed[name]]
        assert other.dtype == tensor.dtype, name
        assert other.reshape(-1).view(torch.uint8).equal(tensor.reshape(-1).view(torch.uint8)), name
