"""Reading and writing HF safetensors folders: round trips, sharding, every bad-input error,
atomic output (the atomic folder itself: tests/converters/test_atomic.py). Torch-free except the tests
marked `peers` (transformers-saved folders)."""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from converters.hf import HFFolderSource, parse_size, write_hf_folder
from converters.tensor_source import DictTensorSource
from nvfp4tool.config import ModelConfig
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError

from fixtures.file_fixtures import rewrite_header

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


def tensors(dtype=np.float32, seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(dtype) for name, shape in CONFIG.expected_tensor_shapes().items()}


def written(tmp_path, name="model", *, source=None, **kwargs) -> str:
    out = str(tmp_path / name)
    write_hf_folder(out, CONFIG, source or DictTensorSource(tensors()), **{"dtype": None, **kwargs})
    return out


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# ------------------------------------------------------------------------------------ round trips


def test_round_trip_is_bit_exact_and_readable_by_safetensors(tmp_path):
    original = tensors()
    out = written(tmp_path)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    source = HFFolderSource(out)
    assert source.config == CONFIG and source.names() == list(CONFIG.expected_tensor_shapes())
    for name, value in original.items():
        assert same_bytes(source.get(name), value), name
    independent = safetensors.numpy.load_file(os.path.join(out, "model.safetensors"))  # their reader
    assert all(same_bytes(independent[n], v) for n, v in original.items())


def test_bf16_cast_and_bf16_round_trip(tmp_path):
    original = tensors()
    out = written(tmp_path, "bf16", dtype="bf16")
    source = HFFolderSource(out)
    assert source.config.dtype == "bfloat16"
    for name, value in original.items():
        assert same_bytes(source.get(name), value.astype(ml_dtypes.bfloat16)), name  # RNE, as torch
    again = str(tmp_path / "again")
    write_hf_folder(again, source.config, source, dtype=None)  # bf16 -> bf16 keeps every bit
    with (
        open(os.path.join(out, "model.safetensors"), "rb") as a,
        open(os.path.join(again, "model.safetensors"), "rb") as b,
    ):
        assert a.read() == b.read()


def test_sharded_write_and_read(tmp_path):
    original = tensors()
    out = written(tmp_path, "sharded", max_shard_size=3000)
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert set(index["weight_map"]) == set(original) and set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in original.values())
    for f in files:  # every shard within the limit unless it holds one tensor larger than it
        size = os.path.getsize(os.path.join(out, f))
        header_len = struct.unpack("<Q", open(os.path.join(out, f), "rb").read(8))[0]
        held = [n for n, s in index["weight_map"].items() if s == f]
        assert size - 8 - header_len <= 3000 or len(held) == 1
    source = HFFolderSource(out)
    assert all(same_bytes(source.get(n), v) for n, v in original.items())


def test_tokenizer_files_copied_and_config_keys_kept(tmp_path):
    src = str(tmp_path / "src")
    write_hf_folder(src, CONFIG, DictTensorSource(tensors()), dtype=None)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "README.md"):
        with open(os.path.join(src, name), "w") as f:
            f.write(f'{{"file": "{name}"}}')
    config_path = os.path.join(src, "config.json")
    config = json.load(open(config_path))
    json.dump({**config, "my_extra_key": [1, 2, 3]}, open(config_path, "w"))
    source = HFFolderSource(src)
    out = str(tmp_path / "out")
    write_hf_folder(out, source.config, source, copy_from=src)
    assert sorted(os.listdir(out)) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert json.load(open(os.path.join(out, "config.json")))["my_extra_key"] == [1, 2, 3]
    assert open(os.path.join(out, "tokenizer.json")).read() == '{"file": "tokenizer.json"}'


def test_writer_holds_one_tensor_at_a_time(tmp_path):
    """Every array the source hands out is released before the next one is requested."""
    import weakref

    alive = []

    class Tracking(DictTensorSource):
        def get(self, name):
            assert not alive, f"{alive} still held when {name} was requested"
            array = super().get(name).copy()  # a fresh array per call, as a file reader returns
            alive.append(name)
            weakref.finalize(array, alive.remove, name)
            return array

    out = written(tmp_path, source=Tracking(tensors()), dtype="bf16", max_shard_size=3000)
    assert not alive and len(HFFolderSource(out).names()) == len(tensors())


