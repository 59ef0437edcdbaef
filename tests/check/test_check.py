"""`nvfp4tool check`: valid checkpoints in every format pass; each kind of breakage is caught and
names its module and tensor."""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest

from nvfp4tool.check import Problem, check_checkpoint, parse_tp
from nvfp4tool.check.report import FILE_LEVEL
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError

from fixtures.serving_fixtures import FORMATS, build_checkpoint, linear_shapes, write_checkpoint

Q = "model.layers.0.self_attn.q_proj"
K = "model.layers.0.self_attn.k_proj"
V = "model.layers.0.self_attn.v_proj"
O_PROJ = "model.layers.1.self_attn.o_proj"
GATE = "model.layers.1.mlp.gate_proj"
UP = "model.layers.1.mlp.up_proj"
DOWN = "model.layers.0.mlp.down_proj"
# Tensor names per format: (weight, block scales, weight global scale, input global scale).
NAMES = {
    "modelopt": ("weight", "weight_scale", "weight_scale_2", "input_scale"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"),
}


def _check(tmp_path, ckpt, *, shards: int = 1, tp=(1,), name: str = "ckpt"):
    return check_checkpoint(write_checkpoint(tmp_path / name, ckpt, shards=shards), tp=tp)


def _only(report, tensor: str, *words: str) -> Problem:
    """The report's single problem, which names `tensor` and contains `words`."""
    assert len(report.problems) == 1, [p.line() for p in report.problems]
    problem = report.problems[0]
    assert problem.tensor == tensor, problem.line()
    for word in words:
        assert word in problem.message, problem.line()
    return problem


def _scalar(fmt: str, value: float) -> np.ndarray:
    return np.array(value if fmt == "modelopt" else [value], np.float32)


# ------------------------------------------------------------------------------------ valid folders


@pytest.mark.parametrize("fmt,quant", FORMATS)
@pytest.mark.parametrize("shards", [1, 3])
def test_valid_checkpoints_pass(tmp_path, fmt, quant, shards):
    report = _check(tmp_path, build_checkpoint(fmt, quant), shards=shards, tp=(1, 2, 4))
    assert report.ok, [p.line() for p in report.problems]
    assert (report.format, report.quant) == (fmt, quant)
    assert [m.module for m in report.modules] == sorted(linear_shapes(), key=_layer_then_name)
    for m in report.modules:
        assert (m.n, m.k) == linear_shapes()[m.module]
        assert m.bits_per_param == (8.0 if quant == "fp8" else 4.5)
        assert m.zero_scale_share == (None if quant == "fp8" else 0.0)
        assert m.weight_global_scale > 0
        assert (m.input_global_scale is None) == (quant == "nvfp4-weight-only")
    assert report.model_checked
    assert report.tensors_checked == len(build_checkpoint(fmt, quant).tensors)


def _layer_then_name(module: str) -> tuple[int, str]:
    return int(module.split(".")[2]), module


def test_zero_scale_share_is_reported_per_module(tmp_path):
    ckpt = build_checkpoint("modelopt", "nvfp4")
    scales = ckpt.tensors[f"{DOWN}.weight_scale"].copy()  # [64, 8]
    scales[:3, :] = 0  # three rows of eight blocks: 24 of 512 block scales
    scales[10, 5] = 0
    ckpt.tensors[f"{DOWN}.weight_scale"] = scales
    report = _check(tmp_path, ckpt)
    assert report.ok  # some zero blocks are legal (all-zero input blocks)
    share = {m.module: m.zero_scale_share for m in report.modules}
    assert share[DOWN] == 25 / 512
    assert share[Q] == 0.0


# ------------------------------------------------------------------------------------ block scales


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_all_zero_block_scales(tmp_path, fmt):
    ckpt = build_checkpoint(fmt, "nvfp4")
    name = f"{O_PROJ}.weight_scale"
    ckpt.tensors[name] = np.zeros_like(ckpt.tensors[name])
    report = _check(tmp_path, ckpt)
    problem = _only(report, name, "all 256 block scales are zero")
    assert problem.module == O_PROJ
    assert {m.module: m.zero_scale_share for m in report.modules}[O_PROJ] == 1.0


@pytest.mark.parametrize("code", [0x7F, 0xFF])
def test_nan_block_scale(tmp_path, code):
    ckpt = build_checkpoint("compressed-tensors", "nvfp4")
    name = f"{GATE}.weight_scale"
    codes = ckpt.tensors[name].view(np.uint8).copy()
    codes[7, 2] = code
    ckpt.tensors[name] = codes.view(ml_dtypes.float8_e4m3fn)
    problem = _only(_check(tmp_path, ckpt), name, "1 NaN block scales", "index [7, 2]")
    assert problem.module == GATE


def test_negative_block_scale(tmp_path):
    ckpt = build_checkpoint("modelopt", "nvfp4")
    name = f"{Q}.weight_scale"
    codes = ckpt.tensors[name].view(np.uint8).copy()
    codes[0, 0] |= 0x80
    ckpt.tensors[name] = codes.view(ml_dtypes.float8_e4m3fn)
    _only(_check(tmp_path, ckpt), name, "1 negative block scales")


# ------------------------------------------------------------------------------------ global scales


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
@pytest.mark.parametrize("value", [0.0, -1.0, np.inf, np.nan])
def test_bad_weight_global_scale(tmp_path, fmt, value):
    # Down_proj is in no fused group, so only the value itself can be wrong.
    ckpt = build_checkpoint(fmt, "nvfp4")
    name = f"{DOWN}.{NAMES[fmt][2]}"
    ckpt.tensors[name] = _scalar(fmt, value)
    problem = _only(_check(tmp_path, ckpt), name, "must be finite and > 0")
    assert problem.module == DOWN


@pytest.mark.parametrize("fmt,quant", FORMATS)
def test_reciprocal_weight_global_scale_is_an_implausible_magnitude(tmp_path, fmt, quant):
    # no provenance record here: the magnitude rule alone catches the convention mix-up
    ckpt = build_checkpoint(fmt, quant)
    name = f"{DOWN}.{_global_suffix(fmt, quant)}"
    ckpt.tensors[name] = np.asarray(np.float32(1.0) / ckpt.tensors[name], np.float32)
    report = _check(tmp_path, ckpt)
    problem = _only(report, name, "implausible for a linear layer")
    assert "reciprocal" in problem.message


@pytest.mark.parametrize("fmt,quant", FORMATS)
def test_bf16_tensor_relabelled_f16_disagrees_with_config(tmp_path, fmt, quant):
    ckpt = build_checkpoint(fmt, quant)
    ckpt.tensors["model.norm.weight"] = ckpt.tensors["model.norm.weight"].view(np.float16)  # same bytes
    _only(_check(tmp_path, ckpt), "model.norm.weight", "is F16 but config.json says dtype bfloat16")


@pytest.mark.parametrize("fmt,quant", FORMATS)
def test_float_tensor_relabelled_integer_is_caught(tmp_path, fmt, quant):
    ckpt = build_checkpoint(fmt, quant)
    ckpt.tensors["model.norm.weight"] = ckpt.tensors["model.norm.weight"].view(np.int16)  # same bytes
    _only(_check(tmp_path, ckpt), "model.norm.weight", "is I16, not a floating dtype")


def _global_suffix(fmt: str, quant: str) -> str:
    from nvfp4tool.formats import get

    return get(fmt, quant).suffix("weight_global")


def test_bad_input_scale_and_fp8_weight_scale(tmp_path):
    ckpt = build_checkpoint("modelopt", "nvfp4")
    ckpt.tensors[f"{O_PROJ}.input_scale"] = _scalar("modelopt", -0.5)
    _only(_check(tmp_path, ckpt, name="a"), f"{O_PROJ}.input_scale", "is -0.5")
    ckpt = build_checkpoint("modelopt", "fp8")
    ckpt.tensors[f"{DOWN}.weight_scale"] = _scalar("modelopt", np.inf)
    _only(_check(tmp_path, ckpt, name="b"), f"{DOWN}.weight_scale", "is inf")


def test_global_scale_shape_per_format(tmp_path):
    # compressed-tensors needs [1] (transformers refuses []); ModelOpt writes [].
    ckpt = build_checkpoint("compressed-tensors", "nvfp4")
    ckpt.tensors[f"{DOWN}.weight_global_scale"] = ckpt.tensors[f"{DOWN}.weight_global_scale"].reshape(())
    _only(_check(tmp_path, ckpt, name="ct"), f"{DOWN}.weight_global_scale", "F32[]", "expected F32 [1]")
    ckpt = build_checkpoint("modelopt", "nvfp4")
    ckpt.tensors[f"{DOWN}.weight_scale_2"] = ckpt.tensors[f"{DOWN}.weight_scale_2"].astype(np.float16)
    _only(_check(tmp_path, ckpt, name="mo"), f"{DOWN}.weight_scale_2", "F16[]", "expected F32 []")


def test_input_scales_required_for_w4a4_and_absent_for_w4a16(tmp_path):
    ckpt = build_checkpoint("compressed-tensors", "nvfp4")
    del ckpt.tensors[f"{DOWN}.input_global_scale"]
    _only(_check(tmp_path, ckpt, name="a"), f"{DOWN}.input_global_scale", "missing")
    ckpt = build_checkpoint("modelopt", "nvfp4-weight-only")
    ckpt.tensors[f"{DOWN}.input_scale"] = _scalar("modelopt", 0.01)
    _only(_check(tmp_path, ckpt, name="b"), f"{DOWN}.input_scale", "weight-only")


# ------------------------------------------------------------------------------------ fused groups


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_mismatched_fused_group_weight_global_scale(tmp_path, fmt):
    ckpt = build_checkpoint(fmt, "nvfp4")
    suffix = NAMES[fmt][2]
    shared = float(ckpt.tensors[f"{K}.{suffix}"].reshape(-1)[0])
    ckpt.tensors[f"{K}.{suffix}"] = _scalar(fmt, shared * 2)
    report = _check(tmp_path, ckpt)
    problem = _only(
        report,
        f"{K}.{suffix}, {Q}.{suffix}, {V}.{suffix}",
        "differ",
        f"k_proj {np.float32(shared * 2):.8g}",
        f"q_proj {np.float32(shared):.8g}",
    )
    assert problem.module == "model.layers.0.self_attn.qkv"


def test_mismatched_fused_group_input_scale(tmp_path):
    ckpt = build_checkpoint("modelopt", "nvfp4")
    ckpt.tensors[f"{UP}.input_scale"] = np.array(ckpt.tensors[f"{UP}.input_scale"] * 1.5, np.float32)
    problem = _only(_check(tmp_path, ckpt), f"{GATE}.input_scale, {UP}.input_scale", "differ")
    assert problem.module == "model.layers.1.mlp.gate_up"


def test_fp8_fused_scales_may_differ(tmp_path):
    # vLLM requantizes FP8 shards to the group's max scale, so different per-shard scales are fine
    # (the fixture's q/k/v weight scales differ: each is its own amax / 448).
    ckpt = build_checkpoint("modelopt", "fp8")
    assert ckpt.tensors[f"{Q}.weight_scale"] != ckpt.tensors[f"{K}.weight_scale"]
    assert _check(tmp_path, ckpt).ok


def test_fused_group_half_excluded(tmp_path):
    ckpt = build_checkpoint("modelopt", "nvfp4")
    w = np.random.default_rng(0).normal(0, 0.05, linear_shapes()[V]).astype(ml_dtypes.bfloat16)
    for suffix in ("weight_scale", "weight_scale_2", "input_scale"):
        del ckpt.tensors[f"{V}.{suffix}"]
    ckpt.tensors[f"{V}.weight"] = w
    ckpt.hf_quant_config["quantization"]["exclude_modules"].append(V)
    ckpt.config["quantization_config"]["ignore"].append(V)
    report = _check(tmp_path, ckpt)
    _only(report, f"{K}, {Q}, {V}", "mixes quantized and unquantized", "v_proj excluded")


# ------------------------------------------------------------------------------------ exclusions


@pytest.mark.parametrize("fmt,scale", [("modelopt", "input_scale"), ("compressed-tensors", "input_global_scale")])
def test_excluded_module_ships_a_scale(tmp_path, fmt, scale):
    ckpt = build_checkpoint(fmt, "nvfp4")
    ckpt.tensors[f"lm_head.{scale}"] = _scalar(fmt, 0.01)
    problem = _only(_check(tmp_path, ckpt), f"lm_head.{scale}", "excluded by 'lm_head'", "vLLM fails to load it")
    assert problem.module == "lm_head"


def test_excluded_by_wildcard_pattern(tmp_path):
    # ModelOpt patterns are fnmatch wildcards; a whole excluded block must ship no scales.
    ckpt = build_checkpoint("modelopt", "nvfp4")
    ckpt.hf_quant_config["quantization"]["exclude_modules"].append("model.layers.1.*")
    ckpt.config["quantization_config"]["ignore"].append("model.layers.1.*")
    report = _check(tmp_path, ckpt)
    flagged = {p.module for p in report.problems}
    assert flagged == {m for m in linear_shapes() if m.startswith("model.layers.1.")}
    assert all("excluded by 'model.layers.1.*'" in p.message for p in report.problems)


def test_linear_neither_quantized_nor_excluded(tmp_path):
    ckpt = build_checkpoint("compressed-tensors", "nvfp4")
    ckpt.config["quantization_config"]["ignore"] = []  # lm_head is BF16 but no longer ignored
    problem = _only(_check(tmp_path, ckpt), "lm_head.weight", "neither quantized nor listed")
    assert problem.module == "lm_head"


def test_ct_regex_ignore(tmp_path):
    ckpt = build_checkpoint("compressed-tensors", "nvfp4")
    ckpt.config["quantization_config"]["ignore"] = ["re:.*lm_head$"]
    assert _check(tmp_path, ckpt).ok


# ------------------------------------------------------------------------------------ dtypes, shapes


@pytest.mark.parametrize("dtype,bits", [(ml_dtypes.float8_e4m3fn, 8.5), (ml_dtypes.bfloat16, 16.5)])
def test_wrong_packed_dtype(tmp_path, dtype, bits):
    # An "NVFP4" export that holds FP8 or BF16 weights beside valid block scales.
    ckpt = build_checkpoint("modelopt", "nvfp4")
    w = np.random.default_rng(1).normal(0, 0.05, linear_shapes()[Q]).astype(dtype)
    ckpt.tensors[f"{Q}.weight"] = w
    report = _check(tmp_path, ckpt)
    lines = [p.line() for p in report.problems]
    assert all(p.tensor == f"{Q}.weight" for p in report.problems), lines
    code = "F8_E4M3" if dtype == ml_dtypes.float8_e4m3fn else "BF16"
    assert any(f"is {code}[64, 64], expected U8" in line for line in lines), lines
    assert any(f"stores {bits:g} bits per parameter" in line for line in lines), lines
    assert {m.module: m.bits_per_param for m in report.modules}[Q] == bits


def test_block_scale_shape_and_dtype(tmp_path):
    ckpt = build_checkpoint("compressed-tensors", "nvfp4")
    name = f"{DOWN}.weight_scale"
    ckpt.tensors[name] = ckpt.tensors[name].astype(np.float32)
    report = _check(tmp_path, ckpt, name="dtype")
    by_tensor = {p.tensor: p.message for p in report.problems}
    assert len(report.problems) == 2 and set(by_tensor) == {f"{DOWN}.weight_packed", name}
    assert "is F32[64, 8], expected F8_E4M3 [64, 8]" in by_tensor[name]
    assert "stores 6 bits" in by_tensor[f"{DOWN}.weight_packed"]  # 4 + 32 / 16
    ckpt = build_checkpoint("compressed-tensors", "nvfp4")
    ckpt.tensors[name] = np.ascontiguousarray(ckpt.tensors[name][:, :4])  # K/32: swizzled / wrong
    report = _check(tmp_path, ckpt, name="shape")
    assert {p.tensor for p in report.problems} == {f"{DOWN}.weight_packed", name}


def test_k_not_divisible_at_tp8(tmp_path):
    # o_proj is row-parallel with K = 64: TP 4 shards K = 16 (fine), TP 8 shards K = 8 (cuts a block).
    ckpt = build_checkpoint("modelopt", "nvfp4")
    assert _check(tmp_path, ckpt, tp=(1, 2, 4), name="a").ok
    report = _check(tmp_path, ckpt, tp=(1, 2, 4, 8), name="b")
    assert sorted(p.module for p in report.problems) == ["model.layers.0.self_attn.o_proj", O_PROJ]
    for p in report.problems:
        assert p.tensor == f"{p.module}.weight"
        assert "row-parallel K = 64 at TP 8 gives shards of K = 8, not a multiple of 16" in p.message


def test_column_parallel_n_not_divisible(tmp_path):
    ckpt = build_checkpoint("modelopt", "fp8")
    report = _check(tmp_path, ckpt, tp=(64,))
    # N = 32 (k/v) cannot split 64 ways; q/o/down (64 rows or K) can; gate/up have N = 128.
    assert {p.module.rpartition(".")[2] for p in report.problems} == {"k_proj", "v_proj"}
    assert all("column-parallel N = 32" in p.message for p in report.problems)


def test_k_not_multiple_of_16(tmp_path):
    ckpt = build_checkpoint("modelopt", "nvfp4")
    ckpt.tensors[f"{DOWN}.weight"] = np.ascontiguousarray(ckpt.tensors[f"{DOWN}.weight"][:, :60])
    ckpt.tensors[f"{DOWN}.weight_scale"] = np.ascontiguousarray(ckpt.tensors[f"{DOWN}.weight_scale"][:, :7])
    report = _check(tmp_path, ckpt)
    assert any(
        p.tensor == f"{DOWN}.weight" and "K = 120 is not a multiple of 16" in p.message for p in report.problems
    ), [p.line() for p in report.problems]


# ------------------------------------------------------------------------------------ data


@pytest.mark.parametrize("name", [f"{DOWN}.weight", "model.embed_tokens.weight", "lm_head.weight"])
def test_all_zero_tensor(tmp_path, name):
    ckpt = build_checkpoint("modelopt", "nvfp4")
    ckpt.tensors[name] = np.zeros_like(ckpt.tensors[name])
    problem = _only(_check(tmp_path, ckpt), name, "all data is zero")
    assert problem.module == name.rpartition(".")[0]


def test_non_finite_bf16_weight(tmp_path):
    ckpt = build_checkpoint("modelopt", "fp8")
    w = ckpt.tensors["lm_head.weight"].copy()
    w[3, 4] = np.nan
    w[5, 6] = np.inf
    ckpt.tensors["lm_head.weight"] = w
    _only(_check(tmp_path, ckpt), "lm_head.weight", "2 non-finite values", "index [3, 4]")


def test_fp8_weight_nan_code(tmp_path):
    ckpt = build_checkpoint("modelopt", "fp8")
    codes = ckpt.tensors[f"{O_PROJ}.weight"].view(np.uint8).copy()
    codes[1, 2] = 0xFF
    ckpt.tensors[f"{O_PROJ}.weight"] = codes.view(ml_dtypes.float8_e4m3fn)
    _only(_check(tmp_path, ckpt), f"{O_PROJ}.weight", "1 NaN codes", "index [1, 2]")


def test_fp8_checkpoint_with_bf16_weight(tmp_path):
    ckpt = build_checkpoint("modelopt", "fp8")
    ckpt.tensors[f"{O_PROJ}.weight"] = ckpt.tensors[f"{O_PROJ}.weight"].astype(ml_dtypes.bfloat16)
    report = _check(tmp_path, ckpt)
    assert {p.tensor for p in report.problems} == {f"{O_PROJ}.weight"}
    assert any("expected F8_E4M3 [N, K]" in p.message for p in report.problems)
    assert any("stores 16 bits per parameter; FP8 is 8" in p.message for p in report.problems)


# ------------------------------------------------------------------------------------ files


def test_truncated_shard(tmp_path):
    ckpt = build_checkpoint("compressed-tensors", "nvfp4")
    folder = write_checkpoint(tmp_path / "ckpt", ckpt, shards=2)
    shard = os.path.join(folder, "model-00002-of-00002.safetensors")
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        in_shard = [n for n, s in json.load(f)["weight_map"].items() if s == os.path.basename(shard)]
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.truncate(size - 3)
    report = check_checkpoint(folder)
    truncated = [p for p in report.problems if "truncated shard" in p.message]
    assert len(truncated) == 1, [p.line() for p in report.problems]
    last = max(in_shard, key=lambda n: _header(shard)[n]["data_offsets"][1])
    assert truncated[0].tensor == last and truncated[0].module == FILE_LEVEL
    assert "model-00002-of-00002.safetensors" in truncated[0].message
    # The truncated tensor is left out (never read), and named again by what needed it.
    assert all(last in p.line() for p in report.problems), [p.line() for p in report.problems]


def _header(path: str) -> dict:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n))


