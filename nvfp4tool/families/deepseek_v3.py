"""The DeepSeek-V3 family (HF `model_type: deepseek_v3`, `DeepseekV3ForCausalLM`; DeepSeek-R1 and
Kimi-K2 share it): multi-head latent attention (MLA) and DeepSeekMoE, its config.json fields in one
record (`MLAFields`, `ModelConfig.family_config`), its tensors, tensor-parallel splits and folds.

    family = get_family("deepseek_v3"); f = config.family_config   # MLAFields
    config.layer_kind(0)            # "mla+mlp" below first_k_dense_replace, "mla+moe" after
    parameter_count(config)         # (total, active per token)

The blocks are `model/deepseek_v3.py`'s.
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
    ATTENTION,
    INPUT_NORM,
    O_PROJ,
    POST_ATTENTION_NORM,
    ROUTER,
    SWIGLU,
    Family,
    Fold,
    LayerAttention,
    ModelConfig,
    Projection,
    Q,
    Tensor,
    layer_prefix,
    preset_shape,
    projection_tensors,
    split_layer,
)
from nvfp4tool.families.hf_values import flag, integer, number
from nvfp4tool.families.maxtext import NamedModel, Rule, dense_mlp_rules, layer_norm_rules, model_rules, moe_rules
from nvfp4tool.families.rope_scaling import YarnRopeScaling, yarn_mscale

MLA_MLP, MLA_MOE = "mla+mlp", "mla+moe"  # a layer's kinds: MLA, then a dense SwiGLU MLP / DeepSeekMoE
# vLLM (model_executor/models/deepseek_v2.py): q_a_proj and kv_a_proj_with_mqa replicated (fused into one
# `fused_qkv_a_proj` GEMM when q_lora_rank is set: one group), q_b_proj / kv_b_proj column, o_proj row
Q_A = Projection("q_a_proj", "q_a", "none", "qkv_a")
Q_B = Projection("q_b_proj", "q_b", "column")
KV_A = Projection("kv_a_proj_with_mqa", "kv_a", "none", "qkv_a")
KV_B = Projection("kv_b_proj", "kv_b", "column")
NORM_EPS = 1e-6  # transformers' q_a_layernorm / kv_a_layernorm epsilon whatever rms_norm_eps says
SHARED = "shared_experts"
# config.json keys the family models (the rest is kept as given)
_KEYS = frozenset(
    {
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "qk_head_dim",
        "v_head_dim",
        "rope_interleave",
        "n_routed_experts",
        "num_local_experts",
        "num_experts_per_tok",
        "n_shared_experts",
        "moe_intermediate_size",
        "first_k_dense_replace",
        "n_group",
        "topk_group",
        "routed_scaling_factor",
        "norm_topk_prob",
        "scoring_func",
        "topk_method",
        "num_nextn_predict_layers",
        "attention_bias",
    }
)


@dataclasses.dataclass(frozen=True)
class MLAFields:
    """The family's own config.json fields (`ModelConfig.family_config`)."""

    q_lora_rank: int | None  # None: one q_proj; else q_a_proj -> q_a_layernorm -> q_b_proj
    kv_lora_rank: int  # R: the latent KV width (what is cached)
    qk_nope_head_dim: int  # the part of a query / key head without RoPE
    qk_rope_head_dim: int  # the rotated part (one key head shared by every query head)
    v_head_dim: int
    rope_interleave: bool  # the rotated part's pairs are (x0, x1), (x2, x3), ... (DeepSeek's layout)
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int  # one shared SwiGLU MLP n_shared_experts x moe_intermediate_size wide
    moe_intermediate_size: int
    first_k_dense_replace: int  # layers below it are dense (intermediate_size), the rest MoE
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    num_nextn_predict_layers: int  # MTP layers the source had (stored at layer index num_hidden_layers..)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def parse_fields(hf: Mapping[str, Any]) -> MLAFields:
    """The fields from config.json `hf` (KeyError for a missing required key, NVFP4ToolError naming
    a bad value or an option transformers and vLLM would compute differently)."""
    scoring = hf.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise NVFP4ToolError(f"scoring_func={scoring!r} unsupported; supported: sigmoid (transformers' only)")
    method = hf.get("topk_method", "noaux_tc")
    if method != "noaux_tc":
        raise NVFP4ToolError(
            f"topk_method={method!r} unsupported; supported: noaux_tc (transformers always routes with "
            "e_score_correction_bias; vLLM does so for noaux_tc only)"
        )
    if integer(hf, "moe_layer_freq", 1) != 1:
        raise NVFP4ToolError(
            f"moe_layer_freq={hf['moe_layer_freq']} unsupported; supported: 1 (transformers ignores it, "
            "vLLM makes only every moe_layer_freq-th layer sparse)"
        )
    if flag(hf, "attention_bias"):
        raise NVFP4ToolError("attention_bias=true unsupported (vLLM builds MLA without biases)")
    counts = {k: integer(hf, k) for k in ("n_routed_experts", "num_local_experts") if hf.get(k) is not None}
    if len(set(counts.values())) > 1:
        raise NVFP4ToolError(" and ".join(f"{k}={v}" for k, v in counts.items()) + " disagree")
    if not counts:
        raise KeyError("n_routed_experts")
    return MLAFields(
        q_lora_rank=integer(hf, "q_lora_rank", None),
        kv_lora_rank=integer(hf, "kv_lora_rank"),
        qk_nope_head_dim=integer(hf, "qk_nope_head_dim"),
        qk_rope_head_dim=integer(hf, "qk_rope_head_dim"),
        v_head_dim=integer(hf, "v_head_dim"),
        rope_interleave=flag(hf, "rope_interleave", True),
        n_routed_experts=next(iter(counts.values())),
        num_experts_per_tok=integer(hf, "num_experts_per_tok"),
        n_shared_experts=integer(hf, "n_shared_experts", 1),
        moe_intermediate_size=integer(hf, "moe_intermediate_size"),
        first_k_dense_replace=integer(hf, "first_k_dense_replace", 0),
        n_group=integer(hf, "n_group", 1),
        topk_group=integer(hf, "topk_group", 1),
        routed_scaling_factor=number(hf, "routed_scaling_factor", 1.0),
        norm_topk_prob=flag(hf, "norm_topk_prob", True),
        num_nextn_predict_layers=integer(hf, "num_nextn_predict_layers", 0),
    )


