"""Hugging Face safetensors folders in and out, one tensor at a time; the one safetensors header parser.

`scan_safetensors_header` / `read_safetensors_header` (the only header parser), `HFFolderSource`
(reading: ONE tensor per `get`, transformers 5's fused experts read as per-expert views),
`write_hf_folder` (streamed, one source tensor in memory at a time, atomic). An FP8 block-scaled
source (`converters.fp8_block`) reads as its BF16 dequantization, one weight at a time.
Design notes: docs/design/converters.md.
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

import ml_dtypes  # registers bfloat16 / float8 / float4 with numpy; bfloat16 for dequantized FP8
import numpy as np
from safetensors import SafetensorError, safe_open

from converters import fp8_block, layout
from converters.atomic import atomic_output_dir
from converters.tensor_source import WEIGHT_DTYPES, TensorSource, check_against_config, check_finite
from nvfp4tool.config import ModelConfig
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# safetensors dtype code -> numpy/ml_dtypes dtype name, and back (the one table every writer uses).
SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
}
SAFETENSORS_CODES = {name: code for code, name in SAFETENSORS_DTYPES.items()}

# Files besides weights and config.json that a model folder carries and a written copy keeps.
AUX_FILE_PATTERNS = (
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.*",
    "*.tiktoken",
    "preprocessor_config.json",
)

_MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit on the JSON header
_HAND_READ_CODES = ("F8_E4M3", "F8_E5M2", "F8_E8M0")  # safetensors' numpy loader cannot build these
_READ_CHUNK_BYTES = 64 * 2**20  # the most of one tensor read through one file mapping
_DEQUANT_CHUNK_ELEMENTS = 1 << 20  # values of an FP8 weight widened at once (~7 MB of temporaries)


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes lie, from its file's header."""

    name: str
    file: str  # the path the header was read from
    code: str  # safetensors dtype code, e.g. "BF16", "U8", "F8_E4M3"
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int
    # A view of part of another tensor (the fused expert layout): the tensor's name in the file, the
    # leading indices selecting the part (the expert) and its first row there.
    stored: str | None = None
    lead: tuple[int, ...] = ()
    row_offset: int = 0

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(SAFETENSORS_DTYPES[self.code])

    @property
    def label(self) -> str:
        """How messages name the tensor: its name, or the part of the stored tensor it views."""
        if self.stored is None:
            return repr(self.name)
        if not self.lead:
            return repr(self.stored)
        return (
            f"{self.stored!r} (expert {self.lead[0]}, rows {self.row_offset}-"
            f"{self.row_offset + self.shape[0] - 1}: {self.name})"
        )


@dataclasses.dataclass(frozen=True)
class HeaderDefect:
    """One thing wrong with a safetensors header: `tensor` is None for the file as a whole."""

    tensor: str | None
    problem: str

    def message(self, file_path: str) -> str:
        return (
            f"{file_path}: {self.problem}"
            if self.tensor is None
            else f"{file_path}: tensor {self.tensor!r} {self.problem}"
        )


