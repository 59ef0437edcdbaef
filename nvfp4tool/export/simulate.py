"""What a serving engine computes from an export folder, run by our JAX model, weights held as stored.

    exported = load_export("out/model-nvfp4")          # either format, any --quant, mixed too
    logits = forward(exported.model(), ids, linear=served_linear)  # decode + (W4A4) activation quantization

Weights stay as stored (`NVFP4Weight`, `FP8Weight`, `FP8BlockWeight`, each linear by its own scheme
in a mixed export), decoded inside the jitted forward; `served_kv`: FP8 KV.
`for_generation`: the weights decoded / widened once (`DecodedWeight`) where the memory allows.
Design notes: docs/design/export.md.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from converters.hf import HFFolderSource
from converters.tensor_source import tensor_bytes
from nvfp4tool import memory, progress
from nvfp4tool.config import ModelConfig
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.formats import PRECISIONS, quant_title
from nvfp4tool.model.kv import LayerKV
from nvfp4tool.numerics import (
    decode_fp8,
    decode_nvfp4,
    dense,
    dense_widening,
    fake_quantize_fp8,
    fake_quantize_fp8_token_groups,
    fake_quantize_nvfp4,
    nvfp4_block_products,
    times_decode_scale,
)
from nvfp4tool.numerics.constants import FP8_BLOCK, NVFP4_GLOBAL_RANGE


class _Stored:
    """What every stored linear weight answers: its bytes as stored and (from `data`) its [N, K]."""

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.data.shape)

    @property
    def nbytes(self) -> int:
        return sum(int(np.asarray(a).nbytes) for a in jax.tree.leaves(self))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NVFP4Weight(_Stored):
    """An NVFP4 linear weight [N, K] as stored: packed uint8 [N, K/2], float8_e4m3fn block scales
    [N, K/16], the fp32 global decode scale S_dec [], and the input's decode scale [] (W4A4) or None."""

    packed: jax.Array
    scales: jax.Array
    s_dec: jax.Array
    input_scale: jax.Array | None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.packed.shape[0], self.packed.shape[1] * 2)

    def dequantize(self, start: int = 0, stop: int | None = None) -> jax.Array:
        """The served weight (rows start:stop), fp32 [N, K]."""
        return decode_nvfp4(self.packed[start:stop], self.scales[start:stop], self.s_dec)

    def quantize_input(self, x: jax.Array, name: str = "tensor") -> jax.Array:
        """x as the engine's activation quantizer leaves it (unchanged when weight-only)."""
        return quantize_input("nvfp4", self.input_scale, x, name)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FP8Weight(_Stored):
    """An FP8 (E4M3, per-tensor) linear weight [N, K] as stored: data, its fp32 decode scale [], and
    the input's static decode scale [] (W8A8) or None."""

    data: jax.Array
    scale: jax.Array
    input_scale: jax.Array | None

    def dequantize(self, start: int = 0, stop: int | None = None) -> jax.Array:
        """The served weight (rows start:stop), fp32 [N, K]."""
        return decode_fp8(self.data[start:stop], self.scale)

    def quantize_input(self, x: jax.Array, name: str = "tensor") -> jax.Array:
        return quantize_input("fp8", self.input_scale, x, name)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FP8BlockWeight(_Stored):
    """An fp8-block linear weight [N, K] as stored: E4M3 data and its fp32 decode scale per 128x128
    block [ceil(N/128), ceil(K/128)]; the input is quantized dynamically (per token per 128 columns)."""

    data: jax.Array
    scale: jax.Array

    def dequantize(self, start: int = 0, stop: int | None = None) -> jax.Array:
        """The served weight (rows start:stop), fp32 [N, K]: each value times its block's scale."""
        rows = jnp.repeat(self.scale, FP8_BLOCK, axis=0)[start : self.data.shape[0] if stop is None else stop]
        return decode_fp8(self.data[start:stop], rows, granularity="block128")

    def quantize_input(self, x: jax.Array, name: str = "tensor") -> jax.Array:
        return quantize_input("fp8-block", None, x, name)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodedWeight:
    """A weight decoded once (`for_generation`), [N, K]: a stored NVFP4 weight's block products
    e2m1 x block scale (`numerics.nvfp4_block_products`) or a stored FP8 weight's values, BF16
    (exact) with its fp32 decode scale `s_dec`, so each use computes `times_decode_scale(data,
    s_dec)`: the stored weight's `dequantize()` bit for bit; or a BF16 weight widened to fp32
    (`s_dec` None). Its input quantizer is the stored weight's (`quant` "nvfp4" / "fp8" with the
    input's decode scale, None when weight-only; "fp8-block", dynamic, its decoded fp32 values with
    `s_dec` None; "plain" for a BF16 weight)."""

    data: jax.Array
    s_dec: jax.Array | None
    input_scale: jax.Array | None
    quant: str = dataclasses.field(metadata={"static": True})

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.data.shape)

    def dequantize(self, start: int = 0, stop: int | None = None) -> jax.Array:
        rows = self.data[start:stop]
        return rows if self.s_dec is None else times_decode_scale(rows, self.s_dec)

    def quantize_input(self, x: jax.Array, name: str = "tensor") -> jax.Array:
        return quantize_input(self.quant, self.input_scale, x, name)


