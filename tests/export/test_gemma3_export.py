"""Exporting Gemma 3 (`gemma3_text`: tied embeddings, (1 + w) norms, q/k norms, GeGLU), on the family
conformance suite's exports of its trained tiny model (both layouts x W4A4 / W4A16 / FP8, each
checked there: tests/quickstart/test_conformance.py): GPTQ with an FP8 KV cache, a scale per
attention, local and global; transformers + compressed-tensors load our compressed-tensors exports
with our decoded weights bit for bit and logits equal to our serving simulation of the weights as
transformers holds them; compressed-tensors' own ModelOpt converter turns our ModelOpt NVFP4 export
into our compressed-tensors one tensor for tensor (validate held and streamed: the suite's
`test_validate_streamed_equals_held`).
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
from nvfp4tool.model import forward, model_from_tensors
from nvfp4tool.numerics import dense

from fixtures.conformance_fixtures import invoke
from fixtures.export_fixtures import assert_converted_tensors_equal, assert_linear_weights_bit_exact
from fixtures.hf_fixtures import build_tiny_model

pytestmark = pytest.mark.peers
torch = pytest.importorskip("torch")

FAMILY = "gemma3"  # its entry in conformance_fixtures.FAMILIES
USED = (("compressed-tensors", "nvfp4"), ("compressed-tensors", "nvfp4-weight-only"), ("modelopt", "nvfp4"))


@pytest.fixture(scope="module")
def exports(conformance, tmp_path_factory):
    """(fmt, quant) -> the suite's export folder (W4A4 with an FP8 KV cache); "source": the training
    run they were made from; "gptq": its W4A4 compressed-tensors export by GPTQ with an FP8
    KV cache (GPTQ's layer-by-layer pass), calibrated as the suite's."""
    out = {key: str(conformance.export(FAMILY, *key)) for key in USED}
    run = conformance.run(FAMILY)
    out["gptq"] = str(tmp_path_factory.mktemp("gemma3_gptq") / "gptq-kv")
    invoke(
        "-q",
        "export",
        run,
        "--out",
        out["gptq"],
        "--format",
        "compressed-tensors",
        "--weight-rounding",
        "gptq",
        "--kv-cache",
        "fp8",
        *conformance.calib,
    )
    return dict(out, source=str(run))


def test_gptq_with_an_fp8_kv_cache_passes_check_with_a_scale_per_attention(exports):
    """GPTQ runs layer by layer (each layer's own block program: local or global) and the KV
    cache is calibrated in every attention, local and global alike."""
    from safetensors import safe_open

    report = check_checkpoint(exports["gptq"])
    assert report.ok, [p.message for p in report.problems]
    with safe_open(os.path.join(exports["gptq"], "model.safetensors"), framework="numpy") as f:
        scales = sorted(n for n in f.keys() if n.endswith(("k_scale", "v_scale")))
    gptq = load_export(exports["gptq"])
    layers = gptq.config.num_layers
    assert scales == [f"model.layers.{i}.self_attn.{kv}_scale" for i in range(layers) for kv in "kv"]
    rtn = load_export(exports["compressed-tensors", "nvfp4"])
    q = "model.layers.1.self_attn.q_proj"
    assert not np.array_equal(np.asarray(gptq.dequantized(q)), np.asarray(rtn.dequantized(q)))  # GPTQ moved it


def _as_transformers(x, w, b, *, name):
    """Our served linear with the decoded weight rounded to the BF16 transformers holds."""
    if hasattr(w, "dequantize"):
        x = w.quantize_input(x, name)
        w = w.dequantize().astype(jnp.bfloat16)
    return dense(x, w, b)


@pytest.mark.parametrize("quant", ("nvfp4", "nvfp4-weight-only"))
def test_transformers_loads_the_compressed_tensors_export_bit_exact_with_our_logits(exports, quant):
    import transformers

    folder = exports["compressed-tensors", quant]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    ids = np.random.default_rng(1).integers(3, 256, (2, 12))
    model(torch.tensor(ids))  # the first forward decompresses the weights
    ours = load_export(folder)
    assert ours.config.family == "gemma3_text" and ours.config.tie_word_embeddings
    # q k v o gate up down of every layer; the tied head kept
    assert assert_linear_weights_bit_exact(model, ours) == len(ours.quantized) == 7 * ours.config.num_layers
    for p in model.parameters():
        p.data = p.data.float()
    with torch.no_grad():
        theirs = model(torch.tensor(ids)).logits.float().numpy()
    held = model_from_tensors(ours.config, ours, dtype=None, compute_dtype=jnp.float32, check=False)
    simulated = np.asarray(forward(held, jnp.asarray(ids), linear=_as_transformers))
    assert np.abs(theirs).max() > 1.0
    np.testing.assert_allclose(simulated, theirs, rtol=0, atol=3e-5)


def test_compressed_tensors_converter_turns_our_modelopt_export_into_ours(exports):
    from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter
    from safetensors.torch import load_file

    modelopt = load_file(os.path.join(exports["modelopt", "nvfp4"], "model.safetensors"))
    ours = load_file(os.path.join(exports["compressed-tensors", "nvfp4"], "model.safetensors"))
    # the FP8 KV cache's scales, which the converter does not take (orphans to it): ModelOpt's
    # k_proj.k_scale / v_proj.v_scale are compressed-tensors' self_attn.k_scale / v_scale, equal bytes
    kv = {n: modelopt.pop(n) for n in [n for n in modelopt if n.endswith(("k_proj.k_scale", "v_proj.v_scale"))]}
    assert (
        len(kv)
        == 2 * json.loads(open(os.path.join(exports["source"], "hf", "config.json")).read())["num_hidden_layers"]
    )
    for name, scale in kv.items():
        stored = ours.pop(name.replace("k_proj.k_scale", "k_scale").replace("v_proj.v_scale", "v_scale"))
        assert scale.reshape(-1).view(torch.uint8).equal(stored.reshape(-1).view(torch.uint8)), name
    theirs = ModelOptNvfp4Converter(ignore=["lm_head"], targets=[r"re:.*_proj$"]).validate(dict(modelopt))
    assert_converted_tensors_equal(theirs, ours)


def test_zero_norm_weights_are_identity_norms_and_pass_check(tmp_path):
    """A (1 + w) norm's weight is zero at identity (every norm of an untrained Gemma): check does
    not call those all-zero tensors corrupt (it does without the family's `may_be_zero`)."""
    from safetensors.numpy import load_file, save_file

    source = build_tiny_model("gemma3", str(tmp_path / "source"), dtype="bfloat16")
    tensors = load_file(os.path.join(source, "model.safetensors"))
    zeroed = {n: np.zeros_like(t) if n.endswith("norm.weight") else t for n, t in tensors.items()}
    assert sum(n.endswith("norm.weight") for n in zeroed) == 3 * 6 + 1
    save_file(zeroed, os.path.join(source, "model.safetensors"), metadata={"format": "pt"})
    out = str(tmp_path / "out")
    export_checkpoint(
        source, out, ExportOptions(format="compressed-tensors", quant="nvfp4-weight-only", show_progress=False)
    )
    report = check_checkpoint(out)
    assert report.ok, [p.message for p in report.problems]
