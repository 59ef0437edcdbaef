"""Gemma 3's text decoder (`gemma3_text`, `Gemma3ForCausalLM`): config.json, tensors, layers.

Local layers attend within `sliding_window` at their own RoPE base, global layers to every earlier
key at theirs (`layer_types` / `sliding_window_pattern`); q/k RMSNorm, (1 + w) norms in fp32 before
and after attention and the MLP, a GeGLU MLP, scores scaled by query_pre_attn_scalar^-0.5, the
embedding scaled by sqrt(hidden), tied embeddings by default. Its blocks: `model/gemma3.py`; its
MaxText layout (MaxText's `gemma3` decoder, scanned in blocks of 6): docs/design/maxtext-layout.md.
Design notes: docs/design/families.md.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Mapping
from typing import Any

from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.families.base import (
    ATTENTION,
    ATTENTION_PROJECTIONS,
    EMBEDDING,
    FINAL_NORM,
    INPUT_NORM,
    POST_ATTENTION_NORM,
    SWIGLU,
    Family,
    Fold,
    LayerAttention,
    ModelConfig,
    Tensor,
    layer_prefix,
    preset_shape,
    projection_tensors,
)
from nvfp4tool.families.hf_values import flag, integer, number
from nvfp4tool.families.maxtext import NamedModel, Rule, dense_mlp_rules
from nvfp4tool.families.rope_scaling import rope_scaling_from_hf

SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer types
PRE_FEEDFORWARD_NORM = "pre_feedforward_layernorm"  # the norm before the MLP ...
POST_FEEDFORWARD_NORM = "post_feedforward_layernorm"  # ... and after it (post_attention_layernorm: after attention)
ACTIVATION = "gelu_pytorch_tanh"  # config.json's hidden_activation: GeGLU
_DEFAULT_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}  # Gemma3TextConfig's defaults
_DEFAULT_PATTERN = 6  # every 6th layer global (Gemma3TextConfig's sliding_window_pattern)
_REFUSED = ("final_logit_softcapping", "attn_logit_softcapping")  # null in every Gemma 3 release
MAXTEXT_PATTERN = 6  # MaxText's gemma3 decoder: layer i is global iff i % 6 == 5, scanned in blocks of 6


def _maxtext_rules() -> tuple[Rule, ...]:
    """MaxText's gemma3 layout (maxtext utils/param_mapping.py GEMMA3_MAXTEXT_TO_HF_PARAM_MAPPING /
    _HOOK_FN; docs/design/maxtext-layout.md): every norm stored as 1 + w, the embedding times
    bf16(sqrt(hidden)), q/k/v/o reshaped per head and unscaled (the attention applies
    query_pre_attn_scalar), no lm_head (logits_via_embedding)."""
    p = layer_prefix("{i}")
    a = f"{p}.{ATTENTION}"
    norms = (
        (f"{p}.{INPUT_NORM}", "pre_self_attention_norm"),
        (f"{p}.{POST_ATTENTION_NORM}", "post_self_attention_norm"),
        (f"{a}.q_norm", "self_attention/query_norm"),
        (f"{a}.k_norm", "self_attention/key_norm"),
        (f"{p}.{PRE_FEEDFORWARD_NORM}", "pre_ffw_norm"),
        (f"{p}.{POST_FEEDFORWARD_NORM}", "post_ffw_norm"),
    )
    return (
        Rule(f"{EMBEDDING}.weight", "token_embedder/embedding", "identity", embedding_scale=True),
        Rule(f"{FINAL_NORM}.weight", "decoder/decoder_norm/scale", "identity", unit_offset=True),
        *(Rule(f"{hf}.weight", f"{mt}/scale", "identity", unit_offset=True) for hf, mt in norms),
        Rule(f"{a}.q_proj.weight", "self_attention/query/kernel", "heads_in", rope=True),
        Rule(f"{a}.k_proj.weight", "self_attention/key/kernel", "heads_in", rope=True),
        Rule(f"{a}.v_proj.weight", "self_attention/value/kernel", "heads_in"),
        Rule(f"{a}.o_proj.weight", "self_attention/out/kernel", "heads_out"),
        *dense_mlp_rules(),
    )


def _maxtext_model(layers: int, hidden: int, mlp: int, heads: int, kv_heads: int, head_dim: int, scalar: int):
    """A MaxText gemma3 model name's text config.json: the geometry of MaxText's
    configs/models/gemma3-*.yml, the rest as Google's gemma-3 text configs (vocabulary: MaxText's
    262144; RoPE: 10k local, 1M global with linear scaling 8)."""
    return NamedModel(
        {
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            "hidden_activation": ACTIVATION,
            "hidden_size": hidden,
            "intermediate_size": mlp,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "query_pre_attn_scalar": scalar,
            "sliding_window": 1024,
            "sliding_window_pattern": MAXTEXT_PATTERN,
            "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 10_000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "vocab_size": 262_144,
            "max_position_embeddings": 131_072,
            "rms_norm_eps": 1e-6,
            "attention_bias": False,
            "bos_token_id": 2,
            "eos_token_id": 1,
            "pad_token_id": 0,
            "tie_word_embeddings": True,
            "torch_dtype": "bfloat16",
        },
        rope_layout="half",
    )


@dataclasses.dataclass(frozen=True)
class Gemma3Fields:
    """Gemma 3's own config fields (`ModelConfig.family_config`)."""

    layer_types: tuple[str, ...]  # each layer's SLIDING or FULL
    rope: tuple[tuple[str, float, Any], ...]  # (layer type, RoPE base, scaling record or None) per type
    query_pre_attn_scalar: float = 256.0  # the scores are scaled by its -0.5 power
    # how the source spelled the layer types: "layer_types", or "sliding_window_pattern" (also written back)
    sliding_window_pattern: int | None = dataclasses.field(default=None, compare=False)

    def rope_of(self, layer_type: str) -> tuple[float, Any]:
        return next((theta, scaling) for t, theta, scaling in self.rope if t == layer_type)


