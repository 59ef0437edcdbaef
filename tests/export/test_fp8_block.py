"""The fp8-block format (issue 41): FP8 E4M3 weights with one fp32 decode scale per 128x128 block
(amax / 448, the grid ceil(N/128) x ceil(K/128)), activations quantized dynamically per token per
128 columns (vLLM's per_token_group_quant_fp8), written as compressed-tensors' FP8_BLOCK scheme,
uniform and per linear in a mixed file with NVFP4; proven against numpy oracles and transformers +
compressed-tensors; ModelOpt's FP8_PB_WO (uniform dense models) converts both ways byte for byte,
and what vLLM's ModelOpt loader cannot read is refused in one line. In a mixed plan it composes with
GPTQ (rounded to nearest, fed forward decoded) and AWQ (scored as served)."""

from __future__ import annotations

import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner

from nvfp4tool import formats
from nvfp4tool.check import check_checkpoint
from nvfp4tool.cli import cli
from nvfp4tool.export import ExportOptions, export_checkpoint, simulate
from nvfp4tool.export.convert_format import convert_format
from nvfp4tool.export.quantizers import FP8_QUANTIZERS
from nvfp4tool.export.simulate import FP8BlockWeight, NVFP4Weight, load_export, served_linear
from nvfp4tool.hub.card import bits_by_quant, build_model_card
from nvfp4tool.numerics import decode_fp8, fake_quantize_fp8_token_groups, quantize_fp8

from fixtures.hf_fixtures import build_tiny_model
from fixtures.mixed_fixtures import FP8_BLOCK_SIZES, stored_tensors

E4M3 = ml_dtypes.float8_e4m3fn
B = 128
# every linear of the tiny Llama below has N and K multiples of 128 (vLLM's merged q/k/v and
# gate/up need it at TP 1), but k/v_proj split at TP 2 into 64-row shards
SIZES = FP8_BLOCK_SIZES
PRECISION_FILE = "model.layers.0.* fp8-block\nmodel.layers.1.self_attn.o_proj bf16\n"


# ------------------------------------------------------------------------------ numpy oracles


def _oracle_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(e4m3 codes, fp32 scale grid, fp32 decode) of w [N, K], block by block in numpy: scale =
    amax / 448 (1 for an all-zero block), codes = e4m3(clip(w / scale)), decode = codes * scale."""
    n, k = w.shape
    grid = (-(-n // B), -(-k // B))
    codes, scales = np.zeros((n, k), E4M3), np.zeros(grid, np.float32)
    for i in range(grid[0]):
        for j in range(grid[1]):
            block = w[i * B : (i + 1) * B, j * B : (j + 1) * B].astype(np.float32)
            amax = np.abs(block).max()
            scale = np.float32(amax) / np.float32(448) if amax > 0 else np.float32(1)
            scales[i, j] = scale
            codes[i * B : (i + 1) * B, j * B : (j + 1) * B] = np.clip(block / scale, -448, 448).astype(E4M3)
    per_element = np.repeat(np.repeat(scales, B, axis=0), B, axis=1)[:n, :k]
    return codes, scales, codes.astype(np.float32) * per_element


def _oracle_groups(x: np.ndarray) -> np.ndarray:
    """vLLM's per_token_group_quant_fp8 (group 128, eps 1e-10, no UE8M0), dequantized, in numpy."""
    groups = x.astype(np.float32).reshape(*x.shape[:-1], x.shape[-1] // B, B)
    scale = np.maximum(np.abs(groups).max(axis=-1, keepdims=True), np.float32(1e-10)) / np.float32(448)
    codes = np.clip(groups / scale, -448, 448).astype(E4M3)
    return (codes.astype(np.float32) * scale).reshape(x.shape)


def _weight(n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 3.0, (n, 1))).astype(np.float32)
    w[:B, B : 2 * B] = 0  # an all-zero block
    return w