def test_index_names_a_missing_tensor_and_a_missing_shard(tmp_path):
    folder = write_checkpoint(tmp_path / "ckpt", build_checkpoint("modelopt", "nvfp4"), shards=2)
    index = _read_index(folder)
    index["weight_map"]["model.layers.0.mlp.extra.weight"] = "model-00001-of-00002.safetensors"
    index["weight_map"]["model.layers.9.mlp.gone.weight"] = "model-00009-of-00009.safetensors"
    _write_index(folder, index)
    report = check_checkpoint(folder)
    by_tensor = {p.tensor: p.message for p in report.problems}
    assert "shard has no such tensor" in by_tensor["model.layers.0.mlp.extra.weight"]
    assert "which does not exist" in by_tensor["model.layers.9.mlp.gone.weight"]
    assert set(by_tensor) == {"model.layers.0.mlp.extra.weight", "model.layers.9.mlp.gone.weight"}


def test_tensor_missing_from_index_and_total_size(tmp_path):
    folder = write_checkpoint(tmp_path / "ckpt", build_checkpoint("modelopt", "nvfp4"), shards=2)
    index = _read_index(folder)
    del index["weight_map"]["model.norm.weight"]
    index["metadata"]["total_size"] += 1
    _write_index(folder, index)
    report = check_checkpoint(folder)
    by_tensor = {p.tensor: p.message for p in report.problems}
    assert "not in model.safetensors.index.json" in by_tensor["model.norm.weight"]
    assert "metadata.total_size" in by_tensor["model.safetensors.index.json"]
    assert len(report.problems) == 2


