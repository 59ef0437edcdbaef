"""Training data: read documents (text, JSONL, Parquet), tokenize, pack and split.

Windows of `seq_len + 1` tokens (each document's tokens and the end-of-text id, concatenated); the last `eval_fraction`
is the eval split. The training batches' order is nvfp4tool/corpus/loader.py's.
Design notes: docs/design/training.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import numpy as np

from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError
from nvfp4tool.records.base import iter_jsonl

DATA_SUFFIXES = (".txt", ".jsonl", ".parquet")


def embedded_corpus() -> tuple[Path, Path]:
    """(train, val) text files shipped in the package: ~256 KB / ~32 KB of Shakespeare
    (public domain text; see nvfp4tool/data/SHAKESPEARE_COPYING.txt)."""
    folder = Path(str(resources.files("nvfp4tool") / "data"))
    return folder / "shakespeare_train.txt", folder / "shakespeare_val.txt"


def iter_documents(path: str | Path, text_field: str = "text") -> Iterator[str]:
    """Yield the documents of a file or folder (see module docstring), one at a time."""
    path = Path(path)
    if not path.exists():
        raise NVFP4ToolError(f"{path}: data file or folder does not exist")
    files = sorted(p for p in path.rglob("*") if p.suffix in DATA_SUFFIXES and p.is_file()) if path.is_dir() else [path]
    if not files:
        raise NVFP4ToolError(f"{path}: no {', '.join(DATA_SUFFIXES)} files in the folder")
    empty = True
    for file in files:
        for text in _read_file(file, text_field):
            empty = empty and not text.strip()
            yield text
    if empty:
        raise NVFP4ToolError(f"{path}: no text (empty data)")


def pack_windows(token_docs: Iterator[list[int]], seq_len: int, eos_id: int) -> np.ndarray:
    """Concatenate documents (each followed by `eos_id`) into windows [num_windows, seq_len + 1]."""
    stream = []
    for ids in token_docs:
        stream.extend(ids)
        stream.append(eos_id)
    window = seq_len + 1
    num_windows = (len(stream) - 1) // seq_len
    if num_windows < 2:
        raise NVFP4ToolError(
            f"the data has {len(stream)} tokens: too few for two windows of "
            f"seq_len={seq_len} (one to train on, one to evaluate)"
        )
    tokens = np.asarray(stream, np.int32)
    starts = np.arange(num_windows) * seq_len
    return tokens[starts[:, None] + np.arange(window)[None, :]]


def split_eval(windows: np.ndarray, eval_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, eval): the last `eval_fraction` of the windows (at least one) are held out."""
    if not 0.0 < eval_fraction < 1.0:
        raise NVFP4UsageError(f"eval_fraction={eval_fraction}: expected a number in (0, 1)")
    num_eval = max(1, int(round(len(windows) * eval_fraction)))
    return windows[:-num_eval], windows[-num_eval:]


def eval_batches(windows: np.ndarray, batch_size: int) -> Iterator[np.ndarray]:
    """The eval windows in order, in batches of at most `batch_size`."""
    for start in range(0, len(windows), batch_size):
        yield windows[start : start + batch_size]


# ------------------------------------------------------------------------------------------
# helpers


def _read_file(file: Path, text_field: str) -> Iterator[str]:
    if file.suffix == ".txt":
        yield _decode(file.read_bytes(), file)
    elif file.suffix == ".jsonl":
        yield from _read_jsonl(file, text_field)
    elif file.suffix == ".parquet":
        yield from _read_parquet(file, text_field)
    else:
        raise NVFP4ToolError(f"{file}: unsupported data file type (use {', '.join(DATA_SUFFIXES)})")


def _decode(data: bytes, file: Path, line_number: int | None = None) -> str:
    """UTF-8 text, or one line naming the file (and line) where it is not (binary data)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as bad:
        line_number = line_number or data.count(b"\n", 0, bad.start) + 1
        raise NVFP4ToolError(
            f"{file}:{line_number}: not UTF-8 text (byte {bad.object[bad.start]:#04x}); binary data given as text?"
        ) from None


def _read_jsonl(file: Path, text_field: str) -> Iterator[str]:
    for line_number, record in iter_jsonl(file):
        text = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise NVFP4ToolError(f"{file}:{line_number}: no string field '{text_field}'")
        yield text


def _read_parquet(file: Path, text_field: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(file)
    except pa.ArrowException as bad:
        raise NVFP4ToolError(f"{file}: not a readable Parquet file ({bad})") from None
    if text_field not in parquet.schema_arrow.names:
        raise NVFP4ToolError(f"{file}: no column '{text_field}' (columns: {', '.join(parquet.schema_arrow.names)})")
    for batch in parquet.iter_batches(columns=[text_field]):
        for text in batch.column(0).to_pylist():
            if text is not None and not isinstance(text, str):
                raise NVFP4ToolError(f"{file}: column '{text_field}' holds {type(text).__name__}, not text")
            if text is not None:
                yield text
