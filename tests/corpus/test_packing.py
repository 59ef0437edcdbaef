"""Fine-tuning rows that keep each conversation whole: `packing=segmented` packs the chat set's
conversations greedily in order and `packing=padded` one per row, each equal to an independent
oracle (tokens, loss marks, segments, end-of-text padding); the loader and the eval split read
these rows; an overlong document (a cache prepared without a row limit) and padded text are
refused in one line; the row table equals the row loop it replaced (kept here as the oracle);
`TokenStream.take` equals slicing; a tiny train run with each packing has finite losses and records
its padding; a resume of a chat run begun when its rows were cut from the stream is refused."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import numpy as np
import pytest

from nvfp4tool.corpus.cache import open_cache
from nvfp4tool.corpus.chat import SftCounts, SftEncoder, SftSpec, encode_rows
from nvfp4tool.corpus.encode import encode_documents
from nvfp4tool.corpus.loader import Loader
from nvfp4tool.corpus.prepare import prepare_cache
from nvfp4tool.corpus.sources import iter_rows
from nvfp4tool.corpus.tokenizer import load_tokenizer
from nvfp4tool.corpus.windows import (
    RELEASE_ROWS,
    TokenStream,
    Windows,
    document_rows,
    segment_ids,
    windows_in_memory,
)
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError
from nvfp4tool.run.config import load_train_config
from nvfp4tool.run.records import RunRecord

from fixtures.train_fixtures import run_train

SEQ = 127
ROWS = 40


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    """ROWS short conversations of varied length (a few longer than SEQ + 1 tokens: dropped)."""
    rows = [
        {"messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": f"What says line {i}?"},
            {"role": "assistant", "content": " ".join(["Good my lord"] * (1 + i * 7 % 13 * 2))},
            *([{"role": "user", "content": "And then?"}, {"role": "assistant", "content": "Peace."}] * (i % 3 == 0)),
        ]}
        for i in range(ROWS)
    ]  # fmt: skip
    path = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def conversations(chats, chat_tokenizer):
    """The kept conversations' (ids, loss marks) as corpus/chat.py encodes them, one at a time."""
    rows = [(f"{chats}:{n}", json.loads(line)) for n, line in enumerate(chats.read_text().splitlines(), 1)]
    kept = list(encode_rows(rows, SftEncoder(chat_tokenizer, SftSpec("chat", seq_len=SEQ)), SftCounts()))
    assert 1 < len(kept) < ROWS  # some dropped (overlong=drop)
    return [(np.asarray(e.ids), np.asarray(e.loss, bool)) for e in kept]


def _windows(chats, chat_tokenizer, packing):
    tokenizer = load_tokenizer(chat_tokenizer)
    encoder = SftEncoder(chat_tokenizer, SftSpec("chat", seq_len=SEQ))
    encoded = encode_documents(tokenizer, iter_rows(chats), format="chat", sft=encoder)
    return windows_in_memory(encoded, SEQ, packing, format="chat", pad_id=tokenizer.eos_id), tokenizer.eos_id


def _oracle(conversations, packing, eos):
    """Rows built conversation by conversation: a new row when the next one does not fit."""
    width, groups = SEQ + 1, [[]]
    for conversation in conversations:
        used = sum(len(ids) for ids, _ in groups[-1])
        if groups[-1] and (packing == "padded" or used + len(conversation[0]) > width):
            groups.append([])
        groups[-1].append(conversation)
    tokens = np.full((len(groups), width), eos, np.int64)
    segments = np.zeros((len(groups), width), np.int64)
    loss = np.zeros((len(groups), width), bool)
    for row, group in enumerate(groups):
        at = 0
        for number, (ids, marks) in enumerate(group, 1):
            tokens[row, at : at + len(ids)], loss[row, at : at + len(ids)] = ids, marks
            segments[row, at : at + len(ids)] = number
            at += len(ids)
    return tokens, segments, loss


