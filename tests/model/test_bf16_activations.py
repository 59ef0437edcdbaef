"""BF16 activations: with compute_dtype bf16, what the training loss's backward pass keeps from the
forward pass is bf16 (or integer / bool), except an explicit allow-list of fp32 tensors kept on
purpose. Traced, not compiled (`jax.ad_checkpoint.print_saved_residuals`: each residual's type
and the op and function that made it), at a size where every activation-sized residual
(>= B*T*E elements) is larger than any weight of the model. Measured here (remat none, either
recipe): 29-30 MiB kept, of it fp32: XLA attention's scores 8 MiB, the norms' fp32 x 2.25 MiB, the
loss's softmax 0.5 MiB.
"""

from __future__ import annotations

import contextlib
import io
import math
import re

import jax
import jax.numpy as jnp
import pytest

from nvfp4tool.corpus.batch import Batch
from nvfp4tool.train.presets import preset_config

from fixtures.step_fixtures import recipe, step_state

VOCAB = 256
B, T, E = 4, 128, 128  # the tiny preset's width; B*T*E = 65536 > its largest weight (384 x 128)
NARROW = ("bf16", "bool", "i8", "u8", "i32", "u32")  # short dtype names of print_saved_residuals
# function that made an fp32 activation-sized residual -> why it is kept in fp32
FP32_KEPT = {
    "attend": "XLA attention (the CPU path): jax computes the [B, H, T, S] scores and softmax in fp32 "
    "and keeps them; cuDNN's flash kernel on a GPU keeps only [B, H, T] softmax statistics",
    "cross_entropy": "the loss: log-softmax over the vocabulary in fp32, one [B, T, V] tensor",
    "RMSNorm.__call__": "the fp32 copy of x its gradient uses (one [B, T, E] per norm). Recomputing it "
    "in the backward pass (jax.checkpoint around the fp32 normalisation) keeps the "
    "loss bit-identical but not the gradients under XLA's default excess precision "
    "(equal only with --xla_allow_excess_precision=false), so it stays",
}
_RESIDUAL = re.compile(r"^(\S+?)\[([\d,]*)\] (.*)$")
_PRODUCER = re.compile(r"\((\S+)\)$")  # "... from path:line:col (RMSNorm.__call__)": its function


def saved_residuals(fn, *args) -> list[tuple[str, tuple[int, ...], str]]:
    """(short dtype, shape, where it comes from) of every residual `jax.vjp(fn, *args)` keeps."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        jax.ad_checkpoint.print_saved_residuals(fn, *args)
    residuals = []
    for line in printed.getvalue().splitlines():
        dtype, shape, source = _RESIDUAL.match(line).groups()
        residuals.append((dtype, tuple(int(n) for n in shape.split(",") if n), source))
    return residuals


@pytest.mark.parametrize("recipe_name", ["bf16", "nvfp4"])
def test_backward_keeps_bf16_activations(recipe_name):
    fns, state = step_state(preset_config("tiny", VOCAB, T), recipe(recipe_name))
    windows = jnp.zeros((B, T + 1), jnp.int32)
    residuals = saved_residuals(lambda p: fns.loss(p, Batch(windows), jax.random.key(0))[0], state["params"])
    large = [r for r in residuals if math.prod(r[1]) >= B * T * E]
    wide = [r for r in large if r[0] not in NARROW]
    unexplained = [r for r in wide if _producer(r[2]) not in FP32_KEPT]
    assert len(large) > 20 and not unexplained, "\n".join(map(str, unexplained))


def _producer(source: str) -> str:
    match = _PRODUCER.search(source)
    return match.group(1) if match else source
