"""The compressed-tensors layout (vLLM compressed-tensors, transformers + compressed-tensors on CPU).

Stateless functions, the counterpart of `modelopt.py` (sheet section 5). Per quantized linear `<m>`:

    NVFP4 (format nvfp4-pack-quantized)
      <m>.weight_packed U8 [N, K/2]          same bytes as ModelOpt `weight`
      <m>.weight_scale F8_E4M3 [N, K/16]     same bytes as ModelOpt
      <m>.weight_global_scale F32 [1]        reciprocal of ModelOpt `weight_scale_2` (an encode scale)
      <m>.input_global_scale F32 [1]         reciprocal of ModelOpt `input_scale` (W4A4 only)
    FP8 (format float-quantized, per tensor)
      <m>.weight F8_E4M3 [N, K], <m>.weight_scale F32 [1], <m>.input_scale F32 [1] (decode scales)

Global scales have shape [1] (transformers refuses []). The reciprocal is computed in fp32 from the
ModelOpt decode scale exactly as compressed-tensors' `ModelOptNvfp4Converter` does (1 / x), so our
two exports are byte-identical under that converter; fl(1 / fl(1 / S_dec)) == S_dec, so the
conversion back is lossless too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from nvfp4tool.export import modelopt
from nvfp4tool.export.plan import ExportPlan
from nvfp4tool.numerics import FP8Array, NVFP4Array
from nvfp4tool.numerics.constants import NVFP4_BLOCK

NAME = "compressed-tensors"
# ModelOpt tensor suffix -> ours, and whether the value is reciprocated (NVFP4 only).
NVFP4_RENAMES = {"weight": ("weight_packed", False), "weight_scale": ("weight_scale", False),
                 "weight_scale_2": ("weight_global_scale", True),
                 "input_scale": ("input_global_scale", True)}


def layout(module: str, n: int, k: int, quant: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of the tensors `tensors` returns for a quantized [N, K] linear."""
    return [(_rename(name, quant), dtype, (1,) if shape == () else shape)
            for name, dtype, shape in modelopt.layout(module, n, k, quant)]


def tensors(module: str, q: NVFP4Array | FP8Array, input_amax: float | None,
            quant: str) -> dict[str, np.ndarray]:
    """The tensors of one quantized linear (input_amax: None for weight-only)."""
    return from_modelopt(modelopt.tensors(module, q, input_amax, quant), quant)


def from_modelopt(tensors: dict[str, np.ndarray], quant: str) -> dict[str, np.ndarray]:
    """One quantized module's ModelOpt-named tensors -> ours (never pass unquantized tensors)."""
    out = {}
    for name, value in tensors.items():
        module, _, suffix = name.rpartition(".")
        new_suffix, reciprocal = NVFP4_RENAMES[suffix] if quant != "fp8" else (suffix, False)
        if reciprocal:  # ModelOpt stores decode scales, compressed-tensors their reciprocal
            value = np.float32(1.0) / value.astype(np.float32)
        if value.ndim == 0:
            value = np.asarray(value, np.float32).reshape(1)  # transformers refuses shape []
        out[f"{module}.{new_suffix}"] = value
    return out


def to_modelopt(tensors: dict[str, np.ndarray], quant: str) -> dict[str, np.ndarray]:
    """Inverse of `from_modelopt` (one quantized module's tensors)."""
    inverse = {new: (old, reciprocal) for old, (new, reciprocal) in NVFP4_RENAMES.items()}
    out = {}
    for name, value in tensors.items():
        module, _, suffix = name.rpartition(".")
        old_suffix, reciprocal = inverse[suffix] if quant != "fp8" else (suffix, False)
        if reciprocal:
            value = np.float32(1.0) / value.astype(np.float32)
        if value.dtype == np.float32 and value.shape == (1,):
            value = np.asarray(value, np.float32).reshape(())
        out[f"{module}.{old_suffix}"] = value
    return out


def convert_layout(entries: list[tuple[str, str, tuple[int, ...]]], quant: str, *,
                   to_ct: bool) -> list[tuple[str, str, tuple[int, ...]]]:
    """The (name, dtype, shape) entries `from_modelopt` (to_ct) / `to_modelopt` would produce."""
    renames = {old: new for old, (new, _) in NVFP4_RENAMES.items()}
    if not to_ct:
        renames = {new: old for old, new in renames.items()}
    out = []
    for name, dtype, shape in entries:
        module, _, suffix = name.rpartition(".")
        if quant != "fp8":
            suffix = renames[suffix]
        if dtype == "float32" and shape in ((), (1,)):
            shape = (1,) if to_ct else ()
        out.append((f"{module}.{suffix}", dtype, shape))
    return out


def quantization_config(plan: ExportPlan) -> dict[str, Any]:
    """config.json["quantization_config"] (quant_method "compressed-tensors")."""
    if plan.quant == "fp8":
        args = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True,
                "dynamic": False, "group_size": None, "observer": "minmax"}
        group: dict[str, Any] = {"targets": ["Linear"], "weights": args,
                                 "input_activations": dict(args)}
        fmt = "float-quantized"
    else:
        weights = {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                   "group_size": NVFP4_BLOCK, "symmetric": True, "dynamic": False,
                   "observer": "static_minmax", "scale_dtype": "torch.float8_e4m3fn"}
        group = {"targets": ["Linear"], "weights": weights}
        if plan.has_input_scales:
            group["input_activations"] = dict(weights, dynamic="local")
        fmt = "nvfp4-pack-quantized"
    group["format"] = fmt
    return {"quant_method": "compressed-tensors", "format": fmt,
            "quantization_status": "compressed", "ignore": list(plan.excluded),
            "config_groups": {"group_0": group}, "kv_cache_scheme": None}


# ------------------------------------------------------------------------------------------
# helpers


def _rename(name: str, quant: str) -> str:
    if quant == "fp8":  # the FP8 names are the same in both layouts
        return name
    module, _, suffix = name.rpartition(".")
    return f"{module}.{NVFP4_RENAMES[suffix][0]}" if suffix in NVFP4_RENAMES else name
