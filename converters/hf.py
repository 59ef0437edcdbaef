"""Hugging Face safetensors folders in and out, one tensor at a time.

Reading: `HFFolderSource(path)` is a `TensorSource` over a single-file (`model.safetensors`) or
sharded (`model.safetensors.index.json`) checkpoint. It parses every shard's header itself and
checks it against the file size before any data is read (a truncated shard or a header that lies
is an error naming the file and tensor), then reads ONE tensor per `get` with a seek + read (bf16
comes back as `ml_dtypes.bfloat16`; numpy has no bf16, so safetensors' own numpy loader cannot be
used). With `check_config=True` (default) config.json is parsed into `ModelConfig` and every tensor
must be present with the shape the config implies.

Writing: `write_hf_folder` writes shards tensor by tensor with our own header writer (the header
is computed from shapes and dtypes before any data is loaded), so it holds ONE source tensor (plus
its cast copy) in memory at a time, whatever the shard size. The folder is built in a temporary
sibling and renamed into place (`converters.atomic`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
import os
import re
import shutil
import struct
from typing import Any, Callable, Iterable, Mapping

import ml_dtypes  # noqa: F401  (registers "bfloat16" / float8 names with numpy)
import numpy as np

from converters.atomic import atomic_output_dir
from converters.tensor_source import TensorSource, check_against_config
from nvfp4tool.config import ModelConfig
from nvfp4tool.errors import NVFP4ToolError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# safetensors dtype code -> numpy/ml_dtypes dtype name (and back).
SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
}
_CODE_BY_DTYPE = {name: code for code, name in SAFETENSORS_DTYPES.items()}

# Files besides weights and config.json that a model folder carries and a written copy keeps.
AUX_FILE_PATTERNS = ("generation_config.json", "tokenizer*", "special_tokens_map.json",
                     "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
                     "chat_template.*", "*.tiktoken", "preprocessor_config.json")

_CASTABLE_DTYPES = ("float64", "float32", "float16", "bfloat16")
_MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit on the JSON header


@dataclasses.dataclass(frozen=True)
class _TensorEntry:
    """Where one tensor's bytes lie: absolute byte range in `file`."""

    file: str
    dtype: str  # numpy/ml_dtypes name
    shape: tuple[int, ...]
    start: int  # absolute offset in the file
    nbytes: int


class HFFolderSource:
    """TensorSource over an HF model folder (single-file or sharded safetensors)."""

    def __init__(self, path: str | os.PathLike, *, check_config: bool = True) -> None:
        self._path = os.fspath(path)
        if not os.path.isdir(self._path):
            raise NVFP4ToolError(f"{self._path}: not a folder (expected an HF model folder)")
        self.config: ModelConfig | None = ModelConfig.from_hf_folder(self._path) if check_config else None
        self._entries = self._read_headers()
        if self.config is not None:
            # Tolerated and dropped: a tied lm_head.weight some exports keep, and the RoPE buffer
            # `rotary_emb.inv_freq` older conversions stored (we recompute it from the config).
            ignore = tuple(n for n in self._entries if n.endswith(".rotary_emb.inv_freq"))
            ignore += ("lm_head.weight",) if self.config.tie_word_embeddings else ()
            expected = self.config.expected_tensor_shapes()
            check_against_config(self, expected, ignore_extra=ignore)
            self._entries = {n: self._entries[n] for n in expected}  # the config's canonical order

    @property
    def path(self) -> str:
        return self._path

    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def dtype(self, name: str) -> str:
        return self._entry(name).dtype

    def get(self, name: str) -> np.ndarray:
        entry = self._entry(name)
        buffer = bytearray(entry.nbytes)
        with open(entry.file, "rb") as f:
            f.seek(entry.start)
            got = f.readinto(buffer)
        if got != entry.nbytes:  # the file shrank since its header was checked
            raise NVFP4ToolError(f"{entry.file}: tensor {name!r} truncated: read {got} of "
                                 f"{entry.nbytes} bytes")
        return np.frombuffer(buffer, dtype=entry.dtype).reshape(entry.shape)

    def aux_files(self) -> list[str]:
        """Names of the tokenizer / generation-config files in the folder (copied on write)."""
        return _aux_files(self._path)

    # ------------------------------------------------------------------------------------ helpers

    def _entry(self, name: str) -> _TensorEntry:
        try:
            return self._entries[name]
        except KeyError:
            raise NVFP4ToolError(f"{self._path}: no tensor {name!r}") from None

    def _read_headers(self) -> dict[str, _TensorEntry]:
        index_path = os.path.join(self._path, INDEX_FILE)
        single_path = os.path.join(self._path, SINGLE_FILE)
        if os.path.exists(index_path):
            return _read_sharded(index_path)
        if os.path.exists(single_path):
            return read_safetensors_header(single_path)
        raise NVFP4ToolError(f"{self._path}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors "
                             f"checkpoints are supported)")


