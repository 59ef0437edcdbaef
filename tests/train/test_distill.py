"""The distillation loss (`nvfp4tool.train.distill`): the vocabulary-chunked KL / CE equal the
direct formula on whole logits (numpy), for chunk sizes that divide the vocabulary, that do not, and
that exceed it, at temperatures != 1; their gradients equal jax.grad of the direct formula; a model
against itself has KL 0."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nvfp4tool.train.distill import chunked_terms

N, E, V = 12, 8, 37


def _head(h, w):
    return jnp.dot(h, w.T, precision="highest")


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(N, E)).astype(np.float32),
        rng.normal(size=(V, E)).astype(np.float32),
        rng.normal(size=(N, E)).astype(np.float32),
        rng.normal(size=(V, E)).astype(np.float32),
        rng.integers(0, V, size=N),
    )


def _log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _numpy_terms(hs, ws, ht, wt, targets, temperature):
    zs, zt = hs.astype(np.float64) @ ws.T, ht.astype(np.float64) @ wt.T
    log_ps, log_pt = _log_softmax(zs / temperature), _log_softmax(zt / temperature)
    kl = np.mean(np.sum(np.exp(log_pt) * (log_pt - log_ps), -1))
    ce = -np.mean(_log_softmax(zs)[np.arange(len(targets)), targets])
    return kl, ce


def _direct_loss(hs, ws, ht, wt, targets, temperature, weight):
    """The same loss on whole logits, in jnp (what jax.grad differentiates)."""
    zs, zt = _head(hs, ws), _head(ht, wt)
    log_ps, log_pt = jax.nn.log_softmax(zs / temperature), jax.nn.log_softmax(zt / temperature)
    kl = jnp.mean(jnp.sum(jnp.exp(log_pt) * (log_pt - log_ps), -1))
    ce = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(zs), targets[:, None], -1))
    return weight * temperature**2 * kl + (1 - weight) * ce


def _chunked_loss(hs, ws, ht, wt, targets, temperature, weight, chunk):
    terms = chunked_terms(
        hs, ws, ht, wt, targets, temperature=temperature, chunk=chunk, student_head=_head, teacher_head=_head
    )
    return weight * temperature**2 * terms["kl"] + (1 - weight) * terms["ce"]


@pytest.mark.parametrize("chunk", [1, 5, 8, 37, 64])
@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_chunked_terms_equal_the_direct_formula(chunk, temperature):
    hs, ws, ht, wt, targets = _inputs()
    terms = chunked_terms(
        *map(jnp.asarray, (hs, ws, ht, wt, targets)),
        temperature=temperature,
        chunk=chunk,
        student_head=_head,
        teacher_head=_head,
    )
    kl, ce = _numpy_terms(hs, ws, ht, wt, targets, temperature)
    assert kl > 0.1
    np.testing.assert_allclose(float(terms["kl"]), kl, rtol=1e-5)
    np.testing.assert_allclose(float(terms["ce"]), ce, rtol=1e-5)


@pytest.mark.parametrize("chunk,temperature,weight", [(5, 2.0, 1.0), (8, 0.7, 0.3), (37, 1.0, 0.0)])
def test_chunked_gradient_equals_jax_grad_of_the_direct_formula(chunk, temperature, weight):
    hs, ws, ht, wt, targets = map(jnp.asarray, _inputs(1))
    chunked = jax.grad(_chunked_loss, argnums=(0, 1))(hs, ws, ht, wt, targets, temperature, weight, chunk)
    direct = jax.grad(_direct_loss, argnums=(0, 1))(hs, ws, ht, wt, targets, temperature, weight)
    for got, want in zip(chunked, direct):
        assert float(jnp.abs(want).max()) > 1e-3
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=1e-6)


def test_kl_of_a_model_against_itself_is_zero():
    hs, ws, _, _, targets = map(jnp.asarray, _inputs(2))
    terms = chunked_terms(hs, ws, hs, ws, targets, temperature=1.5, chunk=7, student_head=_head, teacher_head=_head)
    assert abs(float(terms["kl"])) < 1e-6


def test_weighted_terms_are_the_weighted_tokens_terms():
    """`weight_N` (packed documents, loss marks): the terms of the weighted tokens alone (the
    numpy formula on those rows), whatever the unweighted tokens' target ids (out of the
    vocabulary here); with no weighted token, 0 and a finite gradient."""
    hs, ws, ht, wt, targets = _inputs(3)
    weight = np.arange(N) % 3 != 0
    settings = dict(temperature=1.5, chunk=7, student_head=_head, teacher_head=_head)
    junk = np.where(weight, targets, V + 5)
    terms = chunked_terms(
        *map(jnp.asarray, (hs, ws, ht, wt, junk)),
        weight_N=jnp.asarray(weight),
        normalizer=jnp.float32(weight.sum()),
        **settings,
    )
    kl, ce = _numpy_terms(hs[weight], ws, ht[weight], wt, targets[weight], 1.5)
    np.testing.assert_allclose(float(terms["kl"]), kl, rtol=1e-5)
    np.testing.assert_allclose(float(terms["ce"]), ce, rtol=1e-5)

    def nothing(hs):
        terms = chunked_terms(
            hs, ws, ht, wt, junk, weight_N=jnp.zeros(N, bool), normalizer=jnp.float32(1.0), **settings
        )
        return terms["kl"] + terms["ce"]

    value, grad = jax.value_and_grad(nothing)(jnp.asarray(hs))
    assert float(value) == 0.0 and np.isfinite(np.asarray(grad)).all()


def test_a_target_the_last_chunk_repeats_counts_once():
    """Vocabulary 37 in chunks of 7: the last chunk re-reads rows 30-34 (marked not new); a target
    there is the student's logit once (it was 1e30 when the repeat added the masked value)."""
    hs, ws, ht, wt, _ = _inputs(4)
    targets = np.arange(30, 30 + N) % V
    terms = chunked_terms(
        *map(jnp.asarray, (hs, ws, ht, wt, targets)), temperature=1.0, chunk=7, student_head=_head, teacher_head=_head
    )
    np.testing.assert_allclose(float(terms["ce"]), _numpy_terms(hs, ws, ht, wt, targets, 1.0)[1], rtol=1e-5)
