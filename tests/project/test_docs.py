"""The docs against the code: every option and train key on its page, every relative link resolving, a short README,
short module docstrings whose design notes live in docs/design/."""

from __future__ import annotations

import ast
import pathlib
import re

import click
import pytest

from nvfp4tool.cli import cli
from nvfp4tool.run.config import key_table

from fixtures import REPO_ROOT

ROOT = pathlib.Path(REPO_ROOT)
COMMANDS_DIR = ROOT / "docs" / "commands"
README_MAX_LINES = 250
DESIGN_DIR = ROOT / "docs" / "design"
PACKAGES = ("nvfp4tool", "converters")
DOCSTRING_MAX_LINES = 15
# "Design notes: docs/design/X.md" in a module docstring; a page's "## `path/to/module.py`" sections
DESIGN_POINTER = re.compile(r"Design notes: (docs/design/[^\s]+?\.md)\b")
DESIGN_SECTION = re.compile(r"^## `([^`]+\.py)`$", re.MULTILINE)
# [text](target) and [text](target "title"), not images' inner brackets; the target up to a space or ")"
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)


def _options(command: click.Command) -> list[str]:
    """Every spelling of every option of `command` (primary and secondary, e.g. --no-scan-layers),
    hidden ones included, --help / -h left out."""
    names = []
    for param in command.params:
        if not isinstance(param, click.Option) or "--help" in param.opts:
            continue
        names += [*param.opts, *param.secondary_opts]
    return names


def _all_options(command: click.Command) -> list[str]:
    """`_options` of a command and, for a group (`data`), of each of its subcommands."""
    names = _options(command)
    for sub in getattr(command, "commands", {}).values():
        names += _all_options(sub)
    return names


def _mentions(text: str, option: str) -> bool:
    """`option` appears as a whole word: `--to` is not found inside `--top`, `-o` not inside `--out`."""
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text) is not None


def _markdown_files() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _module_docstrings() -> dict[str, str]:
    """{repository-relative path: module docstring ("" when none)} of every module of the packages."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            found[path.relative_to(ROOT).as_posix()] = ast.get_docstring(tree) or ""
    return found


def _links(text: str) -> list[str]:
    """The link targets of a Markdown text outside fenced code blocks."""
    return LINK.findall(FENCE.sub("", text))


@pytest.mark.parametrize("name", sorted(cli.commands))
def test_every_command_has_a_page_naming_all_its_options(name):
    page = COMMANDS_DIR / f"{name}.md"
    assert page.is_file(), f"nvfp4tool {name} has no page {page.relative_to(ROOT)}"
    text = page.read_text(encoding="utf-8")
    missing = [option for option in _all_options(cli.commands[name]) if not _mentions(text, option)]
    assert not missing, f"{page.relative_to(ROOT)} does not mention {', '.join(missing)}"


def test_the_common_page_names_the_global_options():
    page = COMMANDS_DIR / "README.md"
    text = page.read_text(encoding="utf-8")
    missing = [option for option in _options(cli) if not _mentions(text, option)]
    assert not missing, f"{page.relative_to(ROOT)} does not mention {', '.join(missing)}"


def test_every_train_key_is_on_the_train_page():
    text = (COMMANDS_DIR / "train.md").read_text(encoding="utf-8")
    missing = [key for key, *_ in key_table() if f"`{key}`" not in text]
    assert not missing, f"docs/commands/train.md does not name the train keys {', '.join(missing)}"


def test_every_relative_link_resolves():
    broken = []
    for path in _markdown_files():
        for target in _links(path.read_text(encoding="utf-8")):
            if re.match(r"(?i)(https?:|mailto:)", target):
                continue
            relative = target.split("#", 1)[0]
            if relative and not (path.parent / relative).exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert not broken, "links to missing files:\n  " + "\n  ".join(broken)


def test_the_link_check_reads_every_design_page():
    pages = sorted(DESIGN_DIR.glob("*.md"))
    assert pages, "docs/design/ has no pages"
    unchecked = set(pages) - set(_markdown_files())
    assert not unchecked, f"the link check skips {sorted(p.relative_to(ROOT).as_posix() for p in unchecked)}"
    architecture = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    unlisted = [p.name for p in pages if f"(design/{p.name})" not in architecture]
    assert not unlisted, f"docs/architecture.md's Design notes do not link {', '.join(unlisted)}"


def test_module_docstrings_are_short():
    too_long = [
        f"{path}: {len(doc.splitlines())} lines"
        for path, doc in _module_docstrings().items()
        if len(doc.splitlines()) > DOCSTRING_MAX_LINES
    ]
    assert not too_long, (
        f"module docstrings over {DOCSTRING_MAX_LINES} lines (move the design notes to docs/design/ "
        "and end the docstring with 'Design notes: docs/design/X.md.'):\n  " + "\n  ".join(too_long)
    )


def test_design_pointers_and_sections_agree():
    """Every "Design notes: docs/design/X.md" names a page holding a section of that module, and
    every section of a page is of an existing module whose docstring points to that page."""
    docstrings = _module_docstrings()
    problems = []
    sections = {}
    for page in sorted(DESIGN_DIR.glob("*.md")):
        for module in DESIGN_SECTION.findall(page.read_text(encoding="utf-8")):
            sections.setdefault(module, []).append(page.relative_to(ROOT).as_posix())
    for module, pages in sorted(sections.items()):
        if len(pages) > 1:
            problems.append(f"{module}: a section on {', '.join(pages)}")
        if module not in docstrings:
            problems.append(f"{pages[0]}: a section of {module}, which does not exist")
        elif pages[0] not in DESIGN_POINTER.findall(docstrings[module]):
            problems.append(f"{module}: its docstring does not say 'Design notes: {pages[0]}.'")
    for module, doc in docstrings.items():
        for target in DESIGN_POINTER.findall(doc):
            if not (ROOT / target).is_file():
                problems.append(f"{module}: points to {target}, which does not exist")
            elif target not in sections.get(module, []):
                problems.append(f"{module}: points to {target}, which has no section `{module}`")
    assert not problems, "design notes:\n  " + "\n  ".join(problems)


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines, at most {README_MAX_LINES}"


def test_the_inner_loop_is_cis_command_less_the_slow_tests():
    """docs/testing.md's inner loop is the command we run: CI's (.ci/run: two workers, each test file
    on one) with `-m "not slow"`, not the same tests in one process."""
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("python -m pytest")]
    page = (ROOT / "docs" / "testing.md").read_text(encoding="utf-8").splitlines()
    inner = [
        line.partition("#")[0].strip() for line in page if line.partition("#")[2].strip().startswith("the inner loop")
    ]
    assert len(ci) == 1 and inner == [f'{ci[0]} -m "not slow"'], (ci, inner)


def test_the_checks_see_what_they_look_for(tmp_path):
    """The helpers themselves: whole-word option matching, links outside code blocks only, anchors."""
    assert _mentions("| `--scan-layers` / `--no-scan-layers` |", "--no-scan-layers")
    assert not _mentions("`--top`", "--to") and not _mentions("--out", "-o") and _mentions("`-o`, `--out`", "-o")
    text = "[a](x.md#part) [b](https://e.org) ![c](img.png)\n```\n[d](inside.md)\n```\n[e](<y z.md>)"
    assert _links(text) == ["x.md#part", "https://e.org", "img.png"]
    assert [o for p in cli.commands["convert"].params for o in p.secondary_opts] == ["--no-scan-layers"]
