"""The folded model of equivalent scaling: per-input-channel scales s multiplied into the readers'
weight columns and divided out of their producer (a norm's weight, v_proj's / up_proj's rows),
so the model computes the same function (`export --equalize` chooses s: `export/equalize.py`).

    scales = scales_from_record(export_record.equalization, config)   # the sites' s, as recorded
    tensors = EqualizedSource(source.tensors, scales)                 # the folded model, as read
    EqualizedSource.from_export(source.tensors, export_dir, record, config, as_stored=True)  # bound

The one owner of the fold: the export quantizes the folded model, validate compares an equalized
export with it, and `train equalize_from=` starts QAD from it. The sites are the family's
(`families.Fold`).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import os
import re
from collections.abc import Sequence

import numpy as np

from nvfp4tool.config import ModelConfig
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.families import Fold, folds, fused_group
from nvfp4tool.records.export import EqualizationRecord, ExportRecord


@dataclasses.dataclass(frozen=True)
class FoldScale:
    """The scale chosen for one site: s over the producer's channels (fp32)."""

    fold: Fold
    s: np.ndarray
    alpha: float
    error: float | None = None  # AWQ: the consumers' summed squared output error at `alpha`
    rtn_error: float | None = None  # ... and at s = 1

    def consumer_scale(self) -> np.ndarray:
        """s over the consumers' input channels (repeated over the query heads of a GQA o_proj)."""
        if self.fold.expand is None:
            return self.s
        groups, repeat, width = self.fold.expand
        return np.broadcast_to(self.s.reshape(groups, 1, width), (groups, repeat, width)).reshape(-1)


class EqualizedSource:
    """A `TensorSource` of the folded model: the source's tensors with every site's s applied as
    they are read (consumer and reader columns times s, norm weights and producer rows divided by
    s; a (1 + w) norm's weight becomes (1 + w) / s - 1: `Fold.unit_offset`), computed in fp32 and
    returned in fp32 (a quantized weight is quantized from the unrounded product; the writer
    stores everything else in BF16 as it always does). Names, shapes and dtypes are the
    source's. `as_stored=True` returns each folded tensor rounded (to nearest even) to the dtype
    the source holds it in: the folded model as a checkpoint stores it, which the export's check
    runs and `train equalize_from=` starts from."""

    def __init__(self, source, scales: Sequence[FoldScale], *, as_stored: bool = False) -> None:
        self._source = source
        self._as_stored = as_stored
        self._columns: dict[str, np.ndarray] = {}
        self._rows: dict[str, np.ndarray] = {}  # also the elementwise divisor of a norm weight
        self._unit_offset: set[str] = set()  # (1 + w) norm weights: (1 + w) / s - 1
        for found in scales:
            s_in = found.consumer_scale().astype(np.float32)
            for module in (*found.fold.consumers, *found.fold.readers):
                self._columns[f"{module}.weight"] = s_in
            for tensor in found.fold.producer:
                self._rows[tensor] = found.s.astype(np.float32)
                if found.fold.unit_offset:
                    self._unit_offset.add(tensor)

    @classmethod
    def from_record(
        cls, source, record: EqualizationRecord, config: ModelConfig, *, as_stored: bool = False
    ) -> EqualizedSource:
        """The folded model an export's record describes (validate compares the export with it;
        `train equalize_from=` starts from it, `as_stored`)."""
        return cls(source, scales_from_record(record, config), as_stored=as_stored)

    @classmethod
    def from_export(
        cls, source, export_dir: str, record: ExportRecord, config: ModelConfig, *, as_stored: bool = False
    ) -> EqualizedSource:
        """The folded model the equalized export in `export_dir` (its provenance `record`) was made
        from, its scales bound to the bytes they made: every producer the export stores unquantized
        (a norm weight, a BF16-kept linear) must be the source's tensor folded with the recorded
        scales, as the export wrote it. NVFP4ToolError naming the record, the site and the tensor
        otherwise (scales edited after export, or another source)."""
        where = ExportRecord.path(export_dir)
        assert record.equalization is not None
        scales = scales_from_record(record.equalization, config, where=where)
        _check_bound(cls(source, scales), scales, export_dir, record, where)
        return cls(source, scales, as_stored=as_stored)

    @property
    def path(self) -> str:
        return self._source.path

    def names(self) -> list[str]:
        return self._source.names()

    def shape(self, name: str) -> tuple[int, ...]:
        return self._source.shape(name)

    def dtype(self, name: str) -> str:
        return self._source.dtype(name)

    def columns(self, module: str) -> np.ndarray | None:
        """The factor on linear `module`'s weight columns (its input is divided by it), None: 1."""
        return self._columns.get(f"{module}.weight")

    def rows(self, module: str) -> np.ndarray | None:
        """The divisor of linear `module`'s weight rows and bias (and so of its output), None: 1."""
        return self._rows.get(f"{module}.weight")

    def get(self, name: str) -> np.ndarray:
        array = self._source.get(name)
        columns, rows = self._columns.get(name), self._rows.get(name)
        if columns is None and rows is None:
            return array
        out = np.asarray(array, np.float32)
        if columns is not None:
            out = out * columns[None, :]
        if name in self._unit_offset:
            out = (1 + out) / rows - 1
        elif rows is not None:
            out = out / (rows if out.ndim == 1 else rows[:, None])
        return out.astype(np.asarray(array).dtype) if self._as_stored else out


