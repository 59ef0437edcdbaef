"""Which predictions the training loss counts (`Batch.targets_weight`): packed documents, padding
and loss marks. A plain `Batch(tokens)` takes today's path bit for bit; a packed row's loss is the
token-weighted mean of its documents' losses alone; padding and unweighted targets move neither
the loss nor the gradient; loss marks drop exactly their targets (a numpy oracle); a step of
micro-batches weights them by their counted predictions; a row with nothing to count stays finite.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nvfp4tool.corpus.batch import Batch
from nvfp4tool.corpus.sources import embedded_corpus
from nvfp4tool.model import forward
from nvfp4tool.model.linear import Seam, default_linear
from nvfp4tool.model.transformer import forward_side
from nvfp4tool.recipes.precision import RecipeConfig
from nvfp4tool.run.records import RunRecord
from nvfp4tool.train.moe_loss import load_balancing_loss
from nvfp4tool.train.step import StepFns, cross_entropy, training_loss

from fixtures.step_fixtures import step_fns as tiny_step_fns
from fixtures.step_fixtures import tiny_dense, tiny_moe
from fixtures.train_fixtures import run_train

VOCAB = 64
NARROW = dict(hidden_size=32, head_dim=8, intermediate_size=48)
MOE = tiny_moe(VOCAB, 32, num_heads=4, num_kv_heads=2, moe_intermediate_size=16, **NARROW)  # layer 0 dense, 1 sparse
DENSE = tiny_dense(VOCAB, 32, num_layers=2, **NARROW)
EXPERTS = MOE.family_spec.experts(MOE)  # its Experts record (num_experts_per_tok, router_aux_loss_coef)


def step_fns(config, grad_accum: int = 1, optimizer=None, remat: str = "none") -> tuple[StepFns, dict]:
    """The bf16 recipe's step functions of a random fp32 model, and its parameters."""
    fns, params = tiny_step_fns(
        config,
        RecipeConfig(name="bf16"),
        optimizer=optimizer or optax.sgd(1.0),
        grad_accum=grad_accum,
        remat=remat,
        compute_dtype=None,
    )
    return fns, jax.tree.map(lambda p: p * 20.0 if p.ndim == 2 else p, params)  # visible logits


def packed(lengths: list[int], T: int, seed: int = 0) -> Batch:
    """One row of T + 1 tokens packing documents of `lengths`, then padding (segment 0)."""
    tokens = np.random.default_rng(seed).integers(3, VOCAB, (1, T + 1))
    segments = np.zeros(tokens.shape, np.int32)
    starts = np.cumsum([0, *lengths])
    for d, (start, end) in enumerate(zip(starts[:-1], starts[1:])):
        segments[0, start:end] = d + 1
    return Batch(tokens, segments)


def loss_and_grads(fns: StepFns, params, batch: Batch, *, recipe: bool = False):
    """(loss, parts, gradient) of `training_loss` with fp32 GEMMs (`recipe`: the step's seam)."""

    def plain(params, batch):
        loss, parts, _ = training_loss(nnx.merge(fns.graphdef, params), batch, Seam.of(default_linear))
        return loss, parts

    def stepped(params, batch):
        loss, (_, parts) = fns.loss(params, batch, jax.random.key(0))
        return loss, parts

    (loss, parts), grads = jax.jit(jax.value_and_grad(stepped if recipe else plain, has_aux=True))(params, batch)
    return loss, parts, grads


def test_a_plain_batch_takes_todays_path_bit_for_bit():
    """`Batch(tokens)` (no segments, no marks): the loss and gradient of the code path every earlier
    run trained with (causal forward, plain mean cross-entropy + the unmasked aux loss)."""
    fns, params = step_fns(MOE)
    tokens = np.random.default_rng(1).integers(0, VOCAB, (2, 17))

    def todays(params, tokens):
        model = nnx.merge(fns.graphdef, params)
        seam = Seam.of(default_linear)
        logits, side = forward_side(model, tokens[:, :-1], seam=seam)
        aux = load_balancing_loss(list(side.router_logits.values()), EXPERTS.num_experts_per_tok)
        return cross_entropy(logits, tokens[:, 1:]) + EXPERTS.router_aux_loss_coef * aux

    def ours(params, tokens):
        model = nnx.merge(fns.graphdef, params)
        return training_loss(model, Batch(tokens), Seam.of(default_linear))[0]

    want = jax.jit(jax.value_and_grad(todays))(params, tokens)
    got = jax.jit(jax.value_and_grad(ours))(params, tokens)
    jax.tree.map(np.testing.assert_array_equal, got, want)