class HFFolderSource:
    """TensorSource over an HF model folder (single-file or sharded safetensors)."""

    def __init__(self, path: str | os.PathLike, *, check_config: bool = True) -> None:
        self._path = os.fspath(path)
        if not os.path.isdir(self._path):
            raise NVFP4ToolError(f"{self._path}: not a folder (expected an HF model folder)")
        self.config: ModelConfig | None = ModelConfig.from_hf_folder(self._path) if check_config else None
        self.fp8_block: fp8_block.FP8Block | None = None  # the source's FP8 block scaling, if it has one
        self._scales: dict[str, TensorEntry] = {}  # FP8 weight (stored name) -> its block scales
        self._entries = self._read_headers()
        if self.config is not None:
            self._entries = self._pair_fp8_scales(self._entries)
            self._entries = _our_names(_unfuse_experts(self._entries, self.config, self._path), self.config)
            # Tolerated and dropped: a tied lm_head.weight some exports keep, and the RoPE buffer
            # `rotary_emb.inv_freq` older conversions stored (we recompute it from the config).
            ignore = tuple(n for n in self._entries if n.endswith(".rotary_emb.inv_freq"))
            ignore += ("lm_head.weight",) if self.config.tie_word_embeddings else ()
            expected = self.config.expected_tensor_shapes()
            check_against_config(
                self, expected, ignore_extra=ignore, config_dtype=self.config.dtype, config=self.config
            )
            self._entries = {n: self._entries[n] for n in expected}  # the config's canonical order

    @property
    def path(self) -> str:
        return self._path

    def names(self) -> list[str]:
        return list(self._entries)

    def use_names_of(self, config: ModelConfig) -> HFFolderSource:
        """This source under our module paths for `config`'s family (a folder opened with
        check_config=False, whose config is parsed apart: an export's); returns self."""
        self._entries = _our_names(self._entries, config)
        return self

    def shard_files(self) -> dict[str, list[str]]:
        """{safetensors file name: its tensors in file order} (from the validated headers)."""
        files: dict[str, list[str]] = {}
        for entry in sorted(self._entries.values(), key=lambda e: (e.file, e.start)):
            files.setdefault(os.path.basename(entry.file), []).append(entry.name)
        return files

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def dtype(self, name: str) -> str:
        entry = self._entry(name)
        return "bfloat16" if (entry.stored or entry.name) in self._scales else entry.dtype.name

    def get(self, name: str) -> np.ndarray:
        """One tensor, checked finite if floating (NVFP4ToolError naming file and tensor if not);
        an FP8 block-scaled weight comes back dequantized to bfloat16."""
        entry = self._entry(name)
        scale = self._scales.get(entry.stored or entry.name)
        array = read_tensor(entry) if scale is None else _dequantize(entry, scale, self.fp8_block.block)
        check_finite(array, f"{entry.file}: tensor {entry.label}")
        return array

    # ------------------------------------------------------------------------------------ helpers

    def _entry(self, name: str) -> TensorEntry:
        try:
            return self._entries[name]
        except KeyError:
            raise NVFP4ToolError(f"{self._path}: no tensor {name!r}") from None

    def _pair_fp8_scales(self, entries: dict[str, TensorEntry]) -> dict[str, TensorEntry]:
        """`entries` less the block scales of an FP8 block-scaled source (config.json's
        quantization_config, dropped from `self.config`: what we write is BF16), each FP8 weight
        paired with its scales in `self._scales`; unchanged for a folder without one."""
        extra = dict(self.config.hf_extra)
        if "quantization_config" not in extra:
            return entries
        self.fp8_block = fp8_block.parse(extra.pop("quantization_config"), os.path.join(self._path, "config.json"))
        self.config = dataclasses.replace(self.config, hf_extra=extra)
        pairs = fp8_block.pair(
            {n: (e.dtype.name, e.shape) for n, e in entries.items()},
            self.fp8_block,
            {n: e.file for n, e in entries.items()},
        )
        self._scales = {weight: entries[scale] for weight, scale in pairs.items()}
        return {n: e for n, e in entries.items() if n not in set(pairs.values())}

    def _read_headers(self) -> dict[str, TensorEntry]:
        index_path = os.path.join(self._path, INDEX_FILE)
        single_path = os.path.join(self._path, SINGLE_FILE)
        if os.path.lexists(index_path):
            return _read_sharded(index_path)
        if os.path.lexists(single_path):
            return read_safetensors_header(single_path)
        raise NVFP4ToolError(
            f"{self._path}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors checkpoints are supported)"
        )


