"""Stream one tensor's data and count what a checker needs: zeros, NaN codes, non-finite values.

E4M3 bytes are read as codes (sign bit 0x80; 0x7F / 0xFF are NaN, the format has no inf; 0x00 /
0x80 are +-0). Integer tensors (packed E2M1) only need "is it all zero", so their scan stops at
the first non-zero chunk.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from nvfp4tool.check.files import CHUNK_BYTES, TensorEntry, iter_chunks

E4M3_CODE = "F8_E4M3"
_FLOAT_CODES = ("F64", "F32", "F16", "BF16", "F8_E5M2")


@dataclasses.dataclass
class TensorScan:
    """Counts over one tensor's elements (a stopped-early scan fills only `all_zero`)."""

    elements: int = 0
    all_zero: bool = True
    zeros: int = 0  # E4M3 codes 0x00 / 0x80
    nan: int = 0  # E4M3 NaN codes, or non-finite float values
    negative: int = 0  # E4M3 codes with the sign bit set, other than -0 and NaN
    first_nan: int | None = None  # flat index of the first NaN / non-finite element
    bytes_read: int = 0


def scan_tensor(entry: TensorEntry, chunk_bytes: int = CHUNK_BYTES) -> TensorScan:
    """Zero / NaN / sign counts of `entry` (full read for E4M3 and floats; early stop for ints),
    reading at most `chunk_bytes` at a time."""
    scan = TensorScan()
    offset = 0
    for chunk in iter_chunks(entry, chunk_bytes):
        scan.bytes_read += chunk.nbytes
        if entry.code == E4M3_CODE:
            _count_e4m3(chunk.view(np.uint8), offset, scan)
        elif entry.code in _FLOAT_CODES:
            _count_float(chunk, offset, scan)
        elif np.any(chunk.view(np.uint8)):
            scan.all_zero = False
            return scan
        offset += chunk.size
    scan.elements = offset
    return scan


def _count_e4m3(codes: np.ndarray, offset: int, scan: TensorScan) -> None:
    magnitude = codes & 0x7F
    is_nan = magnitude == 0x7F
    is_zero = magnitude == 0
    scan.zeros += int(np.count_nonzero(is_zero))
    scan.negative += int(np.count_nonzero(((codes & 0x80) != 0) & ~is_zero & ~is_nan))
    _note_nan(is_nan, offset, scan)
    if scan.all_zero and not is_zero.all():
        scan.all_zero = False


def _count_float(values: np.ndarray, offset: int, scan: TensorScan) -> None:
    _note_nan(~np.isfinite(values.astype(np.float32)), offset, scan)
    if scan.all_zero and np.any(values != 0):
        scan.all_zero = False


def _note_nan(is_nan: np.ndarray, offset: int, scan: TensorScan) -> None:
    count = int(np.count_nonzero(is_nan))
    if count and scan.first_nan is None:
        scan.first_nan = offset + int(np.argmax(is_nan))
    scan.nan += count
