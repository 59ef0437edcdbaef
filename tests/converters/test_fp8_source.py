"""FP8 block-scaled sources (DeepSeek-V3's `quantization_config` fp8 / `weight_scale_inv` format) read
as their BF16 dequantization, proven against the tests' own numpy reading of the format
(`fixtures.fp8_source_fixtures`) and transformers' FP8 loader; FP8 -> NVFP4 in one export command
equal to exporting the dequantized BF16 folder; bad sources refused in one line."""

from __future__ import annotations

import json
import os
import re
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner

from converters.hf import HFFolderSource
from nvfp4tool.checkpoints import open_checkpoint
from nvfp4tool.cli import cli
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.records.export import ExportRecord

from fixtures.fp8_source_fixtures import (
    oracle_dequantize,
    read_folder_tensors,
    write_dequantized_folder,
    write_fp8_block_folder,
)
from fixtures.hf_fixtures import build_tiny_model

# Head dim 40: q / o [160, 160], k / v [80, 160], gate / up [256, 160], down [160, 256]; with
# 128 x 128 blocks only gate / up rows and down columns tile, every other edge has a partial block.
OVERRIDES = dict(hidden_size=160, intermediate_size=256, head_dim=40)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    """bf16: the tiny Llama; fp8: it in 128 x 128 blocks (its o_proj kept BF16 as a
    modules_to_not_convert entry); deq: the oracle's BF16 reading of fp8; fp8_16x32: 16 x 32 blocks,
    which tile every weight (transformers' loader needs that, see docs/design/converters.md)."""
    root = tmp_path_factory.mktemp("fp8src")
    out = {name: str(root / name) for name in ("bf16", "fp8", "deq", "fp8_16x32")}
    build_tiny_model("llama3", out["bf16"], dtype="bfloat16", overrides=OVERRIDES)
    write_fp8_block_folder(out["bf16"], out["fp8"], keep=("model.layers.1.self_attn.o_proj",))
    write_dequantized_folder(out["fp8"], out["deq"])
    write_fp8_block_folder(out["bf16"], out["fp8_16x32"], (16, 32))
    np.save(root / "ids.npy", np.random.default_rng(0).integers(0, 256, (2, 16)))
    out["calib"] = str(root / "ids.npy")
    return out


def _bits(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array).tobytes()


def test_fp8_source_reads_as_the_numpy_reading_of_the_format_bit_for_bit(folders):
    source = HFFolderSource(folders["fp8"])
    oracle = read_folder_tensors(folders["deq"])
    stored = read_folder_tensors(folders["fp8"])
    assert source.fp8_block.block == (128, 128)
    assert sorted(source.names()) == sorted(oracle)  # the scales are not tensors of the model
    assert stored["model.layers.0.self_attn.q_proj.weight"].dtype == ml_dtypes.float8_e4m3fn
    assert stored["model.layers.1.self_attn.o_proj.weight"].dtype == ml_dtypes.bfloat16  # not converted
    for name, want in oracle.items():
        got = source.get(name)
        assert source.dtype(name) == got.dtype.name == want.dtype.name, name
        assert got.shape == want.shape and _bits(got) == _bits(want), name
    assert "quantization_config" not in source.config.to_hf_config()


def test_sharded_fp8_source_with_a_scale_in_another_shard(folders, tmp_path):
    """The index may put a weight's scale in another shard than the weight (fp8_cast_bf16.py looks
    scales up through the index too)."""
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = load_file(os.path.join(folders["fp8"], "model.safetensors"))
    moved = _scale()
    shards = {"model-00001-of-00002.safetensors": {n: t for n, t in tensors.items() if n != moved}}
    shards["model-00002-of-00002.safetensors"] = {moved: tensors[moved]}
    (tmp_path / "src").mkdir()
    for file_name, part in shards.items():
        save_file(part, str(tmp_path / "src" / file_name), metadata={"format": "pt"})
    weight_map = {n: f for f, part in shards.items() for n in part}
    (tmp_path / "src" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shutil.copy(os.path.join(folders["fp8"], "config.json"), tmp_path / "src")
    source, oracle = HFFolderSource(tmp_path / "src"), read_folder_tensors(folders["deq"])
    assert sorted(source.names()) == sorted(oracle)
    assert all(_bits(source.get(n)) == _bits(oracle[n]) for n in oracle)


@pytest.mark.peers
def test_fp8_source_equals_transformers_fp8_loader_bit_for_bit(folders):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        folders["fp8_16x32"], quantization_config=transformers.FineGrainedFP8Config(dequantize=True)
    )
    theirs = model.state_dict()
    source = HFFolderSource(folders["fp8_16x32"])
    for name in source.names():
        assert theirs[name].dtype == torch.bfloat16, name
        assert theirs[name].view(torch.uint8).numpy().tobytes() == _bits(source.get(name)), name


