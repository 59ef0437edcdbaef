"""`nvfp4tool convert` through click's CliRunner: directions, options, and bad input (exit 1 for bad
input, 2 for usage; one-line messages; nothing left behind). No torch: the HF folders here are
random fp32 tensors written by our own HF writer."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from click.testing import CliRunner

from converters.hf import HFFolderSource, write_hf_folder
from converters.maxtext import MaxTextSource
from converters.tensor_source import DictTensorSource
from nvfp4tool.cli import cli
from nvfp4tool.config import ModelConfig

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


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> str:
    rng = np.random.default_rng(0)
    tensors = {n: rng.standard_normal(s).astype(np.float32) for n, s in CONFIG.expected_tensor_shapes().items()}
    out = str(tmp_path_factory.mktemp("cli") / "hf")
    write_hf_folder(out, CONFIG, DictTensorSource(tensors), dtype="fp32")
    return out


@pytest.fixture(scope="module")
def maxtext_ckpt(hf_folder, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("cli") / "mt")
    _ok("convert", hf_folder, out, "--to", "maxtext", "--rope-layout", "interleaved")
    return out


def _run(*args: str):
    return CliRunner().invoke(cli, list(args))


def _ok(*args: str) -> str:
    result = _run(*args)
    assert result.exit_code == 0, result.output
    return result.output


def _fails(code: int, *args: str) -> str:
    result = _run(*args)
    assert result.exit_code == code, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    if code == 1:
        assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    return result.output


def _siblings(path: str) -> list[str]:
    return sorted(os.listdir(os.path.dirname(path)))


def test_summary_line_and_round_trip(hf_folder, maxtext_ckpt, tmp_path):
    back = str(tmp_path / "back")
    out = _ok("convert", maxtext_ckpt, back, "--to", "hf", "--model-config", hf_folder, "--rope-layout", "interleaved")
    summary = out.strip().splitlines()[-1]
    assert summary.startswith("converted maxtext -> hf: 21 tensors, ")
    assert f"{CONFIG.num_parameters():,} parameters" in summary and "GB/s" in summary
    original, copy = HFFolderSource(hf_folder), HFFolderSource(back)
    for name in original.names():
        a, b = original.get(name), copy.get(name)
        if name.endswith("q_proj.weight"):  # fp32 * 1/sqrt(8) / 1/sqrt(8): within one ulp
            np.testing.assert_array_max_ulp(a, b, maxulp=1)
        else:
            assert a.tobytes() == b.tobytes(), name


def test_wrong_rope_layout_changes_q_and_k_only(hf_folder, maxtext_ckpt):
    right = MaxTextSource(maxtext_ckpt, CONFIG, "interleaved")
    wrong = MaxTextSource(maxtext_ckpt, CONFIG, "half")
    differ = {n for n in right.names() if not np.array_equal(right.get(n), wrong.get(n))}
    assert differ == {f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "qk"}


def test_hf_to_hf_reshards_and_casts(hf_folder, tmp_path):
    out = str(tmp_path / "resharded")
    _ok("convert", hf_folder, out, "--to", "hf", "--max-shard-size", "20KB", "--dtype", "fp32")
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        assert len(set(json.load(f)["weight_map"].values())) > 1
    original, copy = HFFolderSource(hf_folder), HFFolderSource(out)
    assert all(original.get(n).tobytes() == copy.get(n).tobytes() for n in original.names())


def test_maxtext_source_needs_model_config(maxtext_ckpt, tmp_path):
    out = _fails(2, "convert", maxtext_ckpt, str(tmp_path / "x"), "--to", "hf")
    assert "--model-config" in out
    assert not os.path.exists(tmp_path / "x")


def test_maxtext_side_needs_a_rope_layout(hf_folder, tmp_path):
    out = _fails(2, "convert", hf_folder, str(tmp_path / "x"), "--to", "maxtext")
    assert "--rope-layout" in out
    assert not os.path.exists(tmp_path / "x")


def test_missing_leaf_is_named(maxtext_ckpt, hf_folder, tmp_path):
    import orbax.checkpoint as ocp

    tree = ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).restore(os.path.join(maxtext_ckpt, "0", "items"))
    del tree["params"]["params"]["decoder"]["layers"]["mlp"]["wo"]
    broken = str(tmp_path / "broken")
    manager = ocp.CheckpointManager(broken, item_names=("items",))
    manager.save(3, args=ocp.args.Composite(items=ocp.args.PyTreeSave(tree)))
    manager.wait_until_finished()
    out = _fails(
        1,
        "convert",
        broken,
        str(tmp_path / "x"),
        "--to",
        "hf",
        "--model-config",
        hf_folder,
        "--rope-layout",
        "interleaved",
    )
    assert "params/params/decoder/layers/mlp/wo/kernel missing" in out and broken in out
    assert _siblings(str(tmp_path / "x")) == ["broken"]


def test_shape_that_disagrees_with_the_config_is_named(maxtext_ckpt, tmp_path):
    other = dict(CONFIG.to_hf_config(), intermediate_size=44)
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(other))
    out = _fails(
        1,
        "convert",
        maxtext_ckpt,
        str(tmp_path / "x"),
        "--to",
        "hf",
        "--model-config",
        str(config_path),
        "--rope-layout",
        "half",
    )
    assert "parameter params/params/decoder/layers/mlp/wi_0/kernel has shape [32, 2, 40]" in out
    assert "expects [32, 2, 44]" in out
    assert _siblings(str(tmp_path / "x")) == ["config.json"]


def test_unknown_model_name_is_usage_and_bad_source_an_input_error(hf_folder, tmp_path):
    out = _fails(2, "convert", hf_folder, str(tmp_path / "x"), "--to", "maxtext", "--model-config", "llama9")
    assert "--model-config llama9: neither a file/folder nor a known MaxText model name" in out
    (tmp_path / "empty").mkdir()
    out = _fails(1, "convert", str(tmp_path / "empty"), str(tmp_path / "x"), "--to", "hf")
    assert "neither an HF folder" in out
    assert not os.path.exists(tmp_path / "x")


def test_model_name_must_match_the_hf_folder(hf_folder, tmp_path):
    out = _fails(1, "convert", hf_folder, str(tmp_path / "x"), "--to", "maxtext", "--model-config", "llama3.1-8b")
    assert "different model" in out


def test_existing_output_needs_force(hf_folder, maxtext_ckpt, tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "keep.txt").write_text("old")
    out = _fails(1, "convert", hf_folder, str(out_dir), "--to", "maxtext", "--rope-layout", "half")
    assert "already exists" in out and (out_dir / "keep.txt").exists()
    _ok(
        "convert",
        hf_folder,
        str(out_dir),
        "--to",
        "maxtext",
        "--rope-layout",
        "half",
        "--force",
        "--no-scan-layers",
        "--dtype",
        "bf16",
    )
    assert not (out_dir / "keep.txt").exists()
    source = MaxTextSource(str(out_dir), CONFIG, "half")
    assert not source.scanned and source.dtype("model.norm.weight") == "bfloat16"
    assert _siblings(str(out_dir)) == ["out"]  # no temporary folders left


def test_parameter_the_config_does_not_describe_is_named(maxtext_ckpt, tmp_path):
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(dict(CONFIG.to_hf_config(), tie_word_embeddings=True)))
    out = _fails(
        1,
        "convert",
        maxtext_ckpt,
        str(tmp_path / "x"),
        "--to",
        "hf",
        "--model-config",
        str(config_path),
        "--rope-layout",
        "half",
    )
    assert "parameter params/params/decoder/logits_dense/kernel is not part of the model" in out
