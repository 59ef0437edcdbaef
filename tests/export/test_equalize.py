"""Equivalent scaling (`export --equalize`, `nvfp4tool/export/equalize.py`).

* The fold is the same function: every family's tiny model with random scales at every site folded
  in computes transformers' logits (fp32, the independent implementation) within fp32 rounding;
  a wrong fold (GQA heads repeated the wrong way, v_proj's bias left alone) does not.
* AWQ's search against a direct numpy implementation (the slow oracle's NVFP4 quantizer) on a small
  case: the same errors per alpha and the same choice; on inputs with outlier channels it beats RTN.
* The export: W4A4 / W4A16, with GPTQ, 4over6 and the FP8 KV cache, dense and MoE, passes `check`
  and records its scales; the folded-model check refuses a wrong fold (exit 1, nothing written);
  bad usage is exit 2; validate compares an equalized export with the folded model.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner

from converters.hf import HFFolderSource
from nvfp4tool.checkpoints import open_checkpoint
from nvfp4tool.cli import cli
from nvfp4tool.config import ModelConfig
from nvfp4tool.export import equalize as eq
from nvfp4tool.export.simulate import load_export
from nvfp4tool.families import folds
from nvfp4tool.model import fold as mf
from nvfp4tool.numerics import metrics
from nvfp4tool.records.export import ExportRecord

from fixtures import nvfp4_oracle as oracle
from fixtures.hf_fixtures import FAMILY_KEYS, build_tiny_model

CALIB = ("--calib-samples", "4", "--calib-seq-len", "16")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("equalize")
    out = {key: build_tiny_model(key, str(root / key)) for key in FAMILY_KEYS}
    out["calib"] = str(root / "calib.npy")
    np.save(out["calib"], np.random.default_rng(0).integers(3, 256, (4, 16)))
    return out


def _random_scales(config: ModelConfig, seed: int = 0) -> tuple[mf.FoldScale, ...]:
    rng = np.random.default_rng(seed)
    result = []
    for fold in folds(config):
        width = config.modules.tensor_shapes[fold.producer[0]][0]
        result.append(mf.FoldScale(fold=fold, s=np.exp(rng.normal(0, 0.7, width)).astype(np.float32), alpha=0.0))
    return tuple(result)


def _torch_logits(folder: str, tensors=None, tmp=None) -> np.ndarray:
    """transformers' fp32 logits of the model in `folder`, or of `tensors` saved with its config
    (transformers reads them as it reads any checkpoint: MoE experts fused on load)."""
    import shutil

    import torch
    import transformers
    from safetensors.numpy import save_file

    if tensors is not None:
        os.makedirs(tmp, exist_ok=True)
        shutil.copy(os.path.join(folder, "config.json"), tmp)
        save_file(
            {n: np.ascontiguousarray(tensors.get(n), np.float32) for n in tensors.names()},
            os.path.join(tmp, "model.safetensors"),
            metadata={"format": "pt"},
        )
        folder = tmp
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor(np.random.default_rng(1).integers(3, 256, (2, 12)))
    with torch.no_grad():
        return model(ids).logits.float().numpy()


@pytest.mark.parametrize("key", FAMILY_KEYS)
def test_the_folded_model_is_the_original_in_transformers(models, key, tmp_path):
    source = HFFolderSource(models[key])
    config = ModelConfig.from_hf_folder(models[key])
    scales = _random_scales(config)
    assert len(scales) == len(folds(config)) >= 4 * config.num_layers
    original = _torch_logits(models[key])
    folded = _torch_logits(models[key], mf.EqualizedSource(source, scales), str(tmp_path / "folded"))
    np.testing.assert_allclose(folded, original, rtol=0, atol=2e-4 * np.abs(original).max())
    # the folds did change the weights (s is far from 1): only the function is the same
    q = f"{config.modules.names()[0]}.weight"
    assert np.abs(mf.EqualizedSource(source, scales).get(q) - source.get(q)).max() > 0.1


@pytest.mark.parametrize("wrong", ["gqa order", "v bias untouched"])
def test_a_wrong_fold_is_not_the_original(models, wrong, monkeypatch, tmp_path):
    key = "qwen2"  # GQA (4 heads, 2 KV heads) and a v_proj bias
    source = HFFolderSource(models[key])
    config = ModelConfig.from_hf_folder(models[key])
    scales = []
    for found in _random_scales(config):
        fold = found.fold
        if fold.expand is not None and wrong == "gqa order":  # KV head g read by heads g, g+G, ... instead
            groups, repeat, width = fold.expand
            monkeypatch.setattr(
                mf.FoldScale,
                "consumer_scale",
                lambda self, e=fold.expand: (
                    np.tile(self.s.reshape(e[0], e[2]), (e[1], 1)).reshape(-1) if self.fold.expand else self.s
                ),
            )
        if fold.kind == "rows" and wrong == "v bias untouched":
            fold = dataclasses.replace(fold, producer=tuple(t for t in fold.producer if not t.endswith(".bias")))
        scales.append(dataclasses.replace(found, fold=fold))
    original = _torch_logits(models[key])
    folded = _torch_logits(models[key], mf.EqualizedSource(source, scales), str(tmp_path / "folded"))
    assert np.abs(folded - original).max() > 1e-2 * np.abs(original).max()


# ------------------------------------------------------------------------------------------
# AWQ's search against numpy


def _oracle_fake_quantize(x: np.ndarray, global_amax) -> np.ndarray:
    q = oracle.quantize(np.asarray(x, np.float32), block="1d", global_amax=global_amax)
    return oracle.dequantize(q["packed"], q["scales"], q["global_amax"]).reshape(x.shape)


def _oracle_fake_fp8(x: np.ndarray, tile: tuple[int, int] | tuple[None, None] = (None, None)) -> np.ndarray:
    data, scale = oracle.quantize_fp8(x, "e4m3", *tile)  # default: one scale over the whole tensor
    return data * scale


def _oracle_awq(x_TxK, w_NxK, quant: str):
    """AWQ's grid as the module docstring states it, in numpy, each format as it serves:
    (errors per alpha, chosen alpha)."""
    mean_abs = np.abs(x_TxK).mean(axis=0)
    errors = []
    for alpha in eq.AWQ_ALPHAS:
        s = np.clip(np.maximum(mean_abs, 1e-4) ** alpha, 1e-4, 1e4)
        s = (s / np.sqrt(s.max() * s.min())).astype(np.float32)
        ws = w_NxK * s[None, :]
        xs = (x_TxK / s[None, :]).astype(np.float32)
        if quant == "fp8":
            wq, xq = _oracle_fake_fp8(ws), _oracle_fake_fp8(xs)
        elif quant == "fp8-block":  # 128x128 weight blocks; vLLM's per-token-group input (no group here is 0)
            wq, xq = _oracle_fake_fp8(ws, (128, 128)), _oracle_fake_fp8(xs, (1, 128))
        else:
            wq = _oracle_fake_quantize(ws, np.float32(np.abs(ws).max()))
            xq = xs if quant == "nvfp4-weight-only" else _oracle_fake_quantize(xs, np.float32(np.abs(xs).max()))
        diff = xq.astype(np.float64) @ wq.T.astype(np.float64) - x_TxK.astype(np.float64) @ w_NxK.T.astype(np.float64)
        errors.append(float(np.sum(diff**2)))
    return np.asarray(errors), eq.AWQ_ALPHAS[int(np.argmin(errors))]


@pytest.mark.parametrize("quant", eq.OBJECTIVES)
def test_awq_errors_and_choice_equal_a_numpy_search(quant):
    rng = np.random.default_rng(3)
    K, N, T = 256 if quant == "fp8-block" else 32, 16, 24  # fp8-block: two 128-column groups
    x = (rng.normal(size=(T, K)) * np.exp(rng.normal(0, 1.5, K))[None, :]).astype(jnp.bfloat16).astype(np.float32)
    w = rng.normal(size=(N, K)).astype(jnp.bfloat16).astype(np.float32)
    expected, alpha = _oracle_awq(x, w, quant)
    s_AxK = eq.awq_candidates(np.abs(x).mean(axis=0))
    amax = np.max(np.abs(w)[None] * s_AxK[:, None, :], axis=(1, 2))
    tap = eq._Errors(block="1d")
    _, errors = tap(
        jnp.asarray(x, jnp.bfloat16)[None],
        jnp.asarray(w, jnp.bfloat16),
        None,
        name="lin",
        aux={
            "lin": {"s": jnp.asarray(s_AxK), "amax": jnp.asarray(amax, jnp.float32), "kind": eq.OBJECTIVES.index(quant)}
        },
    )
    np.testing.assert_allclose(np.asarray(errors), expected, rtol=1e-4)
    assert eq.AWQ_ALPHAS[int(np.argmin(np.asarray(errors)))] == alpha
    assert alpha > 0 and expected.min() < 0.9 * expected[0]  # outlier channels: AWQ beats RTN (alpha 0)


# ------------------------------------------------------------------------------------------
# the export


def _export(args: list[str]):
    return CliRunner().invoke(cli, ["export", *args], catch_exceptions=False)


@pytest.mark.parametrize(
    "key,method,extra",
    [
        ("llama3", "awq", ["--quant", "nvfp4"]),
        ("llama3", "smoothquant", ["--quant", "nvfp4-weight-only"]),
        ("llama_tied", "awq", ["--weight-rounding", "gptq", "--kv-cache", "fp8"]),
        ("qwen3", "awq", ["--scale-search", "4over6", "--format", "compressed-tensors"]),
        ("qwen3_moe", "awq", ["--quant", "nvfp4"]),
        ("mixtral", "smoothquant", ["--weight-rounding", "gptq"]),
        ("gemma3", "awq", ["--quant", "nvfp4"]),  # its (1 + w) norms: (1 + w) / s - 1
    ],
)
@pytest.mark.slow  # > 15 s of the inner loop (tests/durations.json)
def test_equalized_exports_pass_check_and_record_their_scales(models, tmp_path, key, method, extra):
    out = str(tmp_path / "out")
    result = _export([models[key], "--out", out, "--calib-data", models["calib"], *CALIB, "--equalize", method, *extra])
    assert result.exit_code == 0, result.output
    check = CliRunner().invoke(cli, ["check", out], catch_exceptions=False)
    assert check.exit_code == 0, check.output
    record = ExportRecord.read(out)
    config = ModelConfig.from_hf_folder(models[key])
    assert record.equalize == method and record.equalization.method == method
    assert len(record.equalization.sites) == len(folds(config))
    assert record.equalization.check_kl_mean <= eq.FOLD_KL_LIMIT
    scales = mf.scales_from_record(record.equalization, config)
    assert all(np.isfinite(f.s).all() and (f.s > 0).all() for f in scales)
    if method == "awq":  # never worse than s = 1 on the calibration data, better somewhere
        reductions = [r.output_err_reduction for r in record.equalization.sites.values()]
        assert min(reductions) >= 0 and max(reductions) > 0
    # no extra tensor: the same names as the plain export
    plain = str(tmp_path / "plain")
    calib = [] if "nvfp4-weight-only" in extra and "gptq" not in extra else ["--calib-data", models["calib"], *CALIB]
    assert _export([models[key], "--out", plain, *calib, *extra]).exit_code == 0
    assert set(ExportRecord.read(plain).tensors) == set(record.tensors)
    assert ExportRecord.read(plain).equalization is None


def test_equalize_none_is_the_default_export_byte_for_byte(models, tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    for out, flags in ((a, []), (b, ["--equalize", "none"])):
        assert _export([models["llama3"], "--out", out, "--calib-data", models["calib"], *CALIB, *flags]).exit_code == 0
    for name in ("model.safetensors", "config.json", "hf_quant_config.json"):
        with open(os.path.join(a, name), "rb") as fa, open(os.path.join(b, name), "rb") as fb:
            assert fa.read() == fb.read(), name


def test_a_fold_that_changes_the_function_is_refused(models, tmp_path, monkeypatch):
    real_get = mf.EqualizedSource.get

    def norms_left_alone(self, name):  # the consumers scaled, the producers not divided
        return self._source.get(name) if name in self._rows else real_get(self, name)

    monkeypatch.setattr(mf.EqualizedSource, "get", norms_left_alone)
    out = str(tmp_path / "out")
    result = CliRunner().invoke(
        cli,
        [
            "export",
            models["llama3"],
            "--out",
            out,
            "--calib-data",
            models["calib"],
            *CALIB,
            "--equalize",
            "smoothquant",
        ],
    )
    assert result.exit_code == 1
    assert "the folded model is not the original" in result.output
    assert not os.path.exists(out) and os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--equalize", "awq"], "needs --calib-data"),
        (["--equalize", "smoothquant", "--quant", "fp8", "--calib-data", "CALIB"], "not fp8"),
    ],
)
def test_equalize_bad_usage_is_exit_2(models, tmp_path, flags, message):
    flags = [models["calib"] if f == "CALIB" else f for f in flags]
    result = CliRunner().invoke(cli, ["export", models["llama3"], "--out", str(tmp_path / "o"), *flags])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not os.path.exists(tmp_path / "o")


@pytest.mark.slow  # > 15 s of the inner loop (tests/durations.json)
def test_validate_compares_an_equalized_export_with_the_folded_model(models, tmp_path):
    out = str(tmp_path / "out")
    assert (
        _export(
            [models["llama3"], "--out", out, "--calib-data", models["calib"], *CALIB, "--equalize", "awq"]
        ).exit_code
        == 0
    )
    data = str(tmp_path / "val.npy")
    np.save(data, np.random.default_rng(5).integers(3, 256, (4, 16)))
    result = CliRunner().invoke(
        cli,
        [
            "validate",
            out,
            "--data",
            data,
            "--samples",
            "4",
            "--seq-len",
            "16",
            "--prompts",
            "1",
            "--gen-tokens",
            "4",
            "--source",
            models["llama3"],
        ],
        catch_exceptions=False,
    )
    record = json.load(open(os.path.join(out, "validation.json")))
    assert result.exit_code in (0, 1), result.output  # thresholds may judge a random tiny model
    # weight SQNR against the folded weights (against the unfolded source it would be ~0 dB), for the
    # export and for the FP8 reference, which folds the same scales and takes the export's input amax
    sqnr = [row["weight_sqnr_db"] for row in record["layers"]]
    assert min(r["nvfp4"] for r in sqnr) > 15 and min(r["fp8"] for r in sqnr) > 25
    assert "the export's input amax" in record["reference_calibration"]
    assert record["models"]["fp8"]["kl_mean"] < record["models"]["nvfp4"]["kl_mean"]

    # An FP8 export made WITHOUT --equalize as the reference (issue 42: its column showed -0.6 dB
    # on v_proj): its layers are measured against the model it was made from, the plain source:
    # weights against the unfolded weights, its GEMMs fed the folded model's inputs carried back.
    fp8 = str(tmp_path / "fp8")
    assert (
        _export([models["llama3"], "--out", fp8, "--quant", "fp8", "--calib-data", models["calib"], *CALIB]).exit_code
        == 0
    )
    argv = ["validate", out, "--data", data, "--samples", "4", "--seq-len", "16", "--prompts", "1"]
    argv += ["--gen-tokens", "4", "--source", models["llama3"], "--reference", fp8, "--force"]
    result = CliRunner().invoke(cli, argv, catch_exceptions=False)
    assert result.exit_code in (0, 1), result.output
    plain = json.load(open(os.path.join(out, "validation.json")))
    source, served = open_checkpoint(models["llama3"]).tensors, load_export(fp8)
    first = {row["name"]: row for row in record["layers"]}
    for row in plain["layers"]:
        m, before = row["name"], first[row["name"]]
        assert row["weight_sqnr_db"]["fp8"] == pytest.approx(
            metrics.sqnr_db(source.get(f"{m}.weight"), served.dequantized(m)), abs=1e-9
        )
        assert row["weight_sqnr_db"]["fp8"] > 25 and row["output_sqnr_db"]["fp8"] > 20, row  # ~0 dB folded
        assert row["weight_sqnr_db"]["nvfp4"] == before["weight_sqnr_db"]["nvfp4"]  # the export's unchanged
    assert plain["models"]["fp8"]["kl_mean"] < plain["models"]["nvfp4"]["kl_mean"]


@pytest.mark.parametrize(
    "key,method,quant", [("mixtral", "smoothquant", "nvfp4"), ("qwen2", "awq", "nvfp4-weight-only")]
)
def test_recorded_scales_are_bound_to_the_bytes_they_made(models, tmp_path, key, method, quant):
    """`EqualizedSource.from_export`: an export's own scales fold (its norm weights are the
    source's divided by them, as written); the same scales times 1.5 (the same function, other
    weights) are refused naming the record, the site and the tensor (issue 39)."""
    import base64
    import dataclasses

    from nvfp4tool.errors import NVFP4ToolError

    out = str(tmp_path / "out")
    flags = ["--calib-data", models["calib"], *CALIB, "--equalize", method, "--quant", quant]
    assert _export([models[key], "--out", out, *flags]).exit_code == 0
    source, record = open_checkpoint(models[key]), ExportRecord.read(out)
    mf.EqualizedSource.from_export(source.tensors, out, record, source.config)  # bound: no error
    forged = {
        k: dataclasses.replace(
            site,
            scales=base64.b64encode(
                (np.frombuffer(base64.b64decode(site.scales), "<f4") * np.float32(1.5)).astype("<f4").tobytes()
            ).decode(),
        )
        for k, site in record.equalization.sites.items()
    }
    tampered = dataclasses.replace(record, equalization=dataclasses.replace(record.equalization, sites=forged))
    with pytest.raises(NVFP4ToolError, match=r"equalization site .*its scales did not make the export's .*norm") as e:
        mf.EqualizedSource.from_export(source.tensors, out, tampered, source.config)
    assert str(e.value).startswith(ExportRecord.path(out))


@pytest.mark.parametrize("lora", [True, False], ids=["q_lora", "q_proj"])
def test_the_folded_deepseek_v3_is_the_original_in_transformers(lora, tmp_path):
    """deepseek_v3's folds (`DeepseekV3.folds`: the input norm into q_a_proj / q_proj and
    kv_a_proj_with_mqa, q_a_layernorm into q_b_proj, kv_a_layernorm into kv_b_proj, the
    post-attention norm into every routed and shared expert's gate/up with the FP32 router reading
    it, up rows into down) leave transformers' logits unchanged, with random scales far from 1."""
    from fixtures.deepseek_fixtures import LORA, NO_LORA, hf_folder

    folder, _ = hf_folder(tmp_path, dict(LORA if lora else NO_LORA, vocab_size=256), seed=8)
    source = HFFolderSource(folder)
    config = ModelConfig.from_hf_folder(folder)
    scales = _random_scales(config)
    assert len(scales) == len(folds(config)) == 3 * (2 + lora) + 2 + 2 * (1 + 9)
    original = _torch_logits(folder)
    folded = _torch_logits(folder, mf.EqualizedSource(source, scales), str(tmp_path / "folded"))
    np.testing.assert_allclose(folded, original, rtol=0, atol=2e-4 * np.abs(original).max())
    router = "model.layers.1.mlp.gate.weight"
    assert np.abs(mf.EqualizedSource(source, scales).get(router) - source.get(router)).max() > 0.01