def test_tensor_in_two_shards(tmp_path):
    from safetensors.numpy import save_file

    ckpt = build_checkpoint("modelopt", "nvfp4")
    folder = write_checkpoint(tmp_path / "ckpt", ckpt)
    save_file({"model.norm.weight": ckpt.tensors["model.norm.weight"]}, os.path.join(folder, "extra.safetensors"))
    _only(check_checkpoint(folder), "model.norm.weight", "in two files")


def test_header_with_trailing_bytes(tmp_path):
    folder = write_checkpoint(tmp_path / "ckpt", build_checkpoint("modelopt", "nvfp4"))
    with open(os.path.join(folder, "model.safetensors"), "ab") as f:
        f.write(b"\0" * 5)
    _only(check_checkpoint(folder), "model.safetensors", "5 bytes after the last tensor")


# ------------------------------------------------------------------------------------ configs


def test_hf_quant_config_keys(tmp_path):
    ckpt = build_checkpoint("modelopt", "nvfp4")
    del ckpt.hf_quant_config["quantization"]["kv_cache_quant_algo"]
    del ckpt.hf_quant_config["quantization"]["group_size"]
    problem = _only(_check(tmp_path, ckpt), "hf_quant_config.json", "lacks kv_cache_quant_algo, group_size")
    assert "vLLM requires quant_algo, kv_cache_quant_algo, group_size, exclude_modules" in problem.message


