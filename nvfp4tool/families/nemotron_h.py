"""The hybrid Nemotron-H family's config.json facts (HF `model_type: nemotron_h`; reference sheet
section 12): the kind of every layer, the Mamba-2 and MoE fields, read and written back in the
source's own spelling, and the parameter count they imply.

    fields = parse_hybrid(hf, "ckpt/config.json")   # HybridFields (NVFP4ToolError naming the key)
    emit_hybrid(fields, out); parameter_count(hf)    # the same keys back; (total, active per token)

`HybridDecoder` is the registered family.
Design notes: docs/design/families.md.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Collection, Mapping
from typing import Any

from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.families.base import (
    ATTENTION_PROJECTIONS,
    BASE_MODEL,
    EMBEDDING,
    FINAL_NORM,
    LAYERS,
    ROUTER,
    Family,
    ModelConfig,
    Projection,
    Tensor,
    layer_prefix,
    preset_shape,
    projection_tensors,
    split_layer,
)
from nvfp4tool.families.hf_values import flag, integer, number

MAMBA, ATTENTION, MLP, MOE = "mamba", "attention", "mlp", "moe"  # single-mixer layer kinds
ACTIVATION = "relu2"  # the MLPs' and experts' (mlp_hidden_act): down(relu(up(x))^2)
PATTERN = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}  # hybrid_override_pattern's characters
KIND_NAMES = {MAMBA: "Mamba-2", ATTENTION: "attention", MLP: "MLP", MOE: "MoE"}  # as messages say them
BLOCK_TYPES = {
    "linear_attention": MAMBA,
    "mamba": MAMBA,
    "full_attention": ATTENTION,
    "attention": ATTENTION,
    "mlp": MLP,
    "moe": MOE,
}  # layers_block_type's names (mamba / attention: legacy)
# the two spellings of the layer kinds: (container, table, what it must be, the error for a bad entry)
LAYER_KEYS = {
    "hybrid_override_pattern": (
        str,
        PATTERN,
        "a non-empty string of M * - E",
        "{key}: {v!r} at position {i} is not a layer kind (M Mamba-2, * attention, - MLP, E MoE)",
    ),
    "layers_block_type": (
        list,
        BLOCK_TYPES,
        "a non-empty list",
        "{key}[{i}]: {v!r} is not one of " + ", ".join(sorted(BLOCK_TYPES)),
    ),
}
# legacy key -> the key transformers 5.24 reads it as (NemotronHConfig.__post_init__)
ALIASES = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_dt_limit": "time_step_limit",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_chunk_size": "chunk_size",
}
# the modules under a layer's mixer, by the kind of mixer they belong to (`tensors_contradiction`)
_MIXER_CHILDREN = {
    MAMBA: ("in_proj", "out_proj", "conv1d", "dt_bias", "A_log", "D", "norm"),
    ATTENTION: ("q_proj", "k_proj", "v_proj", "o_proj"),
    MLP: ("up_proj", "down_proj"),
    MOE: ("gate", "experts", "shared_experts", "fc1_latent_proj", "fc2_latent_proj"),
}
_KIND_OF_CHILD = {child: kind for kind, children in _MIXER_CHILDREN.items() for child in children}
MAMBA_DEFAULTS = {"n_groups": 8, "conv_kernel": 4, "chunk_size": 128, "use_conv_bias": True}  # NemotronHConfig's


@dataclasses.dataclass(frozen=True)
class HybridExperts:
    """An E layer's fields: sigmoid router with a correction bias, non-gated relu2 experts."""

    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    moe_shared_expert_intermediate_size: int
    moe_latent_size: int | None
    routed_scaling_factor: float
    n_group: int
    topk_group: int
    norm_topk_prob: bool


@dataclasses.dataclass(frozen=True)
class HybridFields:
    """The family's own config fields (`ModelConfig.family_config` once the family is registered)."""

    layer_kinds: tuple[str, ...]
    mamba_num_heads: int
    mamba_head_dim: int
    n_groups: int
    ssm_state_size: int
    conv_kernel: int
    chunk_size: int
    time_step_limit: tuple[float, float]
    use_conv_bias: bool
    use_bias: bool  # in_proj / out_proj biases (transformers reads `use_bias`, not mamba_proj_bias)
    experts: HybridExperts | None  # None: no E layer
    # how the source spelled them, for a lossless write-back (not part of the model's identity)
    hf_layers: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)
    hf_keys: dict[str, str] = dataclasses.field(default_factory=dict, compare=False)  # plain key -> key used
    hf_time_step_limit: Any = dataclasses.field(default=None, compare=False)

    @property
    def mamba_inner(self) -> int:
        """I = mamba_num_heads x mamba_head_dim."""
        return self.mamba_num_heads * self.mamba_head_dim

    def in_proj_rows(self) -> int:
        """in_proj's output features: z | x | B | C | dt = 2 I + 2 G N + heads."""
        return 2 * self.mamba_inner + 2 * self.n_groups * self.ssm_state_size + self.mamba_num_heads