def scales_from_record(
    record: EqualizationRecord, config: ModelConfig, *, where: str = "equalization record"
) -> tuple[FoldScale, ...]:
    """The sites' scales an export's record stores, each checked before anything uses it: base64
    of little-endian fp32, one per channel of the site's producer, finite and > 0 (as AWQ and
    SmoothQuant choose them); NVFP4ToolError `where: equalization site KEY: problem` otherwise."""
    by_key = {site_key(f): f for f in folds(config)}
    shapes = config.expected_tensor_shapes()
    result = []
    for key, found in record.sites.items():
        site = f"{where}: equalization site {key!r}"
        if key not in by_key:
            raise NVFP4ToolError(f"{site}: not a site of the model")
        fold = by_key[key]
        try:
            raw = base64.b64decode(found.scales, validate=True)
        except (binascii.Error, ValueError, TypeError):
            raise NVFP4ToolError(f"{site}: scales: not base64 (little-endian fp32 values)") from None
        channels = int(shapes[fold.producer[0]][0])
        if len(raw) != 4 * channels:
            count = f"{len(raw) // 4} scales" if len(raw) % 4 == 0 else f"{len(raw)} bytes"
            raise NVFP4ToolError(
                f"{site}: scales: {count}, expected {channels} (one fp32 per channel of {fold.producer[0]})"
            )
        s = np.frombuffer(raw, "<f4").astype(np.float32)
        bad = np.flatnonzero(~(np.isfinite(s) & (s > 0)))
        if bad.size:
            raise NVFP4ToolError(
                f"{site}: scales: channel {int(bad[0])} is {float(s[bad[0]])!r}"
                + (f" ({bad.size} such)" if bad.size > 1 else "")
                + "; every scale must be finite and > 0"
            )
        result.append(FoldScale(fold=by_key[key], s=s, alpha=found.alpha))
    return tuple(result)


def _check_bound(
    folded: EqualizedSource, scales: Sequence[FoldScale], export_dir: str, record: ExportRecord, where: str
) -> None:
    """Refuse scales that did not make the export's stored producers (`EqualizedSource.from_export`)."""
    from converters.hf import SAFETENSORS_DTYPES, read_safetensors_header

    headers: dict[str, dict] = {}
    for found in scales:
        for name in found.fold.producer:
            stored = record.tensors.get(name)
            if stored is None or stored.amax is not None or stored.dtype not in ("BF16", "F16", "F32"):
                continue  # quantized (its bytes are the quantizer's), or not written as such
            if tuple(stored.shape) != tuple(folded.shape(name)):
                continue
            path = os.path.join(export_dir, *stored.file.split("/"))
            if path not in headers:
                headers[path] = read_safetensors_header(path) if os.path.isfile(path) else {}
            entry = headers[path].get(name)
            if entry is None or entry.code != stored.dtype:
                continue  # check's business: the record does not describe the file
            with open(path, "rb") as f:
                f.seek(entry.start)
                actual = hashlib.sha256(f.read(entry.nbytes)).hexdigest()
            made = np.asarray(folded.get(name), np.float32).astype(SAFETENSORS_DTYPES[stored.dtype])
            if hashlib.sha256(made.tobytes()).hexdigest() != actual:
                raise NVFP4ToolError(
                    f"{where}: equalization site {site_key(found.fold)!r}: its scales did not make the "
                    f"export's {name} (in {stored.file}): the record was edited after export, or the "
                    "source is not the one the export was made from"
                )


def site_key(fold: Fold) -> str:
    """A site's name in the record: its consumers' fused group (`model.layers.0.self_attn.qkv`), or
    a glob over a sparse MLP's experts (`model.layers.0.mlp.experts.*.gate_up`)."""
    groups = list(dict.fromkeys(fused_group(c) for c in fold.consumers))
    return groups[0] if len(groups) == 1 else re.sub(r"\.experts\.\d+\.", ".experts.*.", groups[0])


def carried(into, from_, module: str) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(input factor [K], output factor [N]) that carry linear `module`'s input and output in the
    model `from_` to the model `into` (each a source's tensors, folded or not): x_into = x_from *
    input, y_into = y_from * output; None where the two models agree. A folded model sees its
    consumers' inputs divided by their column scales and its producers' outputs by their row
    scales, so an export of one fold is compared with another's activations through these."""

    def ratio(of: str) -> np.ndarray | None:
        mine = getattr(from_, of)(module) if isinstance(from_, EqualizedSource) else None
        theirs = getattr(into, of)(module) if isinstance(into, EqualizedSource) else None
        if mine is None and theirs is None:
            return None
        one = np.float32(1)
        return ((one if mine is None else mine) / (one if theirs is None else theirs)).astype(np.float32)

    return ratio("columns"), ratio("rows")
