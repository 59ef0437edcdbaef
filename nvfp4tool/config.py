"""Model configuration: the one description of a supported model, to and from HF config.json.

`ModelConfig` is what the JAX model, the converters and the exporters agree on. It models the
fields that change the math (shapes, RoPE, biases, norms, tying, sliding window, experts) and
carries every other key of the source config.json untouched (`hf_extra`) so writing it back loses
nothing. The common keys are parsed here; what a family adds (how config.json spells its
attention bias, window and experts, which combinations it can express, the kind and tensors of
each layer, which common keys its config spells its own way or lacks) is declared by its module
under `nvfp4tool/families/` (the registry lists them), and `modules` is the module table derived from it.
Anything unsupported raises `NVFP4ToolError` naming what is supported.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.families import (
    ARCHITECTURE_BY_FAMILY,
    REGISTRY,
    SUPPORTED_FAMILIES,
    Family,
    ModuleTable,
    get_family,
    module_table,
)
from nvfp4tool.families.hf_values import flag as _flag
from nvfp4tool.families.hf_values import integer as _integer
from nvfp4tool.families.hf_values import number as _number
from nvfp4tool.families.rope_scaling import (  # noqa: F401  (RopeScaling, SUPPORTED_ROPE_TYPES: re-exported)
    ROPE_SCALINGS,
    SUPPORTED_ROPE_TYPES,
    LinearRopeScaling,
    RopeScaling,
    rope_scaling_from_hf,
)

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
_FAMILY_BY_ARCHITECTURE = {arch: fam for fam, arch in ARCHITECTURE_BY_FAMILY.items()}

# config.json keys that ModelConfig models itself (with its family's `modeled_keys`, less the
# common keys its family lacks: `Family.common_keys_not_modeled`); every other key goes to
# `hf_extra` untouched.
_MODELED_KEYS = frozenset(
    {
        "model_type",
        "architectures",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "max_position_embeddings",
        "tie_word_embeddings",
        "dtype",
        "torch_dtype",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "hidden_act",
    }
)


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only model of a registered family: the fields every family shares (shapes, RoPE,
    norms, tying; the attention options of the Llama group's config.json), and the family's own
    fields in `family_config` (its module's record: `moe.Experts`, `nemotron_h.HybridFields`)."""

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
    rope_scaling: Any = None  # a frequency scaling record (`ROPE_SCALINGS`: llama3, linear), or None
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
    # The family's own fields: its module's frozen dataclass (`families.moe.Experts` for qwen3_moe
    # and mixtral), None for a family that has none; parsed, emitted and validated by the family.
    family_config: Any = None
    # How config.json spells RoPE and dtype, kept on write-back: "transformers4" (top-level
    # rope_theta / rope_scaling, torch_dtype: read by transformers 4.x and 5.x and vLLM) or
    # "transformers5" (rope_parameters, dtype).
    hf_config_style: str = field(default="transformers4", compare=False)
    # Keys of the source config.json that are not modeled above, written back unchanged.
    hf_extra: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        if self.family not in SUPPORTED_FAMILIES:
            raise NVFP4ToolError(
                f"unsupported model family {self.family!r}; supported: {', '.join(SUPPORTED_FAMILIES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise NVFP4ToolError(f"model config: {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise NVFP4ToolError(
                f"model config: num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise NVFP4ToolError(f"model config: head_dim={self.head_dim} must be even for RoPE")
        if not (self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps)):
            raise NVFP4ToolError(f"model config: rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise NVFP4ToolError(f"model config: rope_theta must be > 0, got {self.rope_theta}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise NVFP4ToolError(
                f"model config: dtype {self.dtype!r} unsupported; supported: {', '.join(SUPPORTED_DTYPES)}"
            )
        if self.hf_config_style not in ("transformers4", "transformers5"):
            raise NVFP4ToolError(
                f"model config: hf_config_style must be 'transformers4' or "
                f"'transformers5', got {self.hf_config_style!r}"
            )
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise NVFP4ToolError(f"model config: sliding_window must be > 0 or None, got {self.sliding_window}")
        self._check_family_options()

    # ----------------------------------------------------------------------------- HF config.json

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], *, source: str = "config.json") -> ModelConfig:
        """Build from a parsed HF config.json (transformers 4.x or 5.x style); `source` names it in errors."""
        family = _family_of(hf, source)
        spec = get_family(family)
        _reject_unsupported_options(hf, source, spec)
        try:
            num_heads = _integer(hf, "num_attention_heads")
            hidden_size = _integer(hf, "hidden_size")
            rope_theta, rope_scaling = _rope_from_hf(hf, source) if spec.positional == "rope" else (10000.0, None)
            family_fields = dict(spec.parse(hf, source))
            num_layers = family_fields.pop("num_layers", None) or _integer(hf, "num_hidden_layers")
            head_dim = family_fields.pop("head_dim", None) or _default(
                _integer(hf, "head_dim", None), hidden_size // max(num_heads, 1)
            )
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
                num_layers=num_layers,
                num_heads=num_heads,
                num_kv_heads=_default(_integer(hf, "num_key_value_heads", None), num_heads),
                head_dim=head_dim,
                rms_norm_eps=_number(hf, spec.norm_eps_key, 1e-6),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                max_position_embeddings=_integer(hf, "max_position_embeddings", 2048),
                tie_word_embeddings=_flag(hf, "tie_word_embeddings", spec.tie_word_embeddings_default),
                dtype=str(hf.get("dtype") or hf.get("torch_dtype") or "bfloat16").removeprefix("torch."),
                bos_token_id=_integer(hf, "bos_token_id", None),
                eos_token_id=eos,
                pad_token_id=_integer(hf, "pad_token_id", None),
                **family_fields,
                hf_config_style="transformers5" if "rope_parameters" in hf or "dtype" in hf else "transformers4",
                hf_extra={
                    k: v
                    for k, v in hf.items()
                    if k not in (_MODELED_KEYS - spec.common_keys_not_modeled) | spec.modeled_keys
                },
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
        common = {
            "architectures": [self.family_spec.architecture],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.family_spec.activation,
            self.family_spec.norm_eps_key: self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "dtype" if self.hf_config_style == "transformers5" else "torch_dtype": self.dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        for key in self.family_spec.common_keys_not_modeled:  # kept in hf_extra as the source had them
            common.pop(key, None)
        hf.update(common)
        self.family_spec.emit(self, hf)
        if self.family_spec.positional != "rope":
            return hf
        scaling = None if self.rope_scaling is None else self.rope_scaling.to_hf()
        if self.hf_config_style == "transformers5":
            hf["rope_parameters"] = {"rope_type": "default", **(scaling or {}), "rope_theta": self.rope_theta}
        else:
            hf["rope_theta"] = self.rope_theta
            hf["rope_scaling"] = scaling
        return hf

    # ------------------------------------------------------------------------------------ tensors

    @property
    def family_spec(self) -> Family:
        """The family module's declaration for `family` (`nvfp4tool.families`)."""
        return REGISTRY[self.family]

    @property
    def modules(self) -> ModuleTable:
        """The module table of this model (`families.module_table`): every linear with its layer,
        kind, fused group, tensor-parallel split, router / attention role."""
        return module_table(self)

    def layer_kind(self, layer: int) -> str:
        """Decoder layer `layer`'s kind ("attention+mlp", "attention+moe", ...), as its family decides."""
        return self.family_spec.layer_kind(self, layer)

    def mlp_prefix(self, layer: int) -> str:
        """The HF module path of layer `layer`'s MLP (dense or sparse): `model.layers.{i}.mlp` or
        mixtral's `model.layers.{i}.block_sparse_moe`."""
        return self.family_spec.mlp_module(self, layer)

    def router_names(self) -> list[str]:
        """The router (gate) linear of every sparse layer: never quantized."""
        return self.modules.routers()

    def expected_tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every HF tensor name of this model -> its shape, weights as [out_features, in_features].

        Order: embedding, layers 0..L-1 (norm, q, k, v, o, q/k norms, norm, then the dense MLP's
        gate, up, down, or the router and every expert's gate, up, down), final norm, lm_head
        (absent when tied).
        """
        return dict(self.modules.tensor_shapes)

    def linear_names(self) -> list[str]:
        """Names (HF module paths, no `.weight`) of every linear layer the model routes through its
        linear seam, in forward order (a sparse layer: its router, then each expert's gate, up,
        down); `lm_head` last (also when tied: it then reuses the embedding)."""
        return self.modules.names()

    def num_parameters(self) -> int:
        """Total parameter count (tied embeddings counted once)."""
        return sum(math.prod(s) for s in self.expected_tensor_shapes().values())

    # ------------------------------------------------------------------------------------ helpers

    def _check_family_options(self) -> None:
        """Only combinations the family's HF config can express (so to_hf_config is faithful)."""
        problems = self.family_spec.problems(self)
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, tuple(ROPE_SCALINGS.values())):
            problems.append("rope_scaling must be a scaling record (config.ROPE_SCALINGS)")
        if problems:
            raise NVFP4ToolError(f"model config ({self.family}): {'; '.join(problems)}")


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


def _family_of(hf: Mapping[str, Any], source: str) -> str:
    """The family config.json's `model_type` names. It is required, as transformers' AutoConfig
    (and so vLLM) picks the config class by it; `architectures` naming another family's model
    class is refused (engines pick the model class by it)."""
    model_type = hf.get("model_type")
    architectures = hf.get("architectures")
    if model_type is None:
        named = (
            f" (architectures names {architectures[0]!r})" if isinstance(architectures, list) and architectures else ""
        )
        raise NVFP4ToolError(
            f"{source}: missing required key 'model_type'{named}: transformers and vLLM "
            f"choose the model by it; supported: {', '.join(SUPPORTED_FAMILIES)}"
        )
    if model_type not in SUPPORTED_FAMILIES:
        raise NVFP4ToolError(
            f"{source}: unsupported architecture {model_type!r}; supported model_type: "
            f"{', '.join(SUPPORTED_FAMILIES)} ({', '.join(ARCHITECTURE_BY_FAMILY.values())})"
        )
    if architectures is not None and not (
        isinstance(architectures, list) and all(isinstance(a, str) for a in architectures)
    ):
        raise NVFP4ToolError(f"{source}: architectures must be a list of class names, got {architectures!r}")
    other = [a for a in architectures or () if _FAMILY_BY_ARCHITECTURE.get(a, model_type) != model_type]
    if other:
        raise NVFP4ToolError(
            f"{source}: architectures {other[0]!r} is a "
            f"{_FAMILY_BY_ARCHITECTURE[other[0]]} model but model_type is {model_type!r} "
            f"({ARCHITECTURE_BY_FAMILY[model_type]})"
        )
    return model_type


def _reject_unsupported_options(hf: Mapping[str, Any], source: str, family: Family) -> None:
    """The common keys' values no family models: an activation other than the family's (where its
    config spells it `hidden_act`), and for a RoPE family, RoPE over part of the head. What only a
    family's keys say is its `parse`'s to refuse."""
    activation_key = "hidden_act" not in family.common_keys_not_modeled
    if activation_key and hf.get("hidden_act", family.activation) != family.activation:  # HF's default: the family's
        raise NVFP4ToolError(
            f"{source}: hidden_act {hf['hidden_act']!r} unsupported for {family.model_type}; "
            f"supported: {family.activation}"
        )
    if family.positional != "rope":
        return
    for key in ("rope_parameters", "rope_scaling"):
        if not isinstance(hf.get(key) or {}, Mapping):
            raise NVFP4ToolError(f"{source}: {key} must be an object, got {hf[key]!r}")
    rope_parameters = hf.get("rope_parameters") or {}
    partial = rope_parameters.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise NVFP4ToolError(
            f"{source}: partial_rotary_factor={partial} unsupported; supported: 1.0 (RoPE over the whole head)"
        )


def _rope_from_hf(hf: Mapping[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from transformers 5 `rope_parameters` or legacy rope_theta/rope_scaling."""
    params = hf.get("rope_parameters")
    if isinstance(params, Mapping) and params:
        scaling = params
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    else:
        scaling = hf.get("rope_scaling") or {}
        theta = hf.get("rope_theta", 10000.0)
    return _number({"rope_theta": theta}, "rope_theta", 10000.0), rope_scaling_from_hf(scaling, source)


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
