"""Mixed-precision exports (issue 41): per-linear NVFP4 W4A4 / W4A16 / FP8 / BF16 from
`--precision-file`, in both serving formats, against uniform exports of each quant, the real
loader (transformers + compressed-tensors), check, convert-format and the model card."""

from __future__ import annotations

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner

from nvfp4tool import formats
from nvfp4tool.check import check_checkpoint
from nvfp4tool.cli import cli
from nvfp4tool.config import ModelConfig
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.export import ExportOptions, export_checkpoint
from nvfp4tool.export.convert_format import convert_format
from nvfp4tool.export.plan import make_plan, read_precision_file
from nvfp4tool.export.simulate import FP8Weight, NVFP4Weight, load_export
from nvfp4tool.hub.card import bits_by_quant, build_model_card

from fixtures.mixed_fixtures import QUANT_OF, stored_tensors

FORMATS = ("modelopt", "compressed-tensors")


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_linear_is_stored_and_served_as_a_uniform_export_of_its_quant(mixed_exports, fmt):
    mixed = load_export(mixed_exports[fmt])
    assert mixed.quant == formats.MIXED
    assert {m: mixed.quant_of(m) for m in mixed.quantized} == QUANT_OF
    assert "model.layers.1.self_attn.o_proj" not in mixed.quantized  # bf16 by the last matching line
    uniform = {q: load_export(mixed_exports[f"uniform-{q}"]) for q in ("nvfp4", "nvfp4-weight-only", "fp8")}
    stored = {q: stored_tensors(mixed_exports[f"uniform-{q}"]) for q in uniform}
    ct = stored_tensors(mixed_exports["compressed-tensors"])
    for module, quant in QUANT_OF.items():
        ours, theirs = mixed.get(f"{module}.weight"), uniform[quant].get(f"{module}.weight")
        assert type(ours) is (FP8Weight if quant == "fp8" else NVFP4Weight), module
        assert (ours.input_scale is None) == (quant == "nvfp4-weight-only"), module
        assert np.asarray(ours.dequantize()).tobytes() == np.asarray(theirs.dequantize()).tobytes(), module
        if ours.input_scale is not None:
            assert np.float32(ours.input_scale) == np.float32(theirs.input_scale), module
        spec = formats.get("compressed-tensors", quant)
        for suffix in spec.suffixes:  # the compressed-tensors bytes are the uniform export's, tensor by tensor
            assert ct[f"{module}.{suffix}"] == stored[quant][f"{module}.{suffix}"], f"{module}.{suffix}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_check_passes_the_mixed_export_and_judges_each_linear_by_its_scheme(mixed_exports, fmt):
    report = check_checkpoint(mixed_exports[fmt], tp=(1, 2))
    assert report.ok, [p.line() for p in report.problems]
    assert report.quant == formats.MIXED
    assert {m.module: m.kind for m in report.modules} == {
        m: "fp8" if q == "fp8" else "nvfp4" for m, q in QUANT_OF.items()
    }


