"""The Llama family group: llama (Llama 2 / 3 / 3.1 / 3.2), mistral, qwen2 (Qwen2 / 2.5), qwen3 (dense).

Every decoder layer is "attention+mlp": `input_layernorm` -> `self_attn` (q/k/v/o_proj, Qwen3's
per-head `q_norm` / `k_norm`) -> `post_attention_layernorm` -> `mlp` (gate/up/down_proj SwiGLU).
What differs per model type is how config.json spells the attention options:
  llama   `attention_bias` puts a bias on q/k/v AND o_proj; `mlp_bias` written false.
  mistral no attention bias; `sliding_window` (every layer, as HF's MistralModel applies it).
  qwen2   q/k/v always biased, o_proj never; full attention in every layer only.
  qwen3   per-head q/k RMSNorm (`qk_norm`); `attention_bias` on all four; full attention only.
The blocks are `model/decoder.py`'s `DecoderBlock` (Attention + MLP).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import Any

from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.families.base import (
    ATTENTION,
    ATTENTION_PROJECTIONS,
    INPUT_NORM,
    POST_ATTENTION_NORM,
    SWIGLU,
    Family,
    LayerAttention,
    ModelConfig,
    Tensor,
    layer_prefix,
    preset_shape,
    projection_tensors,
)
from nvfp4tool.families.hf_values import flag, integer
from nvfp4tool.families.maxtext import NamedModel, Rule, decoder_rules, dense_mlp_rules


class Decoder(Family):
    """A pre-norm attention + SwiGLU decoder; the switches say how config.json spells its options."""

    blocks_module = "nvfp4tool.model.decoder"

    def __init__(
        self,
        model_type: str,
        architecture: str,
        *,
        bias: str,
        qk_norm: bool,
        window: str,
        maxtext: str | None,
        presets: Mapping[str, Mapping[str, Any]] = types.MappingProxyType({}),
        maxtext_models: Mapping[str, NamedModel] = types.MappingProxyType({}),
        maxtext_rope_layout: str | None = None,
    ) -> None:
        """`maxtext`: MaxText's decoder for the family takes the query kernel "prescaled" by
        1/sqrt(head_dim) (its attention uses scale 1: Llama, Mistral, Mixtral) or "unscaled" (it
        scales queries itself: Qwen3-MoE); None: no MaxText layout. `presets`: its training sizes;
        `maxtext_models`, `maxtext_rope_layout`: its MaxText model names, the RoPE layout its
        MaxText decoder fixes (`Family`)."""
        self.model_type, self.architecture = model_type, architecture
        self.presets = types.MappingProxyType(dict(presets))
        self.maxtext_models = types.MappingProxyType(dict(maxtext_models))
        self.maxtext_rope_layout = maxtext_rope_layout
        self.bias = bias  # "all": attention_bias on q/k/v/o | "qkv": always q/k/v, never o | "none"
        self.qk_norm = qk_norm
        self.window = window  # "sliding": sliding_window key | "full": full attention only | "none"
        self.maxtext_rules = (
            None
            if maxtext is None
            else (decoder_rules(query_scale=maxtext == "prescaled", qk_norm=qk_norm) + self.maxtext_mlp_rules())
        )
        self.modeled_keys = frozenset(
            {"attention_bias", "sliding_window", "use_sliding_window", "max_window_layers", "layer_types", "mlp_bias"}
        )

    # --------------------------------------------------------------------------- config.json

    def parse(self, hf: Mapping[str, Any], source: str) -> dict[str, Any]:
        if hf.get("mlp_bias"):
            raise NVFP4ToolError(f"{source}: mlp_bias=true unsupported (no Llama-family release uses it)")
        if self.window == "full" and (
            hf.get("use_sliding_window") or any(t != "full_attention" for t in hf.get("layer_types") or ())
        ):
            raise NVFP4ToolError(
                f"{source}: {self.model_type} per-layer sliding-window attention "
                f"(use_sliding_window/layer_types) is unsupported; supported: "
                f"full attention in every layer"
            )
        attention_bias = flag(hf, "attention_bias")
        return {
            "attention_bias": True if self.bias == "qkv" else attention_bias,
            "o_proj_bias": attention_bias if self.bias == "all" else False,
            "qk_norm": self.qk_norm,
            "sliding_window": integer(hf, "sliding_window", None) if self.window == "sliding" else None,
        }

    def maxtext_mlp_rules(self) -> tuple[Rule, ...]:
        return dense_mlp_rules()

    def emit(self, config: ModelConfig, hf: dict[str, Any]) -> None:
        if self.bias == "all":
            hf["attention_bias"] = config.attention_bias
        if self.model_type == "llama":
            hf["mlp_bias"] = False
        if self.window == "sliding":
            hf["sliding_window"] = config.sliding_window
        self.emit_mlp(config, hf)
        if self.window == "full":
            hf["use_sliding_window"] = False
            hf["sliding_window"] = None
            hf["layer_types"] = ["full_attention"] * config.num_layers

    def emit_mlp(self, config: ModelConfig, hf: dict[str, Any]) -> None:
        """The MLP's keys (none for a dense SwiGLU: intermediate_size is common)."""

    def problems(self, config: ModelConfig) -> list[str]:
        problems = []
        if config.qk_norm != self.qk_norm:
            problems.append("qk_norm is on exactly for qwen3 and qwen3_moe")
        if self.bias == "qkv" and not (config.attention_bias and not config.o_proj_bias):
            problems.append(f"{self.model_type} has q/k/v bias and no o_proj bias")
        if self.bias == "none" and (config.attention_bias or config.o_proj_bias):
            problems.append(f"{self.model_type} has no attention bias")
        if self.bias == "all" and config.attention_bias != config.o_proj_bias:
            problems.append(f"{self.model_type} attention_bias puts a bias on q/k/v and o_proj together")
        if config.sliding_window is not None and self.window != "sliding":
            problems.append("sliding_window is supported for mistral and mixtral only")
        return problems + self.mlp_problems(config)

    def maxtext_refusal(self, config: ModelConfig) -> str | None:
        """MaxText's decoders of the group have no attention biases."""
        if config.attention_bias or config.o_proj_bias:
            return (
                f"the MaxText converter supports models without attention biases; this {self.model_type} model has them"
            )
        return None

    def mlp_problems(self, config: ModelConfig) -> list[str]:
        return [] if config.family_config is None else ["mixture-of-experts fields are for qwen3_moe and mixtral only"]

    def layer_attention(self, config: ModelConfig, layer: int) -> LayerAttention:
        """Mistral / Mixtral ("sliding"): `sliding_window` in every layer, as HF's MistralModel
        applies it; Qwen2 / Qwen3 ("full"): full attention in every layer (their per-layer windows,
        use_sliding_window / max_window_layers / layer_types, are refused by `parse`); Llama: none."""
        return dataclasses.replace(
            super().layer_attention(config, layer), window=config.sliding_window if self.window == "sliding" else None
        )

    # ----------------------------------------------------------------------------- tensors

    def layer_tensors(self, config: ModelConfig, layer: int) -> list[Tensor]:
        E, D = config.hidden_size, config.head_dim
        q_out, kv_out = config.num_heads * D, config.num_kv_heads * D
        p = layer_prefix(layer)
        attention = f"{p}.{ATTENTION}"
        qkv_bias = config.attention_bias
        tensors = [Tensor(f"{p}.{INPUT_NORM}.weight", (E,))]
        tensors += projection_tensors(
            attention, ATTENTION_PROJECTIONS[:3], ((q_out, E), (kv_out, E), (kv_out, E)), (qkv_bias,) * 3
        )
        tensors += projection_tensors(attention, ATTENTION_PROJECTIONS[3:], ((E, q_out),), (config.o_proj_bias,))
        if config.qk_norm:
            tensors += [Tensor(f"{attention}.q_norm.weight", (D,)), Tensor(f"{attention}.k_norm.weight", (D,))]
        tensors.append(Tensor(f"{p}.{POST_ATTENTION_NORM}.weight", (E,)))
        return tensors + self.mlp_tensors(config, layer)

    def mlp_tensors(self, config: ModelConfig, layer: int) -> list[Tensor]:
        E, F = config.hidden_size, config.intermediate_size
        return projection_tensors(self.mlp_module(config, layer), SWIGLU, ((F, E), (F, E), (E, F)))


