"""`Windows`: the training rows of a token stream (in memory, or a memory-mapped cache).

    windows = Windows.of(stream, seq_len=128, starts=document_starts, packing="segmented", format="chat")
    train, held_out = windows.split(eval_fraction=0.05)
    batch = train.rows(np.array([3, 0, 7]))     # a Batch: tokens [3, 129], segments, loss

A row is `length <= T + 1` consecutive tokens of the stream from `start`, padded to T + 1 (T =
seq_len; padding: the end-of-text id, segment 0, no loss). Text (and `packing=concat`): row i is
stream[i*T : i*T + T + 1] (the stream cut; no table). Fine-tuning rows (`format` chat /
prompt_completion) with `packing=segmented` / `padded`: a table of (start, length) per row from the
document index, whole documents packed greedily in order, or one per row (`document_rows`). The
eval split is the last `eval_fraction` of the rows. Segments number a row's documents 1, 2, ...
Pages that reads map from a memory map are unmapped every RELEASE_ROWS rows (`PageRelease`).
Design notes: docs/design/data.md.
"""

from __future__ import annotations

import dataclasses
import mmap
from collections.abc import Iterable, Iterator

import numpy as np

from nvfp4tool.corpus.batch import Batch
from nvfp4tool.corpus.chat import FORMATS as SFT_FORMATS
from nvfp4tool.corpus.encode import EncodedBatch
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError

PACKINGS = ("concat", "segmented", "padded")


class TokenStream:
    """One sequence stored as consecutive pieces (a cache's shards, or one array in memory)."""

    def __init__(self, pieces: list[np.ndarray]) -> None:
        self.pieces = [p for p in pieces if len(p)]
        self.ends = np.cumsum([len(p) for p in self.pieces], dtype=np.int64)
        self.firsts = self.ends - [len(p) for p in self.pieces]  # each piece's first position
        self._views: dict[tuple[int, int], np.ndarray] = {}  # (piece, length): its windows (a strided view)
        self._release = PageRelease([file_map(p) for p in self.pieces])  # memory-mapped pieces' pages

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def take(self, starts: np.ndarray, length: int, dtype, lengths: np.ndarray | None = None, fill=0) -> np.ndarray:
        """[len(starts), length]: stream[s : s + length] for each start s (within the stream); with
        `lengths`, row r holds only its first lengths[r] tokens and `fill` after them. Rows inside
        one piece: one gather per piece from its windows' strided view; the few that run across a
        piece's end (or past the stream's): one gather per piece of their tokens."""
        starts = np.asarray(starts, np.int64)
        out = np.empty((len(starts), length), dtype)
        if not len(starts):
            return out
        first = self.firsts
        piece = np.minimum(np.searchsorted(self.ends, starts, side="right"), len(self.ends) - 1)
        inside = starts + length <= self.ends[piece]
        rows = np.flatnonzero(inside)
        rows = rows[np.argsort(piece[rows], kind="stable")]  # grouped by piece
        for group in np.split(rows, np.flatnonzero(np.diff(piece[rows])) + 1) if len(rows) else []:
            p = int(piece[group[0]])
            windows = self._views.get((p, length))
            if windows is None:
                windows = self._views[p, length] = np.lib.stride_tricks.sliding_window_view(self.pieces[p], length)
            out[group] = windows[starts[group] - first[p]]
        keep = None
        if lengths is not None:
            keep = np.arange(length)[None, :] < np.asarray(lengths, np.int64)[:, None]
            out[~keep] = fill
        if not inside.all():  # token by token
            rows = np.flatnonzero(~inside)
            valid = np.ones((len(rows), length), bool) if keep is None else keep[rows]
            wanted = (starts[rows, None] + np.arange(length, dtype=np.int64)[None, :])[valid]
            where = np.searchsorted(self.ends, wanted, side="right")
            values = np.empty(wanted.shape, dtype)
            for p in np.unique(where).tolist():
                mine = where == p
                values[mine] = self.pieces[p][wanted[mine] - first[p]]
            part = np.full((len(rows), length), fill, dtype)
            part[valid] = values
            out[rows] = part
        self._release.read(len(starts))
        return out


