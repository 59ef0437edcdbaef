"""Which linear modules an export quantizes, how they group, and what stays BF16.

    plan = make_plan(config, "nvfp4", precision_map=run_pmap, keep_bf16=("*.down_proj",))
    plan.quantized, plan.excluded, plan.groups

`lm_head` and MoE routers are never quantized; a fused group is quantized whole or not at all.
`read_keep_bf16_file` / `format_keep_bf16_file`: the keep-BF16 file (one fnmatch pattern a line).
Design notes: docs/design/export.md.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Iterable, Mapping

from nvfp4tool.config import ModelConfig
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError
from nvfp4tool.families import fused_group
from nvfp4tool.formats import QUANTS
from nvfp4tool.numerics.constants import NVFP4_BLOCK


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


def make_plan(
    config: ModelConfig,
    quant: str,
    *,
    precision_map: Mapping[str, str] | None = None,
    keep_bf16: Iterable[str] = (),
    keep_bf16_origin: Mapping[str, str] | None = None,
) -> ExportPlan:
    """The plan for `config` under `quant`; NVFP4ToolError for an unknown quant or a K % 16 != 0.
    `keep_bf16_origin`: pattern -> "FILE:LINE" of the patterns read from a keep-BF16 file (a bad
    one is then refused naming that line, exit 1, rather than as an option, exit 2)."""
    if quant not in QUANTS:
        raise NVFP4ToolError(f"unknown --quant {quant!r}; choose one of {', '.join(QUANTS)}")
    patterns = tuple(keep_bf16)
    names = config.linear_names()
    if precision_map is not None:
        missing = [n for n in names if n not in precision_map]
        if missing:
            raise NVFP4ToolError(f"precision map has no entry for {missing[0]} ({len(missing)} linear modules missing)")
    unused = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    origin = keep_bf16_origin or {}
    if unused and unused[0] in origin:
        raise NVFP4ToolError(
            f"{origin[unused[0]]}: {unused[0]!r} matches no linear module of the model "
            f"(e.g. {names[0]}); patterns are fnmatch over full module names"
        )
    if unused:
        raise NVFP4UsageError(
            f"--keep-bf16 {unused[0]!r} matches no linear module of the model "
            f"(e.g. {names[0]}); patterns are fnmatch over full module names"
        )
    always = config.modules.kept()  # lm_head, routers
    keep = {
        n
        for n in names
        if n in always
        or (precision_map is not None and precision_map[n] == "bf16")
        or any(fnmatch.fnmatchcase(n, p) for p in patterns)
    }
    kept_groups = {fused_group(n) for n in keep}
    keep |= {n for n in names if fused_group(n) in kept_groups}  # a group is quantized whole
    quantized = tuple(n for n in names if n not in keep)
    shapes = config.expected_tensor_shapes()
    ragged = [n for n in quantized if shapes[f"{n}.weight"][1] % NVFP4_BLOCK != 0]
    if ragged:
        advice = " ".join(f"--keep-bf16 '{p}'" for p in _patterns_for(ragged))
        raise NVFP4ToolError(
            f"{ragged[0]}.weight: in_features {shapes[f'{ragged[0]}.weight'][1]} is "
            f"not a multiple of {NVFP4_BLOCK} ({len(ragged)} module(s) like it); "
            f"keep them in BF16 with {advice}"
        )
    groups: dict[str, tuple[str, ...]] = {}
    for name in quantized:
        groups[fused_group(name)] = groups.get(fused_group(name), ()) + (name,)
    return ExportPlan(quant=quant, quantized=quantized, excluded=tuple(n for n in names if n in keep), groups=groups)


def _patterns_for(modules: list[str]) -> list[str]:
    """fnmatch patterns covering `modules`, the layer index wildcarded (one projection has the
    same in_features in every layer of these models, so the pattern names exactly those)."""
    return list(dict.fromkeys(".".join("*" if p.isdigit() else p for p in m.split(".")) for m in modules))


def read_keep_bf16_file(path: str) -> dict[str, str]:
    """The patterns of a keep-BF16 file, in order: {pattern: "PATH:LINE"} (see the module
    docstring). NVFP4ToolError naming the file (and line) for a file that is not UTF-8 text or a
    line holding more than one word; no pattern at all is allowed (nothing more kept in BF16)."""
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
    except UnicodeDecodeError as bad:
        raise NVFP4ToolError(
            f"{path}: not UTF-8 text (byte {bad.start}); expected a keep-BF16 file "
            f"(one fnmatch pattern or module name per line)"
        ) from None
    patterns: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if len(words) > 1:
            raise NVFP4ToolError(
                f"{path}:{number}: {line.strip()!r}: expected one fnmatch pattern or module "
                f"name per line (# starts a comment)"
            )
        if words:
            patterns.setdefault(words[0], f"{path}:{number}")
    return patterns


def format_keep_bf16_file(patterns: Iterable[str], comments: Iterable[str] = ()) -> str:
    """The text of a keep-BF16 file: each comment line (prefixed "# "), then one pattern per line."""
    lines = [f"# {c}" for c in comments]
    lines += ["# one fnmatch pattern or module name per line (as repeated --keep-bf16); # starts a comment"]
    for p in patterns:
        if not p or p.split() != [p] or "#" in p:
            raise ValueError(f"{p!r} cannot be written to a keep-BF16 file")  # module names have no space or #
        lines.append(p)
    return "\n".join(lines) + "\n"
