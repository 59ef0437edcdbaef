"""`export_checkpoint`: a serving checkpoint from an HF folder, MaxText checkpoint or training run.

    summary = export_checkpoint("runs/a", "out/a-nvfp4", ExportOptions(format="compressed-tensors"))

Streaming and atomic:
1. A first pass reads each quantized weight once (row chunk by row chunk) for its amax and
   finiteness (NaN or inf anywhere: one error naming the tensor, nothing written); fused groups
   (q/k/v, gate/up) take the max over their members (`plan.py`).
2. Input amax: the run's tracked amax, else calibration (`calibrate.py`: the windows read from
   --calib-data once; fewer or shorter than asked is said and recorded, the record holds the
   windows and tokens that ran; --calib-data that nothing would use is bad usage, --kv-cache fp8
   without it too, up front; MoE experts calibrate
   on all their layer's tokens); a fused group shares the max over its members (one input scale
   per GEMM). `--kv-cache fp8` calibrates every attention layer's K (after RoPE) / V amax in the
   same pass and writes the layout's KV-cache scales (F32 decode scales amax / 448,
   `LayoutSpec.kv_scales`) and the config keys announcing them.
3. The output layout (names, dtypes, shapes) comes from the layout's spec (`nvfp4tool.formats`)
   up front and is split into shards of at most `max_shard_size` (a module's tensors stay
   together); each shard is written tensor by tensor: a quantized module is read, quantized
   (`scale_search.py`) and its roles (packed weight, block scales, decode scales) named by the
   spec (with `--weight-rounding gptq`, the GPTQ pass, `gptq_pass.py`, ran after step 2 and
   spilled every record to `.gptq-spill/` inside the output's temporary folder of step 4, so a
   killed run's spill is cleaned with it by the next run: the module's record is read back from
   it, and the spill removed before publishing); other tensors are copied in BF16. Only one module's tensors are held at a time: peak
   memory is the largest source tensor plus its quantized form plus one row chunk of temporaries,
   whatever the model size (FP8 quantizes a weight in one piece: about 3x that weight).
4. Everything goes into a temporary sibling folder renamed into place at the end (`--force`
   replaces an existing output; an output overlapping the source or the calibration data is
   refused); any error leaves nothing behind. The provenance record (`ExportRecord`) lists every
   written tensor with its sha256 and, for quantized weights, its decoded amax.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
import os
import shutil
import time
from typing import Any

import jax.numpy as jnp
import numpy as np

from converters.atomic import atomic_output_dir, check_output_path
from converters.hf import (AUX_FILE_PATTERNS, INDEX_FILE, SAFETENSORS_CODES, SINGLE_FILE, parse_size,
                           plan_shards, write_safetensors)
from nvfp4tool import formats, progress
from nvfp4tool.checkpoints import Checkpoint, open_checkpoint
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError
from nvfp4tool.export import provenance
from nvfp4tool.export.gptq import BLOCK_COLUMNS, DAMP_RANGE, DEFAULT_DAMP
from nvfp4tool.export.gptq_pass import GPTQResult, run_gptq
from nvfp4tool.export.plan import ExportPlan, make_plan, read_keep_bf16_file
from nvfp4tool.export.scale_search import METHODS, quantize_weight
from nvfp4tool.formats import LayoutSpec
from nvfp4tool.numerics import (FP8Array, NVFP4Array, dequantize_fp8, fp8_decode_scale, nvfp4_global_scales,
                                tensor_amax, quantize_fp8)
from nvfp4tool.numerics.constants import E4M3_MAX
from nvfp4tool.records.export import GPTQRecord, TensorRecord

GPTQ_SPILL_DIR = ".gptq-spill"  # GPTQ's spilled records: inside the output's temporary folder, removed before publishing
_AMAX_CHUNK_ELEMENTS = 1 << 24  # rows per chunk of the amax pass ~ 16M elements


@dataclasses.dataclass(frozen=True)
class ExportOptions:
    """How to export (the `nvfp4tool export` options)."""

    format: str = "modelopt"  # modelopt | compressed-tensors
    quant: str = "nvfp4"  # nvfp4 (W4A4) | nvfp4-weight-only (W4A16) | fp8 (W8A8 per tensor)
    scale_search: str = "rtn"  # rtn | 4over6 | mse
    weight_rounding: str = "rtn"  # rtn | gptq (NVFP4 only; needs calib_data)
    gptq_damp: float = DEFAULT_DAMP  # GPTQ: H += damp * mean(diag H) * I
    weight_block: str | None = None  # 1d | 2d; None: the run's setting (2d for nvfp4 runs), else 1d
    keep_bf16: tuple[str, ...] = ()  # fnmatch patterns of linear modules kept in BF16
    keep_bf16_file: str | None = None  # a keep-BF16 file (plan.read_keep_bf16_file): more such patterns
    calib_data: str | None = None  # .txt / .jsonl / .npy (used when the source has no tracked amax)
    calib_samples: int = 64
    calib_seq_len: int = 512
    offload: str = "auto"  # calibration: auto | never | always stream the model layer by layer
    kv_cache: str = "none"  # none | fp8: calibrate K / V and write FP8 KV-cache scales (needs calib_data)
    max_shard_size: int | str = "5GB"
    step: int | None = None  # a training run's checkpoint step (default: its final hf/ weights)
    model_config: str | None = None  # MaxText sources: model name or HF config
    rope_layout: str | None = None  # MaxText sources with an HF config: "half" | "interleaved"
    force: bool = False
    show_progress: bool = True  # False: report no progress task (library callers inside another task)
    # library callers: the input amax of every quantized module, used instead of calibration when no
    # calib_data is given (validate's FP8 reference takes a W4A4 export's calibrated amax)
    input_amax: dict[str, float] | None = None


@dataclasses.dataclass(frozen=True)
class ExportSummary:
    """What an export wrote."""

    out: str
    tensors: int
    quantized_modules: int
    bf16_bytes_in: int  # the source's size in BF16 (2 bytes per parameter)
    bytes_written: int
    seconds: float  # the whole export
    gptq_reduction: float | None = None  # GPTQ: mean output-error reduction vs RTN over the linears
    calibration_seconds: float = 0.0  # reading --calib-data and running the model on it (0: none)
    gptq_seconds: float = 0.0  # the GPTQ pass (0: none)

    @property
    def write_seconds(self) -> float:
        """Reading, quantizing and writing the weights: the whole export but calibration and GPTQ."""
        return max(self.seconds - self.calibration_seconds - self.gptq_seconds, 0.0)

    @property
    def gb_per_s(self) -> float:
        """Throughput of read/quantize/write in GB of BF16 weights in per second (calibration and
        GPTQ, which run the model on data, are timed apart)."""
        return self.bf16_bytes_in / 1e9 / max(self.write_seconds, 1e-9)

    def line(self) -> str:
        passes = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in
                           (("calibration", self.calibration_seconds), ("GPTQ", self.gptq_seconds)) if seconds)
        timing = (f"read/quantize/write {self.bf16_bytes_in / 1e9:.3f} GB of bf16 in {self.write_seconds:.1f} s "
                  f"({self.gb_per_s:.3f} GB/s)")
        return (f"exported {self.quantized_modules} quantized modules, {self.tensors} tensors, "
                f"{self.bytes_written / 1e9:.3f} GB to {self.out} in {self.seconds:.1f} s: "
                f"{passes + '; ' if passes else ''}{timing}"
                + ("" if self.gptq_reduction is None else
                   f"; GPTQ output error {100 * self.gptq_reduction:.1f}% below RTN's (mean over linears)"))


def export_checkpoint(src: str, out: str, options: ExportOptions = ExportOptions()) -> ExportSummary:
    """Export `src` to the serving folder `out` (see the module docstring)."""
    start = time.perf_counter()
    _check_options(options)
    inputs = (src,) + tuple(f for f in (options.calib_data, options.keep_bf16_file) if f)
    from_file = {p: where for p, where in (read_keep_bf16_file(options.keep_bf16_file).items()
                                           if options.keep_bf16_file else ()) if p not in options.keep_bf16}
    check_output_path(out, inputs, flag="--out", force=options.force)  # before any work (atomic_output_dir checks again)
    source = open_checkpoint(src, step=options.step, model_config=options.model_config,
                             rope_layout=options.rope_layout)
    spec = formats.get(options.format, options.quant)
    plan = make_plan(source.config, options.quant, precision_map=source.precision_map,
                     keep_bf16=options.keep_bf16 + tuple(from_file),
                     keep_bf16_origin=from_file)
    block = options.weight_block or (source.weight_block if options.quant != "fp8" else "1d")
    group_amax = _group_amax(source.tensors, plan)  # a broken source is named before anything else
    _check_calibration_used(plan, options)
    calibration_start = time.perf_counter()
    ids = _calibration_ids(source, options)
    # with gptq too, the input amax comes from calibration, not from GPTQ's pass: calibrate() runs the
    # ORIGINAL weights throughout, while GPTQ's first pass through layer i sees inputs made by the
    # already-quantized layers 0..i-1, so its amax differs from layer 1 on (measured: a tiny model's
    # layers.1.o_proj, 0.00684 vs 0.00681); the router counts and K / V amax are calibrate()'s too
    input_amax, origin, calibration, kv_amax = _calibrate(source, plan, options, ids)
    if options.weight_rounding == "gptq" and calibration is None:  # weight-only: the data GPTQ used
        calibration = _calibration_record(options, ids)
    calibration_seconds = time.perf_counter() - calibration_start if options.calib_data else 0.0
    gptq_seconds = 0.0
    with atomic_output_dir(out, force=options.force, inputs=inputs, flag="--out") as tmp:
        gptq = gptq_record = None
        if options.weight_rounding == "gptq":  # its spill folder lies inside the output's temporary one
            spill_dir = os.path.join(tmp, GPTQ_SPILL_DIR)
            os.mkdir(spill_dir)
            gptq_start = time.perf_counter()
            gptq = _gptq(source, plan, group_amax, options, block, spill_dir, ids)
            gptq_record = _gptq_record(gptq, options)
            gptq_seconds = time.perf_counter() - gptq_start
        summary = _write(source, tmp, plan, spec, block, group_amax, input_amax, origin, calibration, kv_amax,
                         options, gptq, gptq_record)
        if gptq is not None:
            shutil.rmtree(spill_dir)  # not published
    written = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    return dataclasses.replace(summary, out=os.path.abspath(out), bytes_written=written,
                               seconds=time.perf_counter() - start, calibration_seconds=calibration_seconds,
                               gptq_seconds=gptq_seconds)


# ------------------------------------------------------------------------------------------
# helpers


def _write(source: Checkpoint, tmp: str, plan: ExportPlan, spec: LayoutSpec, block: str, group_amax,
           input_amax, origin: str, calibration, kv_amax, options: ExportOptions,
           gptq: GPTQResult | None, gptq_record: GPTQRecord | None) -> ExportSummary:
    """Write the export into the temporary output folder `tmp` (step 3 of the module docstring);
    `out`, `bytes_written` and `seconds` are left for the caller."""
    tensors = source.tensors
    names = tensors.names()
    units = [_unit_layout(name, tensors, plan, spec) for name in names]
    kv_scales = _kv_scales(kv_amax, spec)
    units += [(a, spec.kv_scales.layout(a)) for a in kv_amax]
    # each unit (one source tensor's outputs) stays in one shard
    shards = plan_shards(units, lambda unit: sum(_nbytes(d, s) for _, d, s in unit[1]),
                         parse_size(options.max_shard_size))
    loader = _ModuleLoader(tensors, plan, spec, group_amax, input_amax, block, options, kv_scales, gptq)
    files: list[str] = []
    with _task(options.show_progress, len(names)) as task:
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards):
            file_name = (SINGLE_FILE if len(shards) == 1
                         else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors")
            layout = [entry for unit in shard for entry in unit[1]]
            loader.file_name = file_name
            write_safetensors(os.path.join(tmp, file_name), layout, lambda n: loader.load(n, task),
                              source_label=source.path)
            weight_map.update({entry[0]: file_name for entry in layout})
            files.append(file_name)
        if len(shards) > 1:
            total = sum(_nbytes(d, s) for unit in units for _, d, s in unit[1])
            _write_json(os.path.join(tmp, INDEX_FILE),
                        {"metadata": {"total_size": total}, "weight_map": weight_map})
        _write_configs(tmp, source, plan, spec, _kv(options))
        provenance.build_record(
            source=source, options=options, plan=plan, weight_block=block, input_amax_origin=origin,
            calibration=calibration, layer_errors=loader.layer_errors, input_amax=input_amax,
            files_written=files, tensors=loader.records, kv_amax=kv_amax or None,
            gptq=gptq_record).write(tmp)
    bf16_in = sum(2 * int(np.prod(tensors.shape(n), dtype=np.int64)) for n in names)
    return ExportSummary(out=tmp, tensors=sum(len(u[1]) for u in units),
                         quantized_modules=len(plan.quantized), bf16_bytes_in=bf16_in,
                         bytes_written=0, seconds=0.0,
                         gptq_reduction=None if gptq_record is None else gptq_record.mean_output_err_reduction)


def _gptq(source: Checkpoint, plan: ExportPlan, group_amax, options: ExportOptions, block: str,
          spill_dir: str, ids_SxL: np.ndarray) -> GPTQResult:
    """Run the GPTQ pass (`gptq_pass.py`) on the calibration windows `ids_SxL`."""
    return run_gptq(source.config, source.tensors, plan, group_amax, options.calib_data, spill_dir=spill_dir,
                    samples=options.calib_samples, seq_len=options.calib_seq_len, tokenizer_dir=source.aux_dir,
                    offload=options.offload, method=options.scale_search, block=block, damp=options.gptq_damp,
                    ids_SxL=ids_SxL)


def _gptq_record(gptq: GPTQResult, options: ExportOptions) -> GPTQRecord:
    """The GPTQ provenance record (settings, mean output-error reduction), said as it is made."""
    record = provenance.gptq_record(damp=options.gptq_damp, block_size=BLOCK_COLUMNS, errors=gptq.errors)
    progress.info(f"GPTQ: {len(gptq.errors)} linears, output error on the calibration inputs "
                  f"{100 * record.mean_output_err_reduction:.1f}% below RTN's with the same scales (mean)")
    return record


class _ModuleLoader:
    """`load(name)` for write_safetensors: one quantized module's tensors cached at a time; keeps
    each written tensor's record (file, dtype, shape, sha256, decoded amax) and layer errors;
    `kv_scales` are the KV-cache scale tensors, by name."""

    def __init__(self, tensors, plan: ExportPlan, spec: LayoutSpec, group_amax, input_amax, block,
                 options: ExportOptions, kv_scales: dict[str, np.ndarray], gptq: GPTQResult | None) -> None:
        self.tensors, self.plan, self.spec, self.block, self.options = tensors, plan, spec, block, options
        self.gptq = gptq
        self.group_amax, self.input_amax = group_amax, input_amax
        self.layer_errors: dict[str, dict[str, float]] = {}
        self.records: dict[str, TensorRecord] = {}
        self.file_name = ""
        self.module_of = {}
        for module in plan.quantized:
            n, k = tensors.shape(f"{module}.weight")
            for name, _, _ in spec.layout(module, n, k):
                self.module_of[name] = module
        self.cache: dict[str, np.ndarray] = {}
        self.amax: dict[str, float] = {}  # stored weight tensor -> decoded amax
        self.kv_scales = kv_scales

    def load(self, name: str, task: progress.Task) -> np.ndarray:
        array = self.kv_scales.get(name)
        if array is None:
            if name not in self.cache:
                module = self.module_of.get(name)
                if module is None:
                    self.cache = {name: _bf16_copy(self.tensors, name)}
                else:
                    self.cache = self._quantize(module)
                task.advance(description=name if module is None else f"{module}.weight",
                             nbytes=sum(a.nbytes for a in self.cache.values()))
            array = self.cache.pop(name)
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        self.records[name] = TensorRecord(file=self.file_name, dtype=SAFETENSORS_CODES[array.dtype.name],
                                          shape=tuple(int(d) for d in array.shape),
                                          sha256=hashlib.sha256(data).hexdigest(),
                                          amax=self.amax.get(name))
        return array

    def _quantize(self, module: str) -> dict[str, np.ndarray]:
        plan, weight_name = self.plan, f"{module}.weight"
        w = self.tensors.get(weight_name)
        group = plan.group_of(module)
        if plan.quant == "fp8":
            q = quantize_fp8(w, fmt="e4m3", granularity="tensor", name=weight_name)
            w32 = np.asarray(w, np.float32)
            decoded = np.asarray(dequantize_fp8(q))
            norm = float(np.linalg.norm(w32))
            err = float(np.linalg.norm(decoded - w32)) / norm if norm else 0.0
            self.layer_errors[module] = {"rel_l2": err}
            amax = float(np.max(np.abs(decoded))) if decoded.size else 0.0
            del decoded, w32
        elif self.gptq is not None:  # quantized by the GPTQ pass, read back from its spill folder
            q, error = self.gptq.records.get(module), self.gptq.errors[module]
            self.layer_errors[module] = {"rel_l2": error.rel_l2, "output_rel_err": error.output_rel_err,
                                         "rtn_output_rel_err": error.rtn_output_rel_err}
            amax = error.decoded_amax
        else:
            q, error = quantize_weight(w, method=self.options.scale_search, block=self.block,
                                       global_amax=self.group_amax[group], name=weight_name)
            self.layer_errors[module] = {"rel_l2": error.rel_l2}
            if self.options.scale_search != "rtn":
                self.layer_errors[module].update(rtn_rel_l2=error.rtn_rel_l2,
                                                 reduction_vs_rtn=error.reduction_vs_rtn)
            amax = error.decoded_amax
        del w
        input_amax = None
        if plan.has_input_scales:
            input_amax = max(self.input_amax[m] for m in plan.groups[group])
        named = self.spec.from_roles(module, _roles(q, input_amax, plan.quant))
        self.amax = {f"{module}.{self.spec.suffix('weight')}": amax}
        return named


def _roles(q: NVFP4Array | FP8Array, input_amax: float | None, quant: str) -> dict[str, np.ndarray]:
    """One quantized linear's values by role (global scales as decode scales S_dec, fp32 [])."""
    if quant == "fp8":
        roles = {"weight": np.asarray(q.data), "weight_global": np.asarray(q.scale, np.float32).reshape(())}
    else:
        roles = {"weight": np.asarray(q.packed), "block_scale": np.asarray(q.scales),
                 "weight_global": _nvfp4_decode_scale(q.global_amax)}
    if input_amax is not None:
        roles["input_global"] = _input_decode_scale(input_amax, quant)
    return roles


