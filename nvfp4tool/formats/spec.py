"""`LayoutSpec`: the declaration of one serving layout (format x quant), and the file-name
constants every layout shares.

Tensors are declared by role (weight, block_scale, weight_global, input_global), the join key of
`to_roles` / `from_roles`; global scales are "decode" (S_dec: ModelOpt, every FP8 layout) or
"encode" (1 / S_dec: compressed-tensors NVFP4). `fp8-block` has no global scale: its block_scale
is the fp32 decode-scale grid [ceil(N/128), ceil(K/128)]. `KVScaleSpec`: where the KV-cache scales go.
Design notes: docs/design/formats.md.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from converters.fp8_block import FP8Block
from converters.hf import SAFETENSORS_DTYPES
from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.families import is_attention
from nvfp4tool.numerics.constants import FP8_BLOCK, NVFP4_BLOCK

CONFIG_FILE = "config.json"
HF_QUANT_CONFIG_FILE = "hf_quant_config.json"  # ModelOpt's own config (vLLM, TensorRT-LLM read it)
QUANTS = ("nvfp4", "nvfp4-weight-only", "fp8", "fp8-block")  # W4A4, W4A16, FP8 W8A8 per tensor / 128x128 blocks
NVFP4_QUANTS = ("nvfp4", "nvfp4-weight-only")
STATIC_INPUT_QUANTS = ("nvfp4", "fp8")  # quants whose layouts ship a calibrated input scale (fp8-block: dynamic)
# the FP8 quants' weight scaling (`numerics.quantize_fp8`'s granularity): one scale per tensor, or per 128x128 block
FP8_GRANULARITY = {"fp8": "tensor", "fp8-block": "block128x128"}
# bits per weight element of each precision as stored: NVFP4 a 4-bit code + an E4M3 scale per 16 (4.5);
# FP8 8 (its one fp32 scale per tensor not counted); fp8-block 8 + one fp32 scale per full 128x128
# block (8 + 32/16384; a ragged edge block costs its linear a little more, as check counts it); BF16 16
BITS = {
    "nvfp4": 4 + 8 / NVFP4_BLOCK,
    "nvfp4-weight-only": 4 + 8 / NVFP4_BLOCK,
    "fp8": 8.0,
    "fp8-block": 8 + 32 / FP8_BLOCK**2,
    "bf16": 16.0,
}
MIXED = "mixed"  # the quant of a checkpoint whose linears carry several of QUANTS (FolderLayout.quant)
PRECISIONS = (*QUANTS, "bf16")  # what one linear of a mixed export may be (export --precision-file)
ROLES = ("weight", "block_scale", "weight_global", "input_global")
FP8_BLOCKS = FP8Block(block=(FP8_BLOCK, FP8_BLOCK))  # fp8-block: the 128x128 grid of DeepSeek sources


def fp8_block_grid(n: int, k: int) -> tuple[int, int]:
    """fp8-block's scale grid of an [N, K] weight: [ceil(N/128), ceil(K/128)] (`FP8Block.scale_shape`)."""
    return FP8_BLOCKS.scale_shape((n, k))


KV_CACHES = ("fp8",)  # quantized KV caches an export can carry scales for (None: the engine's default)
GLOBAL_ROLES = ("weight_global", "input_global")
# how reports name a precision (a mixed export: "Mixed (NVFP4/FP8/BF16)", `quant_title`)
PRECISION_TITLES = {
    "nvfp4": "NVFP4",
    "nvfp4-weight-only": "NVFP4 W4A16",
    "fp8": "FP8",
    "fp8-block": "FP8 block",
    "bf16": "BF16",
}


