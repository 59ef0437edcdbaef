"""Exporting the hybrid nemotron_h family (both layouts, W4A4 / W4A16 / FP8, RTN), checked and
proven against the peers: the folder is in the checkpoint's own spelling (`backbone.*`, as
transformers and vLLM read it), every linear of every layer kind quantized (Mamba in/out_proj,
attention, relu2 MLPs, experts, the shared expert, latent projections), the routers and lm_head
excluded in both configs, conv1d / A_log / D / dt_bias / norms unquantized and the router in FP32;
transformers + compressed-tensors load our compressed-tensors export with bit-exact weights and
logits equal to our serving simulation (the dense hybrid; a MoE hybrid's experts are fused in
transformers' memory, so their decompression is checked on compressed-tensors' own compressor, as
for Qwen3-MoE); compressed-tensors' ModelOpt converter turns our ModelOpt export into our
compressed-tensors export tensor for tensor, and convert-format does the same byte for byte.
"""

from __future__ import annotations

import functools
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from nvfp4tool.check import check_checkpoint
from nvfp4tool.export import ExportOptions, export_checkpoint
from nvfp4tool.export.convert_format import convert_format
from nvfp4tool.export.simulate import load_export
from nvfp4tool.model import forward
from nvfp4tool.numerics import dense

from fixtures.export_fixtures import assert_converted_tensors_equal, assert_linear_weights_bit_exact
from fixtures.hybrid_fixtures import DENSE, MOE, _hf_folder

torch = pytest.importorskip("torch")

FORMATS = ("modelopt", "compressed-tensors")
QUANTS = ("nvfp4", "nvfp4-weight-only", "fp8")
# every in_features a multiple of 16 (the shared expert 32 wide, the latent 16)
FIXTURES = {"dense": DENSE, "moe": dict(MOE, moe_shared_expert_intermediate_size=32)}


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("nemotron_h_exports")
    np.save(root / "calib.npy", np.random.default_rng(0).integers(3, 40, (4, 16)))
    out = {}
    for key, options in FIXTURES.items():
        (root / key).mkdir()
        out[key], _ = _hf_folder(root / key, options, seed=4)
        for fmt in FORMATS:
            for quant in QUANTS:
                calib = (
                    {}
                    if quant == "nvfp4-weight-only"
                    else dict(calib_data=str(root / "calib.npy"), calib_samples=4, calib_seq_len=16)
                )
                out[key, fmt, quant] = str(root / key / f"{fmt}-{quant}")
                export_checkpoint(
                    out[key], out[key, fmt, quant], ExportOptions(format=fmt, quant=quant, show_progress=False, **calib)
                )
    return out


def _names(folder: str) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(os.path.join(folder, "model.safetensors"), framework="numpy") as f:
        return {n: f.get_slice(n).get_dtype() for n in f.keys()}


