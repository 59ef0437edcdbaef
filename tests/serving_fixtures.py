"""Tiny serving checkpoints built straight from the reference sheet (section 5), for checker tests.

A 2-layer Llama (hidden 64, intermediate 128, 4 heads, 2 kv heads, head_dim 16, vocab 96) in each
format: ModelOpt NVFP4 (W4A4 and W4A16), compressed-tensors nvfp4-pack-quantized (W4A4 and
W4A16), ModelOpt FP8 and compressed-tensors float-quantized FP8. Bytes come from `nvfp4tool.numerics.quantize_nvfp4`
/ `quantize_fp8`
(fused groups q/k/v and gate/up quantized against their joint amax, one input amax per group);
files are written with `safetensors.numpy.save_file`; configs as the sheet spells them. lm_head,
embeddings and norms stay BF16 and lm_head is excluded.

    ckpt = build_checkpoint("modelopt", "nvfp4")   # a fresh, mutable copy each call
    ckpt.tensors["model.layers.0.self_attn.k_proj.weight_scale_2"] = np.array(2.0, np.float32)
    write_checkpoint(tmp_path / "ckpt", ckpt, shards=2)
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
from typing import Any

import ml_dtypes
import numpy as np

VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 96, 64, 128, 2, 4, 2, 16
NVFP4_RANGE = 6.0 * 448.0  # 2688: global decode scale = amax / 2688
FP8_MAX = 448.0
FORMATS = (
    ("modelopt", "nvfp4"),
    ("modelopt", "nvfp4-weight-only"),
    ("compressed-tensors", "nvfp4"),
    ("compressed-tensors", "nvfp4-weight-only"),
    ("modelopt", "fp8"),
    ("compressed-tensors", "fp8"),
)


@dataclasses.dataclass
class ServingCheckpoint:
    """Tensors (name -> numpy array, dtypes as stored) and the JSON files of one checkpoint."""

    tensors: dict[str, np.ndarray]
    config: dict[str, Any]
    hf_quant_config: dict[str, Any] | None


def linear_shapes() -> dict[str, tuple[int, int]]:
    """Linear module -> (N, K), in forward order (lm_head excluded)."""
    shapes = {}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj"] = (HEADS * HEAD_DIM, HIDDEN)
        shapes[p + "self_attn.k_proj"] = (KV_HEADS * HEAD_DIM, HIDDEN)
        shapes[p + "self_attn.v_proj"] = (KV_HEADS * HEAD_DIM, HIDDEN)
        shapes[p + "self_attn.o_proj"] = (HIDDEN, HEADS * HEAD_DIM)
        shapes[p + "mlp.gate_proj"] = (INTERMEDIATE, HIDDEN)
        shapes[p + "mlp.up_proj"] = (INTERMEDIATE, HIDDEN)
        shapes[p + "mlp.down_proj"] = (HIDDEN, INTERMEDIATE)
    return shapes


def build_checkpoint(fmt: str, quant: str) -> ServingCheckpoint:
    """A fresh copy of the tiny checkpoint in `fmt` ("modelopt" / "compressed-tensors") and
    `quant` ("nvfp4" / "nvfp4-weight-only" / "fp8")."""
    return copy.deepcopy(_build(fmt, quant))


def write_checkpoint(folder: str | os.PathLike, ckpt: ServingCheckpoint, *, shards: int = 1) -> str:
    """Write config.json (+ hf_quant_config.json) and the tensors, in `shards` files (an index
    with total_size when more than one). Returns the folder."""
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    from safetensors.numpy import save_file

    _write_json(os.path.join(folder, "config.json"), ckpt.config)
    if ckpt.hf_quant_config is not None:
        _write_json(os.path.join(folder, "hf_quant_config.json"), ckpt.hf_quant_config)
    names = list(ckpt.tensors)
    if shards == 1:
        save_file(ckpt.tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        return folder
    weight_map = {}
    for s, part in enumerate(np.array_split(np.arange(len(names)), shards)):
        shard = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file(
            {names[i]: ckpt.tensors[names[i]] for i in part}, os.path.join(folder, shard), metadata={"format": "pt"}
        )
        weight_map.update({names[i]: shard for i in part})
    total = sum(t.nbytes for t in ckpt.tensors.values())
    _write_json(
        os.path.join(folder, "model.safetensors.index.json"),
        {"metadata": {"total_size": total}, "weight_map": weight_map},
    )
    return folder


# ---------------------------------------------------------------------------------------- helpers


@functools.lru_cache(maxsize=None)
def _build(fmt: str, quant: str) -> ServingCheckpoint:
    rng = np.random.default_rng(1234)
    bf16 = ml_dtypes.bfloat16
    tensors: dict[str, np.ndarray] = {"model.embed_tokens.weight": rng.normal(0, 0.02, (VOCAB, HIDDEN)).astype(bf16)}
    weights = {m: rng.normal(0, 0.05, s).astype(np.float32) for m, s in linear_shapes().items()}
    # One weight amax and one input amax per fused group (q/k/v, gate/up), as serving engines need.
    groups = {m: _group(m) for m in weights}
    weight_amax = {
        g: max(float(np.abs(weights[m]).max()) for m in weights if groups[m] == g) for g in set(groups.values())
    }
    input_amax = {g: float(rng.uniform(2.0, 9.0)) for g in sorted(set(groups.values()))}
    for i in range(LAYERS):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{i}.{norm}.weight"] = rng.uniform(0.5, 1.5, HIDDEN).astype(bf16)
    for module, w in weights.items():
        amax, in_amax = weight_amax[groups[module]], input_amax[groups[module]]
        tensors.update(_quantized(fmt, quant, module, w, amax, in_amax))
    tensors["model.norm.weight"] = rng.uniform(0.5, 1.5, HIDDEN).astype(bf16)
    tensors["lm_head.weight"] = rng.normal(0, 0.02, (VOCAB, HIDDEN)).astype(bf16)
    hf_quant = _hf_quant_config(quant) if fmt == "modelopt" else None
    return ServingCheckpoint(tensors, _config(fmt, quant), hf_quant)


def _group(module: str) -> str:
    block, _, proj = module.rpartition(".")
    if proj in ("q_proj", "k_proj", "v_proj"):
        return block + ".qkv"
    if proj in ("gate_proj", "up_proj"):
        return block + ".gate_up"
    return module


def _quantized(
    fmt: str, quant: str, module: str, w: np.ndarray, amax: float, input_amax: float
) -> dict[str, np.ndarray]:
    from nvfp4tool.numerics import quantize_fp8, quantize_nvfp4

    if quant == "fp8":  # both layouts: decode scales (amax / 448), shape [] (ModelOpt) or [1]
        q = quantize_fp8(w, granularity="tensor", name=module)
        shape = () if fmt == "modelopt" else (1,)
        return {
            f"{module}.weight": np.asarray(q.data),
            f"{module}.weight_scale": np.asarray(q.scale, np.float32).reshape(shape),
            f"{module}.input_scale": _f32(input_amax / FP8_MAX).reshape(shape),
        }
    q = quantize_nvfp4(w, global_amax=np.float32(amax), name=module)
    packed, scales = np.asarray(q.packed), np.asarray(q.scales)
    assert packed.dtype == np.uint8 and scales.dtype == ml_dtypes.float8_e4m3fn
    with_input = quant == "nvfp4"
    if fmt == "modelopt":
        out = {
            f"{module}.weight": packed,
            f"{module}.weight_scale": scales,
            f"{module}.weight_scale_2": _f32(np.float32(amax) / np.float32(NVFP4_RANGE)),
        }
        if with_input:
            out[f"{module}.input_scale"] = _f32(np.float32(input_amax) / np.float32(NVFP4_RANGE))
        return out
    # compressed-tensors: reciprocal global scales, shape [1].
    out = {
        f"{module}.weight_packed": packed,
        f"{module}.weight_scale": scales,
        f"{module}.weight_global_scale": np.array([NVFP4_RANGE / amax], np.float32),
    }
    if with_input:
        out[f"{module}.input_global_scale"] = np.array([NVFP4_RANGE / input_amax], np.float32)
    return out


def _f32(value: float) -> np.ndarray:
    """A 0-d fp32 array (safetensors stores it with shape [])."""
    return np.array(value, np.float32)


def _config(fmt: str, quant: str) -> dict[str, Any]:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    if fmt == "modelopt":
        algo = {"nvfp4": "NVFP4", "nvfp4-weight-only": "W4A16_NVFP4", "fp8": "FP8"}[quant]
        config["quantization_config"] = {
            "quant_method": "modelopt",
            "quant_algo": algo,
            "ignore": ["lm_head"],
            "producer": {"name": "test", "version": "0"},
        }
        return config
    if quant == "fp8":
        weights = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}
        group = {"targets": ["Linear"], "weights": weights, "input_activations": dict(weights)}
    else:
        weights = {
            "num_bits": 4,
            "type": "float",
            "strategy": "tensor_group",
            "group_size": 16,
            "symmetric": True,
            "dynamic": False,
            "scale_dtype": "torch.float8_e4m3fn",
        }
        group = {"targets": ["Linear"], "weights": weights}
    if quant == "nvfp4":
        group["input_activations"] = dict(weights, dynamic="local", observer="static_minmax")
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized" if quant == "fp8" else "nvfp4-pack-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {"group_0": group},
    }
    return config


def _hf_quant_config(quant: str) -> dict[str, Any]:
    algo = {"nvfp4": "NVFP4", "nvfp4-weight-only": "W4A16_NVFP4", "fp8": "FP8"}[quant]
    quantization = {"quant_algo": algo, "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}
    if quant != "fp8":
        quantization["group_size"] = 16
    return {"producer": {"name": "test", "version": "0"}, "quantization": quantization}


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)


def write_export_record(
    folder: str | os.PathLike, ckpt: ServingCheckpoint, fmt: str, quant: str, *, source_name: str = "org/src"
) -> None:
    """A valid `nvfp4tool_export.json` for a single-file checkpoint written by `write_checkpoint`:
    every tensor with its sha256 (no decoded amax), as `nvfp4tool export` would record it."""
    import hashlib

    from nvfp4tool.records.export import ExportRecord, LayerErrorRecord, SourceRecord, TensorRecord, ToolRecord

    codes = {"bfloat16": "BF16", "float32": "F32", "uint8": "U8", "float8_e4m3fn": "F8_E4M3"}
    tensors = {
        n: TensorRecord(
            file="model.safetensors",
            dtype=codes[a.dtype.name],
            shape=tuple(a.shape),
            sha256=hashlib.sha256(np.ascontiguousarray(a).reshape(-1).view(np.uint8)).hexdigest(),
        )
        for n, a in ckpt.tensors.items()
    }
    ExportRecord(
        tool=ToolRecord(name="nvfp4tool", version="0.1.0"),
        source=SourceRecord(name=source_name, kind="hf", step=None, files={}),
        format=fmt,
        quant=quant,
        scale_search="rtn",
        weight_block="1d",
        recipe=None,
        precision_map={**{m: quant for m in linear_shapes()}, "lm_head": "bf16"},
        exclude_modules=("lm_head",),
        input_amax_origin="calibration",
        calibration=None,
        input_amax=None,
        layers={m: LayerErrorRecord(rel_l2=0.1) for m in linear_shapes()},
        files=("model.safetensors",),
        tensors=tensors,
    ).write(os.fspath(folder))
