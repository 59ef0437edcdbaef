"""Chat and prompt/completion rows (nvfp4tool/corpus/chat.py): the assistant mask against
transformers' `return_assistant_tokens_mask` with SmolLM2-Instruct's template, prompt/completion
marks against TRL's rule, loss_on=all, overlong rows, every bad row in one line, the shipped set."""

from __future__ import annotations

import json
import pickle
import shutil

import numpy as np
import pytest
from transformers import AutoTokenizer

from nvfp4tool.corpus.chat import SftCounts, SftEncoder, SftSpec, encode_rows
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError

from fixtures.chat_fixtures import SMOLLM2_CHAT_TEMPLATE, SMOLLM2_MARKED_TEMPLATE

SYSTEM = {"role": "system", "content": "Answer in the words of the play."}
CONVERSATIONS = [
    [{"role": "user", "content": "Who is Bertram?"}, {"role": "assistant", "content": "Count of Rousillon."}],
    [
        SYSTEM,
        {"role": "user", "content": "What hope is there of his majesty's amendment?"},
        {"role": "assistant", "content": "He hath abandoned his physicians, madam."},
        {"role": "user", "content": "Continue."},
        {"role": "assistant", "content": "under whose practices he hath persecuted time with hope"},
    ],
    # contents that open with blank lines and spaces: tokens that cut the span's edges
    [
        {"role": "user", "content": "\n\nSay it twice."},
        {"role": "assistant", "content": "\n  O, were that all!"},
        {"role": "user", "content": " "},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "Thanks."},
    ],
    [{"role": "user", "content": "Ünïcödé — “quotes”?"}, {"role": "assistant", "content": "Ay — “so”."}],
]


def _reference(folder, messages, template):
    """transformers' ids and assistant mask for `messages` rendered with `template`."""
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    out = tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return np.asarray(out["input_ids"]), np.asarray(out["assistant_masks"], bool)


