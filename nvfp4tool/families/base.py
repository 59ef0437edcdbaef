"""What a model family declares, and the module table every stage reads.

A `Family` owns the facts of a group of HF `model_type`s (config keys, layer kinds, tensors, MaxText
support, block classes); `ModuleTable` (one `LinearModule` row per linear, in forward order) is
derived from it, and no stage outside `families/` spells an HF module name.
Design notes: docs/design/families.md.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Collection, Mapping
from typing import Any, Literal

ATTENTION_MLP = "attention+mlp"  # a pre-norm decoder layer: attention, then a dense SwiGLU MLP
ATTENTION_MOE = "attention+moe"  # ... then a sparse mixture of SwiGLU experts
HEAD = "head"  # the LM head's kind in the module table (not a decoder layer)
ATTENTION = "self_attn"  # every family's attention module attribute (where KV-cache scales go)
BASE_MODEL = "model"  # HF's base-model attribute: the embedding, the layers and the final norm lie under it
LAYERS = f"{BASE_MODEL}.layers"  # the decoder layers' HF module path (scanned programs: `model.layers.*`)
LM_HEAD = "lm_head"
INPUT_NORM = "input_layernorm"  # a pre-norm layer's norm before its attention ...
POST_ATTENTION_NORM = "post_attention_layernorm"  # ... and before its MLP
EMBEDDING = f"{BASE_MODEL}.embed_tokens"
FINAL_NORM = f"{BASE_MODEL}.norm"
Split = Literal["column", "row", "none"]
# A `nvfp4tool.config.ModelConfig`: not imported here, since config.py builds on the families.
ModelConfig = Any


@dataclasses.dataclass(frozen=True)
class Projection:
    """One linear of a block: its HF attribute, what it computes, how serving fuses and shards it."""

    attr: str  # HF attribute under its parent module: "q_proj", "w1", "gate"
    role: str  # "q" | "k" | "v" | "o" | "gate" | "up" | "down" | "router"
    split: Split  # tensor parallelism: column (output rows), row (input columns) or none
    fused: str | None = None  # the fused GEMM's suffix ("qkv", "gate_up"); None: its own GEMM


Q, K, V, O_PROJ = (
    Projection("q_proj", "q", "column", "qkv"),
    Projection("k_proj", "k", "column", "qkv"),
    Projection("v_proj", "v", "column", "qkv"),
    Projection("o_proj", "o", "row"),
)
ATTENTION_PROJECTIONS = (Q, K, V, O_PROJ)
SWIGLU = (
    Projection("gate_proj", "gate", "column", "gate_up"),
    Projection("up_proj", "up", "column", "gate_up"),
    Projection("down_proj", "down", "row"),
)
ROUTER = Projection("gate", "router", "none")

# The training presets' shared sizes: name -> (hidden E, layers L, heads H, kv heads KV, head dim D, MLP
# width F); all multiples of 16. A family's presets (`Family.presets`) start from one (`preset_shape`).
PRESET_SHAPES = {
    "tiny": (128, 4, 4, 2, 32, 384),  # ~0.9M parameters + embeddings: minutes on a 2-core CPU
    "small": (384, 6, 6, 2, 64, 1024),  # ~9.4M + embeddings: the accuracy study's model on a CPU
    "100m": (768, 12, 12, 4, 64, 2048),  # ~85M + embeddings: a GPU-sized pretraining run
    "1b": (2048, 16, 32, 8, 64, 8192),  # Llama-3.2-1B: 973M + embeddings (263M at its 128256 tokens)
}


def preset_shape(shape: str, **fields: Any) -> dict[str, Any]:
    """ModelConfig fields of the named size `shape` (`PRESET_SHAPES`): BF16, RMSNorm epsilon 1e-5,
    untied embeddings, `fields` over them (a preset's RoPE base, its family's own fields, ...)."""
    E, L, H, KV, D, F = PRESET_SHAPES[shape]
    sizes = dict(hidden_size=E, num_layers=L, num_heads=H, num_kv_heads=KV, head_dim=D, intermediate_size=F)
    return {**sizes, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "dtype": "bfloat16", **fields}


@dataclasses.dataclass(frozen=True)
class LayerAttention:
    """What one decoder layer's attention computes beyond its shapes, as its family decides
    (`Family.layer_attention`): the attention blocks and RoPE (`model/rope.py`) read it, no
    model-wide field. Layers with equal settings share one block program and one (cos, sin)."""

    window: int | None  # sliding window W: key k visible from query q iff q - k < W; None: every earlier key
    rope_theta: float | None  # RoPE base; None: no positional encoding
    rope_scaling: Any = None  # its scaling record (`config.ROPE_SCALINGS`: llama3, linear), or None
    rope_dim: int | None = None  # the rotated width (MLA: qk_rope_head_dim); None: head_dim
    softmax_scale: float | None = None  # the attention scores' scale; None: head_dim ** -0.5


@dataclasses.dataclass(frozen=True)
class LinearModule:
    """One row of the module table: a linear layer of the model."""

    name: str  # HF module path, no ".weight": "model.layers.3.self_attn.q_proj", "lm_head"
    layer: int | None  # decoder layer index; None for lm_head
    kind: str  # the layer's kind (ATTENTION_MLP, ATTENTION_MOE, ...) or HEAD
    role: str  # the Projection's role, "head" for lm_head
    group: str  # the fused GEMM it belongs to ("<attention>.qkv", "<mlp>.gate_up"), else its name
    split: Split  # tensor-parallel split
    router: bool  # a MoE router: never quantized, its outputs route tokens
    attention: str | None  # the attention module of a q/k/v/o projection, else None
    block: str | None  # the module the linear sits in: "<layer>.self_attn", "<layer>.mlp", ...
    expert: int | None  # the expert index of an expert's projection, else None
    keep_dtype: bool  # stays in the stored dtype whatever the recipe (routers, lm_head)
    shape: tuple[int, int]  # weight [out_features, in_features]


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One HF tensor a family declares for a layer: name, shape, the linear it is the weight of."""

    name: str
    shape: tuple[int, ...]
    linear: Projection | None = None  # the weight of this projection (a bias or norm: None)
    block: str | None = None  # the linear's parent module
    expert: int | None = None


