"""Which precision each linear layer trains in, and the `LinearFn` that applies it.

    recipe = RecipeConfig(name="nvfp4").resolved()         # NVIDIA's recipe; quantizer / gemm "auto" -> this platform's
    pmap = precision_map(recipe, model_config, rules)      # {"model.layers.0.self_attn.q_proj": "bf16", ...}
    linear = make_linear(recipe, pmap, key, group_amax)    # a LinearFn: the model's linear seam

`rules`: a precision file's (`formats.precision_file`): linears in their own format (W4A16 trains
its weight only); `lm_head` and MoE routers stay BF16; fused groups share `group_amax` and one
precision; `training_seam` is training's.
Design notes: docs/design/precision.md.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import zlib
from collections.abc import Mapping
from typing import Literal

import jax
import jax.numpy as jnp

from nvfp4tool.config import ModelConfig
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError
from nvfp4tool.families import fused_group, name_in_layer
from nvfp4tool.formats.precision_file import PrecisionRule, check_groups, resolve_precisions
from nvfp4tool.model.linear import LinearFn, Seam
from nvfp4tool.numerics import dot_nt, linear_output, native_gemm_lowers, tensor_amax
from nvfp4tool.numerics.constants import NVFP4_BLOCK
from nvfp4tool.recipes.fp8_dot import FP8Options, fp8_dot
from nvfp4tool.recipes.nvfp4_dot import (
    GEMMS,
    QUANTIZERS,
    Gemm,
    NVFP4Options,
    NVFP4Weight,
    Quantizer,
    nvfp4_dot,
    quantize_weight,
    resolve_backend,
    weight_only_dot,
)

RecipeName = Literal["bf16", "fp8", "fp8-block", "nvfp4"]
RECIPES = ("bf16", "fp8", "fp8-block", "nvfp4")
# what one linear trains in: a recipe's, or a precision file's NVFP4 weight-only (the weight
# fake-quantized, activations and gradients in BF16; `nvfp4_dot.weight_only_dot`)
WEIGHT_ONLY = "nvfp4-weight-only"
LINEAR_PRECISIONS = (*RECIPES, WEIGHT_ONLY)
GEMM_INPUT_DTYPE = jnp.bfloat16  # activations and weights enter every GEMM in bf16 (or lower)


@dataclasses.dataclass(frozen=True)
class RecipeConfig:
    """A precision recipe and its ablation switches."""

    name: RecipeName = "nvfp4"
    rht: bool = True  # nvfp4: Hadamard transform on the wgrad operands
    stochastic_rounding: bool = True  # nvfp4: SR on gradients
    weight_2d: bool = True  # nvfp4: 16x16 weight scaling
    quantizer: Quantizer = "auto"  # nvfp4: who quantizes: xla | pallas (fused kernels) | auto (pallas on GPU)
    gemm: Gemm = "auto"  # nvfp4: which GEMM: emulated (BF16) | native (FP4, jax.nn.scaled_matmul) | auto
    bf16_first_layers: int | None = None  # leading decoder blocks kept in BF16 (None: the family's default)
    bf16_last_layers: int | None = None  # trailing blocks kept in BF16 (None: the family's default)
    bf16_patterns: tuple[str, ...] = ()  # fnmatch patterns of modules kept in BF16
    switch_to_bf16_at: float | None = None  # step (>= 1) or fraction of the run (< 1) to switch
    switch_scope: Literal["forward", "all"] = "forward"  # what runs in BF16 after the switch

    def __post_init__(self) -> None:
        if self.name not in RECIPES:
            raise NVFP4ToolError(f"unknown recipe {self.name!r}; choose one of {', '.join(RECIPES)}")
        if self.quantizer not in QUANTIZERS:
            raise NVFP4ToolError(f"quantizer must be one of {', '.join(QUANTIZERS)}, got {self.quantizer!r}")
        if self.gemm not in GEMMS:
            raise NVFP4ToolError(f"gemm must be one of {', '.join(GEMMS)}, got {self.gemm!r}")
        if self.switch_scope not in ("forward", "all"):
            raise NVFP4ToolError(f"switch_scope must be 'forward' or 'all', got {self.switch_scope!r}")
        if (self.bf16_first_layers or 0) < 0 or (self.bf16_last_layers or 0) < 0:
            raise NVFP4ToolError("bf16_first_layers / bf16_last_layers must be >= 0")

    def resolved(self) -> RecipeConfig:
        """This recipe with `quantizer` and `gemm` resolved for this platform ("auto": see
        `resolve_backend`); gemm "native" where `jax.nn.scaled_matmul` has no lowering (no CUDA
        GPU) is a usage error naming gemm."""
        quantizer, gemm = resolve_backend(self.quantizer, self.gemm)
        if gemm == "native" and not native_gemm_lowers():
            raise NVFP4UsageError(
                f"gemm='native': jax.nn.scaled_matmul has no lowering on "
                f"{jax.default_backend()!r} (the native FP4 GEMM needs a CUDA GPU); "
                "use gemm=emulated or gemm=auto"
            )
        return dataclasses.replace(self, quantizer=quantizer, gemm=gemm)

    def backend(self) -> dict[str, str] | None:
        """{"quantizer": ..., "gemm": ...} of a resolved nvfp4 recipe (what a run records and
        prints), None for the other recipes (they use neither)."""
        if self.name != "nvfp4":
            return None
        if "auto" in (self.quantizer, self.gemm):
            raise NVFP4ToolError("RecipeConfig.backend(): resolve the recipe first (resolved())")
        return {"quantizer": self.quantizer, "gemm": self.gemm}

    def switch_step(self, total_steps: int) -> int | None:
        """The first step (1-based) that runs in BF16 after the switch, or None."""
        if self.switch_to_bf16_at is None:
            return None
        at = self.switch_to_bf16_at
        return int(at) if at >= 1 else max(1, math.ceil(at * total_steps) + 1)


def precision_map(recipe: RecipeConfig, config: ModelConfig, rules: tuple[PrecisionRule, ...] = ()) -> dict[str, str]:
    """Linear module name -> "bf16" or the recipe's name, for every linear of the model; `rules`
    (a precision file's, in order, the last matching one winning) give the linears they match
    their own precision over that (`lm_head` and routers stay BF16). A rule matching no linear, or
    a fused group split across quantized precisions, is refused naming its FILE:LINE; a group with
    a BF16 member is BF16 whole (as export plans it)."""
    L = config.num_layers
    first, last = config.family_spec.bf16_blocks(L)
    first = first if recipe.bf16_first_layers is None else recipe.bf16_first_layers
    last = last if recipe.bf16_last_layers is None else recipe.bf16_last_layers
    kept_layers = set(range(min(first, L))) | set(range(max(0, L - last), L))
    result = {}
    for m in config.modules.linears:  # lm_head and routers: keep_dtype
        keep = (
            recipe.name == "bf16"
            or m.keep_dtype
            or m.layer in kept_layers
            or any(fnmatch.fnmatchcase(m.name, pattern) for pattern in recipe.bf16_patterns)
        )
        result[m.name] = "bf16" if keep else recipe.name
    if not rules:
        return result
    names = tuple(m.name for m in config.modules.linears if not m.keep_dtype)
    for rule in rules:
        if not any(fnmatch.fnmatchcase(n, rule.pattern) for n in names):
            raise NVFP4ToolError(f"{rule.origin}: {rule.pattern!r} matches no quantizable linear module of the model")
    ruled = {n: p for n, p in resolve_precisions(names, "", rules).items() if p}
    precision = {n: ruled.get(n, result[n]) for n in names}
    check_groups(names, precision, rules, always=())
    kept = {fused_group(n) for n, p in precision.items() if p == "bf16"}
    return result | {n: "bf16" if fused_group(n) in kept else p for n, p in precision.items()}


def check_block_widths(pmap: Mapping[str, str], config: ModelConfig) -> None:
    """NVFP4ToolError naming the first NVFP4 linear whose weight is not 16-element blocks along
    both axes: the recipe quantizes the forward GEMM's operands along in_features and the backward's
    (the output gradient) along out_features, and never pads a block. Said before the step compiles
    (the quantizer's own error names an operand of a traced GEMM, not the linear)."""
    for m in config.modules.linears:
        if pmap.get(m.name) in ("nvfp4", WEIGHT_ONLY) and any(width % NVFP4_BLOCK for width in m.shape):
            out_features, in_features = m.shape
            raise NVFP4ToolError(
                f"{m.name}: weight {out_features} x {in_features} (out x in features) cannot train with "
                f"the nvfp4 recipe: its forward and backward GEMMs quantize both widths in {NVFP4_BLOCK}-element "
                f"blocks; keep it in BF16 (bf16_patterns) or use widths that are multiples of {NVFP4_BLOCK}"
            )


def group_amax(weights: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """Fused group -> joint amax of its members' BF16 weights (module name -> weight [N, K])."""
    result: dict[str, jax.Array] = {}
    for name, w in weights.items():
        amax = tensor_amax(w.astype(GEMM_INPUT_DTYPE))
        group = fused_group(name)
        result[group] = amax if group not in result else jnp.maximum(result[group], amax)
    return result


def layer_key(step_key: jax.Array, name: str) -> jax.Array:
    """The stochastic-rounding key of linear `name` in one step: `step_key` folded with a stable
    hash of the name (crc32, not Python's per-process `hash`), so every layer gets its own stream
    and the same (seed, step, layer) reproduces across runs and resumes."""
    return jax.random.fold_in(step_key, zlib.crc32(name.encode()) & 0x7FFFFFFF)


def nvfp4_options(recipe: RecipeConfig, bf16_scope: Literal["none", "forward", "all"] = "none") -> NVFP4Options:
    """The options of the recipe's nvfp4 layers (see `make_linear` for `bf16_scope`)."""
    return NVFP4Options(
        rht=recipe.rht,
        stochastic_rounding=recipe.stochastic_rounding,
        weight_2d=recipe.weight_2d,
        quantize_fprop=bf16_scope == "none",
        quantizer=recipe.quantizer,
        gemm=recipe.gemm,
    )


def quantize_weights(
    recipe: RecipeConfig,
    pmap: Mapping[str, str],
    weights: Mapping[str, jax.Array],
    amax_by_group: Mapping[str, jax.Array] | None = None,
    bf16_scope: Literal["none", "forward", "all"] = "none",
) -> dict[str, NVFP4Weight]:
    """The GEMM operands of each nvfp4 layer's weight (module name -> weight [N, K] in `weights`),
    quantized from its BF16 rounding against its fused group's amax, as `make_linear`'s layers
    would; for `make_linear(..., weights=)`. Empty when no layer runs nvfp4 GEMMs."""
    if bf16_scope == "all":
        return {}
    options = nvfp4_options(recipe, bf16_scope)
    result = {}
    for name, w in weights.items():
        if pmap.get(name) == "nvfp4":
            amax = None if amax_by_group is None else amax_by_group.get(fused_group(name))
            result[name] = quantize_weight(w.astype(GEMM_INPUT_DTYPE), amax, options)
    return result


def recipe_gemm(
    recipe: RecipeConfig,
    precision: str,
    x: jax.Array,
    w_NxK: jax.Array,
    b_N: jax.Array | None,
    *,
    key: jax.Array | None,
    amax: jax.Array | None,
    weight: NVFP4Weight | None,
    bf16_scope: Literal["none", "forward", "all"] = "none",
) -> jax.Array:
    """`y = x @ w.T + b` of one linear in `precision` (one of `LINEAR_PRECISIONS`):
    the one implementation behind `make_linear` and `RecipeTap`. nvfp4: `key` the layer's SR key
    (`layer_key`), `amax` its fused group's weight amax (None: its own), `weight` its operands
    from `quantize_weights` (None: quantized here)."""
    precision = "bf16" if bf16_scope == "all" else precision
    x_lp, w_lp = x.astype(GEMM_INPUT_DTYPE), w_NxK.astype(GEMM_INPUT_DTYPE)
    if precision == "bf16":
        y = dot_nt(x_lp, w_lp)
    elif precision == "nvfp4":
        if key is None and recipe.stochastic_rounding:
            raise NVFP4ToolError("the nvfp4 recipe with stochastic rounding needs a PRNG key")
        y = nvfp4_dot(
            x_lp, w_lp, key if key is not None else jax.random.key(0), amax, nvfp4_options(recipe, bf16_scope), weight
        )
    elif precision == WEIGHT_ONLY:
        y = weight_only_dot(x_lp, w_lp, amax, "2d" if recipe.weight_2d else "1d", quantize_fprop=bf16_scope == "none")
    else:
        y = fp8_dot(
            x_lp,
            w_lp,
            FP8Options(scaling="block" if precision == "fp8-block" else "tensor", quantize_fprop=bf16_scope == "none"),
        )
    return linear_output(y, b_N, x.dtype)


def make_linear(
    recipe: RecipeConfig,
    pmap: Mapping[str, str],
    key: jax.Array | None = None,
    amax_by_group: Mapping[str, jax.Array] | None = None,
    bf16_scope: Literal["none", "forward", "all"] = "none",
    weights: Mapping[str, NVFP4Weight] | None = None,
) -> LinearFn:
    """The LinearFn of one step: each layer by its precision in `pmap` (concrete names).

    key: this step's randomness (SR), folded with a hash of the layer name (`layer_key`);
    amax_by_group: the fused groups' weight amax (from `group_amax`), else each weight's own;
    bf16_scope: after `switch_to_bf16_at`, "forward" runs fprop in BF16 (gradients stay in the
    recipe), "all" runs the whole layer in BF16;
    weights: the nvfp4 layers' weight operands from `quantize_weights` (same recipe, amax and
    scope), used instead of quantizing each weight where it is multiplied.
    """

    def linear(x, w_NxK, b_N, *, name):
        if name not in pmap:
            raise NVFP4ToolError(f"linear layer {name!r} is not in the precision map")
        # no key: nvfp4 with SR is refused (recipe_gemm); without SR the key is never drawn from
        layer = layer_key(key, name) if key is not None else None
        amax = None if amax_by_group is None else amax_by_group.get(fused_group(name))
        return recipe_gemm(
            recipe,
            pmap[name],
            x,
            w_NxK,
            b_N,
            key=layer,
            amax=amax,
            weight=None if weights is None else weights.get(name),
            bf16_scope=bf16_scope,
        )

    return linear


@dataclasses.dataclass(frozen=True, eq=False)
class RecipeTap:
    """Training's linear tap: each linear in the precision its layer's aux gives it (see the
    module docstring; absent: BF16), recording max|x| of each quantized layer's BF16 input."""

    recipe: RecipeConfig
    bf16_scope: Literal["none", "forward", "all"] = "none"

    def __call__(self, x, w_NxK, b_N, *, name, aux):
        where = name_in_layer(name) or name
        precision, inputs = next(
            ((p, linears[where]) for p, linears in (aux or {}).items() if where in linears), ("bf16", {})
        )
        y = recipe_gemm(
            self.recipe,
            precision,
            x,
            w_NxK,
            b_N,
            key=inputs.get("key"),
            amax=inputs.get("amax"),
            weight=inputs.get("weight"),
            bf16_scope=self.bf16_scope,
        )
        return y, None if precision == "bf16" else tensor_amax(x.astype(GEMM_INPUT_DTYPE))


def training_seam(
    recipe: RecipeConfig,
    pmap: Mapping[str, str],
    config: ModelConfig,
    key: jax.Array,
    quantized: tuple[Mapping[str, jax.Array], Mapping[str, NVFP4Weight]] | None = None,
    bf16_scope: Literal["none", "forward", "all"] = "none",
) -> Seam:
    """The seam of one training micro-batch: `RecipeTap` and each layer's aux (SR keys from `key`,
    `quantized` = (group amax, quantized weights) of this step, else each weight quantized where
    it is multiplied against its own amax)."""
    amax_by_group, weights = quantized if quantized is not None else (None, None)

    def aux_of(layer: int | None) -> dict[str, dict[str, dict]]:
        aux: dict[str, dict[str, dict]] = {}
        if bf16_scope == "all":
            return aux
        for name in config.modules.in_layer(layer):  # layer None: the LM head
            precision = pmap[name]
            if precision == "bf16":
                continue
            inputs = {}
            if precision == WEIGHT_ONLY:
                inputs = {"amax": None if amax_by_group is None else amax_by_group.get(fused_group(name))}
            if precision == "nvfp4":
                inputs = {
                    "key": layer_key(key, name),
                    "amax": None if amax_by_group is None else amax_by_group.get(fused_group(name)),
                    "weight": None if weights is None else weights.get(name),
                }
            aux.setdefault(precision, {})[name_in_layer(name) or name] = inputs
        return aux

    def treatment(layer: int) -> tuple:
        return tuple(sorted((name_in_layer(n), pmap[n]) for n in config.modules.in_layer(layer)))

    return Seam(RecipeTap(recipe, bf16_scope), aux_of=aux_of, treatment=treatment)