def test_a_packed_row_loss_is_the_weighted_mean_of_its_documents_alone():
    """Documents of 6, 9 and 5 tokens and 4 of padding: the cross-boundary predictions (the last
    token of a document predicting the next one's first) and those into or from padding count
    nowhere, so the loss is sum((L - 1) x loss alone) / sum(L - 1) over the documents run alone."""
    fns, params = step_fns(DENSE)
    lengths = [6, 9, 5]
    batch = packed(lengths, 23)
    loss, _, _ = loss_and_grads(fns, params, batch)
    starts = np.cumsum([0, *lengths])
    alone = [
        float(loss_and_grads(fns, params, Batch(batch.tokens[:, s:e]))[0]) for s, e in zip(starts[:-1], starts[1:])
    ]
    want = sum((n - 1) * x for n, x in zip(lengths, alone)) / sum(n - 1 for n in lengths)
    np.testing.assert_allclose(float(loss), want, rtol=2e-6)


def test_padding_moves_neither_the_loss_nor_the_gradient():
    """MoE (the aux loss counts real tokens only): other ids in the padding slots, inputs and
    targets alike, leave the loss, its parts and every gradient bit for bit."""
    fns, params = step_fns(MOE)
    batch = packed([7, 6], 17)
    other = batch._replace(tokens=np.where(batch.segments == 0, (batch.tokens + 11) % VOCAB, batch.tokens))
    assert (other.tokens != batch.tokens).sum() == 5
    jax.tree.map(np.testing.assert_array_equal, loss_and_grads(fns, params, other), loss_and_grads(fns, params, batch))


def test_remat_recomputes_packed_rows_to_the_same_loss_and_gradient():
    """MoE, a packed row with padding: remat block / full (the mask and segment ids are inputs of
    each checkpointed block) give no remat's loss, aux loss and gradient bit for bit (fp32)."""
    batch = packed([7, 6], 17)
    fns, params = step_fns(MOE)
    want = loss_and_grads(fns, params, batch)
    for remat in ("block", "full"):
        got = loss_and_grads(step_fns(MOE, remat=remat)[0], params, batch)
        jax.tree.map(np.testing.assert_array_equal, got, want)


def test_unweighted_predictions_get_no_loss_and_no_gradient():
    """`cross_entropy` under `Batch.targets_weight()`: the logits of a prediction across a boundary,
    into padding or onto an unmarked target get a zero gradient, and other target ids there change
    nothing."""
    segments = np.asarray([[1, 1, 1, 2, 2, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1]])
    marks = np.asarray([[1, 1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 1, 1, 1, 1]], bool)
    tokens = np.random.default_rng(2).integers(0, VOCAB, segments.shape)
    weight = Batch(tokens, segments, marks).targets_weight()
    assert weight.tolist() == [
        [True, True, False, True, True, True, False, False],
        [True, True, False, False, True, True, True, True],
    ]
    logits = jnp.asarray(np.random.default_rng(3).normal(0, 2, (2, 8, VOCAB)), jnp.float32)
    grad_fn = jax.jit(jax.value_and_grad(cross_entropy))
    loss, grads = grad_fn(logits, jnp.asarray(tokens[:, 1:]), jnp.asarray(weight))
    np.testing.assert_array_equal(np.abs(np.asarray(grads)).sum(-1) > 0, weight)
    other = np.where(weight, tokens[:, 1:], (tokens[:, 1:] + 5) % VOCAB)
    jax.tree.map(np.testing.assert_array_equal, grad_fn(logits, jnp.asarray(other), jnp.asarray(weight)), (loss, grads))


def test_loss_marks_drop_exactly_their_targets():
    """A `loss` array without segments: the mean of the marked targets' cross-entropy (a numpy
    oracle on the plain forward's logits); all marked is the plain mean."""
    fns, params = step_fns(DENSE)
    tokens = np.random.default_rng(4).integers(0, VOCAB, (2, 13))
    marks = np.random.default_rng(5).random(tokens.shape) < 0.5
    logits = np.asarray(forward(nnx.merge(fns.graphdef, params), tokens[:, :-1]), np.float64)
    log_p = logits - logits.max(-1, keepdims=True)
    log_p = log_p - np.log(np.exp(log_p).sum(-1, keepdims=True))
    per_target = -np.take_along_axis(log_p, tokens[:, 1:, None], -1)[..., 0]
    loss = float(loss_and_grads(fns, params, Batch(tokens, loss=marks))[0])
    np.testing.assert_allclose(loss, per_target[marks[:, 1:]].mean(), rtol=2e-6)
    every = float(loss_and_grads(fns, params, Batch(tokens, loss=np.ones_like(marks)))[0])
    np.testing.assert_allclose(every, per_target.mean(), rtol=2e-6)


