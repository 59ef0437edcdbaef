"""One optimizer step and one eval step, as pure functions of the train state (jit-able).

The state is a plain pytree {"params" (FP32 master weights), "opt_state", "amax" (per quantized
layer's input, newest first), "step"}; a step quantizes the NVFP4 weights once, scans `grad_accum`
micro-batches and reports loss, gradient norm and whether both were finite.
Design notes: docs/design/training.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from nvfp4tool.corpus.batch import Batch
from nvfp4tool.model.linear import Seam
from nvfp4tool.model.transformer import forward_side
from nvfp4tool.recipes.precision import (
    RecipeConfig,
    group_amax,
    quantize_weights,
    training_seam,
)
from nvfp4tool.train.distill import Distillation
from nvfp4tool.train.moe_loss import load_balancing_loss

State = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class StepFns:
    """The jit-able step functions of one (model, recipe, optimizer) combination."""

    graphdef: Any
    recipe: RecipeConfig
    pmap: dict[str, str]
    optimizer: optax.GradientTransformation
    grad_accum: int
    distill: Distillation | None = None  # None: the next-token loss

    @property
    def quantized(self) -> list[str]:
        return sorted(n for n, p in self.pmap.items() if p != "bf16")

    def init_state(self, params: Any, amax_history: int) -> State:
        return {
            "params": params,
            "opt_state": self.optimizer.init(params),
            "amax": {n: jnp.zeros((amax_history,), jnp.float32) for n in self.quantized},
            "step": jnp.zeros((), jnp.int32),
        }

    def loss(
        self,
        params,
        batch: Batch,
        key: jax.Array,
        bf16_scope: str = "none",
        teacher: Any = None,
        quantized: tuple | None = None,
        normalizer: jax.Array | None = None,
    ):
        """(the training loss (`training_loss`) of `batch` (rows [B, T+1]), ({quantized linear:
        max|input|}, its parts)). `quantized`: `quantize(params, bf16_scope)` of these params, made
        ahead (else here); `normalizer`: `training_loss`'s."""
        model = nnx.merge(self.graphdef, params)
        quantized = quantized if quantized is not None else self._quantize(model, bf16_scope)
        seam = training_seam(self.recipe, self.pmap, model.config, key, quantized, bf16_scope)
        loss, parts, input_amax = training_loss(model, batch, seam, self.distill, teacher, normalizer)
        return loss, (input_amax, parts)

    def quantize(self, params, bf16_scope: str = "none") -> tuple:
        """(the fused groups' weight amax, the nvfp4 layers' weight operands) of `params`: what
        every micro-batch of one step multiplies with (no gradient flows through them)."""
        return self._quantize(nnx.merge(self.graphdef, params), bf16_scope)

    def _quantize(self, model, bf16_scope: str) -> tuple:
        weights = {n: linear_weight(model, n) for n in self.quantized}
        amax_by_group = group_amax(weights)
        return amax_by_group, quantize_weights(self.recipe, self.pmap, weights, amax_by_group, bf16_scope)

    def train_step(
        self, state: State, batch_AxBxT1: Batch, key: jax.Array, bf16_scope: str = "none", teacher: Any = None
    ) -> tuple[State, dict[str, jax.Array]]:
        """One optimizer step over `grad_accum` micro-batches (`batch_AxBxT1`'s rows [A, B/A, T+1];
        `teacher`: the teacher's parameters of a distillation run). With weighted targets
        (`Batch.targets_weight`) the loss is the mean over the step's weighted predictions: each
        micro-batch's weighted sum is divided by the step's count / A, so that the mean over the A
        micro-batches below is that of the whole step."""
        grad_fn = jax.value_and_grad(self.loss, has_aux=True)
        quantized = self.quantize(state["params"], bf16_scope)  # once per step, outside the scan
        weight = batch_AxBxT1.targets_weight()
        normalizer = None if weight is None else weighted_count(weight) / self.grad_accum

        def micro(carry, inputs):
            grad_sum, loss_sum, parts_sum, amax_max = carry
            index, batch = inputs
            (loss, (amax, parts)), grads = grad_fn(
                state["params"], batch, jax.random.fold_in(key, index), bf16_scope, teacher, quantized, normalizer
            )
            amax_max = {n: jnp.maximum(amax_max[n], amax.get(n, 0.0)) for n in amax_max}
            return (
                jax.tree.map(jnp.add, grad_sum, grads),
                loss_sum + loss,
                jax.tree.map(jnp.add, parts_sum, parts),
                amax_max,
            ), None

        zeros = jax.tree.map(jnp.zeros_like, state["params"])
        # which parts the loss reports (none, or the MoE aux loss): from its shapes, traced only
        part_shapes = jax.eval_shape(
            lambda p, b, t: self.loss(p, b, key, bf16_scope, t),
            state["params"],
            jax.tree.map(lambda a: a[0], batch_AxBxT1),
            teacher,
        )[1][1]
        no_parts = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), part_shapes)
        no_amax = {n: jnp.zeros((), jnp.float32) for n in self.quantized}
        (grad_sum, loss_sum, parts_sum, amax_now), _ = jax.lax.scan(
            micro, (zeros, jnp.zeros((), jnp.float32), no_parts, no_amax), (jnp.arange(self.grad_accum), batch_AxBxT1)
        )
        grads = jax.tree.map(lambda g: g / self.grad_accum, grad_sum)
        loss = loss_sum / self.grad_accum
        grad_norm = optax.global_norm(grads)
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], state["params"])
        new_state = {
            "params": optax.apply_updates(state["params"], updates),
            "opt_state": opt_state,
            "amax": {n: jnp.roll(h, 1).at[0].set(amax_now[n]) for n, h in state["amax"].items()},
            "step": state["step"] + 1,
        }
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        parts = {n: total / self.grad_accum for n, total in parts_sum.items()}
        return new_state, {"loss": loss, **parts, "grad_norm": grad_norm, "finite": finite}

    def eval_metrics(self, params, batch: Batch, bf16_scope: str = "none", teacher: Any = None) -> dict[str, jax.Array]:
        """The recipe's forward (no gradient, so no stochastic rounding) on held-out rows (their
        weighted predictions, as training's): {"loss": the training loss}; a distillation run:
        {"loss": the next-token cross-entropy (comparable with any run's), "kl": the KL to the
        teacher}."""
        loss, (_, parts) = self.loss(params, batch, jax.random.key(0), bf16_scope, teacher)
        if self.distill is None:
            return {"loss": loss}
        return {"loss": parts["ce"], "kl": parts["kl"]}


