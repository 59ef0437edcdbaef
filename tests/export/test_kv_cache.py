"""FP8 KV-cache scales (`export --kv-cache fp8`) on tiny synthetic exports: names, dtypes, shapes and
config keys of both layouts, convert-format carrying them, `check` refusing broken copies, the KV
seam's default being an exact no-op, and validate reporting the FP8 KV cache's effect separately.
The peer tests (transformers / compressed-tensors) are in test_kv_cache_peers.py.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner

from converters.hf import SINGLE_FILE, HFFolderSource, read_safetensors_header, write_safetensors
from nvfp4tool import formats
from nvfp4tool.cli import cli
from nvfp4tool.export import export_checkpoint
from nvfp4tool.export.convert_format import convert_format
from nvfp4tool.export.simulate import load_export, served_kv
from nvfp4tool.model.linear import Seam, default_linear
from nvfp4tool.model.transformer import forward_side
from nvfp4tool.model.weights import model_from_tensors
from nvfp4tool.records.export import ExportRecord

from fixtures.export_fixtures import export_options, synthetic_config, synthetic_source

CONFIG = synthetic_config(hidden=64, mlp=128, layers=2, vocab=128, head_dim=16, kv_heads=2, dtype="bfloat16")
ATTENTIONS = [f"model.layers.{i}.self_attn" for i in range(CONFIG.num_layers)]
# what each layout writes: (k scale suffix, v scale suffix, shape) and the config keys announcing them
WANT = {"modelopt": ("k_proj.k_scale", "v_proj.v_scale", ()), "compressed-tensors": ("k_scale", "v_scale", (1,))}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return synthetic_source(tmp_path_factory.mktemp("kv"), CONFIG, seed=5)


@pytest.fixture(scope="module")
def exports(source, tmp_path_factory):
    """{format: folder} of the W4A4 export with an FP8 KV cache, and {format + "-plain": without}."""
    src, calib = source
    root = tmp_path_factory.mktemp("kv-exports")
    out = {}
    for fmt in formats.FORMATS:
        for kv in ("fp8", "none"):
            key = fmt if kv == "fp8" else f"{fmt}-plain"
            out[key] = str(root / key)
            export_checkpoint(src, out[key], export_options(calib, format=fmt, kv_cache=kv))
    return out


def _tensors(folder):
    source = HFFolderSource(folder, check_config=False)
    return {n: source.get(n) for n in source.names()}


@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_layout_names_dtypes_shapes_and_config_keys(exports, fmt):
    folder = exports[fmt]
    header = read_safetensors_header(os.path.join(folder, SINGLE_FILE))
    k_suffix, v_suffix, shape = WANT[fmt]
    record = ExportRecord.read(folder)
    kv_names = {n for n in header if n.endswith(("k_scale", "v_scale"))}
    assert kv_names == {f"{a}.{s}" for a in ATTENTIONS for s in (k_suffix, v_suffix)}
    for attention in ATTENTIONS:
        amax_k, amax_v = record.kv_amax[attention]
        for suffix, amax in ((k_suffix, amax_k), (v_suffix, amax_v)):
            entry = header[f"{attention}.{suffix}"]
            assert (entry.dtype.name, entry.shape) == ("float32", shape)
            value = _tensors(folder)[f"{attention}.{suffix}"]
            assert value.reshape(()) == np.float32(amax) / np.float32(448.0) > 0  # amax / 448, exactly
    # the plain export's tensors are the KV export's minus the KV scales, byte for byte
    plain = _tensors(exports[f"{fmt}-plain"])
    ours = _tensors(folder)
    assert set(ours) - set(plain) == kv_names
    assert all(ours[n].tobytes() == plain[n].tobytes() for n in plain)
    with open(os.path.join(folder, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    assert record.kv_cache == "fp8" and ExportRecord.read(exports[f"{fmt}-plain"]).kv_amax is None
    if fmt == "modelopt":
        with open(os.path.join(folder, "hf_quant_config.json")) as f:
            assert json.load(f)["quantization"]["kv_cache_quant_algo"] == "FP8"
        assert qc["kv_cache_scheme"] == {"dynamic": False, "num_bits": 8, "type": "float"}
        assert qc["kv_cache_quant_algo"] == "FP8"
    else:
        assert qc["kv_cache_scheme"] == {
            "num_bits": 8,
            "type": "float",
            "strategy": "tensor",
            "dynamic": False,
            "symmetric": True,
        }
    assert formats.describe(folder).kv_cache == "fp8" and formats.describe(exports[f"{fmt}-plain"]).kv_cache is None


def test_kv_cache_needs_calibration_data(source, tmp_path):
    src, _ = source
    result = CliRunner().invoke(
        cli, ["export", src, "--out", str(tmp_path / "o"), "--quant", "nvfp4-weight-only", "--kv-cache", "fp8"]
    )
    assert result.exit_code == 2 and "--kv-cache fp8" in result.output and "--calib-data" in result.output
    result = CliRunner().invoke(cli, ["export", src, "--out", str(tmp_path / "o"), "--kv-cache", "nvfp4"])
    assert result.exit_code == 2 and "--kv-cache" in result.output  # only none | fp8 are offered


def test_weight_only_export_calibrates_only_the_kv_cache(source, tmp_path):
    src, calib = source
    out = str(tmp_path / "w4a16")
    export_checkpoint(src, out, export_options(calib, quant="nvfp4-weight-only", kv_cache="fp8"))
    record = ExportRecord.read(out)
    assert record.input_amax is None and record.calibration is not None and set(record.kv_amax) == set(ATTENTIONS)
    assert load_export(out).kv_cache == "fp8"


@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_model_card_says_the_kv_cache(exports, fmt):
    from nvfp4tool.check import check_checkpoint
    from nvfp4tool.hub.card import build_model_card

    for folder, said in ((exports[fmt], True), (exports[f"{fmt}-plain"], False)):
        card = build_model_card(folder, check_checkpoint(folder), repo_id="org/m", validation=None)
        assert ("`--kv-cache-dtype fp8`" in card) == said


def test_convert_format_carries_kv_scales_byte_identical(exports, tmp_path):
    for src, to, direct in (
        ("modelopt", "compressed-tensors", "compressed-tensors"),
        ("compressed-tensors", "modelopt", "modelopt"),
    ):
        out = str(tmp_path / f"from-{src}")
        convert_format(exports[src], out, to=to)
        with (
            open(os.path.join(out, SINGLE_FILE), "rb") as a,
            open(os.path.join(exports[direct], SINGLE_FILE), "rb") as b,
        ):
            assert a.read() == b.read()
        assert formats.describe(out).kv_cache == "fp8"
        assert ExportRecord.read(out).kv_amax == ExportRecord.read(exports[direct]).kv_amax


# ------------------------------------------------------------------------------------------ check


def _rewrite(folder: str, edit: dict[str, np.ndarray | None]) -> None:
    """Rewrite the single shard with `edit` applied: name -> new value (None: drop the tensor)."""
    path = os.path.join(folder, SINGLE_FILE)
    tensors = _tensors(folder)
    for name, value in edit.items():
        if value is None:
            tensors.pop(name)
        else:
            tensors[name] = value
    write_safetensors(path, [(n, a.dtype.name, a.shape) for n, a in tensors.items()], tensors.__getitem__)


def _copy(folder, tmp_path, name="copy"):
    import shutil

    out = str(tmp_path / name)
    shutil.copytree(folder, out)
    return out


def _problems(output: str) -> list[dict]:
    """The problems of `check --json`'s report (the CLI's one-line error follows the JSON)."""
    return json.JSONDecoder().raw_decode(output[output.index("{") :])[0]["problems"]


def _announce(folder: str, fmt: str, kv: str | None) -> None:
    """Rewrite the configs to announce the KV cache `kv` (None: none)."""
    spec = formats.describe(folder).spec
    config_path = os.path.join(folder, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    excluded = tuple(config["quantization_config"]["ignore"])
    config["quantization_config"] = spec.quantization_config(excluded, kv)
    with open(config_path, "w") as f:
        json.dump(config, f)
    hf_quant = spec.hf_quant_config(excluded, {"name": "test"}, kv)
    if hf_quant is not None:
        with open(os.path.join(folder, "hf_quant_config.json"), "w") as f:
            json.dump(hf_quant, f)


K0 = {fmt: f"model.layers.0.self_attn.{WANT[fmt][0]}" for fmt in WANT}
V1 = {fmt: f"model.layers.1.self_attn.{WANT[fmt][1]}" for fmt in WANT}
CASES = {  # name -> (edit(folder, fmt), the tensor named, words of the message)
    "zero k_scale": (lambda d, f: _rewrite(d, {K0[f]: np.zeros(WANT[f][2], np.float32)}), K0, "finite and > 0"),
    "NaN v_scale": (lambda d, f: _rewrite(d, {V1[f]: np.full(WANT[f][2], np.nan, np.float32)}), V1, "finite and > 0"),
    "negative k_scale": (
        lambda d, f: _rewrite(d, {K0[f]: np.full(WANT[f][2], -0.5, np.float32)}),
        K0,
        "finite and > 0",
    ),
    "missing k_scale": (lambda d, f: _rewrite(d, {K0[f]: None}), K0, "missing: the configs announce"),
    "BF16 k_scale": (lambda d, f: _rewrite(d, {K0[f]: np.ones(WANT[f][2], "bfloat16")}), K0, "expected F32"),
    "k_scale of shape [2]": (lambda d, f: _rewrite(d, {K0[f]: np.ones(2, np.float32)}), K0, "expected F32"),
    "scales without the config announcing them": (
        lambda d, f: _announce(d, f, None),
        K0,
        "announce no quantized KV cache",
    ),
}


@pytest.mark.parametrize("fmt", formats.FORMATS)
@pytest.mark.parametrize("case", CASES)
def test_check_fails_a_broken_kv_scale(exports, tmp_path, fmt, case):
    edit, tensor, words = CASES[case]
    folder = _copy(exports[fmt], tmp_path)
    edit(folder, fmt)
    result = CliRunner().invoke(cli, ["check", folder, "--json"])
    assert result.exit_code == 1, result.output
    problems = _problems(result.output)
    assert any(p["tensor"] == tensor[fmt] and words in p["message"] for p in problems), problems


@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_check_fails_an_announced_kv_cache_without_scales(exports, tmp_path, fmt):
    folder = _copy(exports[f"{fmt}-plain"], tmp_path)
    _announce(folder, fmt, "fp8")
    result = CliRunner().invoke(cli, ["check", folder, "--json"])
    assert result.exit_code == 1
    problems = _problems(result.output)
    missing = {p["tensor"] for p in problems if "missing: the configs announce an FP8 KV cache" in p["message"]}
    assert missing == {f"{a}.{s}" for a in ATTENTIONS for s in WANT[fmt][:2]}


@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_check_passes_the_export_and_refuses_a_config_mismatch(exports, tmp_path, fmt):
    assert CliRunner().invoke(cli, ["check", exports[fmt]]).exit_code == 0
    folder = _copy(exports[fmt], tmp_path)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"]["kv_cache_scheme"] = {"num_bits": 4, "type": "float"}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    result = CliRunner().invoke(cli, ["check", folder])
    assert result.exit_code == 1 and "kv_cache_scheme" in result.output


# ----------------------------------------------------------------------------------- the KV seam


def test_served_kv_is_the_fp8_cache_write_and_read():
    """E4M3(sat(x / scale)) * scale (vLLM's __nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE)):
    exact on representable multiples, saturating at 448 * scale, identity nowhere else."""
    scale = np.float32(0.5)
    k = jnp.asarray([[[[1.0, 2.0, 224.0, 1000.0, -1000.0, 0.3]]]], jnp.float32)
    got_k, got_v = served_kv(k, -k, (scale, np.float32(2.0)))
    np.testing.assert_array_equal(np.asarray(got_k)[0, 0, 0], [1.0, 2.0, 224.0, 224.0, -224.0, 0.3125])
    np.testing.assert_array_equal(np.asarray(got_v)[0, 0, 0], [-1.0, -2.0, -224.0, -896.0, 896.0, -0.3125])


def test_default_kv_seam_is_an_exact_no_op(source):
    """The forward with the default KV seam and with an explicit identity give the same bits,
    and a quantizing seam changes them (the seam is on the path)."""
    src, _ = source
    model = model_from_tensors(CONFIG, HFFolderSource(src), dtype=jnp.float32)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, CONFIG.vocab_size, (2, 9)), jnp.int32)
    seen = []

    def run(*kv):
        return np.asarray(forward_side(model, ids, seam=Seam.of(default_linear, *kv))[0])

    def identity(k, v, *, name):
        seen.append(name)
        return k, v

    coarse = lambda k, v, *, name: served_kv(k, v, (jnp.float32(1.0), jnp.float32(1.0)))  # noqa: E731
    assert np.array_equal(run(), run(identity)) and seen == ATTENTIONS
    assert not np.array_equal(run(), run(coarse))


# ----------------------------------------------------------------------------------- validate


@pytest.mark.parametrize("offload", ["never", "always"])
@pytest.mark.slow  # > 15 s of the inner loop (tests/durations.json)
def test_validate_reports_the_fp8_kv_cache_effect_separately(exports, source, offload):
    """The export with an FP8 KV cache is also measured as "nvfp4+fp8-kv": its KL to BF16 differs
    from the plain row by a small nonzero amount (K / V to E4M3 with amax-calibrated scales), the
    same held and streamed."""
    from nvfp4tool.validate.runner import ValidateOptions, open_inputs, run_validation

    _, calib = source
    options = ValidateOptions(
        data=calib,
        reference="bf16",
        samples=2,
        seq_len=16,
        batch_size=2,
        prompts=1,
        prompt_len=4,
        gen_tokens=4,
        offload=offload,
        source=source[0],
    )
    with open_inputs(exports["modelopt"], options) as inputs:
        record = run_validation(inputs)
    plain, kv = record.models["nvfp4"], record.models["nvfp4+fp8-kv"]
    assert record.labels == ["nvfp4", "nvfp4+fp8-kv"] and record.layer_labels == ["nvfp4"]
    assert kv["kl_mean"] != plain["kl_mean"]
    assert abs(kv["kl_mean"] - plain["kl_mean"]) < 0.5 * plain["kl_mean"]  # small next to the W4A4 error
    assert 0 < kv["logit_max_err"] < 10 * plain["logit_max_err"]
    if offload == "never":
        assert set(record.generation.first_divergence) == {"nvfp4", "nvfp4+fp8-kv"}
    with open_inputs(exports["modelopt-plain"], options) as inputs:
        assert [c.label for c in inputs.runs] == ["nvfp4"]  # no KV scales: no +fp8-kv run