def layer_kinds(hf: Mapping[str, Any]) -> tuple[tuple[str, ...], dict[str, Any]]:
    """The kind of each layer, and the layer keys as the source spelled them."""
    kept = {k: hf[k] for k in ("hybrid_override_pattern", "layers_block_type") if hf.get(k) is not None}
    if not kept:
        raise KeyError("hybrid_override_pattern or layers_block_type")
    found = {}
    for key, raw in kept.items():
        container, table, what, bad_text = LAYER_KEYS[key]
        if not isinstance(raw, container) or not raw:
            raise NVFP4ToolError(f"{key} must be {what}, got {raw!r}")
        bad = next((i for i, v in enumerate(raw) if not isinstance(v, str) or v not in table), None)
        if bad is not None:
            raise NVFP4ToolError(bad_text.format(key=key, i=bad, v=raw[bad]))
        found[key] = tuple(table[v] for v in raw)
    kinds = list(found.values())
    if len(kinds) == 2 and kinds[0] != kinds[1]:
        raise NVFP4ToolError(_disagreement(kept, *kinds))
    layers = integer(hf, "num_hidden_layers", None)
    if layers is not None and layers != len(kinds[0]):
        raise NVFP4ToolError(f"num_hidden_layers={layers} but the layer kinds list {len(kinds[0])} layers")
    return kinds[0], kept


def _disagreement(kept: Mapping[str, Any], pattern: tuple[str, ...], block_types: tuple[str, ...]) -> str:
    """Where hybrid_override_pattern and layers_block_type (both given, `kept`; their kinds
    `pattern` and `block_types`) first disagree, each entry as the source spelled it."""
    first, second = kept["hybrid_override_pattern"], kept["layers_block_type"]
    differ = next((i for i, (a, b) in enumerate(zip(pattern, block_types)) if a != b), None)
    if differ is not None:
        text = (
            f"hybrid_override_pattern says layer {differ} is {first[differ]!r} ({KIND_NAMES[pattern[differ]]}), "
            f"layers_block_type says {second[differ]!r} ({KIND_NAMES[block_types[differ]]})"
        )
        if len(pattern) != len(block_types):
            text += f", and they list {len(pattern)} and {len(block_types)} layers"
    else:
        text = (
            f"hybrid_override_pattern lists {len(pattern)} layers, layers_block_type {len(block_types)} "
            f"(the first {min(len(pattern), len(block_types))} agree)"
        )
    return text + "; give one, or both equal"


def _mamba_value(hf: Mapping[str, Any], key: str, read, keys: dict[str, str]) -> Any:
    """`key` or its legacy alias (both present must agree); records which one the source used."""
    alias = next((a for a, k in ALIASES.items() if k == key), None)
    present = [k for k in (key, alias) if k is not None and hf.get(k) is not None]
    if not present:
        return MAMBA_DEFAULTS[key]
    values = [read(hf, k) for k in present]
    if len(values) == 2 and values[0] != values[1]:
        raise NVFP4ToolError(f"{key}={hf[key]!r} and its alias {alias}={hf[alias]!r} disagree")
    keys[key] = present[0]
    return values[0]


def _time_step_limit(hf: Mapping[str, Any], keys: dict[str, str]) -> tuple[tuple[float, float], Any]:
    key = next((k for k in ("time_step_limit", "mamba_dt_limit") if hf.get(k) is not None), None)
    if key is None:
        return (0.0, math.inf), None
    keys["time_step_limit"] = key
    raw = hf[key]

    def bound(v: Any) -> float:
        if isinstance(v, Mapping) and set(v) == {"__float__"} and v["__float__"] in ("Infinity", "inf"):
            return math.inf  # transformers' JSON form of float("inf")
        return number({key: v}, key)

    if not isinstance(raw, (list, tuple)) or len(raw) != 2:
        raise NVFP4ToolError(f"{key} must be [low, high], got {raw!r}")
    low, high = bound(raw[0]), bound(raw[1])
    if not (0.0 <= low < high) or math.isnan(high):
        raise NVFP4ToolError(f"{key} must be [low, high] with 0 <= low < high, got {raw!r}")
    return (low, high), raw


