"""Gemma 3's text decoder (`gemma3_text`, `Gemma3ForCausalLM`): config.json, tensors, layers.

Local layers attend within `sliding_window` at their own RoPE base, global layers to every earlier
key at theirs (`layer_types` / `sliding_window_pattern`); q/k RMSNorm, (1 + w) norms in fp32 before
and after attention and the MLP, a GeGLU MLP, scores scaled by query_pre_attn_scalar^-0.5, the
embedding scaled by sqrt(hidden), tied embeddings by default. Its blocks: `model/gemma3.py`.
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
from nvfp4tool.families.rope_scaling import rope_scaling_from_hf

SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer types
PRE_FEEDFORWARD_NORM = "pre_feedforward_layernorm"  # the norm before the MLP ...
POST_FEEDFORWARD_NORM = "post_feedforward_layernorm"  # ... and after it (post_attention_layernorm: after attention)
ACTIVATION = "gelu_pytorch_tanh"  # config.json's hidden_activation: GeGLU
_DEFAULT_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}  # Gemma3TextConfig's defaults
_DEFAULT_PATTERN = 6  # every 6th layer global (Gemma3TextConfig's sliding_window_pattern)
_REFUSED = ("final_logit_softcapping", "attn_logit_softcapping")  # null in every Gemma 3 release


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
    no_maxtext_reason = (
        "gemma3_text has no MaxText layout here yet (MaxText's gemma3 decoder scans the 5 local : 1 global "
        "pattern as blocks and stores its norms and embedding its own way; not built)"
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
                raise NVFP4ToolError(
                    f"{source}: {key} {hf[key]!r} unsupported for gemma3_text; supported: {ACTIVATION}"
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
