"""The GPTQ pass of an export (`--weight-rounding gptq`): sequential calibration, layer by layer.

    result = run_gptq(config, tensors, plan, group_amax, "calib.txt", spill_dir=tmp, samples=64,
                      seq_len=512, tokenizer_dir=hf, offload="auto", method="rtn", block="1d", damp=0.05)

Each layer's Hessians (X^T X, fp32) are taken with its original weights, its NVFP4 linears
GPTQ-quantized (`gptq.py`; a mixed plan's FP8 and fp8-block linears rounded to nearest, BF16 ones
untouched), and its quantized outputs feed the next layer; each record is spilled to `spill_dir`.
Design notes: docs/design/gptq.md.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4tool.config import ModelConfig
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.export.calibrate import (
    BATCH,
    Calibration,
    InputAmax,
    KVAmax,
    Tally,
    check_calibrated,
    load_calibration_ids,
    open_bf16_model,
)
from nvfp4tool.export.gptq import GPTQError, gptq_quantize
from nvfp4tool.export.plan import ExportPlan
from nvfp4tool.families import hessian_group as hessian_key
from nvfp4tool.families import split_layer
from nvfp4tool.formats import FP8_GRANULARITY, NVFP4_QUANTS
from nvfp4tool.model.layerwise import layer_modules
from nvfp4tool.numerics import NVFP4Array, dense, dequantize_nvfp4, fake_quantize_fp8
from nvfp4tool.recipes.precision import GEMM_INPUT_DTYPE


class SpilledRecords:
    """NVFP4 records kept on disk in `folder` (packed and scales as .npy), their scalars in memory."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self._meta: dict[str, NVFP4Array] = {}  # module -> the record without its arrays

    def put(self, module: str, q: NVFP4Array) -> None:
        np.save(self._file(module, "packed"), np.asarray(q.packed))
        np.save(self._file(module, "scales"), np.asarray(q.scales).view(np.uint8))
        self._meta[module] = dataclasses.replace(q, packed=None, scales=None)

    def get(self, module: str) -> NVFP4Array:
        scales = np.load(self._file(module, "scales")).view(jnp.float8_e4m3fn)
        return dataclasses.replace(self._meta[module], packed=np.load(self._file(module, "packed")), scales=scales)

    def _file(self, module: str, role: str) -> str:
        return os.path.join(self.folder, f"{module}.{role}.npy")


@dataclasses.dataclass(frozen=True)
class GPTQResult:
    records: SpilledRecords  # quantized module -> its record (on disk)
    errors: dict[str, GPTQError]  # quantized module -> its errors
    calibration: Calibration | None = None  # what the reference stream measured; None: nothing was asked


