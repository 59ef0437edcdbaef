"""The one safetensors header parser (`converters.hf.scan_safetensors_header`) and the value checks
of `HFFolderSource`: every defect is one NVFP4ToolError line naming the file and the tensor, and
every header defect is one that safetensors' own reader refuses too (the independent oracle)."""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

from converters.hf import (
    HFFolderSource,
    read_safetensors_header,
    scan_safetensors_header,
    write_hf_folder,
    write_safetensors,
)
from converters.tensor_source import DictTensorSource
from nvfp4tool.config import ModelConfig
from nvfp4tool.errors import NVFP4ToolError

TENSORS = {
    "a": np.arange(12, dtype=np.float32).reshape(3, 4),
    "b": np.ones(4, np.float32),
    "c": np.ones(2, ml_dtypes.bfloat16),
    "d": np.full(4, 2.0, np.float32),
}


def header_file(tmp_path, edit=None, tail: bytes = b"", raw_header: bytes | None = None) -> str:
    """A safetensors file of TENSORS with `edit(header)` applied (data bytes kept), `tail` appended."""
    path = str(tmp_path / "model.safetensors")
    write_safetensors(path, [(n, a.dtype.name, a.shape) for n, a in TENSORS.items()], TENSORS.__getitem__)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header, data = json.loads(f.read(n)), f.read()
    if edit is not None:
        edit(header)
    raw = raw_header if raw_header is not None else json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data + tail)
    return path


def set_field(name, field, value):
    return lambda h: h[name].__setitem__(field, value)


def drop(name):
    return lambda h: h.pop(name)


# (id, how the file is built, tensor named or None, words in the message)
DEFECTS = [
    ("overlap", dict(edit=set_field("d", "data_offsets", [48, 64])), "'d'", "overlaps tensor 'b'"),
    ("gap", dict(edit=drop("b")), "'c'", "gap of 16 bytes"),
    ("bytes after the data", dict(tail=b"\0" * 8), None, "8 bytes after the last tensor"),
    ("dtype relabel, other size", dict(edit=set_field("a", "dtype", "F16")), "'a'", "header lies about its size"),
    ("unknown dtype", dict(edit=set_field("b", "dtype", "F4")), "'b'", "unsupported dtype 'F4'"),
    ("negative dim", dict(edit=set_field("b", "shape", [-4])), "'b'", "malformed shape"),
    ("float dim", dict(edit=set_field("b", "shape", [4.0])), "'b'", "malformed shape"),
    ("shape not a list", dict(edit=set_field("b", "shape", "4")), "'b'", "malformed shape"),
    ("offsets reversed", dict(edit=set_field("b", "data_offsets", [64, 48])), "'b'", "bad data_offsets"),
    ("offsets not ints", dict(edit=set_field("b", "data_offsets", ["48", "64"])), "'b'", "bad data_offsets"),
    ("entry without dtype", dict(edit=lambda h: h["b"].pop("dtype")), "'b'", "malformed header entry"),
    ("entry not an object", dict(edit=lambda h: h.__setitem__("b", [1, 2])), "'b'", "malformed header entry"),
    ("past the end", dict(edit=set_field("d", "data_offsets", [80, 96])), "'d'", "truncated shard or lying header"),
    (
        "metadata not strings",
        dict(edit=lambda h: h.__setitem__("__metadata__", {"format": 1})),
        None,
        "__metadata__ is not a map of strings",
    ),
    ("not JSON", dict(raw_header=b"{not json"), None, "not valid UTF-8 JSON"),
    ("not UTF-8", dict(raw_header=b'{"\xff": 1}'), None, "not valid UTF-8 JSON"),
    ("a JSON array", dict(raw_header=b"[1, 2]"), None, "not an object"),
    (
        "repeated name",
        dict(
            raw_header=b'{"b": {"dtype": "F32", "shape": [4], "data_offsets": [48, 64]}, '
            b'"b": {"dtype": "F32", "shape": [4], "data_offsets": [48, 64]}}'
        ),
        None,
        "'b' appears twice",
    ),
]


@pytest.mark.parametrize("case, build, tensor, words", DEFECTS, ids=[d[0] for d in DEFECTS])
def test_header_defect_is_one_line_naming_file_and_tensor(tmp_path, case, build, tensor, words):
    path = header_file(tmp_path, **build)
    with pytest.raises(NVFP4ToolError) as error:
        read_safetensors_header(path)
    message = str(error.value)
    assert message.startswith(path + ": ") and words in message and "\n" not in message, message
    if tensor is not None:
        assert f"tensor {tensor}" in message, message
    with pytest.raises(Exception):  # the safetensors library refuses the same file
        with safe_open(path, framework="numpy") as f:
            for name in f.keys():
                f.get_tensor(name)


def test_sound_file_has_no_defect_and_matches_safetensors(tmp_path):
    path = header_file(tmp_path)
    entries, defects = scan_safetensors_header(path)
    assert defects == [] and list(entries) == list(TENSORS)
    with safe_open(path, framework="numpy") as f:
        offsets = {n: f.get_slice(n).get_shape() for n in f.keys()}
    assert {n: list(e.shape) for n, e in entries.items()} == offsets
    assert entries["c"].dtype == np.dtype(ml_dtypes.bfloat16) and entries["c"].code == "BF16"


def test_scan_reports_every_defect_and_keeps_the_well_formed_entries(tmp_path):
    def two_defects(h):
        h["b"]["dtype"] = "F4"
        h["d"]["data_offsets"] = [80, 96]

    entries, defects = scan_safetensors_header(header_file(tmp_path, edit=two_defects))
    assert [d.tensor for d in defects][:2] == ["b", "d"]
    assert list(entries) == ["a", "c", "d"]  # b is malformed; d (past the end) is kept, with its defect


