"""Fine-tuning rows through the token cache and train's data: `data prepare --format chat` (in a
worker process) stores the tokens and loss marks `corpus/chat.py` gives and records the counts;
train's rows from the JSONL file equal those from the cache; bad rows and options refused in one
line with the right exit code, nothing written."""

from __future__ import annotations

import hashlib
import json

import datasets
import numpy as np
import pytest
from click.testing import CliRunner

from nvfp4tool.cli import cli
from nvfp4tool.corpus.cache import open_cache
from nvfp4tool.corpus.chat import SftCounts, SftEncoder, SftSpec, encode_rows
from nvfp4tool.corpus.prepare import prepare_cache
from nvfp4tool.corpus.tokenizer import load_tokenizer
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError
from nvfp4tool.records.corpus import CorpusManifest
from nvfp4tool.run.config import load_train_config
from nvfp4tool.train.trainer import _windows

from fixtures.chat_fixtures import SMOLLM2_CHAT_TEMPLATE

SEQ = 255  # 8 of the first ROWS shipped conversations are longer than SEQ + 1 tokens with the suite's tokenizer
ROWS = 24
TEMPLATE_SHA256 = hashlib.sha256(SMOLLM2_CHAT_TEMPLATE.encode("utf-8")).hexdigest()


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    """The first ROWS conversations of the shipped chat set, as a JSONL file."""
    from make_chat_set import OUT

    path = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    path.write_text("".join(OUT.read_text(encoding="utf-8").splitlines(keepends=True)[:ROWS]), encoding="utf-8")
    return path


def _cli(*args):
    return CliRunner().invoke(cli, [*map(str, args)])


def _one_line_error(result, code, *fragments):
    assert result.exit_code == code, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error")]  # after any progress lines
    assert len(errors) == 1 and result.output.rstrip().endswith(errors[0]), result.output
    for fragment in fragments:
        assert fragment in result.output, result.output


def _direct(chats, folder, spec):
    """The kept rows and counts as corpus/chat.py gives them, row by row in this process."""
    rows = [(f"{chats}:{n}", json.loads(line)) for n, line in enumerate(chats.read_text().splitlines(), 1)]
    counts = SftCounts()
    return list(encode_rows(rows, SftEncoder(folder, spec), counts)), counts