@pytest.mark.parametrize("packing", ["segmented", "padded"])
def test_each_conversation_whole_in_one_row_as_the_oracle_packs_them(chats, chat_tokenizer, conversations, packing):
    windows, eos = _windows(chats, chat_tokenizer, packing)
    batch = windows.rows(np.arange(len(windows)))
    tokens, segments, loss = _oracle(conversations, packing, eos)
    np.testing.assert_array_equal(batch.tokens, tokens)
    np.testing.assert_array_equal(batch.segments, segments)
    np.testing.assert_array_equal(batch.loss, loss)
    if packing == "padded":
        assert len(windows) == len(conversations) and batch.segments.max() == 1
    else:
        assert len(windows) < len(conversations)  # rows hold several conversations
    # every conversation in exactly one row, in order, followed only by padding or the next one
    found = [(r, s) for r in range(len(batch.tokens)) for s in range(1, batch.segments[r].max() + 1)]
    assert len(found) == len(conversations)
    for (r, s), (ids, marks) in zip(found, conversations, strict=True):
        np.testing.assert_array_equal(batch.tokens[r][batch.segments[r] == s], ids)
        np.testing.assert_array_equal(batch.loss[r][batch.segments[r] == s], marks)
    padding = batch.segments == 0
    assert (batch.tokens[padding] == eos).all() and not batch.targets_weight()[padding[:, 1:]].any()
    assert windows.padding_share() == pytest.approx(padding.mean())

    # the eval split and the loader read these rows
    train, held_out = windows.split(0.2)
    assert len(train) + len(held_out) == len(windows)
    np.testing.assert_array_equal(held_out.rows(np.arange(len(held_out))).tokens, tokens[len(train) :])
    loader = Loader([train], batch_size=2, seed=3, num_batches=3, threads=0)
    for b, got in enumerate(loader.iterator()):
        picked = loader.source.window_indices(b)
        np.testing.assert_array_equal(got.tokens, tokens[[w for _, w in picked]])
        np.testing.assert_array_equal(got.segments, segments[[w for _, w in picked]])


def test_overlong_documents_and_padded_text_are_refused_in_one_line(tmp_path):
    starts = np.array([0, 5, 9], np.int64)
    np.testing.assert_array_equal(document_rows(starts, 14, 9, "segmented"), [[0, 9], [9, 5]])
    np.testing.assert_array_equal(document_rows(starts, 14, 9, "padded"), [[0, 5], [5, 4], [9, 5]])
    for packing in ("segmented", "padded"):  # empty documents take no row
        np.testing.assert_array_equal(document_rows(np.array([0, 0, 3, 3]), 3, 3, packing), [[0, 3]])
    with pytest.raises(NVFP4ToolError, match=r"^x.jsonl: document 1 has 6 tokens, longer than a row of seq_len \+ 1"):
        document_rows(np.array([0, 5]), 11, 4, "segmented", "x.jsonl")
    with pytest.raises(NVFP4UsageError, match="packing=padded: format=text is cut from one stream"):
        load_train_config(None, ["data=x", "format=text", "packing=padded", f"out={tmp_path / 'r'}"])


def _document_rows_loop(starts, total: int, seq_len: int, packing: str, label: str = "data") -> np.ndarray:
    """The oracle: `document_rows` as it was, a Python step per row (before it was vectorised)."""
    width = seq_len + 1
    ends = np.append(np.asarray(starts, np.int64), np.int64(total))
    lengths = np.diff(ends)
    if len(lengths) and lengths.max() > width:
        first = int(np.argmax(lengths > width))
        raise NVFP4ToolError(
            f"{label}: document {first} has {int(lengths[first])} tokens, longer than a row of seq_len + 1 = "
            f"{width} (rows are held to it by overlong=drop | truncate when encoded: data prepare --seq-len {seq_len})"
        )
    if packing == "padded":
        kept = lengths > 0
        return np.stack([ends[:-1][kept], lengths[kept]], axis=1)
    nonempty = np.flatnonzero(lengths)
    table, at = [], 0
    while at < len(nonempty):
        start = ends[nonempty[at]]
        last = int(np.searchsorted(ends, start + width, side="right")) - 1
        table.append((start, ends[last] - start))
        at = int(np.searchsorted(nonempty, last))
    return np.array(table, np.int64).reshape(-1, 2)