def test_config_disagreements(tmp_path):
    ckpt = build_checkpoint("modelopt", "nvfp4")
    ckpt.config["quantization_config"]["quant_algo"] = "FP8"
    ckpt.config["quantization_config"]["ignore"] = []
    report = _check(tmp_path, ckpt)
    assert [p.tensor for p in report.problems] == ["config.json", "config.json"]
    ckpt = build_checkpoint("compressed-tensors", "nvfp4")
    ckpt.config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 32
    _only(_check(tmp_path, ckpt, name="ct"), "config.json", "'group_size': 32")


def test_unsupported_folders_raise(tmp_path):
    ckpt = build_checkpoint("modelopt", "nvfp4")
    ckpt.hf_quant_config = None
    del ckpt.config["quantization_config"]
    folder = write_checkpoint(tmp_path / "plain", ckpt)
    with pytest.raises(NVFP4ToolError, match="not an NVFP4/FP8 serving checkpoint"):
        check_checkpoint(folder)
    ckpt = build_checkpoint("compressed-tensors", "nvfp4")
    ckpt.config["quantization_config"]["format"] = "pack-quantized"  # int4: not a layout we check
    with pytest.raises(NVFP4ToolError, match="pack-quantized is not supported"):
        _check(tmp_path, ckpt, name="ct")