RELEASE_ROWS = 256  # rows read from memory maps between two releases of their pages


class PageRelease:
    """Unmaps the pages reads mapped from read-only memory maps (a cache's shards, its document
    index) every RELEASE_ROWS rows read. The pages stay in the page cache (a later read of one is a
    minor fault) but leave the process's RSS, which random rows of a large cache would otherwise
    grow by ~0.1 MB each (a fault maps a whole large folio of the file) up to the cache's size."""

    def __init__(self, maps: Iterable[mmap.mmap | None]) -> None:
        released = hasattr(mmap, "MADV_DONTNEED")  # a platform without madvise keeps its pages mapped
        self.maps = [m for m in maps if m is not None] if released else []
        self.rows = 0  # read since the last release (threads may race on it: a release comes late or early)

    def read(self, rows: int) -> None:
        if not self.maps:
            return
        self.rows += rows
        if self.rows >= RELEASE_ROWS:
            self.rows = 0
            for file in self.maps:
                file.madvise(mmap.MADV_DONTNEED)


def file_map(array: np.ndarray | None) -> mmap.mmap | None:
    """The read-only memory map `array` is a view of (an `np.memmap` / `np.load(mmap_mode="r")`
    array's `base`), or None (an array in memory, or a writable map)."""
    base = array
    while base is not None and not isinstance(base, mmap.mmap):
        base = getattr(base, "base", None)
    return None if base is None or array.flags.writeable else base


def whole_documents(format: str, packing: str) -> bool:
    """Whether rows hold whole documents (fine-tuning rows with segmented / padded packing) rather
    than the stream cut every T tokens; packing=padded of text is a usage error."""
    if packing not in PACKINGS:
        raise NVFP4UsageError(f"packing={packing!r}; choose one of {', '.join(PACKINGS)}")
    if packing == "padded" and format not in SFT_FORMATS:
        raise NVFP4UsageError(
            f"packing=padded: format={format} is cut from one stream (concat | segmented); padded "
            f"(one document per row) is for format={' | '.join(SFT_FORMATS)}"
        )
    return format in SFT_FORMATS and packing != "concat"


def segment_ids(starts: np.ndarray, row_starts: np.ndarray, width: int) -> np.ndarray:
    """[rows, width] int32: each token's document numbered from its row's first token's (1, 2,
    ...): `searchsorted(starts, position, "right")` less the row's first token's, plus 1. Found with
    two searches a row and the few documents that start inside it (not a search per token: a
    cache's document index is read at a few pages a row)."""
    row_starts = np.asarray(row_starts, np.int64)
    first = np.searchsorted(starts, row_starts, side="right")  # the first document starting after the row's start
    inside = np.searchsorted(starts, row_starts + width - 1, side="right") - first  # start in the row
    marks = np.zeros((len(row_starts), width + 1), np.int32)  # column width: not in the row
    most = int(inside.max()) if len(inside) else 0
    if most:
        at = np.minimum(first[:, None] + np.arange(most), len(starts) - 1)
        begins = np.asarray(starts[at], np.int64) - row_starts[:, None]  # offsets in the row: 1 .. width - 1
        begins[np.arange(most)[None, :] >= inside[:, None]] = width
        np.add.at(marks, (np.arange(len(row_starts))[:, None], begins), 1)  # empty documents count too
    return 1 + np.cumsum(marks[:, :width], axis=1, dtype=np.int32)


