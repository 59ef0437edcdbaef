"""Training data: readers for each format, packing, the eval split, deterministic batch order,
and a trained tokenizer that transformers loads."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nvfp4tool.corpus.loader import batch_indices
from nvfp4tool.corpus.sources import iter_documents
from nvfp4tool.corpus.tokenizer import END_OF_TEXT, load_tokenizer, train_bpe_tokenizer
from nvfp4tool.corpus.windows import TokenStream, Windows
from nvfp4tool.errors import NVFP4ToolError

DOCS = ["first document, with words.", "second: more words here", "third one"]


def test_readers_give_the_same_documents_for_each_format(tmp_path):
    (tmp_path / "txt").mkdir()
    for i, doc in enumerate(DOCS):
        (tmp_path / "txt" / f"{i}.txt").write_text(doc)
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(DOCS)) + "\n\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": DOCS}), tmp_path / "d.parquet", row_group_size=2)
    assert list(iter_documents(tmp_path / "txt")) == DOCS
    assert list(iter_documents(tmp_path / "d.jsonl")) == DOCS
    assert list(iter_documents(tmp_path / "d.parquet")) == DOCS


def test_bad_data_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(NVFP4ToolError, match=r"bad.jsonl:2: no string field 'text'"):
        list(iter_documents(bad))
    with pytest.raises(NVFP4ToolError, match="does not exist"):
        list(iter_documents(tmp_path / "missing"))


BINARY = bytes(range(0x80, 0x100)) * 4  # not UTF-8 from its first byte, no newline


BAD_FILES = [  # (file name, content, the error's message)
    ("bin.txt", b"fine first line\n" + BINARY, r"bin.txt:2: not UTF-8 text \(byte 0x80\)"),
    ("bin.jsonl", b'{"text": "ok"}\n{"text": "ok"}\n' + BINARY, r"bin.jsonl:3: not UTF-8 text"),
    ("bad.jsonl", b'{"text": "ok"}\n{"text": "unterminated}\n', r"bad.jsonl:2: not valid JSON"),
    ("list.jsonl", b'["text"]\n', r"list.jsonl:1: no string field 'text'"),
    ("number.jsonl", b'{"text": 3}\n', r"number.jsonl:1: no string field 'text'"),
    ("empty.txt", b"", r"empty.txt: no text"),
    ("blank.txt", b"  \n\n\t\n", r"blank.txt: no text"),
    ("empty.jsonl", b"\n\n", r"empty.jsonl: no text"),
    ("fake.parquet", b"PAR1 not really", r"fake.parquet: not a readable Parquet file"),
    ("data.csv", b"text\nhello\n", r"data.csv: unsupported data file type"),
]


@pytest.mark.parametrize("name, content, fragment", BAD_FILES, ids=[case[0] for case in BAD_FILES])
def test_bad_data_file_is_one_line_naming_file_and_line(tmp_path, name, content, fragment):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(NVFP4ToolError, match=fragment) as caught:
        list(iter_documents(path))
    assert "\n" not in str(caught.value)


def test_data_folder_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(NVFP4ToolError, match=r"empty: no .txt, .jsonl, .parquet files"):
        list(iter_documents(tmp_path / "empty"))
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("")
    (tmp_path / "blank" / "dir.txt").mkdir()  # a folder named like a data file is not read
    with pytest.raises(NVFP4ToolError, match=r"blank: no text"):
        list(iter_documents(tmp_path / "blank"))
    (tmp_path / "blank" / "b.txt").write_text("words")  # one empty file among others is fine
    assert list(iter_documents(tmp_path / "blank")) == ["", "words"]


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(NVFP4ToolError, match="missing: not found"):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(NVFP4ToolError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes(BINARY)
    with pytest.raises(NVFP4ToolError, match="tokenizer.json: not a valid tokenizer"):
        load_tokenizer(tmp_path)


def test_windows_separate_documents_and_shift_by_seq_len():
    # stream: 1 2 3 0 4 5 0 6 7 8 9 0  (12 tokens) -> (12 - 1) // 3 = 3 windows of 4
    stream = TokenStream([np.array([1, 2, 3, 0, 4, 5]), np.array([0, 6, 7, 8, 9, 0])])  # two pieces
    windows = Windows(stream, seq_len=3)
    expected = [[1, 2, 3, 0], [0, 4, 5, 0], [0, 6, 7, 8]]
    np.testing.assert_array_equal(windows.rows(np.arange(3)).tokens, expected)
    train, held_out = windows.split(0.34)
    np.testing.assert_array_equal(held_out.rows(np.arange(len(held_out))).tokens, expected[-1:])
    np.testing.assert_array_equal(train.rows(np.array([1, 0])).tokens, [expected[1], expected[0]])


def test_batch_order_is_a_pure_function_of_seed_and_batch_number():
    n, bs = 10, 3  # 3 batches per epoch, one window left out per epoch
    epoch0 = np.concatenate([batch_indices(n, bs, seed=7, batch_number=b) for b in range(3)])
    assert len(set(epoch0.tolist())) == 9  # no window twice within an epoch
    again = [batch_indices(n, bs, seed=7, batch_number=b) for b in (4, 1)]
    np.testing.assert_array_equal(again[1], epoch0[3:6])
    assert not np.array_equal(batch_indices(n, bs, 7, 3), batch_indices(n, bs, 7, 0))  # new epoch
    assert not np.array_equal(batch_indices(n, bs, 8, 0), batch_indices(n, bs, 7, 0))  # new seed


def test_trained_tokenizer_round_trips_and_loads_in_transformers(tmp_path):
    from transformers import AutoTokenizer

    text = "To be, or not to be, that is the question. " * 20
    tok = train_bpe_tokenizer([text, "Whether 'tis nobler in the mind"], vocab_size=300, out_dir=tmp_path)
    ids = tok.encode("To be, or not to be")
    assert tok.decode(ids) == "To be, or not to be"
    assert tok.eos_id == tok.tokenizer.token_to_id(END_OF_TEXT)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf("To be, or not to be", add_special_tokens=False)["input_ids"] == ids
    assert hf.eos_token_id == tok.eos_id
    reloaded = load_tokenizer(tmp_path)
    assert reloaded.encode("question") == tok.encode("question") and reloaded.eos_id == tok.eos_id
