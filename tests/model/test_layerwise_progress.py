"""Progress of a layer-by-layer run says what it counts (issue 42: `bf16 logits: 16/16 layer` on a
4-layer model, `equalize: statistics: 31/120 layer` on a 30-layer one): a held model's run counts
the windows (each batch goes through every layer), a streamed one's the layers (every window goes
through one layer at a time). Captured as the text progress lines a log shows."""

from __future__ import annotations

import io
import re

import jax.numpy as jnp
import numpy as np

from converters.tensor_source import DictTensorSource
from nvfp4tool import progress
from nvfp4tool.model import default_linear, model_from_tensors
from nvfp4tool.model.layerwise import LayerwiseModel
from nvfp4tool.model.linear import Plain

from fixtures.validate_fixtures import CONFIG  # 2 layers, hidden 64, vocab 256

DONE = re.compile(r"^\S+ (?P<stage>.+?): done, (?P<done>\d+)/(?P<total>\d+) (?P<unit>\S+) ", re.M)


def _done_lines(run) -> dict[str, tuple[int, int, str]]:
    stream = io.StringIO()
    previous = progress.use_reporter(progress.for_cli(quiet=False, log_format="text", stream=stream))
    try:
        run()
    finally:
        progress.use_reporter(previous)
    return {m["stage"]: (int(m["done"]), int(m["total"]), m["unit"]) for m in DONE.finditer(stream.getvalue())}


def test_layerwise_progress_counts_windows_when_held_and_layers_when_streamed():
    rng = np.random.default_rng(0)
    tensors = {
        name: (
            1.0 + 0.1 * rng.standard_normal(shape) if name.endswith("norm.weight") else 0.1 * rng.standard_normal(shape)
        ).astype(np.float32)
        for name, shape in CONFIG.expected_tensor_shapes().items()
    }
    ids = rng.integers(0, CONFIG.vocab_size, size=(5, 8))  # 5 windows in batches of 2: 3 batches
    tap = Plain(default_linear)
    held = LayerwiseModel.held(model_from_tensors(CONFIG, DictTensorSource(tensors)))
    streamed = LayerwiseModel.streamed(CONFIG, DictTensorSource(tensors), compute_dtype=jnp.float32)
    assert CONFIG.num_layers == 2
    runs = {"held logits": held, "streamed logits": streamed}
    found = _done_lines(lambda: [list(m.logits(ids, 2, tap=tap, label=label)) for label, m in runs.items()])
    assert found == {"held logits": (5, 5, "window"), "streamed logits": (2, 2, "layer")}, found
