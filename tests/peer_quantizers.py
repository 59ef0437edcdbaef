"""Run each peer library's own NVFP4 quantizer on a torch tensor with a given global amax.

One entry per peer (compressed-tensors, torchao, ModelOpt), each calling the peer's public
quantize + pack path on CPU and returning one `PeerNVFP4` record: its packed bytes, its E4M3
block-scale bytes, its global scale in its own convention, its own dequantized values, and the
fp32 values it rounded to E2M1 (x over the block decode scale, computed the way that peer does).
Peers are imported lazily: this module imports without them.

Global-scale conventions (sheet section 5), each translated from the same fp32 amax:
* compressed-tensors `weight_global_scale` = 2688 / amax (the encode scale, our S_enc).
* ModelOpt `weights_scaling_factor_2` (`weight_scale_2`) = amax / 2688 (a decode scale).
* torchao `per_tensor_scale` = amax / 2688 (`per_tensor_amax_to_scale`, a decode scale).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

NVFP4_GLOBAL_RANGE = 2688.0  # 6 * 448: E2M1 max times E4M3 max
BLOCK = 16  # elements per block scale along K

PEERS = ("compressed-tensors", "torchao", "modelopt")
PEER_MODULES = {"compressed-tensors": "compressed_tensors", "torchao": "torchao", "modelopt": "modelopt"}


@dataclasses.dataclass(frozen=True)
class PeerNVFP4:
    """What one peer wrote for a [M, K] tensor, as numpy arrays."""

    peer: str
    packed: np.ndarray  # uint8 [M, K/2], element 2i in the low nibble
    scale_bytes: np.ndarray  # uint8 [M, K/16], the float8_e4m3fn bit patterns
    global_scale: float  # fp32, in the peer's own convention (see module docstring)
    dequantized: np.ndarray  # [M, K] as float32: the peer's own decode of its bytes ...
    dequantized_dtype: str  # ... which the peer computes in this dtype ("bfloat16"/"float32")
    scaled: np.ndarray  # float32 [M, K], x / block decode scale as the peer computes it


def quantize_with_peer(peer: str, x_MxK, global_amax: float) -> PeerNVFP4:
    """Quantize torch tensor `x_MxK` (fp32 or bf16, CPU) with `peer`'s own NVFP4 code.

    `global_amax` is the fp32 amax the peer's global scale is derived from (the same number our
    `quantize_nvfp4(..., global_amax=...)` takes).
    """
    return _QUANTIZERS[peer](x_MxK, np.float32(global_amax))


def codes_of(packed: np.ndarray) -> np.ndarray:
    """uint8 bytes [..., K/2] -> 4-bit codes [..., K], low nibble first."""
    packed = np.asarray(packed, np.uint8)
    return np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


def ct_generate_gparam(amax: np.ndarray) -> np.ndarray:
    """compressed-tensors' own global scale for each fp32 amax (`generate_gparam`), as fp32."""
    import torch
    from compressed_tensors.quantization.utils.helpers import generate_gparam

    amax_t = torch.from_numpy(np.asarray(amax, np.float32))
    return np.stack([generate_gparam(-a, a).numpy()[0] for a in amax_t])


# ------------------------------------------------------------------------------------------
# helpers: one per peer, each the peer's own public entry points


def _compressed_tensors(x_MxK, global_amax: np.float32) -> PeerNVFP4:
    """compressed-tensors 0.20 `nvfp4-pack-quantized`: calculate_qparams + compress/decompress.

    Scales: `calculate_qparams(block_min, block_max, args, global_scale)`, the function
    llm-compressor's observers call: (bamax / 6) * global_scale, rounded to E4M3, 0 -> 0.125.
    Codes: `NVFP4PackedCompressor.compress` -> `quantize_and_pack_fp4` (CPU: `quantize`, which
    divides x by (scale / global_scale), then `pack_fp4_to_uint8`).
    """
    import torch
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    # 2688 / amax as a tensor-by-tensor division: exactly our S_enc. (CT's own generate_gparam
    # computes 2688 * (1 / amax), see `ct_generate_gparam`.)
    global_scale = torch.tensor([NVFP4_GLOBAL_RANGE], dtype=torch.float32) / torch.tensor(
        [global_amax], dtype=torch.float32
    )
    x_blocks = x_MxK.float().reshape(x_MxK.shape[0], -1, BLOCK)
    scale, _ = calculate_qparams(x_blocks.amin(-1), x_blocks.amax(-1), scheme.weights, global_scale=global_scale)
    state = {"weight": x_MxK, "weight_scale": scale, "weight_global_scale": global_scale}
    compressed = NVFP4PackedCompressor.compress(state, scheme)
    decompressed = NVFP4PackedCompressor.decompress(compressed, scheme)
    # forward_helpers._quantize: scale = scale / global_scale; scaled = x / scale (fp32).
    block_decode = (scale.float() / global_scale).unsqueeze(-1)
    scaled = (x_blocks / block_decode).reshape(x_MxK.shape)
    return PeerNVFP4(
        peer="compressed-tensors",
        packed=compressed["weight_packed"].numpy(),
        scale_bytes=compressed["weight_scale"].view(torch.uint8).numpy(),
        global_scale=float(global_scale.item()),
        dequantized=decompressed["weight"].float().numpy(),  # CT decompresses to bf16
        dequantized_dtype="bfloat16",
        scaled=scaled.numpy(),
    )