def _tiny_preset() -> dict[str, Any]:
    """`tiny-gemma3`: the tiny size as Gemma 3 (3 local layers of window 16 : 1 global, local RoPE
    base 10k, global 1M, query_pre_attn_scalar = head_dim, tied embeddings)."""
    fields = preset_shape("tiny", tie_word_embeddings=True, qk_norm=True, sliding_window=16, rms_norm_eps=1e-6)
    return dict(
        fields,
        family_config=Gemma3Fields(
            layer_types=(SLIDING, SLIDING, SLIDING, FULL),
            rope=((FULL, _DEFAULT_THETA[FULL], None), (SLIDING, _DEFAULT_THETA[SLIDING], None)),
            query_pre_attn_scalar=float(fields["head_dim"]),
        ),
    )


class Gemma3(Family):
    """`gemma3_text` (see the module docstring)."""

    model_type = "gemma3_text"
    architecture = "Gemma3ForCausalLM"
    blocks_module = "nvfp4tool.model.gemma3"
    presets = types.MappingProxyType({"tiny-gemma3": _tiny_preset()})
    positional = "family"  # per layer type: rope_parameters, or rope_theta + rope_local_base_freq + rope_scaling
    norm_unit_offset = True
    may_be_zero = ("*norm.weight",)  # a (1 + w) norm's weight is zero at identity (every norm at init)
    activation = ACTIVATION
    tie_word_embeddings_default = True
    maxtext_rules = _maxtext_rules()
    maxtext_rope_layout = "half"  # MaxText's gemma3 attention: RotaryEmbedding, q/k rows not permuted
    maxtext_scan_block = MAXTEXT_PATTERN
    maxtext_models = types.MappingProxyType(
        {
            "gemma3-4b": _maxtext_model(34, 2560, 10240, 8, 4, 256, 256),
            "gemma3-12b": _maxtext_model(48, 3840, 15360, 16, 8, 256, 256),
            "gemma3-27b": _maxtext_model(62, 5376, 21504, 32, 16, 128, 168),
        }
    )
    common_keys_not_modeled = frozenset({"hidden_act"})  # Gemma spells it hidden_activation
    modeled_keys = frozenset(
        {
            "hidden_activation",
            "attention_bias",
            "sliding_window",
            "sliding_window_pattern",
            "layer_types",
            "rope_local_base_freq",
            "query_pre_attn_scalar",
            "use_bidirectional_attention",
            "mlp_bias",
            *_REFUSED,
        }
    )

    # --------------------------------------------------------------------------- config.json

    def parse(self, hf: Mapping[str, Any], source: str) -> dict[str, Any]:
        for key in _REFUSED:
            if hf.get(key) is not None:
                raise NVFP4ToolError(
                    f"{source}: {key}={hf[key]!r} unsupported for gemma3_text; supported: null (as every Gemma 3)"
                )
        if flag(hf, "use_bidirectional_attention"):
            raise NVFP4ToolError(f"{source}: use_bidirectional_attention=true unsupported; supported: causal")
        if flag(hf, "mlp_bias"):
            raise NVFP4ToolError(f"{source}: mlp_bias=true unsupported for gemma3_text")
        for key in ("hidden_activation", "hidden_act"):
            if (hf.get(key) or ACTIVATION) != ACTIVATION:
                # MaxText's to_huggingface writes "gelu" (its flax gelu, the tanh form), which
                # transformers reads as the exact erf GELU: refused, as transformers would differ
                hint = " (MaxText writes 'gelu' for the tanh GELU: set it to gelu_pytorch_tanh)"
                hint = hint if hf[key] == "gelu" else ""
                raise NVFP4ToolError(
                    f"{source}: {key} {hf[key]!r} unsupported for gemma3_text; supported: {ACTIVATION}{hint}"
                )
        num_layers = integer(hf, "num_hidden_layers")
        pattern = integer(hf, "sliding_window_pattern", None)
        layer_types = hf.get("layer_types")
        if layer_types is None:
            step = _DEFAULT_PATTERN if pattern is None else pattern
            if step <= 0:
                raise NVFP4ToolError(f"{source}: sliding_window_pattern must be > 0, got {step}")
            layer_types = [SLIDING if (i + 1) % step else FULL for i in range(num_layers)]
        if not isinstance(layer_types, list) or any(t not in (SLIDING, FULL) for t in layer_types):
            raise NVFP4ToolError(f"{source}: layer_types must be a list of {SLIDING!r} / {FULL!r}, got {layer_types!r}")
        attention_bias = flag(hf, "attention_bias")
        return {
            "attention_bias": attention_bias,
            "o_proj_bias": attention_bias,
            "qk_norm": True,
            "sliding_window": integer(hf, "sliding_window", None) if SLIDING in layer_types else None,
            "family_config": Gemma3Fields(
                layer_types=tuple(layer_types),
                rope=_rope_from_hf(hf, source),
                query_pre_attn_scalar=number(hf, "query_pre_attn_scalar", 256.0),
                sliding_window_pattern=pattern,
            ),
        }

    def emit(self, config: ModelConfig, hf: dict[str, Any]) -> None:
        f: Gemma3Fields = config.family_config
        hf.update(
            hidden_activation=ACTIVATION,
            attention_bias=config.attention_bias,
            sliding_window=config.sliding_window,
            layer_types=list(f.layer_types),
            query_pre_attn_scalar=_json_number(f.query_pre_attn_scalar),
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
        )
        if f.sliding_window_pattern is not None:
            hf["sliding_window_pattern"] = f.sliding_window_pattern
        if config.hf_config_style == "transformers5":
            hf["rope_parameters"] = {
                t: {"rope_type": "default", **(s.to_hf() if s else {}), "rope_theta": theta} for t, theta, s in f.rope
            }
            return
        full_theta, full_scaling = f.rope_of(FULL)
        local_theta, local_scaling = f.rope_of(SLIDING)
        if local_scaling is not None:
            raise NVFP4ToolError(
                "gemma3_text: RoPE scaling on the sliding layers has no transformers 4 spelling; "
                "write the config in transformers 5's style (rope_parameters)"
            )
        hf.update(
            rope_theta=full_theta,
            rope_local_base_freq=local_theta,
            rope_scaling=None if full_scaling is None else full_scaling.to_hf(),
        )

    def problems(self, config: ModelConfig) -> list[str]:
        f = config.family_config
        if not isinstance(f, Gemma3Fields):
            return [f"gemma3_text needs its fields (family_config=Gemma3Fields(...)), got {f!r}"]
        problems = []
        if len(f.layer_types) != config.num_layers:
            problems.append(f"num_hidden_layers={config.num_layers} but layer_types lists {len(f.layer_types)}")
        if f.sliding_window_pattern is not None and list(f.layer_types) != [
            SLIDING if (i + 1) % f.sliding_window_pattern else FULL for i in range(config.num_layers)
        ]:
            problems.append(f"layer_types contradict sliding_window_pattern={f.sliding_window_pattern}")
        if SLIDING in f.layer_types and config.sliding_window is None:
            problems.append("sliding layers need sliding_window")
        if not config.qk_norm or config.attention_bias != config.o_proj_bias:
            problems.append("gemma3_text has q/k norms and attention_bias on q/k/v/o together")
        if not (f.query_pre_attn_scalar > 0 and math.isfinite(f.query_pre_attn_scalar)):
            problems.append(f"query_pre_attn_scalar must be > 0, got {f.query_pre_attn_scalar}")
        for t, theta, _ in f.rope:
            if not (theta > 0 and math.isfinite(theta)):
                problems.append(f"the {t} layers' rope_theta must be > 0, got {theta}")
        return problems

    def maxtext_refusal(self, config: ModelConfig) -> str | None:
        """MaxText's gemma3 decoder fixes 5 local : 1 global layers, has no attention biases and
        takes the logits from the embedding."""
        f: Gemma3Fields = config.family_config
        want = tuple(FULL if i % MAXTEXT_PATTERN == MAXTEXT_PATTERN - 1 else SLIDING for i in range(config.num_layers))
        if f.layer_types != want:
            return (
                "gemma3_text layer_types other than 5 sliding : 1 full (sliding_window_pattern 6) have no MaxText "
                "layout: MaxText's gemma3 decoder fixes that pattern"
            )
        if config.attention_bias:
            return "gemma3_text with attention_bias has no MaxText layout (MaxText's gemma3 attention has no biases)"
        if not config.tie_word_embeddings:
            return (
                "gemma3_text with an untied lm_head has no MaxText layout (MaxText's gemma3 logits use the embedding)"
            )
        return None

    # ------------------------------------------------------------------------------ layers

    def layer_attention(self, config: ModelConfig, layer: int) -> LayerAttention:
        """A sliding layer: `sliding_window` and the local RoPE; a full one: no window and the
        global RoPE (with its scaling); both at query_pre_attn_scalar^-0.5."""
        f: Gemma3Fields = config.family_config
        layer_type = f.layer_types[layer]
        theta, scaling = f.rope_of(layer_type)
        return LayerAttention(
            window=config.sliding_window if layer_type == SLIDING else None,
            rope_theta=theta,
            rope_scaling=scaling,
            softmax_scale=f.query_pre_attn_scalar**-0.5,
        )

    def embedding_scale(self, config: ModelConfig) -> float:
        return config.hidden_size**0.5

    def layer_tensors(self, config: ModelConfig, layer: int) -> list[Tensor]:
        E, D, F = config.hidden_size, config.head_dim, config.intermediate_size
        q_out, kv_out = config.num_heads * D, config.num_kv_heads * D
        p = layer_prefix(layer)
        attention = f"{p}.{ATTENTION}"
        bias = config.attention_bias
        tensors = [Tensor(f"{p}.{INPUT_NORM}.weight", (E,))]
        tensors += projection_tensors(
            attention, ATTENTION_PROJECTIONS, ((q_out, E), (kv_out, E), (kv_out, E), (E, q_out)), (bias,) * 4
        )
        tensors += [Tensor(f"{attention}.q_norm.weight", (D,)), Tensor(f"{attention}.k_norm.weight", (D,))]
        tensors += [Tensor(f"{p}.{norm}.weight", (E,)) for norm in (POST_ATTENTION_NORM, PRE_FEEDFORWARD_NORM)]
        tensors += projection_tensors(f"{p}.mlp", SWIGLU, ((F, E), (F, E), (E, F)))
        return tensors + [Tensor(f"{p}.{POST_FEEDFORWARD_NORM}.weight", (E,))]

    def folds(self, config: ModelConfig, layer: int) -> list[Fold]:
        """The pre-norm sites of `Family.folds`, the MLP's input norm being pre_feedforward_layernorm
        (post_attention_layernorm normalises the attention's output: no linear reads it); a norm
        producer's (1 + w) is divided by s (`norm_unit_offset`)."""
        p = layer_prefix(layer)
        post, pre = f"{p}.{POST_ATTENTION_NORM}.weight", f"{p}.{PRE_FEEDFORWARD_NORM}.weight"
        found = []
        for f in super().folds(config, layer):
            if f.producer == (post,):
                f = dataclasses.replace(f, producer=(pre,))
            found.append(dataclasses.replace(f, unit_offset=f.kind == "norm"))
        return found


