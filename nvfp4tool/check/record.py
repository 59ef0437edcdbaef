"""The folder's tensors against the export's own provenance record (`nvfp4tool_export.json`,
`ExportRecord`), when there is one.

The record lists every tensor the export wrote: its file, dtype, shape, sha256 of its bytes and,
for quantized weights, the amax of the decoded weight. Any difference is a problem naming the
tensor: a tensor missing or added, moved to another file, relabelled (header dtype / shape), bytes
changed (tampered or corrupted), or a weight that no longer decodes to the amax the export
recorded (a global scale or block scales changed: x4, reciprocal). A record that cannot be read is
itself a problem (naming the file), not an internal error.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping

import numpy as np

from nvfp4tool.check.files import CHUNK_BYTES, TensorEntry, iter_chunks, iter_rows, read_small
from nvfp4tool.check.report import CONFIG_LEVEL, Problem
from nvfp4tool.formats import FolderLayout, LayoutSpec
from nvfp4tool.numerics import decode_e2m1, decode_fp8, unpack_codes
from nvfp4tool.numerics.constants import FP8_BLOCK
from nvfp4tool.records import RecordError
from nvfp4tool.records.export import ExportRecord

AMAX_RTOL = 1e-6  # the writer and the checker decode the same bytes; they differ by fp32 rounding only


def check_against_record(
    folder: str, entries: Mapping[str, TensorEntry], layout: FolderLayout, quantized: Mapping[str, LayoutSpec]
) -> list[Problem]:
    """Problems of the folder's tensors against its ExportRecord ([] when there is none);
    `quantized`: each quantized module's spec."""
    if not ExportRecord.exists(folder):
        return []
    try:
        record = ExportRecord.read(folder)
    except RecordError as bad:
        return [Problem(CONFIG_LEVEL, ExportRecord.FILE_NAME, str(bad))]
    where = ExportRecord.FILE_NAME
    problems = []
    if (record.format, record.quant) != (layout.format, layout.quant):
        problems.append(
            Problem(
                CONFIG_LEVEL,
                where,
                f"records a {record.format} {record.quant} export, the configs declare {layout.format} {layout.quant}",
            )
        )
    for name in sorted(set(record.tensors) - set(entries)):
        problems.append(Problem(name.rpartition(".")[0], name, f"in {where} but not in the folder"))
    for name in sorted(set(entries) - set(record.tensors)):
        problems.append(Problem(name.rpartition(".")[0], name, f"not in {where} (added after export?)"))
    for name in sorted(set(entries) & set(record.tensors)):
        problems += _tensor_problems(name, entries[name], record.tensors[name], where)
    for module, spec in sorted(quantized.items()):
        weight = f"{module}.{spec.suffix('weight')}"
        expected = record.tensors.get(weight).amax if weight in record.tensors else None
        if expected is None:
            continue
        decoded = decoded_amax(module, entries, spec)
        if decoded is not None and not abs(decoded - expected) <= AMAX_RTOL * abs(expected):
            problems.append(
                Problem(
                    module,
                    weight,
                    f"decodes to amax {decoded:.6g}, the export recorded "
                    f"{expected:.6g} ({where}): a global or block scale "
                    f"changed since export",
                )
            )
    return problems


def decoded_amax(module: str, entries: Mapping[str, TensorEntry], spec: LayoutSpec) -> float | None:
    """max |decoded weight| of a quantized module from its stored bytes, row chunk by row chunk;
    None when a tensor it needs is missing or malformed (reported by the module checks)."""
    tensors = {t.role: entries.get(f"{module}.{t.suffix}") for t in spec.tensors}
    if spec.is_fp8_block:
        return _fp8_block_amax(tensors.get("weight"), tensors.get("block_scale"), spec)
    weight, scale = tensors.get("weight"), tensors.get("weight_global")
    if weight is None or scale is None or scale.code != "F32" or scale.nbytes != 4 or len(weight.shape) != 2:
        return None
    if weight.code != spec.tensor("weight").code:
        return None
    s_dec = float(spec.decode_global(read_small(scale)))
    if not spec.is_nvfp4:
        peak = max((float(np.max(np.abs(c.astype(np.float32)))) for c in iter_chunks(weight) if c.size), default=0.0)
        return peak * s_dec
    block = tensors.get("block_scale")
    n, k = spec.nk(weight.shape)
    if (
        block is None
        or block.code != spec.tensor("block_scale").code
        or block.shape != spec.tensor("block_scale").shape(n, k)
    ):
        return None
    rows = max(1, CHUNK_BYTES // 8 // max(1, k))  # the fp32 decode of a chunk stays ~CHUNK_BYTES / 2
    peak = 0.0
    for packed, scales in zip(iter_rows(weight, rows), iter_rows(block, rows)):
        values = np.asarray(decode_e2m1(unpack_codes(packed))).reshape(len(packed), -1, 16)
        product = np.abs(values * scales.astype(np.float32)[..., None])
        peak = max(peak, float(product.max()) if product.size else 0.0)
    return peak * s_dec


def _fp8_block_amax(weight: TensorEntry | None, block: TensorEntry | None, spec: LayoutSpec) -> float | None:
    """max |decoded weight| of an fp8-block module (`numerics.decode_fp8`, each value times its
    128x128 block's scale), 128-row chunks at a time; None when a tensor is missing or malformed."""
    if weight is None or block is None or len(weight.shape) != 2 or weight.code != spec.tensor("weight").code:
        return None
    n, k = weight.shape
    if block.code != spec.tensor("block_scale").code or block.shape != spec.tensor("block_scale").shape(n, k):
        return None
    scales = read_small(block).astype(np.float32).reshape(block.shape[0], -1)  # ModelOpt: [N/128, 1, K/128, 1]
    rows = FP8_BLOCK * max(1, CHUNK_BYTES // 4 // max(1, k) // FP8_BLOCK)  # the fp32 decode stays ~CHUNK_BYTES
    peak = 0.0
    for i, values in enumerate(iter_rows(weight, rows)):
        first = i * rows // FP8_BLOCK
        row_scales = np.repeat(scales[first : first + rows // FP8_BLOCK], FP8_BLOCK, axis=0)[: len(values)]
        decoded = np.asarray(decode_fp8(values, row_scales, granularity="block128"))
        peak = max(peak, float(np.abs(decoded).max()) if decoded.size else 0.0)
    return peak


def _tensor_problems(name: str, entry: TensorEntry, expected, where: str) -> list[Problem]:
    module = name.rpartition(".")[0]
    problems = []
    if os.path.basename(entry.file) != expected.file:
        problems.append(Problem(module, name, f"is in {os.path.basename(entry.file)}, {where} says {expected.file}"))
    if entry.code != expected.dtype or tuple(entry.shape) != tuple(expected.shape):
        problems.append(
            Problem(
                module,
                name,
                f"is {entry.code}{list(entry.shape)} but the export wrote "
                f"{expected.dtype}{list(expected.shape)} ({where}): "
                f"relabelled header?",
            )
        )
        return problems
    digest = hashlib.sha256()
    for chunk in iter_chunks(entry):
        digest.update(chunk.view(np.uint8))
    if digest.hexdigest() != expected.sha256:
        problems.append(
            Problem(module, name, f"bytes differ from what the export wrote (sha256 in {where}): tampered or corrupted")
        )
    return problems
