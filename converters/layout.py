"""The one HF <-> MaxText name and transform table (the families' declared rules), used by both
directions, and the HF side's two mixture-of-experts layouts (per-expert and fused, at the end).

`TABLE` is every family's `Rule`s (HF tensor, MaxText path under `params/params/`, transform),
`rules_for` one model's; `hf_to_maxtext` / `maxtext_to_hf` (its exact inverse) apply a rule;
`fused_expert_views` maps each per-expert name onto its slice of a fused tensor.
Design notes: docs/design/maxtext-layout.md.
"""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes  # also registers bfloat16 / float8 / float4 with numpy
import numpy as np

from nvfp4tool.config import ModelConfig
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.families import MAXTEXT_FAMILIES, REGISTRY, ROUTER, LinearModule, layer_prefix
from nvfp4tool.families.maxtext import Rule

ROPE_LAYOUTS = ("half", "interleaved")
PARAMS_PREFIX = ("params", "params")  # TrainState.params is Flax's {"params": collection}
SCANNED_LAYERS = "decoder/layers"  # one stacked array per rule (per block position), layer axis 1
REMAINDER_LAYERS = "decoder/layers_remainder"  # scanned in blocks: the layers after the last whole block
LAYER_AXIS = 1  # where scanned checkpoints stack the layers
EXPERTS_AXIS = 0  # where an experts array stacks its experts (before the layer axis when scanned)


# The one HF <-> MaxText table: every family's declared rules (families/maxtext.py), each rule once.
TABLE: tuple[Rule, ...] = tuple(dict.fromkeys(r for f in REGISTRY.values() for r in f.maxtext_rules or ()))


FUSED_BLOCK = "mlp"  # the sparse block's name in the fused layout, every family (Mixtral's renamed)
FUSED_GATE_UP = "experts.gate_up_proj"  # [E, 2F, H]: per expert, its gate rows then its up rows
FUSED_DOWN = "experts.down_proj"  # [E, H, F]
FUSED_TENSOR_RE = r"\.experts\.(gate_up_proj|down_proj)$"  # a name only the fused layout has


@dataclasses.dataclass(frozen=True)
class ExpertView:
    """One per-expert HF tensor as rows `[row_start, row_start + rows)` of expert `expert` in the
    fused tensor `fused`; `expert` None: the whole tensor under another name (Mixtral's router)."""

    fused: str
    expert: int | None = None
    row_start: int = 0
    rows: int = 0


