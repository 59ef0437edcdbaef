"""The precision file (`export --precision-file`, `train precision_file=`): per-linear formats.

    rules = read_precision_file("precision.txt")        # PrecisionRule(pattern, precision, "FILE:LINE"), in order
    precision = resolve_precisions(names, "nvfp4", rules)  # linear -> its precision, the last matching rule winning
    check_groups(names, precision, rules, always=routers)  # a fused group split across formats is refused

One `PATTERN FORMAT` a line (fnmatch over module names as stored; FORMAT one of `PRECISIONS`), `#`
starts a comment. Export and train read it here, so both resolve a file the same way.
Design notes: docs/design/export.md.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Iterable, Mapping

from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.families import scheme_group
from nvfp4tool.formats.spec import PRECISIONS


@dataclasses.dataclass(frozen=True)
class PrecisionRule:
    """One `PATTERN PRECISION` rule: linears whose name matches `pattern` (fnmatch) get `precision`."""

    pattern: str
    precision: str  # one of formats.PRECISIONS
    origin: str | None = None  # "FILE:LINE" of a rule read from a file; None: an option


def read_precision_file(path: str) -> tuple[PrecisionRule, ...]:
    """The rules of a precision file, in order: one `PATTERN PRECISION` a line (fnmatch over
    module names as stored; PRECISION one of formats.PRECISIONS), `#` starts a comment.
    NVFP4ToolError naming FILE:LINE for a line that is not that, or a file that is not UTF-8 text."""
    rules = []
    for where, words in read_rule_lines(path, "precision file (lines 'PATTERN FORMAT')"):
        if len(words) != 2 or words[1] not in PRECISIONS:
            raise NVFP4ToolError(
                f"{where}: {' '.join(words)!r}: expected 'PATTERN FORMAT' with FORMAT one of "
                f"{', '.join(PRECISIONS)} (# starts a comment)"
            )
        rules.append(PrecisionRule(words[0], words[1], where))
    return tuple(rules)


def resolve_precisions(names: Iterable[str], default: str, rules: Iterable[PrecisionRule]) -> dict[str, str]:
    """linear -> its precision: `default`, or the last rule that matches it."""
    names = tuple(names)
    precision = dict.fromkeys(names, default)
    for rule in rules:
        for n in names:
            if fnmatch.fnmatchcase(n, rule.pattern):
                precision[n] = rule.precision
    return precision


def check_groups(
    names: tuple[str, ...], precision: Mapping[str, str], rules: tuple[PrecisionRule, ...], always: Iterable[str]
) -> None:
    """Refuse a precision file that gives the members of one fused group (or the routed experts of
    one MoE layer: `families.scheme_group`) different quants (a member in bf16 keeps its whole fused
    group in BF16, as a keep-BF16 pattern does)."""
    always = set(always)
    members: dict[str, list[str]] = {}
    for n in names:
        if n not in always:
            members.setdefault(scheme_group(n), []).append(n)
    for group, modules in members.items():
        found = dict.fromkeys(precision[m] for m in modules)
        if len(found) > 1 and "bf16" not in found:
            where = next(
                (r.origin for r in reversed(rules) if any(fnmatch.fnmatchcase(m, r.pattern) for m in modules)), None
            )
            shown = ", ".join(modules[:3]) + (f", ... ({len(modules)} linears)" if len(modules) > 3 else "")
            raise NVFP4ToolError(
                f"{where or '--precision-file'}: fused group {group} ({shown}) would be split "
                f"across {' / '.join(found)}; serving runs its members as one fused layer of one scheme: "
                f"give them one format"
            )


def read_rule_lines(path: str, kind: str) -> list[tuple[str, list[str]]]:
    """[("PATH:LINE", words)] of the non-empty lines of a rules file, comments (#) stripped."""
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
    except UnicodeDecodeError as bad:
        raise NVFP4ToolError(f"{path}: not UTF-8 text (byte {bad.start}); expected a {kind}") from None
    except OSError as bad:
        raise NVFP4ToolError(f"{path}: cannot read ({bad.strerror})") from None
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if words:
            found.append((f"{path}:{number}", words))
    return found
