"""How an export quantizes one linear's weight: one interface, three implementations, chosen once.

    quantizer = quantizer_for(plan, "rtn", "1d", group_amax, gptq=None)
    done = quantizer.quantize("model.layers.0.mlp.up_proj", w_NxK)   # done.roles, done.errors, done.amax

`ScaleSearch` (NVFP4 RTN or a scale search), `GPTQ` (the GPTQ pass's record), `FP8` (per tensor,
or `granularity="block128x128"`: fp8-block); `Mixed` dispatches each linear of a mixed export to
the one of its quant.
Design notes: docs/design/export.md.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from nvfp4tool.export.gptq_pass import GPTQResult
from nvfp4tool.export.plan import ExportPlan
from nvfp4tool.export.scale_search import quantize_weight
from nvfp4tool.formats import FP8_GRANULARITY
from nvfp4tool.numerics import NVFP4Array, dequantize_fp8, fp8_decode_scale, nvfp4_global_scales, quantize_fp8
from nvfp4tool.numerics.constants import E4M3_MAX


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """One linear's quantized weight: its values by role, its layer errors, its decoded amax."""

    roles: dict[str, np.ndarray]  # "weight", "weight_global" (+ "block_scale" for NVFP4)
    errors: dict[str, float]  # the provenance's LayerErrorRecord fields
    amax: float  # max |decoded weight| (recorded with the stored weight tensor)


class WeightQuantizer(Protocol):
    """Quantizes the weight `w_NxK` of the linear `module`."""

    def quantize(self, module: str, w_NxK: np.ndarray) -> QuantizedWeight: ...


@dataclasses.dataclass(frozen=True)
class ScaleSearch:
    """NVFP4 with round-to-nearest codes and the scales `method` picks (rtn / 4over6 / mse)."""

    method: str
    block: str  # 1d | 2d
    plan: ExportPlan
    group_amax: dict[str, np.float32]  # fused group -> joint weight amax (one global scale per GEMM)

    def quantize(self, module: str, w_NxK: np.ndarray) -> QuantizedWeight:
        q, error = quantize_weight(
            w_NxK,
            method=self.method,
            block=self.block,
            global_amax=self.group_amax[self.plan.group_of(module)],
            name=f"{module}.weight",
        )
        errors = {"rel_l2": error.rel_l2}
        if self.method != "rtn":
            errors.update(rtn_rel_l2=error.rtn_rel_l2, reduction_vs_rtn=error.reduction_vs_rtn)
        return QuantizedWeight(_nvfp4_roles(q), errors, error.decoded_amax)


@dataclasses.dataclass(frozen=True)
class GPTQ:
    """NVFP4 with the codes the GPTQ pass chose (its records, spilled; made from this same weight)."""

    result: GPTQResult

    def quantize(self, module: str, w_NxK: np.ndarray) -> QuantizedWeight:
        q, error = self.result.records.get(module), self.result.errors[module]
        return QuantizedWeight(
            _nvfp4_roles(q),
            {
                "rel_l2": error.rel_l2,
                "output_rel_err": error.output_rel_err,
                "rtn_output_rel_err": error.rtn_output_rel_err,
            },
            error.decoded_amax,
        )


@dataclasses.dataclass(frozen=True)
class FP8:
    """FP8 E4M3 with one per-tensor scale (amax / 448), or (`granularity="block128x128"`, the
    fp8-block quant) one fp32 scale per 128x128 block, [ceil(N/128), ceil(K/128)]."""

    granularity: str = "tensor"

    def quantize(self, module: str, w_NxK: np.ndarray) -> QuantizedWeight:
        q = quantize_fp8(w_NxK, fmt="e4m3", granularity=self.granularity, name=f"{module}.weight")
        w32 = np.asarray(w_NxK, np.float32)
        decoded = np.asarray(dequantize_fp8(q))
        norm = float(np.linalg.norm(w32))
        err = float(np.linalg.norm(decoded - w32)) / norm if norm else 0.0
        amax = float(np.max(np.abs(decoded))) if decoded.size else 0.0
        if self.granularity == "tensor":
            roles = {"weight": np.asarray(q.data), "weight_global": np.asarray(q.scale, np.float32).reshape(())}
        else:
            roles = {"weight": np.asarray(q.data), "block_scale": np.asarray(q.scale, np.float32)}
        return QuantizedWeight(roles, {"rel_l2": err}, amax)


