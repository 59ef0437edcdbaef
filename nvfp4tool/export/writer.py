"""`export_checkpoint`: a serving checkpoint from an HF folder, MaxText checkpoint or training run.

    summary = export_checkpoint("runs/a", "out/a-nvfp4", ExportOptions(format="compressed-tensors"))

Streaming (one module's tensors held at a time) and atomic (a temporary sibling renamed into place);
the inputs are resolved first (`job.py`), the folder written by `serving_folder.py`.
Design notes: docs/design/export.md.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import shutil
import time
from collections.abc import Callable

import numpy as np

from converters.atomic import atomic_output_dir
from converters.hf import AUX_FILE_PATTERNS, SINGLE_FILE, parse_size, plan_shards
from nvfp4tool import progress
from nvfp4tool.export.auto_precision import write_search
from nvfp4tool.export.job import ExportJob, ExportOptions, prepare_job, with_gptq, with_search
from nvfp4tool.export.plan import ExportPlan
from nvfp4tool.export.provenance import build_record
from nvfp4tool.export.quantizers import WeightQuantizer, input_decode_scale, kv_decode_scales, quantizer_for
from nvfp4tool.export.serving_folder import ServingFolder, plain_copy, plain_dtype
from nvfp4tool.formats import LayoutSpec
from nvfp4tool.records.export import ExportRecord

__all__ = ["ExportOptions", "ExportSummary", "export_checkpoint"]

GPTQ_SPILL_DIR = (
    ".gptq-spill"  # GPTQ's spilled records: inside the output's temporary folder, removed before publishing
)


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
    equalization_seconds: float = 0.0  # --equalize: the search and the fold check (0: none)
    auto_precision_seconds: float = 0.0  # --auto-precision: the search (0: none)
    record: ExportRecord | None = None  # the provenance it wrote (nvfp4tool_export.json)

    @property
    def write_seconds(self) -> float:
        """Reading, quantizing and writing the weights: the whole export but the passes that run the
        model on data (equalization, calibration, GPTQ, the auto-precision search)."""
        passes = self.equalization_seconds + self.calibration_seconds + self.gptq_seconds + self.auto_precision_seconds
        return max(self.seconds - passes, 0.0)

    @property
    def gb_per_s(self) -> float:
        """Throughput of read/quantize/write in GB of BF16 weights in per second (equalization,
        calibration and GPTQ, which run the model on data, are timed apart)."""
        return self.bf16_bytes_in / 1e9 / max(self.write_seconds, 1e-9)

    def line(self) -> str:
        passes = ", ".join(
            f"{name} {seconds:.1f} s"
            for name, seconds in (
                ("equalization", self.equalization_seconds),
                ("calibration", self.calibration_seconds),
                ("GPTQ", self.gptq_seconds),
                ("auto-precision", self.auto_precision_seconds),
            )
            if seconds
        )
        timing = (
            f"read/quantize/write {self.bf16_bytes_in / 1e9:.3f} GB of bf16 in {self.write_seconds:.1f} s "
            f"({self.gb_per_s:.3f} GB/s)"
        )
        return (
            f"exported {self.quantized_modules} quantized modules, {self.tensors} tensors, "
            f"{self.bytes_written / 1e9:.3f} GB to {self.out} in {self.seconds:.1f} s: "
            f"{passes + '; ' if passes else ''}{timing}"
            + (
                ""
                if self.gptq_reduction is None
                else f"; GPTQ output error {100 * self.gptq_reduction:.1f}% below RTN's (mean over linears)"
            )
        )


def export_checkpoint(src: str, out: str, options: ExportOptions = ExportOptions()) -> ExportSummary:
    """Export `src` to the serving folder `out` (see the module docstring)."""
    start = time.perf_counter()
    job = prepare_job(src, out, options)
    with atomic_output_dir(out, force=options.force, inputs=job.inputs, flag="--out") as tmp:
        if job.awaits_gptq:  # its spill folder lies inside the output's temporary one
            spill_dir = os.path.join(tmp, GPTQ_SPILL_DIR)
            os.mkdir(spill_dir)
            job = with_gptq(job, spill_dir)
        if job.awaits_search:  # after GPTQ: its records are the base format's weights it measures
            job = with_search(job)
        summary = _write(job, tmp)
        if job.gptq is not None:
            shutil.rmtree(spill_dir)  # not published
    written = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    return dataclasses.replace(
        summary,
        out=os.path.abspath(out),
        bytes_written=written,
        seconds=time.perf_counter() - start,
        calibration_seconds=job.calibration_seconds,
        gptq_seconds=job.gptq_seconds,
        equalization_seconds=job.equalization_seconds,
        auto_precision_seconds=job.auto_precision_seconds,
    )


# ------------------------------------------------------------------------------------------
# helpers


def _write(job: ExportJob, tmp: str) -> ExportSummary:
    """Write the export of `job` into the temporary output folder `tmp` (step 3 of the module
    docstring); `out`, `bytes_written` and `seconds` are left for the caller."""
    source, plan, spec, options = job.source, job.plan, job.spec, job.options
    tensors = source.tensors
    names = tensors.names()
    family = source.config.family_spec
    units = [_unit_layout(name, tensors, plan, job.spec_for, family) for name in names]
    units += [(a, spec.kv_scales.layout(a)) for a in job.kv_amax]
    # each unit (one source tensor's outputs) stays in one shard
    shards = plan_shards(
        units, lambda unit: sum(_nbytes(d, s) for _, d, s in unit[1]), parse_size(options.max_shard_size)
    )
    files = [
        SINGLE_FILE if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        for i in range(len(shards))
    ]
    folder = ServingFolder(tmp, source_label=source.path, rename=family.checkpoint_name)
    with _task(options.show_progress, len(names)) as task:
        loader = _ModuleLoader(
            job, quantizer_for(plan, options.scale_search, job.block, job.group_amax, job.gptq), task
        )
        records = folder.write_shards(
            [(file, [entry for unit in shard for entry in unit[1]]) for file, shard in zip(files, shards)],
            loader.load,
            amax=lambda name: loader.amax.get(name),
        )
        total = sum(_nbytes(d, s) for unit in units for _, d, s in unit[1])
        folder.write_index({"metadata": {"total_size": total}} if len(shards) > 1 else None, records)
        hf = source.config.to_hf_config()
        hf["dtype"] = "bfloat16"
        folder.write_configs(hf, spec, plan.excluded, job.kv_cache, quants=plan.quants if plan.is_mixed else None)
        if source.aux_dir is not None:
            folder.copy_files(
                os.path.join(source.aux_dir, f)
                for f in sorted(os.listdir(source.aux_dir))
                if any(fnmatch.fnmatch(f, p) for p in AUX_FILE_PATTERNS)
            )
        record = build_record(
            source=source,
            options=options,
            plan=plan,
            weight_block=job.block,
            input_amax_origin=job.input_amax_origin,
            calibration=job.calibration,
            layer_errors=loader.layer_errors,
            input_amax=job.input_amax,
            files_written=files,
            tensors=records,
            kv_amax=job.kv_amax or None,
            gptq=job.gptq_record,
            equalization=None if job.equalization is None else job.equalization.record,
        )
        folder.write_record(record)
        if job.auto_precision is not None:
            write_search(job.auto_precision, tmp)
    bf16_in = sum(2 * int(np.prod(tensors.shape(n), dtype=np.int64)) for n in names)
    return ExportSummary(
        out=tmp,
        tensors=sum(len(u[1]) for u in units),
        quantized_modules=len(plan.quantized),
        bf16_bytes_in=bf16_in,
        bytes_written=0,
        seconds=0.0,
        gptq_reduction=None if job.gptq_record is None else job.gptq_record.mean_output_err_reduction,
        record=record,
    )


class _ModuleLoader:
    """`load(name)` for the serving-folder writer: one quantized module's tensors cached at a
    time (quantized by `quantizer`), other tensors copied as `plain_dtype` says, the KV-cache
    scales made from the job's K / V amax; keeps each quantized module's layer errors and its stored weight's
    decoded amax (`amax`)."""

    def __init__(self, job: ExportJob, quantizer: WeightQuantizer, task: progress.Task) -> None:
        self.job, self.quantizer, self.task = job, quantizer, task
        self.layer_errors: dict[str, dict[str, float]] = {}
        self.module_of = {}
        for module in job.plan.quantized:
            n, k = job.source.tensors.shape(f"{module}.weight")
            for name, _, _ in job.spec_for(module).layout(module, n, k):
                self.module_of[name] = module
        self.cache: dict[str, np.ndarray] = {}
        self.amax: dict[str, float] = {}  # stored weight tensor -> decoded amax
        self.kv_scales = _kv_scales(job.kv_amax, job.spec)

    def load(self, name: str) -> np.ndarray:
        array = self.kv_scales.get(name)
        if array is not None:
            return array
        if name not in self.cache:
            module = self.module_of.get(name)
            if module is None:
                self.cache = {name: plain_copy(self.job.source.tensors, name, self.job.source.config.family_spec)}
            else:
                self.cache = self._quantize(module)
            self.task.advance(
                description=name if module is None else f"{module}.weight",
                nbytes=sum(a.nbytes for a in self.cache.values()),
            )
        return self.cache.pop(name)

    def _quantize(self, module: str) -> dict[str, np.ndarray]:
        plan, spec = self.job.plan, self.job.spec_for(module)
        w = self.job.source.tensors.get(f"{module}.weight")
        done = self.quantizer.quantize(module, w)
        del w
        self.layer_errors[module] = done.errors
        roles = dict(done.roles)
        if spec.has_input_scales:
            input_amax = max(self.job.input_amax[m] for m in plan.groups[plan.group_of(module)])
            roles["input_global"] = input_decode_scale(input_amax, spec.quant)
        self.amax = {f"{module}.{spec.suffix('weight')}": done.amax}
        return spec.from_roles(module, roles)


def _kv_scales(kv_amax: dict[str, tuple[float, float]], spec: LayoutSpec) -> dict[str, np.ndarray]:
    """{tensor name: F32 scale} of every attention's K and V (`quantizers.kv_decode_scales`: amax /
    448, what the search's FP8 KV cache ran with), in the layout's shape."""
    scales = {}
    for attention, amax_kv in kv_amax.items():
        for name, scale in zip(spec.kv_scales.names(attention), kv_decode_scales(amax_kv)):
            scales[name] = scale.reshape(spec.kv_scales.shape)
    return scales


def _unit_layout(
    name: str, tensors, plan: ExportPlan, spec_for: Callable[[str], LayoutSpec], family
) -> tuple[str, list]:
    """(source name, [(output name, dtype, shape), ...]) for one source tensor."""
    module = name.removesuffix(".weight")
    if name.endswith(".weight") and module in plan.groups.get(plan.group_of(module), ()):
        n, k = tensors.shape(name)
        return name, spec_for(module).layout(module, n, k)
    return name, [(name, plain_dtype(name, tensors.dtype(name), family), tuple(tensors.shape(name)))]


def _task(enabled: bool, total: int):
    """The export's progress task (one step per source tensor), or a silent one."""
    return progress.task("export", total=total, unit="tensor", enabled=enabled)


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