def quantize_input(quant: str, input_scale: jax.Array | None, x: jax.Array, name: str) -> jax.Array:
    """x as the engine's activation quantizer of a `quant` weight leaves it (unchanged when weight-only;
    fp8-block: dynamic per token per 128 columns, no stored scale)."""
    if quant == "fp8-block":
        return fake_quantize_fp8_token_groups(x, dtype=x.dtype, name=f"input of {name}")
    if input_scale is None:
        return x
    if quant == "fp8":
        return fake_quantize_fp8(x, fmt="e4m3", scale=input_scale, dtype=x.dtype, name=f"input of {name}")
    global_amax = jnp.asarray(input_scale, jnp.float32) * jnp.float32(NVFP4_GLOBAL_RANGE)
    return fake_quantize_nvfp4(x, axis=-1, global_amax=global_amax, dtype=x.dtype, name=f"input of {name}")


DECODE_ONCE_SHARE = 0.25  # decoded copies held beside a model: at most this share of its stored bytes


def for_generation(model, label: str, budget: int | None = None):
    """The held model generation runs with `served_linear`: linear weights held narrower than the
    compute (stored NVFP4 / FP8, or BF16 in fp32 compute) decoded / widened once into a
    `DecodedWeight` (the same values, sliced in the same `dense_widening` blocks, so the same GEMMs:
    tokens and logits bit for bit those of decoding at every step), while their copies fit in
    `budget` bytes: stored quantized weights first (their BF16 block products, 2 bytes a weight,
    the most decode work saved per byte), then BF16 ones (widened to fp32, 4 bytes a weight), each
    in forward order, a linear NAME (e.g. every layer's down_proj) at a time, so that every decoder
    layer keeps one weight layout and the layers share one compiled program (`model.generate`);
    the rest are decoded at every step. Default budget: the smaller of `DECODE_ONCE_SHARE` of the
    model's stored bytes (a held model's peak stays within the stored model and its working set,
    as validate's memory bound promises) and `memory.HEADROOM` of the available memory. Says what
    it did as a status line. The embedding table (a tied LM head too) stays as stored."""
    from nvfp4tool.model.layers import Linear

    linears = {(*path, "weight") for path, node in nnx.iter_graph(model) if isinstance(node, Linear)}
    graphdef, state = nnx.split(model)
    flat = list(nnx.to_flat_state(state))
    narrow = [p for p, v in flat if p in linears and _narrow(v.get_value(), model.compute_dtype)]
    if not narrow:
        return model
    values = {p: v.get_value() for p, v in flat if p in set(narrow)}
    sizes = {p: _decoded_itemsize(values[p]) * math.prod(values[p].shape) for p in narrow}
    groups: dict[tuple, list] = {}  # (stored first, the linear's name in its layer) -> its paths
    for p in narrow:
        groups.setdefault((not _stored(values[p]), _linear_name(p)), []).append(p)
    if budget is None:
        stored = sum(leaf.nbytes for leaf in jax.tree.leaves(state) if hasattr(leaf, "nbytes"))
        budget = int(min(DECODE_ONCE_SHARE * stored, memory.HEADROOM * memory.available_bytes()))
    chosen, used = set(), 0
    for _, paths in sorted(groups.items(), key=lambda kv: kv[0][0]):  # stable: forward order within
        size = sum(sizes[p] for p in paths)
        if used + size <= budget:
            chosen.update(paths)
            used += size
    if not chosen:
        progress.info(
            f"{label}: weights decoded at every generation step (decoding one linear of every layer once "
            f"needs {min(sum(sizes[p] for p in g) for g in groups.values()) / 1e9:.2f} GB, over the "
            f"{budget / 1e9:.2f} GB allowed)"
        )
        return model
    progress.info(
        f"{label}: {len(chosen)} of {len(narrow)} linear weights decoded once for generation "
        f"({used / 1e9:.2f} GB of the {budget / 1e9:.2f} GB allowed), the rest at every step"
    )
    flat = [(p, v.replace(_decode_once(v.get_value())) if p in chosen else v) for p, v in flat]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _narrow(w, compute_dtype) -> bool:
    """A weight `served_linear` decodes or widens at every use."""
    if _stored(w):
        return True
    return jnp.issubdtype(w.dtype, jnp.floating) and jnp.dtype(w.dtype).itemsize < jnp.dtype(compute_dtype).itemsize