def test_float_quantized_config_over_nvfp4_tensors_is_a_problem_not_a_refusal(tmp_path):
    # float-quantized (compressed-tensors FP8) is a supported layout: NVFP4 tensors under an FP8
    # config are problems of that checkpoint, not an unsupported folder.
    ckpt = build_checkpoint("compressed-tensors", "nvfp4")
    ckpt.config["quantization_config"]["format"] = "float-quantized"
    report = _check(tmp_path, ckpt)
    assert (report.format, report.quant) == ("compressed-tensors", "fp8")
    assert any(p.tensor == "config.json" and "float-quantized needs" in p.message for p in report.problems)
    assert any(p.tensor == f"{Q}.weight" and "missing" in p.message for p in report.problems)


def test_parse_tp():
    assert parse_tp("1,2, 4,8") == (1, 2, 4, 8)
    for bad in ("", "0", "a,2"):
        with pytest.raises(NVFP4UsageError):
            parse_tp(bad)


# ------------------------------------------------------------------------------------ vs config.json


def test_linear_layer_missing_entirely(tmp_path):
    ckpt = build_checkpoint("compressed-tensors", "nvfp4-weight-only")
    for name in [n for n in ckpt.tensors if n.startswith(DOWN + ".")]:
        del ckpt.tensors[name]
    report = _check(tmp_path, ckpt)
    assert report.model_checked
    problem = _only(report, f"{DOWN}.weight", "missing: config.json's model needs [64, 128]")
    assert problem.module == DOWN


