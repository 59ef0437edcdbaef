"""Child process of tests/test_validate_mesh.py: validate, search and calibrate the tiny fixtures
(tests/validate_fixtures.py) on as many host devices as the parent's XLA_FLAGS make, and write
what came out as JSON.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/mesh_child.py FIXTURES OUT.json

Every model the code under test opens is seen by wrapping `LayerwiseModel.open` from here (the code
carries no test hook): whether it was streamed, the mesh size, and the global and per-device
shapes of its layer-0 and LM-head weights.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys

import jax

jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py

from converters.hf import HFFolderSource
from nvfp4tool.export.calibrate import calibrate
from nvfp4tool.model.layerwise import LayerwiseModel
from nvfp4tool.validate.runner import ValidateOptions, open_inputs, run_validation
from nvfp4tool.validate.sensitivity import sensitivity

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from validate_fixtures import CONFIG, SEQ_LEN

ROOT, OUT = sys.argv[1], sys.argv[2]
opened: list[dict] = []
messages: list[str] = []


def _shapes(tree) -> list[list[list[int]]]:
    """[global shape, shape on the first device] of every array."""
    return [[list(a.shape), list(a.addressable_shards[0].data.shape)] for a in jax.tree.leaves(tree)]


def _open(*args, _open=LayerwiseModel.open, **kwargs):
    model = _open(*args, **kwargs)
    opened.append(
        {
            "streamed": model.streamed,
            "mesh": 0 if model.mesh is None else model.mesh.size,
            "layer0": _shapes(model._layer(0)),
            "outer": _shapes(model._outer_state),
        }
    )
    return model


LayerwiseModel.open = _open
handler = logging.Handler()
handler.emit = lambda record: messages.append(record.getMessage())
logging.getLogger("nvfp4tool").addHandler(handler)
logging.getLogger("nvfp4tool").setLevel(logging.INFO)

result = {"devices": jax.device_count(), "validate": {}, "amax": {}}
for offload in ("never", "always"):
    options = ValidateOptions(
        data=os.path.join(ROOT, "ids.npy"),
        reference=os.path.join(ROOT, "fp8"),
        samples=8,
        seq_len=SEQ_LEN,
        batch_size=4,
        prompts=2,
        prompt_len=8,
        gen_tokens=12,
        offload=offload,
    )
    with open_inputs(os.path.join(ROOT, "broken"), options) as inputs:
        record = run_validation(inputs)
        found = sensitivity(inputs, kl_target=0.5 * record.models["nvfp4"]["kl_mean"])
    result["validate"][offload] = {
        "record": record.to_json(),
        "sensitivity": dataclasses.asdict(found),
        "ran": dict(inputs.ran),
    }
    names = [n for n in CONFIG.linear_names() if n != "lm_head"]
    result["amax"][offload] = calibrate(
        CONFIG,
        HFFolderSource(os.path.join(ROOT, "src")),
        names,
        os.path.join(ROOT, "ids.npy"),
        samples=8,
        seq_len=SEQ_LEN,
        tokenizer_dir=None,
        offload=offload,
    ).input_amax
result["opened"], result["messages"] = opened, messages
with open(OUT, "w") as f:
    json.dump(result, f)
