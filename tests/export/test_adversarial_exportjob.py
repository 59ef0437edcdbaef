"""Adversarial cases of issue 22 item 6 (one export job, one serving-folder writer, a GPTQ export
that calibrates inside its GPTQ pass): each builds one kind of bad input and `run_case`
(adversarial_harness) asserts the exit code, one `Error:` line naming the tensor / linear / file,
no traceback and nothing created, changed or deleted (the output's temporary folder and GPTQ's
spill inside it included).

* the GPTQ pass now measures what calibration measured (input amax, K / V amax, router counts):
  its refusals (a zero K / V amax, a zero input of a W4A4 linear) come from that one pass, after the
  spill began, and still leave nothing behind;
* the job is resolved before anything is created: a bad calibration file or weight with the
  options of a single-pass GPTQ export is named before the GPTQ pass runs;
* convert-format writes through export's serving-folder writer: a sharded export (index + several
  shards, which the pristine single-file exports lack) with a broken shard or index is refused
  before anything is written.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from click.testing import CliRunner

from nvfp4tool.cli import cli

from fixtures.adversarial_harness import (
    BF16_NAN,
    SEQ,
    WEIGHTS,
    Case,
    World,
    edit_json,
    poke,
    registrar,
    run_case,
    truncate,
)
from fixtures.hf_fixtures import build_tiny_model

CASES: list[Case] = []
case = registrar(CASES)

MOE_SEQ = 16
INDEX = "model.safetensors.index.json"
K0 = "model.layers.0.self_attn.k_proj"


@pytest.fixture(scope="module")
def paths(pristine, tmp_path_factory) -> dict[str, str]:
    """The pristine fixtures plus a tiny Qwen3-MoE model and its ids, and a sharded W4A4 ModelOpt
    export of the pristine model (`sharded`: an index and several shards)."""
    root = tmp_path_factory.mktemp("adversarial-exportjob")
    moe = build_tiny_model("qwen3_moe", str(root / "moe"))
    ids = str(root / "moe-ids.npy")
    np.save(ids, np.random.default_rng(0).integers(3, 256, (4, MOE_SEQ)))
    sharded = str(root / "sharded")
    result = CliRunner().invoke(
        cli,
        [
            "-q",
            "export",
            pristine["hf"],
            "--out",
            sharded,
            "--calib-data",
            pristine["ids"],
            "--calib-samples",
            "4",
            "--calib-seq-len",
            str(SEQ),
            "--max-shard-size",
            "40KB",
        ],
    )
    assert result.exit_code == 0, result.output
    assert os.path.exists(os.path.join(sharded, INDEX))
    return dict(pristine, moe=moe, moe_ids=ids, sharded=sharded)


def _zeroed(w: World, key: str, tensor: str, file: str = WEIGHTS) -> str:
    """A copy of source `key` whose `tensor` is all zero (same dtype and size)."""
    folder = w.copy(key)
    poke(os.path.join(folder, file), tensor, lambda old: bytes(len(old)))
    return folder


def _gptq(w: World, src: str, *args: str, ids: str | None = None, seq: int = SEQ) -> list[str]:
    return [
        "export",
        src,
        "--out",
        w.path("out"),
        "--calib-data",
        ids or w.copy("ids", "ids.npy"),
        "--calib-samples",
        "4",
        "--calib-seq-len",
        str(seq),
        "--weight-rounding",
        "gptq",
        *args,
    ]


def _moe(w: World, src: str, *args: str) -> list[str]:
    return _gptq(w, src, *args, ids=w.copy("moe_ids", "moe-ids.npy"), seq=MOE_SEQ)


def _shard(folder: str, tensor: str) -> str:
    """The shard file of a sharded export holding `tensor`."""
    import json

    with open(os.path.join(folder, INDEX)) as f:
        return os.path.join(folder, json.load(f)["weight_map"][tensor])


def _convert(w: World, src: str) -> list[str]:
    return ["convert-format", src, w.path("out"), "--to", "compressed-tensors"]


WEIGHT_ONLY = ("--quant", "nvfp4-weight-only")
KV = ("--kv-cache", "fp8")


# ---- the GPTQ pass calibrates: its refusals ----------------------------------------------------


@case("export/gptq-w4a4-kv-cache-keys-all-zero", 1)
def _(w):
    return _gptq(w, _zeroed(w, "hf", f"{K0}.weight"), *KV), ("model.layers.0.self_attn", "keys / values")


@case("export/gptq-weight-only-kv-cache-keys-all-zero", 1)
def _(w):
    return _gptq(w, _zeroed(w, "hf", f"{K0}.weight"), *WEIGHT_ONLY, *KV), ("model.layers.0.self_attn", "keys / values")


@case("export/gptq-w4a4-o-proj-input-all-zero", 1)
def _(w):
    # zero values: the attention's output, o_proj's input, is zero on every token
    return _gptq(w, _zeroed(w, "hf", "model.layers.0.self_attn.v_proj.weight")), (
        "model.layers.0.self_attn.o_proj",
        "zero on every",
    )


@case("export/gptq-moe-w4a4-kv-cache-keys-all-zero", 1)
def _(w):
    return _moe(w, _zeroed(w, "moe", f"{K0}.weight"), *KV), ("model.layers.0.self_attn", "keys / values")


# ---- the job is resolved before the GPTQ pass runs ---------------------------------------------


@case("export/gptq-w4a4-kv-cache-calib-ids-outside-the-vocabulary", 1)
def _(w):
    path = w.path("calib.npy")
    np.save(path, np.full((4, SEQ), 300))
    return _gptq(w, w.copy("hf"), *KV, ids=path), ("calib.npy", "outside [0, 256)")


@case("export/gptq-w4a4-kv-cache-nan-weight", 1)
def _(w):
    hf = w.copy("hf")
    poke(os.path.join(hf, WEIGHTS), "model.layers.1.mlp.up_proj.weight", lambda _: BF16_NAN, index=4, size=2)
    return _gptq(w, hf, *KV), ("model.layers.1.mlp.up_proj.weight", "non-finite")


@case("export/gptq-w4a4-kv-cache-existing-output-without-force", 1)
def _(w):
    w.file("out/keep.txt", "mine")
    return _gptq(w, w.copy("hf"), *KV), ("out",)


# ---- convert-format of a sharded export (the shared serving-folder writer) ----------------------


@case("convert-format/sharded-shard-truncated", 1)
def _(w):
    src = w.copy("sharded")
    shard = _shard(src, "model.layers.1.mlp.down_proj.weight")
    truncate(shard, 0.5)
    return _convert(w, src), (os.path.basename(shard),)


@case("convert-format/sharded-index-names-a-missing-shard", 1)
def _(w):
    src = w.copy("sharded")
    shard = _shard(src, "model.layers.1.mlp.down_proj.weight")
    os.remove(shard)
    return _convert(w, src), (os.path.basename(shard),)


@case("convert-format/sharded-index-not-json", 1)
def _(w):
    src = w.copy("sharded")
    w.file(os.path.join("sharded", INDEX), "{not json")
    return _convert(w, src), (INDEX,)


@case("convert-format/sharded-index-maps-a-tensor-to-the-wrong-shard", 1)
def _(w):
    src = w.copy("sharded")
    name = "model.layers.1.mlp.down_proj.weight"
    right = os.path.basename(_shard(src, name))

    def move(index):
        index["weight_map"][name] = next(f for f in sorted(set(index["weight_map"].values())) if f != right)

    edit_json(os.path.join(src, INDEX), move)
    return _convert(w, src), (name,)


@case("convert-format/sharded-zero-input-scale-in-a-later-shard", 1)
def _(w):
    src = w.copy("sharded")
    name = "model.layers.1.mlp.down_proj.input_scale"
    poke(_shard(src, name), name, lambda old: bytes(len(old)))
    return _convert(w, src), (name,)


@case("convert-format/sharded-existing-output-without-force", 1)
def _(w):
    src = w.copy("sharded")
    w.file("out/keep.txt", "mine")
    return _convert(w, src), ("out",)


SLOW = {"export/gptq-moe-w4a4-kv-cache-keys-all-zero"}  # GPTQ rounds the whole MoE model before the refusal


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c.id in SLOW else c for c in CASES], ids=[c.id for c in CASES]
)
def test_bad_input_is_one_line_and_changes_nothing(case, paths, tmp_path, monkeypatch, hub_env):
    run_case(case, paths, tmp_path, monkeypatch)
