"""The mixture-of-experts group: qwen3_moe (Qwen3-MoE) and mixtral (Mixtral).

Attention as the Llama group's (Qwen3's with q/k norm and `attention_bias`; Mistral's with
`sliding_window`); the MLP of a sparse layer ("attention+moe") is a router and experts:
  qwen3_moe  `mlp.gate` router, `mlp.experts.{e}.{gate,up,down}_proj` of width
             `moe_intermediate_size`, top-k of the softmax renormalised when `norm_topk_prob`, the
             routing weights rounded to the logits' dtype (as transformers); dense MLP
             (`intermediate_size`) in `mlp_only_layers` and in layers where
             (i + 1) % decoder_sparse_step != 0, as transformers decides.
  mixtral    every MLP sparse: `block_sparse_moe.gate`, `block_sparse_moe.experts.{e}.{w1,w3,w2}`
             (= gate/up/down) of width `intermediate_size`, top-k renormalised.
The blocks are `model/decoder.py`'s `DecoderBlock` with a `SparseMoE`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.families.base import (
    ATTENTION_MLP,
    ATTENTION_MOE,
    ROUTER,
    ModelConfig,
    Projection,
    Tensor,
    layer_prefix,
    projection_tensors,
)
from nvfp4tool.families.hf_values import flag, integer, number
from nvfp4tool.families.llama import Decoder, llama3_preset
from nvfp4tool.families.maxtext import NamedModel, Rule, moe_rules

EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts")  # HF spells the expert count either way


@dataclasses.dataclass(frozen=True)
class Experts:
    """A mixture-of-experts family's own config fields (`ModelConfig.family_config`, read as
    `config.family_spec.experts(config)`); validated by the family (`SparseDecoder.problems`) with the whole config."""

    num_experts: int  # experts of a sparse MLP
    num_experts_per_tok: int  # k of the top-k routing
    moe_intermediate_size: int = 0  # an expert's SwiGLU width (qwen3_moe; mixtral: intermediate_size)
    norm_topk_prob: bool = False  # renormalise the k chosen probabilities to sum to 1 (mixtral: always)
    decoder_sparse_step: int = 1  # qwen3_moe: layer i is sparse iff (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here
    router_aux_loss_coef: float = 0.0  # weight of the load-balancing loss in training
    # The key the source config.json names the expert count with ("num_experts" on the Hub for
    # qwen3_moe, "num_local_experts" for mixtral and as transformers 5 writes both), kept on write-back.
    hf_experts_key: str = dataclasses.field(default="", compare=False)


class SparseDecoder(Decoder):
    """A decoder whose sparse layers route each token to the top-k of `num_experts` SwiGLU experts."""

    def __init__(
        self,
        model_type: str,
        architecture: str,
        *,
        block: str,
        experts: tuple[Projection, ...],
        maxtext_block: str,
        **attention: Any,
    ) -> None:
        self.block = block  # the sparse MLP's attribute: "mlp" | "block_sparse_moe"
        self.expert_projections = experts  # an expert's (gate, up, down)
        self.router_blocks = (block,)
        self.maxtext_block = maxtext_block  # MaxText's name of the sparse block
        super().__init__(model_type, architecture, **attention)
        self.routing_weights_in_logits_dtype = model_type == "qwen3_moe"
        self.modeled_keys = self.modeled_keys | {
            *EXPERT_COUNT_KEYS,
            "num_experts_per_tok",
            "moe_intermediate_size",
            "norm_topk_prob",
            "decoder_sparse_step",
            "mlp_only_layers",
            "router_aux_loss_coef",
        }

    def parse(self, hf: Mapping[str, Any], source: str) -> dict[str, Any]:
        fields = super().parse(hf, source)
        if hf.get("router_jitter_noise"):
            raise NVFP4ToolError(f"router_jitter_noise={hf['router_jitter_noise']} unsupported; supported: 0")
        keys = [k for k in EXPERT_COUNT_KEYS if k in hf]
        if not keys:
            raise KeyError(" or ".join(EXPERT_COUNT_KEYS))
        counts = {k: integer(hf, k) for k in keys}
        if len(set(counts.values())) > 1:  # transformers keeps one of them, which one depends on the family
            raise NVFP4ToolError(
                " and ".join(f"{k}={v}" for k, v in counts.items())
                + " disagree: the expert count must be given once (or twice, equal)"
            )
        key = keys[0]
        common = dict(
            num_experts=counts[key],
            num_experts_per_tok=integer(hf, "num_experts_per_tok"),
            router_aux_loss_coef=number(hf, "router_aux_loss_coef", 0.001),
            hf_experts_key=key,
        )
        if self.model_type == "mixtral":
            return dict(fields, family_config=Experts(**common, norm_topk_prob=True))
        only = hf.get("mlp_only_layers") or ()
        if not isinstance(only, (list, tuple)):
            raise NVFP4ToolError(f"mlp_only_layers must be a list of layer indices, got {only!r}")
        return dict(
            fields,
            family_config=Experts(
                **common,
                moe_intermediate_size=integer(hf, "moe_intermediate_size"),
                norm_topk_prob=flag(hf, "norm_topk_prob"),
                decoder_sparse_step=integer(hf, "decoder_sparse_step", 1),
                mlp_only_layers=tuple(integer({"mlp_only_layers": i}, "mlp_only_layers") for i in only),
            ),
        )

    def emit_mlp(self, config: ModelConfig, hf: dict[str, Any]) -> None:
        x = config.family_config  # its `Experts`
        hf[x.hf_experts_key or EXPERT_COUNT_KEYS[self.model_type == "mixtral"]] = x.num_experts
        hf["num_experts_per_tok"] = x.num_experts_per_tok
        hf["router_aux_loss_coef"] = x.router_aux_loss_coef
        if self.model_type == "qwen3_moe":
            hf.update(
                moe_intermediate_size=x.moe_intermediate_size,
                norm_topk_prob=x.norm_topk_prob,
                decoder_sparse_step=x.decoder_sparse_step,
                mlp_only_layers=list(x.mlp_only_layers),
            )

    def mlp_problems(self, config: ModelConfig) -> list[str]:
        x = config.family_config  # its `Experts`
        if not isinstance(config.family_config, Experts):
            return [
                f"{self.model_type} needs its experts' fields (family_config=Experts(...)), "
                f"got {config.family_config!r}"
            ]
        problems = []
        if not (isinstance(x.num_experts, int) and x.num_experts >= 1):
            problems.append(f"num_experts must be a positive integer, got {x.num_experts!r}")
        elif not (isinstance(x.num_experts_per_tok, int) and 1 <= x.num_experts_per_tok <= x.num_experts):
            problems.append(
                f"num_experts_per_tok must be in 1..num_experts={x.num_experts}, got {x.num_experts_per_tok!r}"
            )
        if not (isinstance(x.decoder_sparse_step, int) and x.decoder_sparse_step >= 1):
            problems.append(f"decoder_sparse_step must be a positive integer, got {x.decoder_sparse_step!r}")
        bad_layers = [i for i in x.mlp_only_layers if not (isinstance(i, int) and 0 <= i < config.num_layers)]
        if bad_layers:
            problems.append(f"mlp_only_layers {bad_layers[0]!r} is not a layer index in 0..{config.num_layers - 1}")
        if not (x.router_aux_loss_coef >= 0 and math.isfinite(x.router_aux_loss_coef)):
            problems.append(f"router_aux_loss_coef must be finite and >= 0, got {x.router_aux_loss_coef}")
        if self.model_type == "qwen3_moe" and not (
            isinstance(x.moe_intermediate_size, int) and x.moe_intermediate_size > 0
        ):
            problems.append(f"moe_intermediate_size must be a positive integer, got {x.moe_intermediate_size!r}")
        if self.model_type == "mixtral" and (
            x.moe_intermediate_size or not x.norm_topk_prob or x.decoder_sparse_step != 1 or x.mlp_only_layers
        ):
            problems.append(
                "mixtral experts are intermediate_size wide, renormalise the top-k "
                "(norm_topk_prob) and every layer is sparse"
            )
        return problems

    # ----------------------------------------------------------------------------- layers

    def experts(self, config: ModelConfig) -> Experts:
        """The sparse MLPs' fields (experts, top-k, widths, which layers are sparse)."""
        return config.family_config

    @property
    def expert_attrs(self) -> tuple[str, str, str]:
        """HF attributes of an expert's (gate, up, down): gate_proj/up_proj/down_proj, mixtral's w1/w3/w2."""
        return tuple(p.attr for p in self.expert_projections)  # type: ignore[return-value]

    def maxtext_refusal(self, config: ModelConfig) -> str | None:
        """Attention biases (`Decoder`), else dense layers: MaxText's decoders of these families
        make every layer sparse."""
        x = config.family_config  # its `Experts`
        dense = [i for i in range(config.num_layers) if not self.is_sparse(config, i)]
        if super().maxtext_refusal(config) is not None or not dense:
            return super().maxtext_refusal(config)
        return (
            f"{self.model_type} with dense layers {dense} (mlp_only_layers={list(x.mlp_only_layers)}, "
            f"decoder_sparse_step={x.decoder_sparse_step}) has no MaxText layout: MaxText's "
            f"{self.model_type} decoder makes every layer sparse"
        )

    def maxtext_mlp_rules(self) -> tuple[Rule, ...]:
        # MaxText's decoders of these families make every layer sparse (`maxtext_refusal` refuses dense ones)
        return moe_rules(self.maxtext_block, self.block, tuple(p.attr for p in self.expert_projections))

    def is_sparse(self, config: ModelConfig, layer: int) -> bool:
        x = config.family_config  # its `Experts`
        return layer not in x.mlp_only_layers and (layer + 1) % x.decoder_sparse_step == 0

    def layer_kind(self, config: ModelConfig, layer: int) -> str:
        return ATTENTION_MOE if self.is_sparse(config, layer) else ATTENTION_MLP

    def mlp_module(self, config: ModelConfig, layer: int) -> str:
        return f"{layer_prefix(layer)}.{self.block if self.is_sparse(config, layer) else 'mlp'}"

    def expert_width(self, config: ModelConfig) -> int:
        """An expert's SwiGLU width (mixtral's experts use intermediate_size)."""
        x = config.family_config  # its `Experts`
        return x.moe_intermediate_size if self.model_type == "qwen3_moe" else config.intermediate_size

    def mlp_tensors(self, config: ModelConfig, layer: int) -> list[Tensor]:
        x = config.family_config  # its `Experts`
        if not self.is_sparse(config, layer):
            return super().mlp_tensors(config, layer)
        E, Fe = config.hidden_size, self.expert_width(config)
        block = self.mlp_module(config, layer)
        tensors = projection_tensors(block, (ROUTER,), ((x.num_experts, E),))
        for e in range(x.num_experts):
            tensors += projection_tensors(
                f"{block}.experts.{e}", self.expert_projections, ((Fe, E), (Fe, E), (E, Fe)), expert=e, block=block
            )
        return tensors