def test_block_quantization_and_decode_equal_a_numpy_oracle_bit_for_bit_on_ragged_shapes():
    w = _weight(300, 200)  # neither a multiple of 128: the grid is ceil, [3, 2]
    codes, scales, decoded = _oracle_blocks(w)
    q = quantize_fp8(w, granularity="block128x128")
    assert np.asarray(q.scale).shape == (3, 2)
    assert np.asarray(q.data).view(np.uint8).tobytes() == codes.view(np.uint8).tobytes()
    assert np.asarray(q.scale).tobytes() == scales.tobytes()
    ours = np.asarray(decode_fp8(codes, scales, granularity="block128x128"))
    assert ours.tobytes() == decoded.tobytes()
    done = FP8_QUANTIZERS["fp8-block"].quantize("m", w)  # what the export writes
    assert done.roles["weight"].view(np.uint8).tobytes() == codes.view(np.uint8).tobytes()
    assert done.roles["block_scale"].tobytes() == scales.tobytes() and set(done.roles) == {"weight", "block_scale"}
    assert done.amax == float(np.abs(decoded).max())
    served = FP8BlockWeight(data=codes, scale=scales)  # the served weight, whole and by row blocks
    assert np.asarray(served.dequantize()).tobytes() == decoded.tobytes()
    assert np.asarray(served.dequantize(130, 290)).tobytes() == decoded[130:290].tobytes()


def test_served_linear_quantizes_its_input_per_token_per_128_columns_as_vllm_does():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((2, 5, 256)) * 4).astype(np.float32)
    x[0, 1, :B] = 0  # an all-zero group
    x[1, 2, B:] *= np.float32(1e-12)  # amax < eps: vLLM's scale is eps / 448, not amax / 448
    expected = _oracle_groups(x)
    assert np.asarray(fake_quantize_fp8_token_groups(x)).tobytes() == expected.tobytes()
    codes, scales, decoded = _oracle_blocks(_weight(96, 256, seed=2))
    weight = FP8BlockWeight(data=codes, scale=scales)
    assert np.asarray(weight.quantize_input(x)).tobytes() == expected.tobytes()
    bias = rng.standard_normal(96).astype(np.float32)
    y = np.asarray(served_linear(x, weight, bias, name="m"))
    once = simulate._decode_once(weight)  # generation decodes it once, with the same input quantizer
    assert once.quant == "fp8-block" and np.asarray(served_linear(x, once, bias, name="m")).tobytes() == y.tobytes()
    np.testing.assert_allclose(
        y, expected.astype(np.float64) @ decoded.T.astype(np.float64) + bias, rtol=2e-5, atol=2e-5
    )
    with pytest.raises(Exception, match="multiple of 128"):
        fake_quantize_fp8_token_groups(x[..., :200])


# ------------------------------------------------------------------------------ exports


@pytest.fixture(scope="module")
def fp8_block_exports(tmp_path_factory) -> dict[str, str]:
    """{"src", "uniform" (compressed-tensors --quant fp8-block), "mixed" (layer 0 fp8-block, layer
    1's o_proj BF16, the rest NVFP4 W4A4), "precision_file", "calib"} of one tiny Llama."""
    root = tmp_path_factory.mktemp("fp8_block")
    src = build_tiny_model("llama3", str(root / "hf"), overrides=SIZES)
    precision = root / "precision.txt"
    precision.write_text(PRECISION_FILE)
    np.save(root / "calib.npy", np.random.default_rng(0).integers(0, 256, (2, 16)))
    out = {"src": src, "precision_file": str(precision), "calib": str(root / "calib.npy")}
    out |= {"uniform": str(root / "uniform"), "mixed": str(root / "mixed")}
    export_checkpoint(
        src, out["uniform"], ExportOptions(format="compressed-tensors", quant="fp8-block", show_progress=False)
    )
    export_checkpoint(
        src,
        out["mixed"],
        ExportOptions(
            format="compressed-tensors",
            precision_file=str(precision),
            calib_data=str(root / "calib.npy"),
            calib_samples=2,
            calib_seq_len=16,
            show_progress=False,
        ),
    )
    return out


