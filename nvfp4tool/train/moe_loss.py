"""The routers' load-balancing auxiliary loss of MoE training, as transformers defines it.

    logits, side = forward_side(model, ids, seam=seam)  # side.router_logits: each router's, by name
    experts = config.family_spec.experts(config)        # the family's `moe.Experts`
    aux = load_balancing_loss(list(side.router_logits.values()), experts.num_experts_per_tok)
    loss = cross_entropy(...) + experts.router_aux_loss_coef * aux

Design notes: docs/design/training.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from nvfp4tool.model.layers import route


def load_balancing_loss(
    router_logits: Sequence[jax.Array], top_k: int, attention_mask_BxT: jax.Array | None = None
) -> jax.Array:
    """The auxiliary loss (fp32 scalar) of the sparse layers' router logits (each [B, T, N])."""
    tokens_N = probs_N = rows = jnp.zeros((), jnp.float32)
    for logits_BxTxN in router_logits:
        weight_BxT = (
            jnp.ones(logits_BxTxN.shape[:-1], jnp.float32)
            if attention_mask_BxT is None
            else jnp.asarray(attention_mask_BxT).astype(jnp.float32)
        )
        probs_BxTxN = jax.nn.softmax(logits_BxTxN.astype(jnp.float32), axis=-1)
        _, chosen_BxTxN = route(logits_BxTxN, top_k, normalize=False)
        tokens_N = tokens_N + jnp.einsum("bt,btn->n", weight_BxT, chosen_BxTxN.astype(jnp.float32))
        probs_N = probs_N + jnp.einsum("bt,btn->n", weight_BxT, probs_BxTxN)
        rows = rows + jnp.sum(weight_BxT)
    num_experts = router_logits[0].shape[-1]
    if attention_mask_BxT is not None:  # rows of padding only: 0, not 0 / 0
        rows = jnp.maximum(rows, 1.0)
    return num_experts * jnp.sum((tokens_N / rows) * (probs_N / rows))
