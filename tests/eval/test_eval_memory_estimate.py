"""eval's `--offload auto` estimate of a held model's working memory (issue 42: 11.05 GB "held" for a
0.27 GB model): `lm_backend.working_bytes` (= `layerwise.held_forward_bytes`) within 1.5x of the
peak a held forward of one batch measures, on the tiny and small presets. The old estimate summed
the LM head's fp32 logits and a layer's activations and scores (phases that never overlap) and
doubled the sum: 2.4-4x the measured peak. Measured in a child process: VmHWM reset before the
forward (/proc/self/clear_refs), peak minus the resident set before it (compilation included)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fixtures import REPO_ROOT

CHILD = r"""
import json, sys
import ml_dtypes, numpy as np
from converters.tensor_source import DictTensorSource
from nvfp4tool.eval.lm_backend import _served_tap, working_bytes
from nvfp4tool.model import model_from_tensors
from nvfp4tool.model.layerwise import LayerwiseModel
from nvfp4tool.train.presets import preset_config
from nvfp4tool.validate.runner import VALIDATION_DTYPE

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

name, vocab, batch, seq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
config = preset_config(name, vocab, 4096)
rng = np.random.default_rng(0)
tensors = {
    n: (0.02 * rng.standard_normal(s)).astype(ml_dtypes.bfloat16) for n, s in config.expected_tensor_shapes().items()
}
model = LayerwiseModel.held(
    model_from_tensors(config, DictTensorSource(tensors), dtype=None, compute_dtype=VALIDATION_DTYPE)
)
ids = rng.integers(0, vocab, (batch, seq)).astype(np.int32)
before = status("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
for _, logits in model.logits(ids, batch, tap=_served_tap()):
    np.asarray(logits)
print(json.dumps({"measured": status("VmHWM:") - before, "estimate": working_bytes(config, batch, seq)}))
"""


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_held_forward_estimate_is_within_1_5x_of_the_measured_peak(preset):
    run = subprocess.run(
        [sys.executable, "-c", CHILD, preset, "8192", "8", "512"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    measured, estimate = found["measured"], found["estimate"]
    assert measured > 50e6, found  # the forward did allocate its logits and scores
    assert measured / 1.5 <= estimate <= 1.5 * measured, (
        f"estimate {estimate / 1e6:.0f} MB, peak {measured / 1e6:.0f} MB"
    )
