"""`ExportRecord`: the provenance record `nvfp4tool_export.json` written next to every export
(by `export/writer.py`) and read by `check` (and the hub card).

What was exported from what, how (source by name + sha256, options, calibration, per-layer errors),
and per written tensor its file, dtype, shape, sha256 and (quantized) decoded amax; no absolute path.
Design notes: docs/design/records.md.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from collections.abc import Mapping
from typing import Any, ClassVar

from nvfp4tool import progress
from nvfp4tool.records.base import Record
from nvfp4tool.records.names import portable_name


@dataclasses.dataclass(frozen=True)
class ToolRecord(Record):
    name: str  # "nvfp4tool"
    version: str


@dataclasses.dataclass(frozen=True)
class SourceQuantizationRecord(Record):
    """How the source stored its weights when it was not plain floating point: an FP8 block-scaled
    checkpoint (config.json's quantization_config), read dequantized to BF16."""

    quant_method: str  # "fp8"
    fmt: str  # "e4m3"
    weight_block_size: tuple[int, int]  # rows x columns sharing one scale, e.g. [128, 128]
    activation_scheme: str  # "dynamic"


@dataclasses.dataclass(frozen=True)
class SourceRecord(Record):
    """The exported checkpoint, named without its location."""

    name: str  # the source folder's name, or its Hub id when known
    kind: str  # "hf" | "maxtext" | "run"
    step: int | None  # a training run's checkpoint step (None: its final weights)
    files: dict[str, str]  # weight file, relative to the source folder -> sha256
    # the files that define the model with its weights (config.json, generation_config.json, the
    # tokenizer's: `Checkpoint.definition_files`), relative to the source folder -> sha256; None in
    # a record written before they were bound (then only the weights are compared)
    config_files: dict[str, str] | None = None
    # the source's license as its README.md's metadata (else its config.json) says (`source_license`);
    # None: it says none, or a record written before it was kept (push then reads the source folder)
    license: str | None = None
    # an FP8 block-scaled source, dequantized on reading; None: the source was floating point
    quantization: SourceQuantizationRecord | None = None

    @classmethod
    def of(cls, checkpoint: Any) -> SourceRecord:
        """An opened `nvfp4tool.checkpoints.Checkpoint` named portably, with its weight files hashed
        (an HF folder's safetensors, a run's final or step weights, every file of a MaxText checkpoint)
        and the files that define it besides them."""
        fp8 = getattr(checkpoint, "source_quantization", None)
        return cls(
            name=portable_name(checkpoint.path),
            kind=checkpoint.kind,
            step=checkpoint.step,
            files={os.path.relpath(f, checkpoint.path): sha256_file(f) for f in checkpoint.weight_files},
            config_files=definition_hashes(checkpoint),
            license=source_license(checkpoint.path),
            quantization=None
            if fp8 is None
            else SourceQuantizationRecord(
                quant_method=fp8.quant_method,
                fmt=fp8.fmt,
                weight_block_size=fp8.block,
                activation_scheme=fp8.activation_scheme,
            ),
        )


def source_license(folder: str, config: Mapping[str, Any] | None = None) -> str | None:
    """`license` of a model folder: its README.md's metadata (the model card's YAML front matter),
    else `config` (its config.json, read here when not given), else None. An unreadable card or
    config says nothing (None): a license is a courtesy to the card, never a reason to refuse."""
    import json

    import yaml

    readme = os.path.join(folder, "README.md")
    if os.path.isfile(readme):
        try:
            with open(readme, encoding="utf-8") as f:
                text = f.read()
            front = text.split("---", 2)[1] if text.startswith("---") else ""
            found = (yaml.safe_load(front) or {}).get("license") if front else None
        except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError, IndexError):
            found = None
        if isinstance(found, str):
            return found
    if config is None:
        try:
            with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, UnicodeDecodeError, ValueError):
            config = {}
    found = config.get("license") if isinstance(config, Mapping) else None
    return found if isinstance(found, str) else None


def definition_hashes(checkpoint: Any) -> dict[str, str]:
    """{file relative to the checkpoint's folder: sha256} of `Checkpoint.definition_files`: what
    export records and validate compares and records beside the weight files."""
    return {os.path.relpath(f, checkpoint.path): sha256_file(f) for f in checkpoint.definition_files}


def first_file_difference(expected: Mapping[str, str], actual: Mapping[str, str]) -> tuple[str, str] | None:
    """The first file (in name order) on which two {relative file: sha256} maps disagree, as
    (file, "missing" | "extra" | "differs"): missing from `actual`, only in `actual`, or another
    sha256; None when they are equal. The one comparison of recorded weight hashes (validate's
    FP8 reference, push's chain of custody, a resumed run's teacher)."""
    for name in sorted(set(expected) | set(actual)):
        if name not in actual:
            return name, "missing"
        if name not in expected:
            return name, "extra"
        if expected[name] != actual[name]:
            return name, "differs"
    return None


