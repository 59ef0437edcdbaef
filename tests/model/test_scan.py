"""Scanned layers in training (`scan_layers=true`, `model.transformer.layer_runs`): one optimizer step
equals the unrolled program's bit for bit (loss, MoE aux loss, input amax, gradient norm, updated
parameters and optimizer state), with runs of dense and of sparse layers, a layer kept in BF16
that splits a run, the step's quantize-once weights and SR keys scanned in, and under remat; the
scanned program traces one block per run; a resume that changes scan_layers is refused (the key
changes the compiled program: see test_train_safety)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nvfp4tool.corpus.batch import Batch
from nvfp4tool.model import CausalLM
from nvfp4tool.model.linear import Seam
from nvfp4tool.model.transformer import layer_runs
from nvfp4tool.recipes.precision import RecipeConfig, precision_map, training_seam
from nvfp4tool.run.config import scans_layers
from nvfp4tool.train.presets import preset_config
from nvfp4tool.train.step import StepFns, make_optimizer

from fixtures import REPO_ROOT

REPO = Path(REPO_ROOT)
VOCAB = 256
_TINY_MOE = preset_config("tiny-moe", VOCAB, 64)
# layers 0-1 dense, 2-4 sparse (4 experts, top-2); the last layer stays BF16: runs [0, 1], [2, 3], [4]
CONFIG = dataclasses.replace(
    _TINY_MOE,
    hidden_size=64,
    num_layers=5,
    head_dim=16,
    intermediate_size=128,
    family_config=dataclasses.replace(
        _TINY_MOE.experts, moe_intermediate_size=32, num_experts=4, mlp_only_layers=(0, 1)
    ),
)
RECIPE = RecipeConfig(name="nvfp4", bf16_first_layers=0, bf16_last_layers=1)


def _step(scan: bool, remat: str):
    model = CausalLM(
        CONFIG, param_dtype=jnp.float32, compute_dtype=jnp.bfloat16, remat=remat, scan_layers=scan, rngs=nnx.Rngs(0)
    )
    graphdef, params = nnx.split(model)
    optimizer = make_optimizer(lambda step: 1e-2, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8, clip_norm=1.0)
    fns = StepFns(graphdef, RECIPE, precision_map(RECIPE, CONFIG), optimizer, grad_accum=2)
    state = fns.init_state(params.to_pure_dict(), amax_history=2)
    windows = np.random.default_rng(0).integers(0, VOCAB, (2, 2, 33))
    new_state, metrics = jax.jit(fns.train_step)(state, Batch(windows), jax.random.key(7))
    return jax.tree.map(np.asarray, {"state": new_state, "metrics": metrics})


def same_as_unrolled() -> None:
    """Run in a process where XLA keeps every BF16 rounding (see the test)."""
    jax.config.update("jax_default_matmul_precision", "highest")  # as conftest.py
    reference = _step(False, "none")
    assert float(reference["metrics"]["aux_loss"]) > 0 and reference["metrics"]["finite"]
    for remat in ("none", "block"):
        got = _step(True, remat)
        assert jax.tree.structure(got) == jax.tree.structure(reference)
        for (path, want), have in zip(jax.tree_util.tree_leaves_with_path(reference), jax.tree.leaves(got)):
            np.testing.assert_array_equal(have, want, err_msg=f"scanned, remat={remat} {jax.tree_util.keystr(path)}")


@pytest.mark.slow  # one child process, three compiles of a 5-layer step
def test_scanned_step_equals_the_unrolled_step_bit_for_bit():
    """Bit-exact with `--xla_allow_excess_precision=false` only, as test_remat: by default XLA may
    skip a BF16 rounding inside a fusion, and a scan body fuses differently from the unrolled
    layers, so the check runs in its own process with the flag off."""
    env = dict(
        os.environ,
        XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_allow_excess_precision=false",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(REPO),
    )
    code = "import sys; sys.path[:0] = ['tests', 'tests/model']; import test_scan; test_scan.same_as_unrolled()"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]


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
        model = nnx.eval_shape(lambda: CausalLM(config, compute_dtype=jnp.bfloat16, scan_layers=scan))
        graphdef, params = nnx.split(model)
        recipe = RecipeConfig(name="nvfp4", bf16_first_layers=0, bf16_last_layers=0)
        optimizer = make_optimizer(lambda step: 1e-3, weight_decay=0.0, beta1=0.9, beta2=0.95, eps=1e-8, clip_norm=1.0)
        fns = StepFns(graphdef, recipe, precision_map(recipe, config), optimizer, grad_accum=1)
        state = jax.eval_shape(lambda p: fns.init_state(p, 1), params.to_pure_dict())
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
