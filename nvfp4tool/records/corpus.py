"""`nvfp4tool_corpus.json`: the manifest of a token cache (`nvfp4tool data prepare`).

    manifest = CorpusManifest.read(cache)        # strict: every key typed, counts and sizes agree
    manifest.shards[0].file, manifest.tokens     # "tokens-00000.bin", the stream's length

The tokenizer (sha256 of its serialized tokenizer.json), the token dtype, each source file's
sha256, bytes and documents, each shard's and the document index's file, bytes, sha256 and mtime.
Design notes: docs/design/records.md.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, ClassVar, Literal

from nvfp4tool.records.base import Record, RecordError

FORMAT_VERSION = 1  # of the cache's layout; a cache of another version is refused
DTYPE_BYTES = {"uint16": 2, "uint32": 4}  # the token dtypes, little-endian
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*$")  # a file inside the cache folder (no path)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_DOCUMENTS_READ = {False: "the sources' documents", True: "the sources' rows less those dropped"}


@dataclasses.dataclass(frozen=True)
class StoredFile(Record):
    """A file of the cache: its name in the cache folder, size, sha256 and modification time (ns;
    a file whose mtime still matches is trusted without rehashing)."""

    file: str
    bytes: int
    sha256: str
    mtime_ns: int

    @classmethod
    def _from_json_fields(cls, obj: dict[str, Any], label: str) -> dict[str, Any]:
        fields = super()._from_json_fields(obj, label)
        if not _PLAIN_NAME.match(fields["file"]):
            raise RecordError(f"{label}: file: {fields['file']!r} is not a file name inside the cache folder")
        _check_sha256(fields["sha256"], f"{label}: sha256")
        if fields["bytes"] < 0:
            raise RecordError(f"{label}: bytes: {fields['bytes']} < 0")
        return fields


@dataclasses.dataclass(frozen=True)
class CorpusShard(StoredFile):
    """One flat file of tokens (the next `tokens` of the stream) and its optional aligned loss
    marks (uint8, 1: the token is a target that carries loss)."""

    tokens: int
    loss: StoredFile | None = None


@dataclasses.dataclass(frozen=True)
class CorpusSource(Record):
    """A file read (or a `save_to_disk` dataset folder): its path as given, where it lies from the
    cache, sha256, bytes, documents."""

    name: str  # the path as given to prepare (a folder's file: the folder as given / its relative path)
    sha256: str
    bytes: int
    documents: int
    # where `data verify` finds it: absolute when given absolute, else relative to the cache folder
    # (so from any current folder); None: a manifest written before it was recorded, whose `name` is
    # relative to the folder prepare ran in
    path_from_cache: str | None = None

    def location(self, cache: str | os.PathLike) -> str:
        """The source's path now, for the cache in folder `cache` (`path_from_cache` joined to it,
        an absolute one as is; without it, `name` from the current folder)."""
        if self.path_from_cache is None:
            return self.name
        return os.path.join(os.fspath(cache), self.path_from_cache)  # an absolute one replaces the folder


@dataclasses.dataclass(frozen=True)
class CorpusSft(Record):
    """Fine-tuning rows (format chat / prompt_completion, `corpus/chat.py`): which tokens carry loss,
    what happened to rows longer than `seq_len + 1` tokens, and the counts (never a silent change)."""

    loss_on: str  # assistant | completion | all
    overlong: str  # drop | truncate
    seq_len: int | None  # the limit rows were held to (None: none)
    chat_template_sha256: str | None  # sha256 of the template the messages were rendered with (None: not used)
    rows: int  # rows read
    dropped: int  # longer than seq_len + 1 tokens, left out
    truncated: int  # longer than seq_len + 1 tokens, cut to seq_len + 1
    tokens: int  # tokens of the rows kept
    loss_tokens: int  # of which carry loss

    @classmethod
    def _from_json_fields(cls, obj: dict[str, Any], label: str) -> dict[str, Any]:
        fields = super()._from_json_fields(obj, label)
        counts = ("rows", "dropped", "truncated", "tokens", "loss_tokens")
        if any(fields[k] < 0 for k in counts) or fields["dropped"] + fields["truncated"] > fields["rows"]:
            raise RecordError(f"{label}: counts out of range ({', '.join(f'{k}={fields[k]}' for k in counts)})")
        if fields["loss_tokens"] > fields["tokens"]:
            raise RecordError(f"{label}: loss_tokens {fields['loss_tokens']} > tokens {fields['tokens']}")
        if fields["chat_template_sha256"] is not None:
            _check_sha256(fields["chat_template_sha256"], f"{label}: chat_template_sha256")
        return fields

    @property
    def loss_share(self) -> float:
        """The share of the kept tokens that carry loss."""
        return self.loss_tokens / self.tokens if self.tokens else 0.0


@dataclasses.dataclass(frozen=True)
class CorpusManifest(Record):
    """The token cache: documents, each followed by the end-of-text id, as one stream in shards."""

    FILE_NAME: ClassVar[str] = "nvfp4tool_corpus.json"

    format_version: int
    tokenizer_sha256: str  # sha256 of tokenizer.to_str() (corpus.tokenizer.tokenizer_sha256)
    eos_id: int
    vocab_size: int
    dtype: Literal["uint16", "uint32"]
    format: str  # the data format the documents were read and encoded as ("text")
    text_field: str
    sources: list[CorpusSource]
    shards: list[CorpusShard]
    index: StoredFile  # int64 .npy: each document's start offset in the stream
    documents: int
    tokens: int
    sft: CorpusSft | None = None  # fine-tuning rows' loss and overlong counts (format chat / prompt_completion)

    @classmethod
    def _from_json_fields(cls, obj: dict[str, Any], label: str) -> dict[str, Any]:
        version = obj.get("format_version") if isinstance(obj, dict) else None
        if isinstance(version, int) and version != FORMAT_VERSION:
            raise RecordError(
                f"{label}: format_version {version}; this nvfp4tool reads version {FORMAT_VERSION} "
                "(prepare the cache again)"
            )
        fields = super()._from_json_fields(obj, label)
        _check_sha256(fields["tokenizer_sha256"], f"{label}: tokenizer_sha256")
        itemsize = DTYPE_BYTES[fields["dtype"]]
        for i, shard in enumerate(fields["shards"]):
            where = f"{label}: shards[{i}]"
            if shard.tokens < 1 or shard.bytes != shard.tokens * itemsize:
                raise RecordError(f"{where}: {shard.bytes} bytes for {shard.tokens} {fields['dtype']} tokens")
            if shard.loss is not None and shard.loss.bytes != shard.tokens:
                raise RecordError(f"{where}: loss: {shard.loss.bytes} bytes for {shard.tokens} tokens")
        marked = {s.loss is not None for s in fields["shards"]}
        if len(marked) > 1:
            raise RecordError(f"{label}: shards: loss marks recorded for some shards only")
        sft = fields.get("sft")
        read = sum(s.documents for s in fields["sources"])
        counts = (
            ("tokens", fields["tokens"], sum(s.tokens for s in fields["shards"]), "the shards' tokens"),
            ("documents", fields["documents"], read - (sft.dropped if sft else 0), _DOCUMENTS_READ[sft is not None]),
        )
        if sft is not None and (sft.rows != read or sft.tokens != fields["tokens"]):
            raise RecordError(
                f"{label}: sft: {sft.rows} rows / {sft.tokens} tokens, but the sources hold {read} rows "
                f"and the shards {fields['tokens']} tokens"
            )
        for key, value, expected, what in counts:
            if value != expected:
                raise RecordError(f"{label}: {key}: {value}, but {what} make {expected}")
        names = [s.file for s in fields["shards"]] + [s.loss.file for s in fields["shards"] if s.loss]
        names.append(fields["index"].file)
        if len(set(names)) != len(names) or cls.FILE_NAME in names:
            raise RecordError(f"{label}: a file is named twice")
        if not 0 <= fields["eos_id"] < fields["vocab_size"]:
            raise RecordError(f"{label}: eos_id {fields['eos_id']} outside the vocabulary of {fields['vocab_size']}")
        if fields["vocab_size"] > 2 ** (8 * itemsize):
            raise RecordError(f"{label}: vocab_size {fields['vocab_size']} does not fit {fields['dtype']}")
        return fields

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def has_loss(self) -> bool:
        return bool(self.shards) and self.shards[0].loss is not None


def token_dtype(vocab_size: int) -> str:
    """uint16 when every id fits (vocab_size <= 65536), else uint32."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def _check_sha256(value: str, label: str) -> None:
    if not _SHA256.match(value):
        raise RecordError(f"{label}: {value!r} is not a sha256 (64 lowercase hex digits)")
