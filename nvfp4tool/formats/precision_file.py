"""The precision file (`export --precision-file`, `train precision_file=`): per-linear formats.

    rules = read_precision_file("precision.txt")        # PrecisionRule(pattern, precision, "FILE:LINE"), in order
    precision = resolve_precisions(names, "nvfp4", rules)  # linear -> its precision, the last matching rule winning
    check_groups(names, precision, rules, always=routers)  # a fused group split across formats is refused
    rules = precision_rules("out/m-mixed", names)          # train from a mixed export: its per-linear formats

One `PATTERN FORMAT` a line (fnmatch over module names as stored; FORMAT one of `PRECISIONS`), `#`
starts a comment. Export and train read it here, so both resolve a file the same way;
`format_precision_file` writes one; `parse_precision_text` reads one from a text (`--auto-precision`).
Design notes: docs/design/export.md.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
from collections.abc import Iterable, Mapping

from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.families import scheme_group
from nvfp4tool.formats.spec import PRECISIONS
from nvfp4tool.records.export import ExportRecord


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
    return _rules(read_rule_lines(path, "precision file (lines 'PATTERN FORMAT')"))


def parse_precision_text(text: str, origin: str) -> tuple[PrecisionRule, ...]:
    """`read_precision_file` of a text (`export --auto-precision`'s result), lines named "ORIGIN:LINE"."""
    return _rules(rule_lines(text, origin))


def _rules(lines: list[tuple[str, list[str]]]) -> tuple[PrecisionRule, ...]:
    rules = []
    for where, words in lines:
        if len(words) != 2 or words[1] not in PRECISIONS:
            raise NVFP4ToolError(
                f"{where}: {' '.join(words)!r}: expected 'PATTERN FORMAT' with FORMAT one of "
                f"{', '.join(PRECISIONS)} (# starts a comment)"
            )
        rules.append(PrecisionRule(words[0], words[1], where))
    return tuple(rules)


def precision_rules(path: str, names: Iterable[str]) -> tuple[PrecisionRule, ...]:
    """The rules of `path`: a precision file's lines, or for an export folder (a mixed one) one rule
    per linear of `names` its record's precision map gives a format (the linears it quantized and
    the ones it kept in BF16), in `names` order, each naming the record as its origin."""
    if not os.path.isdir(path):
        return read_precision_file(path)
    record = ExportRecord.read(path)
    where = os.path.join(path, ExportRecord.FILE_NAME)
    return tuple(
        PrecisionRule(n, record.precision_map[n], f"{where}: precision_map[{n!r}]")
        for n in names
        if n in record.precision_map
    )


def format_precision_file(rules: Iterable[PrecisionRule], comments: Iterable[str] = ()) -> str:
    """The text of a precision file holding `rules` in order (`read_precision_file` reads them back):
    each comment line (prefixed "# "), then one `PATTERN FORMAT` line per rule."""
    lines = [f"# {c}" for c in comments]
    for rule in rules:
        if rule.pattern.split() != [rule.pattern] or "#" in rule.pattern or rule.precision not in PRECISIONS:
            raise ValueError(f"{rule} cannot be written to a precision file")  # module names have no space or #
        lines.append(f"{rule.pattern} {rule.precision}")
    return "\n".join(lines) + "\n"


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
    return rule_lines(text, path)


def rule_lines(text: str, origin: str) -> list[tuple[str, list[str]]]:
    """[("ORIGIN:LINE", words)] of the non-empty lines of a rules text, comments (#) stripped."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if words:
            found.append((f"{origin}:{number}", words))
    return found
