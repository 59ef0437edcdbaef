"""Open a token cache (`nvfp4tool data prepare`'s output) and check it against its manifest.

    cache = open_cache("cache/")                   # sizes checked; a file whose mtime moved is rehashed
    cache.check_tokenizer(tokenizer, "data")      # the run's tokenizer must be the cache's
    windows = cache.windows(seq_len=128, packing="segmented")

Shards are memory-mapped (`np.memmap`), never read whole. `verify_cache` (`data verify`) rehashes
every file and the sources the manifest records.
Design notes: docs/design/data.md.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np

from nvfp4tool.corpus.sources import file_sha256
from nvfp4tool.corpus.tokenizer import TextTokenizer, tokenizer_sha256
from nvfp4tool.corpus.windows import TokenStream, Windows
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.records.corpus import CorpusManifest, StoredFile


@dataclasses.dataclass(frozen=True)
class TokenCache:
    """An opened cache: its manifest, the manifest file's sha256, and its memory-mapped files."""

    folder: Path
    manifest: CorpusManifest
    manifest_sha256: str
    tokens: TokenStream
    loss: TokenStream | None
    starts: np.ndarray  # [documents] int64: each document's first token in the stream

    def check_tokenizer(self, tokenizer: TextTokenizer, key: str = "data") -> None:
        """Refuse a tokenizer other than the one the cache was prepared with (naming both hashes)."""
        now = tokenizer_sha256(tokenizer)
        if now != self.manifest.tokenizer_sha256 or tokenizer.eos_id != self.manifest.eos_id:
            raise NVFP4ToolError(
                f"{key}={self.folder}: prepared with another tokenizer (sha256 {self.manifest.tokenizer_sha256}, "
                f"end-of-text id {self.manifest.eos_id}; the run's: sha256 {now}, end-of-text id {tokenizer.eos_id})"
            )

    def windows(self, seq_len: int, packing: str = "concat") -> Windows:
        """The cache's rows (its format decides their layout: `Windows.of`), padded with its end-of-text id."""
        return Windows.of(
            self.tokens,
            seq_len,
            starts=self.starts,
            loss=self.loss,
            packing=packing,
            format=self.manifest.format,
            pad_id=self.manifest.eos_id,
            label=str(self.folder),
        )


def is_cache(path: str | os.PathLike) -> bool:
    """Whether `path` is a folder holding a token cache's manifest."""
    return os.path.isdir(path) and CorpusManifest.exists(path)


def manifest_sha256(folder: str | os.PathLike) -> str:
    """sha256 of a cache's manifest file: the cache's identity (it records every shard's sha256)."""
    return file_sha256(Path(CorpusManifest.path(folder)))


def open_cache(folder: str | os.PathLike, *, verify: bool = False) -> TokenCache:
    """The cache in `folder`: every file's size checked, its sha256 too where its mtime differs from
    the manifest's record (every file with `verify`); a defect is one line naming the file."""
    folder = Path(folder)
    manifest = CorpusManifest.read(folder)
    dtype = np.dtype(manifest.dtype).newbyteorder("<")
    shards, losses = [], []
    for shard in manifest.shards:
        _check_file(folder, shard, verify)
        shards.append(np.memmap(folder / shard.file, dtype=dtype, mode="r", shape=(shard.tokens,)))
        if shard.loss is not None:
            _check_file(folder, shard.loss, verify)
            losses.append(np.memmap(folder / shard.loss.file, dtype=np.uint8, mode="r", shape=(shard.tokens,)))
    _check_file(folder, manifest.index, verify)
    index_path = folder / manifest.index.file
    try:
        starts = np.load(index_path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as bad:
        raise NVFP4ToolError(f"{index_path}: not a readable .npy file ({bad})") from None
    if starts.dtype != np.dtype("<i8") or starts.shape != (manifest.documents,):
        raise NVFP4ToolError(
            f"{index_path}: {starts.dtype} {starts.shape}, the manifest records {manifest.documents} int64 offsets"
        )
    return TokenCache(
        folder=folder,
        manifest=manifest,
        manifest_sha256=manifest_sha256(folder),
        tokens=TokenStream(shards),
        loss=TokenStream(losses) if losses else None,
        starts=starts,
    )


def verify_cache(folder: str | os.PathLike, *, sources: bool = True) -> TokenCache:
    """`data verify`: every file of the cache rehashed, and (with `sources`) each source file the
    manifest records against its recorded sha256, found where `CorpusSource.location` says (a
    relative path from the cache folder, whatever the current folder)."""
    cache = open_cache(folder, verify=True)
    for source in cache.manifest.sources if sources else []:
        path = Path(source.location(folder))
        if not path.exists():
            where = (
                "relative to the folder prepare ran in: this manifest predates recording it from the cache"
                if source.path_from_cache is None
                else f"given to prepare as {source.name}; a relative path is found from the cache folder"
            )
            raise NVFP4ToolError(f"{path}: a source of {folder} not found ({where}; --skip-sources skips them)")
        now = file_sha256(path)
        if now != source.sha256:
            raise NVFP4ToolError(
                f"{path}: changed since {folder} was prepared (sha256 {now}, the manifest records {source.sha256})"
            )
    return cache


# ------------------------------------------------------------------------------------------
# helpers


def _check_file(folder: Path, stored: StoredFile, verify: bool) -> None:
    path = folder / stored.file
    try:
        stat = path.stat()
    except FileNotFoundError:
        raise NVFP4ToolError(f"{path}: missing (the manifest {CorpusManifest.FILE_NAME} lists it)") from None
    if stat.st_size != stored.bytes:
        raise NVFP4ToolError(
            f"{path}: {stat.st_size} bytes, the manifest records {stored.bytes} (truncated or extended "
            "since prepare; prepare the cache again)"
        )
    if (verify or stat.st_mtime_ns != stored.mtime_ns) and file_sha256(path) != stored.sha256:
        raise NVFP4ToolError(
            f"{path}: sha256 differs from the manifest's (changed since prepare; prepare the cache again)"
        )