def test_quantized_weight_with_wrong_logical_shape(tmp_path):
    # Bytes of gate_proj [128, 64] stored as a valid-looking [64, 128] NVFP4 weight (transposed
    # shape): dtypes, block-scale shape and 4.5 bits/param all look right; only the model knows.
    ckpt = build_checkpoint("modelopt", "nvfp4")
    ckpt.tensors[f"{GATE}.weight"] = ckpt.tensors[f"{GATE}.weight"].reshape(64, 64)
    ckpt.tensors[f"{GATE}.weight_scale"] = ckpt.tensors[f"{GATE}.weight_scale"].reshape(64, 8)
    _only(_check(tmp_path, ckpt), f"{GATE}.weight", "holds N x K = 64 x 128", "needs 128 x 64")


def test_norm_missing_and_unsupported_family(tmp_path):
    ckpt = build_checkpoint("modelopt", "fp8")
    del ckpt.tensors["model.layers.1.post_attention_layernorm.weight"]
    _only(_check(tmp_path, ckpt, name="a"), "model.layers.1.post_attention_layernorm.weight", "missing")
    ckpt.config["model_type"] = "mixtral"  # a mixtral config without its expert keys: not loadable,
    ckpt.config["architectures"] = ["MixtralForCausalLM"]  # so an error, never a skipped model check
    report = _check(tmp_path, ckpt, name="b")
    assert not report.model_checked
    _only(
        report,
        "config.json",
        "missing required key 'num_experts or num_local_experts'",
        "not loadable as a supported family",
    )