@dataclasses.dataclass(frozen=True)
class CalibrationRecord(Record):
    """The calibration data of the input scales; for MoE models, how each expert was calibrated.
    `samples` x `seq_len` = `tokens` are the windows that actually ran (what the file gave); the
    `requested_*` what --calib-samples / --calib-seq-len asked (the file may hold fewer)."""

    file: str  # file name (no folder)
    sha256: str
    samples: int  # windows used
    seq_len: int  # tokens per window used
    tokens: int | None = None  # samples * seq_len: calibration tokens used
    requested_samples: int | None = None  # --calib-samples
    requested_seq_len: int | None = None  # --calib-seq-len
    all_experts: bool = False  # MoE: every expert ran on every token of its layer
    routed_tokens: dict[str, int] | None = None  # MoE expert -> tokens its router sent it (may be 0)

    @property
    def unrouted_experts(self) -> tuple[str, ...]:
        """Experts the router sent no calibration token (their scales come from all-experts runs)."""
        return tuple(e for e, n in (self.routed_tokens or {}).items() if n == 0)


@dataclasses.dataclass(frozen=True)
class LayerErrorRecord(Record):
    """Weight quantization error of one quantized linear."""

    rel_l2: float  # ||decode(q) - w|| / ||w||
    rtn_rel_l2: float | None = None  # the same for round-to-nearest (scale search only)
    reduction_vs_rtn: float | None = None  # 1 - rel_l2 / rtn_rel_l2 (scale search only)
    # GPTQ: relative output error on the calibration inputs sqrt(tr(D H D^T) / tr(W H W^T)),
    # D = W - decode(q), H = X^T X undamped; after GPTQ and for nearest rounding with the same scales
    output_rel_err: float | None = None
    rtn_output_rel_err: float | None = None


@dataclasses.dataclass(frozen=True)
class GPTQRecord(Record):
    """How `--weight-rounding gptq` rounded the weights (`export/gptq.py`)."""

    damp: float  # H += damp * mean(diag H) * I
    block_size: int  # columns per lazy-batch block
    act_order: str  # the static column order
    mean_output_err_reduction: float  # mean over quantized linears of 1 - output_rel_err / rtn_output_rel_err
    block_scales: str = "original"  # export.gptq.BLOCK_SCALES: fixed on the original weight, or updated


@dataclasses.dataclass(frozen=True)
class FoldRecord(Record):
    """One equalized site (`export/equalize.py`): its scale s over the producer's channels."""

    alpha: float  # AWQ: the chosen exponent; SmoothQuant: its migration strength
    s_min: float
    s_max: float
    s_geomean: float
    output_err_reduction: float | None  # AWQ: 1 - (output error with s) / (with s = 1) on the calibration data
    scales: str  # s itself: little-endian fp32, base64 (validate rebuilds the folded model from it)


@dataclasses.dataclass(frozen=True)
class EqualizationRecord(Record):
    """How `--equalize` scaled the model before quantizing it, and the check of the folded model."""

    method: str  # "awq" | "smoothquant"
    alphas: list[float]  # AWQ's grid; SmoothQuant: [its alpha]
    sites: dict[str, FoldRecord]  # site (consumers' fused group) -> its scale
    check_windows: int  # calibration windows the folded BF16 model was compared on with the original
    check_kl_mean: float  # mean KL(original || folded) there, nats
    check_top1: float  # top-1 agreement there


@dataclasses.dataclass(frozen=True)
class TensorRecord(Record):
    """One written tensor."""

    file: str  # safetensors file, relative to the export
    dtype: str  # safetensors dtype code ("U8", "F8_E4M3", "F32", "BF16", ...)
    shape: tuple[int, ...]
    sha256: str  # of the tensor's bytes as stored
    amax: float | None = None  # quantized weights: max |decoded value| (fp32)


@dataclasses.dataclass(frozen=True)
class ExportRecord(Record):
    """nvfp4tool_export.json (see the module docstring)."""

    FILE_NAME: ClassVar[str] = "nvfp4tool_export.json"

    tool: ToolRecord
    source: SourceRecord
    format: str  # "modelopt" | "compressed-tensors"
    quant: str  # "nvfp4" | "nvfp4-weight-only" | "fp8" | "mixed" (per linear: precision_map)
    scale_search: str  # "rtn" | "4over6" | "mse"
    weight_block: str  # "1d" | "2d"
    recipe: dict[str, Any] | None  # the training run's recipe (None for plain checkpoints)
    precision_map: dict[str, str]  # linear module -> "bf16" or its quant
    exclude_modules: tuple[str, ...]  # modules kept in BF16
    input_amax_origin: str  # "training run" | "calibration" | "none (weight-only)"
    calibration: CalibrationRecord | None
    input_amax: dict[str, float] | None  # quantized module -> max |input| (W4A4 / FP8)
    layers: dict[str, LayerErrorRecord]  # quantized module -> weight error
    files: tuple[str, ...]  # safetensors files written, relative to the export
    tensors: dict[str, TensorRecord]  # every written tensor
    kv_cache: str = "none"  # "none" | "fp8": the KV-cache scales written (--kv-cache)
    kv_amax: dict[str, tuple[float, float]] | None = None  # attention -> calibrated (max |K| after RoPE, max |V|)
    weight_rounding: str = "rtn"  # "rtn" | "gptq" (--weight-rounding)
    gptq: GPTQRecord | None = None  # with gptq: its settings
    equalize: str = "none"  # "none" | "awq" | "smoothquant" (--equalize)
    equalization: EqualizationRecord | None = None  # with --equalize: the scales and their check
    export_recipe: str | None = None  # `export --recipe NAME` (export/recipe_files/NAME.toml); None: none