_QWEN_EXPERT = (
    Projection("gate_proj", "gate", "column", "gate_up"),
    Projection("up_proj", "up", "column", "gate_up"),
    Projection("down_proj", "down", "row"),
)
_MIXTRAL_EXPERT = (
    Projection("w1", "gate", "column", "gate_up"),
    Projection("w3", "up", "column", "gate_up"),
    Projection("w2", "down", "row"),
)

# ------------------------------------------------------------------------- MaxText model names
# (numbers: docs/design/converters.md, `converters/maxtext_models.py`)


def _mixtral(shape: tuple[int, int, int, int, int, int], vocab: int, context: int, aux_loss: float) -> NamedModel:
    """Mixtral of (hidden, heads, kv heads, layers, mlp, experts)."""
    hidden, heads, kv_heads, layers, mlp, experts = shape
    return NamedModel(
        {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "hidden_act": "silu",
            "hidden_size": hidden,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "num_hidden_layers": layers,
            "intermediate_size": mlp,
            "head_dim": 128,
            "vocab_size": vocab,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1e6,
            "max_position_embeddings": context,
            "sliding_window": None,
            "num_local_experts": experts,
            "num_experts_per_tok": 2,
            "router_aux_loss_coef": aux_loss,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
        }
    )


def _qwen3_moe(shape: tuple[int, int, int, int, int, int], rope_theta: float) -> NamedModel:
    """Qwen3-MoE of (hidden, heads, kv heads, layers, expert mlp, experts)."""
    hidden, heads, kv_heads, layers, expert_mlp, experts = shape
    return NamedModel(
        {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "hidden_act": "silu",
            "hidden_size": hidden,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "num_hidden_layers": layers,
            "intermediate_size": expert_mlp,
            "head_dim": 128,
            "vocab_size": 151936,
            "rms_norm_eps": 1e-6,
            "rope_theta": rope_theta,
            "max_position_embeddings": 262144,
            "num_experts": experts,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": expert_mlp,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "router_aux_loss_coef": 0.001,
            "attention_bias": False,
            "bos_token_id": 151643,
            "eos_token_id": 151645,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
        }
    )