def test_prepare_chat_stores_the_marks_and_the_counts(tmp_path, chats, chat_tokenizer):
    out = tmp_path / "cache"
    result = _cli(
        "-q", "data", "prepare", chats, "--format", "chat", "--seq-len", SEQ, "--tokenizer", chat_tokenizer,
        "--out", out, "--workers", 1,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    kept, counts = _direct(chats, chat_tokenizer, SftSpec("chat", seq_len=SEQ))
    assert 0 < counts.dropped < ROWS  # the limit was exercised
    manifest = CorpusManifest.read(out)
    assert manifest.format == "chat" and manifest.documents == len(kept) == ROWS - counts.dropped
    sft = manifest.sft
    assert (sft.loss_on, sft.overlong, sft.seq_len) == ("assistant", "drop", SEQ)
    assert sft.chat_template_sha256 == TEMPLATE_SHA256
    assert (sft.rows, sft.dropped, sft.truncated, sft.tokens, sft.loss_tokens) == (
        ROWS, counts.dropped, 0, counts.tokens, counts.loss_tokens
    )  # fmt: skip
    assert f"{sft.loss_share:.1%} carrying loss" in result.output
    # the dropped rows are a warning, shown even with -q
    assert f"{counts.dropped} longer than seq_len + 1 = {SEQ + 1} tokens dropped (overlong=drop)" in result.output
    cache = open_cache(out)
    np.testing.assert_array_equal(cache.tokens.take(np.array([0]), manifest.tokens, np.int64)[0],
                                  np.concatenate([e.ids for e in kept]))  # fmt: skip
    np.testing.assert_array_equal(cache.loss.take(np.array([0]), manifest.tokens, np.uint8)[0].astype(bool),
                                  np.concatenate([e.loss for e in kept]))  # fmt: skip
    np.testing.assert_array_equal(cache.starts, np.cumsum([0] + [len(e.ids) for e in kept])[:-1])
    assert _cli("data", "verify", out).exit_code == 0


def test_train_reads_the_same_rows_from_the_file_and_the_cache(tmp_path, chats, chat_tokenizer):
    prepare_cache([chats], chat_tokenizer, tmp_path / "c", format="chat", seq_len=SEQ, workers=0)
    tokenizer = load_tokenizer(chat_tokenizer)

    def windows(data, **keys):
        args = dict(data=data, tokenizer=chat_tokenizer, seq_len=SEQ, out=tmp_path / "run", packing="segmented")
        args.update(keys)
        config = load_train_config(None, [f"{k}={v}" for k, v in args.items()])
        (train,), held_out, (sft,), eval_sft = _windows(config, tokenizer, [str(data)], chat_tokenizer)
        assert eval_sft is None  # no eval_data: held out of the data, whose counts sft has
        return train, held_out, sft

    file_train, file_eval, file_sft = windows(chats, format="chat")
    cache_train, cache_eval, cache_sft = windows(tmp_path / "c")
    assert file_sft == cache_sft == CorpusManifest.read(tmp_path / "c").sft
    for a, b in ((file_train, cache_train), (file_eval, cache_eval)):
        assert len(a) == len(b) > 0
        rows_a, rows_b = a.rows(np.arange(len(a))), b.rows(np.arange(len(b)))
        np.testing.assert_array_equal(rows_a.tokens, rows_b.tokens)
        np.testing.assert_array_equal(rows_a.loss, rows_b.loss)
        np.testing.assert_array_equal(rows_a.segments, rows_b.segments)  # whole conversations, padded alike
        assert rows_a.loss.any() and not rows_a.loss.all()

    # the cache holds its format and options: asking for others is a usage error
    for keys, problem in [
        (dict(loss_on="all"), "loss_on=all: data="),
        (dict(format="text"), "format=text: data="),
        (dict(seq_len=SEQ // 2), rf"\(data prepare --seq-len {SEQ}\); prepare it again"),
    ]:
        with pytest.raises(NVFP4UsageError, match=problem):
            windows(tmp_path / "c", **{"seq_len": SEQ, **keys})
    with pytest.raises(NVFP4UsageError, match="loss_on=completion: format=chat takes assistant | all"):
        windows(chats, format="chat", loss_on="completion")
    with pytest.raises(NVFP4UsageError, match="train config: overlong=drop: only for format chat"):
        windows(chats, overlong="drop")


def test_prepare_prompt_completion_from_a_saved_dataset(tmp_path, chat_tokenizer):
    rows = [{"prompt": f"KING.\nWhat of line {i}?\n", "completion": f"It is line {i}." * (i % 3 + 1)} for i in range(9)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    manifest = prepare_cache([tmp_path / "saved"], chat_tokenizer, tmp_path / "c", format="prompt_completion",
                             overlong="truncate", seq_len=12, workers=0)  # fmt: skip
    encoder = SftEncoder(chat_tokenizer, SftSpec("prompt_completion", overlong="truncate", seq_len=12))
    counts = SftCounts()
    kept = list(encode_rows(((f"row {i}", r) for i, r in enumerate(rows)), encoder, counts))
    assert manifest.sft.truncated == counts.truncated > 0 and manifest.sft.loss_tokens == counts.loss_tokens
    cache = open_cache(tmp_path / "c")
    np.testing.assert_array_equal(cache.tokens.take(np.array([0]), manifest.tokens, np.int64)[0],
                                  np.concatenate([e.ids for e in kept]))  # fmt: skip

    rows[4] = {"prompt": "KING.\n", "completion": 7}
    datasets.Dataset.from_list(rows[4:5]).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(NVFP4ToolError, match=r"bad: row 1: prompt / completion: expected two strings"):
        prepare_cache([tmp_path / "bad"], chat_tokenizer, tmp_path / "c2", format="prompt_completion", workers=0)
    assert not (tmp_path / "c2").exists()


def test_bad_rows_and_options_refused_in_one_line(tmp_path, chats, chat_tokenizer, corpus_tokenizer):
    lines = chats.read_text().splitlines()
    bad = json.loads(lines[2])
    bad["messages"][1]["role"] = "tool"
    source = tmp_path / "bad.jsonl"
    source.write_text("\n".join([*lines[:2], json.dumps(bad), *lines[3:]]) + "\n")
    out = tmp_path / "cache"
    prepare = ("data", "prepare", "--tokenizer", chat_tokenizer, "--out", out)
    # a bad row (found in a worker process): exit 1, named, nothing written
    _one_line_error(_cli(*prepare, source, "--format", "chat", "--workers", 1), 1, f"{source}:3: messages[1].role")
    assert not out.exists()
    # a tokenizer without a chat template: refused before anything is created
    no_template = ("data", "prepare", chats, "--format", "chat", "--tokenizer", corpus_tokenizer, "--out", out)
    _one_line_error(_cli(*no_template), 1, f"{corpus_tokenizer}: the tokenizer has no chat template")
    assert not out.exists()
    # options of another format: usage errors
    _one_line_error(_cli(*prepare, chats, "--loss-on", "all"), 2, "loss_on=all: only for format chat")
    _one_line_error(_cli(*prepare, chats, "--format", "chat", "--loss-on", "completion"), 2, "assistant | all")
    _one_line_error(_cli(*prepare, chats, "--format", "chat", "--seq-len", 0), 2, "--seq-len")
    assert not out.exists()


def test_run_json_records_the_rows_counts(tmp_path, chats, chat_tokenizer):
    """What a run starts with (`_prepare`: no step compiled) records the rows' counts in run.json."""
    from nvfp4tool.run.records import RunRecord
    from nvfp4tool.train.trainer import _prepare

    out = tmp_path / "run"
    keys = dict(data=chats, format="chat", tokenizer=chat_tokenizer, seq_len=SEQ, batch_size=2, out=out)
    prepared = _prepare(load_train_config(None, [f"{k}={v}" for k, v in keys.items()]), out)
    _, counts = _direct(chats, chat_tokenizer, SftSpec("chat", seq_len=SEQ))
    assert prepared.record.data_sft == [counts.record(SftSpec("chat", seq_len=SEQ), TEMPLATE_SHA256)]
    assert prepared.record.eval_data_sft is None  # eval split off the same rows
    prepared.record.write(tmp_path)
    assert RunRecord.read(tmp_path).data_sft == prepared.record.data_sft
    assert RunRecord.read(tmp_path).config["format"] == "chat"


def test_a_preset_run_keeps_the_tokenizer_folders_chat_template(tmp_path, chats, chat_tokenizer):
    """A preset trained on chat rows with tokenizer=FOLDER: its hf/ (what export copies and serving
    reads) has the folder's tokenizer files, the chat template with them, and renders a conversation
    to the same ids as the folder's tokenizer does (transformers on both)."""
    from transformers import AutoTokenizer

    from nvfp4tool.train.trainer import train

    keys = dict(model="tiny", data=chats, format="chat", tokenizer=chat_tokenizer, recipe="bf16", steps=1, seq_len=32,
                batch_size=2, overlong="truncate", eval_every=0, eval_batches=1, out=tmp_path / "run")  # fmt: skip
    hf_dir = train(load_train_config(None, [f"{k}={v}" for k, v in keys.items()])).hf_dir
    served, source = AutoTokenizer.from_pretrained(str(hf_dir)), AutoTokenizer.from_pretrained(str(chat_tokenizer))
    assert served.get_chat_template() == SMOLLM2_CHAT_TEMPLATE
    messages = json.loads(chats.read_text().splitlines()[1])["messages"]
    rendered = served.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    assert rendered == source.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    assert (hf_dir / "tokenizer.json").read_bytes() == (chat_tokenizer / "tokenizer.json").read_bytes()