def test_document_rows_equal_the_row_loop_on_random_lengths():
    """The vectorised table against the row loop it replaced (the oracle above), both packings, on
    random document lengths: empty documents, documents of exactly seq_len + 1 and of 1 token, none,
    one, thousands; an overlong document refused with the same line."""
    rng = np.random.default_rng(0)
    cases = [(np.zeros(0, np.int64), 4), (np.zeros(5, np.int64), 4), (np.full(7, 9), 8), (np.ones(3000, np.int64), 8)]
    for _ in range(300):
        seq_len, count = int(rng.integers(1, 40)), int(rng.integers(1, 80))
        kind = rng.integers(0, 4, count)  # empty, exactly seq_len + 1, 1 token, anything that fits
        cases.append((np.choose(kind, [0, seq_len + 1, 1, rng.integers(0, seq_len + 2, count)]), seq_len))
    cases.append((rng.integers(0, 200, 20000), 199))  # thousands of rows: many doubling steps
    for lengths, seq_len in cases:
        starts, total = np.cumsum(lengths) - lengths, int(lengths.sum())
        for packing in ("segmented", "padded"):
            want = _document_rows_loop(starts, total, seq_len, packing)
            got = document_rows(starts, total, seq_len, packing)
            assert got.dtype == want.dtype == np.int64 and got.shape == want.shape
            np.testing.assert_array_equal(got, want)
        overlong = np.insert(lengths, int(rng.integers(0, len(lengths) + 1)), seq_len + 2 + int(rng.integers(0, 5)))
        starts, total = np.cumsum(overlong) - overlong, int(overlong.sum())
        for packing in ("segmented", "padded"):
            with pytest.raises(NVFP4ToolError) as want:
                _document_rows_loop(starts, total, seq_len, packing, "x.jsonl")
            with pytest.raises(NVFP4ToolError) as got:
                document_rows(starts, total, seq_len, packing, "x.jsonl")
            assert str(got.value) == str(want.value)


def test_segment_ids_number_each_tokens_document_as_a_search_per_token():
    """`segment_ids` (two searches a row) equals searching every token's document, with empty
    documents, rows starting on a document's first token and rows reaching the stream's end."""
    rng = np.random.default_rng(3)
    lengths = rng.integers(0, 40, 500)
    lengths[rng.random(500) < 0.2] = 0
    starts = np.cumsum(lengths) - lengths
    total, width = int(lengths.sum()), 33
    row_starts = np.concatenate([rng.integers(0, total - width, 300), starts[:50], [total - width]])
    positions = row_starts[:, None] + np.arange(width)[None, :]
    document = np.searchsorted(starts, positions, side="right") - 1
    got = segment_ids(starts, row_starts, width)
    assert got.dtype == np.int32 and got.max() > 3
    np.testing.assert_array_equal(got, document - document[:, :1] + 1)
    np.testing.assert_array_equal(segment_ids(np.array([0]), np.array([0, 5]), 4), np.ones((2, 4)))


def test_take_equals_slicing_across_pieces():
    rng = np.random.default_rng(0)
    whole = rng.integers(0, 60000, 200).astype(np.uint16)
    stream = TokenStream([whole[:7], whole[7:7], whole[7:90], whole[90:]])
    starts = rng.integers(0, 200 - 33, 40)
    got = stream.take(starts, 33, np.int32)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.stack([whole[s : s + 33] for s in starts]))
    lengths = rng.integers(0, 34, 40)
    got = stream.take(starts, 33, np.int32, lengths, -1)
    want = np.stack([np.concatenate([whole[s : s + n], np.full(33 - n, -1)]) for s, n in zip(starts, lengths)])
    np.testing.assert_array_equal(got, want)


def _mapped_kb(path) -> int:
    """The resident kB of this process's mappings of file `path` (/proc/self/smaps)."""
    total, mine = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):  # a mapping's first line
                mine = len(head) >= 6 and head[5] == str(path)
            elif mine and head[0] == "Rss:":
                total += int(head[1])
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads mapped pages from /proc/self/smaps")
def test_rows_of_a_memory_map_leave_none_of_its_pages_mapped(tmp_path):
    """Random rows read from a memory-mapped shard and document index (as a cache's) are the
    in-memory stream's; pages they mapped stay mapped until RELEASE_ROWS rows have been read, then
    none of either file is (RSS does not grow with the rows read)."""
    whole = np.random.default_rng(0).integers(0, 60000, 1 << 21).astype(np.uint16)  # 4 MiB
    documents = np.arange(0, len(whole), 1000, dtype=np.int64)
    whole.tofile(tmp_path / "tokens.bin")
    np.save(tmp_path / "starts.npy", documents)
    mapped = Windows(
        TokenStream([np.memmap(tmp_path / "tokens.bin", np.uint16, "r")]),
        SEQ,
        starts=np.load(tmp_path / "starts.npy", mmap_mode="r"),
        packing="segmented",
    )
    in_memory = Windows(TokenStream([whole]), SEQ, starts=documents, packing="segmented")
    picked = np.random.default_rng(1).permutation(len(in_memory))[:RELEASE_ROWS].reshape(-1, 16)
    for number, rows in enumerate(picked, 1):
        got, want = mapped.rows(rows), in_memory.rows(rows)
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_array_equal(got.segments, want.segments)
        if number == len(picked) - 1:  # the control: mapped until the release
            assert _mapped_kb(tmp_path / "tokens.bin") > 0 and _mapped_kb(tmp_path / "starts.npy") > 0
    assert _mapped_kb(tmp_path / "tokens.bin") == 0 and _mapped_kb(tmp_path / "starts.npy") == 0