def test_the_config_is_compressed_tensors_fp8_block_scheme(fp8_block_exports):
    from compressed_tensors.quantization import preset_name_to_scheme

    with open(os.path.join(fp8_block_exports["uniform"], "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    group = qc["config_groups"]["group_0"]
    preset = preset_name_to_scheme("FP8_BLOCK", ["Linear"]).model_dump()
    assert group["weights"] == preset["weights"] and group["input_activations"] == preset["input_activations"]
    assert (qc["format"], group["format"], group["targets"]) == ("float-quantized", "float-quantized", ["Linear"])
    with open(os.path.join(fp8_block_exports["mixed"], "config.json")) as f:
        mixed = json.load(f)["quantization_config"]
    assert mixed["format"] == "mixed-precision"
    blocks = [g for g in mixed["config_groups"].values() if g["weights"]["strategy"] == "block"]
    assert len(blocks) == 1 and set(blocks[0]["targets"]) == {
        f"model.layers.0.{m}" for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
    } | {f"model.layers.0.mlp.{p}_proj" for p in ("gate", "up", "down")}
    layout = formats.describe(fp8_block_exports["mixed"])
    assert [s.quant for s in layout.specs] == ["nvfp4", "fp8-block"] and not layout.problems


def test_the_mixed_exports_fp8_block_linears_are_the_uniform_exports_and_checks_pass(fp8_block_exports):
    mixed, uniform = load_export(fp8_block_exports["mixed"]), load_export(fp8_block_exports["uniform"])
    assert uniform.quant == "fp8-block" and len(uniform.quantized) == 14
    stored, stored_uniform = stored_tensors(fp8_block_exports["mixed"]), stored_tensors(fp8_block_exports["uniform"])
    blocks = [m for m in mixed.quantized if mixed.quant_of(m) == "fp8-block"]
    assert len(blocks) == 7 and all(m.startswith("model.layers.0.") for m in blocks)
    for module in mixed.quantized:
        w = mixed.get(f"{module}.weight")
        assert type(w) is (FP8BlockWeight if module in blocks else NVFP4Weight), module
        if module in blocks:
            for suffix in ("weight", "weight_scale"):
                assert stored[f"{module}.{suffix}"] == stored_uniform[f"{module}.{suffix}"], module
            assert stored[f"{module}.weight_scale"][:2] == ("F32", (-(-w.shape[0] // B), -(-w.shape[1] // B)))
            assert f"{module}.input_scale" not in stored
    for folder in (fp8_block_exports["uniform"], fp8_block_exports["mixed"]):
        report = check_checkpoint(folder)
        assert report.ok, [p.line() for p in report.problems]
    report = check_checkpoint(fp8_block_exports["mixed"])
    bits = bits_by_quant(report, formats.describe(fp8_block_exports["mixed"]))
    assert bits["fp8-block"][0] == 7 and bits["fp8-block"][2] == 8 + 32 / 16384
    uniform_report = check_checkpoint(fp8_block_exports["uniform"])
    card = build_model_card(fp8_block_exports["uniform"], uniform_report, repo_id="me/x", validation=None)
    assert "128x128 block scales (W8A8)" in card and "per token per 128 columns" in card
    assert "128x128 weight blocks (an fp32 scale each)" in card and "1x16" not in card


@pytest.mark.peers
@pytest.mark.parametrize("which", ["uniform", "mixed"])
def test_transformers_loads_the_fp8_block_export_with_our_weights_bit_exact(fp8_block_exports, which):
    """compressed-tensors decompresses fp32(e4m3) x fp32(bf16(block scale)) to BF16 (the model dtype
    scale, padding ragged blocks); our codes and grid give that, and NVFP4 linears our decode."""
    import jax.numpy as jnp
    import torch
    import transformers

    folder = fp8_block_exports[which]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    model(torch.tensor(np.random.default_rng(1).integers(3, 256, (1, 8))))  # the first forward decompresses
    ours, stored = load_export(folder), stored_tensors(folder)
    checked = {}
    for name, module in model.named_modules():
        if name not in ours.quantized:
            continue
        theirs = module.weight.detach().view(torch.int16).numpy()
        if ours.quant_of(name) == "fp8-block":
            n, k = stored[f"{name}.weight"][1]
            codes = np.frombuffer(stored[f"{name}.weight"][2], E4M3).reshape(n, k)
            grid = np.frombuffer(stored[f"{name}.weight_scale"][2], np.float32).reshape(
                stored[f"{name}.weight_scale"][1]
            )
            scale = grid.astype(ml_dtypes.bfloat16).astype(np.float32)
            expected = codes.astype(np.float32) * np.repeat(np.repeat(scale, B, axis=0), B, axis=1)[:n, :k]
            expected = expected.astype(ml_dtypes.bfloat16)
        else:
            expected = np.asarray(jnp.asarray(ours.dequantized(name)).astype(jnp.bfloat16))
        assert theirs.tobytes() == expected.view(np.int16).tobytes(), name
        checked[name] = ours.quant_of(name)
    assert checked == {m: ours.quant_of(m) for m in ours.quantized}
    assert len(checked) == (14 if which == "uniform" else 13)


def test_check_refuses_a_wrong_scale_shape_and_a_tp_split_off_128(fp8_block_exports, tmp_path):
    from safetensors.torch import load_file, save_file

    report = check_checkpoint(fp8_block_exports["uniform"], tp=(1, 2))
    lines = [p.line() for p in report.problems]
    assert len(lines) == 4 and all("at TP 2 gives shards of N = 64, not a multiple of 128" in line for line in lines)
    folder = str(tmp_path / "bad")
    shutil.copytree(fp8_block_exports["uniform"], folder)
    os.remove(os.path.join(folder, "nvfp4tool_export.json"))  # judged by the tensors alone
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight_scale"
    assert tuple(tensors[name].shape) == (2, 1)
    tensors[name] = tensors[name].reshape(1, 2).contiguous()  # the grid transposed
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    lines = [p.line() for p in check_checkpoint(folder).problems]
    assert lines == [
        f"model.layers.0.self_attn.q_proj: {name}: is F32[1, 2], expected F32 [2, 1] "
        "(the ceil(N/128) x ceil(K/128) grid of N x K = 256 x 128)"
    ]


def test_modelopt_fp8_pb_wo_round_trips_with_compressed_tensors_byte_for_byte(fp8_block_exports, tmp_path):
    """ModelOpt stores the grid as vLLM's ModelOptFp8PbWoLinearMethod reads it, [N/128, 1, K/128, 1]
    (`quant_algo: FP8_PB_WO`); converting either way is the other direct export, byte for byte."""
    folder = str(tmp_path / "modelopt")
    export_checkpoint(
        fp8_block_exports["src"], folder, ExportOptions(format="modelopt", quant="fp8-block", show_progress=False)
    )
    with open(os.path.join(folder, "hf_quant_config.json")) as f:
        assert json.load(f)["quantization"] == {
            "quant_algo": "FP8_PB_WO",
            "kv_cache_quant_algo": None,
            "exclude_modules": ["lm_head"],
            "group_size": 128,
        }
    stored = stored_tensors(folder)
    assert stored["model.layers.0.mlp.down_proj.weight_scale"][:2] == ("F32", (1, 1, 2, 1))
    report = check_checkpoint(folder)
    assert report.ok and report.quant == "fp8-block", [p.line() for p in report.problems]
    ct, back = str(tmp_path / "ct"), str(tmp_path / "back")
    convert_format(folder, ct, to="compressed-tensors")
    convert_format(ct, back, to="modelopt")
    assert stored_tensors(ct) == stored_tensors(fp8_block_exports["uniform"])
    assert stored_tensors(back) == stored
    ours, theirs = load_export(folder), load_export(fp8_block_exports["uniform"])
    module = "model.layers.1.self_attn.o_proj"
    assert np.asarray(ours.dequantized(module)).tobytes() == np.asarray(theirs.dequantized(module)).tobytes()
    card = build_model_card(folder, report, repo_id="me/x", validation=None)
    assert "`quant_algo: FP8_PB_WO`" in card and "--quantization modelopt" in card


def test_modelopt_refuses_fp8_block_where_vllm_cannot_load_it(fp8_block_exports, tmp_path):
    runner, out = CliRunner(), str(tmp_path / "out")
    precision = fp8_block_exports["precision_file"]
    args = ["export", fp8_block_exports["src"], "--out", out, "--format", "modelopt", "--precision-file", precision]
    result = runner.invoke(cli, [*args, "--calib-data", fp8_block_exports["calib"]])
    assert result.exit_code == 2, result.output
    error = result.output.strip().splitlines()[-1]  # click's usage header, then the one line
    assert error.startswith(f"Error: {precision}:1: --format modelopt does not carry fp8-block in a mixed-precision")
    assert "FP8_PB_WO" in error and not os.path.exists(out)
    result = runner.invoke(cli, ["convert-format", fp8_block_exports["mixed"], out, "--to", "modelopt"])
    assert result.exit_code == 2 and "does not carry fp8-block in a mixed-precision file" in result.output
    assert not os.path.exists(out)
    expert, up = "model.layers.1.mlp.experts.3.w1", "model.layers.0.mlp.up_proj"
    assert "routed expert" in formats.linear_problem("modelopt", "fp8-block", expert, 256, 128)
    assert "N x K = 192 x 128" in formats.linear_problem("modelopt", "fp8-block", up, 192, 128)
    assert formats.linear_problem("compressed-tensors", "fp8-block", up, 192, 128) is None


def test_export_refuses_fp8_block_linears_off_128_where_vllm_needs_it(tmp_path):
    src = build_tiny_model("llama3", str(tmp_path / "hf"))  # hidden 64
    result = CliRunner().invoke(
        cli, ["export", src, "--out", str(tmp_path / "out"), "--format", "compressed-tensors", "--quant", "fp8-block"]
    )
    assert result.exit_code == 1, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert "model.layers.0.self_attn.q_proj.weight: in_features 64 is not a multiple of 128 (fp8-block" in result.output
    assert not os.path.exists(tmp_path / "out")
    # K = 128 everywhere, but k_proj's N = 64 ends a block early inside the merged q/k/v GEMM
    src = build_tiny_model("llama3", str(tmp_path / "hf32"), overrides=dict(SIZES, head_dim=32))
    result = CliRunner().invoke(
        cli, ["export", src, "--out", str(tmp_path / "out"), "--format", "compressed-tensors", "--quant", "fp8-block"]
    )
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1, result.output
    assert result.output.startswith(
        "Error: model.layers.0.self_attn.k_proj.weight: N = 64 is not a multiple of 128: in a merged fp8-block "
        "GEMM only the last shard (v_proj) may end a 128-row block early"
    ), result.output
    assert not os.path.exists(tmp_path / "out")


def test_every_served_linear_on_real_activations_is_the_oracles(fp8_block_exports):
    """What validate and eval run, linear by linear on the activations of a real forward:
    transformers' fp32 Llama holding the export's tensors (BF16 as stored, fp8-block weights
    decoded in numpy) with every quantized linear's input quantized by the numpy
    per_token_group_quant_fp8 oracle; each linear's input, as our served model quantizes it, is the
    oracle's bit for bit and its output the oracle's GEMM to fp32 rounding. (Whole-model logits
    are not compared: an ulp of difference upstream flips E4M3 roundings of activations derived
    from BF16 values, which sit on rounding ties often, so two correct implementations of the same
    served numerics differ by far more than fp32 rounding.)"""
    import torch
    import transformers

    folder = fp8_block_exports["uniform"]
    stored, ours = stored_tensors(folder), load_export(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        fp8_block_exports["src"], dtype=torch.float32, attn_implementation="eager"
    )
    state = {}
    for name in model.state_dict():
        dtype, shape, data = stored[name]
        if dtype == "F8_E4M3":
            codes = np.frombuffer(data, E4M3).reshape(shape)
            _, grid_shape, grid = stored[name.replace(".weight", ".weight_scale")]
            grid = np.frombuffer(grid, np.float32).reshape(grid_shape)
            per_element = np.repeat(np.repeat(grid, B, axis=0), B, axis=1)[: shape[0], : shape[1]]
            state[name] = torch.from_numpy(codes.astype(np.float32) * per_element)
        else:
            assert dtype == "BF16"
            state[name] = torch.from_numpy(np.frombuffer(data, ml_dtypes.bfloat16).reshape(shape).astype(np.float32))
    model.load_state_dict(state)
    inputs = {}

    def quantize(module, args, name):
        inputs[name] = args[0].numpy().copy()
        return (torch.from_numpy(_oracle_groups(inputs[name])),)

    for name, module in model.named_modules():
        if name in ours.quantized:
            module.register_forward_pre_hook(lambda m, args, name=name: quantize(m, args, name))
    with torch.no_grad():
        model(torch.tensor(np.random.default_rng(3).integers(3, 256, (2, 12))))
    assert set(inputs) == set(ours.quantized)
    for name, x in inputs.items():
        weight = ours.get(f"{name}.weight")
        assert np.asarray(weight.quantize_input(x)).tobytes() == _oracle_groups(x).tobytes(), name
        expected = _oracle_groups(x).astype(np.float64) @ state[f"{name}.weight"].numpy().T.astype(np.float64)
        y = np.asarray(served_linear(x, weight, None, name=name))
        np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5 * float(np.abs(expected).max()), err_msg=name)


def test_a_modelopt_mixed_file_naming_fp8_pb_wo_is_a_check_problem():
    from nvfp4tool.formats import modelopt

    layers = {
        "model.layers.0.mlp.up_proj": {"quant_algo": "FP8_PB_WO", "group_size": 128},
        "model.layers.1.mlp.up_proj": {"quant_algo": "NVFP4", "group_size": 16},
    }
    qc = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "quantized_layers": layers}
    hf_quant = {"quantization": {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers, "exclude_modules": []}}
    schemes, _, _, problems = modelopt.parse_mixed(qc, hf_quant)
    assert schemes == [("nvfp4", ("model.layers.1.mlp.up_proj",))]
    assert problems == [
        (
            "hf_quant_config.json",
            "quantized_layers.model.layers.0.mlp.up_proj.quant_algo is 'FP8_PB_WO': vLLM's ModelOpt MIXED_PRECISION "
            "loader maps no per-layer FP8_PB_WO (such a linear would load unquantized); use --format "
            "compressed-tensors for a mixed file with fp8-block linears",
        )
    ]


# ------------------------------------------------------------------------------ GPTQ and --equalize


def _decoded_bf16(stored: dict, module: str) -> np.ndarray:
    """The fp8-block weight of `module` as stored, decoded in numpy (codes x its block's scale)
    and rounded to BF16: what a BF16 model holding the served weight holds."""
    _, (n, k), data = stored[f"{module}.weight"]
    _, grid_shape, grid = stored[f"{module}.weight_scale"]
    grid = np.frombuffer(grid, np.float32).reshape(grid_shape)
    per_element = np.repeat(np.repeat(grid, B, axis=0), B, axis=1)[:n, :k]
    return (np.frombuffer(data, E4M3).reshape(n, k).astype(np.float32) * per_element).astype(ml_dtypes.bfloat16)


def test_gptq_rounds_fp8_block_linears_to_nearest_and_feeds_them_forward_decoded(
    fp8_block_exports, tmp_path, monkeypatch
):
    """A mixed GPTQ export: the fp8-block linears (layer 0) get the bytes of the export without
    GPTQ; layer 1's NVFP4 linears are rounded by GPTQ on Hessians of inputs through layer 0 as
    served, which a model holding the stored fp8-block weights decoded in numpy gives exactly."""
    from nvfp4tool.checkpoints import open_checkpoint
    from nvfp4tool.export import gptq_pass
    from nvfp4tool.export.calibrate import open_bf16_model
    from nvfp4tool.records.export import ExportRecord

    hessians, real = {}, gptq_pass.gptq_quantize

    def spy(w, h, **kw):
        hessians[kw["name"]] = np.array(h)
        return real(w, h, **kw)

    monkeypatch.setattr(gptq_pass, "gptq_quantize", spy)
    out = str(tmp_path / "gptq")
    export_checkpoint(
        fp8_block_exports["src"],
        out,
        ExportOptions(
            format="compressed-tensors",
            precision_file=fp8_block_exports["precision_file"],
            calib_data=fp8_block_exports["calib"],
            calib_samples=2,
            calib_seq_len=16,
            weight_rounding="gptq",
            show_progress=False,
        ),
    )
    gptq, rtn, ours = stored_tensors(out), stored_tensors(fp8_block_exports["mixed"]), load_export(out)
    blocks = [m for m in ours.quantized if ours.quant_of(m) == "fp8-block"]
    assert len(blocks) == 7 and all(m.startswith("model.layers.0.") for m in blocks)
    for module in blocks:
        for suffix in formats.get("compressed-tensors", "fp8-block").suffixes:
            assert gptq[f"{module}.{suffix}"] == rtn[f"{module}.{suffix}"], f"{module}.{suffix}"
    nvfp4 = [m for m in ours.quantized if ours.quant_of(m) == "nvfp4"]
    assert {f"{m}.weight" for m in nvfp4} == set(hessians)  # GPTQ rounded exactly the NVFP4 linears
    assert any(gptq[f"{m}.weight_packed"] != rtn[f"{m}.weight_packed"] for m in nvfp4)
    record = ExportRecord.read(out)
    assert {m for m, layer in record.layers.items() if layer.output_rel_err is not None} == set(nvfp4)
    report = check_checkpoint(out)
    assert report.ok, [p.line() for p in report.problems]

    source = open_checkpoint(fp8_block_exports["src"])
    decoded = {f"{m}.weight": _decoded_bf16(gptq, m) for m in blocks}

    class Served:  # layer 0 as the export serves its weights, the rest the source's
        def get(self, name):
            return decoded[name] if name in decoded else source.tensors.get(name)

        def __getattr__(self, name):
            return getattr(source.tensors, name)

    def layer_1_q_hessian(tensors) -> np.ndarray:
        model = open_bf16_model(source.config, tensors, seq_len=16, offload="never", what="test")
        found = {}
        tap = gptq_pass._Hessians(frozenset({"model.layers.*.self_attn.q_proj"}))
        ids = np.load(fp8_block_exports["calib"])
        for _ in model.logits(ids, 8, tap=tap, on_record=lambda n, v: found.setdefault(n, np.asarray(v))):
            pass
        return found["model.layers.1.self_attn.q_proj"]

    expected, original = layer_1_q_hessian(Served()), layer_1_q_hessian(source.tensors)
    np.testing.assert_array_equal(hessians["model.layers.1.self_attn.q_proj.weight"], expected)
    assert np.abs(original - expected).max() > 1e-4 * np.abs(expected).max()  # layer 0's FP8 error shows


@pytest.mark.parametrize("flag, value", [("--weight-rounding", "gptq"), ("--equalize", "awq")])
def test_gptq_and_equalize_refuse_an_all_fp8_plan(fp8_block_exports, tmp_path, flag, value):
    out = str(tmp_path / "out")
    args = ["export", fp8_block_exports["src"], "--out", out, "--format", "compressed-tensors"]
    args += ["--calib-data", fp8_block_exports["calib"], flag, value]
    result = CliRunner().invoke(cli, [*args, "--quant", "fp8-block"])
    assert result.exit_code == 2 and "nvfp4-weight-only, not fp8-block" in result.output, result.output
    precision = tmp_path / "all-fp8.txt"  # every quantized linear FP8, per tensor or in blocks
    precision.write_text("model.layers.0.* fp8-block\nmodel.layers.1.* fp8\n")
    result = CliRunner().invoke(cli, [*args, "--precision-file", str(precision)])
    assert result.exit_code == 2, result.output
    assert f"{precision}: " in result.output and "nvfp4-weight-only, not fp8 / fp8-block" in result.output
    assert not os.path.exists(out)


def test_awq_scores_fp8_block_consumers_as_served_and_the_export_serves_no_worse(fp8_block_exports, tmp_path):
    """The planted outlier-channel model (`outlier_model`) at fp8-block sizes, exported by the
    precision file (layer 0 fp8-block, layer 1 NVFP4) with and without AWQ: every site whose
    consumers are all quantized is scaled (layer 0's fp8-block ones too, each beating s = 1 by
    fp8-block's served objective), the fold is checked, and the AWQ export serves a lower KL vs the
    source on the calibration windows. Measured: plain 0.0139, AWQ 0.0125 nats; the fp8-block
    sites' output errors fall 2-5%, the NVFP4 ones' 23-27%: most of the gain is layer 1's."""
    from nvfp4tool.config import ModelConfig
    from nvfp4tool.export import equalize as eq
    from nvfp4tool.families import folds
    from nvfp4tool.model.fold import site_key
    from nvfp4tool.records.export import ExportRecord

    from fixtures.mixed_fixtures import mixed_export, outlier_model, served_kl

    src = outlier_model(str(tmp_path / "hf"), overrides=SIZES)
    precision, calib = fp8_block_exports["precision_file"], fp8_block_exports["calib"]
    plain, awq = (mixed_export(src, str(tmp_path / m), precision, calib, equalize=m) for m in ("none", "awq"))
    report = check_checkpoint(awq)
    assert report.ok, [p.line() for p in report.problems]
    record = ExportRecord.read(awq)
    assert record.quant == formats.MIXED and record.equalization.check_kl_mean <= eq.FOLD_KL_LIMIT
    ours = load_export(awq)
    searched = [f for f in folds(ModelConfig.from_hf_folder(src)) if all(c in ours.quantized for c in f.consumers)]
    assert set(record.equalization.sites) == {site_key(f) for f in searched}
    blocks = [f for f in searched if {ours.quant_of(c) for c in f.consumers} == {"fp8-block"}]
    assert len(blocks) == 4  # layer 0's q/k/v, o_proj, gate/up and down_proj sites
    for fold in blocks:  # fp8-block's objective found a better s than 1 (alpha 0) at each of its sites
        found = record.equalization.sites[site_key(fold)]
        print(
            f"{site_key(fold)}: alpha {found.alpha}, output error {100 * found.output_err_reduction:.1f}% below s = 1"
        )
        assert found.alpha > 0 and found.output_err_reduction > 0
    ids = np.load(calib)
    kl_plain, kl_awq = served_kl(src, plain, ids), served_kl(src, awq, ids)
    print(f"served KL vs the BF16 source on the calibration windows: plain {kl_plain:.6g}, awq {kl_awq:.6g}")
    assert kl_awq <= kl_plain
