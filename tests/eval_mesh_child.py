"""Child process of tests/test_eval_mesh.py: the lm-eval backend on as many host devices as the
parent's XLA_FLAGS make, for the NVFP4 export as served (W4A4: the source's path is the same code
without the served seam), on a letter-answer
multiple-choice task and a greedy generative task; writes the responses and the mesh as JSON.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python tests/eval_mesh_child.py NVFP4 OUT.json
"""

from __future__ import annotations

import json
import sys

import jax

jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py

import lm_eval
from flax import nnx

from nvfp4tool.validate.lm_backend import NVFP4ToolLM, task_manager

TASKS = ["nvfp4tool_mc_letter", "nvfp4tool_gsm"]
NVFP4, OUT = sys.argv[1], sys.argv[2]

found = {"devices": jax.device_count(), "models": {}}
for label, path in (("nvfp4", NVFP4),):
    lm = NVFP4ToolLM(path=path, max_length=64, batch_size=4)
    mesh = lm.variant.model.mesh
    layer0 = max(jax.tree.leaves(nnx.state(lm.variant.model.whole.layers[0])), key=lambda a: a.size)
    out = lm_eval.simple_evaluate(
        model=lm,
        tasks=TASKS,
        task_manager=task_manager((), defaults=False),
        limit=3,
        log_samples=True,
        bootstrap_iters=0,
    )
    found["models"][label] = {
        "mesh": 0 if mesh is None else mesh.size,
        "layer0_shards": len({str(s.index) for s in layer0.addressable_shards}),
        "resps": {t: [s["resps"] for s in out["samples"][t]] for t in TASKS},
    }
with open(OUT, "w") as f:
    json.dump(found, f)