def _torchao(x_MxK, global_amax: np.float32) -> PeerNVFP4:
    """torchao 0.18 `NVFP4Tensor.to_nvfp4(x, per_tensor_scale=amax / 2688)` (unswizzled).

    Scales: (bamax / 6) / per_tensor_scale, clamped to [2^-6, 448], rounded to E4M3.
    Codes: x * ((1 / per_tensor_scale) / scale), RNE to E2M1 (`nvfp4_quantize`).
    """
    import torch
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    per_tensor_scale = per_tensor_amax_to_scale(torch.tensor(global_amax, dtype=torch.float32))
    nvfp4 = NVFP4Tensor.to_nvfp4(x_MxK.contiguous(), per_tensor_scale=per_tensor_scale)
    scale_fp32 = nvfp4.scale.float().unsqueeze(-1)
    x_blocks = x_MxK.float().reshape(x_MxK.shape[0], -1, BLOCK)
    # nvfp4_quantize: reciprocal_scale = (1.0 / per_tensor_scale) / scale; x * reciprocal_scale.
    scaled = (x_blocks * ((1.0 / per_tensor_scale) / scale_fp32)).reshape(x_MxK.shape)
    return PeerNVFP4(
        peer="torchao",
        packed=nvfp4.qdata.view(torch.uint8).numpy(),
        scale_bytes=nvfp4.scale.view(torch.uint8).numpy(),
        global_scale=float(per_tensor_scale.item()),
        dequantized=nvfp4.dequantize(torch.float32).numpy(),
        dequantized_dtype="float32",
        scaled=scaled.numpy(),
    )


def _modelopt(x_MxK, global_amax: np.float32) -> PeerNVFP4:
    """ModelOpt 0.47 `NVFP4QTensor.quantize(x, 16, weights_scaling_factor_2=amax / 2688)`.

    Scales: bamax / (6 * scale_2), 0 -> 1.0, clamped to [2^-9, 448], rounded to E4M3.
    Codes: x / (scale * scale_2), rounded by `_cast_fp4`. The fp32 values it rounds come from
    the same call with `keep_high_precision=True` and the scales fixed.
    """
    import torch
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    scale_2 = torch.tensor(global_amax, dtype=torch.float32) / NVFP4_GLOBAL_RANGE
    qtensor, scale, _ = NVFP4QTensor.quantize(x_MxK, BLOCK, weights_scaling_factor_2=scale_2)
    scaled = NVFP4QTensor.quantize(
        x_MxK, BLOCK, weights_scaling_factor=scale, weights_scaling_factor_2=scale_2, keep_high_precision=True
    )
    dequantized = qtensor.dequantize(dtype=torch.float32, scale=scale, double_scale=scale_2, block_sizes={-1: BLOCK})
    return PeerNVFP4(
        peer="modelopt",
        packed=qtensor._quantized_data.numpy(),
        scale_bytes=scale.view(torch.uint8).numpy(),
        global_scale=float(scale_2.item()),
        dequantized=dequantized.numpy(),
        dequantized_dtype="float32",
        scaled=scaled.float().numpy(),
    )


_QUANTIZERS: dict[str, Callable[..., PeerNVFP4]] = {
    "compressed-tensors": _compressed_tensors,
    "torchao": _torchao,
    "modelopt": _modelopt,
}
