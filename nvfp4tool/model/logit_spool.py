"""`LogitSpool`: a model's fp32 logits [S, T, V] kept in a temporary file, a batch at a time.

    spool = LogitSpool(path, (S, T), vocab); spool.write(start, logits_BxTxV); spool.read(start, B)

The reference of a comparison that must not hold two models (validate's BF16 logits, the check of
an equalized export's folded model against the original).
"""

from __future__ import annotations

import numpy as np

from nvfp4tool import progress


class LogitSpool:
    """fp32 logits [S, T, V] of the reference model in a temporary file, written and read a batch at
    a time with plain file I/O (page cache, not this process's memory)."""

    def __init__(self, path: str, shape_SxT: tuple[int, int], vocab: int) -> None:
        self.path, (self.samples, self.seq_len), self.vocab = path, shape_SxT, vocab
        self._row_bytes = self.seq_len * vocab * 4
        with open(path, "wb"):
            pass
        progress.info(f"reference logits: {self.samples * self._row_bytes / 1e9:.2f} GB in a temporary file")

    def write(self, start: int, logits_BxTxV: np.ndarray) -> None:
        with open(self.path, "r+b") as f:
            f.seek(start * self._row_bytes)
            f.write(np.ascontiguousarray(logits_BxTxV, np.float32).tobytes())

    def read(self, start: int, count: int) -> np.ndarray:
        with open(self.path, "rb") as f:
            f.seek(start * self._row_bytes)
            data = np.fromfile(f, np.float32, count * self.seq_len * self.vocab)
        return data.reshape(count, self.seq_len, self.vocab)
