"""The one validator of task items: every document a task will ask (its evaluation items and, with
few-shot examples, its few-shot pool), checked before any model runs.

    check_items("my_mc", task, task.eval_docs)              # NVFP4ToolError on the first bad item
    check_fewshot("my_mc", task, 5, flag="--num-fewshot")   # the pool holds 5 examples per prompt

A multiple-choice item needs a non-empty list of options and a target that names one of them: an
integer index (not a boolean) in 0..len(options)-1, an option's text, or a list of such indices;
lm-eval itself would score `answer_index: -1` against the last option and an index past the end
silently as wrong. Any item needs its target field (a null is a missing field). The message names
the task, the item (its number, from 0, as lm-eval's doc_id) and the field.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError

_TEMPLATE_FIELD = re.compile(r"^\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}$")  # "{{options}}"


def field_of(task: Any, key: str) -> str:
    """The item field a task's `key` (doc_to_target, doc_to_choice) reads: the field itself, or the
    one field of a `{{field}}` template; otherwise the key's name."""
    value = getattr(task.config, key, None)
    if isinstance(value, str):
        if value in (getattr(task, "features", None) or ()):
            return value
        found = _TEMPLATE_FIELD.match(value.strip())
        if found:
            return found.group(1)
    return key


def check_items(name: str, task: Any, docs: Iterable[dict], *, what: str = "item") -> int:
    """Check every document of `docs` (see the module docstring); the number checked."""
    multiple_choice = getattr(task, "OUTPUT_TYPE", None) == "multiple_choice"
    target_field = field_of(task, "doc_to_target")
    choice_field = field_of(task, "doc_to_choice")
    count = 0
    for number, doc in enumerate(docs):
        count += 1
        where = f"task {name}: {what} {number}"
        if not isinstance(doc, dict):
            raise NVFP4ToolError(f"{where}: not an object of fields")
        if target_field != "doc_to_target" and doc.get(target_field) is None:
            raise NVFP4ToolError(f"{where}: no `{target_field}` field (the target)")
        if not multiple_choice:
            continue
        if choice_field != "doc_to_choice" and doc.get(choice_field) is None:
            raise NVFP4ToolError(f"{where}: no `{choice_field}` field (the options)")
        try:
            choices, target = task.doc_to_choice(doc), task.doc_to_target(doc)
        except Exception as bad:  # a template or function of the task failing on this item
            raise NVFP4ToolError(
                f"{where}: its options or target cannot be read ({type(bad).__name__}: {bad})"
            ) from None
        if not isinstance(choices, (list, tuple)) or not choices:
            raise NVFP4ToolError(
                f"{where}: `{choice_field}` is "
                + ("an empty list" if isinstance(choices, (list, tuple)) else f"{_kind(choices)}")
                + ", expected a non-empty list of options"
            )
        _check_target(where, target_field, target, list(choices))
    return count


def check_fewshot(name: str, task: Any, shots: int, *, flag: str) -> None:
    """Refuse `shots` few-shot examples per prompt where the task's pool has fewer (a usage error
    naming `flag` when the user asked for them, else the task's own num_fewshot), then check the
    pool's items."""
    if shots <= 0:
        return
    sampler = getattr(task, "sampler", None)
    pool = list(sampler.fewshot_docs()) if sampler is not None else list(task.fewshot_docs())
    own_split = task.fewshot_cfg.split is not None and task.fewshot_cfg.split == task.config.test_split
    most = len(pool) - 1 if own_split else len(pool)  # lm-eval leaves the asked item out of its own split
    if shots > most:
        message = (
            f"{flag} {shots}: task {name} has {len(pool)} few-shot example(s) in its pool"
            + (" (its evaluation split, less the item asked)" if own_split else "")
            + f", so at most {max(most, 0)} per prompt"
        )
        raise NVFP4UsageError(message) if flag.startswith("--") else NVFP4ToolError(message)
    check_items(name, task, pool, what="few-shot example")


def _check_target(where: str, field: str, target: Any, choices: list) -> None:
    count = len(choices)
    if isinstance(target, str):
        if target not in choices:
            raise NVFP4ToolError(f"{where}: `{field}` {target!r} is none of its {count} options")
        return
    for index in target if isinstance(target, list) and target else [target]:
        if isinstance(index, bool) or not isinstance(index, int):
            raise NVFP4ToolError(
                f"{where}: `{field}` is {_kind(index)} ({index!r}), expected an option index 0..{count - 1}"
            )
        if not 0 <= index < count:
            raise NVFP4ToolError(
                f"{where}: `{field}` {index} is outside its {count} option(s) (expected 0..{count - 1})"
            )


def _kind(value: Any) -> str:
    return {bool: "a boolean", str: "a string", float: "a number", type(None): "null", list: "a list"}.get(
        type(value), type(value).__name__
    )
