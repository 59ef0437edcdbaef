"""Rematerialization (`remat=none|block|full`, `nvfp4tool.model.remat`): the same loss, input
amax and gradients as no remat (nvfp4 recipe, dense and MoE), less kept for the
backward pass (a bad value: tests/train/test_train_config.py); and the `1b` preset's size."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nvfp4tool.corpus.batch import Batch
from nvfp4tool.model import CausalLM
from nvfp4tool.train.presets import preset_config

from fixtures.step_fixtures import assert_trees_equal, in_exact_bf16_child, recipe, step_state, tiny_moe

VOCAB = 256


MIXED = tiny_moe(VOCAB, 64)  # the smallest model with both MLP kinds: layer 0 dense, layer 1 sparse


def _gradients(remat: str):
    fns, state = step_state(MIXED, recipe("nvfp4"), remat=remat)
    windows = np.random.default_rng(0).integers(0, VOCAB, (2, 33))
    (loss, (amax, parts)), grads = jax.jit(jax.value_and_grad(fns.loss, has_aux=True))(
        state["params"], Batch(windows), jax.random.key(0)
    )
    return jax.tree.map(np.asarray, {"loss": loss, "amax": amax, "parts": parts, "grads": grads})


def same_as_no_remat() -> None:
    """Run in a process where XLA keeps every BF16 rounding (see the test)."""
    jax.config.update("jax_default_matmul_precision", "highest")  # as conftest.py
    reference = _gradients("none")
    for remat in ("block", "full"):
        assert_trees_equal(_gradients(remat), reference, f"remat={remat}")


@pytest.mark.slow  # ~2 minutes on a loaded 2-core CPU: one process, three compiles of a 2-layer model
def test_remat_gives_the_same_loss_amax_and_gradients():
    """Bit-exact: recomputing a block repeats the same ops on the same inputs, so the loss, the
    input amax (recorded inside the checkpoint), the MoE aux loss and every gradient (hence the
    optimizer's update) equal no remat's. Only with `--xla_allow_excess_precision=false`: by
    default XLA may skip a BF16 rounding inside a fusion, and remat changes the fusions (measured
    with it on: the loss equal, gradients up to 2% (bf16) / 28% (nvfp4) of their largest entry
    apart), so the check runs in its own process with the flag off."""
    in_exact_bf16_child(__file__, "same_as_no_remat")


@pytest.mark.parametrize("recipe_name", ["bf16", "nvfp4"])
def test_remat_keeps_less_for_the_backward_pass(recipe_name):
    """The residuals the gradient keeps (traced, not compiled) at seq 512: none keeps every
    block's intermediates (~254 MB here, attention scores mostly), block its linear outputs
    (~30 MB), full only each block's input (~11 MB). Not XLA's compiled temp size: XLA:CPU
    reports the same for every level (and for a toy stack of checkpointed layers)."""
    kept = {}
    for remat in ("none", "block", "full"):
        fns, state = step_state(preset_config("tiny", VOCAB, 512), recipe(recipe_name), remat=remat)
        windows = jax.ShapeDtypeStruct((4, 513), jnp.int32)
        backward = jax.eval_shape(
            lambda p, w: jax.vjp(lambda p: fns.loss(p, w, jax.random.key(0))[0], p)[1], state["params"], Batch(windows)
        )
        kept[remat] = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(backward))
    assert kept["full"] < kept["block"] < kept["none"] / 5, kept


def test_1b_preset_has_llama_3_2_1b_size():
    config = preset_config("1b", 128256, 2048)
    model = nnx.eval_shape(lambda: CausalLM(config, param_dtype=jnp.bfloat16))
    count = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert count == 1_235_814_400  # Llama-3.2-1B (tied embeddings)
