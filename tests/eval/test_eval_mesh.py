"""The lm-eval backend on a mesh of 2 host devices gives the log-likelihoods and the generations of
one device for the NVFP4 export as served, its weights really split over both (the same `LayerwiseModel.open`
validate uses).
The device count is fixed when jax starts: each count runs in its own child (tests/fixtures/eval_mesh_child.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from fixtures import REPO_ROOT

ROOT = REPO_ROOT


@pytest.mark.slow
def test_eval_backend_on_two_devices_equals_one(eval_models, tmp_path):
    children = {}
    for devices in (1, 2):
        env = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "PYTHONPATH": ROOT,
            "XLA_FLAGS": f"--xla_backend_optimization_level=0 --xla_force_host_platform_device_count={devices}",
        }
        children[devices] = subprocess.Popen(
            [
                sys.executable,
                os.path.join(ROOT, "tests", "fixtures", "eval_mesh_child.py"),
                eval_models["nvfp4"],
                str(tmp_path / f"{devices}.json"),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    for child in children.values():
        output = child.communicate(timeout=900)[0]
        assert child.returncode == 0, output[-3000:]
    one, two = (json.loads((tmp_path / f"{d}.json").read_text()) for d in (1, 2))
    assert (one["devices"], two["devices"]) == (1, 2)
    for label in ("nvfp4",):
        a, b = one["models"][label], two["models"][label]
        assert (a["mesh"], b["mesh"]) == (0, 2) and (a["layer0_shards"], b["layer0_shards"]) == (1, 2)
        assert a["resps"]["nvfp4tool_gsm"] == b["resps"]["nvfp4tool_gsm"]  # the same greedy text
        mine = np.array([[r[0][0] for r in item] for item in a["resps"]["nvfp4tool_mc_letter"]])
        theirs = np.array([[r[0][0] for r in item] for item in b["resps"]["nvfp4tool_mc_letter"]])
        np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-5)
        assert np.array_equal(mine.argmax(-1), theirs.argmax(-1))
