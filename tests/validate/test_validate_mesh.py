"""validate, the sensitivity search and calibration on a mesh of 4 host devices give the numbers of
one device, with the weights really sharded (fsdp), held and streamed.

The device count is fixed when jax starts, so each count runs in its own child (tests/fixtures/mesh_child.py),
both at once on the fixtures of tests/fixtures/validate_fixtures.py built here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fixtures import REPO_ROOT
from fixtures.validate_fixtures import build_exports

ROOT = REPO_ROOT
OFFLOADS = ("never", "always")
# Both children compile every program once; without the backend's optimization passes (the same in
# both: the mesh is partitioned before them) that takes half the time.
XLA_FLAGS = "--xla_backend_optimization_level=0"

pytestmark = pytest.mark.slow  # two children that compile every program: ~50 s


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, dict]:
    """{device count: what mesh_child.py wrote} for 1 and 4 host devices."""
    root = tmp_path_factory.mktemp("mesh")
    build_exports(str(root))
    children = {}
    for devices in (1, 4):
        env = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "PYTHONPATH": ROOT,
            "XLA_FLAGS": f"{XLA_FLAGS} --xla_force_host_platform_device_count={devices}",
        }
        children[devices] = subprocess.Popen(
            [
                sys.executable,
                os.path.join(ROOT, "tests", "fixtures", "mesh_child.py"),
                str(root),
                str(root / f"{devices}.json"),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    for devices, child in children.items():
        output = child.communicate(timeout=600)[0]
        assert child.returncode == 0, output[-3000:]
    return {d: json.loads((root / f"{d}.json").read_text()) for d in children}


def test_children_ran_on_one_and_four_devices(runs):
    assert {d: run["devices"] for d, run in runs.items()} == {1: 1, 4: 4}


@pytest.mark.parametrize("offload", OFFLOADS)
def test_every_model_ran_sharded_over_the_four_devices(runs, offload):
    """Each model opened (bf16, nvfp4, fp8, the sensitivity model, calibration) was on the 4-device
    mesh, every weight of a layer and of the outer model split 4 ways on one axis, and said so."""
    streamed = offload == "always"
    for devices, run in runs.items():
        opened = [o for o in run["opened"] if o["streamed"] == streamed]
        assert len(opened) == 5 and all(o["mesh"] == (devices if devices > 1 else 0) for o in opened)
        for o in opened:
            for shape, on_device in o["layer0"] + o["outer"]:
                if devices == 1 or not shape:
                    assert on_device == shape
                else:  # the largest axis that 4 divides is split (all of these have one)
                    axis = max((a for a in range(len(shape)) if shape[a] % devices == 0), key=lambda a: shape[a])
                    assert on_device == [n // devices if a == axis else n for a, n in enumerate(shape)]
        sharded = [m for m in run["messages"] if m.endswith(f"sharded over {devices} devices (fsdp)")]
        assert len(sharded) == (10 if devices > 1 else 0)


@pytest.mark.parametrize("offload", OFFLOADS)
def test_four_devices_report_the_numbers_of_one(runs, offload):
    one, four = (runs[d]["validate"][offload] for d in (1, 4))
    assert (
        four["ran"]
        == one["ran"]
        == {k: {"never": "held", "always": "streamed"}[offload] for k in ("bf16", "nvfp4", "fp8", "sensitivity")}
    )
    for label, metrics in one["record"]["models"].items():
        for key, value in metrics.items():
            assert four["record"]["models"][label][key] == pytest.approx(value, rel=1e-6, abs=1e-12), (label, key)
    for row_one, row_four in zip(one["record"]["layers"], four["record"]["layers"], strict=True):
        assert row_four["name"] == row_one["name"]
        for kind in ("weight_sqnr_db", "output_sqnr_db"):
            assert row_four[kind] == pytest.approx(row_one[kind], rel=1e-6)
    # greedy generation of the sharded held models (not when streamed: said in both)
    assert four["record"]["generation"] == one["record"]["generation"]
    assert bool(one["record"]["generation"]["first_divergence"]) == (offload == "never")
    assert four["sensitivity"]["keep_bf16"] == one["sensitivity"]["keep_bf16"] != []
    for step_one, step_four in zip(one["sensitivity"]["trajectory"], four["sensitivity"]["trajectory"], strict=True):
        assert step_four["kl_mean"] == pytest.approx(step_one["kl_mean"], rel=1e-6)


@pytest.mark.parametrize("offload", OFFLOADS)
def test_four_devices_calibrate_the_amax_of_one(runs, offload):
    one, four = (runs[d]["amax"][offload] for d in (1, 4))
    assert four == one and len(one) == 14 and all(v > 0 for v in one.values())