def write_hf_folder(
    out_dir: str | os.PathLike,
    config: ModelConfig,
    source: TensorSource,
    *,
    dtype: str | None = "bf16",
    max_shard_size: int | str = "5GB",
    copy_from: str | os.PathLike | None = None,
    force: bool = False,
    inputs: Iterable[str | os.PathLike] = (),
    flag: str = "output",
    finish: Callable[[str], None] | None = None,
) -> list[str]:
    """Write `source` as an HF model folder; return the weight file names written.

    dtype: "bf16" / "fp32" cast every floating tensor (round to nearest even), None keeps each
    tensor's dtype; config.json's dtype follows. Shards when the total exceeds `max_shard_size`
    ("5GB" = 5e9 bytes, "2GiB" = 2*2**30, or an int), with `model.safetensors.index.json`.
    `copy_from`: a folder whose tokenizer and generation-config files are copied. Every tensor is
    checked against `config.expected_tensor_shapes()` first; a non-finite value (one the source
    holds, or one the cast overflows to) is an error and nothing is written. `inputs` (the folders
    the source reads) and `copy_from` must not overlap `out_dir`, which messages call `flag` (see
    `converters.atomic`). `finish(tmp_dir)` writes more files (a training run's records) into the
    folder before it is published, so they appear together or not at all. Memory: one tensor at a
    time.
    """
    target_dtype = _parse_dtype(dtype)
    shard_limit = parse_size(max_shard_size)
    expected = config.expected_tensor_shapes()
    ignore = ("lm_head.weight",) if config.tie_word_embeddings else ()
    check_against_config(source, expected, ignore_extra=ignore, config=config)
    inputs = [*inputs, *([copy_from] if copy_from is not None else [])]
    names = list(expected)
    keep_fp32 = config.family_spec.stored_fp32
    out_dtypes = {
        n: _output_dtype(
            source.dtype(n),
            "float32" if target_dtype and any(fnmatch.fnmatchcase(n, p) for p in keep_fp32) else target_dtype,
        )
        for n in names
    }
    shards = plan_shards(names, lambda n: _nbytes(out_dtypes[n], expected[n]), shard_limit)
    weight_dtype = out_dtypes["model.embed_tokens.weight"]  # what config.json's dtype declares
    out_config = config
    if weight_dtype in ("float32", "bfloat16", "float16"):
        out_config = dataclasses.replace(config, dtype=weight_dtype)

    def cast(name: str) -> np.ndarray:
        array = np.asarray(source.get(name))
        cast_to = out_dtypes[name] if array.dtype.name != out_dtypes[name] else None
        with np.errstate(over="ignore"):  # an overflow to inf is reported just below
            array = array.astype(out_dtypes[name], copy=False)
        check_finite(array, f"{source.path}: tensor {name!r}", after=f"after the cast to {cast_to}" if cast_to else "")
        return array

    file_names = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    stored = {n: config.family_spec.checkpoint_name(n) for n in names}  # the checkpoint's names
    ours = {s: n for n, s in stored.items()}
    with atomic_output_dir(out_dir, force, inputs=inputs, flag=flag) as tmp_dir:
        for file_name, shard in zip(file_names, shards):
            write_safetensors(
                os.path.join(tmp_dir, file_name),
                [(stored[n], out_dtypes[n], expected[n]) for n in shard],
                lambda s: cast(ours[s]),
                source_label=source.path,
            )
        if len(shards) > 1:
            total = sum(_nbytes(out_dtypes[n], expected[n]) for n in names)
            weight_map = {stored[n]: f for f, shard in zip(file_names, shards) for n in shard}
            _write_json(
                os.path.join(tmp_dir, INDEX_FILE), {"metadata": {"total_size": total}, "weight_map": weight_map}
            )
        _write_json(os.path.join(tmp_dir, "config.json"), out_config.to_hf_config())
        if copy_from is not None:
            for file_name in _aux_files(os.fspath(copy_from)):
                shutil.copy2(os.path.join(copy_from, file_name), os.path.join(tmp_dir, file_name))
        if finish is not None:
            finish(tmp_dir)
    return file_names


def write_safetensors(
    path: str,
    layout: Iterable[tuple[str, str, tuple[int, ...]]],
    load: Callable[[str], np.ndarray],
    *,
    metadata: Mapping[str, str] | None = None,
    source_label: str = "<source>",
) -> None:
    """Write one safetensors file tensor by tensor.

    `layout` lists (name, dtype name, shape) in file order; the header is written from it first,
    then `load(name)` is called once per tensor and its bytes appended, so only one tensor is held.
    A loaded tensor whose dtype or shape differs from its layout entry raises NVFP4ToolError.
    """
    layout = list(layout)
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name, dtype, shape in layout:
        if dtype not in SAFETENSORS_CODES:
            raise NVFP4ToolError(f"{source_label}: tensor {name!r} has dtype {dtype} that safetensors cannot store")
        nbytes = _nbytes(dtype, shape)
        header[name] = {
            "dtype": SAFETENSORS_CODES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)  # data starts 8-byte aligned, as safetensors pads
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for name, dtype, shape in layout:
            array = load(name)
            if array.dtype.name != dtype or tuple(array.shape) != tuple(shape):
                raise NVFP4ToolError(
                    f"{source_label}: tensor {name!r} is {array.dtype.name}"
                    f"{list(array.shape)}, expected {dtype}{list(shape)}"
                )
            f.write(
                np.ascontiguousarray(array).reshape(-1).view(np.uint8).data
            )  # little-endian on every platform we run on
            del array