def run_gptq(
    config: ModelConfig,
    source: Any,
    plan: ExportPlan,
    group_amax: dict[str, np.float32],
    data_path: str,
    *,
    spill_dir: str,
    samples: int,
    seq_len: int,
    tokenizer_dir: str | None,
    offload: str,
    method: str,
    block: str,
    damp: float,
    block_scales: str = "original",
    ids_SxL: np.ndarray | None = None,
    amax_names: Sequence[str] | None = None,
    kv_cache: bool = False,
) -> GPTQResult:
    """GPTQ records of every NVFP4 module of `plan` (see the module docstring); `ids_SxL`: the
    windows already read from `data_path` (`load_calibration_ids`), else read here. With
    `amax_names` (the linears whose input amax to measure; () for none) or `kv_cache`, the first
    pass also calibrates (`GPTQResult.calibration`, with the router counts of a MoE model)."""
    if ids_SxL is None:
        ids_SxL = load_calibration_ids(
            data_path, samples=samples, seq_len=seq_len, tokenizer_dir=tokenizer_dir, vocab_size=config.vocab_size
        )
    model = open_bf16_model(config, source, seq_len=ids_SxL.shape[1], offload=offload, what="GPTQ")
    rounded = tuple(m for m in plan.quantized if plan.quant_of(m) in NVFP4_QUANTS)  # by GPTQ (W4A4 / W4A16)
    representative: dict[str, str] = {}  # Hessian key -> the linear whose input is recorded
    for module in rounded:
        representative.setdefault(hessian_key(module), module)
    recorded = frozenset(name for i in range(config.num_layers) for name in layer_modules(representative.values(), i))
    hessians: dict[str, np.ndarray] = {}
    records, errors = SpilledRecords(spill_dir), {}
    calibrating = amax_names is not None or kv_cache
    tally = Tally(config, amax_names or (), kv_cache=kv_cache) if calibrating else None

    def add_hessian(module: str, xtx) -> None:
        key = hessian_key(module)
        hessians[key] = hessians[key] + np.asarray(xtx) if key in hessians else np.asarray(xtx, np.float32)

    def replace(layer: int) -> dict[str, np.ndarray]:
        new = {}
        in_layer = set(config.modules.in_layer(layer))
        for module in (m for m in plan.quantized if m in in_layer and m not in rounded):
            # a mixed plan's FP8 linear (per tensor or fp8-block): rounded to nearest as the export
            # writes it (quantizers.FP8, the same numerics and granularity; GPTQ's column updates are
            # NVFP4's here) and decoded, so later layers see it as served
            name = f"{module}.weight"
            granularity = FP8_GRANULARITY[plan.quant_of(module)]
            new[split_layer(name)[1]] = np.asarray(
                fake_quantize_fp8(source.get(name), granularity=granularity, dtype=GEMM_INPUT_DTYPE, name=name)
            )
        for module in (m for m in rounded if m in in_layer):
            h = hessians.get(hessian_key(module))
            if h is None:
                raise NVFP4ToolError(f"GPTQ: {module} was never called by the model")
            # an input zero on every token (diag H = sum of x^2 all 0) would round the weight to zeros
            check_calibrated(module, np.max(np.diagonal(h)), what="input")
            name = f"{module}.weight"
            q, error = gptq_quantize(
                source.get(name),
                h,
                method=method,
                block=block,
                damp=damp,
                global_amax=group_amax[plan.group_of(module)],
                name=name,
                block_scales=block_scales,
            )
            records.put(module, q)
            errors[module] = error
            new[split_layer(name)[1]] = np.asarray(dequantize_nvfp4(q, GEMM_INPUT_DTYPE))
        hessians.clear()
        return new

    # the second pass through a layer (quantized weights) only makes the next layer's inputs: the
    # same GEMMs, every expert on every token as in the first, no X^T X
    model.sequential(
        ids_SxL,
        BATCH,
        tap=_Hessians(recorded),
        replay=_Hessians(frozenset()),
        on_record=add_hessian,
        replace=replace,
        label="GPTQ",
        reference=InputAmax.of(config) if calibrating else None,
        kv_tap=KVAmax() if kv_cache else None,
        on_reference=None if tally is None else tally.record,
        all_experts=True,
    )
    return GPTQResult(records=records, errors=errors, calibration=None if tally is None else tally.result())


@dataclasses.dataclass(frozen=True)
class _Hessians:
    """Tap: the plain BF16 GEMM; the linears in `names` (block-program names) record X^T X (fp32)
    of their input. The pass runs every sparse MLP's experts on all tokens (`all_experts=True`)."""

    names: frozenset[str]

    def __call__(self, x, w_NxK, b_N, *, name, aux):
        y = dense(x, w_NxK, b_N, compute_dtype=GEMM_INPUT_DTYPE)
        return y, _xtx(x) if name in self.names else None


def _xtx(x) -> jax.Array:
    """X^T X (fp32, exact products: HIGHEST precision) of a linear's input, its tokens as rows."""
    x_TxK = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    return jnp.matmul(x_TxK.T, x_TxK, precision=jax.lax.Precision.HIGHEST)
