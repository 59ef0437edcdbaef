"""One explicit GEMM backend, recorded (issue 22 item 4): quantizer / gemm resolved once
(`RecipeConfig.resolved`), printed, written to run.json and to every metrics.jsonl step; gemm=native
refused where it cannot run; a run.json written before the key still reads; the 16x16 dgrad weight
is the fprop one transposed, bit for bit; the weight is quantized once per optimizer step (counted
in the step's jaxpr).
(The native/packed branch on the CPU with the emulated GEMM injected: tests/recipes/test_recipes_dots.py.)"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nvfp4tool.corpus.batch import Batch
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError
from nvfp4tool.numerics import nvfp4_operand, quantize_nvfp4, transpose_2d
from nvfp4tool.recipes.nvfp4_dot import WEIGHT_QUANTIZED
from nvfp4tool.recipes.precision import RecipeConfig
from nvfp4tool.run.config import TrainConfig
from nvfp4tool.run.records import RunRecord
from nvfp4tool.train.metrics import read_metrics

from fixtures.step_fixtures import recipe, step_state, tiny_dense

CPU = {"quantizer": "xla", "gemm": "emulated"}  # what "auto" resolves to here


# ---- resolution, forcing, refusal ---------------------------------------------------------


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's resolution")
def test_auto_resolves_by_the_platform_and_forced_keys_stay():
    assert RecipeConfig(name="nvfp4").resolved().backend() == CPU
    forced = RecipeConfig(name="nvfp4", quantizer="pallas", gemm="emulated").resolved()
    assert forced.backend() == {"quantizer": "pallas", "gemm": "emulated"}
    assert TrainConfig(data="x", recipe="nvfp4", quantizer="pallas").resolved_recipe().backend() == {
        "quantizer": "pallas",
        "gemm": "emulated",
    }
    assert RecipeConfig(name="bf16").resolved().backend() is None  # a recipe without nvfp4 GEMMs
    with pytest.raises(NVFP4ToolError, match="resolve the recipe first"):
        RecipeConfig(name="nvfp4").backend()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="scaled_matmul lowers on a GPU")
def test_gemm_native_is_refused_where_scaled_matmul_does_not_lower():
    config = TrainConfig(data="x", recipe="nvfp4", gemm="native")  # a recorded config stays constructible
    with pytest.raises(
        NVFP4UsageError,
        match=r"^train config: gemm='native': jax.nn.scaled_matmul has no "
        r"lowering on 'cpu'.*use gemm=emulated or gemm=auto$",
    ):
        config.resolved_recipe()
    with pytest.raises(NVFP4UsageError, match="gemm='triton'; choose one of auto, emulated, native"):
        TrainConfig(data="x", gemm="triton")


# ---- the record: run.json, metrics.jsonl, the printed line --------------------------------


def test_a_run_records_and_prints_its_backend(nvfp4_run):
    record = RunRecord.read(nvfp4_run["nvrun"])
    assert record.gemm_backend == CPU and record.train_config().gemm == "auto"
    on = jax.default_backend()
    assert f"nvfp4 GEMMs: quantizer=xla (auto on {on}), gemm=emulated (auto on {on})" in nvfp4_run["log"]
    steps = read_metrics(nvfp4_run["nvrun"])
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:  # the header of each step: step, then the backend it ran
        assert list(r)[:3] == ["step", "quantizer", "gemm"] and {k: r[k] for k in CPU} == CPU


def test_a_run_json_written_before_the_backend_was_recorded_still_reads(nvfp4_run, tmp_path):
    with open(RunRecord.path(nvfp4_run["nvrun"])) as f:
        old = json.load(f)
    del old["gemm_backend"], old["config"]["gemm"]
    with open(tmp_path / "run.json", "w") as f:
        json.dump(old, f)
    record = RunRecord.read(tmp_path)
    assert record.gemm_backend is None and record.train_config().gemm == "auto"
    assert record.train_config() == RunRecord.read(nvfp4_run["nvrun"]).train_config()


# ---- the weight's operands ----------------------------------------------------------------


def test_the_16x16_dgrad_weight_is_the_fprop_one_transposed_bit_for_bit():
    """Quantizing W.T along N with 16x16 tiles gives transpose_2d of W's quantization along K, for
    both operand kinds (the recipe's dgrad operand; global amax shared). The fused Pallas
    quantizers' operands: through the recipe's dgrad in tests/recipes/test_recipes_dots.py."""
    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.standard_normal((32, 64)) * 0.05, jnp.bfloat16)
    amax = jnp.max(jnp.abs(w)).astype(jnp.float32) * 1.5  # a fused group's larger amax

    def fields(q):
        return [np.atleast_1d(np.asarray(v)).view(np.uint8) for v in jax.tree.leaves(q)] + [jax.tree.structure(q)]

    makers = {
        "xla operand": lambda x: nvfp4_operand(x, block="2d", global_amax=amax),
        "xla packed": lambda x: quantize_nvfp4(x, block="2d", global_amax=amax),
    }
    for name, make in makers.items():
        want, got = fields(make(w.T)), fields(transpose_2d(make(w)))
        assert want[-1] == got[-1], name
        for a, b in zip(want[:-1], got[:-1]):
            np.testing.assert_array_equal(a, b, err_msg=name)
    with pytest.raises(NVFP4ToolError, match="transpose_2d: expected a 16x16-scaled"):
        transpose_2d(quantize_nvfp4(w, block="1d"))


# one dense block, 64 wide: 7 NVFP4 linears (lm_head stays bf16)
DENSE = tiny_dense(256, 64, num_layers=1)


def _step_fns(remat: str, grad_accum: int = 2):
    return step_state(DENSE, recipe("nvfp4").resolved(), remat=remat, grad_accum=grad_accum)


def _tags(jaxpr) -> tuple[int, int]:
    """(weight quantizations outside any loop, inside a scan) in a jaxpr: its `name` equations
    tagged WEIGHT_QUANTIZED (one per `quantize_weight` call), sub-jaxprs included."""
    outside = inside = 0

    def walk(jaxpr, in_scan):
        nonlocal outside, inside
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "name" and eqn.params.get("name") == WEIGHT_QUANTIZED:
                inside, outside = (inside + 1, outside) if in_scan else (inside, outside + 1)
            for value in eqn.params.values():
                for sub in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        walk(sub.jaxpr, in_scan or eqn.primitive.name == "scan")
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        walk(sub, in_scan or eqn.primitive.name == "scan")

    walk(jaxpr.jaxpr, False)
    return outside, inside


def test_the_weight_is_quantized_once_per_optimizer_step():
    """In the traced step (2 micro-batches; remat=block, which recomputes each block's forward),
    each NVFP4 linear's weight is quantized exactly once, before the micro-batch scan: fprop and
    dgrad share it. (The losses and gradients equal quantizing in each micro-batch: the bit-exact
    tests of tests/train/test_train.py, tests/model/test_remat.py and tests/recipes/test_recipes_dots.py.)"""
    fns, state = _step_fns("block")
    n_linears = sum(p == "nvfp4" for p in fns.pmap.values())
    assert n_linears == 7  # q/k/v/o, gate/up/down
    windows = np.zeros((2, 1, 33), np.int32)
    step = jax.make_jaxpr(lambda s, w: fns.train_step(s, Batch(w), jax.random.key(0)))(state, windows)
    assert _tags(step) == (n_linears, 0)
    # the count sees quantizations inside a loop: a loss gradient left to quantize in its forward
    # (no weights given, as eval does) quantizes once per linear there, inside the scan over two
    grads = jax.make_jaxpr(
        lambda p, w: jax.lax.scan(lambda c, x: (c, jax.grad(lambda q: fns.loss(q, x, jax.random.key(0))[0])(p)), 0, w)
    )(state["params"], Batch(windows))
    assert _tags(grads) == (0, n_linears)


def test_run_json_refuses_a_backend_for_another_recipe(tmp_path):
    """A bf16 run.json holding a backend is refused (the reader checks what the trainer writes)."""
    from nvfp4tool.records.base import RecordError

    config = TrainConfig(data="x", recipe="bf16").to_dict()
    record = {
        "config": config,
        "model_config": {},
        "data_sha256": "0",
        "eval_data_sha256": None,
        "tokenizer_sha256": "0",
        "train_windows": 1,
        "eval_windows": 1,
        "devices": 1,
        "processes": 1,
        "gemm_backend": CPU,
    }
    with open(os.path.join(tmp_path, "run.json"), "w") as f:
        json.dump(record, f)
    with pytest.raises(RecordError, match="gemm_backend: recorded for recipe 'bf16'"):
        RunRecord.read(tmp_path)
