"""Corrupted MaxText checkpoints and non-finite values across `convert` (CliRunner): NaN or
overflowing values in an OCDBT chunk, a truncated, emptied or deleted chunk file. Each is exit 1,
one `Error:` line naming the checkpoint and the array, and no output (nor temporary folder)."""

from __future__ import annotations

import fnmatch
import glob
import os
import re
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from converters import layout
from converters.hf import write_hf_folder
from converters.maxtext import write_maxtext
from converters.tensor_source import DictTensorSource
from nvfp4tool.cli import cli
from nvfp4tool.config import ModelConfig
from nvfp4tool.errors import NVFP4ToolError

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
_RNG = np.random.default_rng(0)
TENSORS = {n: _RNG.standard_normal(s).astype(np.float32) for n, s in CONFIG.expected_tensor_shapes().items()}

PROGRESS_LINE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ convert: ")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> tuple[str, str]:
    """(HF config folder, MaxText checkpoint written from TENSORS, half RoPE layout, fp32)."""
    base = tmp_path_factory.mktemp("corrupt")
    hf = str(base / "hf")
    write_hf_folder(hf, CONFIG, DictTensorSource(TENSORS), dtype=None)
    mt = str(base / "mt")
    write_maxtext(mt, CONFIG, DictTensorSource(TENSORS), rope_layout="half")
    return hf, mt


def chunk_of(checkpoint: str, name: str) -> tuple[str, int]:
    """(data file, offset) holding the first stored values of HF tensor `name` (its MaxText layer)."""
    rule = next(
        r for r in layout.rules_for(CONFIG) if r.per_layer and layout.hf_name(r, int(name.split(".")[2])) == name
    )
    stored = layout.hf_to_maxtext(rule, TENSORS[name], CONFIG, "half", "float32")
    pattern = np.ascontiguousarray(stored).tobytes()[:16]
    hits = [
        (path, data.find(pattern))
        for path in glob.glob(os.path.join(checkpoint, "**", "d", "*"), recursive=True)
        for data in [open(path, "rb").read()]
        if pattern in data
    ]
    assert len(hits) == 1, hits
    return hits[0]


def overwrite(value):
    def corrupt(path: str, offset: int) -> None:
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(np.float32(value).tobytes())

    return corrupt


CASES = [  # (id, tensor whose chunk is hit, corruption, words in the message)
    (
        "NaN value",
        "model.layers.1.mlp.up_proj.weight",
        overwrite(np.nan),
        "parameter params/params/decoder/layers/mlp/wi_1/kernel layer 1 has 1 non-finite value",
    ),
    (
        "inf value",
        "model.layers.0.mlp.down_proj.weight",
        overwrite(-np.inf),
        "parameter params/params/decoder/layers/mlp/wo/kernel layer 0 has 1 non-finite value",
    ),
    (
        "3e38 overflows the query scale",
        "model.layers.1.self_attn.q_proj.weight",
        overwrite(3e38),
        "after its conversion to HF tensor 'model.layers.1.self_attn.q_proj.weight'",
    ),
    # A data file may hold the other layer's chunk too (OCDBT packs them): either layer may be named.
    (
        "truncated chunk",
        "model.layers.1.mlp.up_proj.weight",
        lambda p, o: os.truncate(p, o + 8),
        "parameter params/params/decoder/layers/mlp/wi_1/kernel layer ? cannot be read (corrupted or truncated",
    ),
    (
        "emptied chunk",
        "model.layers.0.mlp.gate_proj.weight",
        lambda p, o: os.truncate(p, 0),
        "parameter params/params/decoder/layers/mlp/wi_0/kernel layer ? cannot be read (corrupted or truncated",
    ),
    (
        "deleted chunk",
        "model.layers.0.self_attn.k_proj.weight",
        lambda p, o: os.remove(p),
        "parameter params/params/decoder/layers/self_attention/key/kernel layer ? cannot be read",
    ),
]


