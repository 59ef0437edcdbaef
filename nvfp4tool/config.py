"""Model configuration: the one description of a Llama-family model, to and from HF config.json.

`ModelConfig` is what the JAX model, the converters and the exporters agree on. It models the
fields that change the math (shapes, RoPE, biases, norms, tying, sliding window) and carries every
other key of the source config.json untouched (`hf_extra`) so writing it back loses nothing.

Supported families and options (anything else raises `NVFP4ToolError` naming what is supported):
  llama   Llama 2 / 3 / 3.1 / 3.2: optional llama3 RoPE frequency scaling, optional tied
          embeddings, optional `attention_bias` (bias on q/k/v AND o_proj, as HF does).
  mistral Mistral: optional `sliding_window` (every layer, as HF's MistralModel applies it).
  qwen2   Qwen2 / Qwen2.5: bias on q/k/v (never on o_proj); no per-layer sliding window.
  qwen3   Qwen3 (dense): RMSNorm over each head of q and k (`qk_norm`); optional attention_bias.
  qwen3_moe  Qwen3-MoE: Qwen3 attention; sparse MLP blocks (`mlp.gate` router, `mlp.experts.{e}.
          {gate,up,down}_proj` of width `moe_intermediate_size`, top-k of the softmax, renormalised
          when `norm_topk_prob`); dense MLP (`intermediate_size`) in `mlp_only_layers` and in layers
          where (i + 1) % decoder_sparse_step != 0, as transformers decides.
  mixtral Mixtral: Mistral attention; every MLP sparse (`block_sparse_moe.gate`,
          `block_sparse_moe.experts.{e}.{w1,w3,w2}` = gate/up/down of width `intermediate_size`),
          top-k renormalised.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from nvfp4tool.errors import NVFP4ToolError

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")
MOE_FAMILIES = ("qwen3_moe", "mixtral")
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
SUPPORTED_ROPE_TYPES = ("default", "llama3")

# HF `architectures[0]` for each family (what config.json names and transformers instantiates).
ARCHITECTURE_BY_FAMILY = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
# Names of a sparse MLP's modules per MoE family: (block attribute, expert (gate, up, down) names).
_MOE_NAMES = {
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
}
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts")  # HF spells the expert count either way
_FAMILY_BY_ARCHITECTURE = {arch: fam for fam, arch in ARCHITECTURE_BY_FAMILY.items()}

# config.json keys that ModelConfig models itself; every other key goes to `hf_extra` untouched.
_MODELED_KEYS = frozenset({
    "model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
    "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings",
    "tie_word_embeddings", "attention_bias", "sliding_window", "use_sliding_window",
    "max_window_layers", "layer_types", "dtype", "torch_dtype", "bos_token_id", "eos_token_id",
    "pad_token_id", "hidden_act", "mlp_bias",
    *_EXPERT_COUNT_KEYS, "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
    "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef",
})


@dataclass(frozen=True)
class RopeScaling:
    """llama3-type RoPE frequency scaling (Llama 3.1 / 3.2); the only scaling type supported."""

    factor: float  # wavelengths longer than original_max / low_freq_factor are divided by this
    low_freq_factor: float  # wavelengths above original_max / low_freq_factor: fully scaled
    high_freq_factor: float  # wavelengths below original_max / high_freq_factor: unscaled
    original_max_position_embeddings: int  # the context length the model was pre-trained at

    def __post_init__(self) -> None:
        if not (self.factor >= 1.0 and 0 < self.low_freq_factor < self.high_freq_factor):
            raise NVFP4ToolError(
                f"rope_scaling llama3: need factor >= 1 and 0 < low_freq_factor < high_freq_factor, "
                f"got factor={self.factor}, low_freq_factor={self.low_freq_factor}, "
                f"high_freq_factor={self.high_freq_factor}")
        if self.original_max_position_embeddings <= 0:
            raise NVFP4ToolError(f"rope_scaling llama3: original_max_position_embeddings must be > 0, "
                                 f"got {self.original_max_position_embeddings}")


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only Llama-family transformer (pre-norm, RMSNorm, GQA attention, SwiGLU MLP or a
    sparse mixture of SwiGLU experts)."""

    family: str  # one of SUPPORTED_FAMILIES (HF model_type)
    vocab_size: int  # V: rows of the embedding and of lm_head
    hidden_size: int  # E: residual stream width
    intermediate_size: int  # F: SwiGLU hidden width (gate_proj / up_proj rows)
    num_layers: int  # L: decoder blocks
    num_heads: int  # H: query heads
    num_kv_heads: int  # KV: key/value heads (GQA: H % KV == 0)
    head_dim: int  # D: per-head width (not necessarily E // H, e.g. Qwen3)
    rms_norm_eps: float = 1e-6  # epsilon inside every RMSNorm
    rope_theta: float = 10000.0  # RoPE base
    rope_scaling: RopeScaling | None = None  # llama3 frequency scaling, or None
    max_position_embeddings: int = 2048  # context length the config advertises
    tie_word_embeddings: bool = False  # lm_head reuses model.embed_tokens.weight
    attention_bias: bool = False  # q_proj/k_proj/v_proj carry a bias (Qwen2: always)
    o_proj_bias: bool = False  # o_proj carries a bias (Llama/Qwen3 attention_bias=True)
    qk_norm: bool = False  # RMSNorm over head_dim of q and k before RoPE (Qwen3)
    sliding_window: int | None = None  # Mistral: key k visible from query q iff q - k < window
    dtype: str = "bfloat16"  # storage dtype the checkpoint declares ("float32"|"bfloat16"|"float16")
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None  # a list in config.json becomes a tuple
    pad_token_id: int | None = None
    # Mixture of experts (MOE_FAMILIES only; 0 / defaults for dense families)
    num_experts: int = 0  # experts of a sparse MLP
    num_experts_per_tok: int = 0  # k of the top-k routing
    moe_intermediate_size: int = 0  # an expert's SwiGLU width (qwen3_moe; mixtral: intermediate_size)
    norm_topk_prob: bool = False  # renormalise the k chosen probabilities to sum to 1 (mixtral: always)
    decoder_sparse_step: int = 1  # qwen3_moe: layer i is sparse iff (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here
    router_aux_loss_coef: float = 0.0  # weight of the load-balancing loss in training
    # How config.json spells RoPE and dtype, kept on write-back: "transformers4" (top-level
    # rope_theta / rope_scaling, torch_dtype: read by transformers 4.x and 5.x and vLLM) or
    # "transformers5" (rope_parameters, dtype).
    hf_config_style: str = field(default="transformers4", compare=False)
    # The key the source config.json names the expert count with ("num_experts" on the Hub for
    # qwen3_moe, "num_local_experts" for mixtral and as transformers 5 writes both), kept on write-back.
    hf_experts_key: str = field(default="", compare=False)
    # Keys of the source config.json that are not modeled above, written back unchanged.
    hf_extra: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        if self.family not in SUPPORTED_FAMILIES:
            raise NVFP4ToolError(f"unsupported model family {self.family!r}; supported: "
                                 f"{', '.join(SUPPORTED_FAMILIES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise NVFP4ToolError(f"model config: {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise NVFP4ToolError(f"model config: num_heads={self.num_heads} is not a multiple of "
                                 f"num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise NVFP4ToolError(f"model config: head_dim={self.head_dim} must be even for RoPE")
        if not (self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps)):
            raise NVFP4ToolError(f"model config: rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise NVFP4ToolError(f"model config: rope_theta must be > 0, got {self.rope_theta}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise NVFP4ToolError(f"model config: dtype {self.dtype!r} unsupported; supported: "
                                 f"{', '.join(SUPPORTED_DTYPES)}")
        if self.hf_config_style not in ("transformers4", "transformers5"):
            raise NVFP4ToolError(f"model config: hf_config_style must be 'transformers4' or "
                                 f"'transformers5', got {self.hf_config_style!r}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise NVFP4ToolError(f"model config: sliding_window must be > 0 or None, "
                                 f"got {self.sliding_window}")
        self._check_family_options()

    # ----------------------------------------------------------------------------- HF config.json

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], *, source: str = "config.json") -> ModelConfig:
        """Build from a parsed HF config.json (transformers 4.x or 5.x style); `source` names it in errors."""
        family = _family_of(hf, source)
        _reject_unsupported_options(hf, family, source)
        try:
            num_heads = _integer(hf, "num_attention_heads")
            hidden_size = _integer(hf, "hidden_size")
            rope_theta, rope_scaling = _rope_from_hf(hf, source)
            attention_bias = _flag(hf, "attention_bias")
            eos = hf.get("eos_token_id")
            if isinstance(eos, list):
                eos = tuple(_integer({"eos_token_id": e}, "eos_token_id") for e in eos)
            else:
                eos = _integer(hf, "eos_token_id", None)
            return cls(
                family=family,
                vocab_size=_integer(hf, "vocab_size"),
                hidden_size=hidden_size,
                intermediate_size=_integer(hf, "intermediate_size"),
                num_layers=_integer(hf, "num_hidden_layers"),
                num_heads=num_heads,
                num_kv_heads=_default(_integer(hf, "num_key_value_heads", None), num_heads),
                head_dim=_default(_integer(hf, "head_dim", None), hidden_size // max(num_heads, 1)),
                rms_norm_eps=_number(hf, "rms_norm_eps", 1e-6),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                max_position_embeddings=_integer(hf, "max_position_embeddings", 2048),
                tie_word_embeddings=_flag(hf, "tie_word_embeddings"),
                # Qwen2 always has q/k/v bias and never o_proj bias; Llama/Qwen3 put it on all four.
                attention_bias=True if family == "qwen2" else attention_bias,
                o_proj_bias=False if family in ("qwen2", "mistral", "mixtral") else attention_bias,
                qk_norm=family in ("qwen3", "qwen3_moe"),
                sliding_window=_sliding_window_from_hf(hf, family),
                dtype=str(hf.get("dtype") or hf.get("torch_dtype") or "bfloat16").removeprefix("torch."),
                bos_token_id=_integer(hf, "bos_token_id", None),
                eos_token_id=eos,
                pad_token_id=_integer(hf, "pad_token_id", None),
                **_moe_from_hf(hf, family),
                hf_config_style="transformers5" if "rope_parameters" in hf or "dtype" in hf
                else "transformers4",
                hf_extra={k: v for k, v in hf.items() if k not in _MODELED_KEYS},
            )
        except KeyError as missing:
            raise NVFP4ToolError(f"{source}: missing required key {missing.args[0]!r}") from None
        except (TypeError, ValueError) as bad:
            raise NVFP4ToolError(f"{source}: bad value: {bad}") from None
        except NVFP4ToolError as invalid:  # from validation: say which file held the values
            if str(invalid).startswith(source):
                raise
            raise NVFP4ToolError(f"{source}: {invalid}") from None

    @classmethod
    def from_hf_folder(cls, path: str | os.PathLike) -> ModelConfig:
        """Read `<path>/config.json` (or `path` itself when it is a .json file)."""
        config_path, hf = read_hf_config(path)
        return cls.from_hf_config(hf, source=config_path)

    def to_hf_config(self) -> dict[str, Any]:
        """The config.json dict: unknown source keys kept, modeled keys written from our fields,
        RoPE and dtype spelled in the source's style (`hf_config_style`)."""
        hf: dict[str, Any] = dict(self.hf_extra)
        hf.update({
            "architectures": [ARCHITECTURE_BY_FAMILY[self.family]],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "dtype" if self.hf_config_style == "transformers5" else "torch_dtype": self.dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple)
            else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        })
        if self.family in ("llama", "qwen3", "qwen3_moe"):
            hf["attention_bias"] = self.attention_bias
        if self.family == "llama":
            hf["mlp_bias"] = False
        if self.family in ("mistral", "mixtral"):
            hf["sliding_window"] = self.sliding_window
        if self.is_moe:
            hf[self.hf_experts_key or _EXPERT_COUNT_KEYS[self.family == "mixtral"]] = self.num_experts
            hf["num_experts_per_tok"] = self.num_experts_per_tok
            hf["router_aux_loss_coef"] = self.router_aux_loss_coef
        if self.family == "qwen3_moe":
            hf.update(moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                      decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=list(self.mlp_only_layers))
        if self.family in ("qwen2", "qwen3", "qwen3_moe"):
            hf["use_sliding_window"] = False
            hf["sliding_window"] = None
            hf["layer_types"] = ["full_attention"] * self.num_layers
        scaling = None if self.rope_scaling is None else {
            "rope_type": "llama3",
            "factor": self.rope_scaling.factor,
            "low_freq_factor": self.rope_scaling.low_freq_factor,
            "high_freq_factor": self.rope_scaling.high_freq_factor,
            "original_max_position_embeddings": self.rope_scaling.original_max_position_embeddings,
        }
        if self.hf_config_style == "transformers5":
            hf["rope_parameters"] = {"rope_type": "default", **(scaling or {}), "rope_theta": self.rope_theta}
        else:
            hf["rope_theta"] = self.rope_theta
            hf["rope_scaling"] = scaling
        return hf

    # ------------------------------------------------------------------------------------ tensors

    @property
    def is_moe(self) -> bool:
        """A mixture-of-experts family (its sparse layers route tokens to experts)."""
        return self.family in MOE_FAMILIES

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` has a sparse MLP (router + experts), as transformers decides."""
        if not self.is_moe:
            return False
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @property
    def expert_intermediate_size(self) -> int:
        """An expert's SwiGLU width (mixtral's experts use intermediate_size)."""
        return self.moe_intermediate_size if self.family == "qwen3_moe" else self.intermediate_size

    def mlp_prefix(self, layer: int) -> str:
        """The HF module path of layer `layer`'s MLP (dense or sparse): `model.layers.{i}.mlp` or
        mixtral's `model.layers.{i}.block_sparse_moe`."""
        return f"model.layers.{layer}.{self.expert_block if self.is_sparse_layer(layer) else 'mlp'}"

    @property
    def expert_block(self) -> str:
        """A sparse layer's MLP attribute: `mlp` (qwen3_moe) or `block_sparse_moe` (mixtral)."""
        return _MOE_NAMES[self.family][0] if self.is_moe else "mlp"

    @property
    def expert_projections(self) -> tuple[str, str, str]:
        """Names of an expert's (gate, up, down) projections: gate_proj/up_proj/down_proj, or
        mixtral's w1/w3/w2."""
        return _MOE_NAMES[self.family][1] if self.is_moe else ("gate_proj", "up_proj", "down_proj")

    def router_names(self) -> list[str]:
        """The router (gate) linear of every sparse layer: never quantized."""
        return [f"{self.mlp_prefix(i)}.gate" for i in range(self.num_layers) if self.is_sparse_layer(i)]

    def expected_tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every HF tensor name of this model -> its shape, weights as [out_features, in_features].

        Order: embedding, layers 0..L-1 (norm, q, k, v, o, q/k norms, norm, then the dense MLP's
        gate, up, down, or the router and every expert's gate, up, down), final norm, lm_head
        (absent when tied).
        """
        E, F, D = self.hidden_size, self.intermediate_size, self.head_dim
        q_out, kv_out = self.num_heads * D, self.num_kv_heads * D
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, E)}
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (E,)
            for proj, out in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
                shapes[f"{p}self_attn.{proj}.weight"] = (out, E)
                if self.attention_bias:
                    shapes[f"{p}self_attn.{proj}.bias"] = (out,)
            shapes[p + "self_attn.o_proj.weight"] = (E, q_out)
            if self.o_proj_bias:
                shapes[p + "self_attn.o_proj.bias"] = (E,)
            if self.qk_norm:
                shapes[p + "self_attn.q_norm.weight"] = (D,)
                shapes[p + "self_attn.k_norm.weight"] = (D,)
            shapes[p + "post_attention_layernorm.weight"] = (E,)
            mlp = self.mlp_prefix(i)
            if self.is_sparse_layer(i):
                shapes[f"{mlp}.gate.weight"] = (self.num_experts, E)
                gate, up, down = self.expert_projections
                Fe = self.expert_intermediate_size
                for e in range(self.num_experts):
                    shapes[f"{mlp}.experts.{e}.{gate}.weight"] = (Fe, E)
                    shapes[f"{mlp}.experts.{e}.{up}.weight"] = (Fe, E)
                    shapes[f"{mlp}.experts.{e}.{down}.weight"] = (E, Fe)
            else:
                shapes[f"{mlp}.gate_proj.weight"] = (F, E)
                shapes[f"{mlp}.up_proj.weight"] = (F, E)
                shapes[f"{mlp}.down_proj.weight"] = (E, F)
        shapes["model.norm.weight"] = (E,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, E)
        return shapes

    def linear_names(self) -> list[str]:
        """Names (HF module paths, no `.weight`) of every linear layer the model routes through its
        linear seam, in forward order (a sparse layer: its router, then each expert's gate, up,
        down); `lm_head` last (also when tied: it then reuses the embedding)."""
        names = [n.removesuffix(".weight") for n, s in self.expected_tensor_shapes().items()
                 if len(s) == 2 and n.startswith("model.layers.")]
        return names + ["lm_head"]

    def num_parameters(self) -> int:
        """Total parameter count (tied embeddings counted once)."""
        return sum(math.prod(s) for s in self.expected_tensor_shapes().values())

    # ------------------------------------------------------------------------------------ helpers

    def _check_family_options(self) -> None:
        """Only combinations the family's HF config can express (so to_hf_config is faithful)."""
        problems = []
        if self.qk_norm != (self.family in ("qwen3", "qwen3_moe")):
            problems.append("qk_norm is on exactly for qwen3 and qwen3_moe")
        if self.family == "qwen2" and not (self.attention_bias and not self.o_proj_bias):
            problems.append("qwen2 has q/k/v bias and no o_proj bias")
        if self.family in ("mistral", "mixtral") and (self.attention_bias or self.o_proj_bias):
            problems.append(f"{self.family} has no attention bias")
        if self.family in ("llama", "qwen3", "qwen3_moe") and self.attention_bias != self.o_proj_bias:
            problems.append(f"{self.family} attention_bias puts a bias on q/k/v and o_proj together")
        if self.sliding_window is not None and self.family not in ("mistral", "mixtral"):
            problems.append("sliding_window is supported for mistral and mixtral only")
        problems += self._moe_problems()
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            problems.append("rope_scaling must be a RopeScaling")
        if problems:
            raise NVFP4ToolError(f"model config ({self.family}): {'; '.join(problems)}")


    def _moe_problems(self) -> list[str]:
        if not self.is_moe:
            moe = (self.num_experts, self.num_experts_per_tok, self.moe_intermediate_size,
                   self.norm_topk_prob, self.decoder_sparse_step, self.mlp_only_layers, self.router_aux_loss_coef)
            return [] if moe == (0, 0, 0, False, 1, (), 0.0) else ["mixture-of-experts fields are for "
                                                                  f"{' and '.join(MOE_FAMILIES)} only"]
        problems = []
        if not (isinstance(self.num_experts, int) and self.num_experts >= 1):
            problems.append(f"num_experts must be a positive integer, got {self.num_experts!r}")
        elif not (isinstance(self.num_experts_per_tok, int) and 1 <= self.num_experts_per_tok <= self.num_experts):
            problems.append(f"num_experts_per_tok must be in 1..num_experts={self.num_experts}, "
                            f"got {self.num_experts_per_tok!r}")
        if not (isinstance(self.decoder_sparse_step, int) and self.decoder_sparse_step >= 1):
            problems.append(f"decoder_sparse_step must be a positive integer, got {self.decoder_sparse_step!r}")
        bad_layers = [i for i in self.mlp_only_layers if not (isinstance(i, int) and 0 <= i < self.num_layers)]
        if bad_layers:
            problems.append(f"mlp_only_layers {bad_layers[0]!r} is not a layer index in 0..{self.num_layers - 1}")
        if not (self.router_aux_loss_coef >= 0 and math.isfinite(self.router_aux_loss_coef)):
            problems.append(f"router_aux_loss_coef must be finite and >= 0, got {self.router_aux_loss_coef}")
        if self.family == "qwen3_moe" and not (isinstance(self.moe_intermediate_size, int)
                                               and self.moe_intermediate_size > 0):
            problems.append(f"moe_intermediate_size must be a positive integer, got {self.moe_intermediate_size!r}")
        if self.family == "mixtral" and (self.moe_intermediate_size or not self.norm_topk_prob
                                         or self.decoder_sparse_step != 1 or self.mlp_only_layers):
            problems.append("mixtral experts are intermediate_size wide, renormalise the top-k "
                            "(norm_topk_prob) and every layer is sparse")
        return problems


def _moe_from_hf(hf: Mapping[str, Any], family: str) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields from config.json (none for a dense family)."""
    if family not in MOE_FAMILIES:
        return {}
    if hf.get("router_jitter_noise"):
        raise NVFP4ToolError(f"router_jitter_noise={hf['router_jitter_noise']} unsupported; supported: 0")
    keys = [k for k in _EXPERT_COUNT_KEYS if k in hf]
    if not keys:
        raise KeyError(" or ".join(_EXPERT_COUNT_KEYS))
    counts = {k: _integer(hf, k) for k in keys}
    if len(set(counts.values())) > 1:  # transformers keeps one of them, which one depends on the family
        raise NVFP4ToolError(" and ".join(f"{k}={v}" for k, v in counts.items())
                             + " disagree: the expert count must be given once (or twice, equal)")
    key = keys[0]
    fields = dict(num_experts=counts[key], num_experts_per_tok=_integer(hf, "num_experts_per_tok"),
                  router_aux_loss_coef=_number(hf, "router_aux_loss_coef", 0.001), hf_experts_key=key)
    if family == "mixtral":
        return dict(fields, norm_topk_prob=True)
    only = hf.get("mlp_only_layers") or ()
    if not isinstance(only, (list, tuple)):
        raise NVFP4ToolError(f"mlp_only_layers must be a list of layer indices, got {only!r}")
    return dict(fields, moe_intermediate_size=_integer(hf, "moe_intermediate_size"),
                norm_topk_prob=_flag(hf, "norm_topk_prob"),
                decoder_sparse_step=_integer(hf, "decoder_sparse_step", 1),
                mlp_only_layers=tuple(_integer({"mlp_only_layers": i}, "mlp_only_layers") for i in only))


_REQUIRED = object()


def _integer(hf: Mapping[str, Any], key: str, default: Any = _REQUIRED) -> Any:
    """`hf[key]` as an int: a JSON integer, never a bool, a float (2.0 included: transformers' strict
    config classes refuse it) or a string; a missing key (or null, when `default` is given) is `default`;
    missing without a default is KeyError (reported as a missing required key)."""
    value = hf.get(key)
    if value is None:
        if default is _REQUIRED:
            raise KeyError(key)
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise NVFP4ToolError(f"{key} must be an integer, got {value!r} ({type(value).__name__})")
    return value


def _number(hf: Mapping[str, Any], key: str, default: Any = _REQUIRED) -> float:
    """`hf[key]` as a float: a JSON number (int or float, never a bool or a string); missing or null
    is `default` (KeyError without one)."""
    value = hf.get(key)
    if value is None:
        if default is _REQUIRED:
            raise KeyError(key)
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise NVFP4ToolError(f"{key} must be a number, got {value!r} ({type(value).__name__})")
    return float(value)


def _flag(hf: Mapping[str, Any], key: str, default: bool = False) -> bool:
    """`hf[key]` as a bool: JSON true / false only (the string "false" is not false); missing or
    null is `default`."""
    value = hf.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise NVFP4ToolError(f"{key} must be true or false, got {value!r} ({type(value).__name__})")
    return value


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


def _family_of(hf: Mapping[str, Any], source: str) -> str:
    """The family config.json's `model_type` names. It is required, as transformers' AutoConfig
    (and so vLLM) picks the config class by it; `architectures` naming another family's model
    class is refused (engines pick the model class by it)."""
    model_type = hf.get("model_type")
    architectures = hf.get("architectures")
    if model_type is None:
        named = f" (architectures names {architectures[0]!r})" if isinstance(architectures, list) \
            and architectures else ""
        raise NVFP4ToolError(f"{source}: missing required key 'model_type'{named}: transformers and vLLM "
                             f"choose the model by it; supported: {', '.join(SUPPORTED_FAMILIES)}")
    if model_type not in SUPPORTED_FAMILIES:
        raise NVFP4ToolError(f"{source}: unsupported architecture {model_type!r}; supported model_type: "
                             f"{', '.join(SUPPORTED_FAMILIES)} ({', '.join(ARCHITECTURE_BY_FAMILY.values())})")
    if architectures is not None and not (isinstance(architectures, list)
                                          and all(isinstance(a, str) for a in architectures)):
        raise NVFP4ToolError(f"{source}: architectures must be a list of class names, got {architectures!r}")
    other = [a for a in architectures or () if _FAMILY_BY_ARCHITECTURE.get(a, model_type) != model_type]
    if other:
        raise NVFP4ToolError(f"{source}: architectures {other[0]!r} is a "
                             f"{_FAMILY_BY_ARCHITECTURE[other[0]]} model but model_type is {model_type!r} "
                             f"({ARCHITECTURE_BY_FAMILY[model_type]})")
    return model_type


def _reject_unsupported_options(hf: Mapping[str, Any], family: str, source: str) -> None:
    if hf.get("hidden_act", "silu") != "silu":
        raise NVFP4ToolError(f"{source}: hidden_act {hf['hidden_act']!r} unsupported; supported: silu")
    if hf.get("mlp_bias"):
        raise NVFP4ToolError(f"{source}: mlp_bias=true unsupported (no Llama-family release uses it)")
    for key in ("rope_parameters", "rope_scaling"):
        if not isinstance(hf.get(key) or {}, Mapping):
            raise NVFP4ToolError(f"{source}: {key} must be an object, got {hf[key]!r}")
    rope_parameters = hf.get("rope_parameters") or {}
    partial = rope_parameters.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise NVFP4ToolError(f"{source}: partial_rotary_factor={partial} unsupported; supported: 1.0 "
                             f"(RoPE over the whole head)")
    if family in ("qwen2", "qwen3", "qwen3_moe"):
        sliding = hf.get("use_sliding_window") or any(
            t != "full_attention" for t in hf.get("layer_types") or ())
        if sliding:
            raise NVFP4ToolError(f"{source}: {family} per-layer sliding-window attention "
                                 f"(use_sliding_window/layer_types) is unsupported; supported: "
                                 f"full attention in every layer")


def _rope_from_hf(hf: Mapping[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from transformers 5 `rope_parameters` or legacy rope_theta/rope_scaling."""
    params = hf.get("rope_parameters")
    if isinstance(params, Mapping) and params:
        scaling = params
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    else:
        scaling = hf.get("rope_scaling") or {}
        theta = hf.get("rope_theta", 10000.0)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NVFP4ToolError(f"{source}: RoPE scaling type {rope_type!r} unsupported; supported: "
                             f"{', '.join(SUPPORTED_ROPE_TYPES)} (none, or llama3)")
    if rope_type == "default":
        return _number({"rope_theta": theta}, "rope_theta", 10000.0), None
    try:
        return _number({"rope_theta": theta}, "rope_theta", 10000.0), RopeScaling(
            factor=_number(scaling, "factor"),
            low_freq_factor=_number(scaling, "low_freq_factor"),
            high_freq_factor=_number(scaling, "high_freq_factor"),
            original_max_position_embeddings=_integer(scaling, "original_max_position_embeddings"),
        )
    except KeyError as missing:
        raise NVFP4ToolError(f"{source}: llama3 rope scaling lacks {missing.args[0]!r}") from None


def _sliding_window_from_hf(hf: Mapping[str, Any], family: str) -> int | None:
    if family not in ("mistral", "mixtral"):
        return None  # Qwen with use_sliding_window was rejected above; its window value is unused
    return _integer(hf, "sliding_window", None)


def read_hf_config(path: str | os.PathLike) -> tuple[str, dict]:
    """(path read, the JSON object) of `<path>/config.json` (or `path` itself when it is a file);
    NVFP4ToolError naming the file when it is missing, a folder, binary, not JSON or not an object."""
    from nvfp4tool.records.base import read_json_file

    config_path = os.fspath(path)
    if os.path.isdir(config_path):
        config_path = os.path.join(config_path, "config.json")
    if not os.path.lexists(config_path):
        raise NVFP4ToolError(f"{config_path}: no such file (an HF model folder needs config.json)")
    hf = read_json_file(config_path)
    if not isinstance(hf, dict):
        raise NVFP4ToolError(f"{config_path}: expected a JSON object")
    return config_path, hf