def _stored(w) -> bool:
    return isinstance(w, NVFP4Weight | FP8Weight | FP8BlockWeight)


def _decoded_itemsize(w) -> int:
    """Bytes a weight of `w` costs decoded once: 2 for NVFP4 / per-tensor FP8 (exact BF16), else 4."""
    return 2 if isinstance(w, NVFP4Weight | FP8Weight) else 4


def _linear_name(path: tuple) -> tuple:
    """A linear weight's path without its layer index (`layers`, i, ...): the same for every
    layer's linear of that name."""
    parts = list(path)
    if "layers" in parts:
        at = parts.index("layers")
        del parts[at : at + 2]
    return tuple(parts)


@jax.jit
def _decode_once(w) -> DecodedWeight:
    if isinstance(w, NVFP4Weight):
        quant, data, s_dec = "nvfp4", nvfp4_block_products(w.packed, w.scales), w.s_dec
    elif isinstance(w, FP8BlockWeight):  # a scale per 128x128 block: held decoded, fp32
        return DecodedWeight(data=w.dequantize(), s_dec=None, input_scale=None, quant="fp8-block")
    elif isinstance(w, FP8Weight):
        quant, data, s_dec = "fp8", w.data.astype(jnp.bfloat16), w.scale  # E4M3 is exact in BF16
    else:
        return DecodedWeight(data=w.astype(jnp.float32), s_dec=None, input_scale=None, quant="plain")
    return DecodedWeight(data=data, s_dec=jnp.asarray(s_dec, jnp.float32), input_scale=w.input_scale, quant=quant)


KVScales = tuple[jax.Array | float, jax.Array | float]  # (k scale, v scale) of one attention, fp32 []


def served_kv(k_BxTxKVxD: jax.Array, v_BxTxKVxD: jax.Array, scales: KVScales) -> tuple[jax.Array, jax.Array]:
    """K and V as an FP8 KV cache with static per-tensor decode scales serves them: E4M3 of
    clamp(x / scale) times scale, in the input's dtype."""
    k_scale, v_scale = scales
    return (
        fake_quantize_fp8(k_BxTxKVxD, fmt="e4m3", scale=k_scale, dtype=k_BxTxKVxD.dtype, name="K cache"),
        fake_quantize_fp8(v_BxTxKVxD, fmt="e4m3", scale=v_scale, dtype=v_BxTxKVxD.dtype, name="V cache"),
    )