def _nvfp4_decode_scale(amax: float | np.ndarray) -> np.ndarray:
    """S_dec = fl(1 / fl(2688 / amax)) as an fp32 scalar: the value the numerics decode with (not
    fl(amax / 2688), which differs in the last bit for ~1 in 6 amax values), so the stored bytes
    decode exactly to `dequantize_nvfp4` of the record."""
    return np.asarray(nvfp4_global_scales(np.float32(amax))[1], np.float32).reshape(())


def _input_decode_scale(input_amax: float, quant: str) -> np.ndarray:
    """Static activation decode scale: NVFP4 S_dec of the input amax, or amax / 448 for FP8."""
    if quant == "fp8":
        scale = np.float32(input_amax) / np.float32(E4M3_MAX)
        return np.asarray(scale if scale > 0 else np.float32(1.0), np.float32).reshape(())
    return _nvfp4_decode_scale(input_amax)


def _kv(options: ExportOptions) -> str | None:
    """The quantized KV cache to announce (`formats.KV_CACHES`), None for --kv-cache none."""
    return None if options.kv_cache == "none" else options.kv_cache


def _kv_scales(kv_amax: dict[str, tuple[float, float]], spec: LayoutSpec) -> dict[str, np.ndarray]:
    """{tensor name: F32 scale} of every attention's K and V: the FP8 decode scale amax / 448
    (`numerics.fp8_decode_scale`: ModelOpt's k/v_bmm_quantizer amax / 448), in the layout's shape."""
    scales = {}
    for attention, amax_kv in kv_amax.items():
        for name, amax in zip(spec.kv_scales.names(attention), amax_kv):
            scales[name] = np.asarray(fp8_decode_scale(amax), np.float32).reshape(spec.kv_scales.shape)
    return scales