def make_optimizer(
    schedule: Callable[[int], float], *, weight_decay: float, beta1: float, beta2: float, eps: float, clip_norm: float
) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW (decay on matrices only, not on norms or biases)."""
    return optax.chain(
        optax.clip_by_global_norm(clip_norm),
        optax.adamw(
            schedule,
            b1=beta1,
            b2=beta2,
            eps=eps,
            weight_decay=weight_decay,
            mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params),
        ),
    )


def make_schedule(
    kind: str, *, lr: float, steps: int, warmup_steps: int, min_lr_ratio: float, decay_fraction: float
) -> optax.Schedule:
    """Linear warmup, then cosine to lr*min_lr_ratio, or WSD (stable, then linear decay)."""
    warmup = min(warmup_steps, max(steps - 1, 0))
    end = lr * min_lr_ratio
    if kind == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, lr, max(warmup, 1), max(steps, warmup + 2), end_value=end)
    decay = max(1, int(round(steps * decay_fraction)))
    stable = max(0, steps - warmup - decay)
    return optax.join_schedules(
        [
            optax.linear_schedule(0.0, lr, max(warmup, 1)),
            optax.constant_schedule(lr),
            optax.linear_schedule(lr, end, decay),
        ],
        [max(warmup, 1), max(warmup, 1) + stable],
    )


def training_loss(
    model: Any,
    batch: Batch,
    seam: Seam,
    distill: Distillation | None = None,
    teacher: Any = None,
    normalizer: jax.Array | None = None,
) -> tuple[jax.Array, dict, dict]:
    """The loss the optimizer minimizes on `batch`'s rows [B, T+1] (tokens 0..T-1 predict 1..T,
    each document of a packed row run as if alone): the next-token cross-entropy averaged over
    the predictions `batch.targets_weight()` counts (all of them when it is None: then exactly
    the plain mean), or with `distill` the distillation loss against the teacher whose
    parameters are `teacher` (`Distillation.loss`); plus, for an MoE model,
    `router_aux_loss_coef` x the routers' load-balancing loss (transformers' model loss with
    `output_router_logits=True`) over the rows' real tokens (padding, segment 0, does not count),
    from the router logits the model returns as side results. `normalizer`: what the weighted
    sums are divided by (default: their count, at least 1, so a row with no weighted prediction
    gives 0, not NaN); a step of several micro-batches passes the step's count / A.

    Returns (loss, parts, records): parts holds "aux_loss" (the unweighted load-balancing loss) for
    an MoE model, "kl" and "ce" (`Distillation.terms`) for distillation; records are the seam's
    (training's: the quantized layers' input amax by name).
    """
    config = model.config
    inputs_BxT, targets_BxT = batch.tokens[:, :-1], batch.tokens[:, 1:]
    segments_BxT = None if batch.segments is None else batch.segments[:, :-1]
    weight_BxT = batch.targets_weight()
    if weight_BxT is not None and normalizer is None:
        normalizer = weighted_count(weight_BxT)
    if distill is None:
        logits, side = forward_side(model, inputs_BxT, segment_ids_BxT=segments_BxT, seam=seam)
        loss, parts = cross_entropy(logits, targets_BxT, weight_BxT, normalizer), {}
    else:
        parts, side = distill.terms(model, teacher, inputs_BxT, targets_BxT, seam, segments_BxT, weight_BxT, normalizer)
        loss = distill.loss(parts)
    experts = config.family_spec.experts(config)
    if experts is None:
        return loss, parts, side.records
    tokens_BxT = None if segments_BxT is None else segments_BxT != 0
    aux = load_balancing_loss(list(side.router_logits.values()), experts.num_experts_per_tok, tokens_BxT)
    return loss + experts.router_aux_loss_coef * aux, {**parts, "aux_loss": aux}, side.records


def cross_entropy(
    logits_BxTxV: jax.Array,
    targets_BxT: jax.Array,
    weight_BxT: jax.Array | None = None,
    normalizer: jax.Array | None = None,
) -> jax.Array:
    """Mean next-token cross-entropy (nats), computed in fp32; with `weight_BxT` (bool) the sum
    over the weighted predictions / `normalizer` (default: their count, at least 1). An
    unweighted target is read as token 0 and its term is 0, so neither its id nor its logits
    reach the loss or the gradient."""
    logits = logits_BxTxV.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    if weight_BxT is None:
        target_logit = jnp.take_along_axis(logits, targets_BxT[..., None], axis=-1)[..., 0]
        return jnp.mean(log_z - target_logit)
    targets_BxT = jnp.where(weight_BxT, targets_BxT, 0)
    target_logit = jnp.take_along_axis(logits, targets_BxT[..., None], axis=-1)[..., 0]
    normalizer = weighted_count(weight_BxT) if normalizer is None else normalizer
    return jnp.sum(jnp.where(weight_BxT, log_z - target_logit, 0.0)) / normalizer


def weighted_count(weight: jax.Array) -> jax.Array:
    """How many predictions `weight` (bool, any shape) counts, as fp32, at least 1 (the divisor of
    a weighted mean: a batch with none gives a zero loss, not NaN)."""
    return jnp.maximum(jnp.sum(weight, dtype=jnp.float32), 1.0)


def linear_weight(model: Any, name: str) -> jax.Array:
    """The weight [N, K] of the linear called `name` ("model.layers.3.mlp.up_proj", "lm_head")."""
    node = model
    for part in name.removeprefix("model.").split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node.weight[...]