def fused_expert_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The tensors the fused layout stores instead of the per-expert ones -> their shapes: per sparse
    layer, the router (renamed for Mixtral), gate_up_proj [E, 2F, H] and down_proj [E, H, F]."""
    H = config.hidden_size
    shapes: dict[str, tuple[int, ...]] = {}
    for layer, experts in _gated_experts(config).items():
        E, F = len(experts), experts[0][0].shape[0]
        block = f"{layer_prefix(layer)}.{FUSED_BLOCK}"
        shapes[f"{block}.gate.weight"] = (E, H)
        shapes[f"{block}.{FUSED_GATE_UP}"] = (E, 2 * F, H)
        shapes[f"{block}.{FUSED_DOWN}"] = (E, H, F)
    return shapes


def fused_expert_views(config: ModelConfig) -> dict[str, ExpertView]:
    """Every per-expert name `ModelConfig.expected_tensor_shapes` gives a sparse layer -> where the
    fused layout keeps it (see the module docstring). Empty for a dense model."""
    table = config.modules
    views: dict[str, ExpertView] = {}
    for layer, experts in _gated_experts(config).items():
        fused = f"{layer_prefix(layer)}.{FUSED_BLOCK}"
        router = table[experts[0][0].name].block + f".{ROUTER.attr}"
        views[f"{router}.weight"] = ExpertView(f"{fused}.gate.weight")
        for e, (gate, up, down) in enumerate(experts):
            F = gate.shape[0]
            views[f"{gate.name}.weight"] = ExpertView(f"{fused}.{FUSED_GATE_UP}", e, 0, F)
            views[f"{up.name}.weight"] = ExpertView(f"{fused}.{FUSED_GATE_UP}", e, F, F)
            views[f"{down.name}.weight"] = ExpertView(f"{fused}.{FUSED_DOWN}", e, 0, config.hidden_size)
    return views


def _gated_experts(config: ModelConfig) -> dict[int, list[tuple[LinearModule, LinearModule, LinearModule]]]:
    """layer -> its experts' (gate, up, down) linears in expert order, for every layer whose routed
    experts are gated MLPs (the module table's; what transformers 5 fuses into gate_up_proj /
    down_proj); a layer of non-gated experts (the hybrid's up / down) has no fused layout here."""
    found: dict[int, dict[int, dict[str, LinearModule]]] = {}
    for m in config.modules.linears:
        if m.expert is not None and m.layer is not None:
            found.setdefault(m.layer, {}).setdefault(m.expert, {})[m.role] = m
    return {
        layer: [(x["gate"], x["up"], x["down"]) for _, x in sorted(experts.items())]
        for layer, experts in found.items()
        if all(set(x) == {"gate", "up", "down"} for x in experts.values())
    }


def check_supported(config: ModelConfig, label: str) -> None:
    """Raise unless the table describes `config`: its family has MaxText rules and nothing in this
    model keeps them from applying (`Family.maxtext_refusal`: attention biases, dense layers of a
    family whose MaxText decoder makes every layer sparse)."""
    family = REGISTRY[config.family]
    if family.maxtext_rules is None:
        raise NVFP4ToolError(
            f"{label}: {family.no_maxtext_reason}"
            if family.no_maxtext_reason is not None
            else f"{label}: the MaxText converter supports {', '.join(MAXTEXT_FAMILIES)} models; this one is "
            f"{config.family}"
        )
    reason = family.maxtext_refusal(config)
    if reason is not None:
        raise NVFP4ToolError(f"{label}: {reason}")


def rules_for(config: ModelConfig) -> list[Rule]:
    """The rules that apply to `config` (its family's; lm_head dropped when the embedding is tied,
    a rule of an empty layer stack or an optional rule whose HF tensor the model lacks dropped)."""
    shapes = config.expected_tensor_shapes()
    return [
        r
        for r in config.family_spec.maxtext_rules or ()
        if not (r.untied_only and config.tie_word_embeddings)
        and (not r.per_layer or len(stack_layers(r, config)))
        and not (r.optional and hf_name(r, _first_layer(r, config), 0) not in shapes)
    ]


def stack_layers(rule: Rule, config: ModelConfig) -> range:
    """The HF layers of `rule`'s MaxText layer stack (`Rule.stack`, `Family.maxtext_stacks`)."""
    return config.family_spec.maxtext_stacks(config)[rule.stack]


def layers_of(rule: Rule, config: ModelConfig) -> list[int | None]:
    """The HF layers `rule` applies to ([None]: not a per-layer rule)."""
    return list(stack_layers(rule, config)) if rule.per_layer else [None]


def stack_names(config: ModelConfig) -> list[str]:
    """MaxText's non-empty layer stacks of `config`'s model, in order."""
    return [name for name, layers in config.family_spec.maxtext_stacks(config).items() if len(layers)]


def placement(
    rule: Rule, config: ModelConfig, *, scanned: bool, layer: int | None = None
) -> tuple[tuple[str, ...], int | None]:
    """(key path under params/params of the parameter holding `rule`'s tensor of `layer`, the
    layer's index on that parameter's layer axis or None where the parameter is not a stack).

    With i the layer's index in its stack S (`Rule.stack`, "layers" unless the family's MaxText
    decoder splits the layers: DeepSeek's dense_layers / moe_layers). Unscanned: `decoder/S_{i}/`.
    Scanned, a family scanning single layers (`Family.maxtext_scan_block` 1): `decoder/S/`,
    stacked, index = i. Scanned in blocks of P layers (one stack): layer i < (L // P) * P lives in
    `decoder/layers/layers_{i % P}/`, stacked, index i // P; the L % P layers after them in
    `decoder/layers_remainder/layers_{i - (L // P) * P}/`, unstacked (MaxText's
    `_apply_gemma3_scanned_blocks`; docs/design/maxtext-layout.md)."""
    if not rule.per_layer:
        return tuple(rule.maxtext.split("/")), None
    prefix, index = _layer_prefix(rule, config, layer, scanned)
    return tuple(f"{prefix}/{rule.maxtext}".split("/")), index


def stack_length(rule: Rule, config: ModelConfig) -> int:
    """The layer axis of `rule`'s scanned stack: its every layer, or one per block of `maxtext_scan_block`."""
    return len(stack_layers(rule, config)) // config.family_spec.maxtext_scan_block


def _layer_prefix(rule: Rule, config: ModelConfig, layer: int | None, scanned: bool) -> tuple[str, int | None]:
    i = stack_layers(rule, config).index(layer)
    if not scanned:
        return f"decoder/{rule.stack}_{i}", None
    block = config.family_spec.maxtext_scan_block
    if block == 1:
        return f"decoder/{rule.stack}", i
    full = stack_length(rule, config) * block
    if i < full:
        return f"{SCANNED_LAYERS}/layers_{i % block}", i // block
    return f"{REMAINDER_LAYERS}/layers_{i - full}", None


def hf_name(rule: Rule, layer: int | None = None, expert: int | None = None) -> str:
    return rule.hf.format(i=layer, e=expert) if rule.per_layer else rule.hf


def experts_of(rule: Rule, config: ModelConfig) -> list[int | None]:
    """The expert indices one parameter of `rule` holds ([None]: not an expert weight)."""
    if not rule.per_expert:
        return [None]
    shapes, layer = config.expected_tensor_shapes(), _first_layer(rule, config)
    count = 0
    while hf_name(rule, layer, count) in shapes:  # the family's tensor table holds every expert
        count += 1
    return list(range(count))


def maxtext_shape(rule: Rule, config: ModelConfig, *, scanned: bool, layer: int | None = None) -> tuple[int, ...]:
    """Shape of the stored parameter holding layer `layer` (None: the first of the rule's stack; the
    whole stack when it is one; every expert)."""
    layer = _first_layer(rule, config) if layer is None else layer
    hf_shape = config.expected_tensor_shapes()[hf_name(rule, _first_layer(rule, config), 0)]
    shape = _forward_shape(rule, hf_shape, config)
    if rule.per_expert:
        shape = (len(experts_of(rule, config)),) + shape
    if placement(rule, config, scanned=scanned, layer=layer)[1] is not None:
        shape = shape[:LAYER_AXIS] + (stack_length(rule, config),) + shape[LAYER_AXIS:]
    return shape


def sliced_axes(rule: Rule, *, scanned: bool) -> tuple[int, ...]:
    """Axes of the stored parameter that one HF tensor takes a single index of: the experts axis
    (0) and, in a scanned stack (`scanned`: the parameter is one), the layer axis (1). The writer
    asks Orbax for chunks of size 1 along them, so that the reader can read one HF tensor without the rest."""
    axes = (EXPERTS_AXIS,) if rule.per_expert else ()
    return axes + ((LAYER_AXIS,) if rule.per_layer and scanned else ())


def slice_index(rule: Rule, *, scanned: bool, layer: int | None, expert: int | None) -> tuple:
    """Index of one HF tensor (`layer`: its index on a stack's layer axis, expert `expert`) in the
    stored parameter (`scanned`: a stack)."""
    index = (expert,) if rule.per_expert else ()
    if rule.per_layer and scanned:
        index = (index[0] if index else slice(None), layer)
    return index


def query_scale(config: ModelConfig) -> np.float32:
    """The fp32 factor MaxText's stored query kernel carries: 1/sqrt(head_dim)."""
    return np.float32(1.0 / math.sqrt(config.head_dim))


def embedding_factor(config: ModelConfig) -> np.float32:
    """The factor MaxText's stored embedding carries (`Rule.embedding_scale`): the family's
    embedding scale (sqrt(hidden)) rounded to bf16, as MaxText's converter and transformers' bf16
    `embed_scale` round it."""
    return np.float32(ml_dtypes.bfloat16(config.family_spec.embedding_scale(config)))


def _offset_and_scale(rule: Rule, y: np.ndarray, config: ModelConfig, *, inverse: bool) -> np.ndarray:
    """The value changes of the rules that carry them, in fp32 whatever the storage dtype: the
    query scale (x * s), the embedding scale (x * n) and the norm offset (x + 1); `inverse`: their
    exact inverses (/ s, / n, - 1, the same fp32 constants). Overflow gives inf (callers check)."""
    factor = query_scale(config) if rule.query_scale else embedding_factor(config) if rule.embedding_scale else None
    if factor is None and not rule.unit_offset:
        return y
    y = y.astype(np.float32)
    with np.errstate(over="ignore"):
        if inverse:
            y = y - np.float32(1) if rule.unit_offset else y
            return y if factor is None else y / factor
        y = y if factor is None else y * factor
        return y + np.float32(1) if rule.unit_offset else y


def hf_to_maxtext(rule: Rule, x: np.ndarray, config: ModelConfig, rope_layout: str, out_dtype: str) -> np.ndarray:
    """One HF tensor (one layer) -> the MaxText parameter (one layer), cast to `out_dtype`.

    Overflow (in the query scale or the cast) gives inf silently: the callers check the result."""
    _check_rope_layout(rope_layout)
    if rule.transform == "identity":
        y = x
    elif rule.transform == "transpose":
        y = transpose_2d(x)
    elif rule.transform == "heads_in":  # [N*D, E] -> [E, N, D]
        D = _head_dim(rule, config)
        y = transpose_2d(x).reshape(x.shape[1], x.shape[0] // D, D)
        if rule.rope and rope_layout == "interleaved":
            y = half_to_interleaved(y)
    elif rule.transform == "heads_out":  # [E, H*D] -> [H, D, E]
        D = _head_dim(rule, config)
        y = transpose_2d(x).reshape(x.shape[1] // D, D, x.shape[0])
    else:  # pragma: no cover - the table only uses the four above
        raise ValueError(rule.transform)
    y = _offset_and_scale(rule, y, config, inverse=False)
    with np.errstate(over="ignore"):
        return np.ascontiguousarray(y.astype(out_dtype, copy=False))


def maxtext_to_hf(rule: Rule, y: np.ndarray, config: ModelConfig, rope_layout: str, out_dtype: str) -> np.ndarray:
    """One MaxText parameter (one layer) -> the HF tensor, cast to `out_dtype` (exact inverse).

    Overflow (in the query scale or the cast) gives inf silently: the callers check the result."""
    _check_rope_layout(rope_layout)
    y = _offset_and_scale(rule, y, config, inverse=True)
    if rule.transform == "identity":
        x = y
    elif rule.transform == "transpose":
        x = transpose_2d(y)
    elif rule.transform == "heads_in":  # [E, N, D] -> [N*D, E]
        if rule.rope and rope_layout == "interleaved":
            y = interleaved_to_half(y)
        x = transpose_2d(y.reshape(y.shape[0], y.shape[1] * y.shape[2]))
    elif rule.transform == "heads_out":  # [H, D, E] -> [E, H*D]
        x = transpose_2d(y.reshape(y.shape[0] * y.shape[1], y.shape[2]))
    else:  # pragma: no cover
        raise ValueError(rule.transform)
    with np.errstate(over="ignore"):
        return np.ascontiguousarray(x.astype(out_dtype, copy=False))


def transpose_2d(x_AxB: np.ndarray, rows_per_block: int = 64) -> np.ndarray:
    """x.T as a new C-contiguous array, copied in blocks of rows (2.7x faster than
    `np.ascontiguousarray(x.T)` on a [8192, 2048] fp32 matrix here: each block stays in cache)."""
    out_BxA = np.empty(x_AxB.shape[::-1], dtype=x_AxB.dtype)
    for start in range(0, x_AxB.shape[0], rows_per_block):
        out_BxA[:, start : start + rows_per_block] = x_AxB[start : start + rows_per_block].T
    return out_BxA


def half_to_interleaved(y_ExNxD: np.ndarray) -> np.ndarray:
    """Rows of each head: [x_0..x_{D/2-1}, y_0..y_{D/2-1}] -> [x_0, y_0, x_1, y_1, ...]."""
    half = y_ExNxD.shape[-1] // 2
    return np.stack([y_ExNxD[..., :half], y_ExNxD[..., half:]], axis=-1).reshape(y_ExNxD.shape)


def interleaved_to_half(y_ExNxD: np.ndarray) -> np.ndarray:
    """Inverse of `half_to_interleaved`."""
    return np.concatenate([y_ExNxD[..., ::2], y_ExNxD[..., 1::2]], axis=-1)


# ---------------------------------------------------------------------------------------- helpers


def _head_dim(rule: Rule, config: ModelConfig) -> int:
    """The head width `rule`'s heads_in / heads_out reshape uses (MLA's differ from head_dim)."""
    return config.head_dim if rule.head_dim is None else rule.head_dim(config)


def _first_layer(rule: Rule, config: ModelConfig) -> int | None:
    """The first HF layer of `rule`'s stack (None: not a per-layer rule, or an empty stack)."""
    layers = stack_layers(rule, config) if rule.per_layer else ()
    return layers[0] if len(layers) else None


def _forward_shape(rule: Rule, hf_shape: tuple[int, ...], config: ModelConfig) -> tuple[int, ...]:
    D = _head_dim(rule, config)
    if rule.transform == "identity":
        return hf_shape
    if rule.transform == "transpose":
        return hf_shape[::-1]
    if rule.transform == "heads_in":
        return (hf_shape[1], hf_shape[0] // D, D)
    return (hf_shape[1] // D, D, hf_shape[0])  # heads_out


def _check_rope_layout(rope_layout: str) -> None:
    if rope_layout not in ROPE_LAYOUTS:
        raise NVFP4ToolError(f"RoPE layout {rope_layout!r} unknown; supported: {', '.join(ROPE_LAYOUTS)}")