@dataclasses.dataclass(frozen=True)
class ModuleTable:
    """The derived view of one model: every linear (forward order, lm_head last), every attention
    module, every HF tensor's shape. Build it with `families.module_table(config)`."""

    linears: tuple[LinearModule, ...]
    attentions: tuple[str, ...]  # attention modules in layer order (where KV-cache scales go)
    tensor_shapes: Mapping[str, tuple[int, ...]]  # every HF tensor -> shape, in checkpoint order

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {m.name: m for m in self.linears})

    def __getitem__(self, name: str) -> LinearModule:
        return self._by_name[name]  # type: ignore[attr-defined]

    def get(self, name: str) -> LinearModule | None:
        return self._by_name.get(name)  # type: ignore[attr-defined]

    def names(self) -> list[str]:
        return [m.name for m in self.linears]

    def routers(self) -> list[str]:
        return [m.name for m in self.linears if m.router]

    def kept(self) -> set[str]:
        """Linears every recipe keeps in the stored dtype (lm_head, routers)."""
        return {m.name for m in self.linears if m.keep_dtype}

    def groups(self) -> dict[str, tuple[str, ...]]:
        """Fused group -> its members in forward order (a linear alone is a group of one)."""
        result: dict[str, tuple[str, ...]] = {}
        for m in self.linears:
            result[m.group] = result.get(m.group, ()) + (m.name,)
        return result

    def experts(self, router: str) -> list[str]:
        """The expert modules ("<block>.experts.<e>") the router `router` chooses among."""
        block = self[router].block
        seen = dict.fromkeys(
            f"{m.block}.experts.{m.expert}" for m in self.linears if m.block == block and m.expert is not None
        )
        return list(seen)

    def attention(self, layer: int) -> str | None:
        """The attention module of decoder layer `layer` (None: the layer has none)."""
        prefix = f"{layer_prefix(layer)}."
        return next((a for a in self.attentions if a.startswith(prefix)), None)

    def in_layer(self, layer: int) -> list[str]:
        """The linears of decoder layer `layer`, in forward order."""
        return [m.name for m in self.linears if m.layer == layer]


def layer_prefix(layer: int | str) -> str:
    """`model.layers.<layer>` (`*`: the name a scanned program's blocks carry)."""
    return f"{LAYERS}.{layer}"