def sha256_file(path: str, chunk: int = 1 << 24) -> str:
    """sha256 hex digest of a file, read `chunk` bytes at a time; remembered for the process while
    the file's size and modification time stay the same (validate hashes a source once to find it
    and once to record it; a large source is read once)."""
    stat = os.stat(path)
    return _sha256_file(os.path.realpath(path), (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns), chunk)


HASH_TASK_BYTES = 1 << 30  # hashing a file this large (~1 s or more) reports a progress task


@functools.lru_cache(maxsize=4096)
def _sha256_file(path: str, identity: tuple[int, int, int, int], chunk: int) -> str:
    digest = hashlib.sha256()
    size = identity[2]
    with (
        open(path, "rb") as f,
        progress.task(
            f"sha256 {os.path.basename(path)}", total=-(-size // chunk), unit="chunk", enabled=size >= HASH_TASK_BYTES
        ) as task,
    ):
        while block := f.read(chunk):
            digest.update(block)
            task.advance(nbytes=len(block))
    return digest.hexdigest()


AUTO_PRECISION_PNG = "auto_precision.png"  # the search's KL-vs-bits curve, beside AutoPrecisionRecord's file


@dataclasses.dataclass(frozen=True)
class UnitSensitivityRecord(Record):
    """One searched unit (a fused group, or one MoE layer's routed experts): its linears, weights,
    and the calibration KL vs BF16 of the network with only this unit in each format."""

    unit: str
    modules: list[str]
    weights: int  # parameters of its linears' weights
    kl_alone: dict[str, float]  # format -> mean KL (bf16: 0, not run; with the FP8 KV cache its kv_cache_kl)


@dataclasses.dataclass(frozen=True)
class AutoSearchStep(Record):
    """One combination the search measured: the units it changed since the last step, the
    additive prediction, the correction factor applied, the measured KL and its bits per weight."""

    upgraded: dict[str, str]  # unit -> its new format (empty: the uniform base; a prune: the rung below)
    # the additive model, before the correction: the sum over units of kl_alone (with the FP8 KV
    # cache: kv_cache_kl + the sum of each unit's kl_alone - kv_cache_kl)
    predicted_kl: float
    correction: float  # measured / predicted of the previous measurement (1 at first)
    measured_kl: float  # the whole mixed model, as served, on the calibration windows
    bits_per_weight: float
    step: str = "upgrade"  # "start" (uniform --quant) | "upgrade" | "prune" (one unit a rung down, kept: still met)


@dataclasses.dataclass(frozen=True)
class AutoPrecisionRecord(Record):
    """`auto_precision.json`, beside an `export --auto-precision KL`: the search that chose the
    per-linear formats (docs/design/export.md): its target, the sensitivities, every measured
    step, the uniform formats on the same windows, and the result as precision-file text."""

    FILE_NAME: ClassVar[str] = "auto_precision.json"

    kl_target: float
    margin: float  # the search stops at measured KL <= margin * kl_target
    met: bool
    base: str  # --quant
    ladder: list[str]  # the formats a unit may take, cheapest first
    bits: dict[str, float]  # format -> bits per weight (the rule)
    windows: list[int]  # [samples, seq_len] of the windows searched on (after the calibration ones in --calib-data)
    units: list[UnitSensitivityRecord]
    steps: list[AutoSearchStep]  # the last is the result
    uniform: dict[str, dict[str, float]]  # format -> {"kl": measured, "bits_per_weight": ...}
    precision_file: str  # the result as `--precision-file` text
    seconds: float
    units_per_second: float  # sensitivity measurements (unit x format) per second
    weight_rounding: str = "rtn"  # the NVFP4 weights measured and written: rtn | gptq (the GPTQ pass's records)
    # "fp8": every measured model (sensitivities, uniform points, mixes) ran the FP8 KV cache the
    # export writes (--kv-cache fp8), the BF16 reference did not; None: the BF16 KV cache (older records)
    kv_cache: str | None = None
    kv_cache_kl: float | None = None  # with kv_cache: the KL with every linear in BF16 (the KV cache's own)