@dataclasses.dataclass(frozen=True)
class ServedKVTap:
    """`model.linear.KVTap` of the FP8 KV cache: the layer's `KVScales` come as its aux, or as its
    aux's entry `key` when the aux carries more (a linear tap's per-layer entries beside them)."""

    key: str | None = None

    def __call__(self, k, v, *, name, aux):
        return served_kv(k, v, aux if self.key is None else aux[self.key]), None


def served_linear(x: jax.Array, w_NxK, b_N: jax.Array | None, *, name: str) -> jax.Array:
    """The LinearFn of a model held as stored: a stored quantized weight quantizes its input (W4A4 /
    W8A8) and is decoded (a `DecodedWeight`: its decoded rows sliced, in the same blocks, so the
    same GEMMs); a plain weight (BF16) is used as it is. `numerics.dense` either way (the
    plain BF16 linear of the source too). A weight is decoded or widened to x's dtype only when its
    input exists and a block of rows at a time (`numerics.dense_widening`), so a program holds at most
    `numerics.dot.WIDEN_BYTES` of widened weight at a time."""
    if isinstance(w_NxK, NVFP4Weight | FP8Weight | FP8BlockWeight | DecodedWeight):
        x = w_NxK.quantize_input(x, name)
        return dense_widening(x, w_NxK, b_N, widen_rows=lambda w, start, stop: w.dequantize(start, stop))
    if w_NxK.dtype != x.dtype:
        return dense_widening(x, w_NxK, b_N)
    return dense(x, w_NxK, b_N)