def parse_hybrid(hf: Mapping[str, Any], source: str) -> HybridFields:
    """The family's fields from config.json `hf` (`source` names the file in errors); a missing
    required key is KeyError, a bad value NVFP4ToolError naming the key."""
    try:
        kinds, layers_keys = layer_kinds(hf)
        keys: dict[str, str] = {}
        limit, raw_limit = _time_step_limit(hf, keys)
        if flag(hf, "tie_word_embeddings"):
            raise NVFP4ToolError(
                "tie_word_embeddings=true unsupported: NemotronHForCausalLM never ties lm_head "
                "to the embeddings (transformers 5.24), so the model would not be the one declared"
            )
        for act_key, want in (("mlp_hidden_act", ACTIVATION), ("mamba_hidden_act", "silu")):
            if hf.get(act_key, want) != want:
                raise NVFP4ToolError(f"{act_key}={hf[act_key]!r} unsupported; supported: {want}")
        experts = None
        if MOE in kinds:
            latent = integer(hf, "moe_latent_size", None)
            experts = HybridExperts(
                n_routed_experts=integer(hf, "n_routed_experts"),
                num_experts_per_tok=integer(hf, "num_experts_per_tok"),
                moe_intermediate_size=integer(hf, "moe_intermediate_size"),
                n_shared_experts=integer(hf, "n_shared_experts", 1),
                moe_shared_expert_intermediate_size=integer(hf, "moe_shared_expert_intermediate_size"),
                moe_latent_size=latent,
                routed_scaling_factor=number(hf, "routed_scaling_factor", 1.0),
                n_group=integer(hf, "n_group", 1),
                topk_group=integer(hf, "topk_group", 1),
                norm_topk_prob=flag(hf, "norm_topk_prob", True),
            )
        fields = HybridFields(
            layer_kinds=kinds,
            mamba_num_heads=integer(hf, "mamba_num_heads"),
            mamba_head_dim=integer(hf, "mamba_head_dim"),
            n_groups=_mamba_value(hf, "n_groups", integer, keys),
            ssm_state_size=integer(hf, "ssm_state_size"),
            conv_kernel=_mamba_value(hf, "conv_kernel", integer, keys),
            chunk_size=_mamba_value(hf, "chunk_size", integer, keys),
            time_step_limit=limit,
            use_conv_bias=_mamba_value(hf, "use_conv_bias", flag, keys),
            use_bias=flag(hf, "use_bias"),
            experts=experts,
            hf_layers=layers_keys,
            hf_keys=keys,
            hf_time_step_limit=raw_limit,
        )
    except KeyError as missing:
        raise NVFP4ToolError(f"{source}: nemotron_h needs {missing.args[0]}") from None
    except NVFP4ToolError as bad:
        raise NVFP4ToolError(f"{source}: {bad}") from None
    problems = hybrid_problems(fields)
    if problems:
        raise NVFP4ToolError(f"{source}: {problems[0]}")
    return fields