def llama3_preset(shape: str, **fields: Any) -> dict[str, Any]:
    """A training preset of Llama 3's shape at the named size (`base.PRESET_SHAPES`): GQA, SwiGLU,
    RoPE base 500k without Llama 3.1's long-context scaling; `fields` over it."""
    return preset_shape(shape, rope_theta=500000.0, **fields)


# `1b` has Llama-3.2-1B's dimensions and tied embeddings
_LLAMA_PRESETS = {
    name: llama3_preset(name, tie_word_embeddings=name == "1b") for name in ("tiny", "small", "100m", "1b")
}

# ------------------------------------------------------------------------- MaxText model names
# (numbers: docs/design/converters.md, `converters/maxtext_models.py`)
_LLAMA2 = dict(
    vocab_size=32000,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=4096,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
_LLAMA3 = dict(
    vocab_size=128256,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=8192,
    bos_token_id=128000,
    eos_token_id=128001,
    tie_word_embeddings=False,
)


def _llama3_scaling(factor: float) -> dict[str, Any]:
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


_LLAMA31 = dict(_LLAMA3, max_position_embeddings=131072, rope_scaling=_llama3_scaling(8.0))
_LLAMA32 = dict(_LLAMA31, tie_word_embeddings=True, rope_scaling=_llama3_scaling(32.0))


def _llama(shape: tuple[int, int, int, int, int, int], base: dict[str, Any]) -> dict[str, Any]:
    """config.json of a Llama of (hidden, heads, kv heads, layers, mlp, head_dim) over `base`."""
    hidden, heads, kv_heads, layers, mlp, head_dim = shape
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "num_hidden_layers": layers,
        "intermediate_size": mlp,
        "head_dim": head_dim,
        "torch_dtype": "bfloat16",
        **base,
    }