# the tiny presets: the tiny Llama 3 shape with every MLP 8 SwiGLU experts 96 wide, top-2 routing
_TINY_EXPERTS = dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, router_aux_loss_coef=0.001)

FAMILIES = (
    SparseDecoder(
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        block="mlp",
        experts=_QWEN_EXPERT,
        maxtext_block="moe_block",
        bias="all",
        qk_norm=True,
        window="full",
        maxtext="unscaled",
        maxtext_models={
            "qwen3-30b-a3b": _qwen3_moe((2048, 32, 4, 48, 768, 128), 1e7),
            "qwen3-235b-a22b": _qwen3_moe((4096, 64, 4, 94, 1536, 128), 5e6),
            "qwen3-480b-a35b": _qwen3_moe((6144, 96, 8, 62, 2560, 160), 1e7),
        },
        maxtext_rope_layout="half",  # MaxText's one Qwen3-MoE decoder: half-split (no q/k rows permuted)
        presets={
            "tiny-moe": llama3_preset(
                "tiny", qk_norm=True, family_config=Experts(**_TINY_EXPERTS, moe_intermediate_size=96)
            )
        },
    ),
    SparseDecoder(
        "mixtral",
        "MixtralForCausalLM",
        block="block_sparse_moe",
        experts=_MIXTRAL_EXPERT,
        maxtext_block="MoeBlock_0",
        bias="none",
        qk_norm=False,
        window="sliding",
        maxtext="prescaled",
        maxtext_models={
            "mixtral-8x7b": _mixtral((4096, 32, 8, 32, 14336, 8), 32000, 32768, 0.02),
            "mixtral-8x22b": _mixtral((6144, 48, 8, 56, 16384, 8), 32768, 65536, 0.001),
        },
        maxtext_rope_layout="half",  # MaxText's one Mixtral decoder: half-split
        presets={"tiny-mixtral": llama3_preset("tiny", intermediate_size=96, family_config=Experts(**_TINY_EXPERTS))},
    ),
)