def test_the_configs_say_each_linears_scheme_as_the_loaders_read_them(mixed_exports):
    with open(os.path.join(mixed_exports["compressed-tensors"], "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    assert qc["format"] == "mixed-precision"
    targets = {
        g["format"] + ("" if "input_activations" in g else "-w"): g["targets"] for g in qc["config_groups"].values()
    }
    assert {t for ts in targets.values() for t in ts} == set(QUANT_OF)
    assert set(targets["float-quantized"]) == {m for m, q in QUANT_OF.items() if q == "fp8"}
    assert set(targets["nvfp4-pack-quantized-w"]) == {m for m, q in QUANT_OF.items() if q == "nvfp4-weight-only"}
    assert qc["ignore"] == ["model.layers.1.self_attn.o_proj", "lm_head"]
    with open(os.path.join(mixed_exports["modelopt"], "hf_quant_config.json")) as f:
        quantization = json.load(f)["quantization"]
    algo = {"nvfp4": "NVFP4", "nvfp4-weight-only": "W4A16_NVFP4", "fp8": "FP8"}
    assert quantization["quant_algo"] == "MIXED_PRECISION"
    assert {m: e["quant_algo"] for m, e in quantization["quantized_layers"].items()} == {
        m: algo[q] for m, q in QUANT_OF.items()
    }
    assert all(e.get("group_size") == 16 for e in quantization["quantized_layers"].values() if e["quant_algo"] != "FP8")


@pytest.mark.peers
def test_transformers_loads_the_mixed_compressed_tensors_export_with_our_weights_bit_exact(mixed_exports):
    import torch
    import transformers

    folder = mixed_exports["compressed-tensors"]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    model(torch.tensor(np.random.default_rng(1).integers(3, 256, (1, 8))))  # the first forward decompresses
    ours = load_export(folder)
    stored = stored_tensors(folder)
    checked = {}
    for name, module in model.named_modules():
        if name not in ours.quantized:
            continue
        theirs = module.weight.detach()
        assert theirs.dtype == torch.bfloat16
        if ours.quant_of(name) == "fp8":  # compressed-tensors: fp32(e4m3) x fp32(bf16(scale)), to BF16
            w = ours.get(f"{name}.weight")
            scale = np.float32(np.asarray(w.scale).astype(jnp.bfloat16))
            expected = np.asarray(jnp.asarray(w.data).astype(jnp.float32) * scale).astype(jnp.bfloat16)
        else:
            expected = np.asarray(jnp.asarray(ours.dequantized(name)).astype(jnp.bfloat16))
        assert theirs.view(torch.int16).numpy().tobytes() == expected.view(np.int16).tobytes(), name
        checked[name] = ours.quant_of(name)
    assert checked == QUANT_OF
    o_proj = model.model.layers[1].self_attn.o_proj.weight.detach()  # BF16, as stored
    assert o_proj.view(torch.int16).numpy().tobytes() == stored["model.layers.1.self_attn.o_proj.weight"][2]


@pytest.mark.peers
def test_compressed_tensors_modelopt_converter_agrees_on_the_mixed_modelopt_exports_nvfp4_linears(mixed_exports):
    """compressed-tensors' ModelOptNvfp4Converter converts NVFP4 (W4A4 and W4A16) modules only: on
    the mixed ModelOpt export it refuses the FP8 linears' scales as orphan qparams unless they are
    ignored; ignoring them, its conversion of every NVFP4 linear is our compressed-tensors bytes."""
    import torch
    from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter
    from safetensors.torch import load_file

    from fixtures.export_fixtures import assert_converted_tensors_equal

    modelopt = load_file(os.path.join(mixed_exports["modelopt"], "model.safetensors"))
    ours = load_file(os.path.join(mixed_exports["compressed-tensors"], "model.safetensors"))
    nvfp4 = [m for m, q in QUANT_OF.items() if q != "fp8"]
    fp8 = [m for m, q in QUANT_OF.items() if q == "fp8"]
    with pytest.raises(ValueError, match="orphan qparams.*model.layers.0.self_attn.q_proj.weight_scale"):
        ModelOptNvfp4Converter(ignore=["lm_head"], targets=nvfp4).validate(dict(modelopt))
    theirs = ModelOptNvfp4Converter(ignore=["lm_head", *fp8], targets=nvfp4).validate(dict(modelopt))
    assert_converted_tensors_equal(
        {n: t for n, t in theirs.items() if n.rpartition(".")[0] in nvfp4},
        {n: t for n, t in ours.items() if n.rpartition(".")[0] in nvfp4},
    )
    assert all(
        theirs[n].dtype == torch.float8_e4m3fn for n in theirs if n.rpartition(".")[0] in fp8 and n.endswith(".weight")
    )


def test_convert_format_round_trips_the_mixed_export_byte_for_byte(mixed_exports, tmp_path):
    convert_format(mixed_exports["modelopt"], str(tmp_path / "ct"), to="compressed-tensors")
    convert_format(str(tmp_path / "ct"), str(tmp_path / "mo"), to="modelopt")
    direct = stored_tensors(mixed_exports["compressed-tensors"])
    assert stored_tensors(str(tmp_path / "ct")) == direct  # = the direct export
    assert stored_tensors(str(tmp_path / "mo")) == stored_tensors(mixed_exports["modelopt"])
    assert formats.describe(str(tmp_path / "mo")).schemes == formats.describe(mixed_exports["modelopt"]).schemes


def _edited(folder: str, tmp_path, edit) -> str:
    out = str(tmp_path / "edited")
    shutil.copytree(folder, out)
    path = os.path.join(out, "config.json")
    with open(path) as f:
        config = json.load(f)
    edit(config["quantization_config"]["config_groups"])
    with open(path, "w") as f:
        json.dump(config, f)
    os.remove(os.path.join(out, "nvfp4tool_export.json"))  # judged by the configs alone
    return out


def _group(groups: dict, fmt: str, activations: bool = True) -> dict:
    return next(g for g in groups.values() if g["format"] == fmt and ("input_activations" in g) == activations)


def test_check_refuses_a_fused_group_split_across_schemes(mixed_exports, tmp_path):
    def split(groups):  # k_proj named by the W4A4 group: q/k/v split across FP8 and NVFP4
        _group(groups, "float-quantized")["targets"].remove("model.layers.0.self_attn.k_proj")
        _group(groups, "nvfp4-pack-quantized")["targets"].append("model.layers.0.self_attn.k_proj")

    lines = [p.line() for p in check_checkpoint(_edited(mixed_exports["compressed-tensors"], tmp_path, split)).problems]
    split_line = (
        "model.layers.0.self_attn.qkv: model.layers.0.self_attn.k_proj, model.layers.0.self_attn.q_proj, "
        "model.layers.0.self_attn.v_proj: fused group is split across formats (k_proj nvfp4, q_proj fp8, v_proj fp8)"
    )
    assert any(line.startswith(split_line) for line in lines), lines


def test_check_refuses_a_target_matching_nothing_and_overlapping_targets(mixed_exports, tmp_path):
    def bad(groups):
        _group(groups, "float-quantized")["targets"] += ["model.layers.7.mlp.up_proj", "model.layers.0.mlp.up_proj"]

    lines = [p.line() for p in check_checkpoint(_edited(mixed_exports["compressed-tensors"], tmp_path, bad)).problems]
    assert any("'model.layers.7.mlp.up_proj' matches no linear layer" in line for line in lines), lines
    assert any(
        line.startswith("model.layers.0.mlp.up_proj: config.json: named by 2 schemes' targets (nvfp4, fp8)")
        for line in lines
    ), lines


def test_the_card_lists_the_formats_and_bits_per_parameter(mixed_exports):
    folder = mixed_exports["modelopt"]
    report = check_checkpoint(folder)
    bits = bits_by_quant(report, formats.describe(folder))
    assert {q: (n, b) for q, (n, _, b) in bits.items() if q != "all"} == {
        "fp8": (4, 8.0),
        "nvfp4": (6, 4.5),
        "nvfp4-weight-only": (3, 4.5),
    }
    assert bits["all"][0] == 13
    params = {q: p for q, (_, p, _) in bits.items()}
    assert bits["all"][2] == pytest.approx((8 * params["fp8"] + 4.5 * (params["all"] - params["fp8"])) / params["all"])
    card = build_model_card(folder, report, repo_id="me/tiny-mixed", validation=None)
    assert "MIXED_PRECISION" in card and "mixed-precision" in card
    assert f"Over the quantized linears: {bits['all'][2]:.3f} bits per parameter." in card


def _config(mixed_exports) -> ModelConfig:
    return ModelConfig.from_hf_folder(mixed_exports["src"])


def test_a_precision_file_splitting_a_fused_group_is_refused_naming_the_group_and_line(mixed_exports, tmp_path):
    path = tmp_path / "split.txt"
    path.write_text("model.layers.*.mlp.* fp8\nmodel.layers.1.mlp.up_proj nvfp4\n")
    with pytest.raises(NVFP4ToolError) as bad:
        make_plan(_config(mixed_exports), "nvfp4", rules=read_precision_file(str(path)))
    assert str(bad.value).startswith(f"{path}:2: fused group model.layers.1.mlp.gate_up (")
    assert "split across fp8 / nvfp4" in str(bad.value)


@pytest.mark.parametrize(
    "text, problem",
    [
        (
            "model.layers.0.* fp8\nmodel.layers.0.mlp.* int8\n",
            ":2: 'model.layers.0.mlp.* int8': expected 'PATTERN FORMAT'",
        ),
        ("lonely_pattern\n", ":1: 'lonely_pattern': expected 'PATTERN FORMAT'"),
        ("# ok\nmodel.layers.9.* fp8\n", ":2: 'model.layers.9.*' matches no linear module"),
    ],
)
def test_export_refuses_a_bad_precision_file_line_in_one_line_naming_it(mixed_exports, tmp_path, text, problem):
    path = tmp_path / "p.txt"
    path.write_text(text)
    result = CliRunner().invoke(
        cli,
        [
            "export",
            mixed_exports["src"],
            "--out",
            str(tmp_path / "out"),
            "--quant",
            "nvfp4-weight-only",
            "--precision-file",
            str(path),
        ],
    )
    assert result.exit_code == 1, result.output
    assert len(result.output.strip().splitlines()) == 1 and f"{path}{problem}" in result.output, result.output
    assert not os.path.exists(tmp_path / "out")


def test_keep_bf16_file_and_bf16_precision_lines_write_the_same_bytes(mixed_exports, tmp_path):
    keep, precision = tmp_path / "keep.txt", tmp_path / "precision.txt"
    keep.write_text("*.layers.0.mlp.*\nmodel.layers.1.self_attn.q_proj\n")  # q_proj keeps k / v too
    precision.write_text("*.layers.0.mlp.* bf16\nmodel.layers.1.self_attn.q_proj bf16\n")
    for name, option in (("keep", {"keep_bf16_file": str(keep)}), ("precision", {"precision_file": str(precision)})):
        export_checkpoint(
            mixed_exports["src"],
            str(tmp_path / name),
            ExportOptions(quant="nvfp4-weight-only", show_progress=False, **option),
        )
    for f in ("model.safetensors", "config.json", "hf_quant_config.json"):
        with open(tmp_path / "keep" / f, "rb") as a, open(tmp_path / "precision" / f, "rb") as b:
            assert a.read() == b.read(), f
    assert formats.describe(str(tmp_path / "keep")).exclude[:3] == (
        "model.layers.0.mlp.gate_proj",
        "model.layers.0.mlp.up_proj",
        "model.layers.0.mlp.down_proj",
    )


def test_check_refuses_modelopt_mixed_configs_that_disagree_or_name_an_unknown_algo(mixed_exports, tmp_path):
    folder = str(tmp_path / "mo")
    shutil.copytree(mixed_exports["modelopt"], folder)
    path = os.path.join(folder, "hf_quant_config.json")
    with open(path) as f:
        hf_quant = json.load(f)
    hf_quant["quantization"]["quantized_layers"]["model.layers.0.mlp.up_proj"] = {"quant_algo": "INT8"}
    with open(path, "w") as f:
        json.dump(hf_quant, f)
    lines = [p.line() for p in check_checkpoint(folder).problems]
    assert any("quantized_layers.model.layers.0.mlp.up_proj.quant_algo is 'INT8'" in line for line in lines), lines
    assert any("quantized_layers differs from hf_quant_config.json's" in line for line in lines), lines


def test_the_routed_experts_of_one_moe_layer_share_one_format(tmp_path):
    from fixtures.step_fixtures import tiny_moe

    config = tiny_moe(64, 16)
    path = tmp_path / "p.txt"
    path.write_text("model.layers.1.mlp.experts.2.* fp8\n")  # one expert of four: vLLM's fused MoE has one scheme
    with pytest.raises(NVFP4ToolError) as bad:
        make_plan(config, "nvfp4", rules=read_precision_file(str(path)))
    assert str(bad.value).startswith(f"{path}:1: fused group model.layers.1.mlp.experts (")
    assert "(12 linears)) would be split across nvfp4 / fp8" in str(bad.value)
    path.write_text("model.layers.1.mlp.experts.* fp8\nmodel.layers.1.self_attn.* nvfp4-weight-only\n")
    plan = make_plan(config, "nvfp4", rules=read_precision_file(str(path)))
    assert plan.is_mixed and plan.quant_of("model.layers.1.mlp.experts.3.down_proj") == "fp8"
    assert plan.quant_of("model.layers.1.self_attn.q_proj") == "nvfp4-weight-only"
    assert plan.quant_of("model.layers.0.mlp.up_proj") == "nvfp4"
