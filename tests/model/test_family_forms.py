"""The two model-level facts a family declares (`Family.embedding_scale`, `Family.norm_unit_offset`),
against transformers' Gemma 3 modules: the scaled embedding (Gemma3TextScaledWordEmbedding, the
scale rounded to the table's dtype) and the (1 + w) RMSNorm computed in fp32 (Gemma3RMSNorm)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nvfp4tool.model.layers import Embedding, RMSNorm

torch = pytest.importorskip("torch")
gemma3 = pytest.importorskip("transformers.models.gemma3.modeling_gemma3")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_unit_offset_norm_is_gemma3s(dtype):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 48)).astype(np.float32) * 3
    w = rng.normal(size=(48,)).astype(np.float32) * 0.5
    theirs = gemma3.Gemma3RMSNorm(48, eps=1e-6)
    with torch.no_grad():
        theirs.weight.copy_(torch.tensor(w))
        expected = theirs(torch.tensor(x).to(getattr(torch, dtype))).float().numpy()
    ours = RMSNorm(48, eps=1e-6, param_dtype=jnp.float32, unit_offset=True)
    np.testing.assert_array_equal(np.asarray(ours.weight[...]), np.zeros(48))  # identity at init
    ours.weight.set_value(jnp.asarray(w))
    got = np.asarray(ours(jnp.asarray(x).astype(dtype)).astype(jnp.float32))
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-6 if dtype == "float32" else 0)


def test_the_scaled_embedding_is_gemma3s_in_bf16():
    """sqrt(48) = 6.928... is 6.9375 in bf16: the rows are multiplied by the rounded scale, in bf16."""
    table = np.random.default_rng(1).normal(size=(11, 48)).astype(np.float32)
    theirs = gemma3.Gemma3TextScaledWordEmbedding(11, 48, padding_idx=0, embed_scale=48**0.5).to(torch.bfloat16)
    with torch.no_grad():
        theirs.weight.copy_(torch.tensor(table).to(torch.bfloat16))
        expected = theirs(torch.tensor([[1, 5, 10]])).float().numpy()
    ours = Embedding(11, 48, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0), scale=48**0.5)
    ours.weight.set_value(jnp.asarray(table).astype(jnp.bfloat16))
    got = np.asarray(ours(jnp.asarray([[1, 5, 10]])).astype(jnp.float32))
    np.testing.assert_array_equal(got, expected)
    unscaled = np.asarray(jnp.asarray(table).astype(jnp.bfloat16).astype(jnp.float32))[[1, 5, 10]]
    assert not np.array_equal(got[0], unscaled * 48**0.5)  # the scale was rounded first
