"""transformers 5's fused MoE expert layout (`save_pretrained(save_original_format=False)`) read as
the per-expert one (converters/hf.py, names in converters/layout.py).

The same seeded tiny Qwen3-MoE and Mixtral saved both ways (hf_fixtures): the fused folder reads
to the same tensors bit for bit, one expert slice at a time; our model's logits from it equal
transformers' on the same folder; `export` of both folders writes byte-identical safetensors; and
`convert --to hf` of the fused folder writes the per-expert layout, which transformers loads with
the same logits. The refusals (mixing, wrong shape, missing) are in test_adversarial_convert.py.
"""

from __future__ import annotations

import glob
import os
import re

import numpy as np
import pytest
from click.testing import CliRunner

import converters.hf as hf_module
from converters.hf import HFFolderSource
from converters.layout import FUSED_TENSOR_RE, fused_expert_shapes
from nvfp4tool.checkpoints import TEACHER_OPTIONS, TRAIN_OPTIONS, open_checkpoint
from nvfp4tool.cli import cli
from nvfp4tool.export import ExportOptions, export_checkpoint
from nvfp4tool.model import forward, model_from_tensors

from fixtures.hf_fixtures import MOE_KEYS, build_tiny_model

torch = pytest.importorskip("torch")

TOLERANCE = 1e-4  # fp32 vs fp32, as tests/model/test_hf_model.py


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{(key, "per-expert" | "fused"): folder} of the same seeded model saved both ways."""
    root = tmp_path_factory.mktemp("fused")
    out = {}
    for key in MOE_KEYS:
        out[key, "per-expert"] = build_tiny_model(key, str(root / f"{key}-per-expert"))
        out[key, "fused"] = build_tiny_model(key, str(root / f"{key}-fused"), fused=True)
    return out


def _stored_names(folder: str) -> list[str]:
    from safetensors import safe_open

    names = []
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(path, framework="numpy") as f:
            names += list(f.keys())
    return names


def _batch():
    ids = np.random.default_rng(1).integers(3, 256, size=(2, 10))
    return ids, np.ones_like(ids)


def _transformers_logits(folder: str, ids, mask) -> np.ndarray:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()


@pytest.mark.parametrize("key", MOE_KEYS)
def test_the_fused_folder_is_fused_and_reads_as_the_per_expert_one(key, saved):
    fused_names = _stored_names(saved[key, "fused"])
    per_expert, fused = HFFolderSource(saved[key, "per-expert"]), HFFolderSource(saved[key, "fused"])
    # the fixture really is the other layout: every fused tensor of the table, no per-expert one
    assert set(fused_expert_shapes(fused.config)) <= set(fused_names)
    assert not any(".experts.0." in n or "block_sparse_moe" in n for n in fused_names)
    assert not any(re.search(FUSED_TENSOR_RE, n) for n in _stored_names(saved[key, "per-expert"]))
    assert fused.names() == per_expert.names()
    for name in per_expert.names():
        a, b = per_expert.get(name), fused.get(name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32), err_msg=name)


def test_the_fused_reader_reads_one_expert_at_a_time(saved, monkeypatch):
    """No fused tensor is loaded whole: each read of one is a slice selecting one expert."""
    reads = []
    real_open = hf_module.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self._f = real_open(*args, **kwargs)

        def __enter__(self):
            self._inner = self._f.__enter__()
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

        def get_tensor(self, name):
            reads.append((name, None))
            return self._inner.get_tensor(name)

        def get_slice(self, name):
            inner = self._inner.get_slice(name)

            class Slice:
                def __getitem__(self, index):
                    reads.append((name, index))
                    return inner[index]

            return Slice()

    monkeypatch.setattr(hf_module, "safe_open", Recording)
    source = HFFolderSource(saved["mixtral", "fused"])
    gate = source.get("model.layers.1.block_sparse_moe.experts.2.w1.weight")
    up = source.get("model.layers.1.block_sparse_moe.experts.2.w3.weight")
    down = source.get("model.layers.1.block_sparse_moe.experts.2.w2.weight")
    F = source.config.family_spec.expert_width(source.config)
    assert reads == [
        ("model.layers.1.mlp.experts.gate_up_proj", (2, slice(0, F))),
        ("model.layers.1.mlp.experts.gate_up_proj", (2, slice(F, 2 * F))),
        ("model.layers.1.mlp.experts.down_proj", (2, slice(0, source.config.hidden_size))),
    ]
    assert gate.shape == up.shape == (F, source.config.hidden_size) and down.shape == gate.shape[::-1]


@pytest.mark.parametrize("key", MOE_KEYS)
def test_logits_from_the_fused_folder_match_transformers_on_it(key, saved):
    ids, mask = _batch()
    source = HFFolderSource(saved[key, "fused"])
    ours = np.asarray(forward(model_from_tensors(source.config, source), ids, mask))
    theirs = _transformers_logits(saved[key, "fused"], ids, mask)
    assert np.abs(ours - theirs).max() < TOLERANCE
    assert np.abs(theirs).max() > 1.0


@pytest.mark.parametrize("key", MOE_KEYS)
def test_export_of_the_fused_folder_is_byte_identical(key, saved, tmp_path):
    """W4A16 (no calibration: the W4A4 calibration runs the model, whose input the logits test
    above already shows identical)."""
    outs = {}
    for layout in ("per-expert", "fused"):
        outs[layout] = str(tmp_path / layout)
        export_checkpoint(
            saved[key, layout], outs[layout], ExportOptions(quant="nvfp4-weight-only", show_progress=False)
        )
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(outs["fused"], "*.safetensors")))
    assert files == sorted(os.path.basename(p) for p in glob.glob(os.path.join(outs["per-expert"], "*.safetensors")))
    for name in files:
        with (
            open(os.path.join(outs["fused"], name), "rb") as a,
            open(os.path.join(outs["per-expert"], name), "rb") as b,
        ):
            assert a.read() == b.read(), name


@pytest.mark.parametrize("key", MOE_KEYS)
def test_convert_to_hf_writes_the_per_expert_layout_transformers_loads(key, saved, tmp_path):
    out = str(tmp_path / "hf")
    result = CliRunner().invoke(cli, ["convert", saved[key, "fused"], out, "--to", "hf"])
    assert result.exit_code == 0, result.output
    names = _stored_names(out)
    assert not any(re.search(FUSED_TENSOR_RE, n) for n in names)
    assert sorted(names) == sorted(_stored_names(saved[key, "per-expert"]))
    ids, mask = _batch()
    np.testing.assert_allclose(
        _transformers_logits(out, ids, mask), _transformers_logits(saved[key, "fused"], ids, mask), rtol=0, atol=1e-5
    )


def test_every_command_opens_the_fused_folder(saved):
    """train `model=` / `teacher=`, validate `--source`, export and convert all open sources with
    `open_checkpoint`: it hands them the per-expert tensors of the fused folder."""
    reference = HFFolderSource(saved["qwen3_moe", "per-expert"])
    for options in (TRAIN_OPTIONS, TEACHER_OPTIONS, None):
        kwargs = {} if options is None else {"options": options}
        opened = open_checkpoint(saved["qwen3_moe", "fused"], **kwargs)
        assert opened.kind == "hf" and opened.tensors.names() == reference.names()
        name = "model.layers.2.mlp.experts.5.up_proj.weight"
        np.testing.assert_array_equal(opened.tensors.get(name), reference.get(name))


def test_a_sharded_fused_folder_read_in_small_chunks(saved, tmp_path, monkeypatch):
    """Fused tensors in shards, each expert read in several row chunks (the path large tensors
    take), give the same per-expert tensors."""
    folder = build_tiny_model("qwen3_moe", str(tmp_path / "sharded"), fused=True, max_shard_size="40KB")
    assert os.path.isfile(os.path.join(folder, "model.safetensors.index.json"))
    monkeypatch.setattr(hf_module, "_READ_CHUNK_BYTES", 1000)  # an expert's [32, 64] fp32 rows: 11 chunks of 3 rows
    reference, sharded = HFFolderSource(saved["qwen3_moe", "per-expert"]), HFFolderSource(folder)
    assert sharded.names() == reference.names()
    for name in reference.names():
        np.testing.assert_array_equal(sharded.get(name), reference.get(name), err_msg=name)


def test_a_fused_expert_name_in_a_dense_folder_is_an_unexpected_tensor(tmp_path):
    """The fused layout is read where the module table has gated experts; a dense model's folder
    holding a fused-layout name is refused in one line (it raised AttributeError: no experts record)."""
    from safetensors.numpy import load_file, save_file

    from nvfp4tool.errors import NVFP4ToolError

    folder = build_tiny_model("llama3", str(tmp_path / "dense"))
    (path,) = glob.glob(os.path.join(folder, "*.safetensors"))
    tensors = load_file(path)
    tensors["model.layers.0.mlp.experts.gate_up_proj"] = np.zeros((2, 4, 8), np.float32)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(NVFP4ToolError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.experts\.gate_up_proj'"):
        HFFolderSource(folder)
