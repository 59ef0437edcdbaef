"""The FP8 KV-cache scales of a serving folder against what its configs announce (`check_kv_scales`).

Announced: every attention layer carries its K and V scales under `LayoutSpec.kv_scales`, F32, finite
and > 0; not announced: none may be present. Each scale found is listed (`KVScaleStats`).
Design notes: docs/design/check.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from nvfp4tool.check.files import TensorEntry, read_small
from nvfp4tool.check.report import KVScaleStats, Problem
from nvfp4tool.families import attention_of
from nvfp4tool.formats import SPECS, FolderLayout

# Every layout's KV-scale naming (to recognise scales under either layout's names).
_KV_SPECS = tuple(dict.fromkeys(spec.kv_scales for spec in SPECS.values()))
# The last name component of a KV scale in any layout (judged here, not by the generic data scan).
KV_SCALE_SUFFIXES = tuple(dict.fromkeys(s.rpartition(".")[2] for kv in _KV_SPECS for s in (kv.k_suffix, kv.v_suffix)))


def check_kv_scales(
    entries: Mapping[str, TensorEntry], layout: FolderLayout, attentions: Sequence[str] | None = None
) -> tuple[list[Problem], list[KVScaleStats]]:
    """(problems, every KV scale checked) of the folder's KV-cache scales (see the module docstring);
    `attentions`: the model's attention modules (None: those the folder's tensors name)."""
    kv = layout.spec.kv_scales
    announced = layout.kv_cache is not None
    if attentions is None:
        attentions = sorted({a for n in entries if (a := attention_of(n)) is not None})
    problems: list[Problem] = []
    checked: list[KVScaleStats] = []
    expected = set()
    if announced:
        for attention in attentions:
            for which, name in zip("kv", kv.names(attention)):
                expected.add(name)
                found = _scale_problems(attention, name, entries.get(name), kv.shape, layout.kv_cache)
                problems += found
                if name in entries:
                    checked.append(_stats(attention, which, entries[name], not found))
    for name in entries:
        owner = next((found for spec in _KV_SPECS if (found := spec.attention_of(name))), None)
        if owner is None or name in expected or owner[0] not in attentions:
            continue
        why = (
            f"is not where {layout.format} keeps KV-cache scales ({kv.k_suffix} / {kv.v_suffix})"
            if announced
            else "is a KV-cache scale, but the configs announce no quantized KV cache "
            "(kv_cache_scheme / kv_cache_quant_algo): no engine reads it"
        )
        problems.append(Problem(owner[0], name, why))
    return problems, checked


def _stats(attention: str, which: str, entry: TensorEntry, ok: bool) -> KVScaleStats:
    value = float(read_small(entry).reshape(-1)[0]) if entry.code == "F32" and entry.nbytes == 4 else None
    return KVScaleStats(
        attention=attention,
        which=which,
        tensor=entry.name,
        dtype=entry.code,
        shape=tuple(entry.shape),
        value=value,
        ok=ok,
    )


def _scale_problems(
    attention: str, name: str, entry: TensorEntry | None, shape: tuple[int, ...], kv_cache: str
) -> list[Problem]:
    if entry is None:
        return [
            Problem(
                attention,
                name,
                f"missing: the configs announce an {kv_cache.upper()} KV cache "
                f"(vLLM would use scale 1.0 for this layer)",
            )
        ]
    if entry.code != "F32" or entry.shape != shape:
        return [Problem(attention, name, f"is {entry.code}{list(entry.shape)}, expected F32 {list(shape)}")]
    value = float(read_small(entry).reshape(-1)[0])
    if not np.isfinite(value) or value <= 0:
        return [Problem(attention, name, f"is {value}: a KV-cache scale must be finite and > 0")]
    return []
