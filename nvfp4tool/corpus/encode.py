"""Data formats: how documents are read and turned into token ids (and optional loss marks).

    batch = encode_batch(tokenizer, "text", ["a document", "another"], np.uint16)
    batch.ids          # each document's ids followed by the end-of-text id, concatenated
    batch.lengths      # tokens per document (its end-of-text id included)

A format is a `DataFormat` in `FORMATS` (text, and the fine-tuning rows chat / prompt_completion of
`corpus/chat.py`): `read(source, text_field, on_file)` yields documents in order; `encode(tokenizer,
documents, sft)` returns each document's (ids, loss marks or None) and, for fine-tuning rows, their
counts. The worker processes of `prepare` and train's in-memory data call the same functions.
Design notes: docs/design/data.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from nvfp4tool.corpus.chat import FORMATS as SFT_FORMATS
from nvfp4tool.corpus.chat import SftCounts, SftEncoder, encode_rows
from nvfp4tool.corpus.sources import iter_documents, iter_rows
from nvfp4tool.corpus.tokenizer import TextTokenizer
from nvfp4tool.errors import NVFP4ToolError

BATCH_DOCUMENTS = 1000  # documents encoded per `encode_batch` call

Encoded = tuple[list[int], list[bool] | None]  # a document's ids and its loss marks (None: all carry loss)


@dataclasses.dataclass(frozen=True)
class DataFormat:
    """How one data format reads its documents and encodes a batch of them."""

    name: str
    read: Callable[[str | Path, str, Callable[[Path], None] | None], Iterator[Any]]
    encode: Callable[[TextTokenizer, list[Any], SftEncoder | None], tuple[list[Encoded], SftCounts | None]]
    size: Callable[[Any], int]  # a document's bytes (progress: MB/s)
    end_of_text: bool = True  # encode_batch appends the end-of-text id (else the documents end themselves)


def _encode_text(tokenizer: TextTokenizer, documents: list[str], sft: None) -> tuple[list[Encoded], None]:
    encodings = tokenizer.tokenizer.encode_batch(documents, add_special_tokens=False)
    return [(encoding.ids, None) for encoding in encodings], None


def _encode_rows(tokenizer: TextTokenizer, rows: list[tuple[str, Any]], sft: SftEncoder) -> tuple[list, SftCounts]:
    """Fine-tuning rows as their ids and marks (a row `overlong=drop` leaves out is not returned)."""
    counts = SftCounts()
    encoded = [(e.ids, e.loss) for e in encode_rows(rows, sft, counts)]
    top = max((int(ids.max()) for ids, _ in encoded if len(ids)), default=-1)
    if top >= tokenizer.vocab_size:  # transformers' tokenizer of the folder has tokens tokenizer.json lacks
        raise NVFP4ToolError(f"{sft.folder}: token id {top} outside the vocabulary of {tokenizer.vocab_size}")
    return encoded, counts


def _row_size(row: tuple[str, Any]) -> int:
    """A row's bytes as its JSON text (for progress lines only)."""
    return len(json.dumps(row[1], ensure_ascii=False, default=str).encode("utf-8"))


FORMATS: dict[str, DataFormat] = {
    "text": DataFormat("text", iter_documents, _encode_text, lambda text: len(text.encode("utf-8"))),
    **{name: DataFormat(name, iter_rows, _encode_rows, _row_size, end_of_text=False) for name in SFT_FORMATS},
}


@dataclasses.dataclass(frozen=True)
class EncodedBatch:
    """Documents' tokens in stream order: each document's ids (a text document's followed by the
    end-of-text id)."""

    ids: np.ndarray  # [tokens] in the cache's dtype
    lengths: np.ndarray  # [documents] int64, each document's tokens (a text one's end-of-text id included)
    loss: np.ndarray | None  # [tokens] uint8 (1: a target carrying loss), None: every token
    sft: SftCounts | None = None  # fine-tuning rows: what encoding did to them


def encode_batch(
    tokenizer: TextTokenizer, format: str, documents: list[Any], dtype: Any, sft: SftEncoder | None = None
) -> EncodedBatch:
    """Encode a batch of documents of `format` (`sft`: the fine-tuning formats' encoder); a text
    document is followed by the end-of-text id, which carries loss."""
    data_format = FORMATS[format]
    encoded, counts = data_format.encode(tokenizer, documents, sft)
    extra = int(data_format.end_of_text)
    lengths = np.fromiter((len(ids) + extra for ids, _ in encoded), np.int64, len(encoded))
    ids = np.empty(int(lengths.sum()), dtype)
    marked = counts is not None or any(m is not None for _, m in encoded)
    marks = np.ones(len(ids), np.uint8) if marked else None
    end = 0
    for (document, mark), length in zip(encoded, lengths.tolist()):
        ids[end : end + len(document)] = document
        if extra:
            ids[end + length - 1] = tokenizer.eos_id
        if mark is not None:
            marks[end : end + len(document)] = mark
        end += length
    return EncodedBatch(ids, lengths, marks, counts)


def batches(documents: Iterable[Any], size: int = BATCH_DOCUMENTS) -> Iterator[list[Any]]:
    """`documents` in lists of `size` (the last one shorter)."""
    batch = []
    for document in documents:
        batch.append(document)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def encode_documents(
    tokenizer: TextTokenizer,
    documents: Iterable[Any],
    *,
    format: str = "text",
    dtype: Any = np.int32,
    sft: SftEncoder | None = None,
) -> Iterator[EncodedBatch]:
    """Encode `documents` in this process, a batch at a time (train's in-memory data)."""
    for batch in batches(documents):
        with single_threaded():
            encoded = encode_batch(tokenizer, format, batch, dtype, sft)
        yield encoded


@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """`tokenizers` without its thread pool (TOKENIZERS_PARALLELISM=false, read at each call): the
    parallelism is our worker processes, and a process that used the pool warns when it forks."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before
