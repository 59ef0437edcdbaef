"""Documents: read text, JSONL, Parquet files or folders and Hugging Face `datasets` folders
(`save_to_disk`), one document at a time, in a fixed order.

    for text in iter_documents("corpus/", text_field="text"): ...
    for where, row in iter_rows("chats.jsonl"): ...    # whole rows (fine-tuning), where = "file:line"
    data_files("corpus/")      # the files read, in reading order (what a manifest hashes)

Any defect (a missing path, non-UTF-8 text, a bad JSONL line, a missing text field or column, no
text at all) is an `NVFP4ToolError` naming the file (and line).
Design notes: docs/design/data.md.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.records.base import iter_jsonl, read_json_file

DATA_SUFFIXES = (".txt", ".jsonl", ".parquet")
DATASET_STATE = "state.json"  # what `datasets.Dataset.save_to_disk` writes beside its Arrow files
DATASET_DICT = "dataset_dict.json"  # ... and `DatasetDict.save_to_disk` above its splits' folders
_ROWS_PER_READ = 1000  # rows of a Parquet file or dataset read at a time


def embedded_corpus() -> tuple[Path, Path]:
    """(train, val) text files shipped in the package: ~256 KB / ~32 KB of Shakespeare
    (public domain text; see nvfp4tool/data/SHAKESPEARE_COPYING.txt)."""
    folder = Path(str(resources.files("nvfp4tool") / "data"))
    return folder / "shakespeare_train.txt", folder / "shakespeare_val.txt"


def iter_documents(
    path: str | Path, text_field: str = "text", on_file: Callable[[Path], None] | None = None
) -> Iterator[str]:
    """Yield the documents of a file, a folder of data files or a `save_to_disk` dataset folder,
    one at a time; `on_file(file)` is called before each file's (or dataset's) documents."""
    path = Path(path)
    empty = True
    for file in data_files(path):
        if on_file is not None:
            on_file(file)
        for text in _read_file(file, text_field):
            empty = empty and not text.strip()
            yield text
    if empty:
        raise NVFP4ToolError(f"{path}: no text (empty data)")


def iter_rows(
    path: str | Path, text_field: str = "text", on_file: Callable[[Path], None] | None = None
) -> Iterator[tuple[str, Any]]:
    """Yield (where, row) for each row of a JSONL / Parquet file, a folder of them or a
    `save_to_disk` dataset folder (the fine-tuning formats' rows, whole): `where` names it in
    errors (`file:line`, `file: row N`). `text_field` is not used (the rows' fields are fixed)."""
    path = Path(path)
    empty = True
    for file in data_files(path):
        if on_file is not None:
            on_file(file)
        for row in _file_rows(file):
            empty = False
            yield row
    if empty:
        raise NVFP4ToolError(f"{path}: no rows (empty data)")


def data_files(path: str | Path) -> list[Path]:
    """The units `iter_documents` reads, in order: the file itself, a folder's data files in sorted
    name order, or a `save_to_disk` dataset folder as one unit."""
    path = Path(path)
    if not path.exists():
        raise NVFP4ToolError(f"{path}: data file or folder does not exist")
    if is_dataset_folder(path):
        return [path]
    if path.is_dir() and (path / DATASET_DICT).is_file():
        splits = ", ".join(sorted(p.name for p in path.iterdir() if p.is_dir()))
        raise NVFP4ToolError(f"{path}: a saved DatasetDict; give one split's folder ({splits})")
    files = sorted(p for p in path.rglob("*") if p.suffix in DATA_SUFFIXES and p.is_file()) if path.is_dir() else [path]
    if not files:
        raise NVFP4ToolError(f"{path}: no {', '.join(DATA_SUFFIXES)} files in the folder")
    return files


def is_dataset_folder(path: Path) -> bool:
    return path.is_dir() and (path / DATASET_STATE).is_file()


def data_sha256(path: str | Path) -> str:
    """sha256 of the data's bytes (a folder: each file's relative name and bytes, in reading order;
    a dataset folder: its state.json's Arrow files)."""
    root = Path(path)
    if is_dataset_folder(root):
        return file_sha256(root)
    files = sorted(p for p in root.rglob("*") if p.suffix in DATA_SUFFIXES) if root.is_dir() else [root]
    digest = hashlib.sha256()
    for file in files:
        if root.is_dir():  # a folder's layout is part of its data; a single file's name is not
            digest.update(str(file.relative_to(root)).encode() + b"\0")
        _hash_into(digest, file)
    return digest.hexdigest()


def file_sha256(unit: Path) -> str:
    """sha256 of one unit of `data_files`: a file's bytes, or a dataset folder's Arrow files (each
    file's name and bytes, in the order its state.json lists them)."""
    digest = hashlib.sha256()
    if is_dataset_folder(unit):
        for file in _arrow_files(unit):
            digest.update(file.name.encode() + b"\0")
            _hash_into(digest, file)
    else:
        _hash_into(digest, unit)
    return digest.hexdigest()


def unit_bytes(unit: Path) -> int:
    """The bytes of one unit of `data_files` (a dataset folder: its Arrow files')."""
    return sum(f.stat().st_size for f in _arrow_files(unit)) if is_dataset_folder(unit) else unit.stat().st_size


# ------------------------------------------------------------------------------------------
# helpers


def _hash_into(digest, file: Path) -> None:
    with file.open("rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)


def _read_file(file: Path, text_field: str) -> Iterator[str]:
    if is_dataset_folder(file):
        yield from _read_dataset(file, text_field)
    elif file.suffix == ".txt":
        yield _decode(file.read_bytes(), file)
    elif file.suffix == ".jsonl":
        yield from _read_jsonl(file, text_field)
    elif file.suffix == ".parquet":
        yield from _read_parquet(file, text_field)
    else:
        raise NVFP4ToolError(f"{file}: unsupported data file type (use {', '.join(DATA_SUFFIXES)})")


def _file_rows(file: Path) -> Iterator[tuple[str, Any]]:
    if is_dataset_folder(file):
        for number, row in enumerate(_dataset_rows(file), 1):
            yield f"{file}: row {number}", row
    elif file.suffix == ".jsonl":
        for line_number, row in iter_jsonl(file):
            yield f"{file}:{line_number}", row
    elif file.suffix == ".parquet":
        for number, row in enumerate(_parquet_rows(file), 1):
            yield f"{file}: row {number}", row
    else:
        raise NVFP4ToolError(f"{file}: a text file holds no rows (use JSONL, Parquet or a saved dataset)")


def _parquet_rows(file: Path) -> Iterator[dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(file)
        for batch in parquet.iter_batches(batch_size=_ROWS_PER_READ):
            yield from batch.to_pylist()
    except pa.ArrowException as bad:
        raise NVFP4ToolError(f"{file}: not a readable Parquet file ({bad})") from None


def _dataset_rows(folder: Path) -> Iterator[dict]:
    dataset = _load_dataset(folder)
    for batch in dataset.iter(batch_size=_ROWS_PER_READ):
        names = list(batch)
        yield from (dict(zip(names, values)) for values in zip(*(batch[n] for n in names)))


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
    for batch in parquet.iter_batches(columns=[text_field], batch_size=_ROWS_PER_READ):
        yield from _texts(batch.column(0).to_pylist(), file, f"column '{text_field}'")


def _read_dataset(folder: Path, text_field: str) -> Iterator[str]:
    """A `save_to_disk` dataset, memory-mapped by `datasets` and read a batch of rows at a time."""
    dataset = _load_dataset(folder)
    if text_field not in dataset.column_names:
        raise NVFP4ToolError(f"{folder}: no column '{text_field}' (columns: {', '.join(dataset.column_names)})")
    for batch in dataset.select_columns([text_field]).iter(batch_size=_ROWS_PER_READ):
        yield from _texts(batch[text_field], folder, f"column '{text_field}'")


def _load_dataset(folder: Path):
    """A `save_to_disk` dataset, memory-mapped by `datasets`."""
    import datasets

    try:
        dataset = datasets.load_from_disk(str(folder))
    except Exception as bad:  # datasets raises many types for a damaged folder
        raise NVFP4ToolError(f"{folder}: not a readable saved dataset ({str(bad).splitlines()[0]})") from None
    if not isinstance(dataset, datasets.Dataset):
        raise NVFP4ToolError(f"{folder}: a saved {type(dataset).__name__}; give one split's folder")
    return dataset


def _texts(values: list, file: Path, what: str) -> Iterator[str]:
    """The strings of a column's values (nulls skipped); a non-text value is refused naming `file`."""
    for text in values:
        if text is not None and not isinstance(text, str):
            raise NVFP4ToolError(f"{file}: {what} holds {type(text).__name__}, not text")
        if text is not None:
            yield text


def _arrow_files(folder: Path) -> list[Path]:
    """The Arrow files of a `save_to_disk` folder, in its state.json's order."""
    state = read_json_file(folder / DATASET_STATE)
    names = [f.get("filename") for f in state.get("_data_files", [])] if isinstance(state, dict) else None
    if not names or not all(isinstance(n, str) and "/" not in n and n not in ("", ".", "..") for n in names):
        raise NVFP4ToolError(f"{folder / DATASET_STATE}: no list of Arrow files (_data_files)")
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise NVFP4ToolError(f"{folder / missing[0]}: listed in {DATASET_STATE} but missing")
    return [folder / n for n in names]
