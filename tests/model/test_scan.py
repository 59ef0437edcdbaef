"""Scanned layers in training (`scan_layers=true`, `model.transformer.layer_runs`): one optimizer step
equals the unrolled program's bit for bit (loss, MoE aux loss, input amax, gradient norm, updated
parameters and optimizer state), with runs of dense and of sparse layers, a layer kept in BF16
that splits a run, the step's quantize-once weights and SR keys scanned in, and under remat; the
scanned program traces one block per run; a resume that changes scan_layers is refused (the key
changes the compiled program: see test_train_safety)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nvfp4tool.corpus.batch import Batch
from nvfp4tool.model.linear import Seam
from nvfp4tool.model.transformer import layer_runs
from nvfp4tool.recipes.precision import precision_map, training_seam
from nvfp4tool.run.config import scans_layers

from fixtures.step_fixtures import (
    adamw,
    assert_trees_equal,
    in_exact_bf16_child,
    recipe,
    step_fns,
    step_state,
    tiny_moe,
)

VOCAB = 256
# layers 0-1 dense, 2-4 sparse (4 experts, top-2); the last layer stays BF16: runs [0, 1], [2, 3], [4]
CONFIG = tiny_moe(VOCAB, 64, num_layers=5, dense_layers=(0, 1))
RECIPE = recipe("nvfp4", bf16_last_layers=1)


def _step(scan: bool, remat: str):
    fns, state = step_state(CONFIG, RECIPE, grad_accum=2, remat=remat, scan=scan)
    windows = np.random.default_rng(0).integers(0, VOCAB, (2, 2, 33))
    new_state, metrics = jax.jit(fns.train_step)(state, Batch(windows), jax.random.key(7))
    return jax.tree.map(np.asarray, {"state": new_state, "metrics": metrics})


def same_as_unrolled() -> None:
    """Run in a process where XLA keeps every BF16 rounding (see the test)."""
    jax.config.update("jax_default_matmul_precision", "highest")  # as conftest.py
    reference = _step(False, "none")
    assert float(reference["metrics"]["aux_loss"]) > 0 and reference["metrics"]["finite"]
    for remat in ("none", "block"):
        assert_trees_equal(_step(True, remat), reference, f"scanned, remat={remat}")


@pytest.mark.slow  # one child process, three compiles of a 5-layer step
def test_scanned_step_equals_the_unrolled_step_bit_for_bit():
    """Bit-exact with `--xla_allow_excess_precision=false` only, as test_remat: by default XLA may
    skip a BF16 rounding inside a fusion, and a scan body fuses differently from the unrolled
    layers, so the check runs in its own process with the flag off."""
    in_exact_bf16_child(__file__, "same_as_unrolled")


def test_runs_follow_the_kinds_and_the_precisions():
    seam = training_seam(RECIPE, precision_map(RECIPE, CONFIG), CONFIG, jax.random.key(0))
    assert layer_runs(CONFIG, seam, scan=True) == [
        ("attention+mlp", [0, 1]),
        ("attention+moe", [2, 3]),
        ("attention+moe", [4]),
    ]
    assert layer_runs(CONFIG, Seam(), scan=True) == [("attention+mlp", [0, 1]), ("attention+moe", [2, 3, 4])]
    # the aux's structure carries each linear's precision: alike within a run, BF16 absent
    assert jax.tree.structure(seam.aux_of(2)) == jax.tree.structure(seam.aux_of(3))
    assert seam.aux_of(4) == {} and set(seam.aux_of(0)) == {"nvfp4"}


@pytest.mark.slow  # > 15 s of the inner loop (tests/durations.json)
def test_the_scanned_program_traces_one_block_per_run():
    """What makes compile time flat in depth: the step's jaxpr holds the GEMMs of one block per run
    (forward and backward), so their count does not grow with the number of layers scanned, while
    the unrolled one grows with each layer. (The per-layer work outside the blocks, the weights
    quantized once per step and the optimizer's update, stays per layer; so does the MoE
    load-balancing loss, 3 einsums per sparse layer.)"""

    def equations(num_layers: int, scan: bool) -> int:
        config = dataclasses.replace(CONFIG, num_layers=num_layers)
        fns, params = step_fns(
            config, recipe("nvfp4"), optimizer=adamw(1e-3, weight_decay=0.0), scan=scan, abstract=True
        )
        state = jax.eval_shape(lambda p: fns.init_state(p, 1), params)
        jaxpr = jax.make_jaxpr(fns.train_step)(
            state, Batch(jax.ShapeDtypeStruct((1, 2, 17), jnp.int32)), jax.random.key(0)
        )
        return str(jaxpr).count("dot_general")

    unrolled = [equations(n, False) for n in (4, 8)]
    scanned = [equations(n, True) for n in (4, 8)]
    assert unrolled[1] > 1.5 * unrolled[0], unrolled  # 4 more sparse layers' GEMMs
    assert scanned[1] - scanned[0] == 3 * 4 and scanned[0] < unrolled[0], (scanned, unrolled)


@pytest.mark.parametrize(
    "choice, layers, scans",
    [("auto", 11, False), ("auto", 12, True), ("auto", 30, True), ("true", 4, True), ("false", 30, False)],
)
def test_scan_layers_auto_scans_deep_models(choice, layers, scans):
    """`scan_layers=auto` scans from 12 layers (docs/benchmarks/train-step.md: below, a scanned step's slowdown
    outweighs its shorter compile)."""
    assert scans_layers(choice, layers) is scans