def test_tied_lm_head_and_inv_freq_tolerated(tmp_path):
    out = written(tmp_path)
    config_path = os.path.join(out, "config.json")
    json.dump({**json.load(open(config_path)), "tie_word_embeddings": True}, open(config_path, "w"))
    path = os.path.join(out, "model.safetensors")
    stored = safetensors.numpy.load_file(path)
    safetensors.numpy.save_file(
        {**stored, "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32)},
        path,
        metadata={"format": "pt"},
    )
    source = HFFolderSource(out)
    assert "lm_head.weight" not in source.names() and not any("inv_freq" in n for n in source.names())


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30
    assert parse_size("500MB") == 5 * 10**8 and parse_size(1234) == 1234
    for bad in ("five gigs", "0GB", "0.1B", "5XB", 0, -3):
        with pytest.raises(NVFP4UsageError, match="--max-shard-size"):
            parse_size(bad)


# ------------------------------------------------------------------------------ bad input errors


def error_of(folder: str) -> str:
    with pytest.raises(NVFP4ToolError) as error:
        HFFolderSource(folder)
    message = str(error.value)
    assert "\n" not in message
    return message


def test_truncated_file_names_file_and_tensor(tmp_path):
    out = written(tmp_path)
    path = os.path.join(out, "model.safetensors")
    os.truncate(path, os.path.getsize(path) - 10)
    message = error_of(out)
    assert path in message and "'lm_head.weight'" in message and "truncated" in message


def test_truncated_inside_header(tmp_path):
    out = written(tmp_path)
    path = os.path.join(out, "model.safetensors")
    os.truncate(path, 50)
    message = error_of(out)
    assert path in message and "header claims" in message


def test_lying_header_names_tensor(tmp_path):
    out = written(tmp_path)
    path = os.path.join(out, "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    rewrite_header(path, lambda h: h[name].update(shape=[24, 15]))  # says fewer bytes than it spans
    message = error_of(out)
    assert path in message and repr(name) in message and "header lies" in message


def test_offsets_past_end_of_file(tmp_path):
    out = written(tmp_path)
    path = os.path.join(out, "model.safetensors")
    name = "model.norm.weight"

    def push_past_end(h):
        begin, end = h[name]["data_offsets"]
        h[name]["data_offsets"] = [begin + 10**6, end + 10**6]

    rewrite_header(path, push_past_end)
    message = error_of(out)
    assert path in message and repr(name) in message and "truncated shard or lying header" in message


def test_missing_shard(tmp_path):
    out = written(tmp_path, max_shard_size=3000)
    victim = os.path.join(
        out, "model-00002-of-%05d.safetensors" % len([f for f in os.listdir(out) if f.endswith(".safetensors")])
    )
    os.remove(victim)
    message = error_of(out)
    assert victim in message and "missing shard" in message and "tensor 'model." in message


def test_index_names_tensor_not_in_shard(tmp_path):
    out = written(tmp_path, max_shard_size=3000)
    index_path = os.path.join(out, "model.safetensors.index.json")
    index = json.load(open(index_path))
    index["weight_map"]["model.norm.weight"] = "model-00001-of-%05d.safetensors" % len(
        set(index["weight_map"].values())
    )
    json.dump(index, open(index_path, "w"))
    message = error_of(out)
    assert "model-00001-of-" in message and "'model.norm.weight' is not in this shard" in message


def test_shape_disagreeing_with_config(tmp_path):
    out = written(tmp_path)
    config_path = os.path.join(out, "config.json")
    json.dump({**json.load(open(config_path)), "intermediate_size": 32}, open(config_path, "w"))
    message = error_of(out)
    assert out in message and "'model.layers.0.mlp.gate_proj.weight' has shape [24, 16]" in message
    assert "expects [32, 16]" in message


def test_missing_and_unexpected_tensors(tmp_path):
    partial = tensors()
    partial.pop("model.layers.1.self_attn.q_proj.bias")
    with pytest.raises(NVFP4ToolError, match=r"'model.layers.1.self_attn.q_proj.bias' missing"):
        written(tmp_path, source=DictTensorSource(partial, path="src"))
    extra = {**tensors(), "model.layers.0.mlp.extra.weight": np.zeros(3, np.float32)}
    with pytest.raises(NVFP4ToolError, match=r"src: unexpected tensor 'model.layers.0.mlp.extra.weight'"):
        written(tmp_path, source=DictTensorSource(extra, path="src"))
    assert not os.path.exists(tmp_path / "model")


def test_unknown_architecture(tmp_path):
    out = written(tmp_path)
    config_path = os.path.join(out, "config.json")
    json.dump(
        {**json.load(open(config_path)), "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]},
        open(config_path, "w"),
    )
    message = error_of(out)
    assert config_path in message and "unsupported architecture 'gpt2'" in message
    assert HFFolderSource(out, check_config=False).names()  # still readable as plain tensors


def test_folder_without_weights(tmp_path):
    out = written(tmp_path)
    os.remove(os.path.join(out, "model.safetensors"))
    assert "no model.safetensors or model.safetensors.index.json" in error_of(out)


# ----------------------------------------------------------------------------------- atomic output


class FailingSource(DictTensorSource):
    """Fails when the writer reaches `fail_at` (after earlier tensors were written)."""

    def __init__(self, tensors, fail_at):
        super().__init__(tensors, path="failing")
        self.fail_at = fail_at

    def get(self, name):
        if name == self.fail_at:
            raise NVFP4ToolError(f"failing: cannot read {name!r}")
        return super().get(name)


def test_failed_write_leaves_nothing(tmp_path):
    source = FailingSource(tensors(), fail_at="model.layers.1.mlp.up_proj.weight")
    with pytest.raises(NVFP4ToolError, match="cannot read"):
        written(tmp_path, "out", source=source, max_shard_size=3000)
    assert os.listdir(tmp_path) == []  # neither out/ nor a temporary folder


def test_existing_output_needs_force(tmp_path):
    out = written(tmp_path, "out")
    with pytest.raises(NVFP4ToolError, match="already exists; pass force=True"):
        written(tmp_path, "out")
    source = FailingSource(tensors(seed=1), fail_at="lm_head.weight")
    with pytest.raises(NVFP4ToolError, match="cannot read"):  # a failed forced write keeps the old one
        written(tmp_path, "out", source=source, force=True)
    assert same_bytes(HFFolderSource(out).get("lm_head.weight"), tensors()["lm_head.weight"])
    written(tmp_path, "out", source=DictTensorSource(tensors(seed=1)), force=True)
    assert same_bytes(HFFolderSource(out).get("lm_head.weight"), tensors(seed=1)["lm_head.weight"])
    assert sorted(os.listdir(tmp_path)) == ["out"]


# ---------------------------------------------------------------- transformers-saved folders (peers)


@pytest.mark.peers
def test_transformers_saved_folders(tmp_path):
    torch = pytest.importorskip("torch")
    from fixtures.hf_fixtures import build_tiny_model, build_torch_model

    state = {n: t.numpy() for n, t in build_torch_model("llama3").state_dict().items()}
    single = HFFolderSource(build_tiny_model("llama3", str(tmp_path / "single")))
    sharded = HFFolderSource(build_tiny_model("llama3", str(tmp_path / "sharded"), max_shard_size="40KB"))
    assert os.path.exists(tmp_path / "sharded" / "model.safetensors.index.json")
    assert single.names() == sharded.names() == list(single.config.expected_tensor_shapes())
    for name in single.names():
        assert same_bytes(single.get(name), state[name]) and same_bytes(sharded.get(name), state[name])
    del torch


@pytest.mark.peers
@pytest.mark.parametrize("key, class_name", [("qwen3", "Qwen3ForCausalLM"), ("llama_tied", "LlamaForCausalLM")])
def test_transformers_loads_what_we_write(tmp_path, key, class_name):
    """Round trip through our writer (bf16, sharded): transformers loads it, same bf16 values."""
    torch = pytest.importorskip("torch")
    import transformers

    from fixtures.hf_fixtures import build_tiny_model

    src = build_tiny_model(key, str(tmp_path / "src"))
    source = HFFolderSource(src)
    out = str(tmp_path / "out")
    write_hf_folder(out, source.config, source, dtype="bf16", max_shard_size="30KB", copy_from=src)
    assert os.path.exists(os.path.join(out, "tokenizer_config.json"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert loaded.dtype == torch.bfloat16 and type(loaded).__name__ == class_name
    for name, tensor in loaded.state_dict().items():
        stored = "model.embed_tokens.weight" if name == "lm_head.weight" and key == "llama_tied" else name
        expected = source.get(stored).astype(ml_dtypes.bfloat16)
        assert tensor.view(torch.int16).numpy().tobytes() == expected.tobytes(), name


@pytest.mark.parametrize("rows", [7, 8, 9, 1])
def test_row_chunked_read_covers_a_last_partial_chunk(tmp_path, monkeypatch, rows):
    """A tensor larger than one read chunk whose rows are not a multiple of the chunk's (the
    embedding of a 32000- or 128256-token vocabulary) reads whole and bit-exact."""
    import converters.hf as hf

    monkeypatch.setattr(hf, "_READ_CHUNK_BYTES", 3 * 16 * 4)  # 3 rows of 16 fp32 per chunk
    array = np.random.default_rng(rows).standard_normal((rows, 16)).astype(np.float32)
    path = str(tmp_path / "t.safetensors")
    safetensors.numpy.save_file({"t": array}, path)
    entry = hf.read_safetensors_header(path)["t"]
    assert same_bytes(hf.read_tensor(entry), array)
