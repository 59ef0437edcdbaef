"""`nvfp4tool data prepare`: tokenize documents once into a token cache.

    manifest = prepare_cache(["corpus/"], "tokenizer/", "cache/", workers=2)

The main process reads the documents in order and hands batches to worker processes ("spawn"),
which encode them; results are written in document order into shards of raw little-endian
tokens, a document index and the manifest (`records/corpus.py`), atomically.
Design notes: docs/design/data.md.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import multiprocessing
import os
import queue
import signal
import sys
import time
import types
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from converters.atomic import atomic_output_dir, check_output_path
from nvfp4tool import progress
from nvfp4tool.corpus.chat import SftCounts, SftEncoder, sft_encoder
from nvfp4tool.corpus.encode import FORMATS, DataFormat, EncodedBatch, batches, encode_batch, single_threaded
from nvfp4tool.corpus.sources import data_files, file_sha256, unit_bytes
from nvfp4tool.corpus.tokenizer import TextTokenizer, load_tokenizer, tokenizer_sha256
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError
from nvfp4tool.records.corpus import FORMAT_VERSION, CorpusManifest, CorpusShard, CorpusSource, StoredFile, token_dtype

SHARD_TOKENS = 1 << 28  # tokens per shard file by default (512 MiB of uint16)
DEFAULT_WORKERS = min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1, 16)
IN_FLIGHT_PER_WORKER = 2  # batches handed to a worker and not yet written: memory flat in the corpus
INDEX_FILE = "documents.npy"
_WORKER_POLL_S = 1.0  # how often a waiting worker checks its parent, and the parent its workers


def prepare_cache(
    sources: Sequence[str | os.PathLike],
    tokenizer_folder: str | os.PathLike,
    out: str | os.PathLike,
    *,
    text_field: str = "text",
    format: str = "text",
    loss_on: str | None = None,
    overlong: str | None = None,
    seq_len: int | None = None,
    workers: int = DEFAULT_WORKERS,
    shard_tokens: int = SHARD_TOKENS,
    force: bool = False,
) -> CorpusManifest:
    """Tokenize `sources` (files, folders, `save_to_disk` datasets; read in the order given) with the
    tokenizer of `tokenizer_folder` into the cache folder `out`; `workers=0` encodes in this process.
    The fine-tuning formats (chat, prompt_completion) take `loss_on`, `overlong` and `seq_len`."""
    if not sources:
        raise NVFP4UsageError("data prepare: no SOURCE given")
    if format not in FORMATS:
        raise NVFP4UsageError(f"data prepare: format {format!r}; choose one of {', '.join(FORMATS)}")
    if workers < 0 or shard_tokens < 1 or not text_field:
        raise NVFP4UsageError("data prepare: workers >= 0, shard_tokens >= 1 and a text field are required")
    sft = sft_encoder(tokenizer_folder, format, loss_on, overlong, seq_len, "data prepare: ")
    check_output_path(out, [*sources, tokenizer_folder], flag="--out", force=force)
    units = [data_files(source) for source in sources]  # every source exists, before anything is created
    tokenizer = load_tokenizer(tokenizer_folder)
    if sft is not None:
        sft.check()
    dtype = token_dtype(tokenizer.vocab_size)
    with atomic_output_dir(out, force=force, inputs=[*sources, tokenizer_folder], flag="--out") as tmp:
        writer = _CacheWriter(Path(tmp), np.dtype(dtype).newbyteorder("<"), shard_tokens)
        sources_read = _Sources(units, sources, out)
        documents = sources_read.read(FORMATS[format], text_field)
        encoder = _Encoder(workers, tokenizer_folder, tokenizer, format, dtype, sft)
        counts = SftCounts()
        try:
            _run(encoder, documents, writer, sources_read, sum(map(len, units)), counts)
        except BaseException:
            encoder.close(abort=True)  # bad data, Ctrl-C, SIGTERM: the workers' batches are not wanted
            raise
        encoder.close()
        shards, index = writer.finish()
        sft_record = None
        if sft is not None:
            sft_record = counts.record(sft.spec, sft.chat_template_sha256())
            counts.report(sft.spec, os.fspath(out))
        manifest = CorpusManifest(
            format_version=FORMAT_VERSION,
            tokenizer_sha256=tokenizer_sha256(tokenizer),
            eos_id=tokenizer.eos_id,
            vocab_size=tokenizer.vocab_size,
            dtype=dtype,
            format=format,
            text_field=text_field,
            sources=sources_read.finish(),
            shards=shards,
            index=index,
            documents=writer.documents,
            tokens=writer.tokens,
            sft=sft_record,
        )
        manifest.write(tmp)
    return manifest


# ------------------------------------------------------------------------------------------
# helpers


def _run(encoder, documents, writer, sources_read, files: int, counts: SftCounts) -> None:
    """Feed batches to the encoder and write its results in order, with progress lines; the
    fine-tuning rows' counts are summed into `counts`."""
    started = time.perf_counter()
    with progress.task("prepare", total=None, unit="document") as task:
        for batch in encoder.map(batches(documents)):
            writer.write(batch)
            if batch.sft is not None:
                counts.merge(batch.sft)
            rate = writer.tokens / max(time.perf_counter() - started, 1e-9)
            task.advance(
                len(batch.lengths),
                nbytes=sources_read.pop_bytes(),
                description=f"file {sources_read.file_number}/{files}",
                fields={"tokens": f"{writer.tokens:,}", "tokens/s": f"{rate:,.0f}"},
            )


