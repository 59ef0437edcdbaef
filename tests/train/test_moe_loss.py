"""The MoE training loss against transformers: the routers' load-balancing loss equals
`load_balancing_loss_func` (padded masks included), and the whole training loss (cross-entropy +
router_aux_loss_coef x aux, fp32) equals the HF model's loss with `output_router_logits=True`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nvfp4tool.checkpoints import open_checkpoint
from nvfp4tool.corpus.batch import Batch
from nvfp4tool.model import model_from_tensors
from nvfp4tool.model.linear import Seam, default_linear
from nvfp4tool.train.moe_loss import load_balancing_loss
from nvfp4tool.train.step import training_loss

from fixtures.hf_fixtures import MOE_KEYS, build_tiny_model, build_torch_model

torch = pytest.importorskip("torch")


# (experts, top-k, sparse layers, mask): no mask, right padding, left padding with an empty row
AUX_CASES = [
    (8, 2, 3, None),
    (6, 2, 2, [[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0, 0]]),
    (4, 1, 1, [[0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1]]),
    (16, 4, 2, [[0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1]]),
]


@pytest.mark.parametrize("num_experts, top_k, layers, mask", AUX_CASES)
def test_aux_loss_equals_transformers(num_experts, top_k, layers, mask):
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    rng = np.random.default_rng(num_experts)
    logits = [rng.normal(0, 2, (3, 7, num_experts)).astype(np.float32) for _ in range(layers)]
    mask_BxT = None if mask is None else np.asarray(mask, np.int64)
    ours = load_balancing_loss(
        [jnp.asarray(x) for x in logits], top_k, None if mask_BxT is None else jnp.asarray(mask_BxT)
    )
    theirs = load_balancing_loss_func(
        tuple(torch.from_numpy(x.reshape(-1, num_experts)) for x in logits),
        num_experts,
        top_k,
        None if mask_BxT is None else torch.from_numpy(mask_BxT),
    )
    np.testing.assert_allclose(float(ours), float(theirs), rtol=1e-6)


def test_aux_loss_ignores_padded_tokens():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(0, 2, (2, 5, 4)).astype(np.float32))
    mask = jnp.asarray([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    changed = logits.at[0, 3:].set(100.0)  # padding rows routed anywhere: the loss does not move
    assert float(load_balancing_loss([changed], 2, mask)) == float(load_balancing_loss([logits], 2, mask))
    assert float(load_balancing_loss([changed], 2)) != float(load_balancing_loss([logits], 2))


@pytest.mark.parametrize("key", MOE_KEYS)
def test_training_loss_equals_the_hf_model_loss(key, tmp_path):
    folder = build_tiny_model(key, str(tmp_path / key))
    source = open_checkpoint(folder)
    model = model_from_tensors(source.config, source.tensors, dtype=jnp.float32)
    windows = np.random.default_rng(1).integers(3, source.config.vocab_size, (3, 13))
    graphdef, state = nnx.split(model)
    # under jit, as in training: the router logits are recorded at trace time
    loss, parts, _ = jax.jit(lambda s, w: training_loss(nnx.merge(graphdef, s), Batch(w), Seam.of(default_linear)))(
        state, windows
    )

    hf = build_torch_model(key)
    ids = torch.from_numpy(windows)
    with torch.no_grad():
        out = hf(
            input_ids=ids[:, :-1], labels=ids[:, :-1], shift_labels=ids[:, 1:].contiguous(), output_router_logits=True
        )
    assert source.config.family_config.router_aux_loss_coef == hf.config.router_aux_loss_coef > 0
    np.testing.assert_allclose(float(parts["aux_loss"]), float(out.aux_loss), rtol=1e-5)
    np.testing.assert_allclose(float(loss), float(out.loss), rtol=1e-5)