FP8_QUANTIZERS = {quant: FP8(granularity) for quant, granularity in FP8_GRANULARITY.items()}  # fp8, fp8-block


@dataclasses.dataclass(frozen=True)
class Mixed:
    """A mixed export's: each linear by the quantizer of its own quant (`ExportPlan.quant_of`)."""

    plan: ExportPlan
    nvfp4: WeightQuantizer

    def quantize(self, module: str, w_NxK: np.ndarray) -> QuantizedWeight:
        quantizer = FP8_QUANTIZERS.get(self.plan.quant_of(module), self.nvfp4)
        return quantizer.quantize(module, w_NxK)


def quantizer_for(
    plan: ExportPlan, scale_search: str, block: str, group_amax: dict[str, np.float32], gptq: GPTQResult | None
) -> WeightQuantizer:
    """The one quantizer of an export: FP8 for --quant fp8 / fp8-block, else its NVFP4 quantizer
    (`nvfp4_quantizer`; a mixed plan: FP8 per linear, the others by that one)."""
    if plan.quant in FP8_QUANTIZERS:
        return FP8_QUANTIZERS[plan.quant]
    nvfp4 = nvfp4_quantizer(plan, scale_search, block, group_amax, gptq)
    return Mixed(plan, nvfp4) if plan.is_mixed else nvfp4


def nvfp4_quantizer(
    plan: ExportPlan, scale_search: str, block: str, group_amax: dict[str, np.float32], gptq: GPTQResult | None
) -> WeightQuantizer:
    """How an export quantizes an NVFP4 linear (W4A4 and W4A16 store the same codes): GPTQ's
    records when the pass ran, else the scale search."""
    return GPTQ(gptq) if gptq is not None else ScaleSearch(scale_search, block, plan, group_amax)


def nvfp4_decode_scale(amax: float | np.ndarray) -> np.ndarray:
    """S_dec = fl(1 / fl(2688 / amax)) as an fp32 scalar: the value the numerics decode with (not
    fl(amax / 2688), which differs in the last bit for ~1 in 6 amax values), so the stored bytes
    decode exactly to `dequantize_nvfp4` of the record."""
    return np.asarray(nvfp4_global_scales(np.float32(amax))[1], np.float32).reshape(())


def input_decode_scale(input_amax: float, quant: str) -> np.ndarray:
    """Static activation decode scale: NVFP4 S_dec of the input amax, or amax / 448 for FP8."""
    if quant == "fp8":
        scale = np.float32(input_amax) / np.float32(E4M3_MAX)
        return np.asarray(scale if scale > 0 else np.float32(1.0), np.float32).reshape(())
    return nvfp4_decode_scale(input_amax)


def kv_decode_scales(amax_kv: tuple[float, float]) -> tuple[np.ndarray, np.ndarray]:
    """The FP8 KV-cache decode scales (K, V) of one attention, fp32 [] each, from its calibrated
    (K, V) amax: amax / 448 (`numerics.fp8_decode_scale`; ModelOpt's k/v_bmm_quantizer amax / 448)."""
    k_scale, v_scale = (np.asarray(fp8_decode_scale(a), np.float32).reshape(()) for a in amax_kv)
    return k_scale, v_scale


def _nvfp4_roles(q: NVFP4Array) -> dict[str, np.ndarray]:
    return {
        "weight": np.asarray(q.packed),
        "block_scale": np.asarray(q.scales),
        "weight_global": nvfp4_decode_scale(q.global_amax),
    }