def quant_title(quant: str, precisions: tuple[str, ...] | list[str] = ()) -> str:
    """How a report names an export of `quant` ("NVFP4", "NVFP4 W4A16", "FP8"); a mixed one by the
    precisions its linears carry (`precisions`, any order; BF16 when some decoder linear stays
    BF16): "Mixed (NVFP4/FP8/BF16)", in `PRECISIONS` order."""
    if quant != MIXED:
        return PRECISION_TITLES.get(quant, quant.upper())
    shown = [PRECISION_TITLES[p] for p in PRECISIONS if p in precisions]
    return f"Mixed ({'/'.join(shown)})" if shown else "Mixed"


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One stored tensor of a quantized module: its role, name suffix, dtype and shape."""

    role: str  # one of ROLES
    suffix: str  # tensor name = f"{module}.{suffix}"
    code: str  # safetensors dtype code: "U8", "F8_E4M3", "F32"
    shape: Callable[[int, int], tuple[int, ...]]  # (N, K) -> stored shape

    @property
    def dtype(self) -> str:
        """The numpy / ml_dtypes name of `code` (e.g. "float8_e4m3fn")."""
        return SAFETENSORS_DTYPES[self.code]


@dataclasses.dataclass(frozen=True)
class KVScaleSpec:
    """Where a layout stores the FP8 KV-cache scales of one attention module `<a>`
    (`model.layers.{i}.self_attn`): `<a>.<k_suffix>` and `<a>.<v_suffix>`, F32 of `shape`, each the
    decode scale amax / 448 the engine divides K / V by before the E4M3 cache write."""

    k_suffix: str  # "k_proj.k_scale" (ModelOpt) | "k_scale" (compressed-tensors)
    v_suffix: str
    shape: tuple[int, ...]  # () | (1,)
    code: str = "F32"

    def names(self, attention: str) -> tuple[str, str]:
        """(k scale, v scale) tensor names of `attention`."""
        return f"{attention}.{self.k_suffix}", f"{attention}.{self.v_suffix}"

    def layout(self, attention: str) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, dtype name, shape) of `attention`'s two scales, in file order."""
        return [(name, SAFETENSORS_DTYPES[self.code], self.shape) for name in self.names(attention)]

    def attention_of(self, name: str) -> tuple[str, str] | None:
        """(attention module, "k" | "v") when `name` is a KV scale in this layout, else None."""
        for which, suffix in (("k", self.k_suffix), ("v", self.v_suffix)):
            attention = name.removesuffix(f".{suffix}")
            if attention != name and is_attention(attention):
                return attention, which
        return None