def field_problems(f: MLAFields, layers: int) -> list[str]:
    """Combinations the model cannot run (each a sentence naming the keys)."""
    problems = []
    positive = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "moe_intermediate_size")
    problems += [f"{k} must be a positive integer, got {getattr(f, k)!r}" for k in positive if getattr(f, k) < 1]
    if f.q_lora_rank is not None and f.q_lora_rank < 1:
        problems.append(f"q_lora_rank must be a positive integer or null, got {f.q_lora_rank!r}")
    if f.v_head_dim > f.qk_head_dim:
        problems.append(
            f"v_head_dim={f.v_head_dim} wider than qk_nope_head_dim + qk_rope_head_dim={f.qk_head_dim} unsupported "
            "(the values are padded to the query width, as vLLM does)"
        )
    if f.qk_rope_head_dim % 2:
        problems.append(f"qk_rope_head_dim={f.qk_rope_head_dim} must be even (RoPE rotates pairs)")
    if not 0 <= f.first_k_dense_replace <= layers:
        problems.append(
            f"first_k_dense_replace must be in 0..num_hidden_layers={layers}, got {f.first_k_dense_replace}"
        )
    n = f.n_routed_experts
    if not 1 <= f.num_experts_per_tok <= n:
        problems.append(f"num_experts_per_tok must be in 1..n_routed_experts={n}, got {f.num_experts_per_tok}")
    elif f.n_group < 1 or n % f.n_group:
        problems.append(f"n_routed_experts={n} is not a multiple of n_group={f.n_group}")
    elif not 1 <= f.topk_group <= f.n_group:
        problems.append(f"topk_group must be in 1..n_group={f.n_group}, got {f.topk_group}")
    elif n // f.n_group < 2:
        problems.append("grouped routing scores each group by its two best experts: n_routed_experts / n_group < 2")
    elif f.num_experts_per_tok > f.topk_group * (n // f.n_group):
        problems.append(
            f"num_experts_per_tok={f.num_experts_per_tok} exceeds the experts of the topk_group={f.topk_group} groups"
        )
    if f.n_shared_experts < 1:
        problems.append(f"n_shared_experts={f.n_shared_experts} unsupported; supported: >= 1")
    if not (f.routed_scaling_factor > 0 and math.isfinite(f.routed_scaling_factor)):
        problems.append(f"routed_scaling_factor must be finite and > 0, got {f.routed_scaling_factor}")
    if f.num_nextn_predict_layers < 0:
        problems.append(f"num_nextn_predict_layers must be >= 0, got {f.num_nextn_predict_layers}")
    return problems


# the tiny preset: the tiny shape's width and depth, one dense layer, 8 experts 96 wide in 2 groups
# (top-2 of the best group), one shared expert; every in_features a multiple of 16
_TINY = MLAFields(
    q_lora_rank=64,
    kv_lora_rank=32,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    rope_interleave=True,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=96,
    first_k_dense_replace=1,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    num_nextn_predict_layers=0,
)


# ------------------------------------------------------------------------------ MaxText layout
# MaxText's deepseek decoder (docs/design/maxtext-layout.md): the first_k_dense_replace dense layers
# in stack `dense_layers`, the MoE layers in `moe_layers`, each scanned on its own.
DENSE_STACK, MOE_STACK = "dense_layers", "moe_layers"
MOE_BLOCK = "DeepSeekMoeBlock_0"  # MaxText's DeepSeekMoE: its routed `MoeBlock_0` and `shared_experts`


def _qk_head_dim(config: ModelConfig) -> int:
    return config.family_config.qk_head_dim


def _kv_b_head_dim(config: ModelConfig) -> int:
    return config.family_config.qk_nope_head_dim + config.family_config.v_head_dim


def _v_head_dim(config: ModelConfig) -> int:
    return config.family_config.v_head_dim


def _mla_rules(stack: str) -> tuple[Rule, ...]:
    """The two norms and MLA of a layer in MaxText stack `stack` (q_proj or q_a_proj / q_a_layernorm
    / q_b_proj, whichever the model has); no RoPE rows permuted, no query scale."""
    a = f"{layer_prefix('{i}')}.{ATTENTION}"
    return layer_norm_rules(stack) + (
        Rule(
            f"{a}.q_proj.weight",
            "self_attention/query/kernel",
            "heads_in",
            stack=stack,
            head_dim=_qk_head_dim,
            optional=True,
        ),
        Rule(f"{a}.q_a_proj.weight", "self_attention/wq_a/kernel", "transpose", stack=stack, optional=True),
        Rule(f"{a}.q_a_layernorm.weight", "self_attention/q_norm/scale", "identity", stack=stack, optional=True),
        Rule(
            f"{a}.q_b_proj.weight",
            "self_attention/wq_b/kernel",
            "heads_in",
            stack=stack,
            head_dim=_qk_head_dim,
            optional=True,
        ),
        Rule(f"{a}.kv_a_proj_with_mqa.weight", "self_attention/wkv_a/kernel", "transpose", stack=stack),
        Rule(f"{a}.kv_a_layernorm.weight", "self_attention/kv_norm/scale", "identity", stack=stack),
        Rule(f"{a}.kv_b_proj.weight", "self_attention/wkv_b/kernel", "heads_in", stack=stack, head_dim=_kv_b_head_dim),
        Rule(f"{a}.o_proj.weight", "self_attention/out/kernel", "heads_out", stack=stack, head_dim=_v_head_dim),
    )


def _maxtext_rules() -> tuple[Rule, ...]:
    mlp = f"{layer_prefix('{i}')}.mlp"
    return (
        model_rules()
        + _mla_rules(DENSE_STACK)
        + dense_mlp_rules(stack=DENSE_STACK)
        + _mla_rules(MOE_STACK)
        + moe_rules(f"{MOE_BLOCK}/MoeBlock_0", "mlp", ("gate_proj", "up_proj", "down_proj"), stack=MOE_STACK)
        + (
            Rule(
                f"{mlp}.gate.e_score_correction_bias", f"{MOE_BLOCK}/MoeBlock_0/gate/bias", "identity", stack=MOE_STACK
            ),
        )
        + dense_mlp_rules(f"mlp.{SHARED}", f"{MOE_BLOCK}/{SHARED}", stack=MOE_STACK)
    )


# MaxText's `deepseek3-671b` (its DeepSeek converter's MODEL_PARAMS_DICT: 61 layers, 3 dense, 128
# heads, emb 7168, 256 experts, q_lora_rank 1536, kv_lora_rank 512, head dims 128 / 64 / 128): the
# config.json of the DeepSeek-V3 release, which has that geometry
DEEPSEEK3_671B = NamedModel(
    {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "n_shared_experts": 1,
        "n_routed_experts": 256,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "qk_nope_head_dim": 128,
        "topk_method": "noaux_tc",
        "n_group": 8,
        "topk_group": 4,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "hidden_act": "silu",
        "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
        },
        "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
    },
    rope_layout="interleaved",
)


