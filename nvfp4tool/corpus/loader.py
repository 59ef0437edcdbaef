"""The run's training batches, read with Grain: batch b is a pure function of (seed, b).

    loader = Loader([windows], None, batch_size=8, seed=1, num_batches=steps)
    batches = loader.iterator(start=0)  # element k: this process's rows of global batch k

One source keeps the order every earlier run trained on (`batch_indices`); a mixture
(`data=A:0.7,B:0.3`, `parse_mixture`) draws each row's source by the weights, then takes that
source's next window in its own permuted order. Each JAX process reads only the rows of the global
batch that the batch sharding places on its devices (`process_rows`, Grain's `ShardByJaxProcess`);
background threads prefetch them (Grain's `ReadOptions`). The iterator's state goes into the
checkpoint (train/checkpoint.py); its position is the number of batches drawn.
Design notes: docs/design/data.md.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Sequence
from typing import Protocol

import grain
import numpy as np

from nvfp4tool.corpus.batch import Batch
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError

MIX_SALT = 0x6D6978  # ("mix") keeps a mixture's random streams apart from the one-source order's


class RandomAccessWindows(Protocol):
    """Training windows: `len(windows)` rows of seq_len + 1 tokens, read by index."""

    def __len__(self) -> int: ...

    def rows(self, indices: np.ndarray) -> Batch: ...


# ------------------------------------------------------------------------------------------
# the order


def epoch_order(num_windows: int, seed: int, epoch: int) -> np.ndarray:
    """The windows of one epoch of the one-source order, permuted by (seed, epoch):
    `default_rng([seed, epoch]).permutation(num_windows)`, shuffled as int32 where the windows fit
    (the same order, half the memory: the shuffle's draws do not depend on the dtype)."""
    return _permutation(np.random.default_rng([seed, epoch]), num_windows)


def _permutation(rng: np.random.Generator, n: int) -> np.ndarray:
    """`rng.permutation(n)`'s values (the same draws from `rng`), int32 where n fits."""
    order = np.arange(n, dtype=np.int32 if n <= np.iinfo(np.int32).max else np.int64)
    rng.shuffle(order)
    return order


def batch_indices(num_windows: int, batch_size: int, seed: int, batch_number: int, order=epoch_order) -> np.ndarray:
    """The window indices of batch `batch_number` (0-based over the run) of one source: a pure
    function. An epoch is `num_windows // batch_size` whole batches of its permutation (the rest
    of the windows sit that epoch out). `order` is `epoch_order` or a cache of it."""
    per_epoch = num_windows // batch_size
    if per_epoch == 0:
        raise NVFP4ToolError(f"batch_size={batch_size} is larger than the {num_windows} training windows")
    epoch, offset = divmod(batch_number, per_epoch)
    return order(num_windows, seed, epoch)[offset * batch_size : (offset + 1) * batch_size]


MIX_CHUNK = 256  # batches whose sources one generator draws


def mixture_draws(cumulative: np.ndarray, seed: int, chunk: int, batch_size: int) -> np.ndarray:
    """[MIX_CHUNK, batch_size] the source of each row of batches chunk * MIX_CHUNK, ...: row j of
    batch b takes uniform (b mod MIX_CHUNK) * batch_size + j of the generator seeded by (seed,
    b div MIX_CHUNK), and the source whose cumulative weight first exceeds it (a pure function of
    (seed, b, j); one generator per chunk keeps a batch's cost at a few microseconds)."""
    draws = np.random.default_rng([MIX_SALT, seed, chunk]).random((MIX_CHUNK, batch_size))
    return np.minimum(np.searchsorted(cumulative, draws, side="right"), len(cumulative) - 1)


def process_rows(batch_size: int, grad_accum: int, shard_index: int, shard_count: int) -> np.ndarray:
    """The rows of each global batch process `shard_index` of `shard_count` reads: the batch is
    `grad_accum` micro-batches of consecutive rows, each split evenly over the processes in order
    (the rows the batch sharding places on that process's devices; one micro-batch: rows
    [p*B/P, (p+1)*B/P))."""
    micro = batch_size // grad_accum
    if micro * grad_accum != batch_size or micro % shard_count:
        raise NVFP4ToolError(
            f"batch_size={batch_size} / grad_accum={grad_accum} does not split evenly over {shard_count} processes"
        )
    per = micro // shard_count
    first = shard_index * per
    return (np.arange(grad_accum)[:, None] * micro + np.arange(first, first + per)[None, :]).reshape(-1)


# ------------------------------------------------------------------------------------------
# mixtures


def parse_mixture(spec: str, key: str = "data") -> list[tuple[str, float]]:
    """[(path, weight)], the weights normalised to sum to 1: `A:0.7,B:0.3`; an existing path, or
    text that is no mixture (no comma, no `:WEIGHT` ending), is the one source [(spec, 1.0)]. A bad
    entry is a usage error naming `key`."""
    if os.path.exists(spec) or ("," not in spec and _weight_of(spec.rpartition(":")[2]) is None):
        return [(spec, 1.0)]
    entries = []
    for entry in spec.split(","):
        path, colon, text = entry.strip().rpartition(":")
        weight = _weight_of(text) if colon else None
        if not path or weight is None:
            raise NVFP4UsageError(
                f"train config: {key}={spec}: entry {entry.strip()!r} is not PATH:WEIGHT "
                "(a mixture is A:0.7,B:0.3, each weight a number > 0)"
            )
        if not (weight > 0 and math.isfinite(weight)):
            raise NVFP4UsageError(f"train config: {key}={spec}: {path}: weight {text} is not a finite number > 0")
        if path in (p for p, _ in entries):
            raise NVFP4UsageError(f"train config: {key}={spec}: {path} is given twice")
        entries.append((path, weight))
    total = sum(w for _, w in entries)
    return [(p, w / total) for p, w in entries]


def _weight_of(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


# ------------------------------------------------------------------------------------------
# the Grain source


class _Orders:
    """A thread-safe cache of permutations (the last two epochs of each source)."""

    def __init__(self, make) -> None:
        self._make, self._cache, self._lock = make, {}, threading.Lock()

    def __call__(self, *key) -> np.ndarray:
        with self._lock:
            found = self._cache.get(key)
        if found is None:
            found = self._make(*key)
            with self._lock:
                self._cache[key] = found
                stale = [k for k in self._cache if k[:-1] == key[:-1] and k[-1] < key[-1] - 1]
                for k in stale:
                    del self._cache[k]
        return found


class _MixCounts:
    """Each batch's sources and how many rows of each source the batches before it drew
    (thread-safe): the counts before every chunk, and the last two chunks' draws with their
    running counts, so reading in order costs one generator per MIX_CHUNK batches."""

    def __init__(self, cumulative: np.ndarray, seed: int, batch_size: int) -> None:
        self._cumulative, self._seed, self._batch_size = cumulative, seed, batch_size
        self._before_chunk = [np.zeros(len(cumulative), np.int64)]  # counts before chunk c
        self._chunks: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # c -> (draws, counts before each batch)
        self._lock = threading.Lock()

    def batch(self, batch: int) -> tuple[np.ndarray, np.ndarray]:
        """([batch_size] the source of each row of `batch`, [sources] the rows of each source drawn
        by the batches before it)."""
        chunk, at = divmod(batch, MIX_CHUNK)
        with self._lock:
            while len(self._before_chunk) <= chunk:  # the counts before each chunk up to this one
                draws, running = self._chunk(len(self._before_chunk) - 1)
                self._before_chunk.append(self._before_chunk[-1] + running[-1])
            draws, running = self._chunk(chunk)
            return draws[at], self._before_chunk[chunk] + running[at]

    def _chunk(self, chunk: int) -> tuple[np.ndarray, np.ndarray]:
        """(draws [MIX_CHUNK, B], [MIX_CHUNK + 1, sources] counts within the chunk before each batch)."""
        found = self._chunks.get(chunk)
        if found is None:
            draws = mixture_draws(self._cumulative, self._seed, chunk, self._batch_size)
            per_batch = (draws[:, :, None] == np.arange(len(self._cumulative))).sum(axis=1)
            running = np.concatenate([np.zeros((1, per_batch.shape[1]), np.int64), np.cumsum(per_batch, axis=0)])
            found = self._chunks[chunk] = (draws, running)
            for old in [c for c in self._chunks if c < chunk - 1]:
                del self._chunks[old]
        return found


class BatchSource:
    """Grain's random-access source of the run: element k is the `rows` of global batch k, one
    `Batch` read with one `rows()` call per source (batching by index)."""

    def __init__(
        self,
        sources: Sequence[RandomAccessWindows],
        weights: Sequence[float] | None,
        *,
        batch_size: int,
        seed: int,
        num_batches: int,
        rows: np.ndarray,
    ) -> None:
        if weights is not None and len(weights) != len(sources):
            raise NVFP4ToolError(f"{len(weights)} mixture weights for {len(sources)} sources")
        self._sources, self._batch_size, self._seed = list(sources), batch_size, seed
        self._num_batches, self._rows = num_batches, np.asarray(rows)
        self._sizes = [len(s) for s in self._sources]
        if len(self._sources) == 1:
            batch_indices(self._sizes[0], batch_size, seed, 0)  # enough windows for a batch?
            self._orders = _Orders(epoch_order)
            self._counts = None
        else:
            empty = [i for i, n in enumerate(self._sizes) if n == 0]
            if empty:
                raise NVFP4ToolError(f"mixture source {empty[0] + 1} has no training windows")
            self._cumulative = np.cumsum(np.asarray(weights, np.float64) / np.sum(weights))
            self._cumulative[-1] = 1.0
            self._orders = _Orders(self._source_order)
            self._counts = _MixCounts(self._cumulative, seed, batch_size)

    def __len__(self) -> int:
        return self._num_batches

    def _source_order(self, source: int, epoch: int) -> np.ndarray:
        """A mixture source's windows in epoch `epoch` of its own order, permuted by (seed, source, epoch)."""
        return _permutation(np.random.default_rng([MIX_SALT, self._seed, source, epoch]), self._sizes[source])

    def __repr__(self) -> str:  # Grain names a source by its repr
        return f"BatchSource(windows={self._sizes}, batch_size={self._batch_size}, seed={self._seed})"

    def __getitem__(self, batch: int) -> Batch:
        if not 0 <= batch < self._num_batches:
            raise IndexError(f"batch {batch} of a run of {self._num_batches}")
        if self._counts is None:
            indices = batch_indices(self._sizes[0], self._batch_size, self._seed, batch, self._orders)
            return self._sources[0].rows(indices[self._rows])
        return self._mixed(batch)

    def window_indices(self, batch: int) -> list[tuple[int, int]]:
        """[(source, window)] of each of this process's rows of `batch` (what `__getitem__` reads)."""
        if self._counts is None:
            indices = batch_indices(self._sizes[0], self._batch_size, self._seed, batch, self._orders)
            return [(0, int(i)) for i in indices[self._rows]]
        sources, windows = self._mixed_indices(batch)
        return list(zip(sources.tolist(), windows.tolist(), strict=True))

    def _mixed_indices(self, batch: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, window) of each of this process's rows: row j of the batch takes the next
        window of its source's own order (its rank among the batch's rows of that source, after
        all earlier batches' rows of it)."""
        draws, before = self._counts.batch(batch)
        position = np.empty(self._batch_size, np.int64)
        for s in range(len(self._sources)):
            mine = np.flatnonzero(draws == s)
            position[mine] = before[s] + np.arange(len(mine))
        sources, position = draws[self._rows], position[self._rows]
        windows = np.empty(len(self._rows), np.int64)
        for s in np.flatnonzero(np.bincount(sources, minlength=len(self._sources))):
            mine = sources == s
            epoch, offset = np.divmod(position[mine], self._sizes[s])
            if epoch[0] == epoch[-1]:  # mostly: one epoch of the source in the batch
                windows[mine] = self._orders(int(s), int(epoch[0]))[offset]
            else:
                windows[mine] = [self._orders(int(s), int(e))[o] for e, o in zip(epoch, offset, strict=True)]
        return sources, windows

    def _mixed(self, batch: int) -> Batch:
        sources, windows = self._mixed_indices(batch)
        return _gather(self._sources, sources, windows)


class ConcatWindows:
    """Windows of several sources one after the other (a mixture's eval set), read by index."""

    def __init__(self, parts: Sequence[RandomAccessWindows]) -> None:
        self._parts = list(parts)
        self._ends = np.cumsum([len(p) for p in self._parts])

    def __len__(self) -> int:
        return int(self._ends[-1])

    def rows(self, indices: np.ndarray) -> Batch:
        indices = np.asarray(indices, np.int64)
        part = np.searchsorted(self._ends, indices, side="right")
        return _gather(self._parts, part, indices - (self._ends - [len(p) for p in self._parts])[part])

    def batches(self, batch_size: int, count: int | None = None):
        """The first `count` windows (default: all) in order, in batches of at most `batch_size`."""
        count = len(self) if count is None else min(count, len(self))
        for start in range(0, count, batch_size):
            yield self.rows(np.arange(start, min(start + batch_size, count)))


def _gather(sources: Sequence[RandomAccessWindows], source: np.ndarray, window: np.ndarray) -> Batch:
    """The Batch whose row i is window `window[i]` of source `source[i]` (one `rows()` call per
    source). A source without segments (one stream) gives all-one segments, one without loss marks
    all-true marks, where another source has them."""
    parts = [(mine, sources[s].rows(window[mine])) for s in np.unique(source) for mine in [source == s]]
    fields = []
    for field in Batch._fields:
        given = [getattr(part, field) for _, part in parts]
        if all(g is None for g in given):
            fields.append(None)
            continue
        first = next(g for g in given if g is not None)
        out = np.empty((len(source), *first.shape[1:]), first.dtype)
        for mine, part in parts:
            value = getattr(part, field)
            out[mine] = value if value is not None else (1 if field == "segments" else True)
        fields.append(out)
    return Batch(*fields)


class Loader:
    """The run's batches for this process: Grain's map dataset over `BatchSource`, read ahead by
    `threads` threads into a buffer of `prefetch` batches. Element k is the same whatever the
    thread count: a pure function of (seed, k)."""

    def __init__(
        self,
        sources: Sequence[RandomAccessWindows],
        weights: Sequence[float] | None = None,
        *,
        batch_size: int,
        seed: int,
        num_batches: int,
        grad_accum: int = 1,
        shard: grain.sharding.ShardOptions | None = None,
        threads: int = 2,
        prefetch: int = 8,
    ) -> None:
        shard = shard or grain.sharding.ShardByJaxProcess()
        self.rows = process_rows(batch_size, grad_accum, shard.shard_index, shard.shard_count)
        self.source = BatchSource(
            sources, weights, batch_size=batch_size, seed=seed, num_batches=num_batches, rows=self.rows
        )
        self._read = grain.ReadOptions(num_threads=threads, prefetch_buffer_size=max(prefetch, threads))

    def dataset(self) -> grain.MapDataset:
        return grain.MapDataset.source(self.source)

    def iterator(self, start: int = 0) -> grain.DatasetIterator:
        """Batches `start`, `start` + 1, ... (`start`: the batches drawn before; what a checkpoint
        without a saved loader state resumes from)."""
        iterator = iter(self.dataset().to_iter_dataset(self._read))
        if start:
            grain.experimental.set_next_index(iterator, start)
        return iterator


def next_index(iterator: grain.DatasetIterator) -> int:
    """How many batches `iterator` has handed out (its position)."""
    return grain.experimental.get_next_index(iterator)