@pytest.mark.parametrize("case, name, corrupt, words", CASES, ids=[c[0] for c in CASES])
def test_corrupted_maxtext_checkpoint_is_one_line_and_writes_nothing(pristine, tmp_path, case, name, corrupt, words):
    hf, mt = pristine
    broken = str(tmp_path / "broken")
    shutil.copytree(mt, broken)
    corrupt(*chunk_of(broken, name))
    out = str(tmp_path / "out")
    result = CliRunner().invoke(
        cli, ["convert", broken, out, "--to", "hf", "--model-config", hf, "--rope-layout", "half"]
    )
    # one line besides the convert stage's own timestamped progress lines (stderr is no terminal)
    lines = [line for line in result.output.splitlines() if line.strip() and not PROGRESS_LINE.match(line)]
    assert result.exit_code == 1 and len(lines) == 1, result.output
    assert lines[0].startswith(f"Error: {broken}: ") and fnmatch.fnmatchcase(lines[0], f"*{words}*"), lines[0]
    assert "internal error" not in lines[0]
    assert sorted(os.listdir(tmp_path)) == ["broken"]


@pytest.mark.parametrize(
    "name, value, dtype, words",
    [
        (
            "model.layers.1.self_attn.k_proj.weight",
            3.4e38,
            "bf16",
            "has 1 non-finite value (NaN or inf) as stored in MaxText (bfloat16)",
        ),
        ("model.norm.weight", np.nan, "fp32", "has 1 non-finite value (NaN or inf) as stored in MaxText (float32)"),
    ],
)
def test_maxtext_writer_refuses_non_finite_stored_values(tmp_path, name, value, dtype, words):
    tensors = {n: t.copy() for n, t in TENSORS.items()}
    tensors[name].reshape(-1)[5] = value
    with pytest.raises(NVFP4ToolError) as error:
        write_maxtext(
            str(tmp_path / "out"), CONFIG, DictTensorSource(tensors, path="src"), rope_layout="half", dtype=dtype
        )
    assert str(error.value).startswith(f"src: tensor {name!r} ") and words in str(error.value)
    assert os.listdir(tmp_path) == []


def _write(relative: str, data: bytes):
    def corrupt(checkpoint: str) -> None:
        with open(os.path.join(checkpoint, relative), "wb") as f:
            f.write(data)

    return corrupt


METADATA_CASES = [  # (id, corruption of the checkpoint folder, file named, words)
    (
        "tree metadata not UTF-8",
        _write("0/items/_METADATA", b"\xff\xfe\0"),
        "0/items/_METADATA",
        "cannot read Orbax metadata",
    ),
    ("tree metadata a JSON list", _write("0/items/_METADATA", b"[]"), "0/items/_METADATA", "is a JSON list"),
    (
        "tree metadata truncated",
        lambda c: os.truncate(os.path.join(c, "0/items/_METADATA"), 20),
        "0/items/_METADATA",
        "cannot read Orbax metadata",
    ),
    (
        "step metadata not UTF-8",
        _write("0/_CHECKPOINT_METADATA", b"\xff\0"),
        "0/_CHECKPOINT_METADATA",
        "cannot read Orbax metadata",
    ),
    (
        "OCDBT manifest truncated",
        lambda c: os.truncate(os.path.join(c, "0/items/manifest.ocdbt"), 10),
        "",
        "cannot read the Orbax tree metadata: DATA_LOSS",
    ),
    (
        "OCDBT manifest deleted",
        lambda c: os.remove(os.path.join(c, "0/items/manifest.ocdbt")),
        "",
        "cannot read the Orbax tree metadata: NOT_FOUND",
    ),
]


@pytest.mark.parametrize("case, corrupt, file, words", METADATA_CASES, ids=[c[0] for c in METADATA_CASES])
def test_corrupted_maxtext_metadata_is_one_line(pristine, tmp_path, case, corrupt, file, words):
    hf, mt = pristine
    broken = str(tmp_path / "broken")
    shutil.copytree(mt, broken)
    corrupt(broken)
    result = CliRunner().invoke(
        cli, ["convert", broken, str(tmp_path / "out"), "--to", "hf", "--model-config", hf, "--rope-layout", "half"]
    )
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert result.exit_code == 1 and len(errors) == 1, result.output
    assert errors[0].startswith(f"Error: {os.path.join(broken, file) if file else broken}: ") and words in errors[0]
    assert "internal error" not in errors[0] and "tensorstore_spec" not in errors[0]
    assert sorted(os.listdir(tmp_path)) == ["broken"]
