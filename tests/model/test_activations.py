"""The activation table (`model/activations.py`) against transformers' ACT2FN, and the names refused."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.families import REGISTRY
from nvfp4tool.model.activations import ACTIVATIONS, activation

pytestmark = pytest.mark.peers
torch = pytest.importorskip("torch")


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_each_activation_is_transformers_own(name):
    from transformers.activations import ACT2FN

    x = np.random.default_rng(0).normal(0.0, 3.0, size=(4096,)).astype(np.float32)
    x[:4] = (0.0, -0.0, 20.0, -20.0)  # the kinks and the saturated tails
    ours = np.asarray(activation(name)(jnp.asarray(x)))
    theirs = ACT2FN[name](torch.from_numpy(x)).numpy()
    assert ours.dtype == theirs.dtype == np.float32
    # fp32 both: XLA's and PyTorch's erf / tanh round differently (each ~1e-6 from an fp64 reference
    # at |x| ~ 10); the exact and tanh GELUs differ by ~5e-4, far outside this
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=2e-6)


def test_the_tanh_gelu_is_not_the_exact_one():
    """gelu_pytorch_tanh and gelu differ (so the table cannot have swapped them unnoticed)."""
    x = jnp.linspace(-3.0, 3.0, 101, dtype=jnp.float32)
    assert float(jnp.max(jnp.abs(activation("gelu_pytorch_tanh")(x) - activation("gelu")(x)))) > 1e-4


def test_every_family_declares_an_activation_the_table_has():
    assert {family.activation for family in REGISTRY.values()} <= set(ACTIVATIONS)


def test_an_unknown_activation_is_refused_in_one_line():
    with pytest.raises(NVFP4ToolError) as error:
        activation("gelu_new", "/m/config.json")
    message = str(error.value)
    assert message.startswith("/m/config.json: hidden_act 'gelu_new' unsupported; supported: silu")
    assert "\n" not in message


def test_a_family_declaring_geglu_gets_a_geglu_mlp(monkeypatch):
    """One declaration (`Family.activation`) makes a family's config.json hidden_act accepted and
    written back, and its MLP gated by that activation: down(gelu_tanh(gate x) * up x), computed here
    in numpy from the MLP's weights with transformers' GELUTanh."""
    import dataclasses

    from flax import nnx
    from transformers.activations import ACT2FN

    from nvfp4tool.config import ModelConfig
    from nvfp4tool.model.layers import MLP
    from nvfp4tool.model.linear import Seam

    hf = {
        "model_type": "llama",
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "hidden_act": "gelu_pytorch_tanh",
    }
    with pytest.raises(NVFP4ToolError, match="hidden_act 'gelu_pytorch_tanh' unsupported for llama; supported: silu"):
        ModelConfig.from_hf_config(hf)
    monkeypatch.setattr(REGISTRY["llama"], "activation", "gelu_pytorch_tanh")
    config = dataclasses.replace(ModelConfig.from_hf_config(hf), dtype="float32")
    assert config.to_hf_config()["hidden_act"] == "gelu_pytorch_tanh"
    mlp = MLP(config, "model.layers.0.mlp", param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    x = np.random.default_rng(1).normal(size=(2, 3, 16)).astype(np.float32)
    y, _ = mlp(jnp.asarray(x), Seam())
    w = {a: np.asarray(getattr(mlp, a).weight.get_value(), np.float64) for a in ("gate_proj", "up_proj", "down_proj")}
    gate = torch.from_numpy(x.astype(np.float64) @ w["gate_proj"].T)
    hidden = ACT2FN["gelu_pytorch_tanh"](gate).numpy() * (x.astype(np.float64) @ w["up_proj"].T)
    np.testing.assert_allclose(np.asarray(y), hidden @ w["down_proj"].T, rtol=1e-5, atol=1e-6)