def write_hf_folder(out_dir: str | os.PathLike, config: ModelConfig, source: TensorSource, *,
                    dtype: str | None = "bf16", max_shard_size: int | str = "5GB",
                    copy_from: str | os.PathLike | None = None, force: bool = False) -> list[str]:
    """Write `source` as an HF model folder; return the weight file names written.

    dtype: "bf16" / "fp32" cast every floating tensor (round to nearest even), None keeps each
    tensor's dtype; config.json's dtype follows. Shards when the total exceeds `max_shard_size`
    ("5GB" = 5e9 bytes, "2GiB" = 2*2**30, or an int), with `model.safetensors.index.json`.
    `copy_from`: a folder whose tokenizer and generation-config files are copied. Every tensor is
    checked against `config.expected_tensor_shapes()` first. Memory: one tensor at a time.
    """
    target_dtype = _parse_dtype(dtype)
    shard_limit = parse_size(max_shard_size)
    expected = config.expected_tensor_shapes()
    ignore = ("lm_head.weight",) if config.tie_word_embeddings else ()
    check_against_config(source, expected, ignore_extra=ignore)
    names = list(expected)
    out_dtypes = {n: _output_dtype(source.dtype(n), target_dtype) for n in names}
    shards = plan_shards(names, lambda n: _nbytes(out_dtypes[n], expected[n]), shard_limit)
    weight_dtype = out_dtypes["model.embed_tokens.weight"]  # what config.json's dtype declares
    out_config = config
    if weight_dtype in ("float32", "bfloat16", "float16"):
        out_config = dataclasses.replace(config, dtype=weight_dtype)

    def cast(name: str) -> np.ndarray:
        return np.asarray(source.get(name)).astype(out_dtypes[name], copy=False)

    file_names = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    with atomic_output_dir(out_dir, force) as tmp_dir:
        for file_name, shard in zip(file_names, shards):
            write_safetensors(os.path.join(tmp_dir, file_name),
                              [(n, out_dtypes[n], expected[n]) for n in shard], cast,
                              source_label=source.path)
        if len(shards) > 1:
            total = sum(_nbytes(out_dtypes[n], expected[n]) for n in names)
            weight_map = {n: f for f, shard in zip(file_names, shards) for n in shard}
            _write_json(os.path.join(tmp_dir, INDEX_FILE),
                        {"metadata": {"total_size": total}, "weight_map": weight_map})
        _write_json(os.path.join(tmp_dir, "config.json"), out_config.to_hf_config())
        if copy_from is not None:
            for file_name in _aux_files(os.fspath(copy_from)):
                shutil.copy2(os.path.join(copy_from, file_name), os.path.join(tmp_dir, file_name))
    return file_names


def write_safetensors(path: str, layout: Iterable[tuple[str, str, tuple[int, ...]]],
                      load: Callable[[str], np.ndarray], *, metadata: Mapping[str, str] | None = None,
                      source_label: str = "<source>") -> None:
    """Write one safetensors file tensor by tensor.

    `layout` lists (name, dtype name, shape) in file order; the header is written from it first,
    then `load(name)` is called once per tensor and its bytes appended, so only one tensor is held.
    A loaded tensor whose dtype or shape differs from its layout entry raises NVFP4ToolError.
    """
    layout = list(layout)
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name, dtype, shape in layout:
        if dtype not in _CODE_BY_DTYPE:
            raise NVFP4ToolError(f"{source_label}: tensor {name!r} has dtype {dtype} that "
                                 f"safetensors cannot store")
        nbytes = _nbytes(dtype, shape)
        header[name] = {"dtype": _CODE_BY_DTYPE[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)  # data starts 8-byte aligned, as safetensors pads
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for name, dtype, shape in layout:
            array = load(name)
            if array.dtype.name != dtype or tuple(array.shape) != tuple(shape):
                raise NVFP4ToolError(f"{source_label}: tensor {name!r} is {array.dtype.name}"
                                     f"{list(array.shape)}, expected {dtype}{list(shape)}")
            f.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)  # little-endian on every platform we run on
            del array


