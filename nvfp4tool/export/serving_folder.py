"""The one writer of serving folders: shards, index, configs and the provenance tensor records.

    folder = ServingFolder(tmp, source_label=src)
    records = folder.write_shards([(file_name, [(name, dtype, shape), ...]), ...], load, amax=amax_of)

Export (`writer.py`) and convert-format (`convert_format.py`) decide what goes where; this writes it
(`plain_copy`: an unquantized tensor as stored).
Design notes: docs/design/export.md.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from converters.hf import INDEX_FILE, SAFETENSORS_CODES, write_safetensors
from nvfp4tool import formats
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.formats import LayoutSpec
from nvfp4tool.records.export import ExportRecord, TensorRecord

Layout = list[tuple[str, str, tuple[int, ...]]]  # (name, dtype name, shape) in file order


class ServingFolder:
    """A serving folder being written into `folder` (a temporary output folder: see the module
    docstring); `source_label` names the source in a loaded tensor's dtype / shape error."""

    def __init__(self, folder: str, *, source_label: str, rename: Callable[[str], str] = lambda name: name) -> None:
        """`rename`: our tensor / module name -> the checkpoint's (`Family.checkpoint_name`), applied
        to every tensor written and every module an exclusion list names; callers keep our names."""
        self.folder, self.source_label, self.rename = folder, source_label, rename

    def write_shards(
        self,
        shards: Iterable[tuple[str, Layout]],
        load: Callable[[str], np.ndarray],
        *,
        amax: Callable[[str], float | None] = lambda name: None,
    ) -> dict[str, TensorRecord]:
        """Write each (file name, layout) shard tensor by tensor; returns every written tensor's
        record (by its name in the folder), in write order."""
        records: dict[str, TensorRecord] = {}
        ours: dict[str, str] = {}
        for file_name, layout in shards:
            ours.update((self.rename(name), name) for name, _, _ in layout)

            def record(stored: str, file_name: str = file_name) -> np.ndarray:
                name = ours[stored]
                array = load(name)
                data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
                records[stored] = TensorRecord(
                    file=file_name,
                    dtype=SAFETENSORS_CODES[array.dtype.name],
                    shape=tuple(int(d) for d in array.shape),
                    sha256=hashlib.sha256(data).hexdigest(),
                    amax=amax(name),
                )
                return array

            write_safetensors(
                os.path.join(self.folder, file_name),
                [(self.rename(n), d, s) for n, d, s in layout],
                record,
                source_label=self.source_label,
            )
        return records

    def write_index(self, index: dict[str, Any] | None, records: dict[str, TensorRecord]) -> None:
        """The shard index `index` (its other keys kept in their order) with the weight map of
        `records`; None: no index (a single-file folder)."""
        if index is not None:
            weight_map = {name: r.file for name, r in records.items()}
            write_json(os.path.join(self.folder, INDEX_FILE), {**index, "weight_map": weight_map})

    def write_configs(
        self,
        hf_config: dict[str, Any],
        spec: LayoutSpec,
        exclude,
        kv_cache: str | None,
        quants: Mapping[str, str] | None = None,
    ) -> None:
        """config.json (`hf_config` with the layout's quantization_config) and, when the layout has
        one, hf_quant_config.json, both announcing `exclude` (BF16 modules) and `kv_cache`; a mixed
        export's (`quants`: quantized linear -> its quant) name each linear's scheme."""
        hf = dict(hf_config)
        exclude = tuple(self.rename(m) for m in exclude)
        producer = {"name": "nvfp4tool", "version": _version()}
        if quants:
            hf["quantization_config"], hf_quant = formats.mixed_configs(
                spec.format, {self.rename(m): q for m, q in quants.items()}, exclude, producer, kv_cache
            )
        else:
            hf["quantization_config"] = spec.quantization_config(exclude, kv_cache)
            hf_quant = spec.hf_quant_config(exclude, producer, kv_cache)
        write_json(os.path.join(self.folder, formats.CONFIG_FILE), hf)
        if hf_quant is not None:
            write_json(os.path.join(self.folder, formats.HF_QUANT_CONFIG_FILE), hf_quant)

    def copy_files(self, paths: Iterable[str]) -> None:
        """Copy each file (tokenizer, generation config, ...) into the folder, metadata kept."""
        for path in paths:
            shutil.copy2(path, os.path.join(self.folder, os.path.basename(path)))

    def write_record(self, record: ExportRecord | None) -> None:
        """The provenance record (`nvfp4tool_export.json`), when there is one."""
        if record is not None:
            record.write(self.folder)


def write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


def _version() -> str:
    import nvfp4tool

    return nvfp4tool.__version__


def plain_dtype(name: str, dtype: str, family) -> str:
    """An unquantized tensor's output dtype: BF16 for a float, but the source's own for the tensors
    the family keeps as stored (`Family.kept_as_stored`: Nemotron-H's SSM parameters, norms and
    router) and FP32 for those it stores in FP32 (`Family.stored_fp32`); other dtypes as they are."""
    if dtype not in ("float32", "float16", "float64", "bfloat16"):
        return dtype
    if dtype != "float64" and any(fnmatch.fnmatchcase(name, p) for p in family.kept_as_stored):
        return dtype
    return "float32" if any(fnmatch.fnmatchcase(name, p) for p in family.stored_fp32) else "bfloat16"


def plain_copy(tensors, name: str, family) -> np.ndarray:
    """An unquantized tensor as the export writes it (`plain_dtype`); non-finite values refused."""
    array = tensors.get(name)
    if array.dtype.name in ("float32", "float16", "float64", "bfloat16"):
        if not np.isfinite(array).all():
            raise NVFP4ToolError(f"{name}: tensor has non-finite values (NaN or inf); nothing written")
        array = array.astype(plain_dtype(name, array.dtype.name, family), copy=False)
    return array
