"""`check` passes the real exports of `nvfp4tool export` with their options (sharded, scale search,
2D weight blocks, kept BF16 layers, GPTQ) on a tiny synthetic model, and flags a real export once it
is broken."""

from __future__ import annotations

import os
import shutil

import pytest

from nvfp4tool import export
from nvfp4tool.check import check_checkpoint

from fixtures.export_fixtures import export_options, synthetic_config, synthetic_source

CONFIG = synthetic_config(hidden=64, mlp=128, layers=2, vocab=256, head_dim=16, kv_heads=2, dtype="bfloat16")
# (format, quant, extra export options): the options' cases; each format x quant of every family's
# plain export is checked by the conformance suite (tests/quickstart/test_conformance.py). The
# scale-search, 2D and GPTQ cases compile more: slow.
CASES = [
    ("compressed-tensors", "nvfp4", {"max_shard_size": "40KB"}),  # sharded, with an index
    pytest.param("compressed-tensors", "nvfp4-weight-only", {"scale_search": "4over6"}, marks=pytest.mark.slow),
    pytest.param(
        "modelopt", "nvfp4", {"weight_block": "2d", "keep_bf16": ("model.layers.1.*",)}, marks=pytest.mark.slow
    ),
    pytest.param(
        "compressed-tensors", "nvfp4", {"weight_rounding": "gptq", "scale_search": "mse"}, marks=pytest.mark.slow
    ),
]


@pytest.fixture(scope="module")
def export_to(tmp_path_factory):
    """export_to(fmt, quant, **extra) -> the folder of that export of one tiny synthetic model."""
    root = tmp_path_factory.mktemp("check_exports")
    src, calib = synthetic_source(root, CONFIG, seed=5)
    done: dict[tuple, str] = {}

    def run(fmt: str, quant: str, **extra) -> str:
        key = (fmt, quant, repr(sorted(extra.items())))
        if key not in done:
            folder = str(root / f"{len(done)}-{fmt}-{quant}")
            export.export_checkpoint(src, folder, export_options(calib, format=fmt, quant=quant, **extra))
            done[key] = folder
        return done[key]

    return run


@pytest.mark.parametrize("fmt,quant,extra", CASES)
@pytest.mark.slow  # > 15 s of the inner loop (tests/durations.json)
def test_real_exports_pass(export_to, fmt, quant, extra):
    report = check_checkpoint(export_to(fmt, quant, **extra), tp=(1, 2, 4))
    assert report.ok, [p.line() for p in report.problems]
    assert (report.format, report.quant) == (fmt, quant)
    quantized = 14 - 7 * ("keep_bf16" in extra)
    assert len(report.modules) == quantized
    assert {m.bits_per_param for m in report.modules} == {8.0 if quant == "fp8" else 4.5}


def test_real_export_broken_is_caught(export_to, tmp_path):
    # Take the sharded compressed-tensors export and cut its last shard short.
    folder = str(tmp_path / "broken")
    shutil.copytree(export_to("compressed-tensors", "nvfp4", max_shard_size="40KB"), folder)
    shards = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    assert len(shards) > 1
    last = os.path.join(folder, shards[-1])
    with open(last, "r+b") as f:
        f.truncate(os.path.getsize(last) - 1)
    report = check_checkpoint(folder)
    assert any("truncated shard" in p.message and shards[-1] in p.message for p in report.problems)