def _rope_from_hf(hf: Mapping[str, Any], source: str) -> tuple[tuple[str, float, Any], ...]:
    """(layer type, base, scaling) of both layer types: transformers 5's `rope_parameters` per
    layer type, else transformers 4's rope_theta + rope_scaling (global) and rope_local_base_freq."""
    params = hf.get("rope_parameters")
    if params:
        if not isinstance(params, Mapping) or any(not isinstance(params.get(t) or {}, Mapping) for t in _DEFAULT_THETA):
            raise NVFP4ToolError(f"{source}: rope_parameters must map {FULL!r} and {SLIDING!r} to objects")
        rope = []
        for t in (FULL, SLIDING):
            p = params.get(t) or {}
            if p.get("partial_rotary_factor", 1.0) != 1.0:
                raise NVFP4ToolError(
                    f"{source}: rope_parameters.{t}.partial_rotary_factor={p['partial_rotary_factor']} "
                    "unsupported; supported: 1.0 (RoPE over the whole head)"
                )
            theta = number({"rope_theta": p.get("rope_theta", _DEFAULT_THETA[t])}, "rope_theta")
            rope.append((t, theta, rope_scaling_from_hf(p, f"{source}: rope_parameters.{t}")))
        return tuple(rope)
    scaling = hf.get("rope_scaling") or {}
    if not isinstance(scaling, Mapping):
        raise NVFP4ToolError(f"{source}: rope_scaling must be an object, got {scaling!r}")
    return (
        (FULL, number(hf, "rope_theta", _DEFAULT_THETA[FULL]), rope_scaling_from_hf(scaling, source)),
        (SLIDING, number(hf, "rope_local_base_freq", _DEFAULT_THETA[SLIDING]), None),
    )


def _json_number(value: float) -> int | float:
    """An integral float as the int config.json gives it (query_pre_attn_scalar: 256)."""
    return int(value) if float(value).is_integer() else value


FAMILIES = (Gemma3(),)