@dataclasses.dataclass(frozen=True)
class LayoutSpec:
    """One serving layout: its tensors, scale convention, configs and exclusion rules."""

    format: str  # "modelopt" | "compressed-tensors"
    quant: str  # one of QUANTS
    tensors: tuple[TensorSpec, ...]
    convention: str  # "decode" (stored global = S_dec) | "encode" (stored global = 1 / S_dec)
    pattern_style: str  # "fnmatch" | "exact-or-re" (how exclusion lists / targets match)
    element_range: float  # 2688 = 6 * 448 (NVFP4) or 448 (FP8): decoded amax = range * S_dec
    packing: int  # elements per stored weight item along K (2 for packed E2M1, 1 for FP8)
    kv_scales: KVScaleSpec  # where FP8 KV-cache scales go (written only with --kv-cache fp8)
    build_config: Callable[[LayoutSpec, tuple[str, ...], str | None], dict[str, Any]]
    build_hf_quant_config: Callable[[LayoutSpec, tuple[str, ...], dict[str, str], str | None], dict[str, Any]] | None

    # ---------------------------------------------------------------- tensors
    @property
    def is_nvfp4(self) -> bool:
        return self.quant in NVFP4_QUANTS

    @property
    def is_fp8_block(self) -> bool:
        """FP8 with an fp32 decode scale per 128x128 weight block, activations dynamic per token per 128."""
        return self.quant == "fp8-block"

    @property
    def marker_suffix(self) -> str:
        """The suffix of the one scale every quantized module of this layout has (its weight's
        global scale, or fp8-block's scale grid): what says a module is stored quantized."""
        return self.suffix("weight_global") or self.suffix("block_scale")

    @property
    def has_input_scales(self) -> bool:
        return any(t.role == "input_global" for t in self.tensors)

    @property
    def quantizes_activations(self) -> bool:
        """W4A4 / W8A8: a stored input scale, or (fp8-block) dynamic per-token-group scales."""
        return self.has_input_scales or self.is_fp8_block

    @property
    def global_shape(self) -> tuple[int, ...]:
        """Stored shape of a per-tensor scale: () or (1,)."""
        return self.tensor("weight_global").shape(1, 1)

    @property
    def suffixes(self) -> tuple[str, ...]:
        return tuple(t.suffix for t in self.tensors)

    def tensor(self, role: str) -> TensorSpec:
        for t in self.tensors:
            if t.role == role:
                return t
        raise KeyError(f"{self.label} has no {role} tensor")

    def suffix(self, role: str) -> str | None:
        """The suffix of `role`'s tensor, None when this layout has no such tensor."""
        return next((t.suffix for t in self.tensors if t.role == role), None)

    def layout(self, module: str, n: int, k: int) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, dtype name, shape) of the tensors of a quantized [N, K] linear, in file order."""
        return [(f"{module}.{t.suffix}", t.dtype, t.shape(n, k)) for t in self.tensors]

    def nk(self, weight_shape: tuple[int, ...]) -> tuple[int, int]:
        """(N, K) of a module from its stored weight's shape."""
        return int(weight_shape[0]), int(weight_shape[1]) * self.packing

    @property
    def label(self) -> str:
        return f"{self.format} {self.quant}"

    # ---------------------------------------------------------------- global-scale convention
    def stored_global(self, s_dec: np.ndarray | float) -> np.ndarray:
        """The stored value of a per-tensor decode scale `s_dec`, in this layout's shape."""
        value = np.asarray(s_dec, np.float32).reshape(())
        if self.convention == "encode":
            with np.errstate(divide="ignore"):  # 0 -> inf: the checker's inputs may be broken
                value = np.float32(1.0) / value
        return np.asarray(value, np.float32).reshape(self.global_shape)

    def decode_global(self, stored: np.ndarray | float) -> np.ndarray:
        """The decode scale S_dec (fp32, shape []) of a stored per-tensor scale."""
        value = np.asarray(stored, np.float32).reshape(())
        if self.convention == "encode":
            with np.errstate(divide="ignore"):
                value = np.float32(1.0) / value
        return np.asarray(value, np.float32).reshape(())

    def to_roles(self, module: str, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One quantized module's stored tensors -> {role: value}, global scales as S_dec [],
        fp8-block's scale grid as [ceil(N/128), ceil(K/128)]."""
        by_suffix = {t.suffix: t for t in self.tensors}
        roles = {}
        for name, value in tensors.items():
            owner, _, suffix = name.rpartition(".")
            if owner != module or suffix not in by_suffix:
                raise NVFP4ToolError(
                    f"{name}: not a tensor of a {self.label} quantized module "
                    f"(expected {module}.{{{', '.join(by_suffix)}}})"
                )
            role = by_suffix[suffix].role
            if role in GLOBAL_ROLES:
                value = self.decode_global(value)
            elif role == "block_scale" and self.is_fp8_block:
                value = self._grid(value, stored=False)
            roles[role] = value
        missing = [t.suffix for t in self.tensors if t.role not in roles]
        if missing:
            raise NVFP4ToolError(f"{module}.{missing[0]}: missing ({self.label} quantized module)")
        return roles

    def from_roles(self, module: str, roles: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """{role: value} (global scales as S_dec) -> this layout's named tensors, in file order."""
        stored = {}
        for t in self.tensors:
            value = roles[t.role]
            if t.role in GLOBAL_ROLES:
                value = self.stored_global(value)
            elif t.role == "block_scale" and self.is_fp8_block:
                value = self._grid(value, stored=True)
            stored[f"{module}.{t.suffix}"] = value
        return stored

    def _grid(self, value: np.ndarray, *, stored: bool) -> np.ndarray:
        """fp8-block's scale grid as a role ([ceil(N/128), ceil(K/128)]) or as this layout stores it
        (compressed-tensors the same; ModelOpt [N/128, 1, K/128, 1]): the same fp32 values."""
        value = np.asarray(value)
        grid = value.reshape(value.shape[0], -1) if value.ndim else value
        if stored and len(self.tensor("block_scale").shape(1, 1)) == 4:
            return grid.reshape(grid.shape[0], 1, grid.shape[1], 1)
        return grid

    # ---------------------------------------------------------------- configs
    def quantization_config(self, excluded: tuple[str, ...], kv_cache: str | None = None) -> dict[str, Any]:
        """config.json["quantization_config"] for an export excluding the modules `excluded`,
        announcing a quantized KV cache (`kv_cache`: one of KV_CACHES) or none."""
        return self.build_config(self, tuple(excluded), kv_cache)

    def hf_quant_config(
        self, excluded: tuple[str, ...], producer: dict[str, str], kv_cache: str | None = None
    ) -> dict[str, Any] | None:
        """hf_quant_config.json (ModelOpt layouts), None for layouts without one."""
        if self.build_hf_quant_config is None:
            return None
        return self.build_hf_quant_config(self, tuple(excluded), producer, kv_cache)

    @property
    def config_files(self) -> tuple[str, ...]:
        """The JSON files this layout's configs live in."""
        return (CONFIG_FILE,) + ((HF_QUANT_CONFIG_FILE,) if self.build_hf_quant_config else ())

    # ---------------------------------------------------------------- exclusion lists
    def matches(self, module: str, pattern: str) -> bool:
        """Whether an exclusion / target `pattern` names `module` (a malformed regex never does)."""
        if self.pattern_style == "fnmatch":
            return fnmatch.fnmatchcase(module, pattern)
        if pattern.startswith("re:"):
            compiled = _regex(pattern[3:])
            return compiled is not None and compiled.match(module) is not None
        return pattern == module

    def excluded_by(self, module: str, patterns: tuple[str, ...]) -> str | None:
        """The first pattern of `patterns` that excludes `module`, or None."""
        return next((p for p in patterns if self.matches(module, p)), None)

    def pattern_problem(self, pattern: str) -> str | None:
        """Why `pattern` cannot be matched (a malformed `re:` regex), or None."""
        if self.pattern_style == "fnmatch" or not pattern.startswith("re:"):
            return None
        try:
            re.compile(pattern[3:])
        except re.error as bad:
            return f"malformed regex {pattern!r} ({bad})"
        return None


def _regex(text: str) -> re.Pattern | None:
    try:
        return re.compile(text)
    except re.error:
        return None