@pytest.mark.parametrize("packing", ["segmented", "padded"])
def test_a_tiny_chat_run_with_each_packing(tmp_path, chats, chat_tokenizer, packing):
    result = run_train(
        chat_tokenizer, tmp_path / "run", data=chats, eval_data=chats, format="chat", packing=packing,
        seq_len=SEQ, batch_size=2, steps=2, eval_batches=1,
    )  # fmt: skip
    assert len(result.losses) == 2 and all(math.isfinite(v) for v in result.losses.values())
    assert all(math.isfinite(v) for v in result.eval_losses.values())
    record = RunRecord.read(tmp_path / "run")
    assert record.packing == packing and 0 < record.padding_share < 1


def test_a_cache_prepared_without_a_row_limit_is_refused_when_packed(tmp_path, chats, chat_tokenizer):
    """A conversation longer than seq_len + 1 reaching the rows (a cache prepared without --seq-len):
    one line naming the cache; cut from the stream (packing=concat) it is read as before."""
    prepare_cache([chats], chat_tokenizer, tmp_path / "c", format="chat", workers=0)
    cache = open_cache(tmp_path / "c")
    with pytest.raises(NVFP4ToolError, match=rf"^{tmp_path / 'c'}: document \d+ has \d+ tokens, longer than a row"):
        cache.windows(SEQ, "segmented")
    assert len(cache.windows(SEQ, "concat")) == (cache.manifest.tokens - 1) // SEQ
    padded = cache.windows(4 * SEQ, "padded")  # every conversation fits a row of 4 * SEQ + 1
    assert len(padded) == ROWS and (padded.rows(np.arange(ROWS)).segments.max(axis=1) == 1).all()


def test_a_resume_of_a_chat_run_begun_on_the_stream_cut_is_refused(tmp_path, chats, chat_tokenizer):
    """A chat run begun before whole-conversation rows (its run.json has no `padding_share`, the key
    that change began recording) had its packing=segmented rows cut from the token stream: a resume
    is refused in one line naming run.json and the key, since this nvfp4tool packs other rows. With
    the key, or with packing=concat (the stream cut then and now), the resume check passes.
    (`_prepare` only: no step compiled.)"""
    from nvfp4tool.train.trainer import _prepare

    keys = dict(data=chats, format="chat", tokenizer=chat_tokenizer, seq_len=SEQ, batch_size=2)
    rows = {}
    for packing in ("segmented", "concat"):
        out = tmp_path / packing
        config = load_train_config(None, [f"{k}={v}" for k, v in {**keys, "packing": packing, "out": out}.items()])
        record = _prepare(config, out).record
        rows[packing] = record.train_windows
        out.mkdir(exist_ok=True)
        record.write(out)
        resume = dataclasses.replace(config, resume=True)
        if packing == "segmented":
            _prepare(resume, out)  # a run.json with the key: the resume check passes
        legacy = {k: v for k, v in record.to_json().items() if k != "padding_share"}
        (out / "run.json").write_text(json.dumps(legacy))
        assert RunRecord.read(out).padding_share is None
        if packing == "concat":
            _prepare(resume, out)
            continue
        with pytest.raises(NVFP4ToolError) as refused:
            _prepare(resume, out)
        message = str(refused.value)
        assert re.match(rf"{re.escape(str(out / 'run.json'))}: no padding_share: ", message) and "\n" not in message
        assert "packing=segmented" in message and "other rows" in message
    assert rows["segmented"] != rows["concat"]  # whole conversations per row are other rows than the cut