@pytest.mark.parametrize("empty", ["padding row", "nothing marked"])
def test_a_row_with_nothing_to_count_gives_finite_values(empty):
    """MoE: a row of padding only next to a packed one, or a batch whose every prediction is
    unmarked: finite loss and gradient (no 0 / 0), and no loss at all when nothing counts."""
    fns, params = step_fns(MOE)
    row = packed([9, 8], 17)
    if empty == "padding row":
        batch = Batch(np.concatenate([row.tokens, row.tokens]), np.concatenate([row.segments, 0 * row.segments]))
    else:
        batch = Batch(row.tokens, row.segments, np.zeros(row.tokens.shape, bool))
    loss, parts, grads = loss_and_grads(fns, params, batch)
    assert np.isfinite(float(loss)) and np.isfinite(float(parts["aux_loss"]))
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    if empty == "nothing marked":
        assert float(loss) == np.float32(EXPERTS.router_aux_loss_coef) * np.float32(parts["aux_loss"])


def test_micro_batches_are_weighted_by_their_counted_predictions():
    """grad_accum=2 over rows with 17 and 5 counted predictions: the step's loss and gradient (SGD
    with lr 1: the update is minus the gradient) are those of the two rows as one batch, not the
    mean of the two rows' means."""
    fns, params = step_fns(DENSE, grad_accum=2)
    one, two = packed([10, 9], 20, seed=6), packed([3, 4], 20, seed=7)
    assert [int(b.targets_weight().sum()) for b in (one, two)] == [17, 5]
    whole = Batch(np.concatenate([one.tokens, two.tokens]), np.concatenate([one.segments, two.segments]))
    state = fns.init_state(params, amax_history=1)
    micro = Batch(whole.tokens.reshape(2, 1, -1), whole.segments.reshape(2, 1, -1))
    new_state, metrics = jax.jit(fns.train_step)(state, micro, jax.random.key(0))
    loss, _, grads = loss_and_grads(fns, params, whole, recipe=True)
    np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=2e-6)
    # the bf16 recipe rounds activation gradients to bf16: the update agrees to ~2e-3 of its size
    # (seen: 1.7e-3); the mean of the two rows' gradients is ~0.5 of it away
    update = np.concatenate(
        [np.ravel(p - new) for p, new in zip(jax.tree.leaves(params), jax.tree.leaves(new_state["params"]))]
    )
    flat = np.concatenate([np.ravel(g) for g in jax.tree.leaves(grads)])
    assert np.linalg.norm(update - flat) < 1e-2 * np.linalg.norm(flat)
    halves = [loss_and_grads(fns, params, b, recipe=True) for b in (one, two)]
    mean_of_means = np.concatenate([np.ravel((a + b) / 2) for a, b in zip(*(jax.tree.leaves(h[2]) for h in halves))])
    assert np.linalg.norm(update - mean_of_means) > 0.1 * np.linalg.norm(flat)
    assert abs(float(metrics["loss"]) - np.mean([float(h[0]) for h in halves])) > 1e-3  # the mean of means


def test_the_trainer_hands_the_segments_to_the_step(tmp_path, corpus_tokenizer):
    """`packing=segmented` over the embedded corpus cut into its speeches (JSONL, one document
    each: a few per 33-token window) reads the same windows as concat, with segment ids: the first
    step's loss and the eval loss (before any update: the same weights) differ, so the segments
    reach the train and eval steps."""
    data = {}
    for name, text in zip(("train", "val"), (p.read_text(encoding="utf-8") for p in embedded_corpus())):
        data[name] = tmp_path / f"{name}.jsonl"
        speeches = [s for s in text.split("\n\n") if s.strip()]
        data[name].write_text("".join(json.dumps({"text": s}) + "\n" for s in speeches), encoding="utf-8")
    runs = {
        packing: run_train(
            corpus_tokenizer,
            tmp_path / packing,
            steps=1,
            eval_every=1,
            packing=packing,
            data=data["train"],
            eval_data=data["val"],
        )
        for packing in ("concat", "segmented")
    }
    concat, segmented = runs["concat"], runs["segmented"]
    assert RunRecord.read(tmp_path / "segmented").packing == "segmented"
    assert np.isfinite(segmented.losses[1]) and segmented.losses[1] != concat.losses[1]
    assert abs(segmented.losses[1] - concat.losses[1]) < 0.1 * concat.losses[1]  # the same windows
    assert segmented.eval_losses[1] != concat.eval_losses[1]
