"""FP8 block-scaled source checkpoints (DeepSeek-V3/R1, Qwen3-FP8): their config, pairing, dequantization.

`parse(quantization_config, where)` -> `FP8Block` (or one-line refusal); `pair(entries, fmt)` finds
each FP8 weight's `<weight>_scale_inv`; `dequantize_rows(values, scales, block)` is the one
dequantization: bf16(fp32(value) * fp32(its block's scale)). `converters.hf.HFFolderSource` reads
such a folder through these, one weight (in row chunks) at a time.
Design notes: docs/design/converters.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import ml_dtypes  # noqa: F401 (registers bfloat16 / float8 with numpy)
import numpy as np

from nvfp4tool.errors import NVFP4ToolError

QUANT_METHOD = "fp8"  # config.json quantization_config.quant_method of these checkpoints
SCALE_SUFFIX = "_scale_inv"  # `<name>.weight` is scaled by `<name>.weight_scale_inv`
WEIGHT_DTYPE = "float8_e4m3fn"  # fmt "e4m3": the only one the format (and transformers) defines
SCALE_DTYPE = "float32"  # DeepSeek's and Qwen3-FP8's scales; E8M0 / uint8 scale bytes (DeepSeek-V4) are refused


@dataclasses.dataclass(frozen=True)
class FP8Block:
    """What config.json's quantization_config says of an FP8 block-scaled checkpoint."""

    block: tuple[int, int]  # weight_block_size: rows x columns of weight sharing one scale
    fmt: str = "e4m3"
    activation_scheme: str = "dynamic"
    quant_method: str = QUANT_METHOD

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """The scale grid of a weight `[out, in]`: one scale per (possibly partial) block."""
        return math.ceil(shape[0] / self.block[0]), math.ceil(shape[1] / self.block[1])


def is_fp8_block_config(quantization_config: Any) -> bool:
    """Whether config.json's quantization_config claims this format (a source, not a serving export)."""
    return isinstance(quantization_config, Mapping) and quantization_config.get("quant_method") == QUANT_METHOD


def parse(qc: Any, where: str) -> FP8Block:
    """The `FP8Block` of config.json's quantization_config `qc`; NVFP4ToolError naming `where` (the
    file) and the key for anything this reader does not read exactly."""
    if not isinstance(qc, Mapping):
        raise NVFP4ToolError(f"{where}: quantization_config must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method != QUANT_METHOD:
        raise NVFP4ToolError(
            f"{where}: quantization_config.quant_method {method!r} is not a source format this tool reads "
            f"(supported: {QUANT_METHOD!r} with weight_block_size, DeepSeek's FP8 block-scaled checkpoints)"
        )
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise NVFP4ToolError(f"{where}: quantization_config.fmt {fmt!r} unsupported; supported: 'e4m3'")
    scheme = str(qc.get("activation_scheme", "dynamic")).lower()
    if scheme != "dynamic":
        raise NVFP4ToolError(
            f"{where}: quantization_config.activation_scheme {qc.get('activation_scheme')!r} unsupported; "
            "supported: 'dynamic' (static activation scales are not part of a BF16 model)"
        )
    # scale_fmt "ue8m0" (DeepSeek-V3.1) says the scales are powers of two; stored as float32 they
    # dequantize the same way, and scales stored as E8M0 / uint8 bytes are refused by `pair`.
    block = qc.get("weight_block_size")
    if block is None:
        raise NVFP4ToolError(
            f"{where}: quantization_config has no weight_block_size; only block-scaled FP8 "
            "(e.g. [128, 128]) is read, not per-tensor FP8"
        )
    if not (
        isinstance(block, (list, tuple))
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise NVFP4ToolError(
            f"{where}: quantization_config.weight_block_size {block!r} does not tile a weight; "
            "expected two positive integers [rows, columns], e.g. [128, 128]"
        )
    return FP8Block(block=(block[0], block[1]), fmt=fmt, activation_scheme=scheme)


def pair(codes: Mapping[str, tuple[str, tuple[int, ...]]], fmt: FP8Block, where: Mapping[str, str]) -> dict[str, str]:
    """{FP8 weight name: its scale's name} over a checkpoint's tensors (`codes`: name -> (numpy
    dtype name, shape); `where`: name -> its file, for messages). NVFP4ToolError naming the file and
    tensor for an FP8 weight without its scale, a scale without its weight, a scale that is not
    fp32, or a scale grid other than `fmt.scale_shape` of its weight."""
    pairs: dict[str, str] = {}
    for name, (dtype, shape) in codes.items():
        if name.endswith(SCALE_SUFFIX):
            weight = name[: -len(SCALE_SUFFIX)]
            if weight not in codes:
                raise NVFP4ToolError(f"{where[name]}: tensor {name!r} is a block scale but {weight!r} is missing")
            continue
        scale = name + SCALE_SUFFIX
        if dtype != WEIGHT_DTYPE:
            if scale in codes:
                raise NVFP4ToolError(
                    f"{where[scale]}: tensor {scale!r} scales {name!r}, which is {dtype}, not {WEIGHT_DTYPE}"
                )
            continue
        if scale not in codes:
            raise NVFP4ToolError(
                f"{where[name]}: tensor {name!r} is {WEIGHT_DTYPE} but its block scale {scale!r} is missing"
            )
        if len(shape) != 2:
            raise NVFP4ToolError(
                f"{where[name]}: tensor {name!r} has shape {list(shape)}; FP8 block-scaled weights are 2-D [out, in]"
            )
        scale_dtype, scale_shape = codes[scale]
        if scale_dtype != SCALE_DTYPE:
            raise NVFP4ToolError(f"{where[scale]}: tensor {scale!r} is {scale_dtype}; block scales must be float32")
        want = fmt.scale_shape(shape)
        if tuple(scale_shape) != want:
            raise NVFP4ToolError(
                f"{where[scale]}: tensor {scale!r} has shape {list(scale_shape)}, but weight_block_size "
                f"{list(fmt.block)} over {name!r} {list(shape)} needs {list(want)} (ceil(out/{fmt.block[0]}), "
                f"ceil(in/{fmt.block[1]}))"
            )
        pairs[name] = scale
    return pairs


def check_scales(scales: np.ndarray, label: str) -> None:
    """NVFP4ToolError naming `label` (file and tensor) unless every block scale is finite and >= 0."""
    bad = ~np.isfinite(scales) | (scales < 0)
    if bad.any():
        index = [int(i) for i in np.argwhere(bad)[0]]
        raise NVFP4ToolError(
            f"{label} has {int(bad.sum())} block scale(s) that are not finite and >= 0, "
            f"e.g. {float(scales[tuple(index)])} at block {index}"
        )


def dequantize_rows(values: np.ndarray, scales: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """bfloat16 rows of an FP8 weight: each value widened to fp32, times its block's fp32 scale (one
    fp32 product, round to nearest even), then rounded to bfloat16 (nearest even), as DeepSeek's
    `weight_dequant` and transformers' `Fp8Dequantize` do. `values` are whole rows starting on a
    block boundary; `scales` the scale rows covering them ([ceil(rows/b0), ceil(in/b1)])."""
    product = values.astype(np.float32)
    row_scales = np.repeat(scales, block[0], axis=0)[: len(values)]  # [rows, column blocks]: small
    for j in range(scales.shape[1]):  # one column block at a time: no scale array as large as the weight
        columns = product[:, j * block[1] : (j + 1) * block[1]]
        np.multiply(columns, row_scales[:, j : j + 1], out=columns)
    return product.astype(ml_dtypes.bfloat16)
