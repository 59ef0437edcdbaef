"""The MaxText layout rules a family declares (`Family.maxtext_rules`; None: no MaxText layout),
and its MaxText model names (`Family.maxtext_models`: `NamedModel`).

Each `Rule` names an HF tensor, the MaxText parameter path it lives at (under `params/params/`)
and the transform between the two orientations; `converters/layout.py` owns what the transforms
do, the scanned / unscanned paths and the sources these names were read in (no code copied).
Per-layer rules are written relative to a decoder layer ("{i}" in the HF name) of one MaxText
layer stack (`Rule.stack`, the family's `maxtext_stacks`), expert rules hold "{e}".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from nvfp4tool.families.base import (
    ATTENTION,
    EMBEDDING,
    FINAL_NORM,
    LM_HEAD,
    layer_prefix,
)


@dataclasses.dataclass(frozen=True)
class Rule:
    """One HF tensor <-> one MaxText parameter (or, for an expert, one slice of it)."""

    hf: str  # HF name; per-layer rules contain "{i}", per-expert rules "{e}"
    maxtext: str  # path under params/params; per-layer rules: relative to the decoder layer
    transform: str  # "identity" | "transpose" | "heads_in" | "heads_out"
    rope: bool = False  # q and k: the RoPE row layout may differ (interleaved vs half-split)
    query_scale: bool = False  # q: MaxText stores it pre-multiplied by 1/sqrt(head_dim)
    untied_only: bool = False  # lm_head: absent when the embedding is tied
    stack: str = "layers"  # per-layer rules: MaxText's layer stack (`Family.maxtext_stacks`) holding them
    head_dim: Callable[[Any], int] | None = None  # heads_in / heads_out: head width of a config; None: head_dim
    optional: bool = False  # absent when the model has no such HF tensor (DeepSeek's q_proj vs q_a_proj)
    unit_offset: bool = False  # a (1 + w) norm: MaxText stores 1 + w (its RMSNorm scales by the stored value)
    embedding_scale: bool = False  # the embedding: MaxText stores it times the family's embedding scale

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf

    @property
    def per_expert(self) -> bool:
        """An expert weight: slice `e` (axis 0) of a parameter that stacks all experts."""
        return "{e}" in self.hf


@dataclasses.dataclass(frozen=True)
class NamedModel:
    """A MaxText model name (`--model-config llama3.1-8b`; MaxText checkpoints carry no config): the
    HF config.json it stands for and the RoPE row layout of MaxText's checkpoints of it."""

    hf: Mapping[str, Any]  # the config.json dict (numbers from MaxText's model yml and the HF release)
    rope_layout: str = "half"  # "interleaved" | "half" (when the family's decoder fixes none)


_LAYER = layer_prefix("{i}")
_ATTN = f"{_LAYER}.{ATTENTION}"


def model_rules() -> tuple[Rule, ...]:
    """Embedding, final norm and LM head (every MaxText decoder's)."""
    return (
        Rule(f"{EMBEDDING}.weight", "token_embedder/embedding", "identity"),
        Rule(f"{FINAL_NORM}.weight", "decoder/decoder_norm/scale", "identity"),
        Rule(f"{LM_HEAD}.weight", "decoder/logits_dense/kernel", "transpose", untied_only=True),
    )


def layer_norm_rules(stack: str = "layers") -> tuple[Rule, ...]:
    """A pre-norm decoder layer's two norms (input, post-attention) in MaxText stack `stack`."""
    return (
        Rule(f"{_LAYER}.input_layernorm.weight", "pre_self_attention_layer_norm/scale", "identity", stack=stack),
        Rule(
            f"{_LAYER}.post_attention_layernorm.weight",
            "post_self_attention_layer_norm/scale",
            "identity",
            stack=stack,
        ),
    )


def decoder_rules(*, query_scale: bool, qk_norm: bool) -> tuple[Rule, ...]:
    """Embedding, final norm, LM head, the layer norms and the attention of a Llama-style decoder;
    `query_scale`: MaxText's attention for the family uses scale 1 (the query kernel carries
    1/sqrt(head_dim)); `qk_norm`: Qwen3's per-head q/k norms."""
    rules = [
        *model_rules(),
        *layer_norm_rules(),
        Rule(f"{_ATTN}.q_proj.weight", "self_attention/query/kernel", "heads_in", rope=True, query_scale=query_scale),
        Rule(f"{_ATTN}.k_proj.weight", "self_attention/key/kernel", "heads_in", rope=True),
        Rule(f"{_ATTN}.v_proj.weight", "self_attention/value/kernel", "heads_in"),
        Rule(f"{_ATTN}.o_proj.weight", "self_attention/out/kernel", "heads_out"),
    ]
    if qk_norm:
        rules += [
            Rule(f"{_ATTN}.q_norm.weight", "self_attention/query_norm/scale", "identity"),
            Rule(f"{_ATTN}.k_norm.weight", "self_attention/key_norm/scale", "identity"),
        ]
    return tuple(rules)


def dense_mlp_rules(hf_block: str = "mlp", block: str = "mlp", stack: str = "layers") -> tuple[Rule, ...]:
    """A dense SwiGLU MLP (HF `hf_block`, MaxText `block` in stack `stack`): gate/up/down = MaxText
    wi_0 / wi_1 / wo."""
    return tuple(
        Rule(f"{_LAYER}.{hf_block}.{attr}.weight", f"{block}/{mt}/kernel", "transpose", stack=stack)
        for attr, mt in (("gate_proj", "wi_0"), ("up_proj", "wi_1"), ("down_proj", "wo"))
    )


def moe_rules(block: str, hf_block: str, projections: tuple[str, str, str], stack: str = "layers") -> tuple[Rule, ...]:
    """Router and experts of a sparse MLP: MaxText's block `block` (`gate/kernel`, and the experts
    as bare arrays wi_0 / wi_1 / wo stacked on a leading experts axis) for HF's `hf_block` whose
    experts' (gate, up, down) are `projections`."""
    gate, up, down = projections
    experts = f"{_LAYER}.{hf_block}.experts.{{e}}"
    return (
        Rule(f"{_LAYER}.{hf_block}.gate.weight", f"{block}/gate/kernel", "transpose", stack=stack),
        Rule(f"{experts}.{gate}.weight", f"{block}/wi_0", "transpose", stack=stack),
        Rule(f"{experts}.{up}.weight", f"{block}/wi_1", "transpose", stack=stack),
        Rule(f"{experts}.{down}.weight", f"{block}/wo", "transpose", stack=stack),
    )