def test_fp8_to_nvfp4_in_one_export_equals_exporting_the_dequantized_folder(folders, tmp_path):
    runner = CliRunner()
    outs = {}
    for key in ("fp8", "deq"):
        outs[key] = str(tmp_path / key)
        args = ["export", folders[key], "--out", outs[key], "--quant", "nvfp4", "--calib-data", folders["calib"]]
        result = runner.invoke(cli, args + ["--calib-samples", "2", "--calib-seq-len", "16"])
        assert result.exit_code == 0, result.output
    names = sorted(os.listdir(outs["deq"]))
    assert sorted(os.listdir(outs["fp8"])) == names
    for name in names:
        a, b = (open(os.path.join(outs[k], name), "rb").read() for k in ("fp8", "deq"))
        if name == ExportRecord.FILE_NAME:
            a, b = json.loads(a), json.loads(b)
            assert a.pop("source")["quantization"] == {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "weight_block_size": [128, 128],
                "activation_scheme": "dynamic",
            }
            assert b.pop("source")["quantization"] is None
        assert a == b, name
    with open(os.path.join(outs["fp8"], "config.json")) as f:
        assert json.load(f)["quantization_config"]["quant_method"] == "modelopt"  # the export's, not the source's


def test_convert_fp8_source_to_bf16_safetensors(folders, tmp_path):
    result = CliRunner().invoke(cli, ["convert", folders["fp8"], str(tmp_path / "out"), "--to", "hf"])
    assert result.exit_code == 0, result.output
    ours, oracle = read_folder_tensors(str(tmp_path / "out")), read_folder_tensors(folders["deq"])
    assert sorted(ours) == sorted(oracle) and all(_bits(ours[n]) == _bits(oracle[n]) for n in oracle)
    with open(tmp_path / "out" / "config.json") as f:
        config = json.load(f)
    assert "quantization_config" not in config and config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    assert open_checkpoint(folders["fp8"]).source_quantization.block == (128, 128)
    assert open_checkpoint(str(tmp_path / "out")).source_quantization is None


def _edit_config(folder, change):
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    change(config["quantization_config"])
    with open(path, "w") as f:
        json.dump(config, f)


def _edit_tensors(folder, change):
    from safetensors.torch import load_file, save_file

    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _scale(layer="0", proj="self_attn.q_proj"):
    return f"model.layers.{layer}.{proj}.weight_scale_inv"


def _nan_scale(tensors):
    tensors[_scale()][1, 0] = float("nan")


