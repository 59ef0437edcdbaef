"""Our compressed-tensors export against transformers + compressed-tensors, and our ModelOpt export
against compressed-tensors' own `ModelOptNvfp4Converter` (marker: peers).

transformers (CPU) loads the compressed-tensors export and decompresses every NVFP4 weight to
BF16: those must equal `dequantize_nvfp4(...)` cast to BF16 bit for bit. Its logits (model moved
to fp32 after decompression, W4A4 activation fake-quantization by compressed-tensors) must match
our JAX model running `simulate.py`'s LinearFn on the same BF16 weights: tolerance 1e-5 absolute
on logits of magnitude ~2 (measured 4.8e-7: fp32 summation order), while dropping the activation
quantization moves them by ~0.5, so the comparison can fail.
"""

from __future__ import annotations

import functools
import os

import jax.numpy as jnp
import numpy as np
import pytest

from nvfp4tool.export import ExportOptions, export_checkpoint
from nvfp4tool.export.convert_format import convert_format
from nvfp4tool.export.simulate import load_export
from nvfp4tool.model import forward
from nvfp4tool.numerics import dense, dequantize_nvfp4, quantize_nvfp4
from nvfp4tool.recipes.precision import fused_group

from fixtures.export_fixtures import assert_converted_tensors_equal
from fixtures.hf_fixtures import build_tiny_model

pytestmark = pytest.mark.peers
LOGIT_ATOL = 1e-5
# --weight-rounding (GPTQ's codes load the same way) and --equalize awq (a plain checkpoint: the
# scales are folded into the norms and v_proj / up_proj rows), alone and with GPTQ
ROUNDINGS = ("rtn", "gptq", "awq", "awq+gptq")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("peers")
    src = build_tiny_model("llama3", str(root / "hf"))
    np.save(root / "calib.npy", np.random.default_rng(0).integers(0, 256, (4, 16)))
    out = {}
    for fmt in ("modelopt", "compressed-tensors"):
        for rounding in ROUNDINGS:
            out[fmt, rounding] = str(root / f"{fmt}-{rounding}")
            export_checkpoint(
                src,
                out[fmt, rounding],
                ExportOptions(
                    format=fmt,
                    calib_data=str(root / "calib.npy"),
                    calib_samples=4,
                    calib_seq_len=16,
                    weight_rounding="gptq" if "gptq" in rounding else "rtn",
                    equalize="awq" if "awq" in rounding else "none",
                    show_progress=False,
                ),
            )
    out["src"] = src
    return out


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.slow  # > 15 s of the inner loop (tests/durations.json)
def test_transformers_loads_our_export_bit_exact_weights_and_matching_logits(exported, rounding):
    import torch
    import transformers
    from safetensors.numpy import load_file

    folder = exported["compressed-tensors", rounding]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    ids = np.random.default_rng(1).integers(3, 256, (2, 12))
    model(torch.tensor(ids))  # the first forward decompresses the weights
    ours = load_export(folder)
    src = load_file(os.path.join(exported["src"], "model.safetensors"))
    checked = 0
    for name, module in model.named_modules():
        if name not in ours.quantized:
            continue
        theirs = module.weight.detach()
        assert theirs.dtype == torch.bfloat16
        members = [m for m in ours.quantized if fused_group(m) == fused_group(name)]
        amax = max(np.float32(np.abs(src[f"{m}.weight"]).max()) for m in members)
        if rounding == "rtn":  # the independent RTN
            expected = dequantize_nvfp4(quantize_nvfp4(src[f"{name}.weight"], global_amax=amax), jnp.bfloat16)
        else:  # GPTQ's codes, AWQ's folded weights: our decode of the stored bytes
            expected = ours.dequantized(name).astype(jnp.bfloat16)
        assert theirs.view(torch.int16).numpy().tobytes() == np.asarray(expected).view(np.int16).tobytes(), name
        checked += 1
    assert checked == len(ours.quantized) == 14

    for p in model.parameters():
        p.data = p.data.float()
    with torch.no_grad():
        theirs = model(torch.tensor(ids)).logits.float().numpy()

    def as_transformers(x, w, b, *, name, quantize_input=True):
        """Our served linear with the decoded weight rounded to the BF16 transformers holds."""
        if hasattr(w, "dequantize"):
            x = w.quantize_input(x, name) if quantize_input else x
            w = w.dequantize().astype(jnp.bfloat16)
        return dense(x, w, b)

    jax_model = ours.model(jnp.float32)
    simulated = np.asarray(forward(jax_model, jnp.asarray(ids), linear=as_transformers))
    weights_only = np.asarray(
        forward(jax_model, jnp.asarray(ids), linear=functools.partial(as_transformers, quantize_input=False))
    )
    np.testing.assert_allclose(simulated, theirs, rtol=0, atol=LOGIT_ATOL)
    assert np.abs(weights_only - theirs).max() > 100 * LOGIT_ATOL  # activation quantization matters


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_compressed_tensors_converter_on_our_modelopt_export_gives_our_ct_export(exported, rounding, tmp_path):
    from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter
    from safetensors.torch import load_file

    modelopt = load_file(os.path.join(exported["modelopt", rounding], "model.safetensors"))
    ours = load_file(os.path.join(exported["compressed-tensors", rounding], "model.safetensors"))
    theirs = ModelOptNvfp4Converter(ignore=["lm_head"], targets=[r"re:.*_proj$"]).validate(dict(modelopt))
    assert_converted_tensors_equal(theirs, ours)
    # and our convert-format output is byte-identical to our direct export, both ways
    convert_format(exported["modelopt", rounding], str(tmp_path / "ct"), to="compressed-tensors")
    convert_format(exported["compressed-tensors", rounding], str(tmp_path / "mo"), to="modelopt")
    for converted, direct in (("ct", "compressed-tensors"), ("mo", "modelopt")):
        with (
            open(tmp_path / converted / "model.safetensors", "rb") as a,
            open(os.path.join(exported[direct, rounding], "model.safetensors"), "rb") as b,
        ):
            assert a.read() == b.read()
