"""What a checkpoint check found: problems (one line each), per-module stats, the KV-cache scales it
verified, JSON and rich tables."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

FILE_LEVEL = "<files>"  # the `module` of a problem about files, headers or the index
CONFIG_LEVEL = "<config>"  # the `module` of a problem about config.json / hf_quant_config.json


@dataclasses.dataclass(frozen=True)
class Problem:
    """One thing that makes the checkpoint unfit to serve."""

    module: str  # module path (e.g. model.layers.0.mlp.gate_proj), a fused group, or FILE/CONFIG_LEVEL
    tensor: str  # full tensor name, or a file name for file / config problems
    message: str

    def line(self) -> str:
        return f"{self.module}: {self.tensor}: {self.message}"


@dataclasses.dataclass
class ModuleStats:
    """Measured facts about one quantized module."""

    module: str
    kind: str  # "nvfp4" or "fp8"
    n: int | None = None  # output features (rows)
    k: int | None = None  # input features (contraction dimension, unpacked)
    bits_per_param: float | None = None  # 8 * (data + block-scale bytes) / (N * K)
    zero_scale_share: float | None = None  # share of block scales that are 0 (NVFP4 only)
    weight_global_scale: float | None = None  # as stored (ModelOpt: amax/2688; CT: 2688/amax)
    input_global_scale: float | None = None  # as stored, None when absent
    problems: int = 0


@dataclasses.dataclass(frozen=True)
class KVScaleStats:
    """One FP8 KV-cache scale the check read (`kv.py`)."""

    attention: str  # the attention module, e.g. model.layers.0.self_attn
    which: str  # "k" or "v"
    tensor: str  # full tensor name (the layout's: ModelOpt k_proj.k_scale, compressed-tensors k_scale)
    dtype: str  # safetensors dtype code as stored (F32 expected)
    shape: tuple[int, ...]
    value: float | None  # the decode scale amax / 448 as stored; None when not one F32 value
    ok: bool  # F32 of the layout's shape, finite and > 0


@dataclasses.dataclass
class CheckReport:
    """Everything `check_checkpoint` found in one folder."""

    path: str
    format: str  # "modelopt" or "compressed-tensors"
    quant: str  # "nvfp4", "nvfp4-weight-only" or "fp8"
    tp: tuple[int, ...]
    problems: list[Problem] = dataclasses.field(default_factory=list)
    modules: list[ModuleStats] = dataclasses.field(default_factory=list)
    tensors_checked: int = 0
    bytes_read: int = 0
    model_checked: bool = False  # tensors checked against config.json's model (supported family)
    kv_cache: str | None = None  # the quantized KV cache the configs announce ("fp8"), or None
    kv_scales: list[KVScaleStats] = dataclasses.field(default_factory=list)  # every KV scale checked

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "quant": self.quant,
            "tp": list(self.tp),
            "ok": self.ok,
            "modules_checked": len(self.modules),
            "tensors_checked": self.tensors_checked,
            "bytes_read": self.bytes_read,
            "model_checked": self.model_checked,
            "kv_cache": self.kv_cache,
            "kv_scales": [{k: _json_number(v) for k, v in dataclasses.asdict(s).items()} for s in self.kv_scales],
            "problems": [dataclasses.asdict(p) for p in self.problems],
            "modules": [{k: _json_number(v) for k, v in dataclasses.asdict(m).items()} for m in self.modules],
        }

    def failure(self, consequence: str = "") -> str:
        """The one-line error of a failed check (count and the first problem), e.g. for exit 1."""
        more = f"; {consequence}" if consequence else ""
        return f"{self.path}: check failed: {len(self.problems)} problem(s){more}; first: {self.problems[0].line()}"

    def summary_line(self) -> str:
        verdict = "OK" if self.ok else f"{len(self.problems)} problem(s)"
        kv = (
            f", {self.kv_cache.upper()} KV-cache scales of {len({s.attention for s in self.kv_scales})} layers"
            if self.kv_cache
            else ""
        )
        return (
            f"{self.path}: {self.format} {self.quant}, {len(self.modules)} quantized modules{kv}, "
            f"{self.tensors_checked} tensors, TP {','.join(map(str, self.tp))}: {verdict}"
        )


def print_report(report: CheckReport, console: Any) -> None:
    """Problems one per line, then a table of the quantized modules and the summary line (rich)."""
    from rich import box
    from rich.table import Table

    from nvfp4tool.tables import print_line, print_table

    for problem in report.problems:
        print_line(console, problem.line())
    table = Table(title=f"{report.format} {report.quant}", title_justify="left", box=box.SIMPLE_HEAD)
    for column in ("module", "NxK", "bits", "zero", "w scale", "in scale", "problems"):
        table.add_column(column, justify="left" if column == "module" else "right", no_wrap=column == "module")
    for m in report.modules:
        table.add_row(
            m.module,
            _fmt_shape(m.n, m.k),
            _fmt(m.bits_per_param, "{:.3g}"),
            _fmt(m.zero_scale_share, "{:.1%}"),
            _fmt(m.weight_global_scale, "{:.4g}"),
            _fmt(m.input_global_scale, "{:.4g}"),
            str(m.problems),
        )
    print_table(console, table)
    if report.kv_cache:
        print_table(console, _kv_table(report))
    print_line(console, report.summary_line())


def _kv_table(report: CheckReport) -> Any:
    """One row per attention layer: its k and v scale as stored, their dtype, and whether both passed."""
    from rich import box
    from rich.table import Table

    table = Table(title=f"{report.kv_cache.upper()} KV-cache scales", title_justify="left", box=box.SIMPLE_HEAD)
    for column in ("attention", "k scale", "v scale", "dtype", "ok"):
        table.add_column(column, justify="left" if column == "attention" else "right", no_wrap=True)
    layers: dict[str, dict[str, KVScaleStats]] = {}
    for scale in report.kv_scales:
        layers.setdefault(scale.attention, {})[scale.which] = scale
    for attention, scales in layers.items():
        k, v = scales.get("k"), scales.get("v")
        dtypes = "/".join(sorted({s.dtype for s in scales.values()}))
        table.add_row(
            attention,
            _fmt(k.value if k else None, "{:.6g}"),
            _fmt(v.value if v else None, "{:.6g}"),
            dtypes,
            "yes" if k and v and k.ok and v.ok else "no",
        )
    return table


def _json_number(value: Any) -> Any:
    """Strict JSON has no inf / NaN: a non-finite float becomes the string "inf", "-inf" or "nan"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def _fmt_shape(n: int | None, k: int | None) -> str:
    return "-" if n is None or k is None else f"{n}x{k}"