class ExportedModel:
    """An export folder opened for serving: config, layout, and its tensors read on demand (`get`)."""

    def __init__(
        self,
        folder: str,
        config: ModelConfig,
        layout,
        source: HFFolderSource,
        specs: dict,
        kv_cache: str | None = None,
    ) -> None:
        self.folder, self.config, self.quantized = folder, config, tuple(specs)
        self.format: str = layout.format  # "modelopt" | "compressed-tensors"
        self.quant: str = layout.quant  # "nvfp4" | "nvfp4-weight-only" | "fp8" | "fp8-block" | "mixed"
        self.kv_cache = kv_cache  # "fp8" when the configs announce a quantized KV cache, else None
        self._spec, self._source, self._quantized_set = layout.spec, source, frozenset(specs)
        self._specs = specs  # quantized module -> its LayoutSpec (a mixed export's differ)

    def quant_of(self, module: str) -> str:
        """The quant of the quantized module `module` (its scheme's in a mixed export)."""
        return self._specs[module].quant

    def precisions(self) -> tuple[str, ...]:
        """The precisions its linears carry, in `formats.PRECISIONS` order: its quants, and "bf16"
        when a decoder linear (not lm_head or a router, which always are) stays BF16."""
        kept = set(self.config.modules.kept())
        found = {self.quant_of(m) for m in self.quantized}
        if any(n not in self._quantized_set and n not in kept for n in self.config.linear_names()):
            found.add("bf16")
        return tuple(p for p in PRECISIONS if p in found)

    @property
    def title(self) -> str:
        """How reports name it: "NVFP4", "NVFP4 W4A16", "FP8", "Mixed (NVFP4/FP8/BF16)" (`formats.quant_title`)."""
        return quant_title(self.quant, self.precisions())

    @property
    def path(self) -> str:
        return self.folder

    def names(self) -> list[str]:
        """The model's HF tensor names (a quantized module's weight stands for its stored group)."""
        return list(self.config.expected_tensor_shapes())

    def get(self, name: str):
        """One tensor as stored: a quantized module's `<m>.weight` is its `NVFP4Weight` /
        `FP8Weight` / `FP8BlockWeight` (numpy arrays); anything else the stored array (BF16 as BF16)."""
        module, _, suffix = name.rpartition(".")
        if module not in self._quantized_set or suffix != "weight":
            return self._source.get(name)
        spec = self._specs[module]
        group = {f"{module}.{t.suffix}": self._source.get(f"{module}.{t.suffix}") for t in spec.tensors}
        roles = spec.to_roles(module, group)
        if spec.is_fp8_block:
            return FP8BlockWeight(data=roles["weight"], scale=np.asarray(roles["block_scale"], np.float32))
        input_scale = np.asarray(roles["input_global"], np.float32).reshape(()) if "input_global" in roles else None
        s_dec = np.asarray(roles["weight_global"], np.float32).reshape(())
        if spec.quant == "fp8":
            return FP8Weight(data=roles["weight"], scale=s_dec, input_scale=input_scale)
        return NVFP4Weight(packed=roles["weight"], scales=roles["block_scale"], s_dec=s_dec, input_scale=input_scale)

    def kv_scales(self, layer: int) -> KVScales:
        """The stored (k scale, v scale) of attention layer `layer`, fp32 [] each (an export with
        an FP8 KV cache)."""
        names = self._spec.kv_scales.names(self.config.modules.attention(layer))
        k_scale, v_scale = (np.asarray(self._source.get(n), np.float32).reshape(()) for n in names)
        return k_scale, v_scale

    def kv_aux(self, layer: int | None) -> KVScales | None:
        """The KV scales decoder layer `layer`'s block reads as its aux when served layer by layer:
        None for the head (`layer` None) and for a layer without attention (a hybrid's Mamba and
        MLP layers)."""
        if layer is None or self.config.modules.attention(layer) is None:
            return None
        return self.kv_scales(layer)

    def served_kv(self) -> LayerKV:
        """The KV seam of this export's FP8 KV cache, for a whole model (generation): each
        attention layer's stored scales as its aux (`kv_aux`), so alike layers share a program."""
        return LayerKV(ServedKVTap(), lambda layer: self.kv_aux(layer))

    def module_bytes(self, module: str) -> int:
        """The stored bytes of a quantized module's weight group (weight, scales, input scale)."""
        return sum(tensor_bytes(self._source, f"{module}.{t.suffix}") for t in self._specs[module].tensors)

    def dequantized(self, module: str) -> np.ndarray:
        """A quantized module's served weight, fp32 [N, K] (for SQNR, tests)."""
        return np.asarray(self.get(f"{module}.weight").dequantize())

    def stored_tensor_bytes(self) -> dict[str, int]:
        """{stored tensor name: its bytes as stored}."""
        return {n: tensor_bytes(self._source, n) for n in self._source.names()}

    def stored_bytes(self) -> int:
        """The model's weights as stored (what holding it costs)."""
        return sum(self.stored_tensor_bytes().values())

    def model(self, compute_dtype: jnp.dtype = jnp.float32, mesh: jax.sharding.Mesh | None = None):
        """A CausalLM holding every weight as stored (run it with `linear=served_linear`), sharded
        over `mesh` when given (`model_from_tensors`)."""
        from nvfp4tool.model.weights import model_from_tensors

        return model_from_tensors(self.config, self, dtype=None, compute_dtype=compute_dtype, check=False, mesh=mesh)


def load_export(folder: str) -> ExportedModel:
    """Open an export folder written by `nvfp4tool export` (or `convert-format`), in any layout
    `nvfp4tool.formats` declares: each quantized module's tensors are read by role with the
    folder's spec (decode scales whatever the stored convention). Tensors are read when asked for."""
    from nvfp4tool import formats

    layout = formats.describe(folder)
    config = ModelConfig.from_hf_folder(folder)
    source = HFFolderSource(folder, check_config=False).use_names_of(config)
    specs = {}  # quantized module -> its spec: a module with its scheme's marker scale
    for n in source.names():
        module, _, suffix = n.rpartition(".")
        spec = layout.spec_for(config.family_spec.checkpoint_name(module))
        if spec is not None and suffix == spec.marker_suffix:
            specs[module] = spec
    quantized = tuple(specs)
    expected = config.expected_tensor_shapes()
    for name in expected:
        module = name.rpartition(".")[0]
        if module not in quantized and name not in source.names():
            contradiction = config.family_spec.tensors_contradiction(config, source.names())
            raise NVFP4ToolError(f"{folder}: {contradiction or f'tensor {name!r} missing; the config expects it'}")
    return ExportedModel(folder, config, layout, source, specs, layout.kv_cache)
