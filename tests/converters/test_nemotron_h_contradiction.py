"""A Nemotron-H config.json whose layer keys contradict each other or the stored tensors is refused
naming the key, the layer, what the key says and what the tensors are, by every command that reads
it (convert, export, check, push): never blamed on tensors "missing" or "unexpected" (issue 39).
The folders are tests/fixtures/hybrid_fixtures.py's dense hybrid (layers M - M * - M) as
transformers writes it, its config.json edited afterwards."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from nvfp4tool.cli import cli

from fixtures.hybrid_fixtures import DENSE, _hf_folder

BLOCKS = ["mamba", "mlp", "mamba", "attention", "mlp", "mamba"]  # the fixture's layers, legacy names


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("nemotron_h_contradiction")
    source, _ = _hf_folder(root, DENSE, seed=0)
    export = str(root / "export")
    result = CliRunner().invoke(cli, ["-q", "export", source, "--out", export, "--quant", "nvfp4-weight-only"])
    assert result.exit_code == 0, result.output
    return {"source": source, "export": export, "root": root}


def _edited(folders, which: str, name: str, **keys) -> str:
    """A copy of the source or export folder whose config.json has `keys` (None: removed)."""
    import shutil

    folder = str(folders["root"] / name)
    shutil.copytree(folders[which], folder)
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.pop("hybrid_override_pattern", None)
    config.update(keys)
    with open(path, "w") as f:
        json.dump({k: v for k, v in config.items() if v is not None}, f)
    return folder


def _error(args: list[str]) -> str:
    result = CliRunner().invoke(cli, ["-q", *args])
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, result.output
    assert "missing" not in errors[0] and "unexpected" not in errors[0], errors[0]
    return errors[0]


def _source_commands(folder: str, tmp_path) -> list[list[str]]:
    return [
        ["convert", folder, str(tmp_path / "converted"), "--to", "hf"],
        ["export", folder, "--out", str(tmp_path / "exported"), "--quant", "nvfp4-weight-only"],
    ]


def test_the_two_keys_disagreeing_at_one_layer(folders, tmp_path):
    blocks = [*BLOCKS[:3], "mamba", *BLOCKS[4:]]
    folder = _edited(folders, "source", "two-keys", hybrid_override_pattern="M-M*-M", layers_block_type=blocks)
    for args in _source_commands(folder, tmp_path):
        error = _error(args)
        assert error == (
            f"Error: {folder}/config.json: hybrid_override_pattern says layer 3 is '*' (attention), "
            "layers_block_type says 'mamba' (Mamba-2); give one, or both equal"
        ), args[0]


def test_the_two_keys_of_different_lengths(folders, tmp_path):
    folder = _edited(folders, "source", "lengths", hybrid_override_pattern="M-M*-M", layers_block_type=BLOCKS[:4])
    for args in _source_commands(folder, tmp_path):
        error = _error(args)
        assert "hybrid_override_pattern lists 6 layers, layers_block_type 4 (the first 4 agree)" in error, args[0]


@pytest.mark.parametrize(
    "key,value,said",
    [
        ("hybrid_override_pattern", "M-MM-M", "hybrid_override_pattern says layer 3 is 'M' (Mamba-2)"),
        (
            "layers_block_type",
            [*BLOCKS[:3], "mamba", *BLOCKS[4:]],
            "layers_block_type says layer 3 is 'mamba' (Mamba-2)",
        ),
    ],
)
def test_a_key_contradicting_the_source_tensors(folders, tmp_path, key, value, said):
    folder = _edited(folders, "source", f"tensors-{key}", **{"layers_block_type": None, key: value})
    for args in _source_commands(folder, tmp_path):
        error = _error(args)
        assert error == (
            f"Error: {folder}: config.json's {said}, but the checkpoint's layer 3 holds attention tensors "
            "(backbone.layers.3.mixer.q_proj.weight)"
        ), args[0]


def test_a_key_listing_fewer_layers_than_the_tensors(folders, tmp_path):
    folder = _edited(folders, "source", "short", layers_block_type=None, hybrid_override_pattern="M-M*-")
    for args in _source_commands(folder, tmp_path):
        error = _error(args)
        assert "config.json's hybrid_override_pattern lists 5 layers, but the checkpoint's layer 5 holds " in error
        assert "Mamba-2 tensors (backbone.layers.5.mixer." in error


def test_an_export_whose_key_contradicts_its_tensors(folders):
    """check and push (which checks first) name the key and the layer, and so does load_export
    (what validate opens an export with)."""
    from nvfp4tool.errors import NVFP4ToolError
    from nvfp4tool.export.simulate import load_export

    blocks = ["linear_attention", "mlp", "linear_attention", "mlp", "mlp", "linear_attention"]
    folder = _edited(folders, "export", "export-edited", layers_block_type=blocks)
    said = "layers_block_type says layer 3 is 'mlp' (MLP), but the checkpoint's layer 3 holds attention tensors"
    for args in (["check", folder], ["push", folder, "--repo-id", "org/m", "--dry-run", "--no-validation"]):
        assert said in _error(args), args[0]
    with pytest.raises(NVFP4ToolError, match=r"layers_block_type says layer 3 is 'mlp' \(MLP\)"):
        load_export(folder)
