"""Model families as modules: the registry by HF `model_type` and the module table.

    family = get_family("qwen3_moe")          # the Family that owns qwen3_moe's facts
    table = module_table(config)               # one LinearModule per linear, attentions, tensor shapes
    table["model.layers.0.self_attn.k_proj"].group   # "model.layers.0.self_attn.qkv"
    fused_group("model.layers.3.mlp.up_proj")  # the same fact from a name alone (no config at hand)

Families: `llama.py` (llama, mistral, qwen2, qwen3), `moe.py` (qwen3_moe, mixtral) and
`nemotron_h.py` (the hybrid Mamba-2 + attention nemotron_h), `gemma3.py` (gemma3_text), `deepseek_v3.py`
(MLA + DeepSeekMoE); see
`base.py` for what a family declares and docs/architecture.md, "Adding a model family".
"""

from __future__ import annotations

import functools

from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.families import deepseek_v3, gemma3, llama, moe, nemotron_h
from nvfp4tool.families.base import (
    ATTENTION,
    ATTENTION_MLP,
    ATTENTION_MOE,
    ATTENTION_PROJECTIONS,
    BASE_MODEL,
    EMBEDDING,
    FINAL_NORM,
    HEAD,
    LM_HEAD,
    ROUTER,
    SWIGLU,
    Family,
    Fold,
    LayerAttention,
    LinearModule,
    ModelConfig,
    ModuleTable,
    Projection,
    layer_index,
    layer_prefix,
    name_in_layer,
    split_layer,
)

__all__ = [
    "ARCHITECTURE_BY_FAMILY",
    "ATTENTION",
    "ATTENTION_MLP",
    "ATTENTION_MOE",
    "ATTENTION_PROJECTIONS",
    "BASE_MODEL",
    "EMBEDDING",
    "FINAL_NORM",
    "HEAD",
    "LM_HEAD",
    "MAXTEXT_FAMILIES",
    "REGISTRY",
    "ROUTER",
    "SUPPORTED_FAMILIES",
    "SWIGLU",
    "Family",
    "Fold",
    "LayerAttention",
    "LinearModule",
    "ModuleTable",
    "Projection",
    "attention_of",
    "expert_of",
    "folds",
    "fused_group",
    "fused_position",
    "scheme_group",
    "get_family",
    "group_glob",
    "hessian_group",
    "is_attention",
    "is_embedding",
    "is_router",
    "layer_index",
    "layer_prefix",
    "module_table",
    "name_in_layer",
    "projection_of",
    "split_layer",
]

REGISTRY: dict[str, Family] = {
    f.model_type: f
    for f in (*llama.FAMILIES, *moe.FAMILIES, *nemotron_h.FAMILIES, *gemma3.FAMILIES, *deepseek_v3.FAMILIES)
}
SUPPORTED_FAMILIES = tuple(REGISTRY)
MAXTEXT_FAMILIES = tuple(t for t, f in REGISTRY.items() if f.maxtext_rules is not None)
ARCHITECTURE_BY_FAMILY = {t: f.architecture for t, f in REGISTRY.items()}


def get_family(model_type: str) -> Family:
    """The family of HF `model_type` (NVFP4ToolError naming the supported ones otherwise)."""
    try:
        return REGISTRY[model_type]
    except KeyError:
        raise NVFP4ToolError(
            f"unsupported model family {model_type!r}; supported: {', '.join(SUPPORTED_FAMILIES)}"
        ) from None


@functools.lru_cache(maxsize=64)
def module_table(config: ModelConfig) -> ModuleTable:
    """The module table of `config`'s model (derived from its family's declaration; cached)."""
    family = get_family(config.family)
    E, V = config.hidden_size, config.vocab_size
    shapes: dict[str, tuple[int, ...]] = {f"{EMBEDDING}.weight": (V, E)}
    linears: list[LinearModule] = []
    attentions: list[str] = []
    for i in range(config.num_layers):
        kind = family.layer_kind(config, i)
        for t in family.layer_tensors(config, i):
            shapes[t.name] = t.shape
            p = t.linear
            if p is None:
                continue
            name = t.name.removesuffix(".weight")
            parent = name.rpartition(".")[0]
            attention = parent if p in ATTENTION_PROJECTIONS else None
            if attention is not None and attention not in attentions:
                attentions.append(attention)
            linears.append(
                LinearModule(
                    name=name,
                    layer=i,
                    kind=kind,
                    role=p.role,
                    group=f"{parent}.{p.fused}" if p.fused else name,
                    split=p.split,
                    router=p.role == ROUTER.role,
                    attention=attention,
                    block=t.block,
                    expert=t.expert,
                    keep_dtype=p.role == ROUTER.role,
                    shape=t.shape,
                )
            )  # type: ignore[arg-type]
    shapes[f"{FINAL_NORM}.weight"] = (E,)
    if not config.tie_word_embeddings:
        shapes[f"{LM_HEAD}.weight"] = (V, E)
    linears.append(
        LinearModule(
            name=LM_HEAD,
            layer=None,
            kind=HEAD,
            role="head",
            group=LM_HEAD,
            split="none",
            router=False,
            attention=None,
            block=None,
            expert=None,
            keep_dtype=True,
            shape=(V, E),
        )
    )
    return ModuleTable(tuple(linears), tuple(attentions), shapes)


