"""`Windows`: the training rows cut from a token stream (in memory, or a memory-mapped cache).

    windows = Windows(stream, seq_len=128, starts=document_starts, packing="segmented")
    train, held_out = windows.split(eval_fraction=0.05)
    batch = train.rows(np.array([3, 0, 7]))     # a Batch: tokens [3, 129], segments, loss

Window i is stream[i*T : i*T + T + 1] (T = seq_len; consecutive windows share one token, the
ragged tail is dropped); the eval split is the last `eval_fraction` of the windows. With
`packing="segmented"` a row's documents are numbered 1, 2, ... from the document starts.
Design notes: docs/design/data.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from nvfp4tool.corpus.batch import Batch
from nvfp4tool.corpus.encode import EncodedBatch
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError

PACKINGS = ("concat", "segmented")


class TokenStream:
    """One sequence stored as consecutive pieces (a cache's shards, or one array in memory)."""

    def __init__(self, pieces: list[np.ndarray]) -> None:
        self.pieces = [p for p in pieces if len(p)]
        self.ends = np.cumsum([len(p) for p in self.pieces], dtype=np.int64)

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def take(self, starts: np.ndarray, length: int, dtype) -> np.ndarray:
        """[len(starts), length]: stream[s : s + length] for each start s (within the stream)."""
        out = np.empty((len(starts), length), dtype)
        for row, start in enumerate(np.asarray(starts, np.int64).tolist()):
            done = 0
            piece = int(np.searchsorted(self.ends, start, side="right"))
            while done < length:  # a row may run across the end of a piece
                first = start + done - (int(self.ends[piece - 1]) if piece else 0)
                chunk = self.pieces[piece][first : first + length - done]
                out[row, done : done + len(chunk)] = chunk
                done += len(chunk)
                piece += 1
        return out


class Windows:
    """Windows `first .. first + count - 1` of a stream cut into rows of `seq_len + 1` tokens."""

    def __init__(
        self,
        tokens: TokenStream,
        seq_len: int,
        *,
        starts: np.ndarray | None = None,
        loss: TokenStream | None = None,
        packing: str = "concat",
        first: int = 0,
        count: int | None = None,
    ) -> None:
        if packing not in PACKINGS:
            raise NVFP4UsageError(f"packing={packing!r}; choose one of {', '.join(PACKINGS)}")
        if packing == "segmented" and starts is None:
            raise NVFP4UsageError("packing=segmented needs the documents' start offsets")
        self.tokens, self.seq_len, self.starts, self.loss, self.packing = tokens, seq_len, starts, loss, packing
        self.first = first
        self.count = max(0, (len(tokens) - 1) // seq_len) - first if count is None else count

    def __len__(self) -> int:
        return self.count

    def rows(self, indices: np.ndarray) -> Batch:
        """The Batch of windows `indices` (0-based within these windows), in that order."""
        indices = np.asarray(indices, np.int64)
        if len(indices) and (indices.min() < 0 or indices.max() >= self.count):
            raise IndexError(f"window index out of range 0..{self.count - 1}")
        row_starts = (self.first + indices) * self.seq_len
        width = self.seq_len + 1
        tokens = self.tokens.take(row_starts, width, np.int32)
        segments = None
        if self.packing == "segmented":
            positions = row_starts[:, None] + np.arange(width)[None, :]
            document = np.searchsorted(self.starts, positions, side="right") - 1  # each token's document
            segments = (document - document[:, :1] + 1).astype(np.int32)  # 1, 2, ... within each row
        loss = None if self.loss is None else self.loss.take(row_starts, width, np.uint8).astype(bool)
        return Batch(tokens, segments, loss)

    def split(self, eval_fraction: float) -> tuple[Windows, Windows]:
        """(train, eval): the last `eval_fraction` of the windows (at least one) are held out."""
        if not 0.0 < eval_fraction < 1.0:
            raise NVFP4UsageError(f"eval_fraction={eval_fraction}: expected a number in (0, 1)")
        num_eval = max(1, int(round(self.count * eval_fraction)))
        return self._part(0, self.count - num_eval), self._part(self.count - num_eval, num_eval)

    def batches(self, batch_size: int, count: int | None = None) -> Iterator[Batch]:
        """The first `count` windows (default: all) in order, in batches of at most `batch_size`."""
        count = self.count if count is None else min(count, self.count)
        for start in range(0, count, batch_size):
            yield self.rows(np.arange(start, min(start + batch_size, count)))

    def require_two(self) -> Windows:
        """These windows, if there are two or more (one to train on, one to evaluate)."""
        if self.count < 2:
            raise NVFP4ToolError(
                f"the data has {len(self.tokens)} tokens: too few for two windows of "
                f"seq_len={self.seq_len} (one to train on, one to evaluate)"
            )
        return self

    def _part(self, first: int, count: int) -> Windows:
        return Windows(
            self.tokens,
            self.seq_len,
            starts=self.starts,
            loss=self.loss,
            packing=self.packing,
            first=self.first + first,
            count=count,
        )


def windows_in_memory(encoded: Iterable[EncodedBatch], seq_len: int, packing: str = "concat") -> Windows:
    """The windows of documents encoded in this process (train's text / JSONL / Parquet data)."""
    ids, lengths, marks = [], [], []
    for batch in encoded:
        ids.append(batch.ids)
        lengths.append(batch.lengths)
        marks.append(batch.loss)
    lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    starts = np.cumsum(lengths) - lengths
    loss = None if not marks or any(m is None for m in marks) else TokenStream([np.concatenate(marks)])
    tokens = TokenStream([np.concatenate(ids)] if ids else [])
    return Windows(tokens, seq_len, starts=starts, loss=loss, packing=packing).require_two()