def split_layer(name: str) -> tuple[int, str] | None:
    """(layer index, the rest) of a name under `model.layers.<i>.` (`model.layers.3.mlp.up_proj`
    -> (3, "mlp.up_proj")), else None."""
    head, _, rest = name.partition(f"{LAYERS}.")
    index, _, tail = rest.partition(".")
    return (int(index), tail) if head == "" and index.isdigit() and tail else None


def name_in_layer(name: str) -> str | None:
    """The part of a name under `model.layers.<i>.` or a block program's `model.layers.*.`
    (`model.layers.*.mlp.up_proj` -> "mlp.up_proj"), else None."""
    head, _, rest = name.partition(f"{LAYERS}.")
    index, _, tail = rest.partition(".")
    return tail if head == "" and (index.isdigit() or index == "*") and tail else None


def layer_index(name: str) -> int | None:
    """The decoder layer a module or tensor name lies in (`model.layers.<i>.`), else None."""
    found = split_layer(name)
    return None if found is None else found[0]


@dataclasses.dataclass(frozen=True)
class Fold:
    """One site of equivalent scaling (`export/equalize.py`, AWQ / SmoothQuant): linears reading
    one input, and the op that makes it. Scaling the input's channels by 1/s at the producer and
    the readers' weight columns by s leaves the model's function unchanged.

    `consumers` are the linears quantized together (q/k/v, gate/up, every expert's gate/up); their
    weight columns take s. `readers` read the same input but are never quantized (a MoE router);
    their columns take s too. `producer` is the norm weight ("norm": divided by s elementwise) or a
    linear's weight and bias ("rows": rows divided by s). `expand` = (groups, repeat, width) when a
    producer row feeds several consumer channels: consumer channel (g, r, w) reads producer row
    (g, w), so s is chosen over the producer's rows and repeated (o_proj after a GQA v_proj: KV
    heads, query heads per KV head, head_dim)."""

    consumers: tuple[str, ...]
    producer: tuple[str, ...]
    kind: Literal["norm", "rows"]
    readers: tuple[str, ...] = ()
    expand: tuple[int, int, int] | None = None
    unit_offset: bool = False  # a "norm" producer that scales by (1 + w) (`Family.norm_unit_offset`): (1 + w) / s - 1