def document_rows(starts: np.ndarray, total: int, seq_len: int, packing: str, label: str = "data") -> np.ndarray:
    """[rows, 2] int64 (start, length) of each row of whole documents: `segmented` packs them in
    order, greedily (a document that does not fit the rest of a row starts the next one), `padded`
    one per row; empty documents are left out. A document longer than seq_len + 1 is refused
    (`overlong=` drops or truncates them when rows are encoded)."""
    width = seq_len + 1
    ends = np.append(np.asarray(starts, np.int64), np.int64(total))
    lengths = np.diff(ends)
    if len(lengths) and lengths.max() > width:
        first = int(np.argmax(lengths > width))
        raise NVFP4ToolError(
            f"{label}: document {first} has {int(lengths[first])} tokens, longer than a row of seq_len + 1 = "
            f"{width} (rows are held to it by overlong=drop | truncate when encoded: data prepare --seq-len {seq_len})"
        )
    if packing == "padded":
        kept = lengths > 0
        return np.stack([ends[:-1][kept], lengths[kept]], axis=1)
    nonempty = np.flatnonzero(lengths)  # empty documents take no row
    first = ends[nonempty]  # each nonempty document's first token
    # a row opened by nonempty document k holds documents nonempty[k] .. last[k] - 1 (those ending
    # within `width` of its start); the next row opens at the first nonempty document from last[k]
    last = np.searchsorted(ends, first + width, side="right") - 1
    opened = _chain(np.searchsorted(nonempty, last))  # the rows' first documents, as indices into nonempty
    return np.stack([first[opened], ends[last[opened]] - first[opened]], axis=1)


def _chain(following: np.ndarray) -> np.ndarray:
    """0, following[0], following[following[0]], ... while below n = len(following) (each
    following[k] in (k, n]): the path from 0, found by doubling instead of a step per row. With
    jump = following applied 2^t times, the path's first 2^t nodes extended by jump of each are
    its first 2^(t+1); O(n log rows) work in numpy, memory a few int64 per document."""
    n = len(following)
    path = np.zeros(min(n, 1), np.int64)
    jump = np.append(following, np.int64(n))  # n: past the last document, where it stays
    while len(path) and path[-1] < n:
        path = np.concatenate([path, jump[path]])
        jump = jump[jump]
    return path[: np.searchsorted(path, n)]


