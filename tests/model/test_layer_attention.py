"""Per-layer attention settings: each family's `layer_attention(config, layer)` (window, RoPE base
and scaling), the attention blocks reading it, and a layer's window applied to the model's mask."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nvfp4tool.config import LinearRopeScaling, ModelConfig, RopeScaling
from nvfp4tool.families import REGISTRY, LayerAttention
from nvfp4tool.model.attention import AttentionMask, attention_allowed
from nvfp4tool.model.rope import inverse_frequencies
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


# layer -> (base, linear scaling factor or None): layers 0, 1 and 3 alike, layer 2 its own
_PER_LAYER_ROPE = {0: (1000.0, None), 1: (1000.0, None), 2: (100000.0, 4.0), 3: (1000.0, None)}


def _per_layer(c, layer):
    theta, factor = _PER_LAYER_ROPE[layer]
    return LayerAttention(None, theta, None if factor is None else LinearRopeScaling(factor))


def test_the_linear_scalings_frequencies_are_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(head_dim=16, rope_parameters={"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0})
    theirs = ROPE_INIT_FUNCTIONS["linear"](hf, "cpu")[0].numpy()
    np.testing.assert_array_equal(inverse_frequencies(16, 10000.0, LinearRopeScaling(8.0)), theirs)


def test_layers_with_their_own_rope_match_transformers_layer_by_layer(monkeypatch):
    """Layers at different RoPE settings in one model (the family's `layer_attention`): one
    (cos, sin) per distinct setting, each block its own layer's; the logits equal transformers'
    Llama whose decoder layers are each handed their own `LlamaRotaryEmbedding` (a config at that
    layer's base and scaling), unscanned and scanned (runs split where the settings change)."""
    torch = pytest.importorskip("torch")
    import transformers

    from converters.tensor_source import DictTensorSource
    from nvfp4tool.model import forward, model_from_tensors
    from nvfp4tool.model.linear import Seam
    from nvfp4tool.model.rope import rotation_index, rotations
    from nvfp4tool.model.transformer import layer_runs

    monkeypatch.setattr(REGISTRY["llama"], "layer_attention", _per_layer)
    config = _config("llama", num_hidden_layers=4)
    assert len(rotations(config)) == 2 and [rotation_index(config, i) for i in range(4)] == [0, 0, 1, 0]
    assert layer_runs(config, Seam(), scan=True) == [
        ("attention+mlp", [0, 1]),
        ("attention+mlp", [2]),
        ("attention+mlp", [3]),
    ]

    hf_config = transformers.LlamaConfig(**{**BASE, "num_hidden_layers": 4, "head_dim": 8})
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(hf_config).eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            p.copy_(torch.randn(p.shape) * (0.2 if "norm" in name else 0.3) + (1.0 if "norm" in name else 0.0))
    ids = np.random.default_rng(0).integers(0, 32, size=(2, 12))
    with torch.no_grad():
        one_rope = theirs(input_ids=torch.tensor(ids)).logits.numpy()  # every layer at base 1000
    for i, layer in enumerate(theirs.model.layers):
        theta, factor = _PER_LAYER_ROPE[i]
        rope = (
            {"rope_type": "default", "rope_theta": theta}
            if factor is None
            else {"rope_type": "linear", "factor": factor, "rope_theta": theta}
        )
        rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(
            transformers.LlamaConfig(**{**BASE, "head_dim": 8, "rope_parameters": rope})
        )

        def own_rope(module, args, kwargs, rotary=rotary):
            kwargs["position_embeddings"] = rotary(args[0], kwargs["position_ids"])
            return args, kwargs

        layer.register_forward_pre_hook(own_rope, with_kwargs=True)
    with torch.no_grad():
        expected = theirs(input_ids=torch.tensor(ids)).logits.numpy()
    tensors = {n: t.detach().numpy() for n, t in theirs.state_dict().items()}
    for scan in (False, True):
        ours = forward(model_from_tensors(config, DictTensorSource(tensors), scan_layers=scan), ids)
        np.testing.assert_allclose(np.asarray(ours), expected, atol=1e-4, rtol=0)
    assert np.abs(one_rope - expected).max() > 1e-2  # layer 2's own RoPE matters
