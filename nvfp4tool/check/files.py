"""Safetensors files of a folder: headers and index checked against the files, tensors streamed.

Unlike `converters.hf` (which stops at the first bad header), this collects every problem and
keeps every tensor whose bytes lie inside its file, so that one truncated shard does not hide the
rest of the checkpoint. Tensor data is read in chunks (`iter_chunks`): never more than
`CHUNK_BYTES` of one tensor in memory.
"""

from __future__ import annotations

import glob
import json
import math
import os
from collections.abc import Iterator

import ml_dtypes  # noqa: F401 (registers bfloat16 / float8 / float4 with numpy)
import numpy as np

from converters.hf import INDEX_FILE, TensorEntry, scan_safetensors_header
from nvfp4tool.check.report import FILE_LEVEL, Problem
from nvfp4tool.errors import NVFP4ToolError

CHUNK_BYTES = 16 * 2**20  # the most tensor data held at once


def read_tensor_table(folder: str) -> tuple[dict[str, TensorEntry], list[Problem]]:
    """Every readable tensor of the folder (name -> entry) and the problems of its files.

    Sharded (`model.safetensors.index.json`): every indexed tensor must be in the shard the index
    names, every shard tensor in the index, no tensor in two shards, `metadata.total_size` (when
    given) equal to the tensors' bytes. Otherwise every `*.safetensors` of the folder is read.
    Each header must describe its file exactly (contiguous data, nothing past the end, byte counts
    matching dtype x shape); a tensor whose bytes are not all in the file is a problem and is left out.
    """
    index_path = os.path.join(folder, INDEX_FILE)
    if os.path.exists(index_path):
        return _read_sharded(folder, index_path)
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise NVFP4ToolError(f"{folder}: no *.safetensors files and no {INDEX_FILE}")
    problems: list[Problem] = []
    per_file = {path: _read_header(path, problems) for path in files}
    return _readable(_merge_unique(per_file, problems)), problems


def iter_chunks(entry: TensorEntry, chunk_bytes: int = CHUNK_BYTES) -> Iterator[np.ndarray]:
    """The tensor's elements as 1-D arrays of its dtype, at most `chunk_bytes` at a time."""
    itemsize = entry.dtype.itemsize
    step = max(itemsize, chunk_bytes - chunk_bytes % itemsize)
    with open(entry.file, "rb") as f:
        f.seek(entry.start)
        done = 0
        while done < entry.nbytes:
            want = min(step, entry.nbytes - done)
            data = f.read(want)
            if len(data) != want:  # the file changed since its header was checked
                raise NVFP4ToolError(
                    f"{entry.file}: tensor {entry.name!r} truncated while reading "
                    f"({done + len(data)} of {entry.nbytes} bytes)"
                )
            done += want
            yield np.frombuffer(data, dtype=entry.dtype)


def iter_rows(entry: TensorEntry, rows: int) -> Iterator[np.ndarray]:
    """A 2-D+ tensor `rows` leading rows at a time, each chunk in its shape [rows, ...]."""
    row_shape = entry.shape[1:]
    row_bytes = math.prod(row_shape) * entry.dtype.itemsize
    with open(entry.file, "rb") as f:
        for start in range(0, entry.shape[0], rows):
            count = min(rows, entry.shape[0] - start)
            f.seek(entry.start + start * row_bytes)
            data = f.read(count * row_bytes)
            if len(data) != count * row_bytes:
                raise NVFP4ToolError(f"{entry.file}: tensor {entry.name!r} truncated while reading")
            yield np.frombuffer(data, dtype=entry.dtype).reshape(count, *row_shape)


def read_small(entry: TensorEntry) -> np.ndarray:
    """A small tensor (a global scale) whole, in its shape."""
    return np.concatenate(list(iter_chunks(entry)) or [np.zeros(0, entry.dtype)]).reshape(entry.shape)


# ---------------------------------------------------------------------------------------- helpers


def _read_sharded(folder: str, index_path: str) -> tuple[dict[str, TensorEntry], list[Problem]]:
    problems: list[Problem] = []
    index_name = os.path.basename(index_path)
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
        weight_map: dict[str, str] = index["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as bad:
        raise NVFP4ToolError(f"{index_path}: not a valid safetensors index ({bad})") from None

    shard_names = sorted(set(weight_map.values()))
    per_file: dict[str, dict[str, TensorEntry]] = {}
    for shard in shard_names:
        path = os.path.join(folder, shard)
        if os.path.exists(path):
            per_file[path] = _read_header(path, problems)
        else:
            missing = sorted(n for n, s in weight_map.items() if s == shard)
            for name in missing:
                problems.append(Problem(FILE_LEVEL, name, f"{index_name} maps it to {shard}, which does not exist"))
    entries = _merge_unique(per_file, problems)

    for name, shard in weight_map.items():
        path = os.path.join(folder, shard)
        if path in per_file and name not in per_file[path]:
            problems.append(
                Problem(FILE_LEVEL, name, f"{index_name} maps it to {shard}, but that shard has no such tensor")
            )
        elif name in entries and entries[name].file != path:
            problems.append(
                Problem(
                    FILE_LEVEL,
                    name,
                    f"{index_name} maps it to {shard}, but it is in {os.path.basename(entries[name].file)}",
                )
            )
    for name, entry in entries.items():
        if name not in weight_map:
            problems.append(
                Problem(
                    FILE_LEVEL,
                    name,
                    f"in {os.path.basename(entry.file)} but not in {index_name}: loaders will not load it",
                )
            )
    declared = (index.get("metadata") or {}).get("total_size")
    actual = sum(e.nbytes for e in entries.values())
    if declared is not None and declared != actual:
        problems.append(
            Problem(FILE_LEVEL, index_name, f"metadata.total_size is {declared} but the tensors hold {actual} bytes")
        )
    return _readable({n: e for n, e in entries.items() if n in weight_map}), problems


def _readable(entries: dict[str, TensorEntry]) -> dict[str, TensorEntry]:
    """Only the tensors whose bytes all lie in their file (the others are reported as truncated)."""
    sizes: dict[str, int] = {}
    for entry in entries.values():
        sizes.setdefault(entry.file, os.path.getsize(entry.file))
    return {n: e for n, e in entries.items() if e.start + e.nbytes <= sizes[e.file]}


def _merge_unique(per_file: dict[str, dict[str, TensorEntry]], problems: list[Problem]) -> dict[str, TensorEntry]:
    """name -> entry over all files; a name in two files is a problem (the first file is kept)."""
    entries: dict[str, TensorEntry] = {}
    for path, file_entries in per_file.items():
        for name, entry in file_entries.items():
            if name in entries:
                problems.append(
                    Problem(
                        FILE_LEVEL,
                        name,
                        f"in two files: {os.path.basename(entries[name].file)} and {os.path.basename(path)}",
                    )
                )
                continue
            entries[name] = entry
    return entries


def _read_header(path: str, problems: list[Problem]) -> dict[str, TensorEntry]:
    """The sound tensors of one file's header (`converters.hf.scan_safetensors_header`, the one
    header parser, with the serving rules: metadata `format` "pt"); every defect appended to
    `problems`."""
    base = os.path.basename(path)
    entries, defects = scan_safetensors_header(path, serving=True)
    problems.extend(Problem(FILE_LEVEL, d.tensor or base, f"{base}: {d.problem}") for d in defects)
    return entries