# ------------------------------------------------------------------------------------ streaming


@pytest.mark.parametrize("chunk_bytes", [1, 7, 64, 1 << 20])
def test_scan_counts_do_not_depend_on_chunking(tmp_path, chunk_bytes):
    from safetensors.numpy import save_file

    from nvfp4tool.check.files import read_tensor_table
    from nvfp4tool.check.scan import scan_tensor

    codes = np.arange(40 * 16, dtype=np.uint32).astype(np.uint8).reshape(40, 16)  # every code
    codes[codes == 0x7F] = 0x10
    codes[codes == 0xFF] = 0x10
    codes[33, 5] = 0xFF  # one NaN, late
    values = np.ones((30, 20), ml_dtypes.bfloat16)
    values[29, 19] = np.inf
    packed = np.zeros((16, 8), np.uint8)
    packed[15, 7] = 1  # the only non-zero byte is the last
    save_file(
        {"scales": codes.view(ml_dtypes.float8_e4m3fn), "values": values, "packed": packed},
        str(tmp_path / "model.safetensors"),
    )
    entries, problems = read_tensor_table(str(tmp_path))
    assert problems == []
    s = scan_tensor(entries["scales"], chunk_bytes)
    assert s.elements == 640 and s.nan == 1 and s.first_nan == 33 * 16 + 5
    assert s.zeros == sum(int(c) in (0x00, 0x80) for c in codes.flat) == 5
    assert s.negative == sum(0x80 < int(c) < 0xFF for c in codes.flat)
    v = scan_tensor(entries["values"], chunk_bytes)
    assert v.nan == 1 and v.first_nan == 599 and not v.all_zero
    assert not scan_tensor(entries["packed"], chunk_bytes).all_zero


def _read_index(folder: str) -> dict:
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        return json.load(f)


def _write_index(folder: str, index: dict) -> None:
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