BAD = {
    "missing-scale": (lambda d: _edit_tensors(d, lambda t: t.pop(_scale())), f"{_scale()[:-10]}.*missing"),
    "misshapen-scale": (
        lambda d: _edit_tensors(d, lambda t: t.__setitem__(_scale(), t[_scale()][:1].contiguous())),
        r"has shape \[1, 2\], but weight_block_size \[128, 128\] over .* needs \[2, 2\]",
    ),
    "non-finite-scale": (lambda d: _edit_tensors(d, _nan_scale), r"1 block scale\(s\) that are not finite"),
    "fp16-scale": (
        lambda d: _edit_tensors(d, lambda t: t.__setitem__(_scale(), t[_scale()].half())),
        "block scales must be float32",
    ),
    "unknown-fmt": (lambda d: _edit_config(d, lambda q: q.__setitem__("fmt", "e5m2")), "fmt 'e5m2' unsupported"),
    "static-activations": (
        lambda d: _edit_config(d, lambda q: q.__setitem__("activation_scheme", "static")),
        "activation_scheme 'static' unsupported",
    ),
    "block-does-not-tile": (
        lambda d: _edit_config(d, lambda q: q.__setitem__("weight_block_size", [128, 0])),
        r"weight_block_size \[128, 0\] does not tile",
    ),
    "no-block-size": (lambda d: _edit_config(d, lambda q: q.pop("weight_block_size")), "no weight_block_size"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_fp8_source_is_refused_in_one_line_and_nothing_is_written(folders, tmp_path, case):
    import shutil

    src = str(tmp_path / "src")
    shutil.copytree(folders["fp8"], src)
    corrupt, message = BAD[case]
    corrupt(src)
    result = CliRunner().invoke(cli, ["convert", src, str(tmp_path / "out"), "--to", "hf"])
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert result.exit_code == 1 and len(errors) == 1 and "Traceback" not in result.output, result.output
    assert src in errors[0] and re.search(message, errors[0]), errors[0]
    assert sorted(os.listdir(tmp_path)) == ["src"]  # no output, no temporary folder left


def test_ue8m0_scale_fmt_with_float32_scales_reads_the_same(folders, tmp_path):
    """DeepSeek-V3.1 declares scale_fmt ue8m0 (power-of-two scales) and stores them F32."""
    import shutil

    shutil.copytree(folders["fp8"], tmp_path / "src")
    _edit_config(tmp_path / "src", lambda q: q.__setitem__("scale_fmt", "ue8m0"))
    name = "model.layers.0.mlp.down_proj.weight"
    assert _bits(HFFolderSource(tmp_path / "src").get(name)) == _bits(read_folder_tensors(folders["deq"])[name])


def test_unknown_quant_method_is_refused_by_the_reader(folders, tmp_path):
    import shutil

    shutil.copytree(folders["fp8"], tmp_path / "src")
    _edit_config(tmp_path / "src", lambda q: q.__setitem__("quant_method", "awq"))
    with pytest.raises(NVFP4ToolError, match="quant_method 'awq' is not a source format this tool reads"):
        HFFolderSource(tmp_path / "src")


def test_dequantization_holds_one_chunk_besides_the_result(tmp_path):
    """A [262144, 64] FP8 weight (16.8 M values: 32 MiB as bf16, 64 MiB as one fp32 product) read
    with a peak of traced allocations under 1.5x its bf16 size."""
    from converters import fp8_block

    rows, cols, block = 262144, 64, (128, 128)
    values = np.random.default_rng(0).standard_normal((rows, cols), np.float32).astype(ml_dtypes.float8_e4m3fn)
    scales = np.random.default_rng(1).uniform(1e-3, 1e-2, (rows // 128, 1)).astype(np.float32)
    import torch
    from safetensors.torch import save_file

    weight = torch.from_numpy(values.view(np.uint8)).view(torch.float8_e4m3fn)
    save_file({"w": weight, "w_scale_inv": torch.from_numpy(scales)}, str(tmp_path / "x.safetensors"))
    from converters.hf import _dequantize, read_safetensors_header

    entries = read_safetensors_header(str(tmp_path / "x.safetensors"))
    del weight, values
    tracemalloc.start()
    out = _dequantize(entries["w"], entries["w_scale_inv"], block)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1.5 * out.nbytes, (peak, out.nbytes)
    check = slice(0, 1000)  # the oracle reads back the first 8 block rows
    assert out.dtype == ml_dtypes.bfloat16 and fp8_block.FP8Block(block).scale_shape(out.shape) == scales.shape
    want = oracle_dequantize(
        np.random.default_rng(0).standard_normal((rows, cols), np.float32).astype(ml_dtypes.float8_e4m3fn)[check],
        scales[:8],
        block,
    )
    assert _bits(out[check]) == _bits(want)


def test_a_deepseek_v3_fp8_source_reads_as_the_oracle(tmp_path):
    """DeepSeek-V3's own layout (MLA projections, dense MLP, routed and shared experts FP8; norms,
    routers and the FP32 e_score_correction_bias as stored), on the family's tiny fixture."""
    from fixtures.deepseek_fixtures import BASE, hf_folder

    folder, _ = hf_folder(tmp_path, BASE, seed=0)
    write_fp8_block_folder(folder, str(tmp_path / "fp8"))
    write_dequantized_folder(str(tmp_path / "fp8"), str(tmp_path / "deq"))
    source, oracle = HFFolderSource(tmp_path / "fp8"), read_folder_tensors(str(tmp_path / "deq"))
    stored = read_folder_tensors(str(tmp_path / "fp8"))
    assert stored["model.layers.1.mlp.experts.0.up_proj.weight"].dtype == ml_dtypes.float8_e4m3fn
    assert source.config.family == "deepseek_v3" and sorted(source.names()) == sorted(oracle)
    assert all(_bits(source.get(n)) == _bits(oracle[n]) and source.dtype(n) == oracle[n].dtype.name for n in oracle)