_LLAMA_MAXTEXT = {
    "llama2-7b": NamedModel(_llama((4096, 32, 32, 32, 11008, 128), _LLAMA2)),
    "llama2-13b": NamedModel(_llama((5120, 40, 40, 40, 13824, 128), _LLAMA2)),
    "llama3-8b": NamedModel(_llama((4096, 32, 8, 32, 14336, 128), _LLAMA3)),
    "llama3.1-8b": NamedModel(_llama((4096, 32, 8, 32, 14336, 128), _LLAMA31), rope_layout="interleaved"),
    "llama3.1-70b": NamedModel(_llama((8192, 64, 8, 80, 28672, 128), _LLAMA31), rope_layout="interleaved"),
    "llama3.2-1b": NamedModel(_llama((2048, 32, 8, 16, 8192, 64), _LLAMA32)),
    "llama3.2-3b": NamedModel(_llama((3072, 24, 8, 28, 8192, 128), _LLAMA32)),
}
_MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "hidden_act": "silu",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "intermediate_size": 14336,
    "head_dim": 128,
    "vocab_size": 32000,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 32768,
    "sliding_window": 4096,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

FAMILIES = (
    Decoder(
        "llama",
        "LlamaForCausalLM",
        bias="all",
        qk_norm=False,
        window="none",
        maxtext="prescaled",
        presets=_LLAMA_PRESETS,
        maxtext_models=_LLAMA_MAXTEXT,
    ),
    Decoder(
        "mistral",
        "MistralForCausalLM",
        bias="none",
        qk_norm=False,
        window="sliding",
        maxtext="prescaled",
        maxtext_models={"mistral-7b": NamedModel(_MISTRAL_7B)},
    ),
    Decoder("qwen2", "Qwen2ForCausalLM", bias="qkv", qk_norm=False, window="full", maxtext=None),
    Decoder("qwen3", "Qwen3ForCausalLM", bias="all", qk_norm=True, window="full", maxtext=None),
)
