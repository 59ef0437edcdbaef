"""What a serving engine computes from an export folder, run by our JAX model.

    exported = load_export("out/model-nvfp4")              # either format, any --quant
    model = exported.model(dtype=jnp.float32)               # CausalLM with the dequantized weights
    logits = forward(model, ids, linear=exported.linear())  # W4A4: inputs fake-quantized too

All the math is numerics': weights of NVFP4 modules are decoded from the stored bytes with
`numerics.decode_nvfp4`, `e2m1(code) * fp32(block_scale) * S_dec` in fp32 with the stored global
decode scale (bit for bit `dequantize_nvfp4` of the exported record; tested); FP8 modules with
`numerics.decode_fp8`, `fp32(e4m3) * weight_scale`; everything else is the stored BF16.
Activations (W4A4): each quantized linear's input is fake-quantized to NVFP4 with 1x16 dynamic
block scales (RNE) against the static input global scale (global amax = 2688 * stored input
decode scale); FP8 W8A8: per tensor, clamp(x / input_scale) to E4M3 and back
(`fake_quantize_fp8(scale=)`, a true division). The GEMM is `numerics.dense`.
Weight-only exports leave the activations alone. The GEMM itself runs in fp32 (or the model's
compute dtype) on the dequantized values, which is what the emulation paths of vLLM and
transformers + compressed-tensors do.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from converters.hf import HFFolderSource
from converters.tensor_source import DictTensorSource
from nvfp4tool.config import ModelConfig
from nvfp4tool.model.linear import LinearFn
from nvfp4tool.numerics import (
    decode_fp8,
    decode_nvfp4,
    dense,
    fake_quantize_fp8,
    fake_quantize_nvfp4,
)
from nvfp4tool.numerics.constants import NVFP4_GLOBAL_RANGE


@dataclasses.dataclass
class ExportedModel:
    """An export folder read back: config, dequantized tensors, and per-module activation scales."""

    config: ModelConfig
    format: str  # "modelopt" | "compressed-tensors"
    quant: str  # "nvfp4" | "nvfp4-weight-only" | "fp8"
    tensors: dict[str, np.ndarray]  # HF names; quantized weights dequantized to fp32
    input_scales: dict[str, float]  # quantized module -> static input decode scale (W4A4 / FP8)
    quantized: tuple[str, ...]

    def model(self, dtype: jnp.dtype = jnp.float32, compute_dtype: jnp.dtype | None = None):
        """A CausalLM holding the dequantized weights (cast to `dtype`)."""
        from nvfp4tool.model.weights import model_from_tensors

        return model_from_tensors(self.config, DictTensorSource(self.tensors), dtype=dtype,
                                  compute_dtype=compute_dtype)

    def linear(self) -> LinearFn:
        """The LinearFn: activation fake-quantization of the quantized modules, then the GEMM."""
        return simulated_linear(self.quant, self.input_scales)


def load_export(folder: str) -> ExportedModel:
    """Read an export folder written by `nvfp4tool export` (or `convert-format`), in any layout
    `nvfp4tool.formats` declares: each quantized module's tensors are read by role with the
    folder's spec (decode scales whatever the stored convention)."""
    from nvfp4tool import formats

    spec = formats.describe(folder).spec
    decode_names = formats.get("modelopt", spec.quant)  # the names `_dequantize` reads
    source = HFFolderSource(folder, check_config=False)
    config = ModelConfig.from_hf_folder(folder)
    marker = spec.suffix("weight_global")
    quantized = [n.rpartition(".")[0] for n in source.names() if n.rpartition(".")[2] == marker]
    quantized_set = set(quantized)
    by_module: dict[str, dict[str, np.ndarray]] = {}
    tensors: dict[str, np.ndarray] = {}
    for name in source.names():
        module = name.rpartition(".")[0]
        if module in quantized_set:
            by_module.setdefault(module, {})[name] = source.get(name)
        else:
            tensors[name] = source.get(name)
    input_scales: dict[str, float] = {}
    for module, group in by_module.items():
        roles = spec.to_roles(module, group)
        tensors[f"{module}.weight"] = np.asarray(_dequantize(module, decode_names.from_roles(module, roles),
                                                             spec.quant))
        if "input_global" in roles:
            input_scales[module] = float(roles["input_global"])
    return ExportedModel(config=config, format=spec.format, quant=spec.quant, tensors=tensors,
                         input_scales=input_scales, quantized=tuple(quantized))


def simulated_linear(quant: str, input_scales: dict[str, float]) -> LinearFn:
    """LinearFn for an export: inputs of modules in `input_scales` fake-quantized (static scale)."""
    scales = dict(input_scales)

    def linear(x, w_NxK, b_N, *, name):
        if name in scales:
            x = _fake_quantize_input(x, scales[name], quant, name)
        return dense(x, w_NxK, b_N)

    return linear


# ------------------------------------------------------------------------------------------
# helpers


def _dequantize(module: str, group: dict[str, np.ndarray], quant: str) -> jax.Array:
    weight = group[f"{module}.weight"]
    if quant == "fp8":
        return decode_fp8(weight, np.float32(group[f"{module}.weight_scale"]))
    return decode_nvfp4(weight, group[f"{module}.weight_scale"],
                        np.float32(group[f"{module}.weight_scale_2"]), name=f"{module}.weight")


def _fake_quantize_input(x: jax.Array, input_scale: float, quant: str, module: str) -> jax.Array:
    name = f"input of {module}"  # errors name the activation (and its static scale's problem)
    if quant == "fp8":
        return fake_quantize_fp8(x, fmt="e4m3", scale=np.float32(input_scale), dtype=x.dtype,
                                 name=name)
    global_amax = np.float32(np.float32(input_scale) * np.float32(NVFP4_GLOBAL_RANGE))
    return fake_quantize_nvfp4(x, axis=-1, global_amax=global_amax, dtype=x.dtype, name=name)