class Family:
    """A group of HF model types with one block structure. Subclasses (one per family module)
    declare the facts; the registry (`families/__init__.py`) finds them by `model_type`."""

    model_type: str  # the HF model_type this instance describes
    architecture: str  # config.json's architectures[0] (what transformers and vLLM instantiate)
    maxtext_rules: tuple | None = None  # its MaxText layout (`families/maxtext.py` Rules); None: none
    # its MaxText model names -> `maxtext.NamedModel` (config.json and RoPE layout); collected by
    # `converters/maxtext_models.py`
    maxtext_models: Mapping[str, Any] = types.MappingProxyType({})
    maxtext_rope_layout: str | None = None  # the RoPE row layout its MaxText decoder fixes; None: the model's
    # how many consecutive layers its scanned MaxText checkpoints stack as one block (`converters/layout.py`
    # `placement`): 1, one stack per parameter; P > 1, a stack per block position plus a remainder
    maxtext_scan_block = 1
    modeled_keys: frozenset[str] = frozenset()  # config.json keys this family's fields model
    routing_weights_in_logits_dtype = False  # MoE: routing weights rounded to the logits' dtype
    # the attention's positional encoding: "rope" (config.json's model-wide rope_theta / rope_scaling /
    # rope_parameters, parsed and written by config.py), "none" (a hybrid's), or "family" (RoPE whose
    # keys the family parses and emits itself and gives each layer: `layer_attention`)
    positional = "rope"
    norm_scale_in_fp32 = False  # RMSNorm multiplies its weight in fp32 (Nemotron-H) or in the input dtype
    # RMSNorm scales by (1 + weight), in fp32, the weight stored as the offset from 1 (Gemma3RMSNorm);
    # its norms start at zero, and an equivalent-scaling fold divides (1 + weight) by s
    norm_unit_offset = False
    norm_eps_key = "rms_norm_eps"  # config.json's key of the norms' epsilon
    tie_word_embeddings_default = False  # a config.json without tie_word_embeddings: its config class's default
    # its MLPs' activation, by transformers' `hidden_act` name (a key of `model.activations.ACTIVATIONS`):
    # config.json's hidden_act must name it (absent: this), and it is written back
    activation = "silu"
    common_keys_not_modeled: frozenset[str] = frozenset()  # common keys its configs lack (kept as given)
    stored_fp32: tuple[str, ...] = ()  # fnmatch patterns of tensors written in FP32 whatever the cast
    # fnmatch patterns of unquantized tensors an export copies in the source's dtype (others: BF16)
    kept_as_stored: tuple[str, ...] = ()
    projections: tuple[Projection, ...] = ()  # its linears beyond attention, SwiGLU and experts (names alone)
    router_blocks: tuple[str, ...] = ()  # the attributes whose `gate` is a MoE router ("mlp", "mixer", ...)
    may_be_zero: tuple[str, ...] = ()  # fnmatch patterns of tensors legitimately all zero (check says nothing)
    no_maxtext_reason: str | None = None  # why the family has no MaxText layout (said by convert --to maxtext)
    # the model module (`nvfp4tool.model.*`) defining its blocks: imported when a model of the family is
    # built, it registers a block for each of the family's layer kinds (`model.blocks.register_blocks`)
    blocks_module: str | None = None
    # keep-BF16 rules its publisher's recipes use (a recipe file's `keep_bf16_rule`, `export/recipes.py`):
    # rule name -> (config -> fnmatch patterns of the linear modules kept in BF16)
    keep_bf16_rules: Mapping[str, Any] = {}
    # its named training sizes (`train --model <name>`): name -> ModelConfig fields but family,
    # vocab_size and max_position_embeddings (`preset_shape`); `train/presets.py` collects them
    presets: Mapping[str, Mapping[str, Any]] = types.MappingProxyType({})

    def parse(self, hf: Mapping[str, Any], source: str) -> dict[str, Any]:
        """ModelConfig fields this family derives from config.json (beyond the common ones)."""
        return {}

    def maxtext_refusal(self, config: ModelConfig) -> str | None:
        """Why `config`'s model, of a family with MaxText rules, has no MaxText layout all the same
        (said by convert --to maxtext after the file name); None: its rules apply."""
        return None

    def maxtext_stacks(self, config: ModelConfig) -> dict[str, range]:
        """MaxText's layer stacks of `config`'s model -> the HF layers each holds, in order (scanned:
        `decoder/<stack>`, unscanned `decoder/<stack>_<j>`); one stack of every layer unless the
        family's MaxText decoder splits them (DeepSeek's dense_layers / moe_layers)."""
        return {"layers": range(config.num_layers)}

    def export_warnings(self, config: ModelConfig, fmt: str, quant: str) -> list[str]:
        """Lines an export of `config`'s model in layout `fmt` x `quant` prints before it runs (a
        layout the engines do not serve for this model): none for these families."""
        return []

    def export_problem(self, config: ModelConfig, kv_cache: str) -> str | None:
        """Why an export of `config`'s model with `--kv-cache kv_cache` cannot be made (a sentence,
        refused before anything is written), else None: none for these families."""
        return None

    def tensors_contradiction(self, config: ModelConfig, names: Collection[str]) -> str | None:
        """When the tensors a checkpoint holds (`names`, ours: `Family.our_name`) are not the ones
        `config`'s model needs because a config.json key says something the tensors contradict (a
        layer kind), the sentence naming the key, the layer, what the key says and what the
        tensors are; the missing / unexpected tensor is reported otherwise. None for these families."""
        return None

    def tp_problems(self, config: ModelConfig, tp: int) -> list[str]:
        """What keeps `config`'s model from being served at tensor-parallel degree `tp`, beyond
        each linear's own split (which check judges per module): none for these families."""
        return []

    def bf16_blocks(self, layers: int) -> tuple[int, int]:
        """The (first, last) decoder blocks the fp8 / nvfp4 training recipes keep in BF16 unless
        told otherwise: the first block and ceil(15%) of the blocks at the end."""
        return 1, math.ceil(0.15 * layers)

    def checkpoint_name(self, name: str) -> str:
        """The name an HF checkpoint stores the tensor (or module) our model calls `name` under, any
        suffix (`.weight`, a layout's `.weight_scale`); the families whose checkpoints use other
        module paths rename here, at the readers and writers of folders only."""
        return name

    def our_name(self, stored: str) -> str:
        """The inverse of `checkpoint_name`: our name of a tensor (or module) a checkpoint stores."""
        return stored

    def emit(self, config: ModelConfig, hf: dict[str, Any]) -> None:
        """Write this family's keys into config.json's dict."""

    def problems(self, config: ModelConfig) -> list[str]:
        """Field combinations this family's config.json cannot express."""
        return []

    def experts(self, config: ModelConfig) -> Any:
        """The sparse MLP's fields (`moe.Experts`) of a family with sparse layers, else None."""
        return None

    def layer_kind(self, config: ModelConfig, layer: int) -> str:
        return ATTENTION_MLP

    def embedding_scale(self, config: ModelConfig) -> float | None:
        """The factor the embedding's output is multiplied by, rounded to the table's dtype
        (Gemma: sqrt(hidden_size)); None: the rows as stored."""
        return None

    def layer_attention(self, config: ModelConfig, layer: int) -> LayerAttention:
        """Decoder layer `layer`'s attention settings (window, RoPE base and scaling): the one owner
        of which layer sees which keys at which frequencies. Here: the same in every layer, no
        window, RoPE from config.json's rope_theta / rope_scaling (none when `positional` is "none")."""
        if self.positional != "rope":
            return LayerAttention(None, None)
        return LayerAttention(None, config.rope_theta, config.rope_scaling)

    def layer_tensors(self, config: ModelConfig, layer: int) -> list[Tensor]:
        """Every HF tensor of decoder layer `layer`, in checkpoint order."""
        raise NotImplementedError

    def mlp_module(self, config: ModelConfig, layer: int) -> str:
        """The HF module path of layer `layer`'s MLP (dense or sparse)."""
        return f"{layer_prefix(layer)}.mlp"

    def folds(self, config: ModelConfig, layer: int) -> list[Fold]:
        """The equivalent-scaling sites of decoder layer `layer` (see `Fold`), for the pre-norm
        attention + MLP / MoE layers: q/k/v after the input norm; o_proj after v_proj's rows (GQA:
        one s per KV-head channel, repeated over its query heads); gate/up after the
        post-attention norm (a sparse MLP: every expert's gate/up, the router reading it too);
        down_proj after up_proj's rows (each expert's after its own). A family with other layer
        kinds declares its own."""
        p = layer_prefix(layer)
        rows = [m for m in config.modules.linears if m.layer == layer]
        shapes = config.modules.tensor_shapes

        def of(role: str, expert: int | None = None) -> list[str]:
            return [m.name for m in rows if m.role == role and m.expert == expert]

        def weight_and_bias(module: str) -> tuple[str, ...]:
            return tuple(t for t in (f"{module}.weight", f"{module}.bias") if t in shapes)

        folds = [Fold(tuple(of("q") + of("k") + of("v")), (f"{p}.{INPUT_NORM}.weight",), "norm")]
        heads, kv_heads = config.num_heads, config.num_kv_heads
        folds.append(
            Fold(
                tuple(of("o")),
                weight_and_bias(of("v")[0]),
                "rows",
                expand=(kv_heads, heads // kv_heads, config.head_dim),
            )
        )
        experts = sorted({m.expert for m in rows if m.expert is not None})
        post = (f"{p}.{POST_ATTENTION_NORM}.weight",)
        if not experts:
            folds.append(Fold(tuple(of("gate") + of("up")), post, "norm"))
            folds.append(Fold(tuple(of("down")), weight_and_bias(of("up")[0]), "rows"))
            return folds
        folds.append(
            Fold(
                tuple(n for e in experts for n in of("gate", e) + of("up", e)),
                post,
                "norm",
                readers=tuple(m.name for m in rows if m.router),
            )
        )
        folds += [Fold(tuple(of("down", e)), weight_and_bias(of("up", e)[0]), "rows") for e in experts]
        return folds


def projection_tensors(
    parent: str,
    projections: tuple[Projection, ...],
    shapes: tuple[tuple[int, int], ...],
    bias: tuple[bool, ...] | None = None,
    *,
    expert: int | None = None,
    block: str | None = None,
) -> list[Tensor]:
    """The weight (and bias, where `bias` says) of each projection under module `parent`; `block`:
    the mixer they belong to when it is not `parent` (an expert's projections: the sparse MLP)."""
    result = []
    for i, (p, shape) in enumerate(zip(projections, shapes)):
        result.append(Tensor(f"{parent}.{p.attr}.weight", shape, p, block or parent, expert))
        if bias is not None and bias[i]:
            result.append(Tensor(f"{parent}.{p.attr}.bias", (shape[0],)))
    return result
