"""Which linear modules an export quantizes, how they group, and what stays BF16.

    plan = make_plan(config, "nvfp4", precision_map=run_pmap, keep_bf16=("*.down_proj",))
    plan.quantized       # ("model.layers.0.self_attn.q_proj", ...)
    plan.excluded        # ("lm_head", ...): listed in exclude_modules / ignore, ship nothing quantized
    plan.groups          # {"model.layers.0.self_attn.qkv": ("...q_proj", "...k_proj", "...v_proj")}

Rules: `lm_head` is never quantized (embeddings and norms are not linears and never are); with a
training run's precision map, the modules it trained in BF16 stay BF16; `keep_bf16` fnmatch
patterns exclude more. A fused group (q/k/v, gate/up) is one GEMM in serving engines, so it is
quantized whole or not at all: excluding one member excludes the group.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Iterable, Mapping

from nvfp4tool.config import ModelConfig
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.formats import QUANTS
from nvfp4tool.numerics.constants import NVFP4_BLOCK
from nvfp4tool.recipes.precision import fused_group


@dataclasses.dataclass(frozen=True)
class ExportPlan:
    """The quantization plan of one export."""

    quant: str  # one of nvfp4tool.formats.QUANTS
    quantized: tuple[str, ...]  # linear module names quantized, in model order
    excluded: tuple[str, ...]  # linear module names kept BF16 (always includes lm_head)
    groups: Mapping[str, tuple[str, ...]]  # fused group -> its quantized members

    @property
    def has_input_scales(self) -> bool:
        """W4A4 and FP8 W8A8 ship input scales; weight-only NVFP4 does not."""
        return self.quant != "nvfp4-weight-only"

    def group_of(self, module: str) -> str:
        return fused_group(module)


def make_plan(config: ModelConfig, quant: str, *, precision_map: Mapping[str, str] | None = None,
              keep_bf16: Iterable[str] = ()) -> ExportPlan:
    """The plan for `config` under `quant`; NVFP4ToolError for an unknown quant or a K % 16 != 0."""
    if quant not in QUANTS:
        raise NVFP4ToolError(f"unknown --quant {quant!r}; choose one of {', '.join(QUANTS)}")
    patterns = tuple(keep_bf16)
    names = config.linear_names()
    if precision_map is not None:
        missing = [n for n in names if n not in precision_map]
        if missing:
            raise NVFP4ToolError(f"precision map has no entry for {missing[0]} "
                                 f"({len(missing)} linear modules missing)")
    keep = {n for n in names
            if n == "lm_head"
            or (precision_map is not None and precision_map[n] == "bf16")
            or any(fnmatch.fnmatchcase(n, p) for p in patterns)}
    kept_groups = {fused_group(n) for n in keep}
    keep |= {n for n in names if fused_group(n) in kept_groups}  # a group is quantized whole
    quantized = tuple(n for n in names if n not in keep)
    shapes = config.expected_tensor_shapes()
    for name in quantized:
        k = shapes[f"{name}.weight"][1]
        if k % NVFP4_BLOCK != 0:
            raise NVFP4ToolError(f"{name}.weight: in_features {k} is not a multiple of "
                                 f"{NVFP4_BLOCK}; keep it in BF16 with --keep-bf16 '{name}'")
    groups: dict[str, tuple[str, ...]] = {}
    for name in quantized:
        groups[fused_group(name)] = groups.get(fused_group(name), ()) + (name,)
    return ExportPlan(quant=quant, quantized=quantized,
                      excluded=tuple(n for n in names if n in keep), groups=groups)