class _Sources:
    """The source files as they are read: each one hashed when its reading starts, its documents
    and their bytes counted."""

    def __init__(self, units: list[list[Path]], given: Sequence[str | os.PathLike], out: str | os.PathLike) -> None:
        self.given = {Path(u): os.fspath(g) for files, g in zip(units, given) for u in files}
        self.roots = {Path(u): Path(g) for files, g in zip(units, given) for u in files}
        self.sources = list(given)
        self.out = os.path.realpath(out)  # the cache folder a relative source is recorded from
        self.records: list[dict[str, Any]] = []
        self.file_number, self.bytes = 0, 0

    def start_file(self, file: Path) -> None:
        root = self.roots[file]
        name = os.fspath(self.given[file]) if file == root else os.path.join(self.given[file], file.relative_to(root))
        found = name if os.path.isabs(name) else os.path.relpath(os.path.realpath(file), self.out)
        record = dict(name=name, sha256=file_sha256(file), bytes=unit_bytes(file), documents=0, path_from_cache=found)
        self.records.append(record)
        self.file_number += 1

    def read(self, format: DataFormat, text_field: str) -> Iterator[Any]:
        """The sources' documents in order, each counted to the file it was read from."""
        for source in self.sources:
            for document in format.read(source, text_field, self.start_file):
                self.records[-1]["documents"] += 1
                self.bytes += format.size(document)
                yield document

    def pop_bytes(self) -> int:
        done, self.bytes = self.bytes, 0
        return done

    def finish(self) -> list[CorpusSource]:
        return [CorpusSource(**r) for r in self.records]


class _Encoder:
    """Encodes batches in order: in this process (`workers=0`) or in worker processes, each with
    at most IN_FLIGHT_PER_WORKER batches handed to it and not yet taken back."""

    def __init__(
        self, workers: int, folder, tokenizer: TextTokenizer, format: str, dtype: str, sft: SftEncoder | None
    ) -> None:
        self.tokenizer, self.format, self.dtype, self.sft = tokenizer, format, dtype, sft
        self.processes, self.tasks, self.results = [], [], []
        context = multiprocessing.get_context("spawn")
        for i in range(workers):
            tasks, results = context.Queue(), context.Queue()
            process = context.Process(
                target=_worker,
                args=(os.fspath(folder), format, dtype, sft, tasks, results),
                daemon=True,
                name=f"nvfp4tool-prepare-{i}",
            )
            with _main_module_hidden():
                process.start()
            self.processes.append(process)
            self.tasks.append(tasks)
            self.results.append(results)

    def map(self, document_batches: Iterator[list[Any]]) -> Iterator[EncodedBatch]:
        if not self.processes:
            for batch in document_batches:
                with single_threaded():
                    encoded = encode_batch(self.tokenizer, self.format, batch, self.dtype, self.sft)
                yield encoded
            return
        pending: collections.deque[int] = collections.deque()  # the worker of each batch in flight, in order
        limit = IN_FLIGHT_PER_WORKER * len(self.processes)
        for number, batch in enumerate(document_batches):
            if len(pending) >= limit:
                yield self._take(pending.popleft())
            worker = number % len(self.processes)
            self.tasks[worker].put(batch)
            pending.append(worker)
        while pending:
            yield self._take(pending.popleft())

    def _take(self, worker: int) -> EncodedBatch:
        while True:
            try:
                result = self.results[worker].get(timeout=_WORKER_POLL_S)
            except queue.Empty:
                process = self.processes[worker]
                if not process.is_alive():
                    raise NVFP4ToolError(
                        f"data prepare: tokenizer worker {worker} ended (exit code {process.exitcode})"
                    ) from None
                continue
            if isinstance(result, NVFP4ToolError):
                raise result
            if isinstance(result, str):
                raise NVFP4ToolError(f"data prepare: tokenizer worker {worker} failed: {result}")
            return result

    def close(self, abort: bool = False) -> None:
        """Stop the workers: each after its last batch, or at once (`abort`)."""
        for tasks in self.tasks:
            tasks.put(None)
        for process in self.processes:
            process.join(timeout=0 if abort else 10)
            if process.is_alive():
                process.terminate()
                process.join()
        for q in [*self.tasks, *self.results]:
            q.cancel_join_thread()
            q.close()


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """ "spawn" runs the parent's __main__ again in each child (the CLI's imports jax); a worker needs
    only this module, so the child is started with an empty __main__ (and a script calling
    `prepare_cache` needs no `if __name__ == "__main__":` guard)."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _worker(folder: str, format: str, dtype: str, sft: SftEncoder | None, tasks, results) -> None:
    """A worker process: encode each batch handed to it until None (or until its parent is gone)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent stops us
    results.cancel_join_thread()  # exit without waiting for unread results (the parent aborted)
    parent = os.getppid()
    try:
        tokenizer = load_tokenizer(folder)
    except Exception as bad:
        results.put(f"{type(bad).__name__}: {bad}")
        return
    while True:
        try:
            batch = tasks.get(timeout=_WORKER_POLL_S)
        except queue.Empty:
            if os.getppid() != parent:  # the parent was killed: nothing will take our results
                return
            continue
        if batch is None:
            return
        try:
            results.put(encode_batch(tokenizer, format, batch, dtype, sft))
        except NVFP4ToolError as bad:  # bad data, named by the library: handed back as is
            results.put(bad)
        except Exception as bad:
            results.put(f"{type(bad).__name__}: {bad}")