def hybrid_problems(f: HybridFields) -> list[str]:
    """Combinations the model cannot run (each a sentence naming the keys)."""
    problems = []
    positive = ("mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel", "chunk_size")
    problems += [f"{k} must be a positive integer, got {getattr(f, k)!r}" for k in positive if getattr(f, k) < 1]
    if not problems and f.mamba_num_heads % f.n_groups:
        problems.append(
            f"mamba_num_heads={f.mamba_num_heads} is not a multiple of n_groups={f.n_groups} "
            "(each group's B and C serve whole heads)"
        )
    e = f.experts
    if e is not None:
        if not 1 <= e.num_experts_per_tok <= e.n_routed_experts:
            problems.append(
                f"num_experts_per_tok must be in 1..n_routed_experts={e.n_routed_experts}, got {e.num_experts_per_tok}"
            )
        elif e.n_group < 1 or e.n_routed_experts % e.n_group:
            problems.append(f"n_routed_experts={e.n_routed_experts} is not a multiple of n_group={e.n_group}")
        elif not 1 <= e.topk_group <= e.n_group:
            problems.append(f"topk_group must be in 1..n_group={e.n_group}, got {e.topk_group}")
        elif e.n_group > 1 and e.n_routed_experts // e.n_group < 2:
            problems.append(
                "grouped routing scores each group by its two best experts: "
                f"n_routed_experts / n_group = {e.n_routed_experts // e.n_group} < 2"
            )
        elif e.num_experts_per_tok > e.topk_group * (e.n_routed_experts // e.n_group):
            problems.append(
                f"num_experts_per_tok={e.num_experts_per_tok} exceeds the experts of the "
                f"topk_group={e.topk_group} chosen groups"
            )
        if e.n_shared_experts != 1:  # the two disagree on what it means, and agree at 1
            problems.append(
                f"n_shared_experts={e.n_shared_experts} unsupported; supported: 1 (transformers 5.24 "
                "builds one shared MLP moe_shared_expert_intermediate_size wide whatever the count, "
                "vLLM one n_shared_experts times as wide, none for 0)"
            )
        if not (e.routed_scaling_factor > 0 and math.isfinite(e.routed_scaling_factor)):
            problems.append(f"routed_scaling_factor must be finite and > 0, got {e.routed_scaling_factor}")
    return problems


def emit_hybrid(f: HybridFields, hf: dict[str, Any]) -> None:
    """Write the fields into config.json's dict `hf` in the source's spelling (see the module
    docstring); fields the source did not give are written under their plain names."""
    canonical = {
        "hybrid_override_pattern": "".join({v: k for k, v in PATTERN.items()}[k] for k in f.layer_kinds),
        "layers_block_type": [
            {MAMBA: "linear_attention", ATTENTION: "full_attention", MLP: "mlp", MOE: "moe"}[k] for k in f.layer_kinds
        ],
    }
    for key, raw in (f.hf_layers or {"hybrid_override_pattern": None}).items():
        table = LAYER_KEYS[key][1]
        hf[key] = raw if raw is not None and tuple(table[x] for x in raw) == f.layer_kinds else canonical[key]
    hf.update(
        mamba_num_heads=f.mamba_num_heads,
        mamba_head_dim=f.mamba_head_dim,
        ssm_state_size=f.ssm_state_size,
        use_bias=f.use_bias,
    )
    for key in ("n_groups", "conv_kernel", "chunk_size", "use_conv_bias"):
        hf[f.hf_keys.get(key, key)] = getattr(f, key)
    limit_key = f.hf_keys.get("time_step_limit", "time_step_limit")
    raw = f.hf_time_step_limit
    if raw is not None and _time_step_limit({limit_key: raw}, {})[0] == f.time_step_limit:
        hf[limit_key] = raw
    else:
        hf[limit_key] = [
            f.time_step_limit[0],
            {"__float__": "Infinity"} if math.isinf(f.time_step_limit[1]) else f.time_step_limit[1],
        ]
    if f.experts is not None:
        hf.update(dataclasses.asdict(f.experts))


def parameter_count(hf: Mapping[str, Any], source: str = "config.json") -> tuple[int, int]:
    """(total, active per token) parameters of the model config.json `hf` describes, as
    transformers 5.24's NemotronHForCausalLM holds them (multi-token-prediction layers not
    counted): embeddings, lm_head (never tied), the final norm, and per layer its norm and mixer.
    Attention and experts have no biases there; MLPs take `mlp_bias`, in_proj / out_proj `use_bias`."""
    f = parse_hybrid(hf, source)
    h, v = integer(hf, "hidden_size"), integer(hf, "vocab_size")
    heads, kv = integer(hf, "num_attention_heads"), integer(hf, "num_key_value_heads", None)
    kv = heads if kv is None else kv
    head_dim = integer(hf, "head_dim", None) or integer(hf, "attention_head_dim", None) or h // heads
    mlp_bias = flag(hf, "mlp_bias")
    inner, conv = f.mamba_inner, f.mamba_inner + 2 * f.n_groups * f.ssm_state_size
    total = active = 2 * v * h + h

    def dense(k: int, n: int, bias: bool) -> int:
        return k * n + (n if bias else 0)

    for kind in f.layer_kinds:
        own = routed_all = routed_active = 0
        if kind == MAMBA:
            own = (
                dense(h, f.in_proj_rows(), f.use_bias)
                + conv * f.conv_kernel
                + (conv if f.use_conv_bias else 0)
                + 3 * f.mamba_num_heads
                + inner
                + dense(inner, h, f.use_bias)
            )
        elif kind == ATTENTION:
            own = 2 * h * heads * head_dim + 2 * h * kv * head_dim
        elif kind == MLP:
            width = integer(hf, "intermediate_size")
            own = dense(h, width, mlp_bias) + dense(width, h, mlp_bias)
        else:
            e = f.experts
            width = e.moe_latent_size or h
            expert = 2 * width * e.moe_intermediate_size
            shared = e.moe_shared_expert_intermediate_size
            own = (
                e.n_routed_experts * h
                + e.n_routed_experts  # router weight, correction bias
                + dense(h, shared, mlp_bias)
                + dense(shared, h, mlp_bias)
            )
            if e.moe_latent_size:
                own += dense(h, e.moe_latent_size, mlp_bias) + dense(e.moe_latent_size, h, mlp_bias)
            routed_all, routed_active = e.n_routed_experts * expert, e.num_experts_per_tok * expert
        total += h + own + routed_all
        active += h + own + routed_active
    return total, active


# ------------------------------------------------------------------------------------------------
# the family

MIXER = "mixer"  # every layer's one mixer attribute (its norm is `norm`)
MAMBA_IN = Projection("in_proj", "mamba_in", "column")  # z | x | B | C | dt rows (vLLM shards each piece)
MAMBA_OUT = Projection("out_proj", "mamba_out", "row")
# the relu2 MLP's up_proj has no gate; it keeps the `gate_up` group name every family's up_proj has
# (a group of one), so `families.fused_group` names it from the attribute alone
RELU2 = (Projection("up_proj", "up", "column", "gate_up"), Projection("down_proj", "down", "row"))
# vLLM builds both latent projections as ReplicatedLinear (every rank holds them whole)
LATENT = (Projection("fc1_latent_proj", "latent_in", "none"), Projection("fc2_latent_proj", "latent_out", "none"))
CHECKPOINT_BASE = "backbone"  # NemotronHForCausalLM's base-model attribute (ours: `model`)
# our base-model names -> the checkpoint's (vLLM's hf_to_vllm_mapper read backwards)
_CHECKPOINT_NAMES = {
    f"{EMBEDDING}.weight": f"{CHECKPOINT_BASE}.embeddings.weight",
    f"{FINAL_NORM}.weight": f"{CHECKPOINT_BASE}.norm_f.weight",
}
# config.json keys the family models (with its aliases), beyond the common ones; the MoE keys are
# not among them (a dense hybrid's config carries transformers' defaults for them, kept as given;
# a MoE hybrid's are written from its fields)
_KEYS = frozenset(
    {
        "hybrid_override_pattern",
        "layers_block_type",
        "mamba_num_heads",
        "mamba_head_dim",
        "ssm_state_size",
        "time_step_limit",
        "use_bias",
        "layer_norm_epsilon",
        "attention_bias",
        "mlp_bias",
        *MAMBA_DEFAULTS,
        *ALIASES,
    }
)


def _preset(pattern: str, experts: HybridExperts | None) -> dict[str, Any]:
    """A training preset: the single-mixer stack `pattern` at the tiny size's width (16 Mamba heads
    of 8, one group of state 16: in_proj 2 x 128 + 2 x 16 + 16 = 304 rows, a multiple of the 16 x 16
    weight blocks)."""
    kinds, _ = layer_kinds({"hybrid_override_pattern": pattern})
    fields = HybridFields(
        layer_kinds=kinds,
        mamba_num_heads=16,
        mamba_head_dim=8,
        n_groups=1,
        ssm_state_size=16,
        conv_kernel=4,
        chunk_size=64,
        time_step_limit=(0.0, float("inf")),
        use_conv_bias=True,
        use_bias=False,
        experts=experts,
        hf_layers={"hybrid_override_pattern": pattern},
    )
    return preset_shape("tiny", num_layers=len(kinds), family_config=fields)


# `tiny-hybrid-moe`'s E layers: 8 relu2 experts 96 wide, top-2 of the sigmoid router, a shared expert
_TINY_EXPERTS = HybridExperts(
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=96,
    n_shared_experts=1,
    moe_shared_expert_intermediate_size=96,
    moe_latent_size=None,
    routed_scaling_factor=1.0,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
)


class HybridDecoder(Family):
    """`nemotron_h`: a stack of single-mixer layers (see the module docstring). Our module paths
    are every family's (`model.embed_tokens`, `model.layers.{i}.norm`, `model.layers.{i}.mixer.*`,
    `model.norm`, `lm_head`); `checkpoint_name` maps them to the checkpoint's `backbone.*`."""

    model_type = "nemotron_h"
    architecture = "NemotronHForCausalLM"
    blocks_module = "nvfp4tool.model.hybrid"

    @property
    def keep_bf16_rules(self) -> dict[str, Any]:
        """NVIDIA's published Nemotron-3-Nano NVFP4 recipe (`export --recipe nemotron-nano`)."""
        return {"nvidia-nemotron-3-nano": nvidia_nano_keep_bf16}

    presets = types.MappingProxyType(
        {"tiny-hybrid": _preset("M-M-M*-M", None), "tiny-hybrid-moe": _preset("ME-M*EME", _TINY_EXPERTS)}
    )
    modeled_keys = _KEYS
    positional = "none"
    projections = (MAMBA_IN, MAMBA_OUT, *LATENT)
    router_blocks = (MIXER,)
    # the router in FP32, as transformers 5.24 keeps it (`_keep_in_fp32_modules_strict`) and NVIDIA ships it
    stored_fp32 = (f"*.{MIXER}.gate.weight", f"*.{MIXER}.gate.e_score_correction_bias")
    # the SSM parameters, conv1d, the norms and the router: exported in the source's dtypes (FP32
    # where it has FP32), as NVIDIA's checkpoints keep them beside the quantized linears
    kept_as_stored = (
        f"*.{MIXER}.conv1d.*",
        f"*.{MIXER}.A_log",
        f"*.{MIXER}.D",
        f"*.{MIXER}.dt_bias",
        "*norm*",
        f"*.{MIXER}.gate.*",
    )
    # zero until an aux-loss-free balancing update moves it (none in fine-tuning: no gradient reaches it)
    may_be_zero = (f"*.{MIXER}.gate.e_score_correction_bias",)
    norm_scale_in_fp32 = True
    norm_eps_key = "layer_norm_epsilon"
    activation = ACTIVATION  # its MLPs' and experts' (config.json spells it mlp_hidden_act)
    # common keys a hybrid config does not have: kept as the source spelled them (or absent), never written
    no_maxtext_reason = "MaxText has no Mamba-2 decoder, so a hybrid nemotron_h model has no MaxText layout"
    common_keys_not_modeled = frozenset(
        {
            "rope_theta",
            "rope_scaling",
            "rope_parameters",
            "hidden_act",
            "rms_norm_eps",
            "num_hidden_layers",
            "sliding_window",
        }
    )

    def parse(self, hf: Mapping[str, Any], source: str) -> dict[str, Any]:
        for key, why in (
            ("attention_bias", "transformers 5.24 builds its attention without biases"),
            ("mlp_bias", "MLP and expert biases are not modeled yet"),
        ):
            if flag(hf, key):
                raise NVFP4ToolError(f"{source}: {key}=true unsupported for nemotron_h ({why})")
        if hf.get("sliding_window") is not None:
            raise NVFP4ToolError(
                f"{source}: sliding_window={hf['sliding_window']!r} unsupported for nemotron_h "
                f"(its attention layers attend to the whole sequence)"
            )
        fields = parse_hybrid(hf, source)
        # transformers 5.24 derives the layer count from the kinds and does not write it
        return {"family_config": fields, "num_layers": len(fields.layer_kinds)}

    def emit(self, config: ModelConfig, hf: dict[str, Any]) -> None:
        emit_hybrid(config.family_config, hf)
        hf.update(layer_norm_epsilon=config.rms_norm_eps, attention_bias=False, mlp_bias=False)

    def problems(self, config: ModelConfig) -> list[str]:
        f = config.family_config
        if not isinstance(f, HybridFields):
            return [f"nemotron_h needs its fields (family_config=HybridFields(...)), got {f!r}"]
        problems = hybrid_problems(f)
        if len(f.layer_kinds) != config.num_layers:
            problems.append(f"num_hidden_layers={config.num_layers} but the layer kinds list {len(f.layer_kinds)}")
        if config.tie_word_embeddings:
            problems.append("NemotronHForCausalLM never ties lm_head to the embeddings")
        if config.qk_norm or config.attention_bias or config.o_proj_bias or config.sliding_window is not None:
            problems.append("nemotron_h attention has no q/k norm, no bias and no sliding window")
        return problems

    def bf16_blocks(self, layers: int) -> tuple[int, int]:
        """NVIDIA's NVFP4 pretraining of the 62-block Nemotron-H kept the first 2 and last 8 blocks
        in BF16 (arXiv 2509.25149, section 4.1): the same fractions of `layers`, rounded up."""
        return math.ceil(2 * layers / 62), math.ceil(8 * layers / 62)

    def checkpoint_name(self, name: str) -> str:
        if name in _CHECKPOINT_NAMES:
            return _CHECKPOINT_NAMES[name]
        if name.startswith(f"{LAYERS}."):
            return f"{CHECKPOINT_BASE}.{name.removeprefix(f'{BASE_MODEL}.')}"
        return name

    def our_name(self, stored: str) -> str:
        ours = {v: k for k, v in _CHECKPOINT_NAMES.items()}
        if stored in ours:
            return ours[stored]
        if stored.startswith(f"{CHECKPOINT_BASE}.layers."):
            return f"{BASE_MODEL}.{stored.removeprefix(f'{CHECKPOINT_BASE}.')}"
        return stored

    def tensors_contradiction(self, config: ModelConfig, names: Collection[str]) -> str | None:
        """A layer whose mixer tensors are all of one kind other than the one config.json's layer
        keys give it, or mixers stored for more or fewer layers than the keys list (a layer
        holding tensors of several kinds is no one mixer: its tensors are reported)."""
        f: HybridFields = config.family_config
        found: dict[int, dict[str, str]] = {}  # layer -> {the kind its mixer tensors are: the first one}
        for name in names:
            where = split_layer(name)
            if where is None or not where[1].startswith(f"{MIXER}."):
                continue
            child = where[1].split(".")[1]
            kind = _KIND_OF_CHILD.get(child)
            if kind is not None:
                first = found.setdefault(where[0], {}).setdefault(kind, name)
                if _rank(name) < _rank(first):  # the example named: the kind's first module, whatever the order
                    found[where[0]][kind] = name
        kinds = f.layer_kinds
        for layer in sorted(found):
            if len(found[layer]) != 1:
                continue
            ((stored, example),) = found[layer].items()
            named = self.checkpoint_name(example)
            tensors = f"the checkpoint's layer {layer} holds {KIND_NAMES[stored]} tensors ({named})"
            if layer >= len(kinds):
                return f"{_layer_keys(f)} {len(kinds)} layers, but {tensors}"
            if stored != kinds[layer]:
                return f"{_layer_keys(f, layer)}, but {tensors}"
        stored_layers = max(found, default=-1) + 1
        if 0 < stored_layers < len(kinds) and all(i in found for i in range(stored_layers)):
            return (
                f"{_layer_keys(f)} {len(kinds)} layers, but the checkpoint holds mixers of layers "
                f"0-{stored_layers - 1} only ({stored_layers})"
            )
        return None

    def tp_problems(self, config: ModelConfig, tp: int) -> list[str]:
        """vLLM's MambaMixer2 shards in_proj's z | x | B | C | dt pieces, conv1d and the SSM
        parameters by Mamba heads (it asserts the degree divides them); B and C by groups, which a
        degree that does not divide them replicates to follow the head shards (so the degree must be
        a multiple of the group count then). out_proj's input K is checked per module (row split)."""
        f: HybridFields = config.family_config
        if MAMBA not in f.layer_kinds:
            return []
        problems = []
        if f.mamba_num_heads % tp:
            problems.append(
                f"mamba_num_heads = {f.mamba_num_heads} does not split into {tp} equal shards (TP {tp}: "
                f"vLLM shards in_proj's pieces, conv1d, A, D and dt_bias by Mamba heads)"
            )
        if f.n_groups % tp and tp % f.n_groups:
            problems.append(
                f"n_groups = {f.n_groups} neither splits into {tp} shards nor replicates evenly over "
                f"them (TP {tp}: B and C follow the head shards)"
            )
        return problems

    def export_warnings(self, config: ModelConfig, fmt: str, quant: str) -> list[str]:
        """A MoE hybrid in compressed-tensors NVFP4: vLLM's fused-MoE layer refuses compressed-tensors
        NVFP4 for non-gated experts (vllm-project/vllm#31782, open when we read it), while NVIDIA's
        own NVFP4 MoE hybrids are ModelOpt checkpoints (our default format), which it serves."""
        nvfp4 = quant in ("nvfp4", "nvfp4-weight-only")
        if MOE in config.family_config.layer_kinds and fmt == "compressed-tensors" and nvfp4:
            return [
                "warning: vLLM does not serve a MoE hybrid's non-gated experts from compressed-tensors "
                "NVFP4 (vllm-project/vllm#31782); --format modelopt (the default) is the layout it serves"
            ]
        return []

    def layer_kind(self, config: ModelConfig, layer: int) -> str:
        return config.family_config.layer_kinds[layer]

    def mlp_module(self, config: ModelConfig, layer: int) -> str:
        return f"{layer_prefix(layer)}.{MIXER}"

    def layer_tensors(self, config: ModelConfig, layer: int) -> list[Tensor]:
        f: HybridFields = config.family_config
        E, p = config.hidden_size, layer_prefix(layer)
        mixer = f"{p}.{MIXER}"
        tensors = [Tensor(f"{p}.norm.weight", (E,))]
        kind = f.layer_kinds[layer]
        if kind == MAMBA:
            conv, heads = f.mamba_inner + 2 * f.n_groups * f.ssm_state_size, f.mamba_num_heads
            tensors += projection_tensors(mixer, (MAMBA_IN,), ((f.in_proj_rows(), E),), (f.use_bias,))
            tensors.append(Tensor(f"{mixer}.conv1d.weight", (conv, 1, f.conv_kernel)))
            if f.use_conv_bias:
                tensors.append(Tensor(f"{mixer}.conv1d.bias", (conv,)))
            tensors += [Tensor(f"{mixer}.{name}", (heads,)) for name in ("dt_bias", "A_log", "D")]
            tensors.append(Tensor(f"{mixer}.norm.weight", (f.mamba_inner,)))
            tensors += projection_tensors(mixer, (MAMBA_OUT,), ((E, f.mamba_inner),), (f.use_bias,))
        elif kind == ATTENTION:
            q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
            tensors += projection_tensors(mixer, ATTENTION_PROJECTIONS, ((q, E), (kv, E), (kv, E), (E, q)))
        elif kind == MLP:
            F = config.intermediate_size
            tensors += projection_tensors(mixer, RELU2, ((F, E), (E, F)))
        else:
            e = f.experts
            width, Fe, Fs = e.moe_latent_size or E, e.moe_intermediate_size, e.moe_shared_expert_intermediate_size
            tensors += projection_tensors(mixer, (ROUTER,), ((e.n_routed_experts, E),))
            tensors.append(Tensor(f"{mixer}.gate.e_score_correction_bias", (e.n_routed_experts,)))
            for x in range(e.n_routed_experts):
                tensors += projection_tensors(
                    f"{mixer}.experts.{x}", RELU2, ((Fe, width), (width, Fe)), expert=x, block=mixer
                )
            tensors += projection_tensors(f"{mixer}.shared_experts", RELU2, ((Fs, E), (E, Fs)), block=mixer)
            if e.moe_latent_size:
                tensors += projection_tensors(mixer, LATENT, ((width, E), (E, width)))
        return tensors

    def folds(self, config: ModelConfig, layer: int) -> list:
        raise NVFP4ToolError(
            "nemotron_h: equivalent scaling (--equalize) is not built for the hybrid "
            "family yet (its relu2 MLPs and Mamba mixers fold differently)"
        )


def _rank(name: str) -> tuple[int, str]:
    """Where a mixer tensor's module comes in its kind's `_MIXER_CHILDREN`, then the name."""
    child = split_layer(name)[1].split(".")[1]
    return _MIXER_CHILDREN[_KIND_OF_CHILD[child]].index(child), name


def _layer_keys(f: HybridFields, layer: int | None = None) -> str:
    """config.json's layer keys as the source gave them: "config.json's hybrid_override_pattern
    lists" (`layer` None), or "... says layer 3 is '*' (attention)"."""
    keys = " and ".join(f.hf_layers) or "layer kinds"
    plural = len(f.hf_layers) != 1
    if layer is None:
        return f"config.json's {keys} {'list' if plural else 'lists'}"
    kind = KIND_NAMES[f.layer_kinds[layer]]
    spelled = " and ".join(repr(raw[layer]) for raw in f.hf_layers.values())
    return f"config.json's {keys} {'say' if plural else 'says'} layer {layer} is " + (
        f"{spelled} ({kind})" if spelled else kind
    )


def nvidia_nano_keep_bf16(config: ModelConfig) -> list[str]:
    """The modules NVIDIA's published NVFP4 Nemotron-3-Nano keeps in BF16 beyond lm_head, the
    routers and conv1d (never quantized here): every attention layer and the Mamba layer feeding
    each (the closest Mamba layer before it), as keep-BF16 patterns of whole mixers
    (`model.layers.{i}.mixer.*`), in layer order. With `export --kv-cache fp8` this is that
    checkpoint's recipe (its model card and the Nemotron 3 Nano report, section 4)."""
    kinds = config.family_config.layer_kinds
    kept = set()
    for i, kind in enumerate(kinds):
        if kind == ATTENTION:
            kept.add(i)
            feeding = next((j for j in range(i - 1, -1, -1) if kinds[j] == MAMBA), None)
            if feeding is not None:
                kept.add(feeding)
    return [f"{layer_prefix(i)}.{MIXER}.*" for i in sorted(kept)]


FAMILIES = (HybridDecoder(),)