class DeepseekV3(Family):
    """`deepseek_v3`: pre-norm layers of MLA + a dense SwiGLU MLP (layers < first_k_dense_replace) or
    DeepSeekMoE (sigmoid router with e_score_correction_bias in FP32, grouped top-k, routed experts
    and one shared expert)."""

    model_type = "deepseek_v3"
    architecture = "DeepseekV3ForCausalLM"
    blocks_module = "nvfp4tool.model.deepseek_v3"
    modeled_keys = _KEYS
    projections = (Q_A, Q_B, KV_A, KV_B)
    router_blocks = ("mlp",)
    # the router in FP32, as transformers keeps it (`_keep_in_fp32_modules_strict`) and vLLM reads it
    stored_fp32 = ("*.mlp.gate.weight", "*.mlp.gate.e_score_correction_bias")
    kept_as_stored = ("*norm*", "*.mlp.gate.*")
    may_be_zero = ("*.mlp.gate.e_score_correction_bias",)  # zero until aux-loss-free balancing moves it
    presets = types.MappingProxyType(
        {
            "tiny-deepseek": preset_shape(
                "tiny", num_kv_heads=4, head_dim=_TINY.qk_rope_head_dim, rms_norm_eps=NORM_EPS, family_config=_TINY
            )
        }
    )
    maxtext_rules = _maxtext_rules()
    maxtext_models = types.MappingProxyType({"deepseek3-671b": DEEPSEEK3_671B})
    maxtext_rope_layout = "interleaved"  # MaxText's deepseek RoPE pairs (x0, x1), ...: HF's rows as stored

    def maxtext_stacks(self, config: ModelConfig) -> dict[str, range]:
        k = config.family_config.first_k_dense_replace
        return {DENSE_STACK: range(0, k), MOE_STACK: range(k, config.num_layers)}

    def maxtext_refusal(self, config: ModelConfig) -> str | None:
        """rope_interleave=false: MaxText's deepseek decoder rotates interleaved pairs and its
        converter permutes no rows, so half-split rows have no layout there."""
        if config.family_config.rope_interleave:
            return None
        return (
            "deepseek_v3 with rope_interleave=false has no MaxText layout: MaxText's deepseek decoder "
            "rotates interleaved pairs and its converter stores q/k rows as given"
        )

    def parse(self, hf: Mapping[str, Any], source: str) -> dict[str, Any]:
        try:
            fields = parse_fields(hf)
        except KeyError as missing:
            raise NVFP4ToolError(f"{source}: deepseek_v3 needs {missing.args[0]}") from None
        except NVFP4ToolError as bad:
            raise NVFP4ToolError(f"{source}: {bad}") from None
        # transformers derives head_dim (its RoPE width) from qk_rope_head_dim, whatever config.json says
        return {"family_config": fields, "head_dim": fields.qk_rope_head_dim}

    def emit(self, config: ModelConfig, hf: dict[str, Any]) -> None:
        f: MLAFields = config.family_config
        hf.update({k: v for k, v in dataclasses.asdict(f).items()})
        # vLLM reads these (its defaults: softmax, no correction bias); transformers' save omits them
        hf.update(
            scoring_func="sigmoid",
            topk_method="noaux_tc",
            qk_head_dim=f.qk_head_dim,
            head_dim=f.qk_rope_head_dim,
            attention_bias=False,
        )
        hf.pop("num_local_experts", None)

    def problems(self, config: ModelConfig) -> list[str]:
        f = config.family_config
        if not isinstance(f, MLAFields):
            return [f"deepseek_v3 needs its fields (family_config=MLAFields(...)), got {f!r}"]
        problems = field_problems(f, config.num_layers)
        if config.head_dim != f.qk_rope_head_dim:
            problems.append(
                f"head_dim={config.head_dim} must be qk_rope_head_dim={f.qk_rope_head_dim} (the RoPE width)"
            )
        if config.num_kv_heads != config.num_heads:
            problems.append("num_key_value_heads must equal num_attention_heads (MLA expands every head)")
        if config.rms_norm_eps != NORM_EPS:
            problems.append(
                f"rms_norm_eps={config.rms_norm_eps} unsupported; supported: {NORM_EPS} (transformers' "
                f"q_a / kv_a layernorms use {NORM_EPS}, vLLM's rms_norm_eps: they agree only there)"
            )
        if config.qk_norm or config.attention_bias or config.o_proj_bias or config.sliding_window is not None:
            problems.append("deepseek_v3 attention has no q/k norm, no bias and no sliding window")
        return problems

    def layer_attention(self, config: ModelConfig, layer: int) -> LayerAttention:
        """Every layer alike: RoPE over qk_rope_head_dim at config.json's base and scaling; the
        softmax scale 1/sqrt(qk_nope_head_dim + qk_rope_head_dim), times mscale(factor,
        mscale_all_dim)^2 under YaRN scaling with mscale_all_dim (transformers' `yarn_apply_mscale`,
        vLLM's DeepseekV2MLAAttention: the non-rotary dims are scaled too)."""
        f: MLAFields = config.family_config
        scale = f.qk_head_dim**-0.5
        s = config.rope_scaling
        if isinstance(s, YarnRopeScaling) and s.mscale_all_dim:
            scale = scale * yarn_mscale(s.factor, s.mscale_all_dim) ** 2
        return LayerAttention(
            None, config.rope_theta, config.rope_scaling, rope_dim=f.qk_rope_head_dim, softmax_scale=scale
        )

    def layer_kind(self, config: ModelConfig, layer: int) -> str:
        return MLA_MLP if layer < config.family_config.first_k_dense_replace else MLA_MOE

    def layer_tensors(self, config: ModelConfig, layer: int) -> list[Tensor]:
        f: MLAFields = config.family_config
        E, H, p = config.hidden_size, config.num_heads, layer_prefix(layer)
        attention = f"{p}.{ATTENTION}"
        tensors = [Tensor(f"{p}.{INPUT_NORM}.weight", (E,))]
        if f.q_lora_rank is None:
            tensors += projection_tensors(attention, (Q,), ((H * f.qk_head_dim, E),))
        else:
            tensors += projection_tensors(attention, (Q_A,), ((f.q_lora_rank, E),))
            tensors.append(Tensor(f"{attention}.q_a_layernorm.weight", (f.q_lora_rank,)))
            tensors += projection_tensors(attention, (Q_B,), ((H * f.qk_head_dim, f.q_lora_rank),))
        tensors += projection_tensors(attention, (KV_A,), ((f.kv_lora_rank + f.qk_rope_head_dim, E),))
        tensors.append(Tensor(f"{attention}.kv_a_layernorm.weight", (f.kv_lora_rank,)))
        tensors += projection_tensors(
            attention,
            (KV_B, O_PROJ),
            ((H * (f.qk_nope_head_dim + f.v_head_dim), f.kv_lora_rank), (E, H * f.v_head_dim)),
        )
        tensors.append(Tensor(f"{p}.{POST_ATTENTION_NORM}.weight", (E,)))
        mlp = self.mlp_module(config, layer)
        if self.layer_kind(config, layer) == MLA_MLP:
            F = config.intermediate_size
            return tensors + projection_tensors(mlp, SWIGLU, ((F, E), (F, E), (E, F)))
        n, Fe = f.n_routed_experts, f.moe_intermediate_size
        tensors += projection_tensors(mlp, (ROUTER,), ((n, E),))
        tensors.append(Tensor(f"{mlp}.gate.e_score_correction_bias", (n,)))
        for e in range(n):
            tensors += projection_tensors(
                f"{mlp}.experts.{e}", SWIGLU, ((Fe, E), (Fe, E), (E, Fe)), expert=e, block=mlp
            )
        Fs = Fe * f.n_shared_experts
        return tensors + projection_tensors(f"{mlp}.{SHARED}", SWIGLU, ((Fs, E), (Fs, E), (E, Fs)), block=mlp)

    def tensors_contradiction(self, config: ModelConfig, names: Collection[str]) -> str | None:
        """Multi-token-prediction layers (tensors at layer index num_hidden_layers and above, as
        DeepSeek-V3's `model.layers.61.*`) are refused by name: transformers does not build them
        and vLLM's DeepseekV3ForCausalLM skips them, so they would be published unchecked."""
        mtp = sorted(
            (n for n in names if (w := split_layer(n)) is not None and w[0] >= config.num_layers),
            key=lambda n: (split_layer(n)[0], n),
        )
        if not mtp:
            return None
        return (
            f"tensor {mtp[0]!r} belongs to a multi-token-prediction layer (layer index >= "
            f"num_hidden_layers={config.num_layers}; num_nextn_predict_layers="
            f"{config.family_config.num_nextn_predict_layers}): MTP layers are not supported (transformers "
            f"does not build them, vLLM's DeepseekV3ForCausalLM skips them); remove them from the checkpoint"
        )

    def tp_problems(self, config: ModelConfig, tp: int) -> list[str]:
        """vLLM shards MLA by heads (q_b_proj / q_proj and kv_b_proj columns, o_proj rows; it asserts
        num_heads % tp == 0); q_a_proj and kv_a_proj_with_mqa are replicated on every rank."""
        if config.num_heads % tp:
            return [
                f"num_attention_heads = {config.num_heads} does not split into {tp} equal shards "
                f"(TP {tp}: vLLM shards MLA's q_b_proj, kv_b_proj and o_proj by heads)"
            ]
        return []

    def folds(self, config: ModelConfig, layer: int) -> list[Fold]:
        """The exact equivalent-scaling sites of an MLA layer: q_a_proj (or q_proj) and
        kv_a_proj_with_mqa after the input norm; q_b_proj after q_a_layernorm; kv_b_proj after
        kv_a_layernorm; gate/up after the post-attention norm (a MoE layer: every routed and the
        shared expert's, the router reading it too); each down_proj after its up_proj's rows. Not
        folded: o_proj (its input is attention over kv_b_proj's value rows, a subset of the rows
        `Fold` can scale)."""
        f: MLAFields = config.family_config
        p = layer_prefix(layer)
        a = f"{p}.{ATTENTION}"
        first = f"{a}.q_proj" if f.q_lora_rank is None else f"{a}.q_a_proj"
        folds = [Fold((first, f"{a}.kv_a_proj_with_mqa"), (f"{p}.{INPUT_NORM}.weight",), "norm")]
        if f.q_lora_rank is not None:
            folds.append(Fold((f"{a}.q_b_proj",), (f"{a}.q_a_layernorm.weight",), "norm"))
        folds.append(Fold((f"{a}.kv_b_proj",), (f"{a}.kv_a_layernorm.weight",), "norm"))
        mlp, post = self.mlp_module(config, layer), (f"{p}.{POST_ATTENTION_NORM}.weight",)
        if self.layer_kind(config, layer) == MLA_MLP:
            mlps, readers = [mlp], ()
        else:
            mlps = [f"{mlp}.experts.{e}" for e in range(f.n_routed_experts)] + [f"{mlp}.{SHARED}"]
            readers = (f"{mlp}.gate",)
        folds.append(Fold(tuple(f"{m}.{x}" for m in mlps for x in ("gate_proj", "up_proj")), post, "norm", readers))
        folds += [Fold((f"{m}.down_proj",), (f"{m}.up_proj.weight",), "rows") for m in mlps]
        return folds

    def export_problem(self, config: ModelConfig, kv_cache: str) -> str | None:
        """--kv-cache fp8 is refused: vLLM's MLA caches the normed latent and the rotated k_pe in one
        FP8 entry under the layer's k_scale alone (`concat_and_cache_mla`), which this tool's K / V
        scales (one per key, one per value) do not describe."""
        if kv_cache == "none":
            return None
        return (
            f"--kv-cache {kv_cache} is not built for deepseek_v3: vLLM's MLA caches the latent and k_pe "
            f"together under one k_scale (concat_and_cache_mla), not per-head K / V; export without --kv-cache"
        )


def parameter_count(config: ModelConfig) -> tuple[int, int]:
    """(total, active per token) parameters of `config`'s model from its geometry (the module
    table's tensors; MTP layers not counted): active leaves out the routed experts a token does
    not use (n_routed_experts - num_experts_per_tok per MoE layer); the embedding counts as a table."""
    f: MLAFields = config.family_config
    shapes = config.modules.tensor_shapes
    total = sum(math.prod(s) for s in shapes.values())
    expert = sum(
        math.prod(shapes[f"{config.mlp_prefix(i)}.experts.0.{x}.weight"])
        for i in range(config.num_layers)
        if config.layer_kind(i) == MLA_MOE
        for x in ("gate_proj", "up_proj", "down_proj")
    )
    return total, total - (f.n_routed_experts - f.num_experts_per_tok) * expert


FAMILIES = (DeepseekV3(),)
