"""RoPE scaling records: how config.json spells each scaling type (`from_hf` / `to_hf`), one
record class per `rope_type`, found by `rope_scaling_from_hf`. Their math is `model/rope.py`'s
(`SCALED`); a new type is a record here and a function there.
Design notes: docs/design/families.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.families.hf_values import integer as _integer
from nvfp4tool.families.hf_values import number as _number

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """llama3-type RoPE frequency scaling (Llama 3.1 / 3.2)."""

    rope_type: ClassVar[str] = "llama3"
    factor: float  # wavelengths longer than original_max / low_freq_factor are divided by this
    low_freq_factor: float  # wavelengths above original_max / low_freq_factor: fully scaled
    high_freq_factor: float  # wavelengths below original_max / high_freq_factor: unscaled
    original_max_position_embeddings: int  # the context length the model was pre-trained at

    def __post_init__(self) -> None:
        if not (self.factor >= 1.0 and 0 < self.low_freq_factor < self.high_freq_factor):
            raise NVFP4ToolError(
                f"rope_scaling llama3: need factor >= 1 and 0 < low_freq_factor < high_freq_factor, "
                f"got factor={self.factor}, low_freq_factor={self.low_freq_factor}, "
                f"high_freq_factor={self.high_freq_factor}"
            )
        if self.original_max_position_embeddings <= 0:
            raise NVFP4ToolError(
                f"rope_scaling llama3: original_max_position_embeddings must be > 0, "
                f"got {self.original_max_position_embeddings}"
            )

    @classmethod
    def from_hf(cls, scaling: Mapping[str, Any]) -> RopeScaling:
        return cls(
            factor=_number(scaling, "factor"),
            low_freq_factor=_number(scaling, "low_freq_factor"),
            high_freq_factor=_number(scaling, "high_freq_factor"),
            original_max_position_embeddings=_integer(scaling, "original_max_position_embeddings"),
        )

    def to_hf(self) -> dict[str, Any]:
        return {
            "rope_type": self.rope_type,
            "factor": self.factor,
            "low_freq_factor": self.low_freq_factor,
            "high_freq_factor": self.high_freq_factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
        }


@dataclass(frozen=True)
class LinearRopeScaling:
    """linear-type RoPE scaling (position interpolation: every frequency divided by `factor`;
    Gemma 3's global layers)."""

    rope_type: ClassVar[str] = "linear"
    factor: float

    def __post_init__(self) -> None:
        if not (self.factor > 0 and math.isfinite(self.factor)):
            raise NVFP4ToolError(f"rope_scaling linear: factor must be > 0, got {self.factor}")

    @classmethod
    def from_hf(cls, scaling: Mapping[str, Any]) -> LinearRopeScaling:
        return cls(factor=_number(scaling, "factor"))

    def to_hf(self) -> dict[str, Any]:
        return {"rope_type": self.rope_type, "factor": self.factor}


@dataclass(frozen=True)
class YarnRopeScaling:
    """yarn-type RoPE scaling (YaRN; DeepSeek-V3 / R1, Kimi-K2): frequencies between the
    `beta_fast` and `beta_slow` rotation counts over `original_max_position_embeddings` ramped from
    extrapolated to interpolated by `factor`; cos and sin times the attention factor (given, or
    mscale(factor, mscale) / mscale(factor, mscale_all_dim), or mscale(factor)). The keys as
    transformers' `_compute_yarn_parameters` reads them; None: absent (its defaults apply)."""

    rope_type: ClassVar[str] = "yarn"
    factor: float
    original_max_position_embeddings: int
    beta_fast: float | None = None  # None: 32
    beta_slow: float | None = None  # None: 1
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool | None = None  # None: True (the correction range rounded outwards)

    def __post_init__(self) -> None:
        if not (self.factor > 0 and math.isfinite(self.factor)):
            raise NVFP4ToolError(f"rope_scaling yarn: factor must be > 0, got {self.factor}")
        if self.original_max_position_embeddings <= 0:
            raise NVFP4ToolError(
                f"rope_scaling yarn: original_max_position_embeddings must be > 0, "
                f"got {self.original_max_position_embeddings}"
            )

    @classmethod
    def from_hf(cls, scaling: Mapping[str, Any]) -> YarnRopeScaling:
        truncate = scaling.get("truncate")
        if truncate is not None and not isinstance(truncate, bool):
            raise NVFP4ToolError(f"rope_scaling yarn: truncate must be true or false, got {truncate!r}")
        return cls(
            factor=_number(scaling, "factor"),
            original_max_position_embeddings=_integer(scaling, "original_max_position_embeddings"),
            beta_fast=_number(scaling, "beta_fast", None),
            beta_slow=_number(scaling, "beta_slow", None),
            mscale=_number(scaling, "mscale", None),
            mscale_all_dim=_number(scaling, "mscale_all_dim", None),
            attention_factor=_number(scaling, "attention_factor", None),
            truncate=truncate,
        )

    def to_hf(self) -> dict[str, Any]:
        keys = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")
        given = {k: getattr(self, k) for k in keys if getattr(self, k) is not None}
        return {
            "rope_type": self.rope_type,
            "factor": self.factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
            **given,
        }


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's mscale (its Eq. 21, transformers' `yarn_get_mscale`): 0.1 mscale ln(scale) + 1, 1 at scale <= 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


# rope_type -> its scaling record (`from_hf` / `to_hf`; its math: `model/rope.py`); "default": none
ROPE_SCALINGS: dict[str, Any] = {r.rope_type: r for r in (RopeScaling, LinearRopeScaling, YarnRopeScaling)}


def rope_scaling_from_hf(scaling: Mapping[str, Any], source: str) -> Any:
    """The scaling record of a config.json RoPE object (`rope_scaling`, or one of transformers 5's
    `rope_parameters`; its `rope_type`, or legacy `type`); None for "default"; NVFP4ToolError
    naming `source` for a type not in `ROPE_SCALINGS` or a missing key."""
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type not in ROPE_SCALINGS:
        raise NVFP4ToolError(
            f"{source}: RoPE scaling type {rope_type!r} unsupported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    try:
        return ROPE_SCALINGS[rope_type].from_hf(scaling)
    except KeyError as missing:
        raise NVFP4ToolError(f"{source}: {rope_type} rope scaling lacks {missing.args[0]!r}") from None
