"""Peak memory of HF -> MaxText -> HF stays bounded by the largest stacked tensor.

A child process converts a synthetic fp32 model (~1.3 GB; largest stacked tensor, mlp wi_0/wi_1/wo
[1024, 16, 4096], 268 MB) to a scanned MaxText checkpoint and back, then reports its peak RSS
(VmHWM). The fixed overhead is measured in the same child first: the peak after importing
jax/orbax/tensorstore and converting a tiny model both ways (thread pools, allocator arenas).
The bound asserted: peak - overhead < 2.5 x the largest stacked tensor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_hf_maxtext_hf_peak_rss_is_bounded_by_the_largest_stacked_tensor(tmp_path):
    result = subprocess.run([sys.executable, os.path.abspath(__file__), str(tmp_path)],
                            capture_output=True, text=True, timeout=600, cwd=ROOT,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    print(report)
    largest = report["largest_stacked_bytes"]
    assert largest == 1024 * 16 * 4096 * 4
    assert report["tensors_equal"]
    used = report["peak_bytes"] - report["overhead_bytes"]
    assert used < 2.5 * largest, report


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _child(workdir: str) -> None:
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import numpy as np
    import orbax.checkpoint  # noqa: F401
    import tensorstore  # noqa: F401

    from bench_convert import synthetic_config
    from converters.convert import convert_checkpoint
    from converters.hf import HFFolderSource

    tiny = synthetic_config(hidden=256, mlp=512, layers=2, vocab=512, dtype="float32")
    big = synthetic_config(hidden=1024, mlp=4096, layers=16, vocab=32768, dtype="float32")
    for name, config in (("tiny", tiny), ("big", big)):
        # the source is written in a separate process so its tensors never count here
        subprocess.run([sys.executable, "-c", (
            "import sys; sys.path[:0] = [%r, %r]; from bench_convert import *; "
            "write_synthetic_hf_folder(%r, synthetic_config(hidden=%d, mlp=%d, layers=%d, vocab=%d, "
            "dtype='float32'))") % (ROOT, os.path.join(ROOT, "scripts"), os.path.join(workdir, name),
                                   config.hidden_size, config.intermediate_size, config.num_layers,
                                   config.vocab_size)], check=True)
    report = {"rss_after_imports": _rss("VmRSS")}
    for name in ("tiny", "big"):
        hf = os.path.join(workdir, name)
        convert_checkpoint(hf, hf + "-mt", to="maxtext", rope_layout="interleaved")
        convert_checkpoint(hf + "-mt", hf + "-back", to="hf", model_config=hf, rope_layout="interleaved")
        if name == "tiny":
            report["overhead_bytes"] = _rss("VmHWM")
    report["peak_bytes"] = _rss("VmHWM")
    report["largest_stacked_bytes"] = big.hidden_size * big.num_layers * big.intermediate_size * 4
    original, back = HFFolderSource(os.path.join(workdir, "big")), HFFolderSource(os.path.join(workdir, "big-back"))
    report["tensors_equal"] = all(
        np.array_equal(original.get(n), back.get(n)) if not n.endswith("q_proj.weight") else
        np.abs(original.get(n) - back.get(n)).max() <= np.abs(original.get(n)).max() * 2**-23
        for n in original.names())
    print(json.dumps(report))


if __name__ == "__main__":
    _child(sys.argv[1])
