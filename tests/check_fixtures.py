"""A tiny Qwen3-MoE model and its NVFP4 W4A4 exports with FP8 KV-cache scales, in both layouts, made
by the CLI: the fixtures of check's expert and KV-scale tests (test_check_model.py and
test_adversarial_check.py). 2 layers (both sparse), 4 experts of width 32, top-2; hidden 64."""

from __future__ import annotations

import os

from adversarial_harness import SEQ, write_synthetic_hf_folder
from click.testing import CliRunner

from nvfp4tool.cli import cli
from nvfp4tool.config import ModelConfig
from nvfp4tool.families.moe import Experts

MOE_CONFIG = ModelConfig(
    family="qwen3_moe",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    qk_norm=True,
    dtype="bfloat16",
    family_config=Experts(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
)


def build_moe_exports(root: str, ids: str) -> dict[str, str]:
    """{"moe": the BF16 HF folder, "moe-mo": its ModelOpt export, "moe-ct": its compressed-tensors
    export}, both exports W4A4 with FP8 KV-cache scales, calibrated on `ids` (.npy token ids)."""
    paths = {
        "moe": os.path.join(root, "moe"),
        "moe-mo": os.path.join(root, "moe-mo"),
        "moe-ct": os.path.join(root, "moe-ct"),
    }
    write_synthetic_hf_folder(paths["moe"], MOE_CONFIG, seed=5)
    runner = CliRunner()
    for key, fmt in (("moe-mo", "modelopt"), ("moe-ct", "compressed-tensors")):
        result = runner.invoke(
            cli,
            [
                "-q",
                "export",
                paths["moe"],
                "--out",
                paths[key],
                "--format",
                fmt,
                "--calib-data",
                ids,
                "--calib-samples",
                "4",
                "--calib-seq-len",
                str(SEQ),
                "--kv-cache",
                "fp8",
            ],
        )
        assert result.exit_code == 0, result.output
    return paths
