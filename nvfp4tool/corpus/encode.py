"""Data formats: how documents are read and turned into token ids (and optional loss marks).

    batch = encode_batch(tokenizer, "text", ["a document", "another"], np.uint16)
    batch.ids          # each document's ids followed by the end-of-text id, concatenated
    batch.lengths      # tokens per document (its end-of-text id included)

A format is a `DataFormat` in `FORMATS` (only "text" now): `read(source, text_field, on_file)`
yields documents in order; `encode(tokenizer, documents)` returns each document's (ids, loss marks
or None). The worker processes of `prepare` and train's in-memory data call the same functions.
Design notes: docs/design/data.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from nvfp4tool.corpus.sources import iter_documents
from nvfp4tool.corpus.tokenizer import TextTokenizer

BATCH_DOCUMENTS = 1000  # documents encoded per `encode_batch` call

Encoded = tuple[list[int], list[bool] | None]  # a document's ids and its loss marks (None: all carry loss)


@dataclasses.dataclass(frozen=True)
class DataFormat:
    """How one data format reads its documents and encodes a batch of them."""

    name: str
    read: Callable[[str | Path, str, Callable[[Path], None] | None], Iterator[Any]]
    encode: Callable[[TextTokenizer, list[Any]], list[Encoded]]
    size: Callable[[Any], int]  # a document's bytes (progress: MB/s)


def _encode_text(tokenizer: TextTokenizer, documents: list[str]) -> list[Encoded]:
    encodings = tokenizer.tokenizer.encode_batch(documents, add_special_tokens=False)
    return [(encoding.ids, None) for encoding in encodings]


FORMATS: dict[str, DataFormat] = {
    "text": DataFormat("text", iter_documents, _encode_text, lambda text: len(text.encode("utf-8"))),
}


@dataclasses.dataclass(frozen=True)
class EncodedBatch:
    """Documents' tokens in stream order: each document's ids followed by the end-of-text id."""

    ids: np.ndarray  # [tokens] in the cache's dtype
    lengths: np.ndarray  # [documents] int64, each document's tokens with its end-of-text id
    loss: np.ndarray | None  # [tokens] uint8 (1: a target carrying loss), None: every token


def encode_batch(tokenizer: TextTokenizer, format: str, documents: list[Any], dtype: Any) -> EncodedBatch:
    """Encode a batch of documents of `format`; the end-of-text id after each one carries loss."""
    encoded = FORMATS[format].encode(tokenizer, documents)
    lengths = np.fromiter((len(ids) + 1 for ids, _ in encoded), np.int64, len(encoded))
    ids = np.empty(int(lengths.sum()), dtype)
    marks = None if all(m is None for _, m in encoded) else np.ones(len(ids), np.uint8)
    end = 0
    for (document, mark), length in zip(encoded, lengths.tolist()):
        ids[end : end + length - 1] = document
        ids[end + length - 1] = tokenizer.eos_id
        if mark is not None:
            marks[end : end + length - 1] = mark
        end += length
    return EncodedBatch(ids, lengths, marks)


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
    tokenizer: TextTokenizer, documents: Iterable[Any], *, format: str = "text", dtype: Any = np.int32
) -> Iterator[EncodedBatch]:
    """Encode `documents` in this process, a batch at a time (train's in-memory data)."""
    for batch in batches(documents):
        with single_threaded():
            encoded = encode_batch(tokenizer, format, batch, dtype)
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