def folds(config: ModelConfig) -> list[Fold]:
    """Every equivalent-scaling site of `config`'s model, layer by layer (`Family.folds`)."""
    family = get_family(config.family)
    return [f for i in range(config.num_layers) for f in family.folds(config, i)]


# ----------------------------------------------------------------------- names without a model

_FOREIGN = (Projection("qkv_proj", "qkv", "column"), Projection("gate_up_proj", "gate_up", "column"))


def _declared() -> dict[str, Projection]:
    """Every projection attribute any registered family declares (and fused names other exporters
    write), by attribute name: the same attribute means the same projection in every family."""
    found: dict[str, Projection] = {}
    for family in REGISTRY.values():
        for p in (
            *ATTENTION_PROJECTIONS,
            *SWIGLU,
            *getattr(family, "expert_projections", ()),
            *family.projections,
            *_FOREIGN,
        ):
            found.setdefault(p.attr, p)
    return found


_BY_ATTR = _declared()
_SPARSE_BLOCKS = frozenset(b for f in REGISTRY.values() for b in f.router_blocks)


def projection_of(name: str) -> Projection | None:
    """The projection a module name ends in (`...self_attn.k_proj`, `...experts.3.w1`, a router
    `...<sparse block>.gate`), from the names the families declare; None: not a known linear."""
    parent, _, attr = name.rpartition(".")
    if attr == ROUTER.attr:
        return ROUTER if parent.rpartition(".")[2] in _SPARSE_BLOCKS else None
    return _BY_ATTR.get(attr)


def fused_group(name: str) -> str:
    """The fused GEMM a linear belongs to: `<block>.self_attn.qkv`, `<block>.mlp.gate_up`,
    `<block>.<moe>.experts.<e>.gate_up` (an expert's gate/up, mixtral's w1/w3), or itself; equal
    to `module_table(config)[name].group` for every model's linear."""
    p = projection_of(name)
    return f"{name.rpartition('.')[0]}.{p.fused}" if p is not None and p.fused else name


def fused_position(name: str) -> int:
    """The place of a linear among the shards of its fused GEMM (q < k < v, gate < up, w1 < w3: the
    order the families declare, which is vLLM's merged-weight order); -1 for an unknown name."""
    p = projection_of(name)
    return -1 if p is None else list(_BY_ATTR).index(p.attr)


def scheme_group(name: str) -> str:
    """The linears that must share one quantization scheme in serving: the fused group, widened to
    every routed expert of a sparse block (`<block>.<moe>.experts`: vLLM runs them as one fused MoE
    layer with one quant method)."""
    expert = expert_of(name)
    return f"{expert[0]}.experts" if expert is not None else fused_group(name)


def is_attention(module: str) -> bool:
    """Whether `module` names an attention module (`model.layers.3.self_attn`)."""
    return module.rpartition(".")[2] == ATTENTION


def attention_of(name: str) -> str | None:
    """The attention module a tensor name lies under (`model.layers.3.self_attn.k_proj.k_scale` ->
    `model.layers.3.self_attn`), else None."""
    head, found, _ = name.partition(f".{ATTENTION}.")
    return f"{head}.{ATTENTION}" if found else None


def hessian_group(name: str) -> str:
    """The input a linear reads, as the Hessian GPTQ shares: its fused group (q/k/v, gate/up), and
    one for the gate/up of ALL experts of a sparse layer (all-experts calibration gives every
    expert every token of its layer, so their inputs are the same)."""
    group, expert = fused_group(name), expert_of(name)
    if expert is not None and group != name:
        return f"{expert[0]}.experts.{group.rpartition('.')[2]}"
    return group


def group_glob(group: str, members: list[str]) -> str:
    """An fnmatch pattern matching exactly the members of a fused group (or the module itself)."""
    if len(members) == 1:
        return members[0]
    prefix = group.rpartition(".")[0]
    suffixes = sorted(m[len(prefix) + 1 :] for m in members)
    if suffixes == ["k_proj", "q_proj", "v_proj"]:
        return f"{prefix}.[qkv]_proj"
    if suffixes == ["gate_proj", "up_proj"]:
        return f"{prefix}.[gu][ap]*_proj"  # gate_proj, up_proj; not down_proj
    if suffixes == ["w1", "w3"]:
        return f"{prefix}.w[13]"
    return f"{prefix}.{{{','.join(suffixes)}}}"


def is_router(name: str) -> bool:
    """A MoE router's module name (`<layer>.<sparse block>.gate`)."""
    return projection_of(name) is ROUTER


def expert_of(name: str) -> tuple[str, int] | None:
    """(sparse block, expert index) of a tensor name under `<layer>.<block>.experts.<e>.`, else None."""
    head, found, rest = name.partition(".experts.")
    index = rest.partition(".")[0]
    if not found or not index.isdigit() or layer_index(head + ".") is None or head.count(".") != 3:
        return None
    return head, int(index)


def is_embedding(module: str) -> bool:
    """A module holding an embedding table (ours `model.embed_tokens`; GPT-2's wte / wpe)."""
    return "embed" in module or module.rpartition(".")[2] in ("wte", "wpe")
