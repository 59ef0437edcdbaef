"""The routers' load-balancing auxiliary loss of MoE training, as transformers defines it.

    router_logits = {}
    linear = recording_router_logits(linear, config.router_names(), router_logits)
    logits = forward(model, ids, linear=linear)        # fills router_logits at trace time
    aux = load_balancing_loss(list(router_logits.values()), config.experts.num_experts_per_tok)
    loss = cross_entropy(...) + config.experts.router_aux_loss_coef * aux

`load_balancing_loss` is transformers' `load_balancing_loss_func` (Qwen3-MoE and Mixtral share it;
Switch Transformer eqs. 4-6): over the tokens of every sparse layer together (mask-weighted, so
padding does not count), the fraction of top-k assignments each expert got times its mean router
probability, summed over the experts and multiplied by the number of experts (perfect balance
gives k). The softmax runs in fp32 (transformers: in the logits' dtype; equal for fp32 models) and
the top-k choice is `route`'s, the one the model routes with.

The logits are recorded through the linear seam under the routers' names: the model's forward runs
inline under the caller's transformation, so the recording holds tracers of that trace only.
Training runs its layers unscanned (one Python loop over the blocks), which this needs: a sink
filled inside a `lax.scan` body would leak the body's tracers.
"""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping, Sequence

import jax
import jax.numpy as jnp

from nvfp4tool.model.linear import LinearFn
from nvfp4tool.model.remat import sinks
from nvfp4tool.model.transformer import route


def load_balancing_loss(router_logits: Sequence[jax.Array], top_k: int,
                        attention_mask_BxT: jax.Array | None = None) -> jax.Array:
    """The auxiliary loss (fp32 scalar) of the sparse layers' router logits (each [B, T, N])."""
    tokens_N = probs_N = rows = jnp.zeros((), jnp.float32)
    for logits_BxTxN in router_logits:
        weight_BxT = (jnp.ones(logits_BxTxN.shape[:-1], jnp.float32) if attention_mask_BxT is None
                      else jnp.asarray(attention_mask_BxT).astype(jnp.float32))
        probs_BxTxN = jax.nn.softmax(logits_BxTxN.astype(jnp.float32), axis=-1)
        _, chosen_BxTxN = route(logits_BxTxN, top_k, normalize=False)
        tokens_N = tokens_N + jnp.einsum("bt,btn->n", weight_BxT, chosen_BxTxN.astype(jnp.float32))
        probs_N = probs_N + jnp.einsum("bt,btn->n", weight_BxT, probs_BxTxN)
        rows = rows + jnp.sum(weight_BxT)
    num_experts = router_logits[0].shape[-1]
    return num_experts * jnp.sum((tokens_N / rows) * (probs_N / rows))


def recording_router_logits(linear: LinearFn, router_names: Iterable[str],
                            sink: MutableMapping[str, jax.Array]) -> LinearFn:
    """`linear`, also storing the output of each router (by name) into `sink`."""
    routers = frozenset(router_names)

    def recording(x, w_NxK, b_N, *, name):
        y = linear(x, w_NxK, b_N, name=name)
        if name in routers:
            sink[name] = y
        return y

    recording.sinks = (*sinks(linear), sink)  # filled at trace time (model.remat)
    return recording