@dataclasses.dataclass(frozen=True, eq=False)
class Windows:
    """Rows `first .. first + count - 1` of a stream: the table's, or the stream cut every seq_len."""

    tokens: TokenStream
    seq_len: int
    _: dataclasses.KW_ONLY
    starts: np.ndarray | None = None  # [documents] int64: each document's first token (packing != concat)
    loss: TokenStream | None = None  # the tokens' loss marks (None: every token carries loss)
    packing: str = "concat"
    table: np.ndarray | None = None  # [rows, 2] int64 (start, length) of whole-document rows; None: the stream cut
    pad_id: int = 0
    first: int = 0  # the first row of the layout these rows begin at
    count: int | None = None  # how many rows (None: all from `first`)
    _index_release: PageRelease = dataclasses.field(init=False, repr=False)  # a cache's document index

    def __post_init__(self) -> None:
        if self.packing not in PACKINGS:
            raise NVFP4UsageError(f"packing={self.packing!r}; choose one of {', '.join(PACKINGS)}")
        if self.packing != "concat" and self.starts is None:
            raise NVFP4UsageError(f"packing={self.packing} needs the documents' start offsets")
        object.__setattr__(self, "_index_release", PageRelease([file_map(self.starts)]))
        if self.count is None:
            total = len(self.table) if self.table is not None else max(0, (len(self.tokens) - 1) // self.seq_len)
            object.__setattr__(self, "count", total - self.first)

    @classmethod
    def of(
        cls,
        tokens: TokenStream,
        seq_len: int,
        *,
        starts: np.ndarray,
        loss: TokenStream | None = None,
        packing: str = "concat",
        format: str = "text",
        pad_id: int = 0,
        label: str = "data",
    ) -> Windows:
        """The rows of documents of `format` (`whole_documents` decides their layout), two or more."""
        table = None
        if whole_documents(format, packing):
            table = document_rows(starts, len(tokens), seq_len, packing, label)
        windows = cls(tokens, seq_len, starts=starts, loss=loss, packing=packing, table=table, pad_id=pad_id)
        return windows.require_two()

    def __len__(self) -> int:
        return self.count

    def extents(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """(start, length) in the stream of rows `indices` (length None: every row is T + 1 tokens)."""
        if self.table is None:
            return (self.first + indices) * self.seq_len, None
        row = self.table[self.first + indices]
        return row[:, 0], row[:, 1]

    def rows(self, indices: np.ndarray) -> Batch:
        """The Batch of rows `indices` (0-based within these rows), in that order."""
        indices = np.asarray(indices, np.int64)
        if len(indices) and (indices.min() < 0 or indices.max() >= self.count):
            raise IndexError(f"window index out of range 0..{self.count - 1}")
        row_starts, lengths = self.extents(indices)
        width = self.seq_len + 1
        tokens = self.tokens.take(row_starts, width, np.int32, lengths, self.pad_id)
        segments = None
        if self.packing != "concat":
            segments = segment_ids(self.starts, row_starts, width)
            self._index_release.read(len(indices))
            if lengths is not None:
                segments[np.arange(width)[None, :] >= lengths[:, None]] = 0  # padding
        loss = None
        if self.loss is not None:
            loss = self.loss.take(row_starts, width, np.uint8, lengths, 0).astype(bool)
        return Batch(tokens, segments, loss)

    def padding_share(self) -> float:
        """The share of these rows' tokens that are padding (0 for the stream cut)."""
        if self.table is None or self.count == 0:
            return 0.0
        used = int(self.table[self.first : self.first + self.count, 1].sum())
        return 1.0 - used / (self.count * (self.seq_len + 1))

    def split(self, eval_fraction: float) -> tuple[Windows, Windows]:
        """(train, eval): the last `eval_fraction` of the rows (at least one) are held out."""
        if not 0.0 < eval_fraction < 1.0:
            raise NVFP4UsageError(f"eval_fraction={eval_fraction}: expected a number in (0, 1)")
        num_eval = max(1, int(round(self.count * eval_fraction)))
        return self._part(0, self.count - num_eval), self._part(self.count - num_eval, num_eval)

    def batches(self, batch_size: int, count: int | None = None) -> Iterator[Batch]:
        """The first `count` rows (default: all) in order, in batches of at most `batch_size`."""
        count = self.count if count is None else min(count, self.count)
        for start in range(0, count, batch_size):
            yield self.rows(np.arange(start, min(start + batch_size, count)))

    def require_two(self) -> Windows:
        """These rows, if there are two or more (one to train on, one to evaluate)."""
        if self.count < 2:
            raise NVFP4ToolError(
                f"the data has {len(self.tokens)} tokens: too few for two windows of "
                f"seq_len={self.seq_len} (one to train on, one to evaluate; packing={self.packing} "
                f"gives {self.count})"
            )
        return self

    def _part(self, first: int, count: int) -> Windows:
        return dataclasses.replace(self, first=self.first + first, count=count)


def windows_in_memory(
    encoded: Iterable[EncodedBatch],
    seq_len: int,
    packing: str = "concat",
    *,
    format: str = "text",
    pad_id: int = 0,
    label: str = "data",
) -> Windows:
    """The rows of documents encoded in this process (train's text / JSONL / Parquet data)."""
    ids, lengths, marks = [], [], []
    for batch in encoded:
        ids.append(batch.ids)
        lengths.append(batch.lengths)
        marks.append(batch.loss)
    lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    starts = np.cumsum(lengths) - lengths
    loss = None if not marks or any(m is None for m in marks) else TokenStream([np.concatenate(marks)])
    tokens = TokenStream([np.concatenate(ids)] if ids else [])
    return Windows.of(
        tokens, seq_len, starts=starts, loss=loss, packing=packing, format=format, pad_id=pad_id, label=label
    )