class _CacheWriter:
    """Writes the token stream into shards of `shard_tokens`, hashing as it goes, and each
    document's start offset into the index."""

    def __init__(self, folder: Path, dtype: np.dtype, shard_tokens: int) -> None:
        self.folder, self.dtype, self.shard_tokens = folder, dtype, shard_tokens
        self.tokens, self.documents = 0, 0
        self.shards: list[CorpusShard] = []
        self._shard: _OpenShard | None = None
        self._starts = (folder / (INDEX_FILE + ".part")).open("wb")

    def write(self, batch: EncodedBatch) -> None:
        starts = self.tokens + np.cumsum(batch.lengths) - batch.lengths
        self._starts.write(starts.astype("<i8").tobytes())
        self.documents += len(batch.lengths)
        ids = batch.ids.astype(self.dtype, copy=False)
        done = 0
        while done < len(ids):
            if self._shard is None:
                self._shard = _OpenShard(self.folder, len(self.shards), batch.loss is not None)
            take = min(self.shard_tokens - self._shard.tokens, len(ids) - done)
            self._shard.write(ids[done : done + take], None if batch.loss is None else batch.loss[done : done + take])
            done += take
            if self._shard.tokens == self.shard_tokens:
                self.shards.append(self._shard.close())
                self._shard = None
        self.tokens += len(ids)

    def finish(self) -> tuple[list[CorpusShard], StoredFile]:
        if self._shard is not None:
            self.shards.append(self._shard.close())
            self._shard = None
        self._starts.close()
        part = self.folder / (INDEX_FILE + ".part")
        starts = np.memmap(part, dtype="<i8", mode="r") if self.documents else np.zeros(0, "<i8")
        index = np.lib.format.open_memmap(self.folder / INDEX_FILE, mode="w+", dtype="<i8", shape=(self.documents,))
        for first in range(0, self.documents, 1 << 22):  # bounded memory: a chunk at a time
            index[first : first + (1 << 22)] = starts[first : first + (1 << 22)]
        index.flush()
        del index, starts
        part.unlink()
        return self.shards, _stored(self.folder / INDEX_FILE, file_sha256(self.folder / INDEX_FILE))


class _OpenShard:
    """A shard being written: its token file and (for a format with marks) its loss-mark file."""

    def __init__(self, folder: Path, number: int, marks: bool) -> None:
        self.path = folder / f"tokens-{number:05d}.bin"
        self.loss_path = folder / f"loss-{number:05d}.bin" if marks else None
        self.file, self.digest = self.path.open("wb"), hashlib.sha256()
        self.loss_file = self.loss_path.open("wb") if marks else None
        self.loss_digest = hashlib.sha256()
        self.tokens = 0

    def write(self, ids: np.ndarray, marks: np.ndarray | None) -> None:
        if (marks is None) != (self.loss_file is None):
            raise NVFP4ToolError(f"{self.path}: the data format gave loss marks for some documents only")
        data = ids.tobytes()
        self.file.write(data)
        self.digest.update(data)
        if marks is not None:
            self.loss_file.write(marks.tobytes())
            self.loss_digest.update(marks.tobytes())
        self.tokens += len(ids)

    def close(self) -> CorpusShard:
        self.file.close()
        loss = None
        if self.loss_file is not None:
            self.loss_file.close()
            loss = _stored(self.loss_path, self.loss_digest.hexdigest())
        stored = _stored(self.path, self.digest.hexdigest())
        return CorpusShard(**dataclasses.asdict(stored), tokens=self.tokens, loss=loss)


def _stored(path: Path, sha256: str) -> StoredFile:
    stat = path.stat()
    return StoredFile(file=path.name, bytes=stat.st_size, sha256=sha256, mtime_ns=stat.st_mtime_ns)
