"""`check` catches single defects in a real export, in both formats: each case copies a tiny
sharded W4A4 export (built once per format), corrupts one thing (a scale, a dtype, a header, a
file, the index, a config key, the provenance record ...), runs `nvfp4tool check` in-process and
requires exit 1 with the corrupted tensor / file named in the output. An untouched re-write of the
export (every shard rewritten from its tensors) passes.
"""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Callable

import numpy as np
import pytest
from click.testing import CliRunner

from converters.hf import SAFETENSORS_DTYPES, write_safetensors
from nvfp4tool import formats
from nvfp4tool.cli import cli
from nvfp4tool.export import export_checkpoint
from nvfp4tool.records.export import ExportRecord

from fixtures.check_fixtures import INDEX, Folder
from fixtures.export_fixtures import export_options, synthetic_config, synthetic_source

CONFIG = synthetic_config(hidden=64, mlp=128, layers=2, vocab=128, head_dim=16, kv_heads=2, dtype="bfloat16")
Q = "model.layers.0.self_attn.q_proj"
O_PROJ = "model.layers.1.self_attn.o_proj"
DOWN = "model.layers.0.mlp.down_proj"
NORM = "model.layers.1.input_layernorm.weight"
EMBED = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """{format: folder} of one tiny model exported W4A4, sharded (so the index is checked too)."""
    root = tmp_path_factory.mktemp("corrupt")
    src, calib = synthetic_source(root, CONFIG, seed=11)
    out = {}
    for fmt in formats.FORMATS:
        out[fmt] = str(root / fmt)
        export_checkpoint(src, out[fmt], export_options(calib, format=fmt, quant="nvfp4", max_shard_size="60KB"))
        assert len([f for f in os.listdir(out[fmt]) if f.endswith(".safetensors")]) >= 2
    return out


# ------------------------------------------------------------------------------------ file surgery


def _relabel(tensor: str, code: str):
    return lambda d: d.edit_header(tensor, lambda h: h[tensor].__setitem__("dtype", code))


def _reshape(tensor: str, shape):
    return lambda d: d.edit_header(tensor, lambda h: h[tensor].__setitem__("shape", list(shape(h[tensor]["shape"]))))


# ------------------------------------------------------------------------------------ the defects
# (id, corrupt(folder), what the output must name: a tensor or file name, or a role to resolve)
W, B, G, IG = "weight", "block_scale", "weight_global", "input_global"  # roles, resolved per format


def _r(module: str, role: str) -> tuple[str, str]:
    return (module, role)


