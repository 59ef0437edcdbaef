"""export/plan.py: what is quantized, and the usage errors of --keep-bf16 (tiny configs, no weights)."""

from __future__ import annotations

import pytest

from nvfp4tool.config import ModelConfig
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError
from nvfp4tool.export.plan import make_plan


def _config(mlp: int) -> ModelConfig:
    return ModelConfig(
        family="llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=mlp,
        num_layers=3,
        num_heads=2,
        num_kv_heads=2,
        head_dim=16,
        dtype="bfloat16",
    )


def test_groups_are_quantized_whole_and_lm_head_never():
    plan = make_plan(_config(64), "nvfp4", keep_bf16=("*.layers.1.mlp.gate_proj",))
    assert "lm_head" in plan.excluded and "lm_head" not in plan.quantized
    assert {"model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"} <= set(plan.excluded)
    assert "model.layers.1.mlp.down_proj" in plan.quantized


def test_a_keep_bf16_pattern_that_matches_nothing_is_a_usage_error():
    with pytest.raises(NVFP4UsageError, match=r"--keep-bf16 'model\.layers\.\*\.mlp\.gate' matches no"):
        make_plan(_config(64), "nvfp4", keep_bf16=("model.layers.*.mlp.gate",))


def test_ragged_k_names_every_module_as_patterns():
    # intermediate 40: every layer's down_proj has K = 40 (not a multiple of 16)
    with pytest.raises(NVFP4ToolError) as info:
        make_plan(_config(40), "nvfp4")
    message = str(info.value)
    assert "model.layers.0.mlp.down_proj.weight: in_features 40" in message
    assert "(3 module(s) like it)" in message and "--keep-bf16 'model.layers.*.mlp.down_proj'" in message
    plan = make_plan(_config(40), "nvfp4", keep_bf16=("model.layers.*.mlp.down_proj",))  # the advice works
    assert not any(n.endswith("down_proj") for n in plan.quantized)
