"""nvfp4tool export / convert-format on tiny synthetic HF folders (no torch): the layouts and
configs of both formats, exact bytes against the numerics, fused groups, exclusions, FP8,
weight-only, scale search, calibration, sharding, atomicity, provenance, simulate and the CLI."""

from __future__ import annotations

import hashlib
import json
import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner

from converters.hf import HFFolderSource, read_safetensors_header
from nvfp4tool.cli import cli
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.export import ExportOptions, export_checkpoint
from nvfp4tool.export.calibrate import calibrate
from nvfp4tool.export.convert_format import convert_format
from nvfp4tool.export.scale_search import quantize_weight
from nvfp4tool.export.simulate import load_export, served_linear
from nvfp4tool.numerics import (
    dense,
    dequantize_fp8,
    dequantize_nvfp4,
    nvfp4_global_scales,
    quantize_fp8,
    quantize_nvfp4,
)
from nvfp4tool.recipes.precision import fused_group
from nvfp4tool.records.export import ExportRecord, sha256_file

from fixtures import REPO_ROOT

ROOT = REPO_ROOT
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from bench_convert import synthetic_config, write_synthetic_hf_folder  # noqa: E402

LAYERS = 2
CONFIG = synthetic_config(hidden=64, mlp=128, layers=LAYERS, vocab=256, head_dim=16, kv_heads=2, dtype="bfloat16")
LINEARS = CONFIG.linear_names()
QUANTIZED = [n for n in LINEARS if n != "lm_head"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("src") / "hf")
    write_synthetic_hf_folder(folder, CONFIG, seed=3)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"fixture": True}, f)
    return folder


@pytest.fixture(scope="module")
def calib(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("calib") / "ids.npy")
    np.save(path, np.random.default_rng(0).integers(0, CONFIG.vocab_size, (3, 24)))
    return path


def _export(src, out, **options):
    options.setdefault("show_progress", False)
    return export_checkpoint(str(src), str(out), ExportOptions(**options))


def _tensors(folder):
    source = HFFolderSource(folder, check_config=False)
    return {n: source.get(n) for n in source.names()}


def _bytes(a):
    return np.ascontiguousarray(a).view(np.uint8).tobytes()


def _group_amax(src_tensors, module):
    members = [m for m in QUANTIZED if fused_group(m) == fused_group(module)]
    return max(np.float32(np.abs(src_tensors[f"{m}.weight"].astype(np.float32)).max()) for m in members)


@pytest.fixture(scope="module")
def exports(hf_dir, calib, tmp_path_factory):
    root = tmp_path_factory.mktemp("exports")
    out = {}
    for fmt in ("modelopt", "compressed-tensors"):
        out[fmt] = str(root / fmt)
        _export(hf_dir, out[fmt], format=fmt, calib_data=calib, calib_samples=3, calib_seq_len=24)
    return out


# ----------------------------------------------------------------------------------- scale search


@pytest.mark.parametrize("block", ["1d", "2d"])
def test_rtn_and_mse_radius_0_are_quantize_nvfp4_bit_for_bit(block):
    rng = np.random.default_rng(1)
    w = (0.05 * rng.standard_normal((48, 96))).astype(np.float32)
    w[0, :16] = -1e-9  # rounds to -0: code 8 must be kept
    w[1, :16] = 0.0
    amax = np.float32(1.3 * np.abs(w).max())  # a group amax larger than the tensor's own
    reference = quantize_nvfp4(w, block=block, global_amax=amax)
    for method, radius in (("rtn", 2), ("mse", 0)):
        q, err = quantize_weight(w, method=method, block=block, global_amax=amax, mse_radius=radius)
        assert _bytes(q.packed) == _bytes(reference.packed), method
        assert _bytes(q.scales) == _bytes(reference.scales), method
        assert err.rel_l2 == pytest.approx(err.rtn_rel_l2, rel=1e-6)  # same values, summed apart


