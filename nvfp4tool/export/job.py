"""`ExportJob`: the resolved inputs of one export, made and checked before anything is created.

    job = prepare_job("runs/a", "out/a-nvfp4", ExportOptions(calib_data="calib.txt"))
    job.plan, job.spec, job.block, job.group_amax, job.input_amax, job.kv_amax, job.calibration

`prepare_job` opens the source, refuses a bad output, makes the plan, runs the weight pass and
resolves the input amax; `with_gptq` adds GPTQ's records. The writer takes the finished job.
Design notes: docs/design/export.md.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from converters.atomic import check_output_path
from nvfp4tool import formats, progress
from nvfp4tool.checkpoints import Checkpoint, open_checkpoint
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError
from nvfp4tool.export.auto_precision import LADDERS, AutoPrecision, search_precision
from nvfp4tool.export.equalize import METHODS as EQUALIZE_METHODS
from nvfp4tool.export.equalize import Equalization, equalize
from nvfp4tool.export.gptq import BLOCK_COLUMNS, BLOCK_SCALES, DAMP_RANGE, DEFAULT_DAMP
from nvfp4tool.export.gptq_pass import GPTQResult, run_gptq
from nvfp4tool.export.plan import ExportPlan, make_plan, read_keep_bf16_file, read_precision_file
from nvfp4tool.export.provenance import calibration_record, gptq_record
from nvfp4tool.export.quantizers import nvfp4_quantizer
from nvfp4tool.export.recipes import rule_patterns
from nvfp4tool.export.scale_search import METHODS
from nvfp4tool.formats import LayoutSpec
from nvfp4tool.model.fold import EqualizedSource, scales_from_record
from nvfp4tool.numerics import tensor_amax
from nvfp4tool.records.export import CalibrationRecord, EqualizationRecord, GPTQRecord

WEIGHT_ROUNDINGS = ("rtn", "gptq")  # --weight-rounding: round to nearest, or GPTQ
_AMAX_CHUNK_ELEMENTS = 1 << 24  # rows per chunk of the amax pass ~ 16M elements
_CALIBRATED = "calibration"  # the input amax origin of calibrated scales (recorded)
_NOT_FP8 = {  # the passes that need an NVFP4 linear, refusing an all-FP8 plan
    "--weight-rounding": (
        "--weight-rounding gptq rounds NVFP4 weights: use --quant nvfp4 or nvfp4-weight-only, not {quant}"
    ),
    "--equalize": "--equalize {} scales for NVFP4: use --quant nvfp4 or nvfp4-weight-only, not {quant}",
}


@dataclasses.dataclass(frozen=True)
class ExportOptions:
    """How to export (the `nvfp4tool export` options)."""

    format: str = "modelopt"  # modelopt | compressed-tensors
    quant: str = "nvfp4"  # nvfp4 (W4A4) | nvfp4-weight-only (W4A16) | fp8 (W8A8 per tensor) | fp8-block
    scale_search: str = "rtn"  # rtn | 4over6 | mse
    weight_rounding: str = "rtn"  # rtn | gptq (NVFP4 only; needs calib_data)
    equalize: str = "none"  # none | awq | smoothquant: equivalent scaling before quantizing (NVFP4; needs calib_data)
    gptq_damp: float = DEFAULT_DAMP  # GPTQ: H += damp * mean(diag H) * I
    gptq_block_scales: str = "original"  # GPTQ: export.gptq.BLOCK_SCALES (fixed first, or as it reaches them)
    weight_block: str | None = None  # 1d | 2d; None: the run's setting (2d for nvfp4 runs), else 1d
    keep_bf16: tuple[str, ...] = ()  # fnmatch patterns of linear modules kept in BF16
    keep_bf16_file: str | None = None  # a keep-BF16 file (plan.read_keep_bf16_file): more such patterns
    precision_file: str | None = None  # `PATTERN FORMAT` lines (plan.read_precision_file): per-linear formats
    auto_precision: float | None = None  # a KL target: per-linear formats searched on calibration (auto_precision.py)
    # the search scores on this many windows of calib_data that FOLLOW the calibration windows: never
    # the ones GPTQ / --equalize fitted the weights on (KL there reads low), nor the input amax's
    auto_precision_samples: int = 4
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
    # library callers: fold these recorded scales (another export's `equalization`) instead of
    # searching (validate's FP8 reference of an equalized export is made from the same folded model)
    equalization: EqualizationRecord | None = None
    # the named recipe its options came from (`export.recipes.apply_recipe`): recorded, and its
    # family's keep-BF16 rule applied once the model is open
    recipe: str | None = None


@dataclasses.dataclass(frozen=True)
class ExportJob:
    """The resolved inputs of one export (see the module docstring)."""

    source: Checkpoint
    out: str
    options: ExportOptions
    inputs: tuple[str, ...]  # the files the output must not overlap (source, calibration data, keep-BF16 file)
    spec: LayoutSpec  # the output layout (a mixed export: its first quant's; `spec_for` per linear)
    plan: ExportPlan  # what is quantized, in which fused groups
    block: str  # weight scale blocks: 1d | 2d
    group_amax: dict[str, np.float32]  # fused group -> joint weight amax
    calibration_ids: np.ndarray | None  # the windows [S, L] read from --calib-data (None without)
    search_ids: np.ndarray | None  # --auto-precision: the N windows after them that the search scores on
    input_amax: dict[str, float] | None  # quantized module -> input amax; None: weight-only
    input_amax_origin: str  # "training run" | "calibration" | "given (...)" | "none (weight-only | dynamic ...)"
    kv_amax: dict[str, tuple[float, float]]  # attention -> (K, V) amax; {} without --kv-cache
    calibration: CalibrationRecord | None  # the calibration data and windows that ran
    calibration_seconds: float  # reading --calib-data and running the model on it (0: none)
    gptq: GPTQResult | None = None  # GPTQ's records (with_gptq)
    gptq_record: GPTQRecord | None = None
    gptq_seconds: float = 0.0
    equalization: Equalization | None = None  # --equalize: the scales folded into `source.tensors`
    equalization_seconds: float = 0.0
    auto_precision: AutoPrecision | None = None  # --auto-precision: the search that made `plan` (with_search)
    auto_precision_seconds: float = 0.0  # the search (0: none)
    keep_bf16_origin: Mapping[str, str] = dataclasses.field(default_factory=dict)  # keep-BF16 pattern -> its file line
    reference: Any = None  # the tensors validate compares with (the unfolded source); None: `source.tensors`

    @property
    def kv_cache(self) -> str | None:
        """The quantized KV cache to announce (`formats.KV_CACHES`), None for --kv-cache none."""
        return _kv(self.options)

    def spec_for(self, module: str) -> LayoutSpec:
        """The layout of the quantized linear `module` (a mixed export's linears differ)."""
        return formats.get(self.options.format, self.plan.quant_of(module))

    @property
    def awaits_gptq(self) -> bool:
        """True until `with_gptq` ran for a --weight-rounding gptq export."""
        return self.options.weight_rounding == "gptq" and self.gptq is None

    @property
    def awaits_search(self) -> bool:
        """True until `with_search` ran for an --auto-precision export."""
        return self.options.auto_precision is not None and self.auto_precision is None


def prepare_job(src: str, out: str, options: ExportOptions) -> ExportJob:
    """The job of exporting `src` to `out` (see the module docstring); nothing is created."""
    _check_options(options)
    inputs = (src,) + tuple(f for f in (options.calib_data, options.keep_bf16_file, options.precision_file) if f)
    from_file = {
        p: where
        for p, where in (read_keep_bf16_file(options.keep_bf16_file).items() if options.keep_bf16_file else ())
        if p not in options.keep_bf16
    }
    check_output_path(
        out, inputs, flag="--out", force=options.force
    )  # before any work (atomic_output_dir checks again)
    source = open_checkpoint(src, step=options.step, model_config=options.model_config, rope_layout=options.rope_layout)
    problem = source.config.family_spec.export_problem(source.config, options.kv_cache)
    if problem is not None:
        raise NVFP4ToolError(problem)
    if options.recipe is not None:
        from_file |= {
            p: where for p, where in rule_patterns(options.recipe, source.config).items() if p not in from_file
        }
    for line in source.config.family_spec.export_warnings(source.config, options.format, options.quant):
        progress.warn(line)
    # a run trained with a precision file carries it: its rules first, --precision-file's after
    files = (source.precision_file, options.precision_file)
    rules = tuple(rule for f in files if f is not None for rule in read_precision_file(f))

    plan = _plan_with(source, options, from_file, rules)
    _check_mixed(plan, options)
    _check_format_carries(plan, options, rules, source.config)
    if options.auto_precision is not None and rules:
        raise NVFP4UsageError(
            f"--auto-precision {options.auto_precision:g}: {source.path} was trained with a precision file "
            f"({rules[0].origin}); the search starts every linear at --quant: export it with --precision-file instead"
        )
    spec = formats.get(options.format, plan.quant_of(plan.quantized[0]) if plan.is_mixed else plan.quant)
    block = options.weight_block or (source.weight_block if options.quant in formats.NVFP4_QUANTS else "1d")
    group_amax = _group_amax(source.tensors, plan)  # a broken source is named before anything else
    _check_calibration_used(plan, options)
    ids, search_ids = _calibration_ids(source, options)
    equalization, equalization_start = None, time.perf_counter()
    if options.equalization is not None:
        equalization = Equalization(
            scales=scales_from_record(options.equalization, source.config), record=options.equalization
        )
    elif options.equalize != "none":
        equalization = equalize(
            source.config,
            source.tensors,
            {m: plan.quant_of(m) for m in plan.quantized},
            ids,
            method=options.equalize,
            block=block,
            offload=options.offload,
        )
    unfolded = source.tensors  # what validate compares with
    if equalization is not None:  # the rest of the export runs on the folded model
        source = dataclasses.replace(source, tensors=EqualizedSource(source.tensors, equalization.scales))
        group_amax = _group_amax(source.tensors, plan)
    equalization_seconds = time.perf_counter() - equalization_start if equalization else 0.0
    calibration_start = time.perf_counter()
    input_amax, origin, calibration, kv_amax = _calibrate(source, plan, options, ids)
    if options.auto_precision is not None and input_amax is None:  # a weight-only base: its FP8 rung
        if options.weight_rounding == "gptq":  # needs input scales, which the GPTQ pass measures
            origin = _CALIBRATED
        else:
            found_amax = _calibration(source, plan.quantized, options, ids, kv_cache=False)
            input_amax, origin = found_amax.input_amax, _CALIBRATED
            calibration = _calibration_record(options, ids, found_amax.routed_tokens)
    return ExportJob(
        source=source,
        out=out,
        options=options,
        inputs=inputs,
        spec=spec,
        plan=plan,
        block=block,
        group_amax=group_amax,
        calibration_ids=ids,
        search_ids=search_ids,
        input_amax=input_amax,
        input_amax_origin=origin,
        kv_amax=kv_amax,
        calibration=calibration,
        calibration_seconds=time.perf_counter() - calibration_start if options.calib_data else 0.0,
        equalization=equalization,
        equalization_seconds=equalization_seconds,
        keep_bf16_origin=from_file,
        reference=unfolded,
    )


def with_gptq(job: ExportJob, spill_dir: str) -> ExportJob:
    """`job` with the GPTQ pass's records (spilled into `spill_dir`) and, where the job calibrates,
    the input amax, K / V amax and router counts the same pass measured through the original layers."""
    options, source, plan = job.options, job.source, job.plan
    # The input amax (and K / V amax, router counts) of a GPTQ export come from the ORIGINAL layers
    # (the pass's reference stream, exactly calibrate()'s values), not from the windows through the
    # already-quantized earlier layers that GPTQ's Hessians see (what serving computes). Measured on
    # the `small` preset (6 layers) trained 200 steps of 8 x 256 tokens on shakespeare train.txt, W4A4
    # GPTQ, calibration 32 x 256 tokens of train.txt, held-out KL vs BF16 on 32 x 256 tokens of val.txt
    # (`nvfp4tool export HF --quant nvfp4 --calib-data train.txt --calib-samples 32 --calib-seq-len 256
    # --weight-rounding gptq`, then validate as scripts/accuracy_study.py does; docs/benchmarks/accuracy-small.md):
    #   original layers:  KL mean 0.0012987, p99 0.010216, top-1 96.39%, ppl +0.17%
    #   quantized layers: KL mean 0.0013181, p99 0.010123, top-1 96.34%, ppl +0.13%
    # the quantized path moves 14 of the 42 input amax (-0.7% .. +0.8%; the others are equal in BF16)
    # and costs 1.5% more mean KL and some top-1 agreement (the study's metrics): a small margin, on
    # one model and seed, but the measured better one, so the original layers' amax stays (and every
    # export's bytes stay as they were).
    calibrates_inputs = job.input_amax_origin == _CALIBRATED
    start = time.perf_counter()
    gptq = run_gptq(
        source.config,
        source.tensors,
        plan,
        job.group_amax,
        options.calib_data,
        spill_dir=spill_dir,
        samples=options.calib_samples,
        seq_len=options.calib_seq_len,
        tokenizer_dir=source.aux_dir,
        offload=options.offload,
        method=options.scale_search,
        block=job.block,
        damp=options.gptq_damp,
        block_scales=options.gptq_block_scales,
        ids_SxL=job.calibration_ids,
        amax_names=plan.quantized if calibrates_inputs else None,
        kv_cache=job.kv_cache is not None,
    )
    record = _gptq_record(options, gptq.errors)
    progress.info(
        f"GPTQ: {len(gptq.errors)} linears, output error on the calibration inputs "
        f"{100 * record.mean_output_err_reduction:.1f}% below RTN's with the same scales (mean)"
    )
    found = gptq.calibration
    return dataclasses.replace(
        job,
        gptq=gptq,
        gptq_record=record,
        gptq_seconds=time.perf_counter() - start,
        input_amax=found.input_amax if calibrates_inputs else job.input_amax,
        kv_amax=found.kv_amax if found is not None and found.kv_amax else job.kv_amax,
        calibration=(
            _calibration_record(options, job.calibration_ids, found.routed_tokens)
            if calibrates_inputs
            else job.calibration
        ),
    )


def with_search(job: ExportJob) -> ExportJob:
    """`job` with the --auto-precision search's plan (`auto_precision.search_precision`): run after
    `with_gptq`, so that a GPTQ export's base-format units are measured with the records the
    writer then stores (measured is written: the records of the all-base pass, each unit's
    Hessians taken through every earlier layer in the base format)."""
    options, source = job.options, job.source
    start = time.perf_counter()
    # the NVFP4 rung's and points' weights (an FP8 / fp8-block base's uniform NVFP4 points too)
    nvfp4 = nvfp4_quantizer(job.plan, options.scale_search, job.block, job.group_amax, job.gptq)
    found = search_precision(
        source,
        job.plan,
        job.group_amax,
        job.input_amax,
        job.search_ids,
        options,
        block=job.block,
        nvfp4=nvfp4,
        reference=job.reference,
        kv_amax=job.kv_amax,
    )
    plan = _plan_with(source, options, job.keep_bf16_origin, found.rules)
    _check_format_carries(plan, options, found.rules, source.config)
    spec = formats.get(options.format, plan.quant_of(plan.quantized[0]) if plan.quantized else options.quant)
    input_amax, origin = job.input_amax, job.input_amax_origin
    if plan.has_input_scales:
        input_amax = {m: input_amax[m] for m in plan.quantized}
    else:
        input_amax, origin = None, _no_input_scales(plan)
    gptq, record = job.gptq, job.gptq_record
    if gptq is not None:  # the records of the linears left in an NVFP4 format
        rounded = {m for m in plan.quantized if plan.quant_of(m) in formats.NVFP4_QUANTS}
        gptq = dataclasses.replace(gptq, errors={m: e for m, e in gptq.errors.items() if m in rounded})
        record = _gptq_record(options, gptq.errors)
    return dataclasses.replace(
        job,
        plan=plan,
        spec=spec,
        group_amax={g: a for g, a in job.group_amax.items() if g in plan.groups},
        input_amax=input_amax,
        input_amax_origin=origin,
        gptq=gptq,
        gptq_record=record,
        auto_precision=found,
        auto_precision_seconds=time.perf_counter() - start,
    )


# ------------------------------------------------------------------------------------------
# helpers


def _gptq_record(options: ExportOptions, errors) -> GPTQRecord:
    """The export record's GPTQ entry: the options' settings and these linears' errors."""
    return gptq_record(
        damp=options.gptq_damp, block_size=BLOCK_COLUMNS, errors=errors, block_scales=options.gptq_block_scales
    )


def _plan_with(source: Checkpoint, options: ExportOptions, keep_bf16_origin: Mapping[str, str], rules) -> ExportPlan:
    """The plan of these per-linear rules (the precision files', or the search's that replace them)."""
    return make_plan(
        source.config,
        options.quant,
        precision_map=source.precision_map,
        keep_bf16=options.keep_bf16 + tuple(keep_bf16_origin),
        keep_bf16_origin=dict(keep_bf16_origin),
        rules=rules,
    )


def _check_options(options: ExportOptions) -> None:
    if options.kv_cache not in ("none", *formats.KV_CACHES):
        raise NVFP4UsageError(
            f"unknown --kv-cache {options.kv_cache!r}; choose one of {', '.join(('none', *formats.KV_CACHES))}"
        )
    if options.format not in formats.FORMATS:
        raise NVFP4ToolError(f"unknown --format {options.format!r}; choose one of {', '.join(formats.FORMATS)}")
    if options.scale_search not in METHODS:
        raise NVFP4ToolError(f"unknown --scale-search {options.scale_search!r}; choose one of {', '.join(METHODS)}")
    if options.quant not in formats.NVFP4_QUANTS and options.scale_search != "rtn":
        raise NVFP4ToolError(f"--scale-search applies to NVFP4 only ({options.quant} is amax scaling)")
    if options.weight_rounding not in WEIGHT_ROUNDINGS:
        raise NVFP4UsageError(
            f"unknown --weight-rounding {options.weight_rounding!r}; choose one of {', '.join(WEIGHT_ROUNDINGS)}"
        )
    if not DAMP_RANGE[0] < options.gptq_damp <= DAMP_RANGE[1]:  # also refuses nan
        raise NVFP4UsageError(
            f"--gptq-damp must be > {DAMP_RANGE[0]} and <= {DAMP_RANGE[1]} "
            f"(a fraction of the mean Hessian diagonal), got {options.gptq_damp}"
        )
    if options.gptq_block_scales not in BLOCK_SCALES:
        raise NVFP4UsageError(
            f"unknown --gptq-block-scales {options.gptq_block_scales!r}; choose one of {', '.join(BLOCK_SCALES)}"
        )
    if options.gptq_block_scales != "original" and options.weight_rounding != "gptq":
        raise NVFP4UsageError(
            f"--gptq-block-scales {options.gptq_block_scales} chooses GPTQ's block scales: "
            f"it needs --weight-rounding gptq"
        )
    all_fp8 = options.quant not in formats.NVFP4_QUANTS and options.precision_file is None  # fp8 / fp8-block
    if options.weight_rounding == "gptq" and all_fp8:
        raise NVFP4UsageError(_NOT_FP8["--weight-rounding"].format(quant=options.quant))
    if _kv(options) is not None and options.calib_data is None:
        raise NVFP4UsageError(
            f"--kv-cache {options.kv_cache} needs --calib-data PATH (it calibrates the K / V "
            f"amax of every attention layer)"
        )
    if options.weight_rounding == "gptq" and options.calib_data is None:
        raise NVFP4UsageError(
            "--weight-rounding gptq needs --calib-data PATH (the Hessian of each linear's "
            "input comes from the calibration text)"
        )
    if options.equalize not in EQUALIZE_METHODS:
        raise NVFP4UsageError(f"unknown --equalize {options.equalize!r}; choose one of {', '.join(EQUALIZE_METHODS)}")
    if options.equalization is not None:
        if options.equalize != options.equalization.method:
            raise NVFP4UsageError(
                f"ExportOptions.equalization is {options.equalization.method} scales: "
                f"equalize must say so, not {options.equalize!r}"
            )
    elif options.equalize != "none" and all_fp8:
        raise NVFP4UsageError(_NOT_FP8["--equalize"].format(options.equalize, quant=options.quant))
    if options.equalize != "none" and options.equalization is None and options.calib_data is None:
        raise NVFP4UsageError(
            f"--equalize {options.equalize} needs --calib-data PATH (the scales are chosen on "
            "the calibration activations)"
        )
    if options.auto_precision is not None:
        _check_auto(options)
    if options.weight_block not in (None, "1d", "2d"):
        raise NVFP4ToolError(f"--weight-block must be 1d or 2d, got {options.weight_block!r}")


def _check_mixed(plan: ExportPlan, options: ExportOptions) -> None:
    """A precision file whose every quantized linear is FP8 (per tensor or fp8-block) is refused
    GPTQ and --equalize as --quant fp8 / fp8-block is; a plan with an NVFP4 linear takes both,
    each linear by its own format (GPTQ rounds the NVFP4 ones, the FP8 ones to nearest; AWQ scores
    each in its own)."""
    quants = sorted({plan.quant_of(m) for m in plan.quantized})
    if not quants or any(q in formats.NVFP4_QUANTS for q in quants):
        return
    quant = " / ".join(quants)
    if options.weight_rounding == "gptq":
        raise NVFP4UsageError(f"{options.precision_file}: {_NOT_FP8['--weight-rounding'].format(quant=quant)}")
    if options.equalize != "none" and options.equalization is None:
        raise NVFP4UsageError(
            f"{options.precision_file}: {_NOT_FP8['--equalize'].format(options.equalize, quant=quant)}"
        )


def _check_format_carries(plan: ExportPlan, options: ExportOptions, rules, config) -> None:
    """Refuse in one line what --format cannot carry so that its engines load it: a mixed file with
    a quant the format's mixed loader does not map (ModelOpt: fp8-block; NVFP4UsageError naming the
    precision-file line), a linear its layout cannot hold (ModelOpt fp8-block: N or K off 128, a
    routed expert; an fp8-block merged GEMM whose shards but the last are off 128; NVFP4ToolError naming it)."""
    if plan.is_mixed:
        problem = formats.mixed_problem(options.format, set(plan.quants.values()))
        if problem is not None:
            bad = next(q for q in plan.quants.values() if formats.mixed_problem(options.format, {q}))
            where = next((r.origin for r in reversed(rules) if r.precision == bad), None)
            raise NVFP4UsageError(f"{where}: {problem}" if where else problem)
    shapes = config.expected_tensor_shapes()
    for module in plan.quantized:
        n, k = shapes[f"{module}.weight"][:2]
        problem = formats.linear_problem(options.format, plan.quant_of(module), module, n, k)
        if problem is not None:
            raise NVFP4ToolError(f"{module}.weight: {plan.quant_of(module)} in --format {options.format}: {problem}")
    for members in plan.groups.values():
        found = formats.merged_problem(plan.quant_of(members[0]), {m: shapes[f"{m}.weight"][0] for m in members})
        if found is not None:
            raise NVFP4ToolError(f"{found[0]}.weight: {found[1]}; keep its group BF16 or choose another format")


def _check_auto(options: ExportOptions) -> None:
    """--auto-precision KL: a positive finite target, searched on --calib-data, alone in choosing formats."""
    target = options.auto_precision
    if not (isinstance(target, int | float) and math.isfinite(target) and target > 0):
        raise NVFP4UsageError(f"--auto-precision must be a positive mean KL in nats (e.g. 0.05), got {target}")
    if options.calib_data is None:
        raise NVFP4UsageError(
            f"--auto-precision {target:g} needs --calib-data PATH (the search runs on the calibration windows)"
        )
    if options.precision_file is not None:
        raise NVFP4UsageError(
            f"--auto-precision {target:g} chooses every linear's format: drop --precision-file "
            f"{options.precision_file} (--keep-bf16 patterns stay BF16 and are not searched)"
        )
    samples = options.auto_precision_samples
    if not (isinstance(samples, int) and samples >= 1):
        raise NVFP4UsageError(f"--auto-precision-samples must be a whole number >= 1, got {samples}")
    if options.quant not in LADDERS:
        raise NVFP4UsageError(f"--auto-precision searches from --quant {', '.join(LADDERS)}, not {options.quant}")


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
            chunk_amax = np.float32(tensor_amax(jnp.asarray(w[start : start + rows])))
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
    given (its windows `ids_SxL`); the KV cache is always calibrated. With --weight-rounding gptq
    nothing runs here: the GPTQ pass measures what calibration would (`with_gptq`), the input amax
    is left None when it is to be calibrated."""
    kv_cache = _kv(options) is not None
    gptq = options.weight_rounding == "gptq"
    needs_inputs = plan.has_input_scales and bool(plan.quantized)
    if needs_inputs and not kv_cache and options.input_amax is not None and options.calib_data is None:
        given = dataclasses.replace(source, input_amax=dict(options.input_amax))
        return _tracked_input_amax(given, plan)[0], "given (ExportOptions.input_amax)", None, {}
    if not needs_inputs or (source.input_amax is not None and options.calib_data is None):
        input_amax, origin = _tracked_input_amax(source, plan) if needs_inputs else (None, _no_input_scales(plan))
        if gptq:  # the GPTQ pass's record: the data it ran
            return input_amax, origin, _calibration_record(options, ids_SxL), {}
        if not kv_cache:
            return input_amax, origin, None, {}
        found = _calibration(source, [], options, ids_SxL, kv_cache=True)
        return input_amax, origin, _calibration_record(options, ids_SxL), found.kv_amax
    if options.calib_data is None:
        raise NVFP4ToolError(
            f"{source.path}: {_needs_inputs(plan, options)} input scales: pass "
            "--calib-data PATH (or export a training run, or use nvfp4-weight-only)"
        )
    if gptq:
        return None, _CALIBRATED, _calibration_record(options, ids_SxL), {}
    found = _calibration(source, plan.quantized, options, ids_SxL, kv_cache=kv_cache)
    return (found.input_amax, _CALIBRATED, _calibration_record(options, ids_SxL, found.routed_tokens), found.kv_amax)


def _calibration(source: Checkpoint, names, options: ExportOptions, ids_SxL: np.ndarray, *, kv_cache: bool):
    from nvfp4tool.export.calibrate import calibrate

    return calibrate(
        source.config,
        source.tensors,
        names,
        options.calib_data,
        samples=options.calib_samples,
        seq_len=options.calib_seq_len,
        tokenizer_dir=source.aux_dir,
        kv_cache=kv_cache,
        offload=options.offload,
        ids_SxL=ids_SxL,
    )


def _calibration_ids(source: Checkpoint, options: ExportOptions) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(the calibration windows [S, L] read from --calib-data, the --auto-precision search's
    windows: the next --auto-precision-samples of the same file, disjoint from them), None without.
    The file may give fewer windows or shorter ones than --calib-samples / --calib-seq-len ask (the
    samples are at most that many; a library caller's default of 64 windows is common); that is
    said in one line and recorded (`CalibrationRecord`: what ran and what was asked). Less than one
    token, or no window left for the search: refused."""
    if options.calib_data is None:
        return None, None
    from nvfp4tool.export.calibrate import load_calibration_ids

    searched = options.auto_precision_samples if options.auto_precision is not None else 0
    ids = load_calibration_ids(
        options.calib_data,
        samples=options.calib_samples + searched,
        seq_len=options.calib_seq_len,
        tokenizer_dir=source.aux_dir,
        vocab_size=source.config.vocab_size,
    )
    search_ids = None
    if searched:
        if len(ids) <= options.calib_samples:
            raise NVFP4ToolError(
                f"{options.calib_data}: {len(ids)} window(s) of {ids.shape[1]} tokens, none left for the "
                f"--auto-precision search after the {options.calib_samples} calibration windows (it scores on "
                f"the --auto-precision-samples {searched} that follow them); give more text or lower --calib-samples"
            )
        ids, search_ids = ids[: options.calib_samples], ids[options.calib_samples :]
        if len(search_ids) < searched:
            progress.warn(
                f"warning: {options.calib_data} gives {len(search_ids)} window(s) for the --auto-precision "
                f"search after the calibration windows, fewer than --auto-precision-samples {searched} (recorded)"
            )
    samples, seq_len = ids.shape
    if (samples, seq_len) != (options.calib_samples, options.calib_seq_len):
        progress.warn(
            f"warning: {options.calib_data} gives {samples} calibration window(s) of {seq_len} tokens, "
            f"fewer than asked (--calib-samples {options.calib_samples} x --calib-seq-len "
            f"{options.calib_seq_len}): calibrating on its {samples * seq_len} tokens (recorded)"
        )
    return ids, search_ids


def _calibration_record(options: ExportOptions, ids_SxL: np.ndarray, routed_tokens: dict[str, int] | None = None):
    """The record of the calibration data and the windows that ran; `routed_tokens` when it
    calibrated MoE experts' inputs."""
    return calibration_record(
        options.calib_data,
        ids_SxL,
        requested=(options.calib_samples, options.calib_seq_len),
        routed_tokens=routed_tokens,
    )


def _check_calibration_used(plan: ExportPlan, options: ExportOptions) -> None:
    """--calib-data given where nothing uses it (no input scales to calibrate, no GPTQ, no KV
    cache) is bad usage (NVFP4UsageError naming --calib-data), not silently ignored. Checked
    after the weight pass (the source's own errors come first), before any calibration or output."""
    if (
        options.calib_data is None
        or options.weight_rounding == "gptq"
        or _kv(options) is not None
        or options.equalize != "none"
        or options.auto_precision is not None
    ):
        return
    if plan.has_input_scales and plan.quantized:
        return
    why = (
        f"--quant {plan.quant} has no input scales"
        if not plan.has_input_scales
        else "every linear module stays in BF16"
    )
    raise NVFP4UsageError(
        f"--calib-data {options.calib_data} would not be used: {why}, and neither "
        f"--weight-rounding gptq nor --kv-cache fp8 is asked; drop --calib-data (or add one of those)"
    )


def _tracked_input_amax(source: Checkpoint, plan: ExportPlan) -> tuple[dict[str, float], str]:
    """(the training run's tracked input amax of every quantized module, checked, "training run")."""
    missing = [m for m in plan.quantized if m not in source.input_amax]
    if missing:
        raise NVFP4ToolError(
            f"{source.path}: no tracked input amax for {missing[0]} (it trained "
            f"in BF16?); keep it in BF16 or pass --calib-data"
        )
    bad = [m for m in plan.quantized if not (source.input_amax[m] > 0 and np.isfinite(source.input_amax[m]))]
    if bad:
        raise NVFP4ToolError(
            f"{source.path}: tracked input amax of {bad[0]} is "
            f"{source.input_amax[bad[0]]}; pass --calib-data to recalibrate"
        )
    return {m: float(source.input_amax[m]) for m in plan.quantized}, "training run"


def _needs_inputs(plan: ExportPlan, options: ExportOptions) -> str:
    """What asks for input scales, in words: `--quant Q needs`, or a precision file's W4A4 / FP8 linears."""
    if plan.is_mixed:
        quants = sorted({q for q in plan.quants.values() if q != "nvfp4-weight-only"})
        return f"{options.precision_file}: the {' / '.join(quants)} linears need"
    return f"--quant {plan.quant} needs"


def _no_input_scales(plan: ExportPlan) -> str:
    """The input amax origin of a plan without input scales: fp8-block's are dynamic, else weight-only."""
    return "none (dynamic activation scales)" if plan.quant == "fp8-block" else "none (weight-only)"


def _kv(options: ExportOptions) -> str | None:
    """The quantized KV cache to announce (`formats.KV_CACHES`), None for --kv-cache none."""
    return None if options.kv_cache == "none" else options.kv_cache
