"""The FP8 KV-cache scales of a serving folder against what its configs announce.

When the configs announce a quantized KV cache (ModelOpt `kv_cache_quant_algo` / `kv_cache_scheme`,
compressed-tensors `kv_cache_scheme`), every attention layer (`model.layers.{i}.self_attn`, as the
folder's tensors name them) must carry its K and V scales under the layout's names
(`LayoutSpec.kv_scales`), F32 of the layout's scalar shape, finite and > 0: vLLM falls back to
scale 1.0 for a missing one (an FP8 cache of unscaled values) and divides by a zero one. KV scales
present without the configs announcing a quantized KV cache (or under the other layout's names)
are an error too: no engine reads them, so the cache they were calibrated for is not what is served.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np

from nvfp4tool.check.files import TensorEntry, read_small
from nvfp4tool.check.report import Problem
from nvfp4tool.formats import SPECS, FolderLayout

_ATTENTION = re.compile(r"^(?P<attention>.*\.self_attn)\.")
# Every layout's KV-scale naming (to recognise scales under either layout's names).
_KV_SPECS = tuple(dict.fromkeys(spec.kv_scales for spec in SPECS.values()))
# The last name component of a KV scale in any layout (judged here, not by the generic data scan).
KV_SCALE_SUFFIXES = tuple(dict.fromkeys(s.rpartition(".")[2] for kv in _KV_SPECS
                                        for s in (kv.k_suffix, kv.v_suffix)))


def check_kv_scales(entries: Mapping[str, TensorEntry], layout: FolderLayout) -> list[Problem]:
    """Problems of the folder's KV-cache scales (see the module docstring)."""
    kv = layout.spec.kv_scales
    announced = layout.kv_cache is not None
    problems = []
    expected = set()
    if announced:
        attentions = sorted({m.group("attention") for n in entries if (m := _ATTENTION.match(n))})
        for attention in attentions:
            for name in kv.names(attention):
                expected.add(name)
                problems += _scale_problems(attention, name, entries.get(name), kv.shape, layout.kv_cache)
    for name in entries:
        owner = next((found for spec in _KV_SPECS if (found := spec.attention_of(name))), None)
        if owner is None or name in expected:
            continue
        why = (f"is not where {layout.format} keeps KV-cache scales ({kv.k_suffix} / {kv.v_suffix})"
               if announced else "is a KV-cache scale, but the configs announce no quantized KV cache "
                                 "(kv_cache_scheme / kv_cache_quant_algo): no engine reads it")
        problems.append(Problem(owner[0], name, why))
    return problems


def _scale_problems(attention: str, name: str, entry: TensorEntry | None, shape: tuple[int, ...],
                    kv_cache: str) -> list[Problem]:
    if entry is None:
        return [Problem(attention, name, f"missing: the configs announce an {kv_cache.upper()} KV cache "
                                         f"(vLLM would use scale 1.0 for this layer)")]
    if entry.code != "F32" or entry.shape != shape:
        return [Problem(attention, name, f"is {entry.code}{list(entry.shape)}, expected F32 {list(shape)}")]
    value = float(read_small(entry).reshape(-1)[0])
    if not np.isfinite(value) or value <= 0:
        return [Problem(attention, name, f"is {value}: a KV-cache scale must be finite and > 0")]
    return []