@pytest.mark.parametrize("method", ["4over6", "mse"])
def test_scale_search_lowers_the_error_and_decodes_with_the_standard_formula(method):
    w = (0.05 * np.random.default_rng(2).standard_normal((64, 256))).astype(np.float32)
    amax = np.float32(np.abs(w).max())
    q, err = quantize_weight(w, method=method, block="1d", global_amax=amax)
    decoded = np.asarray(dequantize_nvfp4(q))  # the plain NVFP4 decode of the stored bytes
    assert err.rel_l2 == pytest.approx(np.linalg.norm(decoded - w) / np.linalg.norm(w), rel=1e-5)
    rtn = np.asarray(dequantize_nvfp4(quantize_nvfp4(w, global_amax=amax)))
    assert err.rtn_rel_l2 == pytest.approx(np.linalg.norm(rtn - w) / np.linalg.norm(w), rel=1e-5)
    assert err.reduction_vs_rtn > 0.03, err  # measured: 4over6 ~0.08, mse ~0.09 on N(0,1)
    scales = np.asarray(q.scales, np.float32)
    assert np.isfinite(scales).all()
    if method == "4over6":  # global bound 256: the 6-candidate <= 256, the 4-candidate <= 384
        assert scales.max() <= 384 and q.global_amax == np.float32(amax * np.float32(1.75))
    # per block, the chosen scale is never worse than RTN's (mse includes the RTN candidate)
    if method == "mse":
        per_block = lambda d: ((d - w) ** 2).reshape(64, -1, 16).sum(-1)  # noqa: E731
        assert (per_block(decoded) <= per_block(rtn)).all()


def test_calibration_streamed_layer_by_layer_gives_the_held_amax(hf_dir, calib):
    """--offload always (all windows through layer i, then i+1, weights read per layer) and a held
    model record the same input amax, bit for bit."""
    held, streamed = (
        calibrate(
            CONFIG,
            HFFolderSource(hf_dir),
            QUANTIZED,
            calib,
            samples=3,
            seq_len=24,
            tokenizer_dir=None,
            kv_cache=True,
            offload=mode,
        )
        for mode in ("never", "always")
    )
    assert set(held.input_amax) == set(QUANTIZED) and all(v > 0 for v in held.input_amax.values())
    assert len(held.kv_amax) == CONFIG.num_layers and all(min(kv) > 0 for kv in held.kv_amax.values())
    assert held == streamed


# ------------------------------------------------------------------------------------- layouts