def read_safetensors_header(file_path: str) -> dict[str, TensorEntry]:
    """name -> entry of one safetensors file, in header order, without reading tensor data.

    Raises NVFP4ToolError (naming the file, and the tensor where there is one) at the first
    defect `scan_safetensors_header` finds.
    """
    entries, defects = scan_safetensors_header(file_path)
    if defects:
        raise NVFP4ToolError(defects[0].message(file_path))
    return entries


def scan_safetensors_header(
    file_path: str, *, serving: bool = False
) -> tuple[dict[str, TensorEntry], list[HeaderDefect]]:
    """(well-formed entries, every defect) of one safetensors file's header.

    `serving=True` (check, for the folders engines load) also requires what transformers 4.x's
    loader requires of the metadata: absent, or with `format` "pt" (it refuses a `__metadata__`
    without `format` or with another one, and reads "tf" / "flax" as other frameworks' weights;
    transformers 5 no longer looks). A source is read by our own reader, which does not care.

    The entries are the well-formed ones (known dtype, integer shape, `dtype x shape` bytes between
    its offsets), including any whose bytes run past the end of the file (a truncated file: the
    defect names it, and a caller that reads must skip it) or overlap another's, so that a
    checker can still account for them. A file whose header cannot be read at all gives no
    entries and one defect.
    """
    try:
        header_len, raw, file_size = _read_raw_header(file_path)
    except _Unreadable as bad:
        return {}, [HeaderDefect(None, str(bad))]
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, ValueError) as bad:
        return {}, [HeaderDefect(None, f"header is not valid UTF-8 JSON ({bad})")]
    if not isinstance(header, dict):
        return {}, [HeaderDefect(None, f"header is a JSON {type(header).__name__}, not an object")]
    defects: list[HeaderDefect] = []
    metadata = header.get("__metadata__")  # optional; null is allowed, as safetensors allows it
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        defects.append(HeaderDefect(None, "__metadata__ is not a map of strings to strings"))
    elif serving and metadata is not None and metadata.get("format") != "pt":
        defects.append(
            HeaderDefect(
                None,
                f"__metadata__ format is {metadata.get('format')!r}, not 'pt': "
                f"transformers refuses to load it as PyTorch weights",
            )
        )
    data_start, data_size = 8 + header_len, file_size - 8 - header_len
    entries: dict[str, TensorEntry] = {}
    spans: list[tuple[int, int, str]] = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        parsed = _parse_entry(name, info, data_size, defects)
        if parsed is not None:
            code, shape, begin, end = parsed
            spans.append((begin, end, name))
            entries[name] = TensorEntry(
                name=name, file=file_path, code=code, shape=shape, start=data_start + begin, nbytes=end - begin
            )
    _check_tiling(spans, data_size, defects)
    return entries, defects