CASES: list[tuple[str, Callable[[Folder], None], object]] = [
    # global scales: convention mix-ups, magnitude, non-finite
    ("weight-global-reciprocal", lambda d: d.scale(d.name(Q, G), lambda v: 1 / v), _r(Q, W)),
    ("weight-global-x4", lambda d: d.scale(d.name(Q, G), lambda v: v * 4), _r(Q, W)),
    ("weight-global-div4", lambda d: d.scale(d.name(DOWN, G), lambda v: v / 4), _r(DOWN, W)),
    ("weight-global-zero", lambda d: d.scale(d.name(O_PROJ, G), lambda v: v * 0), _r(O_PROJ, G)),
    ("weight-global-nan", lambda d: d.scale(d.name(O_PROJ, G), lambda v: v * np.nan), _r(O_PROJ, G)),
    ("weight-global-inf", lambda d: d.scale(d.name(O_PROJ, G), lambda v: v * np.inf), _r(O_PROJ, G)),
    ("weight-global-negative", lambda d: d.scale(d.name(O_PROJ, G), lambda v: -v), _r(O_PROJ, G)),
    ("weight-global-next-float", lambda d: d.scale(d.name(DOWN, G), lambda v: np.nextafter(v, np.inf)), _r(DOWN, G)),
    ("input-global-reciprocal", lambda d: d.scale(d.name(Q, IG), lambda v: 1 / v), _r(Q, IG)),
    ("input-global-x4", lambda d: d.scale(d.name(DOWN, IG), lambda v: v * 4), _r(DOWN, IG)),
    ("input-global-zero", lambda d: d.scale(d.name(O_PROJ, IG), lambda v: v * 0), _r(O_PROJ, IG)),
    ("input-global-nan", lambda d: d.scale(d.name(O_PROJ, IG), lambda v: v * np.nan), _r(O_PROJ, IG)),
    ("input-global-inf", lambda d: d.scale(d.name(O_PROJ, IG), lambda v: v * np.inf), _r(O_PROJ, IG)),
    # block scales and packed codes
    ("block-scale-nan", lambda d: d.bytes_op(d.name(Q, B), lambda b: b.__setitem__(3, 0x7F)), _r(Q, B)),
    ("block-scale-negative", lambda d: d.bytes_op(d.name(Q, B), lambda b: b.__setitem__(5, b[5] | 0x80)), _r(Q, B)),
    ("block-scale-all-zero", lambda d: d.bytes_op(d.name(O_PROJ, B), lambda b: b.fill(0)), _r(O_PROJ, B)),
    ("block-scale-x2", lambda d: d.bytes_op(d.name(DOWN, B), lambda b: b.__setitem__(0, b[0] + 8)), _r(DOWN, B)),
    (
        "packed-byte-flipped",
        lambda d: d.bytes_op(d.name(DOWN, W), lambda b: b.__setitem__(7, b[7] ^ 0x11)),
        _r(DOWN, W),
    ),
    ("packed-all-zero", lambda d: d.bytes_op(d.name(O_PROJ, W), lambda b: b.fill(0)), _r(O_PROJ, W)),
    # unquantized tensors
    ("norm-nan", lambda d: d.scale(NORM, lambda v: np.where(np.arange(v.size) == 2, np.nan, v)), NORM),
    ("norm-all-zero", lambda d: d.scale(NORM, lambda v: v * 0), NORM),
    ("embed-byte-changed", lambda d: d.bytes_op(EMBED, lambda b: b.__setitem__(11, b[11] ^ 0x01)), EMBED),
    (
        "lm-head-inf",
        lambda d: d.scale("lm_head.weight", lambda v: np.where(np.arange(v.size).reshape(v.shape) == 0, np.inf, v)),
        "lm_head.weight",
    ),
    # dtypes and shapes in headers
    ("bf16-relabelled-f16", _relabel(EMBED, "F16"), EMBED),
    ("bf16-norm-relabelled-f16", _relabel(NORM, "F16"), NORM),
    ("global-f32-relabelled-i32", lambda d: _relabel(d.name(Q, G), "I32")(d), _r(Q, G)),
    ("packed-u8-relabelled-i8", lambda d: _relabel(d.name(Q, W), "I8")(d), _r(Q, W)),
    ("block-scale-relabelled-e5m2", lambda d: _relabel(d.name(Q, B), "F8_E5M2")(d), _r(Q, B)),
    ("block-scale-relabelled-u8", lambda d: _relabel(d.name(O_PROJ, B), "U8")(d), _r(O_PROJ, B)),
    ("packed-transposed", lambda d: _reshape(d.name(Q, W), lambda s: s[::-1])(d), _r(Q, W)),
    ("block-scale-wrong-shape", lambda d: _reshape(d.name(Q, B), lambda s: [s[0] * 2, s[1] // 2])(d), _r(Q, B)),
    ("embed-wrong-shape", _reshape(EMBED, lambda s: [s[0] // 2, s[1] * 2]), EMBED),
    ("global-shape-other-convention", lambda d: _reshape(d.name(Q, G), lambda s: [] if s == [1] else [1])(d), _r(Q, G)),
    # tensors missing, renamed, added
    ("drop-weight-global", lambda d: d.drop(d.name(DOWN, G)), _r(DOWN, G)),
    ("drop-input-global", lambda d: d.drop(d.name(DOWN, IG)), _r(DOWN, IG)),
    ("drop-block-scale", lambda d: d.drop(d.name(O_PROJ, B)), _r(O_PROJ, B)),
    ("drop-packed-weight", lambda d: d.drop(d.name(O_PROJ, W)), _r(O_PROJ, W)),
    ("drop-norm", lambda d: d.drop(NORM), NORM),
    ("rename-weight-global", lambda d: d.rename(d.name(Q, G), f"{Q}.global_scale"), f"{Q}.global_scale"),
    ("rename-norm", lambda d: d.rename(NORM, NORM + "_x"), NORM),
    ("add-extra-tensor", lambda d: d.add(f"{Q}.bias", np.ones(64, "bfloat16"), d.name(Q, W)), f"{Q}.bias"),
    # files and the index
    ("truncate-shard-1-byte", lambda d: d.truncate(d.shards()[-1], by=1), "shards[-1]"),
    ("truncate-shard-to-4-bytes", lambda d: d.truncate(d.shards()[0], size=4), "shards[0]"),
    (
        "shard-header-garbage",
        lambda d: open(os.path.join(d.path, d.shards()[0]), "r+b").write(struct.pack("<Q", 16) + b"{not json at all"),
        "shards[0]",
    ),
    ("trailing-bytes", lambda d: open(os.path.join(d.path, d.shards()[0]), "ab").write(b"\0" * 8), "shards[0]"),
    ("shard-deleted", lambda d: os.remove(os.path.join(d.path, d.shards()[1])), "shards[1]"),
    (
        "index-points-to-missing-file",
        lambda d: d.edit_json(INDEX, lambda j: j["weight_map"].__setitem__(NORM, "model-00009-of-00009.safetensors")),
        "model-00009-of-00009.safetensors",
    ),
    ("index-lacks-a-tensor", lambda d: d.edit_json(INDEX, lambda j: j["weight_map"].pop(EMBED)), EMBED),
    (
        "index-total-size-wrong",
        lambda d: d.edit_json(INDEX, lambda j: j["metadata"].__setitem__("total_size", 7)),
        INDEX,
    ),
    (
        "index-wrong-shard",
        lambda d: d.edit_json(
            INDEX,
            lambda j: j["weight_map"].__setitem__(EMBED, next(s for s in d.shards() if s != j["weight_map"][EMBED])),
        ),
        EMBED,
    ),
    ("index-not-json", lambda d: d.write_text(INDEX, "{"), INDEX),
    # configs
    ("config-not-json", lambda d: d.write_text("config.json", "{"), "config.json"),
    ("config-dtype-float16", lambda d: d.edit_json("config.json", lambda c: c.__setitem__("dtype", "float16")), EMBED),
    (
        "config-hidden-size",
        lambda d: d.edit_json("config.json", lambda c: c.__setitem__("hidden_size", 128)),
        "config.json",
    ),
    (
        "config-layers-3",
        lambda d: d.edit_json("config.json", lambda c: c.__setitem__("num_hidden_layers", 3)),
        "model.layers.2",
    ),
    ("ignore-drops-lm-head", lambda d: _exclude_nothing(d), "lm_head.weight"),
    ("ignore-lists-quantized-module", lambda d: _exclude(d, DOWN), DOWN),
    ("quant-method-wrong", lambda d: d.qc(lambda q: q.__setitem__("quant_method", "fp8")), "config.json"),
    ("group-size-32", lambda d: _group_size(d, 32), "_group_size_file"),
    # the provenance record
    ("record-not-json", lambda d: d.write_text(ExportRecord.FILE_NAME, "{"), ExportRecord.FILE_NAME),
    ("record-unknown-key", lambda d: d.record(lambda r: r.__setitem__("extra", 1)), ExportRecord.FILE_NAME),
    ("record-missing-tensors", lambda d: d.record(lambda r: r.pop("tensors")), ExportRecord.FILE_NAME),
    ("record-format-other", lambda d: d.record(lambda r: r.__setitem__("format", "other")), ExportRecord.FILE_NAME),
    ("record-sha256-other", lambda d: d.record(lambda r: r["tensors"][NORM].__setitem__("sha256", "0" * 64)), NORM),
    ("record-amax-other", lambda d: d.record(lambda r: r["tensors"][d.name(Q, W)].__setitem__("amax", 1.0)), _r(Q, W)),
    (
        "record-nan-amax",
        lambda d: d.write_text(
            ExportRecord.FILE_NAME,
            open(os.path.join(d.path, ExportRecord.FILE_NAME)).read().replace('"amax": null', '"amax": NaN', 1),
        ),
        ExportRecord.FILE_NAME,
    ),
]


def _exclude_nothing(d: Folder) -> None:
    d.qc(lambda q: [q.__setitem__(k, []) for k in ("ignore", "exclude_modules") if k in q])
    if os.path.exists(os.path.join(d.path, formats.HF_QUANT_CONFIG_FILE)):
        d.edit_json(formats.HF_QUANT_CONFIG_FILE, lambda j: j["quantization"].__setitem__("exclude_modules", []))


def _exclude(d: Folder, module: str) -> None:
    d.qc(lambda q: [q[k].append(module) for k in ("ignore", "exclude_modules") if k in q])
    if os.path.exists(os.path.join(d.path, formats.HF_QUANT_CONFIG_FILE)):
        d.edit_json(formats.HF_QUANT_CONFIG_FILE, lambda j: j["quantization"]["exclude_modules"].append(module))


def _group_size(d: Folder, size: int) -> None:
    if d.spec.format == "modelopt":
        d.edit_json(formats.HF_QUANT_CONFIG_FILE, lambda j: j["quantization"].__setitem__("group_size", size))
    else:
        d.qc(lambda q: q["config_groups"]["group_0"]["weights"].__setitem__("group_size", size))


# Defects only one family can have.
FORMAT_CASES = {
    "modelopt": [
        (
            "hf-quant-config-missing",
            lambda d: os.remove(os.path.join(d.path, formats.HF_QUANT_CONFIG_FILE)),
            formats.HF_QUANT_CONFIG_FILE,
        ),
        (
            "hf-quant-config-algo-fp8",
            lambda d: d.edit_json(
                formats.HF_QUANT_CONFIG_FILE, lambda j: j["quantization"].__setitem__("quant_algo", "FP8")
            ),
            "config.json",
        ),
        (
            "hf-quant-config-lacks-kv-key",
            lambda d: d.edit_json(formats.HF_QUANT_CONFIG_FILE, lambda j: j["quantization"].pop("kv_cache_quant_algo")),
            formats.HF_QUANT_CONFIG_FILE,
        ),
        (
            "exclude-modules-not-a-list",
            lambda d: d.edit_json(
                formats.HF_QUANT_CONFIG_FILE, lambda j: j["quantization"].__setitem__("exclude_modules", "lm_head")
            ),
            formats.HF_QUANT_CONFIG_FILE,
        ),
        ("config-algo-w4a16", lambda d: d.qc(lambda q: q.__setitem__("quant_algo", "W4A16_NVFP4")), "config.json"),
    ],
    "compressed-tensors": [
        ("ignore-malformed-regex", lambda d: d.qc(lambda q: q["ignore"].append("re:model.(")), "re:model.("),
        ("status-frozen", lambda d: d.qc(lambda q: q.__setitem__("quantization_status", "frozen")), "config.json"),
        (
            "format-float-quantized",
            lambda d: d.qc(
                lambda q: [
                    q.__setitem__("format", "float-quantized"),
                    q["config_groups"]["group_0"].__setitem__("format", "float-quantized"),
                ]
            ),
            "config.json",
        ),
        ("no-config-groups", lambda d: d.qc(lambda q: q.__setitem__("config_groups", {})), "config.json"),
        (
            "weights-strategy-channel",
            lambda d: d.qc(lambda q: q["config_groups"]["group_0"]["weights"].__setitem__("strategy", "channel")),
            "config.json",
        ),
        (
            "unquantized-weight-beside-packed",
            lambda d: d.add(f"{Q}.weight", np.ones((64, 64), "bfloat16"), d.name(Q, W)),
            f"{Q}.weight",
        ),
    ],
}
ALL = [(fmt, case) for fmt in formats.FORMATS for case in CASES + FORMAT_CASES[fmt]]


def _expected_name(d: Folder, want: object) -> str:
    if isinstance(want, tuple):
        return d.name(*want)
    if want == "_group_size_file":
        return formats.HF_QUANT_CONFIG_FILE if d.spec.format == "modelopt" else "config.json"
    if isinstance(want, str) and want.startswith("shards["):
        return eval(want, {"shards": d.shards()})
    return str(want)


@pytest.mark.parametrize("fmt,case", ALL, ids=[f"{fmt}-{case[0]}" for fmt, case in ALL])
@pytest.mark.slow  # > 15 s of the inner loop (tests/durations.json)
def test_each_defect_is_caught_and_named(exports, tmp_path, fmt, case):
    _, corrupt, want = case
    folder = str(tmp_path / "x")
    shutil.copytree(exports[fmt], folder)
    d = Folder(folder)
    name = _expected_name(d, want)  # resolved before the corruption (the shard list may change)
    corrupt(d)
    result = CliRunner().invoke(cli, ["check", folder])
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output and "internal error" not in result.output.lower()
    assert name in result.output, result.output


def test_at_least_50_defects_per_format():
    assert all(len(CASES) + len(cases) >= 50 for cases in FORMAT_CASES.values())


@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_an_untouched_rewrite_passes(exports, tmp_path, fmt):
    folder = str(tmp_path / "rewrite")
    shutil.copytree(exports[fmt], folder)
    d = Folder(folder)
    for shard in d.shards():  # every shard rewritten tensor by tensor from what it holds
        header, data = d.header(shard)
        layout = [
            (n, SAFETENSORS_DTYPES[i["dtype"]], tuple(i["shape"])) for n, i in header.items() if n != "__metadata__"
        ]
        values = {n: d.values(n) for n, _, _ in layout}
        write_safetensors(os.path.join(folder, shard), layout, values.__getitem__)
    result = CliRunner().invoke(cli, ["check", folder])
    assert result.exit_code == 0, result.output