def _with_template(source, out, template):
    """A copy of the tokenizer folder `source` with `template` as its chat template."""
    shutil.copytree(source, out)
    (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    return out


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_assistant_mask_equals_transformers_generation_mask(chat_tokenizer, messages):
    """The prefix-by-prefix method on SmolLM2's template as shipped (no generation markers) gives
    transformers' `return_assistant_tokens_mask` of the same template with the markers added."""
    assert (chat_tokenizer / "chat_template.jinja").read_text() == SMOLLM2_CHAT_TEMPLATE  # no generation markers
    assert "{% generation %}" not in SMOLLM2_CHAT_TEMPLATE
    ids_ref, mask_ref = _reference(chat_tokenizer, messages, SMOLLM2_MARKED_TEMPLATE)
    encoded = SftEncoder(chat_tokenizer, SftSpec("chat")).encode({"messages": messages}, "rows.jsonl:1")
    assert encoded.status == "kept"
    np.testing.assert_array_equal(encoded.ids, ids_ref)
    np.testing.assert_array_equal(encoded.loss, mask_ref)
    assert mask_ref.any() and not mask_ref.all()


def test_loss_tokens_are_the_assistant_turn_and_its_end(chat_tokenizer):
    """Read back as text, the marked tokens are the assistant's content and the `<|im_end|>\\n`
    that ends its turn (what TRL's training templates put inside the generation markers)."""
    tokenizer = AutoTokenizer.from_pretrained(str(chat_tokenizer))
    encoded = SftEncoder(chat_tokenizer, SftSpec("chat")).encode({"messages": CONVERSATIONS[1]}, "rows.jsonl:2")
    runs, current = [], []
    for token, loss in zip(encoded.ids.tolist(), encoded.loss.tolist()):
        if loss:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    assert [tokenizer.decode(run) for run in runs + [current] if run] == [
        "He hath abandoned his physicians, madam.<|im_end|>\n",
        "under whose practices he hath persecuted time with hope<|im_end|>\n",
    ]


def test_generation_markers_take_the_template_path(chat_tokenizer, marked_chat_tokenizer, tmp_path):
    """A template with `{% generation %}` markers is read through transformers' mask: the
    SmolLM2 template marked as TRL marks it gives the same mask as the prefix method, and one
    marking the content only (not `<|im_end|>`) gives its own, different mask."""
    content_only = (
        SMOLLM2_CHAT_TEMPLATE.split("{{'<|im_start|>' + message['role']")[0]
        + "{{'<|im_start|>' + message['role'] + '\\n'}}"
        + "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{% endgeneration %}"
        + "{% else %}{{ message['content'] }}{% endif %}{{ '<|im_end|>' + '\\n' }}{% endfor %}"
        + "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    folder = _with_template(chat_tokenizer, tmp_path / "content-only", content_only)
    for messages in CONVERSATIONS[:2]:
        row = {"messages": messages}
        marked = SftEncoder(marked_chat_tokenizer, SftSpec("chat")).encode(row, "r:1")
        prefix = SftEncoder(chat_tokenizer, SftSpec("chat")).encode(row, "r:1")
        np.testing.assert_array_equal(marked.ids, prefix.ids)
        np.testing.assert_array_equal(marked.loss, prefix.loss)
        ids_ref, mask_ref = _reference(folder, messages, content_only)
        ours = SftEncoder(folder, SftSpec("chat")).encode(row, "r:1")
        np.testing.assert_array_equal(ours.ids, ids_ref)
        np.testing.assert_array_equal(ours.loss, mask_ref)
        assert ours.loss.sum() < prefix.loss.sum()  # <|im_end|>\n of each turn left out


def test_loss_on_all(chat_tokenizer):
    row = {"messages": CONVERSATIONS[1]}
    assistant = SftEncoder(chat_tokenizer, SftSpec("chat")).encode(row, "r:1")
    everything = SftEncoder(chat_tokenizer, SftSpec("chat", loss_on="all")).encode(row, "r:1")
    np.testing.assert_array_equal(everything.ids, assistant.ids)
    assert everything.loss.all()
    plain = {"prompt": "Who speaks?", "completion": " Helena."}
    encoded = SftEncoder(chat_tokenizer, SftSpec("prompt_completion", loss_on="all")).encode(plain, "r:1")
    assert encoded.loss.all() and len(encoded.ids) > 2


def test_prompt_completion_strings_follow_trl(chat_tokenizer, corpus_tokenizer):
    """Plain strings: the ids of prompt + completion and the end-of-text id; the marks are TRL's
    (the tokens after the prompt's, computed here from `tokenizers` directly) and the end of text."""
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(corpus_tokenizer / "tokenizer.json"))
    eos = raw.token_to_id("<|endoftext|>")
    for prompt, completion in [("Question: who is Helena?\n", "Answer: a gentlewoman."), ("KING.\n", ""), ("", "All")]:
        encoded = SftEncoder(chat_tokenizer, SftSpec("prompt_completion")).encode(
            {"prompt": prompt, "completion": completion}, "pc.jsonl:3"
        )
        prompt_ids = raw.encode(prompt, add_special_tokens=False).ids
        full_ids = raw.encode(prompt + completion, add_special_tokens=False).ids
        assert full_ids[: len(prompt_ids)] == prompt_ids
        assert encoded.ids.tolist() == full_ids + [eos]
        assert encoded.loss.tolist() == [False] * len(prompt_ids) + [True] * (len(full_ids) - len(prompt_ids) + 1)


def test_prompt_completion_messages_follow_the_template(chat_tokenizer):
    """Conversational prompt / completion: rendered with the template; the completion's tokens
    carry loss, as the assistant mask of the same conversation marks them."""
    messages = CONVERSATIONS[1]
    row = {"prompt": messages[:4], "completion": messages[4:]}
    encoded = SftEncoder(chat_tokenizer, SftSpec("prompt_completion")).encode(row, "pc.jsonl:1")
    ids_ref, mask_ref = _reference(chat_tokenizer, messages, SMOLLM2_MARKED_TEMPLATE)
    last_turn = mask_ref.copy()
    last_turn[: np.flatnonzero(~mask_ref)[-1]] = False  # the last assistant turn only
    np.testing.assert_array_equal(encoded.ids, ids_ref)
    np.testing.assert_array_equal(encoded.loss, last_turn)
    assert last_turn.sum() < mask_ref.sum()


BAD_CHAT = [
    (["not", "an", "object"], "expected a JSON object, got list"),
    ({"text": "hello"}, "no 'messages' field"),
    ({"messages": "hello"}, "messages: expected a list of messages, got str"),
    ({"messages": []}, "messages: an empty conversation"),
    ({"messages": ["hi"]}, "messages[0]: expected an object with role and content, got str"),
    ({"messages": [{"content": "hi"}]}, "messages[0]: no 'role'"),
    ({"messages": [{"role": "user"}]}, "messages[0]: no 'content'"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content: expected a string, got int"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content: expected a string, got NoneType"),
    (
        {"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]},
        "messages[1].role: unknown role 'tool'",
    ),
    (
        {"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]},
        "messages[1].role: a system message is allowed first only",
    ),
    ({"messages": [{"role": "user", "content": "a"}]}, "messages: no assistant turn"),
    (
        {"messages": [{"role": "assistant", "content": "a"}]},
        "messages[0]: the conversation opens with an assistant turn",
    ),
]


@pytest.mark.parametrize("row, problem", BAD_CHAT)
def test_bad_chat_rows_refused_in_one_line(chat_tokenizer, row, problem):
    with pytest.raises(NVFP4ToolError) as caught:
        SftEncoder(chat_tokenizer, SftSpec("chat")).encode(row, "data/chat.jsonl:7")
    message = str(caught.value)
    assert message.startswith("data/chat.jsonl:7: ") and problem in message and "\n" not in message
    assert not isinstance(caught.value, NVFP4UsageError)


BAD_PROMPT_COMPLETION = [
    ({"prompt": "a"}, "no 'completion' field"),
    ({"completion": "a"}, "no 'prompt' field"),
    ({"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]}, "expected two strings or two lists"),
    ({"prompt": 1, "completion": "b"}, "got int / str"),
    ({"prompt": [{"role": "user", "content": "a"}], "completion": []}, "completion: an empty list of messages"),
    (
        {"prompt": [{"role": "user", "content": "a"}], "completion": [{"role": "robot", "content": "b"}]},
        "prompt + completion message 1.role: unknown role 'robot'",
    ),
]


@pytest.mark.parametrize("row, problem", BAD_PROMPT_COMPLETION)
def test_bad_prompt_completion_rows_refused_in_one_line(chat_tokenizer, row, problem):
    with pytest.raises(NVFP4ToolError) as caught:
        SftEncoder(chat_tokenizer, SftSpec("prompt_completion")).encode(row, "dataset row 4")
    message = str(caught.value)
    assert message.startswith("dataset row 4: ") and problem in message and "\n" not in message


def test_unusable_templates_are_refused(chat_tokenizer, corpus_tokenizer, tmp_path):
    """A template whose earlier turns render differently once a later turn follows (here: the last
    message is flagged) has no generation markers and no prefix property: refused naming the folder;
    a template's own refusal and a tokenizer without a template: one line each."""
    template = (
        "{% for message in messages %}{% if loop.last %}<|im_start|>{% endif %}{{ message['content'] }}"
        "{% endfor %}{% if add_generation_prompt %}<|im_end|>{% endif %}"
    )
    folder = _with_template(chat_tokenizer, tmp_path / "unmarkable", template)
    with pytest.raises(NVFP4ToolError) as caught:
        SftEncoder(folder, SftSpec("chat")).encode({"messages": CONVERSATIONS[0]}, "c.jsonl:1")
    message = str(caught.value)
    assert message.startswith(f"{folder}: the chat template cannot mark the assistant's span: ")
    assert "c.jsonl:1" in message and "\n" not in message
    # a template's own refusal (Mistral's templates raise on roles that do not alternate)
    strict = _with_template(
        chat_tokenizer,
        tmp_path / "strict",
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}",
    )
    pair = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]
    with pytest.raises(NVFP4ToolError) as caught:
        SftEncoder(strict, SftSpec("chat")).encode({"messages": pair}, "c.jsonl:2")
    assert str(caught.value) == (
        f"c.jsonl:2: the chat template of {strict} refused the conversation "
        "(Conversation roles must alternate user/assistant/user/assistant/...)"
    )
    # loss_on=all needs no span
    assert SftEncoder(folder, SftSpec("chat", loss_on="all")).encode({"messages": CONVERSATIONS[0]}, "c:1").loss.all()
    # no template at all
    with pytest.raises(NVFP4ToolError, match="the tokenizer has no chat template"):
        SftEncoder(corpus_tokenizer, SftSpec("chat")).encode({"messages": CONVERSATIONS[0]}, "c.jsonl:1")


def test_bad_spec_is_a_usage_error():
    for kwargs, problem in [
        (dict(format="text"), "format=text: expected one of chat, prompt_completion"),
        (dict(format="chat", loss_on="completion"), "loss_on=completion: format=chat takes assistant | all"),
        (dict(format="prompt_completion", loss_on="assistant"), "takes completion | all"),
        (dict(format="chat", overlong="cut"), "overlong=cut: expected drop | truncate"),
        (dict(format="chat", seq_len=0), "seq_len=0"),
    ]:
        with pytest.raises(NVFP4UsageError, match=problem):
            SftSpec(**kwargs)
    assert SftSpec("chat").loss_on == "assistant" and SftSpec("prompt_completion").loss_on == "completion"


def test_overlong_rows_dropped_or_truncated_and_counted(chat_tokenizer):
    rows = [(f"c.jsonl:{i + 1}", {"messages": m}) for i, m in enumerate(CONVERSATIONS)]
    whole = [SftEncoder(chat_tokenizer, SftSpec("chat")).encode(row, where) for where, row in rows]
    lengths = [len(e.ids) for e in whole]
    seq_len = sorted(lengths)[1]  # the shortest two fit seq_len + 1; the others do not
    longer = [n > seq_len + 1 for n in lengths]
    assert 0 < sum(longer) < len(rows)

    counts = SftCounts()
    kept = list(encode_rows(rows, SftEncoder(chat_tokenizer, SftSpec("chat", seq_len=seq_len)), counts))
    assert [len(e.ids) for e in kept] == [n for n, over in zip(lengths, longer) if not over]
    assert (counts.rows, counts.dropped, counts.truncated) == (len(rows), sum(longer), 0)
    assert counts.tokens == sum(len(e.ids) for e in kept)
    assert counts.loss_tokens == sum(int(e.loss.sum()) for e in kept)
    assert counts.loss_share == counts.loss_tokens / counts.tokens
    line = counts.summary(SftSpec("chat", seq_len=seq_len))
    assert f"{sum(longer)} longer than seq_len + 1 = {seq_len + 1} tokens dropped (overlong=drop)" in line
    assert "\n" not in line

    counts = SftCounts()
    spec = SftSpec("chat", overlong="truncate", seq_len=seq_len)
    cut = list(encode_rows(rows, SftEncoder(chat_tokenizer, spec), counts))
    assert len(cut) == len(rows) and (counts.dropped, counts.truncated) == (0, sum(longer))
    for encoded, full, over in zip(cut, whole, longer):
        assert encoded.status == ("truncated" if over else "kept")
        np.testing.assert_array_equal(encoded.ids, full.ids[: seq_len + 1])
        np.testing.assert_array_equal(encoded.loss, full.loss[: seq_len + 1])
    assert f"{sum(longer)} longer than seq_len + 1 = {seq_len + 1} tokens truncated" in counts.summary(spec)


def test_encoder_pickles_for_worker_processes(chat_tokenizer):
    encoder = SftEncoder(chat_tokenizer, SftSpec("chat"))
    row = {"messages": CONVERSATIONS[0]}
    before = encoder.encode(row, "r:1")
    clone = pickle.loads(pickle.dumps(encoder))
    after = clone.encode(row, "r:1")
    np.testing.assert_array_equal(before.ids, after.ids)
    np.testing.assert_array_equal(before.loss, after.loss)


def test_shipped_chat_set(chat_tokenizer):
    """nvfp4tool/data/chat_shakespeare.jsonl: what scripts/make_chat_set.py writes, < 200 KB, every
    conversation valid with SmolLM2's template and carrying loss on its assistant turns."""
    import make_chat_set

    path = make_chat_set.OUT
    assert path.read_text(encoding="utf-8") == make_chat_set.render()
    assert path.stat().st_size < 200_000
    rows = [(f"{path.name}:{n}", json.loads(line)) for n, line in enumerate(path.read_text().splitlines(), 1)]
    assert len(rows) == 200
    counts = SftCounts()
    kept = list(encode_rows(rows, SftEncoder(chat_tokenizer, SftSpec("chat")), counts))
    assert len(kept) == 200 and all(e.loss.any() for e in kept)
    assert 0.2 < counts.loss_share < 0.8