def _check_options(options: ExportOptions) -> None:
    if options.kv_cache not in ("none", *formats.KV_CACHES):
        raise NVFP4UsageError(f"unknown --kv-cache {options.kv_cache!r}; choose one of "
                              f"{', '.join(('none', *formats.KV_CACHES))}")
    if options.format not in formats.FORMATS:
        raise NVFP4ToolError(f"unknown --format {options.format!r}; choose one of "
                             f"{', '.join(formats.FORMATS)}")
    if options.scale_search not in METHODS:
        raise NVFP4ToolError(f"unknown --scale-search {options.scale_search!r}; choose one of "
                             f"{', '.join(METHODS)}")
    if options.quant == "fp8" and options.scale_search != "rtn":
        raise NVFP4ToolError("--scale-search applies to NVFP4 only (fp8 is per-tensor amax scaling)")
    if options.weight_rounding not in ("rtn", "gptq"):
        raise NVFP4UsageError(f"unknown --weight-rounding {options.weight_rounding!r}; choose rtn or gptq")
    if not DAMP_RANGE[0] < options.gptq_damp <= DAMP_RANGE[1]:  # also refuses nan
        raise NVFP4UsageError(f"--gptq-damp must be > {DAMP_RANGE[0]} and <= {DAMP_RANGE[1]} "
                              f"(a fraction of the mean Hessian diagonal), got {options.gptq_damp}")
    if options.weight_rounding == "gptq" and options.quant == "fp8":
        raise NVFP4UsageError("--weight-rounding gptq rounds NVFP4 weights: use --quant nvfp4 or "
                              "nvfp4-weight-only, not fp8")
    if _kv(options) is not None and options.calib_data is None:
        raise NVFP4UsageError(f"--kv-cache {options.kv_cache} needs --calib-data PATH (it calibrates the K / V "
                              f"amax of every attention layer)")
    if options.weight_rounding == "gptq" and options.calib_data is None:
        raise NVFP4UsageError("--weight-rounding gptq needs --calib-data PATH (the Hessian of each linear's "
                              "input comes from the calibration text)")
    if options.weight_block not in (None, "1d", "2d"):
        raise NVFP4ToolError(f"--weight-block must be 1d or 2d, got {options.weight_block!r}")