def read_safetensors_header(file_path: str) -> dict[str, _TensorEntry]:
    """Parse and check one safetensors header: name -> byte range, without reading tensor data.

    Checks the header length and every tensor's offsets against the file size, and each tensor's
    byte count against its dtype and shape.
    """
    try:
        file_size = os.path.getsize(file_path)
        with open(file_path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise NVFP4ToolError(f"{file_path}: truncated: {file_size} bytes, no safetensors header")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(_MAX_HEADER_BYTES, file_size - 8):
                raise NVFP4ToolError(f"{file_path}: header claims {header_len} bytes but the file "
                                     f"has {file_size} (truncated or not safetensors)")
            header_raw = f.read(header_len)
    except FileNotFoundError:
        raise NVFP4ToolError(f"{file_path}: no such file") from None
    try:
        header = json.loads(header_raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as bad:
        raise NVFP4ToolError(f"{file_path}: header is not valid JSON ({bad})") from None
    if not isinstance(header, dict):
        raise NVFP4ToolError(f"{file_path}: header is not a JSON object")
    data_start = 8 + header_len
    data_size = file_size - data_start
    entries: dict[str, _TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entries[name] = _parse_entry(file_path, name, info, data_start, data_size)
    return entries


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like "5GB" (decimal, as HF) / "500MiB" (binary)."""
    if isinstance(size, int):
        if size <= 0:
            raise NVFP4ToolError(f"shard size must be positive, got {size}")
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", str(size), re.IGNORECASE)
    if not match:
        raise NVFP4ToolError(f"cannot parse size {size!r}; use e.g. 5GB, 500MB, 2GiB or a byte count")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    powers = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    if unit not in powers or number <= 0:
        raise NVFP4ToolError(f"cannot parse size {size!r}; use e.g. 5GB, 500MB, 2GiB or a byte count")
    return int(number * powers[unit])


# ---------------------------------------------------------------------------------------- helpers


def _read_sharded(index_path: str) -> dict[str, _TensorEntry]:
    folder = os.path.dirname(index_path)
    try:
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as bad:
        raise NVFP4ToolError(f"{index_path}: not a valid safetensors index ({bad!r})") from None
    shard_headers: dict[str, dict[str, _TensorEntry]] = {}
    entries: dict[str, _TensorEntry] = {}
    for name, shard_name in weight_map.items():
        shard_path = os.path.join(folder, shard_name)
        if shard_name not in shard_headers:
            if not os.path.exists(shard_path):
                raise NVFP4ToolError(f"{shard_path}: missing shard (the index maps tensor {name!r} to it)")
            shard_headers[shard_name] = read_safetensors_header(shard_path)
        if name not in shard_headers[shard_name]:
            raise NVFP4ToolError(f"{shard_path}: tensor {name!r} is not in this shard, but "
                                 f"{INDEX_FILE} says it is")
        entries[name] = shard_headers[shard_name][name]
    return entries


def _parse_entry(file_path: str, name: str, info: Any, data_start: int, data_size: int) -> _TensorEntry:
    try:
        code, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise NVFP4ToolError(f"{file_path}: tensor {name!r} has a malformed header entry") from None
    if code not in SAFETENSORS_DTYPES:
        raise NVFP4ToolError(f"{file_path}: tensor {name!r} has unsupported dtype {code}")
    dtype = SAFETENSORS_DTYPES[code]
    nbytes = _nbytes(dtype, shape)
    if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
        raise NVFP4ToolError(f"{file_path}: tensor {name!r} has bad data_offsets {[begin, end]}")
    if end > data_size:
        raise NVFP4ToolError(f"{file_path}: tensor {name!r} ends at byte {data_start + end} but the "
                             f"file has {data_start + data_size} (truncated shard or lying header)")
    if end - begin != nbytes:
        raise NVFP4ToolError(f"{file_path}: tensor {name!r} spans {end - begin} bytes but "
                             f"{dtype}{list(shape)} needs {nbytes} (header lies about its size)")
    return _TensorEntry(file=file_path, dtype=dtype, shape=shape, start=data_start + begin, nbytes=nbytes)


def plan_shards(items: list, nbytes: Callable[[Any], int], limit: int) -> list[list]:
    """Greedy, in order: a new shard starts when the next item would overflow the limit (an item
    larger than the limit gets a shard of its own, as transformers does)."""
    shards: list[list] = [[]]
    used = 0
    for item in items:
        size = nbytes(item)
        if shards[-1] and used + size > limit:
            shards.append([])
            used = 0
        shards[-1].append(item)
        used += size
    return shards


def _parse_dtype(dtype: str | None) -> str | None:
    aliases = {None: None, "keep": None, "bf16": "bfloat16", "bfloat16": "bfloat16",
               "fp32": "float32", "float32": "float32"}
    if dtype not in aliases:
        raise NVFP4ToolError(f"output dtype {dtype!r} unsupported; supported: bf16, fp32, None (keep)")
    return aliases[dtype]


def _output_dtype(source_dtype: str, target: str | None) -> str:
    """Cast wide floats to `target`; integer / float8 tensors (and target None) keep their dtype."""
    return target if target is not None and source_dtype in _CASTABLE_DTYPES else source_dtype


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize


def _aux_files(folder: str) -> list[str]:
    return sorted(f for f in os.listdir(folder)
                  if os.path.isfile(os.path.join(folder, f))
                  and any(fnmatch.fnmatch(f, pattern) for pattern in AUX_FILE_PATTERNS))


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")

