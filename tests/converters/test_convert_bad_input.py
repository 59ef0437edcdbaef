"""`nvfp4tool convert` on bad input (CliRunner), table-driven: each case is exit 1 (bad data) or 2
(bad usage), exactly one `Error:` line naming the file / tensor / option, no traceback, nothing
new anywhere and the source's bytes unchanged (a snapshot of the whole test folder before/after)."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner

from converters.hf import read_safetensors_header, write_hf_folder
from converters.maxtext import write_maxtext
from converters.tensor_source import DictTensorSource
from nvfp4tool.cli import cli
from nvfp4tool.config import ModelConfig

from fixtures.file_fixtures import rewrite_header, snapshot

CONFIG = ModelConfig(
    family="llama",
    vocab_size=48,
    hidden_size=32,
    intermediate_size=40,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    dtype="float32",
)
VICTIM = "model.layers.1.mlp.up_proj.weight"
_RNG = np.random.default_rng(0)
TENSORS = {n: _RNG.standard_normal(s).astype(np.float32) for n, s in CONFIG.expected_tensor_shapes().items()}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bad")
    write_hf_folder(root / "hf", CONFIG, DictTensorSource(TENSORS), dtype=None)
    write_hf_folder(root / "hf_bf16", CONFIG, DictTensorSource(TENSORS), dtype="bf16")
    write_maxtext(root / "mt", CONFIG, DictTensorSource(TENSORS), rope_layout="half")
    return root


# ------------------------------------------------------------------------------ source editors


def weights(folder: Path) -> Path:
    return folder / "model.safetensors"


def edit_header(folder: Path, edit) -> None:
    rewrite_header(weights(folder), edit)


def poke(folder: Path, name: str, value, dtype=np.float32, index: int = 5) -> None:
    entry = read_safetensors_header(str(weights(folder)))[name]
    with open(weights(folder), "r+b") as f:
        f.seek(entry.start + index * np.dtype(dtype).itemsize)
        f.write(np.array([value], dtype).tobytes())


def relabel(name: str, code: str):
    return lambda h: h[name].__setitem__("dtype", code)


def share_bytes(h):  # two same-sized tensors on the same bytes (safetensors refuses this)
    h["model.layers.1.mlp.gate_proj.weight"]["data_offsets"] = h[VICTIM]["data_offsets"]


def folder_for_weights(folder: Path) -> None:
    weights(folder).unlink()
    weights(folder).mkdir()


def truncate(folder: Path) -> None:
    os.truncate(weights(folder), os.path.getsize(weights(folder)) - 100)


def write_config(text: bytes):
    return lambda folder: (folder / "config.json").write_bytes(text)


def to_hf(*extra):
    return lambda src, out: ["convert", src, out, "--to", "hf", *extra]


TO_MAXTEXT = lambda src, out: ["convert", src, out, "--to", "maxtext", "--rope-layout", "half"]  # noqa: E731

# (id, source kept in the test folder as "src", how the source is broken, the command, exit code,
#  words of the one Error line)
DATA_CASES = [
    ("NaN weight", "hf", lambda f: poke(f, VICTIM, np.nan), to_hf(), 1, f"tensor '{VICTIM}' has 1 non-finite value"),
    ("inf weight", "hf", lambda f: poke(f, VICTIM, -np.inf), TO_MAXTEXT, 1, f"tensor '{VICTIM}' has 1 non-finite"),
    (
        "NaN bf16 weight",
        "hf_bf16",
        lambda f: poke(f, VICTIM, np.nan, ml_dtypes.bfloat16),
        to_hf(),
        1,
        f"tensor '{VICTIM}' has 1 non-finite value",
    ),
    (
        "cast overflow",
        "hf",
        lambda f: poke(f, VICTIM, 3.4e38),
        to_hf("--dtype", "bf16"),
        1,
        "after the cast to bfloat16",
    ),
    (
        "F32 relabelled I32",
        "hf",
        lambda f: edit_header(f, relabel(VICTIM, "I32")),
        to_hf(),
        1,
        f"tensor '{VICTIM}' has dtype int32, the config expects a floating-point weight",
    ),
    (
        "F32 relabelled U32",
        "hf",
        lambda f: edit_header(f, relabel(VICTIM, "U32")),
        TO_MAXTEXT,
        1,
        f"tensor '{VICTIM}' has dtype uint32",
    ),
    (
        "BF16 relabelled F16",
        "hf_bf16",
        lambda f: edit_header(f, relabel(VICTIM, "F16")),
        to_hf(),
        1,
        f"tensor '{VICTIM}' is float16 but config.json declares bfloat16",
    ),
    (
        "F32 relabelled F16",
        "hf",
        lambda f: edit_header(f, relabel(VICTIM, "F16")),
        to_hf(),
        1,
        "header lies about its size",
    ),
    (
        "overlapping offsets",
        "hf",
        lambda f: edit_header(f, share_bytes),
        to_hf(),
        1,
        "overlaps tensor 'model.layers.1.mlp.gate_proj.weight'",
    ),
    ("unknown dtype", "hf", lambda f: edit_header(f, relabel(VICTIM, "F4")), to_hf(), 1, "unsupported dtype 'F4'"),
    ("weights path is a folder", "hf", folder_for_weights, to_hf(), 1, "model.safetensors: is a folder"),
    ("truncated weights", "hf", truncate, TO_MAXTEXT, 1, "truncated shard or lying header"),
    (
        "header not JSON",
        "hf",
        lambda f: weights(f).write_bytes(struct.pack("<Q", 8) + b"{notjson"),
        to_hf(),
        1,
        "header is not valid UTF-8 JSON",
    ),
    ("empty weights file", "hf", lambda f: weights(f).write_bytes(b""), to_hf(), 1, "truncated: 0 bytes"),
    (
        "trailing bytes",
        "hf",
        lambda f: weights(f).write_bytes(weights(f).read_bytes() + b"\0" * 16),
        to_hf(),
        1,
        "16 bytes after the last tensor's data",
    ),
    ("config.json binary", "hf", write_config(b"\xff\xfe\0binary"), to_hf(), 1, "config.json: not UTF-8 text"),
    ("config.json invalid JSON", "hf", write_config(b"{"), TO_MAXTEXT, 1, "config.json: not valid JSON"),
    ("config.json a list", "hf", write_config(b"[]"), to_hf(), 1, "config.json: expected a JSON object"),
    (
        "bad index",
        "hf",
        lambda f: (f / "model.safetensors.index.json").write_text("{"),
        to_hf(),
        1,
        "not a valid safetensors index",
    ),
    (
        "index names a missing shard",
        "hf",
        lambda f: (f / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {VICTIM: "model-00009-of-00009.safetensors"}})
        ),
        to_hf(),
        1,
        "missing shard",
    ),
]

USAGE_CASES = [  # (id, the command from (src, tmp folder), words): outputs overlapping an input, bad options
    ("DST is SRC", lambda s, t: ["convert", s, s, "--to", "hf", "--force"], "DST {s}: is the input {s}"),
    (
        "DST contains SRC",
        lambda s, t: ["convert", s, t, "--to", "maxtext", "--rope-layout", "half", "--force"],
        "DST {t}: contains the input {s}",
    ),
    ("DST inside SRC", lambda s, t: ["convert", s, s + "/sub", "--to", "hf"], "lies inside the input"),
    (
        "DST is a symlink to SRC",
        lambda s, t: ["convert", s, t + "/link", "--to", "hf", "--force"],
        "DST {t}/link: is the input {s}",
    ),
    (
        "DST is the --model-config folder",
        lambda s, t: ["convert", t + "/mt", s, "--to", "hf", "--model-config", s, "--rope-layout", "half", "--force"],
        "DST {s}: is the input {s}",
    ),
    (
        "unparsable --max-shard-size",
        lambda s, t: ["convert", s, t + "/out", "--to", "hf", "--max-shard-size", "5 gigs"],
        "--max-shard-size '5 gigs': not a size",
    ),
    (
        "zero --max-shard-size",
        lambda s, t: ["convert", s, t + "/out", "--to", "hf", "--max-shard-size", "0MB"],
        "--max-shard-size '0MB': not a size",
    ),
]


def run_and_check(root: Path, args: list[str], code: int) -> str:
    before = snapshot(root)
    result = CliRunner().invoke(cli, args)
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert result.exit_code == code and len(errors) == 1, result.output
    assert "Traceback" not in result.output and "internal error" not in result.output, result.output
    assert snapshot(root) == before  # nothing new, nothing changed, nothing removed
    return errors[0]


@pytest.mark.parametrize("case, kind, breaks, command, code, words", DATA_CASES, ids=[c[0] for c in DATA_CASES])
def test_bad_data(pristine, tmp_path, case, kind, breaks, command, code, words):
    src = tmp_path / "src"
    shutil.copytree(pristine / kind, src)
    breaks(src)
    line = run_and_check(tmp_path, command(str(src), str(tmp_path / "out")), code)
    assert str(src) in line and words in line, line


@pytest.mark.parametrize("case, command, words", USAGE_CASES, ids=[c[0] for c in USAGE_CASES])
def test_bad_usage(pristine, tmp_path, case, command, words):
    src = tmp_path / "src"
    shutil.copytree(pristine / "hf", src)
    shutil.copytree(pristine / "mt", tmp_path / "mt")
    (tmp_path / "link").symlink_to(src, target_is_directory=True)
    line = run_and_check(tmp_path, command(str(src), str(tmp_path)), 2)
    assert words.format(s=src, t=tmp_path) in line, line