def test_modelopt_layout_bytes_fused_groups_and_configs(hf_dir, calib, exports):
    out = exports["modelopt"]
    header = read_safetensors_header(os.path.join(out, "model.safetensors"))
    tensors, src = _tensors(out), _tensors(hf_dir)
    amax_in = calibrate(
        CONFIG, HFFolderSource(hf_dir), QUANTIZED, calib, samples=3, seq_len=24, tokenizer_dir=None
    ).input_amax
    for module in QUANTIZED:
        n, k = src[f"{module}.weight"].shape
        assert header[f"{module}.weight"].dtype == "uint8" and header[f"{module}.weight"].shape == (n, k // 2)
        assert header[f"{module}.weight_scale"].dtype == "float8_e4m3fn"
        assert header[f"{module}.weight_scale"].shape == (n, k // 16)
        assert header[f"{module}.weight_scale_2"].shape == () == header[f"{module}.input_scale"].shape
        gamax = _group_amax(src, module)
        ref = quantize_nvfp4(src[f"{module}.weight"], global_amax=gamax)  # 1d for HF sources
        assert _bytes(tensors[f"{module}.weight"]) == _bytes(ref.packed), module
        assert _bytes(tensors[f"{module}.weight_scale"]) == _bytes(ref.scales), module
        assert tensors[f"{module}.weight_scale_2"] == np.asarray(nvfp4_global_scales(gamax)[1])
        group_in = max(amax_in[m] for m in QUANTIZED if fused_group(m) == fused_group(module))
        assert tensors[f"{module}.input_scale"] == np.asarray(nvfp4_global_scales(np.float32(group_in))[1])
    # fused groups share both global scales; distinct groups differ
    for layer in range(LAYERS):
        p = f"model.layers.{layer}"
        for members in (
            (".self_attn.q_proj", ".self_attn.k_proj", ".self_attn.v_proj"),
            (".mlp.gate_proj", ".mlp.up_proj"),
        ):
            for suffix in (".weight_scale_2", ".input_scale"):
                assert len({float(tensors[p + m + suffix]) for m in members}) == 1
        assert tensors[f"{p}.self_attn.q_proj.input_scale"] != tensors[f"{p}.mlp.down_proj.input_scale"]
    # excluded / unquantized tensors: BF16, nothing quantized
    assert header["lm_head.weight"].dtype == "bfloat16"
    assert not [n for n in header if n.startswith("lm_head.") and n != "lm_head.weight"]
    assert header["model.embed_tokens.weight"].dtype == "bfloat16"
    assert _bytes(tensors["model.norm.weight"]) == _bytes(src["model.norm.weight"])
    with open(os.path.join(out, "hf_quant_config.json")) as f:
        hqc = json.load(f)
    assert set(hqc["quantization"]) >= {"quant_algo", "kv_cache_quant_algo", "group_size", "exclude_modules"}
    assert hqc["quantization"]["quant_algo"] == "NVFP4" and hqc["quantization"]["exclude_modules"] == ["lm_head"]
    with open(os.path.join(out, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "NVFP4" and qc["ignore"] == ["lm_head"]
    assert os.path.isfile(os.path.join(out, "tokenizer_config.json"))


def test_compressed_tensors_layout_and_config(exports):
    ct = _tensors(exports["compressed-tensors"])
    mo = _tensors(exports["modelopt"])
    for module in QUANTIZED:
        assert _bytes(ct[f"{module}.weight_packed"]) == _bytes(mo[f"{module}.weight"])
        assert _bytes(ct[f"{module}.weight_scale"]) == _bytes(mo[f"{module}.weight_scale"])
        for ours, theirs in (("weight_global_scale", "weight_scale_2"), ("input_global_scale", "input_scale")):
            assert ct[f"{module}.{ours}"].shape == (1,) and ct[f"{module}.{ours}"].dtype == np.float32
            assert ct[f"{module}.{ours}"][0] == np.float32(1.0) / mo[f"{module}.{theirs}"]
            assert np.float32(1.0) / ct[f"{module}.{ours}"][0] == mo[f"{module}.{theirs}"]  # lossless back
    assert not [n for n in ct if n.startswith("lm_head.") and n != "lm_head.weight"]
    with open(os.path.join(exports["compressed-tensors"], "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    assert qc["format"] == "nvfp4-pack-quantized" and qc["quantization_status"] == "compressed"
    group = qc["config_groups"]["group_0"]
    assert group["weights"]["strategy"] == "tensor_group" and group["weights"]["group_size"] == 16
    assert group["input_activations"]["dynamic"] == "local" and qc["ignore"] == ["lm_head"]
    assert not os.path.exists(os.path.join(exports["compressed-tensors"], "hf_quant_config.json"))


def test_weight_only_and_fp8_layouts(hf_dir, calib, tmp_path):
    src = _tensors(hf_dir)
    _export(hf_dir, tmp_path / "w4a16", quant="nvfp4-weight-only")  # no calibration needed
    w4a16 = _tensors(str(tmp_path / "w4a16"))
    assert not [n for n in w4a16 if n.endswith("input_scale")]
    with open(tmp_path / "w4a16" / "config.json") as f:
        assert json.load(f)["quantization_config"]["quant_algo"] == "W4A16_NVFP4"
    _export(hf_dir, tmp_path / "w4a16-ct", quant="nvfp4-weight-only", format="compressed-tensors")
    with open(tmp_path / "w4a16-ct" / "config.json") as f:
        assert "input_activations" not in json.load(f)["quantization_config"]["config_groups"]["group_0"]

    _export(hf_dir, tmp_path / "fp8", quant="fp8", calib_data=calib, calib_samples=3, calib_seq_len=24)
    fp8 = _tensors(str(tmp_path / "fp8"))
    amax_in = calibrate(
        CONFIG, HFFolderSource(hf_dir), QUANTIZED, calib, samples=3, seq_len=24, tokenizer_dir=None
    ).input_amax
    for module in QUANTIZED:
        ref = quantize_fp8(src[f"{module}.weight"], fmt="e4m3", granularity="tensor")
        assert fp8[f"{module}.weight"].dtype.name == "float8_e4m3fn"
        assert _bytes(fp8[f"{module}.weight"]) == _bytes(ref.data)
        assert fp8[f"{module}.weight_scale"].shape == () and fp8[f"{module}.weight_scale"] == np.asarray(ref.scale)
        group_in = max(amax_in[m] for m in QUANTIZED if fused_group(m) == fused_group(module))
        assert fp8[f"{module}.input_scale"] == np.float32(group_in) / np.float32(448.0)
    with open(tmp_path / "fp8" / "hf_quant_config.json") as f:
        assert json.load(f)["quantization"]["quant_algo"] == "FP8"
    convert_format(str(tmp_path / "fp8"), str(tmp_path / "fp8-ct"), to="compressed-tensors")
    ct = _tensors(str(tmp_path / "fp8-ct"))
    assert ct["model.layers.0.mlp.up_proj.weight_scale"].shape == (1,)
    convert_format(str(tmp_path / "fp8-ct"), str(tmp_path / "fp8-back"), to="modelopt")
    with (
        open(tmp_path / "fp8" / "model.safetensors", "rb") as a,
        open(tmp_path / "fp8-back" / "model.safetensors", "rb") as b,
    ):
        assert a.read() == b.read()
    exported = load_export(str(tmp_path / "fp8"))
    w = "model.layers.0.mlp.down_proj.weight"
    ref = quantize_fp8(src[w], fmt="e4m3", granularity="tensor")
    assert _bytes(exported.dequantized(w.removesuffix(".weight"))) == _bytes(np.asarray(dequantize_fp8(ref)))


def test_keep_bf16_excludes_whole_fused_groups(hf_dir, tmp_path):
    _export(hf_dir, tmp_path / "o", quant="nvfp4-weight-only", keep_bf16=("*.layers.1.self_attn.k_proj",))
    header = read_safetensors_header(str(tmp_path / "o" / "model.safetensors"))
    for proj in ("q_proj", "k_proj", "v_proj"):
        name = f"model.layers.1.self_attn.{proj}"
        assert header[f"{name}.weight"].dtype == "bfloat16"
        assert f"{name}.weight_scale" not in header and f"{name}.weight_scale_2" not in header
    assert header["model.layers.1.self_attn.o_proj.weight"].dtype == "uint8"
    with open(tmp_path / "o" / "hf_quant_config.json") as f:
        excluded = json.load(f)["quantization"]["exclude_modules"]
    assert excluded == [
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.self_attn.k_proj",
        "model.layers.1.self_attn.v_proj",
        "lm_head",
    ]


# --------------------------------------------------------------------------- errors / streaming


@pytest.mark.parametrize("value", [np.inf, np.nan])  # a NaN must not vanish in max(0.0, nan) == 0.0
def test_non_finite_weight_is_refused_and_nothing_is_written(hf_dir, tmp_path, value):
    bad = tmp_path / "bad"
    tensors = _tensors(hf_dir)
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"].copy()
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = value
    from converters.hf import write_safetensors

    os.makedirs(bad)
    write_safetensors(
        str(bad / "model.safetensors"), [(n, a.dtype.name, a.shape) for n, a in tensors.items()], tensors.__getitem__
    )
    with open(os.path.join(hf_dir, "config.json")) as f, open(bad / "config.json", "w") as g:
        g.write(f.read())
    with pytest.raises(NVFP4ToolError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*non-finite"):
        _export(bad, tmp_path / "out", quant="nvfp4-weight-only")
    assert sorted(os.listdir(tmp_path)) == ["bad"]  # neither the output nor a temporary folder


def test_w4a4_from_plain_hf_needs_calibration_and_existing_output_needs_force(hf_dir, tmp_path):
    with pytest.raises(NVFP4ToolError, match="--calib-data"):
        _export(hf_dir, tmp_path / "o")
    _export(hf_dir, tmp_path / "o", quant="nvfp4-weight-only")
    with pytest.raises(NVFP4ToolError, match="already exists"):
        _export(hf_dir, tmp_path / "o", quant="nvfp4-weight-only")
    _export(hf_dir, tmp_path / "o", quant="nvfp4-weight-only", force=True)


def test_sharded_export_equals_single_file(hf_dir, tmp_path):
    _export(hf_dir, tmp_path / "one", quant="nvfp4-weight-only")
    _export(hf_dir, tmp_path / "many", quant="nvfp4-weight-only", max_shard_size="20KB")
    shards = sorted(f for f in os.listdir(tmp_path / "many") if f.endswith(".safetensors"))
    assert len(shards) > 2 and os.path.isfile(tmp_path / "many" / "model.safetensors.index.json")
    with open(tmp_path / "many" / "model.safetensors.index.json") as f:
        index = json.load(f)
    for file_name in shards:
        header = read_safetensors_header(str(tmp_path / "many" / file_name))
        assert {index["weight_map"][n] for n in header} == {file_name}
        modules = {n.rpartition(".")[0] for n in header if n.endswith(".weight_scale")}
        assert all(f"{m}.weight_scale_2" in header for m in modules)  # a module stays in one shard
    one, many = _tensors(str(tmp_path / "one")), _tensors(str(tmp_path / "many"))
    assert one.keys() == many.keys() and all(_bytes(one[n]) == _bytes(many[n]) for n in one)


# ----------------------------------------------------------------- provenance, simulate, convert


def test_provenance_record(hf_dir, calib, exports, tmp_path):
    record = ExportRecord.read(exports["modelopt"])
    assert record.source.name == "hf" and record.source.kind == "hf"
    assert record.source.files == {"model.safetensors": sha256_file(os.path.join(hf_dir, "model.safetensors"))}
    assert record.calibration.file == "ids.npy" and record.calibration.sha256 == sha256_file(calib)
    assert record.calibration.samples == 3
    assert record.weight_block == "1d" and record.input_amax_origin == "calibration"
    assert set(record.layers) == set(QUANTIZED)
    assert all(0.05 < v.rel_l2 < 0.15 for v in record.layers.values())
    # every written tensor: its file, dtype, shape, sha256; quantized weights their decoded amax
    tensors = _tensors(exports["modelopt"])
    assert set(record.tensors) == set(tensors)
    for name, array in tensors.items():
        entry = record.tensors[name]
        assert entry.file == "model.safetensors" and entry.shape == array.shape
        assert entry.sha256 == hashlib.sha256(_bytes(array)).hexdigest(), name
    exported = load_export(exports["modelopt"])
    for module in QUANTIZED:
        decoded = np.abs(exported.dequantized(module)).max()
        assert record.tensors[f"{module}.weight"].amax == pytest.approx(float(decoded), rel=1e-7)
    assert record.tensors["lm_head.weight"].amax is None
    # no absolute path of this machine anywhere in the record
    text = open(ExportRecord.path(exports["modelopt"])).read()
    for path in (hf_dir, calib, exports["modelopt"], str(tmp_path)):
        assert os.path.dirname(path) not in text
    _export(hf_dir, tmp_path / "mse", quant="nvfp4-weight-only", scale_search="mse")
    layers = ExportRecord.read(str(tmp_path / "mse")).layers
    assert all(v.reduction_vs_rtn > 0 and v.rel_l2 < v.rtn_rel_l2 for v in layers.values())


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_simulate_decodes_exactly_dequantize_nvfp4(hf_dir, exports, fmt):
    exported = load_export(exports[fmt])
    src = _tensors(hf_dir)
    assert exported.quant == "nvfp4" and set(exported.quantized) == set(QUANTIZED)
    for module in QUANTIZED:
        ref = quantize_nvfp4(src[f"{module}.weight"], global_amax=_group_amax(src, module))
        assert _bytes(exported.dequantized(module)) == _bytes(np.asarray(dequantize_nvfp4(ref)))
    # the W4A4 LinearFn changes the logits (activations are fake-quantized), weight decode alone not
    from nvfp4tool.model import forward

    model = exported.model(jnp.float32)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 256, (1, 12)))

    def decode_only(x, w, b, *, name):  # the weights as served, the activations left alone
        return dense(x, w.dequantize() if hasattr(w, "dequantize") else w, b)

    plain, simulated = forward(model, ids, linear=decode_only), forward(model, ids, linear=served_linear)
    assert np.isfinite(np.asarray(simulated)).all()
    assert 0 < float(jnp.abs(plain - simulated).max())


def test_convert_format_is_lossless_both_ways(exports, tmp_path):
    convert_format(exports["modelopt"], str(tmp_path / "ct"), to="compressed-tensors")
    convert_format(exports["compressed-tensors"], str(tmp_path / "mo"), to="modelopt")
    for converted, direct in ((tmp_path / "ct", exports["compressed-tensors"]), (tmp_path / "mo", exports["modelopt"])):
        with (
            open(converted / "model.safetensors", "rb") as a,
            open(os.path.join(direct, "model.safetensors"), "rb") as b,
        ):
            assert a.read() == b.read()
        for name in ("config.json",):
            with open(converted / name) as a, open(os.path.join(direct, name)) as b:
                assert json.load(a)["quantization_config"] == json.load(b)["quantization_config"]
    assert os.path.isfile(tmp_path / "mo" / "hf_quant_config.json")
    with pytest.raises(NVFP4ToolError, match="already in the modelopt layout"):
        convert_format(exports["modelopt"], str(tmp_path / "x"), to="modelopt")


def test_cli_export_and_convert_format(hf_dir, tmp_path):
    runner = CliRunner()
    result = runner.invoke(
        cli,
        [
            "export",
            hf_dir,
            "--to",
            "safetensors",
            "--out",
            str(tmp_path / "o"),
            "--quant",
            "nvfp4-weight-only",
            "--scale-search",
            "4over6",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "GB/s" in result.output and os.path.isfile(tmp_path / "o" / "model.safetensors")
    result = runner.invoke(
        cli, ["convert-format", str(tmp_path / "o"), str(tmp_path / "c"), "--to", "compressed-tensors"]
    )
    assert result.exit_code == 0, result.output
    assert load_export(str(tmp_path / "c")).format == "compressed-tensors"
    result = runner.invoke(cli, ["export", hf_dir, "--out", str(tmp_path / "o2")])
    assert result.exit_code == 1 and "--calib-data" in result.output
    for command in ("export", "convert-format"):
        assert "Example:" in runner.invoke(cli, [command, "--help"]).output


def test_maxtext_source_exports_like_its_hf_original(hf_dir, tmp_path):
    from converters.maxtext import write_maxtext

    write_maxtext(tmp_path / "mt", CONFIG, HFFolderSource(hf_dir), scan_layers=True, rope_layout="half")
    with pytest.raises(NVFP4ToolError, match="--model-config"):
        _export(tmp_path / "mt", tmp_path / "x", quant="nvfp4-weight-only")
    _export(tmp_path / "mt", tmp_path / "from-mt", quant="nvfp4-weight-only", model_config=hf_dir, rope_layout="half")
    _export(hf_dir, tmp_path / "from-hf", quant="nvfp4-weight-only")
    a, b = _tensors(str(tmp_path / "from-mt")), _tensors(str(tmp_path / "from-hf"))
    assert a.keys() == b.keys() and all(_bytes(a[n]) == _bytes(b[n]) for n in a)  # bf16 -> fp32 -> bf16 exact


def test_outputs_overlapping_an_input_are_usage_errors_naming_the_flag(hf_dir, calib, exports, tmp_path):
    runner = CliRunner()
    cases = [  # (argv, the flag the message names); --force or not, nothing may be replaced
        (["export", hf_dir, "--out", os.path.join(hf_dir, "sub"), "--quant", "nvfp4-weight-only"], "--out"),
        (["export", hf_dir, "--out", hf_dir, "--quant", "nvfp4-weight-only", "--force"], "--out"),
        (["export", hf_dir, "--out", os.path.dirname(calib), "--calib-data", calib, "--force"], "--out"),
        (["convert-format", exports["modelopt"], exports["modelopt"], "--to", "compressed-tensors", "--force"], "OUT"),
    ]
    before = {p: sorted(os.listdir(p)) for p in (hf_dir, os.path.dirname(calib), exports["modelopt"])}
    for argv, flag in cases:
        result = runner.invoke(cli, argv)
        assert result.exit_code == 2, (argv, result.output)
        assert flag in result.output, (argv, result.output)
    assert before == {p: sorted(os.listdir(p)) for p in before}
