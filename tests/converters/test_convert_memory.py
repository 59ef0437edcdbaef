"""Peak memory of HF -> MaxText -> HF stays bounded by the largest stacked tensor.

A child process converts a synthetic fp32 model to a scanned MaxText checkpoint and back, then
reports its peak RSS (VmHWM): a Llama (~1.3 GB; largest stacked tensor, mlp wi_0/wi_1/wo
[1024, 16, 4096], 268 MB) and a Mixtral (~1.2 GB; largest, the experts stacks wi_0/wi_1/wo
[8 experts, 8 layers, 1024, 1024], 268 MB, assembled and read back one expert at a time). The
fixed overhead is measured in the same child first: the peak after importing
jax/orbax/tensorstore and converting a tiny model both ways (thread pools, allocator arenas).
The bound asserted: peak - overhead < 2.5 x the largest stacked tensor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from nvfp4tool.families.moe import Experts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a child too


# family -> (tiny, big) config fields beyond hidden/mlp/layers/vocab
_MIXTRAL = dict(family="mixtral", family_config=Experts(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True))
CASES = {
    "llama": ((256, 512, 2, 512, {}), (1024, 4096, 16, 32768, {})),
    "mixtral": ((256, 256, 2, 512, _MIXTRAL), (1024, 1024, 8, 32768, _MIXTRAL)),
}


@pytest.fixture(scope="module")
def children(tmp_path_factory) -> dict[str, tuple[int, str, str]]:
    """{family: (exit status, stdout, stderr)} of its child; both children run at once (VmHWM is per
    process: a neighbour does not change a peak), one per core of a 2-core CI machine."""
    from conftest import default_xla_backend  # not at the top: this file is the child too

    with default_xla_backend():
        procs = {
            family: subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), str(tmp_path_factory.mktemp(family)), family],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=ROOT,
                env=dict(os.environ, JAX_PLATFORMS="cpu"),
            )
            for family in CASES
        }
    try:
        outputs = {family: proc.communicate(timeout=600) for family, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return {family: (procs[family].returncode, *outputs[family]) for family in CASES}


@pytest.mark.slow
@pytest.mark.parametrize("family", CASES)
def test_hf_maxtext_hf_peak_rss_is_bounded_by_the_largest_stacked_tensor(children, family):
    returncode, stdout, stderr = children[family]
    assert returncode == 0, stderr[-3000:]
    report = json.loads(stdout.strip().splitlines()[-1])
    print(report)
    largest = report["largest_stacked_bytes"]
    assert largest == 1024 * 16 * 4096 * 4 == 8 * 8 * 1024 * 1024 * 4
    assert report["tensors_equal"]
    used = report["peak_bytes"] - report["overhead_bytes"]
    assert used < 2.5 * largest, report


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def _child(workdir: str, family: str) -> None:
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import dataclasses

    import numpy as np
    import orbax.checkpoint  # noqa: F401 (the imports' memory is part of the measured overhead)
    import tensorstore  # noqa: F401
    from bench_convert import synthetic_config

    from converters.hf import HFFolderSource
    from nvfp4tool.convert import convert_checkpoint

    tiny, big = (
        dataclasses.replace(synthetic_config(hidden=h, mlp=f, layers=n, vocab=v, dtype="float32"), **fields)
        for h, f, n, v, fields in CASES[family]
    )
    for name, config in (("tiny", tiny), ("big", big)):
        # the source is written in a separate process so its tensors never count here
        subprocess.run(
            [
                sys.executable,
                "-c",
                (
                    "import sys, json; sys.path[:0] = [%r, %r]; from bench_convert import *; "
                    "from nvfp4tool.config import ModelConfig; "
                    "write_synthetic_hf_folder(%r, ModelConfig.from_hf_config(json.loads(%r)))"
                )
                % (ROOT, os.path.join(ROOT, "scripts"), os.path.join(workdir, name), json.dumps(config.to_hf_config())),
            ],
            check=True,
        )
    from converters.maxtext_models import family_rope_layout

    # interleaved (the permuting layout) where the model may choose; Mixtral's family fixes half
    rope = None if family_rope_layout(big.family) else "interleaved"
    report = {"rss_after_imports": _rss("VmRSS")}
    for name in ("tiny", "big"):
        hf = os.path.join(workdir, name)
        convert_checkpoint(hf, hf + "-mt", to="maxtext", rope_layout=rope)
        convert_checkpoint(hf + "-mt", hf + "-back", to="hf", model_config=hf, rope_layout=rope)
        if name == "tiny":
            report["overhead_bytes"] = _rss("VmHWM")
    report["peak_bytes"] = _rss("VmHWM")
    report["largest_stacked_bytes"] = (
        (big.family_config.num_experts if big.family_spec.experts(big) is not None else 1)
        * big.hidden_size
        * big.num_layers
        * big.intermediate_size
        * 4
    )
    original, back = HFFolderSource(os.path.join(workdir, "big")), HFFolderSource(os.path.join(workdir, "big-back"))
    report["tensors_equal"] = all(
        np.array_equal(original.get(n), back.get(n))
        if not n.endswith("q_proj.weight")
        else np.abs(original.get(n) - back.get(n)).max() <= np.abs(original.get(n)).max() * 2**-23
        for n in original.names()
    )
    print(json.dumps(report))


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