@pytest.mark.parametrize("case", ["folder", "missing", "empty", "header longer than file"])
def test_unreadable_file(tmp_path, case):
    path = str(tmp_path / "model.safetensors")
    if case == "folder":
        os.makedirs(path)
    elif case == "empty":
        open(path, "wb").close()
    elif case == "header longer than file":
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(NVFP4ToolError) as error:
        read_safetensors_header(path)
    words = {
        "folder": "is a folder",
        "missing": "no such file",
        "empty": "truncated",
        "header longer than file": "header claims 1000 bytes",
    }[case]
    assert str(error.value).startswith(path + ": ") and words in str(error.value)


# --------------------------------------------------------------------- values read from a folder

CONFIG = ModelConfig(
    family="qwen2",
    vocab_size=64,
    hidden_size=16,
    intermediate_size=24,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    attention_bias=True,
    dtype="float32",
)
VICTIM = "model.layers.1.mlp.up_proj.weight"


def model_folder(tmp_path, dtype=np.float32, poison: float | None = None) -> str:
    """A model folder of random weights; `poison` is put at VICTIM[3, 0]."""
    rng = np.random.default_rng(0)
    tensors = {n: rng.standard_normal(s).astype(dtype) for n, s in CONFIG.expected_tensor_shapes().items()}
    if poison is not None:
        tensors[VICTIM][3, 0] = poison
    out = str(tmp_path / "model")
    write_hf_folder(out, CONFIG, DictTensorSource(tensors), dtype=None)
    return out


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_writer_refuses_non_finite_values_and_writes_nothing(tmp_path, value):
    with pytest.raises(
        NVFP4ToolError,
        match=rf"<memory>: tensor '{VICTIM}' has 1 non-finite value "
        rf"\(NaN or inf\), e.g. {value} at index \[3, 0\]",
    ):
        model_folder(tmp_path, poison=value)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_weight_in_a_file_is_named_when_read(tmp_path, value):
    out = model_folder(tmp_path)
    path = os.path.join(out, "model.safetensors")
    entry = read_safetensors_header(path)[VICTIM]
    with open(path, "r+b") as f:
        f.seek(entry.start + 4 * 16 * 3)
        f.write(np.array([value], np.float32).tobytes())
    source = HFFolderSource(out)  # the header is fine
    source.get("model.norm.weight")
    with pytest.raises(
        NVFP4ToolError,
        match=rf"{path}: tensor '{VICTIM}' has 1 non-finite value "
        rf"\(NaN or inf\), e.g. {value} at index \[3, 0\]",
    ):
        source.get(VICTIM)


def rewrite_dtype(folder: str, name: str, code: str) -> None:
    path = os.path.join(folder, "model.safetensors")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header, data = json.loads(f.read(n)), f.read()
    header[name]["dtype"] = code
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize(
    "stored, code, config_dtype, words",
    [
        (np.float32, "I32", None, "has dtype int32, the config expects a floating-point weight"),
        (np.float32, "U32", None, "has dtype uint32"),
        (ml_dtypes.bfloat16, "F16", "bfloat16", "is float16 but config.json declares bfloat16"),
        (np.float16, "BF16", "float16", "is bfloat16 but config.json declares float16"),
    ],
)
def test_relabelled_dtype_is_refused(tmp_path, stored, code, config_dtype, words):
    out = model_folder(tmp_path, dtype=stored)
    if config_dtype is not None:
        config_path = os.path.join(out, "config.json")
        json.dump({**json.load(open(config_path)), "torch_dtype": config_dtype}, open(config_path, "w"))
    rewrite_dtype(out, VICTIM, code)
    with pytest.raises(NVFP4ToolError, match=rf"{out}: tensor '{VICTIM}' {words}"):
        HFFolderSource(out)
    HFFolderSource(out, check_config=False).get(VICTIM)  # as plain tensors it is readable


def test_weights_path_that_is_a_folder(tmp_path):
    out = model_folder(tmp_path)
    os.remove(os.path.join(out, "model.safetensors"))
    os.makedirs(os.path.join(out, "model.safetensors"))
    with pytest.raises(NVFP4ToolError, match=r"model\.safetensors: is a folder, not a safetensors file"):
        HFFolderSource(out)


def test_cast_overflow_is_refused_and_nothing_written(tmp_path):
    tensors = {n: np.ones(s, np.float32) for n, s in CONFIG.expected_tensor_shapes().items()}
    tensors[VICTIM][2, 1] = 3.4e38  # finite in fp32, inf in bf16
    with pytest.raises(
        NVFP4ToolError,
        match=rf"tensor '{VICTIM}' has 1 non-finite value \(NaN or inf\) "
        rf"after the cast to bfloat16, e.g. inf at index \[2, 1\]",
    ):
        write_hf_folder(str(tmp_path / "out"), CONFIG, DictTensorSource(tensors), dtype="bf16")
    assert os.listdir(tmp_path) == []


def test_float8_tensors_are_read_by_hand_exactly(tmp_path):
    path = str(tmp_path / "scales.safetensors")
    values = {
        "s": np.linspace(-2, 2, 16).astype(ml_dtypes.float8_e4m3fn),
        "e": np.array([0.5, 1, 2, 4], np.float32).astype(ml_dtypes.float8_e8m0fnu),
    }
    write_safetensors(path, [(n, a.dtype.name, a.shape) for n, a in values.items()], values.__getitem__)
    from converters.hf import read_tensor

    entries = read_safetensors_header(path)
    for name, value in values.items():
        got = read_tensor(entries[name])
        assert got.dtype == value.dtype and got.tobytes() == value.tobytes()
