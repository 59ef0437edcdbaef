"""Peak memory of calibration and validate stays bounded by the model as stored (held, `--offload
never`) or by one decoder layer (streamed, `--offload always`), and both modes give the same numbers.

Child processes (`scripts/bench_validate.py`) run `calibrate` and `validate_export` (FP8
reference: an FP8 export made beforehand) on a warm-up model, the tiny preset's widths at the
measured model's depth and vocabulary (its peak is the fixed overhead: imports, XLA compilation and
the compiled programs, thread pools; its programs are then freed, the measured run compiles its
own), then on a synthetic BF16 model of 1.08 GB (hidden 2048,
mlp 5632, 8 layers, vocab 32000; largest layer 103 MB, embeddings + LM head 262 MB) exported NVFP4
W4A4 beforehand, on 4 windows of 64 tokens, and report their peak RSS (VmHWM). Every bound is
computed from the sizes the child measured (safetensors headers):
* held:     peak - overhead <= 1.3 x the stored model + the working set;
* streamed: peak - overhead <= the largest decoder layer + embeddings / final norm / LM head
            + the windows' activations + the working set;
working set: one fp32 copy of the largest weight (the LM head widened for the fp32 GEMM, or a read
buffer), one batch's logits and activations in fp32, two float64 metric temporaries.

The validate children also run the warm-up model a second time, its programs compiled, and report
that run's peak above the resident set before it (VmHWM reset by clear_refs) beside validate's own
estimate (`validate.footprint`, what `--offload auto` weighs): within 1.5x either way, held and
streamed (issue 42: the old estimate was 3.5x the peak of the tiny preset).
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from fixtures import REPO_ROOT

ROOT = REPO_ROOT
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from bench_validate import KINDS, Setup  # noqa: E402
from conftest import default_xla_backend  # noqa: E402

SHAPE = dict(hidden=2048, mlp=5632, layers=8, vocab=32000)
HELD_FACTOR = 1.3
# not imported (no JAX in this process): nvfp4tool.numerics.metrics.CHUNK_BYTES (the float64 per-token
# math holds at most ~6 such temporaries: log-softmax of both models, exp, difference, product) and
# nvfp4tool.numerics.dot.WIDEN_BYTES (the most of a weight held widened to fp32 at once)
CHUNK_BYTES = 16 * 2**20
WIDEN_BYTES = 64 * 2**20


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    with default_xla_backend():
        setup = Setup(
            str(tmp_path_factory.mktemp("validate_memory")),
            **SHAPE,
            samples=4,
            seq_len=64,
            batch_size=4,
            gen_tokens=4,
            reference="prebuilt",
        )
        # each kind in its own child (VmHWM is per process, so a neighbour does not change a peak),
        # two at a time: one per core of a 2-core CI machine, ~6 GB at most together
        with ThreadPoolExecutor(max_workers=2) as pool:
            return dict(zip(KINDS, pool.map(setup.measure, KINDS)))


def _bound(report: dict) -> tuple[int, str]:
    """(bytes, how they were computed) of the kind's bound.

    working set: one tensor read from its file while its device copy is made (the largest), one
    block of a weight widened for its GEMM, a batch's logits three times (on the device, the host
    copy spooled or compared, the shifted copy the NLL takes), a batch's intermediates, the float64
    metric temporaries. Streamed, the BF16 pass also holds the same layer of each export as stored
    (for the per-layer SQNR)."""
    s = report["sizes"]
    working = s["largest_tensor_bytes"] + WIDEN_BYTES + 3 * s["logits_bytes"] + s["batch_bytes"] + 6 * CHUNK_BYTES
    if report["kind"].endswith("never"):
        return (
            int(HELD_FACTOR * s["model_bytes"]) + working,
            f"{HELD_FACTOR} x model {s['model_bytes']} + working set {working}",
        )
    layer = s["largest_layer_bytes"] + s["export_layer_bytes"] + s["outer_bytes"] + s["carry_bytes"]
    return (
        layer + working,
        f"largest layer {s['largest_layer_bytes']} + the exports' layer "
        f"{s['export_layer_bytes']} + embeddings/lm_head {s['outer_bytes']} + activations "
        f"{s['carry_bytes']} + working set {working}",
    )


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_peak_rss_is_bounded(runs, kind):
    report = runs[kind]
    bound, how = _bound(report)
    used = report["peak_bytes"] - report["overhead_bytes"]
    print(
        f"{kind}: peak {report['peak_bytes'] / 1e9:.3f} GB, overhead {report['overhead_bytes'] / 1e9:.3f} GB, "
        f"peak - overhead {used / 1e9:.3f} GB, bound {bound / 1e9:.3f} GB, {report['seconds']:.1f} s"
    )
    assert used <= bound, (
        f"{kind}: peak {report['peak_bytes']} - overhead {report['overhead_bytes']} = {used} > bound {bound} = {how}"
    )


@pytest.mark.slow
def test_the_bounds_tell_held_from_streamed(runs):
    sizes = runs["calibrate-always"]["sizes"]
    assert 0.9e9 < sizes["model_bytes"] < 1.3e9
    streamed, _ = _bound(runs["calibrate-always"])
    held, _ = _bound(runs["calibrate-never"])
    assert streamed < sizes["model_bytes"] < held  # a held model cannot pass the streamed bound


@pytest.mark.slow
def test_held_and_streamed_give_the_same_numbers(runs):
    assert runs["calibrate-never"]["amax"] == runs["calibrate-always"]["amax"]
    held, streamed = runs["validate-never"], runs["validate-always"]
    assert held["resources"]["models"] == {"bf16": "held", "nvfp4": "held", "fp8": "held"}
    assert streamed["resources"]["models"] == {"bf16": "streamed", "nvfp4": "streamed", "fp8": "streamed"}
    assert held["models"].keys() == streamed["models"].keys()
    for label, metrics in held["models"].items():
        for name, value in metrics.items():
            np.testing.assert_allclose(streamed["models"][label][name], value, rtol=1e-6, err_msg=f"{label} {name}")
    assert [r["name"] for r in held["layers"]] == [r["name"] for r in streamed["layers"]]
    for h, s in zip(held["layers"], streamed["layers"]):
        for key in ("weight_sqnr_db", "output_sqnr_db"):
            assert h[key].keys() == s[key].keys()
            for label in h[key]:
                np.testing.assert_allclose(s[key][label], h[key][label], rtol=1e-6, err_msg=f"{h['name']} {key}")
    assert streamed["generation"]["skipped"] and not held["generation"]["skipped"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["validate-never", "validate-always"])
def test_the_estimate_is_within_1_5x_of_the_measured_peak(runs, kind):
    warm = runs[kind]["warm"]
    measured, estimate = warm["peak_bytes"], warm["estimate_bytes"]
    print(f"{kind}: warm-up peak above its start {measured / 1e6:.0f} MB, estimate {estimate / 1e6:.0f} MB")
    assert measured > 100e6, warm  # the run did hold its logits and metric chunks
    assert measured / 1.5 <= estimate <= 1.5 * measured, f"{kind}: estimate {estimate}, measured {measured}"
