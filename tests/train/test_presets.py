"""The training presets (`train/presets.py`) as the families declare them (`Family.presets`): each
builds a config its family can write and read back, a family's declaration is all a new preset
takes, a name declared twice is refused, and the train page names every preset."""

from __future__ import annotations

import pathlib
import types

import pytest

from nvfp4tool.config import ModelConfig
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.families import REGISTRY, get_family, module_table
from nvfp4tool.families.base import PRESET_SHAPES, preset_shape
from nvfp4tool.train import presets
from nvfp4tool.train.presets import PRESETS, preset_config

from fixtures import REPO_ROOT


@pytest.mark.parametrize("name", PRESETS)
def test_each_preset_is_a_config_its_family_writes_and_reads_back(name):
    config = preset_config(name, 512, 2048)
    declaring = [f.model_type for f in REGISTRY.values() if name in f.presets]
    assert declaring == [config.family]
    assert (config.vocab_size, config.max_position_embeddings) == (512, 2048)
    # config.json written by the family and parsed again: the same model (the preset is expressible)
    assert ModelConfig.from_hf_config(config.to_hf_config()) == config
    assert module_table(config).tensor_shapes["model.embed_tokens.weight"] == (512, config.hidden_size)


def test_a_family_declaring_a_preset_is_all_it_takes(monkeypatch):
    llama = get_family("llama")
    extra = types.SimpleNamespace(
        model_type="llama", presets={"tiny-wide": preset_shape("tiny", hidden_size=256, rope_theta=1e6)}
    )
    monkeypatch.setattr(presets, "REGISTRY", {"llama": llama, "other": extra})
    monkeypatch.setattr(presets, "_DECLARED", presets._collect())
    config = presets.preset_config("tiny-wide", 512, 2048)
    E, L, H, KV, D, F = PRESET_SHAPES["tiny"]
    assert (config.hidden_size, config.num_layers, config.num_heads, config.intermediate_size) == (256, L, H, F)
    assert config.rope_theta == 1e6 and config.family == "llama" and E != 256
    assert presets.preset_config("tiny", 512, 2048) == preset_config("tiny", 512, 2048)


def test_a_preset_name_declared_by_two_families_is_refused(monkeypatch):
    twice = [types.SimpleNamespace(model_type=t, presets={"tiny": {}}) for t in ("a", "b")]
    monkeypatch.setattr(presets, "REGISTRY", {f.model_type: f for f in twice})
    with pytest.raises(AssertionError, match="'tiny' declared by a and b"):
        presets._collect()


def test_an_unknown_preset_is_refused_naming_the_sizes():
    with pytest.raises(NVFP4ToolError, match=r"unknown model size 'huge'; sizes: tiny, small, .*tiny-hybrid-moe"):
        preset_config("huge", 512, 2048)


def test_the_train_page_names_every_preset():
    text = (pathlib.Path(REPO_ROOT) / "docs" / "commands" / "train.md").read_text(encoding="utf-8")
    assert [name for name in PRESETS if f"`{name}`" not in text] == []
