"""Quantization-aware distillation's loss: the student (trained with the run's recipe) against a
frozen BF16 teacher's next-token distribution, from the two models' final hidden states.

    loss = w * T^2 * KL(p_teacher^T || p_student^T) + (1 - w) * CE(next token)

w = `distill_weight`, T = `temperature`. `chunked_terms` walks the vocabulary in chunks, so neither
model's [tokens, V] logits exist whole.
Design notes: docs/design/training.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nvfp4tool.families import LM_HEAD
from nvfp4tool.model.linear import Seam, Side, default_linear
from nvfp4tool.model.transformer import final_hidden, head_weight

VOCAB_CHUNK = 8192  # LM-head rows per chunk: [tokens, 8192] fp32 blocks
_NEG = -1e30  # a logit that is no candidate (finite, so masked terms stay 0 rather than nan)

# (hidden [N, E], head rows [C, E]) -> fp32 logits [N, C]
Head = Callable[[jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class Distillation:
    """The teacher's structure and the loss settings of one run (its parameters travel separately,
    as an argument of the jitted step, laid out on the training mesh)."""

    teacher_graphdef: Any
    temperature: float
    weight: float  # distill_weight: the KL's share of the loss
    chunk: int = VOCAB_CHUNK

    def terms(
        self,
        student: Any,
        teacher_params: Any,
        inputs_BxT: jax.Array,
        targets_BxT: jax.Array,
        seam: Seam,
        segments_BxT: jax.Array | None = None,
        weight_BxT: jax.Array | None = None,
        normalizer: jax.Array | None = None,
    ) -> tuple[dict[str, jax.Array], Side]:
        """({"kl", "ce"}, the student's side results) of the student (its linears through `seam`)
        against the teacher (plain BF16 GEMMs, no gradient) on `inputs_BxT` predicting `targets_BxT`;
        both models see the packed documents apart (`segments_BxT`), and the terms average over
        the predictions `weight_BxT` counts (`chunked_terms`)."""
        teacher = nnx.merge(self.teacher_graphdef, jax.lax.stop_gradient(teacher_params))
        h_student, side = final_hidden(student, inputs_BxT, seam, segments_BxT)
        h_teacher, _ = final_hidden(teacher, inputs_BxT, Seam.of(default_linear), segments_BxT)
        head = seam.at(None)

        def flat(h):
            return h.reshape(-1, h.shape[-1])

        return chunked_terms(
            flat(h_student),
            head_weight(student),
            flat(h_teacher),
            head_weight(teacher),
            targets_BxT.reshape(-1),
            temperature=self.temperature,
            chunk=self.chunk,
            student_head=lambda h, w: head.project(h, w, None, LM_HEAD)[0].astype(jnp.float32),
            teacher_head=lambda h, w: default_linear(h, w, None, name=LM_HEAD).astype(jnp.float32),
            weight_N=None if weight_BxT is None else weight_BxT.reshape(-1),
            normalizer=normalizer,
        ), side

    def loss(self, terms: dict[str, jax.Array]) -> jax.Array:
        return self.weight * self.temperature**2 * terms["kl"] + (1.0 - self.weight) * terms["ce"]


def chunked_terms(
    h_student_NxE: jax.Array,
    w_student_VxE: jax.Array,
    h_teacher_NxE: jax.Array,
    w_teacher_VxE: jax.Array,
    targets_N: jax.Array,
    *,
    temperature: float,
    chunk: int,
    student_head: Head,
    teacher_head: Head,
    weight_N: jax.Array | None = None,
    normalizer: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """{"kl": mean KL(p_t^T || p_s^T), "ce": mean CE(student logits, targets)} over the N tokens,
    one vocabulary chunk of both heads at a time (see the module docstring); with `weight_N`
    (bool) the sums over the weighted tokens / `normalizer` (`step.training_loss`'s: their count,
    at least 1), an unweighted token's terms 0 (its target read as row 0)."""
    if (weight_N is None) != (normalizer is None):
        raise ValueError("chunked_terms: weight_N and normalizer go together")
    vocab = w_student_VxE.shape[0]
    if w_teacher_VxE.shape[0] != vocab:
        raise ValueError(f"teacher vocabulary {w_teacher_VxE.shape[0]} != student's {vocab}")
    size = min(chunk, vocab)
    count = -(-vocab // size)
    n = h_student_NxE.shape[0]
    inv_t = 1.0 / temperature

    def body(carry, index):
        lse_s, lse_t, cross, lse_1, target_logit = carry
        first = index * size  # the chunk's first new row
        start = jnp.minimum(first, vocab - size)  # the last chunk ends at the vocabulary's end
        rows_C = start + jnp.arange(size)
        new_C = rows_C >= first
        z_s = jnp.where(
            new_C, student_head(h_student_NxE, jax.lax.dynamic_slice_in_dim(w_student_VxE, start, size)), _NEG
        )
        z_t = jnp.where(
            new_C, teacher_head(h_teacher_NxE, jax.lax.dynamic_slice_in_dim(w_teacher_VxE, start, size)), _NEG
        )
        s, t = jnp.where(new_C, z_s * inv_t, _NEG), jnp.where(new_C, z_t * inv_t, _NEG)
        lse_s_new = jnp.logaddexp(lse_s, jax.nn.logsumexp(s, axis=-1))
        lse_t_new = jnp.logaddexp(lse_t, jax.nn.logsumexp(t, axis=-1))
        # sum over the rows so far of p_t (t - s), with p_t normalised by the log-sum-exp so far
        cross = cross * jnp.exp(lse_t - lse_t_new) + jnp.sum(jnp.exp(t - lse_t_new[:, None]) * (t - s), axis=-1)
        lse_1 = jnp.logaddexp(lse_1, jax.nn.logsumexp(z_s, axis=-1))
        # a row the last chunk repeats (new_C False) was counted in its own chunk
        hit_NxC = (rows_C[None, :] == targets_N[:, None]) & new_C[None, :]
        target_logit = target_logit + jnp.sum(jnp.where(hit_NxC, z_s, 0.0), axis=-1)
        return (lse_s_new, lse_t_new, cross, lse_1, target_logit), None

    if weight_N is not None:
        targets_N = jnp.where(weight_N, targets_N, 0)
    empty = jnp.full((n,), _NEG, jnp.float32)
    zero = jnp.zeros((n,), jnp.float32)
    (lse_s, lse_t, cross, lse_1, target_logit), _ = jax.lax.scan(
        jax.checkpoint(body), (empty, empty, zero, empty, zero), jnp.arange(count)
    )
    kl_N, ce_N = cross - lse_t + lse_s, lse_1 - target_logit
    if weight_N is None:
        return {"kl": jnp.mean(kl_N), "ce": jnp.mean(ce_N)}
    return {
        "kl": jnp.sum(jnp.where(weight_N, kl_N, 0.0)) / normalizer,
        "ce": jnp.sum(jnp.where(weight_N, ce_N, 0.0)) / normalizer,
    }
