"""Per-layer attention settings: each family's `layer_attention(config, layer)` (window, RoPE base
and scaling), the attention blocks reading it, and a layer's window applied to the model's mask."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nvfp4tool.config import ModelConfig, RopeScaling
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.families import REGISTRY, LayerAttention
from nvfp4tool.model.attention import AttentionMask, attention_allowed
from nvfp4tool.model.rope import layer_frequencies
from nvfp4tool.model.transformer import CausalLM

BASE = {
    "vocab_size": 32,
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "rope_theta": 1000.0,
}


def _config(model_type: str, **keys) -> ModelConfig:
    return ModelConfig.from_hf_config({**BASE, "model_type": model_type, **keys}, source="/m/config.json")


@pytest.mark.parametrize(
    ("model_type", "keys", "window"),
    [
        ("llama", {}, None),
        ("mistral", {"sliding_window": 5}, 5),  # every layer, as HF's MistralModel
        ("mixtral", {"sliding_window": 7, "num_local_experts": 2, "num_experts_per_tok": 1}, 7),
        ("qwen2", {"sliding_window": 9, "use_sliding_window": False}, None),  # full attention only
        ("qwen3", {}, None),
    ],
)
def test_each_family_gives_every_layer_its_window_and_rope(model_type, keys, window):
    config = _config(model_type, **keys)
    family = REGISTRY[model_type]
    assert [family.layer_attention(config, i) for i in range(3)] == [LayerAttention(window, 1000.0, None)] * 3


def test_llama3_scaling_and_the_hybrids_none_come_from_the_family():
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    config = _config("llama", rope_scaling=scaling)
    assert config.family_spec.layer_attention(config, 2) == LayerAttention(None, 1000.0, RopeScaling(8.0, 1.0, 4.0, 16))
    assert REGISTRY["nemotron_h"].layer_attention(config, 0) == LayerAttention(None, None)


def test_the_attention_blocks_read_their_layers_window(monkeypatch):
    """A family that gives its layers different windows (as Gemma 3's local / global layers will)
    gets them in each layer's attention block, with no model-wide field consulted."""
    config = _config("mistral", sliding_window=4)
    monkeypatch.setattr(
        REGISTRY["mistral"], "layer_attention", lambda c, layer: LayerAttention((3, None, 6)[layer], c.rope_theta)
    )
    model = CausalLM(config, rngs=nnx.Rngs(0))
    assert [layer.self_attn.window for layer in model.layers] == [3, None, 6]


def test_a_layers_window_on_an_explicit_mask_is_attention_alloweds():
    """`within(W)` on a mask built without a window equals the mask built with it (left padding,
    positions counted over real tokens), and a causal mask takes the window as the kernel's."""
    rng = np.random.default_rng(0)
    valid = jnp.asarray(rng.random((3, 10)) > 0.2)
    positions = jnp.maximum(jnp.cumsum(valid.astype(jnp.int32), axis=-1) - 1, 0)
    query = jnp.arange(10)
    for window in (1, 3, 11):
        full = AttentionMask.explicit(
            attention_allowed(query, valid, None), valid, query_positions_BxT=positions, key_positions_BxS=positions
        )
        expected = attention_allowed(query, valid, window, positions, positions)
        np.testing.assert_array_equal(np.asarray(full.within(window).allowed_BxTxS), np.asarray(expected))
        assert full.within(None) is full
    assert AttentionMask.causal().within(4) == AttentionMask.causal(4)


def test_layers_with_different_rope_settings_are_refused_in_one_line(monkeypatch):
    config = _config("llama")
    monkeypatch.setattr(
        REGISTRY["llama"], "layer_attention", lambda c, layer: LayerAttention(None, 1000.0 * (1 + layer % 2))
    )
    with pytest.raises(NVFP4ToolError, match=r"^model config \(llama\): layers with different RoPE bases"):
        layer_frequencies(config)
