"""Which linear modules an export quantizes, how they group, and what stays BF16.

    plan = make_plan(config, "nvfp4", precision_map=run_pmap, keep_bf16=("*.down_proj",))
    plan.quantized, plan.excluded, plan.groups

Each linear gets one precision (`formats.PRECISIONS`): `--quant`, unless a precision rule says
otherwise (`PrecisionRule`: a `--precision-file` line, the last matching one wins; a keep-BF16
pattern is a rule to "bf16"). `lm_head` and MoE routers are never quantized; a fused group shares
one format (a bf16 rule keeps it whole in BF16; one split across quants is refused).
`read_keep_bf16_file` / `format_keep_bf16_file`: the keep-BF16 file (the precision file:
`formats.precision_file`, re-exported here).
Design notes: docs/design/export.md.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Iterable, Mapping

from nvfp4tool.config import ModelConfig
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError
from nvfp4tool.families import fused_group
from nvfp4tool.formats import MIXED, QUANTS, STATIC_INPUT_QUANTS
from nvfp4tool.formats.precision_file import (
    PrecisionRule,
    check_groups,
    read_rule_lines,
    resolve_precisions,
)
from nvfp4tool.formats.precision_file import (
    read_precision_file as read_precision_file,  # re-exported: export's callers read it here
)
from nvfp4tool.numerics.constants import FP8_BLOCK, NVFP4_BLOCK


@dataclasses.dataclass(frozen=True)
class ExportPlan:
    """The quantization plan of one export."""

    quant: str  # one of nvfp4tool.formats.QUANTS, or MIXED when the quantized linears differ
    quantized: tuple[str, ...]  # linear module names quantized, in model order
    excluded: tuple[str, ...]  # linear module names kept BF16 (always includes lm_head)
    groups: Mapping[str, tuple[str, ...]]  # fused group -> its quantized members
    quants: Mapping[str, str] = dataclasses.field(default_factory=dict)  # quantized module -> its quant

    @property
    def is_mixed(self) -> bool:
        return self.quant == MIXED

    @property
    def has_input_scales(self) -> bool:
        """W4A4 and FP8 W8A8 per tensor ship calibrated input scales; weight-only NVFP4 and
        fp8-block (dynamic activation scales) do not (mixed: any linear's)."""
        if self.is_mixed:
            return any(q in STATIC_INPUT_QUANTS for q in self.quants.values())
        return self.quant in STATIC_INPUT_QUANTS

    def quant_of(self, module: str) -> str:
        """The quant of the quantized linear `module`."""
        return self.quants.get(module, self.quant)

    def group_of(self, module: str) -> str:
        return fused_group(module)


def make_plan(
    config: ModelConfig,
    quant: str,
    *,
    precision_map: Mapping[str, str] | None = None,
    keep_bf16: Iterable[str] = (),
    keep_bf16_origin: Mapping[str, str] | None = None,
    rules: Iterable[PrecisionRule] = (),
) -> ExportPlan:
    """The plan for `config` under `quant`; NVFP4ToolError for an unknown quant or a K % 16 != 0.
    `keep_bf16_origin`: pattern -> "FILE:LINE" of the patterns read from a keep-BF16 file (a bad
    one is then refused naming that line, exit 1, rather than as an option, exit 2). `rules`: a
    precision file's, applied in order (the last matching one wins), before the keep-BF16 patterns."""
    if quant not in QUANTS:
        raise NVFP4ToolError(f"unknown --quant {quant!r}; choose one of {', '.join(QUANTS)}")
    origin = keep_bf16_origin or {}
    rules = tuple(rules)
    names = config.linear_names()
    if precision_map is not None:
        missing = [n for n in names if n not in precision_map]
        if missing:
            raise NVFP4ToolError(f"precision map has no entry for {missing[0]} ({len(missing)} linear modules missing)")
    keep_rules = tuple(PrecisionRule(p, "bf16", origin.get(p)) for p in keep_bf16)
    for rule in rules + keep_rules:
        _check_used(rule, names)
    always = config.modules.kept()  # lm_head, routers
    precision = resolve_precisions(names, quant, rules)
    check_groups(names, precision, rules, always)
    keep = {
        n
        for n in names
        if n in always
        or precision[n] == "bf16"
        or (precision_map is not None and precision_map[n] == "bf16")
        or any(fnmatch.fnmatchcase(n, r.pattern) for r in keep_rules)
    }
    kept_groups = {fused_group(n) for n in keep}
    keep |= {n for n in names if fused_group(n) in kept_groups}  # a group is quantized whole
    quantized = tuple(n for n in names if n not in keep)
    shapes = config.expected_tensor_shapes()
    for block, why in ((NVFP4_BLOCK, ""), (FP8_BLOCK, " (fp8-block: activations are quantized per 128 columns)")):
        ragged = [
            n
            for n in quantized
            if (precision[n] == "fp8-block") == (block == FP8_BLOCK) and shapes[f"{n}.weight"][1] % block != 0
        ]
        if ragged:
            advice = " ".join(f"--keep-bf16 '{p}'" for p in _patterns_for(ragged))
            raise NVFP4ToolError(
                f"{ragged[0]}.weight: in_features {shapes[f'{ragged[0]}.weight'][1]} is "
                f"not a multiple of {block}{why} ({len(ragged)} module(s) like it); "
                f"keep them in BF16 with {advice}"
            )
    groups: dict[str, tuple[str, ...]] = {}
    for name in quantized:
        groups[fused_group(name)] = groups.get(fused_group(name), ()) + (name,)
    quants = {n: precision[n] for n in quantized}
    used = set(quants.values())
    plan_quant = quant if not used else (next(iter(used)) if len(used) == 1 else MIXED)
    return ExportPlan(
        quant=plan_quant,
        quantized=quantized,
        excluded=tuple(n for n in names if n in keep),
        groups=groups,
        quants=quants if plan_quant == MIXED else {},
    )


def _check_used(rule: PrecisionRule, names: tuple[str, ...]) -> None:
    if any(fnmatch.fnmatchcase(n, rule.pattern) for n in names):
        return
    why = (
        f"{rule.pattern!r} matches no linear module of the model (e.g. {names[0]}); "
        f"patterns are fnmatch over full module names"
    )
    if rule.origin is not None:
        raise NVFP4ToolError(f"{rule.origin}: {why}")
    raise NVFP4UsageError(f"--keep-bf16 {why}")


def _patterns_for(modules: list[str]) -> list[str]:
    """fnmatch patterns covering `modules`, the layer index wildcarded (one projection has the
    same in_features in every layer of these models, so the pattern names exactly those)."""
    return list(dict.fromkeys(".".join("*" if p.isdigit() else p for p in m.split(".")) for m in modules))


def read_keep_bf16_file(path: str) -> dict[str, str]:
    """The patterns of a keep-BF16 file, in order: {pattern: "PATH:LINE"} (see the module
    docstring): a precision file whose lines name only the pattern (the precision is bf16).
    NVFP4ToolError naming the file (and line) for a file that is not UTF-8 text or a line holding
    more than one word; no pattern at all is allowed (nothing more kept in BF16)."""
    patterns: dict[str, str] = {}
    for where, words in read_rule_lines(path, "keep-BF16 file (one fnmatch pattern or module name per line)"):
        if len(words) > 1:
            raise NVFP4ToolError(
                f"{where}: {' '.join(words)!r}: expected one fnmatch pattern or module name per line "
                f"(# starts a comment)"
            )
        patterns.setdefault(words[0], where)
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
