"""The ModelOpt "unified HF checkpoint" layout (vLLM `modelopt_fp4`/`modelopt`, TensorRT-LLM, SGLang).

Stateless functions from one module's quantized weight (+ input amax) to the tensors written, and
the two JSON configs (sheet section 5). Per quantized linear `<m>`:

    NVFP4  <m>.weight U8 [N, K/2], <m>.weight_scale F8_E4M3 [N, K/16],
           <m>.weight_scale_2 F32 [] (global decode scale), <m>.input_scale F32 [] (W4A4 only)
    FP8    <m>.weight F8_E4M3 [N, K], <m>.weight_scale F32 [] = amax / 448, <m>.input_scale F32 []

Global decode scales are S_dec = fl(1 / fl(2688 / amax)), the value the numerics decode with (not
fl(amax / 2688), which differs in the last bit for ~1 in 6 amax values), so the stored bytes
decode exactly to `dequantize_nvfp4` of the record.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from nvfp4tool.export.plan import ExportPlan
from nvfp4tool.numerics import FP8Array, NVFP4Array
from nvfp4tool.numerics.constants import E4M3_MAX, NVFP4_BLOCK
from nvfp4tool.numerics.nvfp4 import nvfp4_global_scales

NAME = "modelopt"
HF_QUANT_CONFIG_FILE = "hf_quant_config.json"
QUANT_ALGO = {"nvfp4": "NVFP4", "nvfp4-weight-only": "W4A16_NVFP4", "fp8": "FP8"}


def layout(module: str, n: int, k: int, quant: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of the tensors `tensors` returns for a quantized [N, K] linear."""
    if quant == "fp8":
        entries = [(f"{module}.weight", "float8_e4m3fn", (n, k)),
                   (f"{module}.weight_scale", "float32", ())]
    else:
        entries = [(f"{module}.weight", "uint8", (n, k // 2)),
                   (f"{module}.weight_scale", "float8_e4m3fn", (n, k // NVFP4_BLOCK)),
                   (f"{module}.weight_scale_2", "float32", ())]
    if quant != "nvfp4-weight-only":
        entries.append((f"{module}.input_scale", "float32", ()))
    return entries


def tensors(module: str, q: NVFP4Array | FP8Array, input_amax: float | None,
            quant: str) -> dict[str, np.ndarray]:
    """The tensors of one quantized linear (input_amax: None for weight-only)."""
    if quant == "fp8":
        out = {f"{module}.weight": np.asarray(q.data),
               f"{module}.weight_scale": np.asarray(q.scale, np.float32).reshape(())}
    else:
        out = {f"{module}.weight": np.asarray(q.packed),
               f"{module}.weight_scale": np.asarray(q.scales),
               f"{module}.weight_scale_2": nvfp4_decode_scale(q.global_amax)}
    if quant != "nvfp4-weight-only":
        out[f"{module}.input_scale"] = input_decode_scale(input_amax, quant)
    return out


def nvfp4_decode_scale(amax: float | np.ndarray) -> np.ndarray:
    """S_dec of an amax as an fp32 scalar array (shape [])."""
    return np.asarray(nvfp4_global_scales(np.float32(amax))[1], np.float32).reshape(())


def input_decode_scale(input_amax: float, quant: str) -> np.ndarray:
    """Static activation decode scale: NVFP4 S_dec of the input amax, or amax / 448 for FP8."""
    if quant == "fp8":
        scale = np.float32(input_amax) / np.float32(E4M3_MAX)
        return np.asarray(scale if scale > 0 else np.float32(1.0), np.float32).reshape(())
    return nvfp4_decode_scale(input_amax)


def quantization_config(plan: ExportPlan) -> dict[str, Any]:
    """config.json["quantization_config"] (quant_method "modelopt")."""
    algo = QUANT_ALGO[plan.quant]
    weights: dict[str, Any] = ({"num_bits": 8, "type": "float", "dynamic": False} if plan.quant == "fp8"
                               else {"num_bits": 4, "type": "float", "group_size": NVFP4_BLOCK,
                                     "dynamic": False})
    group: dict[str, Any] = {"targets": ["Linear"], "weights": weights}
    if plan.has_input_scales:
        group["input_activations"] = dict(weights)
    config: dict[str, Any] = {"quant_method": "modelopt", "quant_algo": algo,
                              "kv_cache_quant_algo": None, "ignore": list(plan.excluded),
                              "exclude_modules": list(plan.excluded),
                              "config_groups": {"group_0": group}}
    if plan.quant != "fp8":
        config["group_size"] = NVFP4_BLOCK
    return config


def hf_quant_config(plan: ExportPlan, producer: dict[str, str]) -> dict[str, Any]:
    """hf_quant_config.json (vLLM requires all four quantization keys)."""
    quantization: dict[str, Any] = {"quant_algo": QUANT_ALGO[plan.quant], "kv_cache_quant_algo": None,
                                    "exclude_modules": list(plan.excluded)}
    if plan.quant != "fp8":
        quantization["group_size"] = NVFP4_BLOCK
    return {"producer": producer, "quantization": quantization}
