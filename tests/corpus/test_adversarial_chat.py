"""The adversarial corpus of fine-tuning rows (`corpus/chat.py`): each case is one bad row, option or
tokenizer given to `data prepare --format chat|prompt_completion` or `train format=...`, run
in-process by `adversarial_harness.run_case`: the exit code, one `Error:` line naming the row
(`file:line`) and the field, no traceback, nothing created or changed.

Fixture (module-scoped `pristine`, no model): the suite's chat tokenizer (SmolLM2-Instruct's
template), the BPE tokenizer without a template, and a good conversation.
"""

from __future__ import annotations

import json
import shutil

import pytest

from fixtures.adversarial_harness import Case, World, registrar, run_case

CASES: list[Case] = []
case = registrar(CASES)

GOOD = {"messages": [{"role": "user", "content": "Who is Helena?"}, {"role": "assistant", "content": "A gentlewoman."}]}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, chat_tokenizer, corpus_tokenizer) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adversarial-chat")
    shutil.copytree(chat_tokenizer, root / "tok")
    shutil.copytree(corpus_tokenizer, root / "plain")
    return {"tok": str(root / "tok"), "plain": str(root / "plain")}


def _rows(w: World, *bad, good: int = 2, name: str = "rows.jsonl") -> str:
    """A JSONL file: `good` good conversations, then the bad rows (line good + 1, ...)."""
    lines = [json.dumps(GOOD)] * good + [b if isinstance(b, str) else json.dumps(b) for b in bad]
    return w.file(name, "\n".join(lines) + "\n")


def _prepare(w: World, rows: str, *extra: str, tokenizer: str = "tok") -> list[str]:
    return [
        "data",
        "prepare",
        rows,
        "--tokenizer",
        w.copy(tokenizer),
        "--out",
        w.path("cache"),
        "--workers",
        "0",
        *extra,
    ]


def _chat_row_case(id: str, row, *names: str) -> None:
    @case(f"prepare/chat/{id}", 1)
    def _(w):
        return _prepare(w, _rows(w, row), "--format", "chat"), ("rows.jsonl:3", *names)


def _pc_row_case(id: str, row, *names: str) -> None:
    @case(f"prepare/prompt_completion/{id}", 1)
    def _(w):
        return _prepare(w, _rows(w, row, good=0), "--format", "prompt_completion"), ("rows.jsonl:1", *names)


USER = {"role": "user", "content": "a"}
_chat_row_case("no-messages", {"text": "a"}, "no 'messages' field")
_chat_row_case("messages-not-a-list", {"messages": {"role": "user"}}, "messages: expected a list")
_chat_row_case("empty-conversation", {"messages": []}, "messages: an empty conversation")
_chat_row_case("message-not-an-object", {"messages": [USER, "b"]}, "messages[1]: expected an object")
_chat_row_case("no-role", {"messages": [{"content": "a"}]}, "messages[0]: no 'role'")
_chat_row_case("no-content", {"messages": [USER, {"role": "assistant"}]}, "messages[1]: no 'content'")
_chat_row_case("content-not-a-string", {"messages": [USER, {"role": "assistant", "content": ["x"]}]},
               "messages[1].content: expected a string, got list")  # fmt: skip
_chat_row_case("unknown-role", {"messages": [USER, {"role": "tool", "content": "b"}]}, "unknown role 'tool'")
_chat_row_case("late-system", {"messages": [USER, {"role": "system", "content": "b"}]}, "allowed first only")
_chat_row_case("no-assistant-turn", {"messages": [USER]}, "messages: no assistant turn")
_chat_row_case("row-not-an-object", [1, 2], "expected a JSON object, got list")
_chat_row_case("not-json", "{messages: [", "not valid JSON")
_pc_row_case("no-completion", {"prompt": "a"}, "no 'completion' field")
_pc_row_case("mixed-kinds", {"prompt": "a", "completion": [USER]}, "prompt / completion: expected two strings")


@case("prepare/chat/tokenizer-without-template", 1)
def _(w):
    argv = _prepare(w, _rows(w), "--format", "chat", tokenizer="plain")
    return argv, (w.path("plain"), "the tokenizer has no chat template")


@case("prepare/chat/template-cannot-mark-the-assistant", 1)
def _(w):
    tokenizer = w.copy("tok", "odd-tok")
    w.file(
        "odd-tok/chat_template.jinja",
        "{% for m in messages %}{% if loop.last %}!{% endif %}{{ m['content'] }}{% endfor %}",
    )
    argv = ["data", "prepare", _rows(w), "--format", "chat", "--tokenizer", tokenizer, "--out", w.path("cache")]
    return argv, (tokenizer, "the chat template cannot mark the assistant's span", "rows.jsonl:1")


@case("prepare/text-file-holds-no-rows", 1)
def _(w):
    return _prepare(w, w.file("a.txt", "To be.\n"), "--format", "chat"), ("a.txt", "holds no rows")


@case("prepare/loss-on-for-text", 2)
def _(w):
    return _prepare(w, _rows(w), "--loss-on", "all"), ("loss_on=all", "only for format chat")


@case("prepare/chat/loss-on-completion", 2)
def _(w):
    return _prepare(w, _rows(w), "--format", "chat", "--loss-on", "completion"), (
        "loss_on=completion",
        "assistant | all",
    )


@case("train/chat/loss-on-completion", 2)
def _(w):
    argv = ["train", f"data={_rows(w)}", "format=chat", "loss_on=completion", f"tokenizer={w.copy('tok')}"]
    return [*argv, f"out={w.path('run')}"], ("loss_on=completion", "assistant | all")


@case("train/chat/unknown-role", 1)
def _(w):
    rows = _rows(w, {"messages": [USER, {"role": "robot", "content": "b"}]})
    argv = ["train", f"data={rows}", "format=chat", f"tokenizer={w.copy('tok')}", f"out={w.path('run')}"]
    return argv, ("rows.jsonl:3", "messages[1].role: unknown role 'robot'")


@case("train/chat/tokenizer-trained-here", 2)
def _(w):
    return ["train", f"data={_rows(w)}", "format=chat", f"out={w.path('run')}"], ("format=chat", "tokenizer=FOLDER")


@case("train/overlong-for-text", 2)
def _(w):
    data = w.file("a.txt", "To be.\n" * 200)
    argv = ["train", f"data={data}", "overlong=truncate"]
    return [*argv, f"out={w.path('run')}"], ("overlong=truncate", "only for format chat")


@pytest.mark.parametrize("adversarial", CASES, ids=lambda c: c.id)
def test_adversarial_chat(adversarial, pristine, tmp_path, monkeypatch, hub_env):
    run_case(adversarial, pristine, tmp_path, monkeypatch)