def read_tensor(entry: TensorEntry) -> np.ndarray:
    """One tensor's data (no value checks), through safetensors' `safe_open` except for F8 dtypes.

    Read in row chunks of at most `_READ_CHUNK_BYTES`, the file reopened (and so unmapped) for each:
    reading a whole tensor through one mapping keeps its pages resident next to the copy, which
    raised export's peak memory by ~0.45x the largest tensor (tests/export/test_export_memory.py)."""
    if entry.code in _HAND_READ_CODES:
        return _read_by_hand(entry)
    key = entry.stored or entry.name
    try:
        if not entry.lead and (len(entry.shape) < 2 or entry.nbytes <= _READ_CHUNK_BYTES):
            with safe_open(entry.file, framework="numpy") as f:
                return f.get_tensor(key)
        out = np.empty(entry.shape, entry.dtype)
        rows = max(1, _READ_CHUNK_BYTES // max(1, entry.nbytes // max(1, entry.shape[0])))
        for start in range(0, entry.shape[0], rows):
            stop = min(start + rows, entry.shape[0])  # safetensors >= 0.8 refuses a slice past the end
            index = (*entry.lead, slice(entry.row_offset + start, entry.row_offset + stop))
            with safe_open(entry.file, framework="numpy") as f:
                out[start:stop] = f.get_slice(key)[index]
        return out
    except (SafetensorError, OSError) as bad:  # the file changed since its header was checked
        raise NVFP4ToolError(f"{entry.file}: tensor {entry.label} cannot be read ({bad})") from None


def parse_size(size: int | str, flag: str = "--max-shard-size") -> int:
    """Bytes from an int or a string like "5GB" (decimal, as HF) / "500MiB" (binary).

    A size that is not one is bad usage (NVFP4UsageError naming `flag`, the option it came from)."""
    if isinstance(size, int):
        if size <= 0:
            raise NVFP4UsageError(f"{flag} must be positive, got {size}")
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", str(size), re.IGNORECASE)
    powers = {
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }
    unit = (match.group(2) or "B").upper() if match else None
    if unit not in powers or int(float(match.group(1)) * powers[unit]) <= 0:
        raise NVFP4UsageError(f"{flag} {size!r}: not a size; use e.g. 5GB, 500MB, 2GiB or a byte count")
    return int(float(match.group(1)) * powers[unit])


# ---------------------------------------------------------------------------------------- helpers


def _read_sharded(index_path: str) -> dict[str, TensorEntry]:
    folder = os.path.dirname(index_path)
    try:
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
            raise TypeError("weight_map is not a map of tensor names to file names")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as bad:
        raise NVFP4ToolError(f"{index_path}: not a valid safetensors index ({bad!r})") from None
    shard_headers: dict[str, dict[str, TensorEntry]] = {}
    entries: dict[str, TensorEntry] = {}
    for name, shard_name in weight_map.items():
        shard_path = os.path.join(folder, shard_name)
        if shard_name not in shard_headers:
            if not os.path.lexists(shard_path):
                raise NVFP4ToolError(f"{shard_path}: missing shard (the index maps tensor {name!r} to it)")
            shard_headers[shard_name] = read_safetensors_header(shard_path)
        if name not in shard_headers[shard_name]:
            raise NVFP4ToolError(f"{shard_path}: tensor {name!r} is not in this shard, but {INDEX_FILE} says it is")
        entries[name] = shard_headers[shard_name][name]
    return entries


def _our_names(entries: dict[str, TensorEntry], config: ModelConfig) -> dict[str, TensorEntry]:
    """`entries` under our module paths: a family whose checkpoints name tensors otherwise
    (`Family.checkpoint_name`: nemotron_h's `backbone.*`) is renamed here, each entry keeping its
    stored name for reading and messages. A name both spellings would give is refused."""
    out: dict[str, TensorEntry] = {}
    for stored, entry in entries.items():
        name = config.family_spec.our_name(stored)
        if name in out:
            raise NVFP4ToolError(
                f"{entry.file}: tensors {out[name].label} and {entry.label} are the same "
                f"{config.family} tensor under two names"
            )
        out[name] = entry if name == stored else dataclasses.replace(entry, name=name, stored=entry.stored or stored)
    return out


def _unfuse_experts(entries: dict[str, TensorEntry], config: ModelConfig, folder: str) -> dict[str, TensorEntry]:
    """`entries` with transformers 5's fused expert tensors replaced by per-expert views (see the
    module docstring); unchanged when the folder has no fused tensor."""
    fused = [n for n in entries if re.search(layout.FUSED_TENSOR_RE, n)]
    if not fused:
        return entries
    views = layout.fused_expert_views(config)
    per_expert = next((n for n in entries if n in views and views[n].fused != n), None)
    if per_expert is not None:
        raise NVFP4ToolError(
            f"{folder}: tensor {fused[0]!r} is in transformers 5's fused expert layout "
            f"but {per_expert!r} in the per-expert one; a checkpoint must use one layout"
        )
    for name, want in layout.fused_expert_shapes(config).items():
        entry = entries.get(name)
        if entry is None:
            raise NVFP4ToolError(
                f"{folder}: tensor {name!r} missing; the config expects it in "
                f"transformers 5's fused expert layout, which {fused[0]!r} is in"
            )
        if entry.shape != want:
            axes = (
                "experts x (gate + up rows) x hidden"
                if name.endswith(layout.FUSED_GATE_UP)
                else "experts x hidden x expert width"
                if name.endswith(layout.FUSED_DOWN)
                else "experts x hidden, the router"
            )
            raise NVFP4ToolError(
                f"{entry.file}: tensor {name!r} has shape {list(entry.shape)}, the config "
                f"expects {list(want)} (transformers 5's fused expert layout: {axes})"
            )
        if entry.dtype.name not in WEIGHT_DTYPES:
            raise NVFP4ToolError(
                f"{entry.file}: tensor {name!r} has dtype {entry.dtype.name}, the config "
                f"expects a floating-point weight ({', '.join(WEIGHT_DTYPES)})"
            )
        if {entry.dtype.name, config.dtype} == {"float16", "bfloat16"}:
            raise NVFP4ToolError(
                f"{entry.file}: tensor {name!r} is {entry.dtype.name} but config.json "
                f"declares {config.dtype} (a relabelled header?)"
            )
    stored = {view.fused for view in views.values()}
    out = {n: e for n, e in entries.items() if n not in stored}
    for name, view in views.items():
        whole = entries[view.fused]
        if view.expert is None:  # the router: Mixtral's renamed, Qwen3-MoE's as it is
            out[name] = whole if whole.name == name else dataclasses.replace(whole, name=name, stored=whole.name)
            continue
        row_bytes = math.prod(whole.shape[2:]) * whole.dtype.itemsize
        start = whole.start + (view.expert * whole.shape[1] + view.row_start) * row_bytes
        out[name] = TensorEntry(
            name=name,
            file=whole.file,
            code=whole.code,
            shape=(view.rows, *whole.shape[2:]),
            start=start,
            nbytes=view.rows * row_bytes,
            stored=whole.name,
            lead=(view.expert,),
            row_offset=view.row_start,
        )
    return out


class _Unreadable(Exception):
    """The header itself cannot be read (no file, a folder, truncated prefix, a length that lies)."""


def _read_raw_header(file_path: str) -> tuple[int, bytes, int]:
    """(header length, header bytes, file size)."""
    if os.path.isdir(file_path):
        raise _Unreadable("is a folder, not a safetensors file")
    try:
        with open(file_path, "rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise _Unreadable(f"truncated: {file_size} bytes, no safetensors header")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(_MAX_HEADER_BYTES, file_size - 8):
                raise _Unreadable(
                    f"header claims {header_len} bytes but the file has {file_size} (truncated or not safetensors)"
                )
            return header_len, f.read(header_len), file_size
    except FileNotFoundError:
        raise _Unreadable("no such file") from None
    except OSError as bad:
        raise _Unreadable(f"cannot be read ({bad.strerror or bad})") from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:
        raise ValueError(f"{repeated[0]!r} appears twice")
    return dict(pairs)


def _parse_entry(
    name: str, info: Any, data_size: int, defects: list[HeaderDefect]
) -> tuple[str, tuple[int, ...], int, int] | None:
    """(code, shape, begin, end) of a well-formed entry; None (and a defect) otherwise."""

    def bad(problem: str) -> None:
        defects.append(HeaderDefect(name, problem))

    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        return bad(f"has a malformed header entry {info!r} (needs dtype, shape, data_offsets)")
    code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if code not in SAFETENSORS_DTYPES:
        return bad(f"has unsupported dtype {code!r}")
    if not (isinstance(shape, list) and all(_is_count(d) for d in shape)):
        return bad(f"has a malformed shape {shape!r}")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(_is_count(v) for v in offsets)
        and offsets[0] <= offsets[1]
    ):
        return bad(f"has bad data_offsets {offsets!r}")
    begin, end = offsets
    nbytes = _nbytes(SAFETENSORS_DTYPES[code], tuple(shape))
    if end - begin != nbytes:
        return bad(f"spans {end - begin} bytes but {code}{shape} needs {nbytes} (header lies about its size)")
    if end > data_size:
        bad(f"ends at data byte {end} but the file holds {data_size} (truncated shard or lying header)")
    return code, tuple(shape), begin, end


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_tiling(spans: list[tuple[int, int, str]], data_size: int, defects: list[HeaderDefect]) -> None:
    """The tensors must tile the data region exactly, as the safetensors library requires.
    Overlaps are reported before gaps (two tensors on the same bytes also leave a gap elsewhere)."""
    overlaps, gaps = [], []
    cursor, last = 0, None
    for begin, end, name in sorted(spans):
        if begin < cursor:
            overlaps.append(
                HeaderDefect(
                    name,
                    f"overlaps tensor {last!r} (its data starts at byte {begin}, before {cursor} where {last!r} ends)",
                )
            )
        elif begin > cursor:
            gaps.append(HeaderDefect(name, f"leaves a gap of {begin - cursor} bytes before it"))
        if end > cursor:
            cursor, last = end, name
    if cursor < data_size:
        gaps.append(HeaderDefect(None, f"{data_size - cursor} bytes after the last tensor's data"))
    defects.extend(overlaps + gaps)


def _read_by_hand(entry: TensorEntry, rows: tuple[int, int] | None = None) -> np.ndarray:
    """The tensor, or its rows [start, stop) (one seek + read of their bytes)."""
    start, stop = rows if rows is not None else (0, entry.shape[0] if entry.shape else 1)
    row_bytes = entry.nbytes // max(1, entry.shape[0]) if entry.shape else entry.nbytes
    nbytes = (stop - start) * row_bytes
    buffer = bytearray(nbytes)
    try:
        with open(entry.file, "rb") as f:
            f.seek(entry.start + start * row_bytes)
            got = f.readinto(buffer)
    except OSError as bad:
        raise NVFP4ToolError(f"{entry.file}: tensor {entry.name!r} cannot be read ({bad.strerror or bad})") from None
    if got != nbytes:  # the file shrank since its header was checked
        raise NVFP4ToolError(f"{entry.file}: tensor {entry.name!r} truncated: read {got} of {nbytes} bytes")
    shape = entry.shape if rows is None else (stop - start, *entry.shape[1:])
    return np.frombuffer(buffer, dtype=entry.dtype).reshape(shape)


def _dequantize(entry: TensorEntry, scale: TensorEntry, block: tuple[int, int]) -> np.ndarray:
    """An FP8 block-scaled weight as bfloat16 (`fp8_block.dequantize_rows`), read and widened in
    chunks of whole block rows of about `_DEQUANT_CHUNK_ELEMENTS` values, so that besides the
    result only one chunk's fp8 / fp32 / bf16 copies are held."""
    scales = read_tensor(scale)
    fp8_block.check_scales(scales, f"{scale.file}: tensor {scale.label}")
    rows, cols = entry.shape
    out = np.empty(entry.shape, ml_dtypes.bfloat16)
    step = max(1, _DEQUANT_CHUNK_ELEMENTS // max(1, cols * block[0])) * block[0]
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        values = _read_by_hand(entry, (start, stop))
        out[start:stop] = fp8_block.dequantize_rows(values, scales[start // block[0] : -(-stop // block[0])], block)
    return out


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
    aliases = {
        None: None,
        "keep": None,
        "bf16": "bfloat16",
        "bfloat16": "bfloat16",
        "fp32": "float32",
        "float32": "float32",
    }
    if dtype not in aliases:
        raise NVFP4ToolError(f"output dtype {dtype!r} unsupported; supported: bf16, fp32, None (keep)")
    return aliases[dtype]


def _output_dtype(source_dtype: str, target: str | None) -> str:
    """Cast wide floats to `target`; integer / float8 tensors (and target None) keep their dtype."""
    return target if target is not None and source_dtype in WEIGHT_DTYPES else source_dtype


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize


def _aux_files(folder: str) -> list[str]:
    return sorted(
        f
        for f in os.listdir(folder)
        if os.path.isfile(os.path.join(folder, f)) and any(fnmatch.fnmatch(f, pattern) for pattern in AUX_FILE_PATTERNS)
    )


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")