def _group_amax(tensors, plan: ExportPlan) -> dict[str, np.float32]:
    """Fused group -> joint amax of its members' weights (first pass; also rejects non-finite:
    a NaN must not vanish in `max(0.0, nan) == 0.0`, so each chunk is checked on its own)."""
    result: dict[str, np.float32] = {}
    for module in plan.quantized:
        name = f"{module}.weight"
        w = tensors.get(name)
        rows = max(1, _AMAX_CHUNK_ELEMENTS // max(1, w.shape[-1]))
        amax = np.float32(0.0)
        for start in range(0, w.shape[0], rows):  # max|x| is exact in the source dtype
            chunk_amax = np.float32(tensor_amax(jnp.asarray(w[start:start + rows])))
            if not np.isfinite(chunk_amax):
                raise NVFP4ToolError(f"{name}: weight has non-finite values (NaN or inf); nothing written")
            amax = max(amax, chunk_amax)
        group = plan.group_of(module)
        result[group] = np.float32(max(result.get(group, np.float32(0.0)), amax))
        del w
    return result


def _calibrate(source: Checkpoint, plan: ExportPlan, options: ExportOptions, ids_SxL: np.ndarray | None):
    """(input amax per quantized module or None, its origin, calibration record or None, K / V amax
    per attention ({} without --kv-cache)): the run's tracked input amax unless --calib-data is
    given (its windows `ids_SxL`); the KV cache is always calibrated."""
    kv_cache = _kv(options) is not None
    needs_inputs = plan.has_input_scales and bool(plan.quantized)
    if needs_inputs and not kv_cache and options.input_amax is not None and options.calib_data is None:
        given = dataclasses.replace(source, input_amax=dict(options.input_amax))
        return _tracked_input_amax(given, plan)[0], "given (ExportOptions.input_amax)", None, {}
    if not needs_inputs or (source.input_amax is not None and options.calib_data is None):
        input_amax, origin = _tracked_input_amax(source, plan) if needs_inputs else (None, "none (weight-only)")
        if not kv_cache:
            return input_amax, origin, None, {}
        found = _calibration(source, [], options, ids_SxL, kv_cache=True)
        return input_amax, origin, _calibration_record(options, ids_SxL), found.kv_amax
    if options.calib_data is None:
        raise NVFP4ToolError(f"{source.path}: --quant {plan.quant} needs input scales: pass "
                             "--calib-data PATH (or export a training run, or use nvfp4-weight-only)")
    found = _calibration(source, plan.quantized, options, ids_SxL, kv_cache=kv_cache)
    return (found.input_amax, "calibration", _calibration_record(options, ids_SxL, found.routed_tokens),
            found.kv_amax)


def _calibration(source: Checkpoint, names, options: ExportOptions, ids_SxL: np.ndarray, *, kv_cache: bool):
    from nvfp4tool.export.calibrate import calibrate

    return calibrate(source.config, source.tensors, names, options.calib_data, samples=options.calib_samples,
                     seq_len=options.calib_seq_len, tokenizer_dir=source.aux_dir, kv_cache=kv_cache,
                     offload=options.offload, ids_SxL=ids_SxL)


def _calibration_ids(source: Checkpoint, options: ExportOptions) -> np.ndarray | None:
    """The calibration windows [S, L] read from --calib-data (None without it). The file may give
    fewer windows or shorter ones than --calib-samples / --calib-seq-len ask (the samples are at
    most that many; a library caller's default of 64 windows is common); that is said in one line
    and recorded (`CalibrationRecord`: what ran and what was asked). Less than one token: refused."""
    if options.calib_data is None:
        return None
    from nvfp4tool.export.calibrate import load_calibration_ids

    ids = load_calibration_ids(options.calib_data, samples=options.calib_samples, seq_len=options.calib_seq_len,
                               tokenizer_dir=source.aux_dir, vocab_size=source.config.vocab_size)
    samples, seq_len = ids.shape
    if (samples, seq_len) != (options.calib_samples, options.calib_seq_len):
        progress.info(f"warning: {options.calib_data} gives {samples} calibration window(s) of {seq_len} tokens, "
                      f"fewer than asked (--calib-samples {options.calib_samples} x --calib-seq-len "
                      f"{options.calib_seq_len}): calibrating on its {samples * seq_len} tokens (recorded)")
    return ids


def _calibration_record(options: ExportOptions, ids_SxL: np.ndarray, routed_tokens: dict[str, int] | None = None):
    """The record of the calibration data and the windows that ran; `routed_tokens` when it
    calibrated MoE experts' inputs."""
    return provenance.calibration_record(options.calib_data, ids_SxL,
                                         requested=(options.calib_samples, options.calib_seq_len),
                                         routed_tokens=routed_tokens)


def _check_calibration_used(plan: ExportPlan, options: ExportOptions) -> None:
    """--calib-data given where nothing uses it (no input scales to calibrate, no GPTQ, no KV
    cache) is bad usage (NVFP4UsageError naming --calib-data), not silently ignored. Checked
    after the weight pass (the source's own errors come first), before any calibration or output."""
    if options.calib_data is None or options.weight_rounding == "gptq" or _kv(options) is not None:
        return
    if plan.has_input_scales and plan.quantized:
        return
    why = (f"--quant {plan.quant} has no input scales" if not plan.has_input_scales
           else "every linear module stays in BF16")
    raise NVFP4UsageError(f"--calib-data {options.calib_data} would not be used: {why}, and neither "
                          f"--weight-rounding gptq nor --kv-cache fp8 is asked; drop --calib-data (or add one of those)")


def _tracked_input_amax(source: Checkpoint, plan: ExportPlan) -> tuple[dict[str, float], str]:
    """(the training run's tracked input amax of every quantized module, checked, "training run")."""
    missing = [m for m in plan.quantized if m not in source.input_amax]
    if missing:
        raise NVFP4ToolError(f"{source.path}: no tracked input amax for {missing[0]} (it trained "
                             f"in BF16?); keep it in BF16 or pass --calib-data")
    bad = [m for m in plan.quantized if not (source.input_amax[m] > 0 and np.isfinite(source.input_amax[m]))]
    if bad:
        raise NVFP4ToolError(f"{source.path}: tracked input amax of {bad[0]} is "
                             f"{source.input_amax[bad[0]]}; pass --calib-data to recalibrate")
    return {m: float(source.input_amax[m]) for m in plan.quantized}, "training run"


def _unit_layout(name: str, tensors, plan: ExportPlan, spec: LayoutSpec) -> tuple[str, list]:
    """(source name, [(output name, dtype, shape), ...]) for one source tensor."""
    module = name.removesuffix(".weight")
    if name.endswith(".weight") and module in plan.groups.get(plan.group_of(module), ()):
        n, k = tensors.shape(name)
        return name, spec.layout(module, n, k)
    dtype = tensors.dtype(name)
    out_dtype = "bfloat16" if dtype in ("float32", "float16", "float64", "bfloat16") else dtype
    return name, [(name, out_dtype, tuple(tensors.shape(name)))]


def _bf16_copy(tensors, name: str) -> np.ndarray:
    array = tensors.get(name)
    if array.dtype.name in ("float32", "float16", "float64", "bfloat16"):
        if not np.isfinite(array).all():
            raise NVFP4ToolError(f"{name}: tensor has non-finite values (NaN or inf); nothing written")
        array = array.astype("bfloat16", copy=False)
    return array


def _write_configs(folder: str, source: Checkpoint, plan: ExportPlan, spec: LayoutSpec,
                   kv_cache: str | None) -> None:
    hf = source.config.to_hf_config()
    hf["dtype"] = "bfloat16"
    hf["quantization_config"] = spec.quantization_config(plan.excluded, kv_cache)
    _write_json(os.path.join(folder, formats.CONFIG_FILE), hf)
    hf_quant = spec.hf_quant_config(plan.excluded, {"name": "nvfp4tool", "version": _version()}, kv_cache)
    if hf_quant is not None:
        _write_json(os.path.join(folder, formats.HF_QUANT_CONFIG_FILE), hf_quant)
    if source.aux_dir is not None:
        for file_name in sorted(os.listdir(source.aux_dir)):
            if any(fnmatch.fnmatch(file_name, p) for p in AUX_FILE_PATTERNS):
                shutil.copy2(os.path.join(source.aux_dir, file_name), os.path.join(folder, file_name))


def _task(enabled: bool, total: int):
    """The export's progress task (one step per source tensor), or a silent one."""
    return progress.task("export", total=total, unit="tensor", enabled=enabled)


def _version() -> str:
    import nvfp4tool

    return nvfp4tool.__version__


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