@pytest.mark.parametrize("key", FIXTURES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.slow  # > 15 s of the inner loop (tests/durations.json)
def test_export_is_checked_and_in_the_checkpoints_spelling(exports, key, fmt, quant):
    folder = exports[key, fmt, quant]
    report = check_checkpoint(folder)
    assert report.ok, [p.message for p in report.problems]
    names = _names(folder)
    assert all(n.startswith(("backbone.", "lm_head.")) for n in names)
    ours = load_export(folder)
    kinds = {m.split(".mixer.")[1].split(".")[0] for m in ours.quantized}
    want = {"in_proj", "out_proj", "up_proj", "down_proj"} | ({"q_proj", "k_proj", "v_proj", "o_proj"})
    if key == "moe":
        want |= {"experts", "shared_experts", "fc1_latent_proj", "fc2_latent_proj"}
    assert kinds == want
    config = json.loads(open(os.path.join(folder, "config.json")).read())
    qc = config["quantization_config"]
    routers = [
        f"backbone.layers.{i}.mixer.gate" for i, c in enumerate(FIXTURES[key]["hybrid_override_pattern"]) if c == "E"
    ]
    excluded = qc.get("ignore", qc.get("exclude_modules"))
    assert sorted(excluded) == sorted(routers + ["lm_head"])
    if fmt == "modelopt":
        hf_quant = json.loads(open(os.path.join(folder, "hf_quant_config.json")).read())
        assert sorted(hf_quant["quantization"]["exclude_modules"]) == sorted(routers + ["lm_head"])
    for suffix in ("conv1d.weight", "conv1d.bias", "A_log", "D", "dt_bias", "norm.weight"):
        assert names[f"backbone.layers.0.mixer.{suffix}"] == "F32", suffix  # the FP32 source's dtype, kept
    assert names["backbone.layers.0.norm.weight"] == names["backbone.norm_f.weight"] == "F32"
    assert names["backbone.embeddings.weight"] == names["lm_head.weight"] == "BF16"
    for router in routers:
        assert names[f"{router}.weight"] == "F32" and names[f"{router}.e_score_correction_bias"] == "F32"
    source = json.loads(open(os.path.join(exports[key], "config.json")).read())
    same = {k: v for k, v in source.items() if k not in ("dtype", "transformers_version")}
    assert {
        k: v for k, v in config.items() if k not in ("quantization_config", "dtype", "transformers_version")
    } == same  # the source's config, every key in its own spelling


def _as_transformers(x, w, b, *, name):
    """Our served linear with the decoded weight rounded to the BF16 transformers holds."""
    if hasattr(w, "dequantize"):
        x = w.quantize_input(x, name)
        w = w.dequantize().astype(jnp.bfloat16)
    return dense(x, w, b)


@pytest.mark.peers
@pytest.mark.parametrize("quant", ("nvfp4", "nvfp4-weight-only"))
def test_transformers_loads_the_dense_hybrid_bit_exact_with_our_logits(exports, quant):
    import transformers

    folder = exports["dense", "compressed-tensors", quant]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    ids = np.random.default_rng(1).integers(3, 40, (2, 12))
    model(torch.tensor(ids))  # the first forward decompresses the weights
    ours = load_export(folder)
    # transformers' module paths are ours (model.layers.{i}.mixer.*)
    assert assert_linear_weights_bit_exact(model, ours) == len(ours.quantized) == 14
    for p in model.parameters():
        p.data = p.data.float()
    with torch.no_grad():
        theirs = model(torch.tensor(ids)).logits.float().numpy()
    from nvfp4tool.model import model_from_tensors

    class AsTransformersHolds:
        """The export's tensors as transformers holds them loaded in BF16: the FP32 ones kept as
        stored (A_log, D, dt_bias, conv1d, norms) rounded to BF16, the quantized weights as stored."""

        path = folder

        def get(self, name):
            value = ours.get(name)
            return value.astype(jnp.bfloat16) if isinstance(value, np.ndarray) and value.dtype == np.float32 else value

    held = model_from_tensors(ours.config, AsTransformersHolds(), dtype=None, compute_dtype=jnp.float32, check=False)
    simulated = np.asarray(forward(held, jnp.asarray(ids), linear=_as_transformers))
    np.testing.assert_allclose(simulated, theirs, rtol=0, atol=3e-5)


@pytest.mark.peers
def test_compressed_tensors_decompresses_the_moe_hybrid_to_our_weights(exports):
    import transformers
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from safetensors.torch import load_file

    folder = exports["moe", "compressed-tensors", "nvfp4"]
    ours = load_export(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    model(torch.tensor(np.random.default_rng(1).integers(3, 40, (2, 12))))
    plain = assert_linear_weights_bit_exact(model, ours)
    assert plain == len([m for m in ours.quantized if ".experts." not in m])
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    scheme = preset_name_to_scheme("NVFP4", ["Linear"])
    experts = [m for m in ours.quantized if ".experts." in m]
    assert len(experts) == 2 * 8 * 2
    for module in experts:
        stored = module.replace("model.", "backbone.", 1)
        state = {s: tensors[f"{stored}.{s}"] for s in ("weight_packed", "weight_scale", "weight_global_scale")}
        theirs = NVFP4PackedCompressor.decompress(state, scheme)["weight"]
        mine = np.asarray(jnp.asarray(ours.dequantized(module)).astype(jnp.bfloat16)).view(np.int16)
        assert theirs.view(torch.int16).numpy().tobytes() == mine.tobytes(), module


@pytest.mark.peers
@pytest.mark.parametrize("key", FIXTURES)
def test_compressed_tensors_converter_and_convert_format_agree(exports, key, tmp_path):
    from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter
    from safetensors.torch import load_file

    modelopt = load_file(os.path.join(exports[key, "modelopt", "nvfp4"], "model.safetensors"))
    ours = load_file(os.path.join(exports[key, "compressed-tensors", "nvfp4"], "model.safetensors"))
    routers = [n.removesuffix(".weight") for n in modelopt if n.endswith("mixer.gate.weight")]
    theirs = ModelOptNvfp4Converter(ignore=["lm_head", *routers], targets=[r"re:.*_proj$"]).validate(dict(modelopt))
    assert_converted_tensors_equal(theirs, ours)
    for quant in ("nvfp4", "nvfp4-weight-only", "fp8"):
        convert_format(exports[key, "modelopt", quant], str(tmp_path / f"ct-{quant}"), to="compressed-tensors")
        with (
            open(tmp_path / f"ct-{quant}" / "model.safetensors", "rb") as a,
            open(os.path.join(exports[key, "compressed-tensors", quant], "model.safetensors"), "rb") as b,
        ):
            assert a.read() == b.read(), quant


@pytest.mark.slow  # > 15 s of the inner loop (tests/durations.json)
def test_a_hybrid_export_simulates_close_to_its_source(exports):
    """Our serving simulation of each export against the BF16 source's logits: FP8 closest, then
    W4A16, then W4A4 (the order quantization error must take), all finite."""
    from converters.hf import HFFolderSource
    from nvfp4tool.config import ModelConfig
    from nvfp4tool.export.simulate import served_linear
    from nvfp4tool.model import model_from_tensors

    src = exports["moe"]
    ids = jnp.asarray(np.random.default_rng(2).integers(3, 40, (2, 12)))
    want = np.asarray(forward(model_from_tensors(ModelConfig.from_hf_folder(src), HFFolderSource(src)), ids))
    error = {}
    for quant in QUANTS:
        got = np.asarray(
            forward(
                load_export(exports["moe", "compressed-tensors", quant]).model(jnp.float32),
                ids,
                linear=functools.partial(served_linear),
            )
        )
        assert np.isfinite(got).all()
        error[quant] = float(np.abs(got - want).mean())
    assert error["fp8"] < error["nvfp4-weight-only"] < error["nvfp4"], error


@pytest.mark.slow
def test_validate_runs_a_hybrid_held_and_streamed(exports, tmp_path):
    """validate on a MoE hybrid export: the same metrics held in memory and streamed layer by layer,
    greedy generation with the Mamba layers' decode state (held), and the sensitivity search over
    the hybrid's fused groups."""
    import shutil

    from nvfp4tool.validate.runner import ValidateOptions, validate_export
    from nvfp4tool.validate.thresholds import Thresholds

    np.save(tmp_path / "val.npy", np.random.default_rng(5).integers(3, 40, (4, 24)))
    records = {}
    for offload in ("never", "always"):
        folder = tmp_path / offload
        shutil.copytree(exports["moe", "compressed-tensors", "nvfp4"], folder)
        options = ValidateOptions(
            data=str(tmp_path / "val.npy"),
            source=exports["moe"],
            samples=4,
            seq_len=24,
            batch_size=2,
            prompts=2,
            prompt_len=8,
            gen_tokens=6,
            offload=offload,
            reference="bf16",
            thresholds=Thresholds(
                max_kl_mean=None, max_kl_p99=None, min_top1=None, max_ppl_increase=None, min_layer_sqnr_db=None
            ),
        )
        records[offload] = validate_export(str(folder), options, kl_target=1e9 if offload == "never" else None).record
    held, streamed = records["never"], records["always"]
    assert held.generation.skipped is None and held.generation.tokens == 6
    assert len(held.generation.first_divergence["nvfp4"]) == 2
    assert "streamed layer by layer" in streamed.generation.skipped  # generation needs the whole model
    for metric in ("kl_mean", "top1", "ppl"):
        np.testing.assert_allclose(held.models["nvfp4"][metric], streamed.models["nvfp4"][metric], rtol=1e-5)
    assert {layer.name.split(".mixer.")[1].split(".")[0] for layer in held.layers} >= {
        "in_proj",
        "out_proj",
        "experts",
        "q_proj",
    }
    harm = held.sensitivity.harm  # every fused group measured alone, the hybrid's kinds among them
    assert held.sensitivity.met and {h.group.split(".mixer.")[1].split(".")[0] for h in harm} >= {
        "in_proj",
        "out_proj",
        "qkv",
        "experts",
        "shared_experts",
    }


def test_check_applies_the_hybrids_tensor_parallel_rules(exports):
    """vLLM's sharding of a Mamba layer: its heads split across the ranks (TP 8 > 4 heads is
    refused), its groups split or replicate (2 groups at TP 4 replicate evenly), in_proj is column-
    and out_proj row-parallel (at TP 4 out_proj's K = 32 gives shards of 8 < one 16-block)."""
    folder = exports["dense", "compressed-tensors", "nvfp4"]
    at8 = [p.message for p in check_checkpoint(folder, tp=(8,)).problems]
    assert any("mamba_num_heads = 4 does not split into 8 equal shards" in m for m in at8)
    at4 = check_checkpoint(folder, tp=(4,)).problems
    assert not any("n_groups" in p.message or "mamba_num_heads" in p.message for p in at4)
    assert any(
        p.module == "backbone.layers.0.mixer.out_proj" and "row-parallel K = 32 at TP 4" in p.message for p in at4
    )
    assert not any(p.module == "backbone.layers.0.mixer.in_proj" for p in at4)  # 2 x 32 + 2 x 12 + 4 = 92 rows
    at2 = [p for p in check_checkpoint(folder, tp=(2,)).problems if "mixer.in_proj" in p.module]
    assert not at2  # 92 rows split in two; its K (hidden 32) is not split


def test_nvidias_nano_recipe_keeps_attention_and_the_mamba_layers_feeding_it(exports, tmp_path):
    """The keep-BF16 file of NVIDIA's published Nemotron-3-Nano NVFP4 choice: on a 52-layer M / E
    pattern with attention where Nano has it (layers 5, 12, 19, 26, 33, 42), the Mamba layers its
    card names {4, 11, 18, 25, 32, 41} and the attention layers after them;
    on the dense fixture (M-M*-M) layers 2 and 3, which the export then leaves unquantized, with
    the FP8 KV cache."""
    import subprocess
    import sys

    from nvfp4tool.config import ModelConfig
    from nvfp4tool.families.nemotron_h import nvidia_nano_keep_bf16

    nano = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
    config = ModelConfig.from_hf_config({"model_type": "nemotron_h", **dict(MOE, hybrid_override_pattern=nano)})
    kept = [int(p.split(".")[2]) for p in nvidia_nano_keep_bf16(config)]
    attention = [i for i, c in enumerate(nano) if c == "*"]
    assert len(nano) == 52 and attention == [5, 12, 19, 26, 33, 42]
    assert sorted(set(kept) - set(attention)) == [4, 11, 18, 25, 32, 41]
    keep = tmp_path / "keep.txt"
    keep.write_text(
        subprocess.run(
            [sys.executable, "scripts/nemotron_keep_bf16.py", exports["dense"]],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    np.save(tmp_path / "calib.npy", np.random.default_rng(0).integers(3, 40, (4, 16)))
    out = tmp_path / "nano-recipe"
    export_checkpoint(
        exports["dense"],
        str(out),
        ExportOptions(
            keep_bf16_file=str(keep),
            kv_cache="fp8",
            calib_data=str(tmp_path / "calib.npy"),
            calib_samples=4,
            calib_seq_len=16,
            show_progress=False,
        ),
    )
    quantized = load_export(str(out)).quantized
    assert quantized and not any(m.startswith(("model.layers.2.", "model.layers.3.")) for m in quantized)
    assert check_checkpoint(str(out)).ok
    # validate serves it with its FP8 KV cache layer by layer: only the attention layer reads KV scales
    # (every nemotron_h export with --kv-cache fp8 failed "no tensor 'None.k_scale'" before)
    from nvfp4tool.validate.runner import ValidateOptions, validate_export

    served = load_export(str(out))
    pattern = DENSE["hybrid_override_pattern"]
    assert [served.kv_aux(i) is not None for i in range(len(pattern))] == [c == "*" for c in pattern]
    np.save(tmp_path / "val.npy", np.random.default_rng(5).integers(3, 40, (2, 16)))
    options = ValidateOptions(
        data=str(tmp_path / "val.npy"),
        source=exports["dense"],
        samples=2,
        seq_len=16,
        batch_size=2,
        prompts=1,
        prompt_len=8,
        gen_tokens=2,
        offload="always",
        reference="bf16",
        limits={"max_kl_mean": 1e9},
    )
    record = validate_export(str(out), options).record
    assert np.isfinite(record.models["nvfp4+fp8-kv"]["kl_mean"]) and record.models["nvfp4"]["kl_mean"] < 1e9


def test_compressed_tensors_nvfp4_of_a_moe_hybrid_says_vllm_does_not_serve_it(exports, tmp_path):
    from click.testing import CliRunner

    from nvfp4tool.cli import cli

    result = CliRunner().invoke(
        cli,
        [
            "export",
            exports["moe"],
            "--out",
            str(tmp_path / "ct"),
            "--quant",
            "nvfp4-weight-only",
            "--format",
            "compressed-tensors",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "vllm-project/vllm#31782" in result.output
    result = CliRunner().invoke(
        cli,
        [
            "export",
            exports["dense"],
            "--out",
            str(tmp_path / "dense"),
            "--quant",
            "nvfp4-weight-only",
            "--format",
            "compressed-tensors",
        ],
    )
    assert result.exit_code == 0 and "31782" not in result.output  # no MoE layer: nothing to say


@pytest.mark.parametrize("rounding", ["gptq", "4over6"])
@pytest.mark.slow  # > 15 s of the inner loop (tests/durations.json)
def test_gptq_and_scale_search_on_a_hybrid(exports, tmp_path, rounding):
    """GPTQ's Hessians for every hybrid linear (in_proj reads the block norm's output, out_proj
    the gated norm's, the experts all their layer's tokens) lower the output error below RTN's;
    4over6's scale search writes a checked export; both load back as exports."""
    src = exports["moe"]
    np.save(tmp_path / "calib.npy", np.random.default_rng(0).integers(3, 40, (4, 16)))
    out = str(tmp_path / rounding)
    summary = export_checkpoint(
        src,
        out,
        ExportOptions(
            calib_data=str(tmp_path / "calib.npy"),
            calib_samples=4,
            calib_seq_len=16,
            show_progress=False,
            **({"weight_rounding": "gptq"} if rounding == "gptq" else {"scale_search": "4over6"}),
        ),
    )
    assert check_checkpoint(out).ok
    assert len(load_export(out).quantized) == summary.quantized_modules == 50
    if rounding == "gptq":
        assert summary.gptq_reduction is not None and summary.gptq_reduction > 0.05
