"""Run the BF16 source, the FP8 reference and the NVFP4 export on the same token windows, one model
at a time, each held as stored (or streamed layer by layer).

    with open_inputs("out/m-nvfp4", ValidateOptions(data="val.txt", reference="fp8")) as inputs:
        record = run_validation(inputs)    # a ValidationRecord
    run = validate_export("out/m-nvfp4", options, json_copy="v.json")  # + validation.json etc.

Every model computes in fp32 on its weights as stored.
Design notes: docs/design/validate.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from converters.atomic import scratch_dir
from converters.tensor_source import tensor_bytes
from nvfp4tool import formats, memory, progress
from nvfp4tool.checkpoints import CLI_OPTIONS, Checkpoint, open_checkpoint
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError
from nvfp4tool.export import ExportOptions
from nvfp4tool.export.plan import make_plan
from nvfp4tool.export.provenance import locate_source
from nvfp4tool.export.simulate import ExportedModel, ServedKVTap, for_generation, load_export, served_linear
from nvfp4tool.model import model_from_tensors
from nvfp4tool.model.fold import EqualizedSource, carried
from nvfp4tool.model.kv import KVFn, default_kv
from nvfp4tool.model.layerwise import LayerwiseModel, layer_modules
from nvfp4tool.model.linear import Plain
from nvfp4tool.model.logit_spool import LogitSpool
from nvfp4tool.numerics import computed_after, metrics
from nvfp4tool.records.export import (
    AutoPrecisionRecord,
    EqualizationRecord,
    ExportRecord,
    definition_hashes,
    sha256_file,
)
from nvfp4tool.records.validation import (
    KV_SUFFIX,
    DataRef,
    Failure,
    Generation,
    Histogram,
    LayerSQNR,
    Named,
    Resources,
    SearchedTarget,
    ValidationRecord,
)
from nvfp4tool.validate.custody import reference_mismatch, source_mismatch, validated_files
from nvfp4tool.validate.footprint import Footprint, footprint
from nvfp4tool.validate.generation import greedy_continuations
from nvfp4tool.validate.thresholds import Thresholds, check_thresholds, defaults_for

_EXPORT_DEFAULTS = ExportOptions()  # the FP8 reference's calibration defaults are export's
SCRATCH_PREFIX = "nvfp4tool-validate-"  # the scratch folder in the system temp folder (atomic.scratch_dir)
KL_BINS = 40  # log-spaced bins of the per-token KL histogram
VALIDATION_DTYPE = jnp.float32  # every validated model computes in fp32 (the source, the export, the reference)


@dataclasses.dataclass(frozen=True)
class ValidateOptions:
    """What `nvfp4tool validate` runs (the CLI flags)."""

    data: str  # .txt / .jsonl text (or a .npy [S, L] of token ids)
    reference: str = "fp8"  # fp8 (made on the fly) | bf16 (no FP8 column) | PATH of an FP8 export
    source: str | None = None  # the BF16 source (default: the export's provenance record)
    samples: int = 16  # sequences of `seq_len` tokens
    seq_len: int = 256
    batch_size: int = 4
    prompts: int = 4  # greedy-generation prompts (the first `prompt_len` tokens of the first sequences)
    prompt_len: int = 32
    gen_tokens: int = 256  # greedy continuation length
    thresholds: Thresholds | None = None  # None: the export's quant's defaults (`thresholds.defaults_for`) ...
    limits: Mapping[str, float] = dataclasses.field(default_factory=dict)  # ... with these limits over them
    offload: str = "auto"  # auto | never | always (memory.choose_offload)
    source_mismatch_ok: bool = False  # validate against a source that is not the export's recorded one
    calib_data: str | None = None  # calibration of the on-the-fly FP8 reference (never `data`)
    calib_samples: int = _EXPORT_DEFAULTS.calib_samples
    calib_seq_len: int = _EXPORT_DEFAULTS.calib_seq_len

    def judged_by(self, quant: str) -> Thresholds:
        """The limits an export of `quant` is judged by: `thresholds`, or its quant's defaults,
        with `limits` (the ones a user gave) over them."""
        try:
            return dataclasses.replace(self.thresholds or defaults_for(quant), **self.limits)
        except TypeError:
            raise NVFP4UsageError(f"validate limits: {sorted(self.limits)}: unknown threshold names") from None


@dataclasses.dataclass
class Candidate:
    """A quantized model as served: the export opened (tensors read when asked for)."""

    label: str  # "nvfp4" / "fp8" / "nvfp4+fp8-kv"
    exported: ExportedModel
    fp8_kv: bool = False  # run with the export's FP8 KV cache (its stored K / V scales)
    # the BF16 model it quantized (the source's tensors, folded by its own `--equalize` scales or
    # not): its weights are compared with this one's, its GEMMs fed this model's activations
    # (`model.fold.carried`); None: the validation's source model (`Inputs.source`)
    model: Any = None

    @classmethod
    def load(cls, folder: str, label: str | None = None) -> Candidate:
        """The export in `folder` as served; refused (exit 1, its first problem) if `check` fails,
        so validate never reports numbers for a checkpoint no engine should load."""
        from nvfp4tool.check import check_checkpoint

        report = check_checkpoint(folder)
        if not report.ok:
            raise NVFP4ToolError(report.failure("not validated"))
        memory.release()  # what the check decoded
        exported = load_export(folder)
        return cls(label or exported.quant, exported)


@dataclasses.dataclass
class Inputs:
    """Everything a validation (or a sensitivity search) runs on: opened, not loaded."""

    export_dir: str
    options: ValidateOptions
    source: Checkpoint  # the BF16 source, opened
    nvfp4: Candidate
    fp8: Candidate | None
    reference: str  # what the FP8 column is (see ValidationRecord.reference)
    reference_export: Named | None  # the --reference folder, named and hashed
    ids_SxL: np.ndarray
    scratch: str  # a temporary folder for this validation (the reference logits, an FP8 export)
    reference_logits: LogitSpool | None = None  # the BF16 logits, once the source has run
    source_mismatch: str | None = None  # why the source is not the export's recorded one (source_mismatch_ok)
    reference_calibration: str | None = None  # what calibrated the FP8 reference (ValidationRecord)
    ran: dict[str, str] = dataclasses.field(default_factory=dict)  # {label: "held" | "streamed"}
    needs: dict[str, Footprint] = dataclasses.field(default_factory=dict)  # {label: what it was estimated to hold}

    @property
    def candidates(self) -> list[Candidate]:
        """The quantized models compared per layer: the export (plain KV cache) and the FP8 reference."""
        return [c for c in (self.nvfp4, self.fp8) if c is not None]

    @property
    def compute_dtype(self):
        """What every model of this validation computes in (`VALIDATION_DTYPE`, fp32)."""
        return VALIDATION_DTYPE

    @property
    def runs(self) -> list[Candidate]:
        """Every model compared with BF16: the candidates, then the export with its FP8 KV cache
        when it carries KV-cache scales."""
        kv = self.nvfp4.exported.kv_cache is not None
        return self.candidates + (
            [Candidate(self.nvfp4.label + KV_SUFFIX, self.nvfp4.exported, fp8_kv=True)] if kv else []
        )

    def footprint(self, config, stored: dict[str, int]) -> Footprint:
        """What validating a model of `config` whose tensors as stored are `stored` ({name: bytes})
        holds, held or streamed (`footprint.footprint`): what `--offload auto` weighs."""
        samples, seq_len = self.ids_SxL.shape
        return footprint(config, stored, self.options, samples=samples, seq_len=seq_len)

    def footprints(self) -> dict[str, Footprint]:
        """{label: Footprint} of every model the validation runs: the BF16 source, then `runs`."""
        return {
            "bf16": self.footprint(self.source.config, source_tensor_bytes(self.source)),
            **{c.label: self.footprint(c.exported.config, c.exported.stored_tensor_bytes()) for c in self.runs},
        }


@contextlib.contextmanager
def open_inputs(export_dir: str, options: ValidateOptions) -> Iterator[Inputs]:
    """Open the export, its BF16 source, the FP8 reference and read the token windows; the scratch
    folder (reference logits, an FP8 export made on the fly) is removed on exit.

    Refused up front, before any model runs: a source that is not the one the export's provenance
    record names (`custody.source_mismatch`; unless `source_mismatch_ok`), an on-the-fly FP8
    reference with nothing to calibrate it on (`_reference_calibration`), `calib_data` where no FP8
    reference is made or that is the evaluation data itself."""
    from nvfp4tool.export.calibrate import load_calibration_ids

    for flag, value in (
        ("--samples", options.samples),
        ("--seq-len", options.seq_len),
        ("--batch-size", options.batch_size),
        ("--prompts", options.prompts),
        ("--prompt-len", options.prompt_len),
        ("--gen-tokens", options.gen_tokens),
        ("--calib-samples", options.calib_samples),
        ("--calib-seq-len", options.calib_seq_len),
    ):
        if value < 1:
            raise NVFP4UsageError(f"{flag} must be >= 1, got {value}")
    if options.offload not in memory.OFFLOAD_MODES:
        raise NVFP4UsageError(f"--offload {options.offload}: expected one of {', '.join(memory.OFFLOAD_MODES)}")
    if options.reference not in ("fp8", "bf16") and not os.path.isdir(options.reference):
        raise NVFP4ToolError(f"--reference {options.reference}: not fp8, bf16 or an export folder")
    _check_calib_data(options)
    progress.info(f"opening {export_dir}")
    nvfp4 = Candidate.load(export_dir)
    if not nvfp4.exported.quantized:
        raise NVFP4ToolError(f"{export_dir}: no quantized linear modules (everything is BF16): nothing to validate")
    if nvfp4.exported.quant == "fp8" and options.reference != "bf16":
        raise NVFP4ToolError(f"{export_dir}: an FP8 export; validate it with --reference bf16")
    record = ExportRecord.read(export_dir) if ExportRecord.exists(export_dir) else None
    source_path, step = source_of(export_dir, options.source, record)
    progress.info(f"opening the BF16 source {source_path}")
    source = open_checkpoint(source_path, step=step, options=VALIDATE_OPTIONS)
    mismatch = None if record is None else source_mismatch(export_dir, record, source)
    if mismatch is not None and not options.source_mismatch_ok:
        raise NVFP4ToolError(
            f"{mismatch}: not the source the export was made from; pass the right --source, "
            "or --source-mismatch-ok to validate against this one anyway (the report says so)"
        )
    if mismatch is None and record is not None and options.reference not in ("fp8", "bf16"):
        mismatch = reference_mismatch(options.reference, record)
        if mismatch is not None and not options.source_mismatch_ok:
            raise NVFP4ToolError(
                f"{mismatch}: the FP8 reference must be an export of the same source; pass "
                "another --reference, or --source-mismatch-ok to compare with it anyway"
            )
    if mismatch is not None:
        progress.info(f"--source-mismatch-ok: {mismatch}")
    calibration = _reference_calibration(options, record, source)
    unfolded = source.tensors
    if record is not None and record.equalization is not None:  # compare with the model the export folded
        folded = (  # the scales bound to the export's bytes, unless another source was allowed
            EqualizedSource.from_export(source.tensors, export_dir, record, source.config)
            if mismatch is None
            else EqualizedSource.from_record(source.tensors, record.equalization, source.config)
        )
        source = dataclasses.replace(source, tensors=folded)
        progress.info(
            f"the export is equalized (--equalize {record.equalize}): the BF16 model is the source with "
            f"its {len(record.equalization.sites)} recorded scales folded in (KL "
            f"{record.equalization.check_kl_mean:.2g} nats to the source, checked at export)"
        )
    tokenizer_dir = export_dir if os.path.isfile(os.path.join(export_dir, "tokenizer.json")) else source.aux_dir
    vocab = nvfp4.exported.config.vocab_size
    ids = load_calibration_ids(
        options.data,
        samples=options.samples,
        seq_len=options.seq_len,
        tokenizer_dir=tokenizer_dir,
        vocab_size=vocab,
        flags=("--samples", "--seq-len"),
    )
    if options.calib_data is not None:  # read once here, so a bad file is refused before anything runs
        load_calibration_ids(
            options.calib_data,
            samples=options.calib_samples,
            seq_len=options.calib_seq_len,
            tokenizer_dir=source.aux_dir,
            vocab_size=vocab,
        )
    with _scratch() as scratch:
        equalization = None if record is None else record.equalization
        fp8, reference, reference_export, reference_calibration = _reference(
            options, source, scratch, calibration, equalization
        )
        if fp8 is not None:
            fp8.model = _model_of(fp8, equalization, unfolded, source)
        yield Inputs(
            export_dir=export_dir,
            options=options,
            source=source,
            nvfp4=nvfp4,
            fp8=fp8,
            reference=reference,
            reference_export=reference_export,
            ids_SxL=ids,
            scratch=scratch,
            source_mismatch=mismatch,
            reference_calibration=reference_calibration,
        )


def validate_export(
    export_dir: str,
    options: ValidateOptions,
    *,
    json_copy: str | None = None,
    kl_target: float | None = None,
    force: bool = False,
) -> ValidationRun:
    """Validate, optionally search the layers to keep in BF16 (`kl_target`), write the reports
    (validation.json / .md and the plots into the export, a copy of the JSON at `json_copy`).
    Existing reports are replaced only with `force` (refused before anything runs otherwise)."""
    from nvfp4tool.validate.report import write_reports
    from nvfp4tool.validate.sensitivity import sensitivity

    check_report_paths(export_dir, json_copy, force=force)
    started = time.perf_counter()
    with open_inputs(export_dir, options) as inputs:
        record = run_validation(inputs)
        if kl_target is not None:
            record = dataclasses.replace(record, sensitivity=sensitivity(inputs, kl_target=kl_target))
            memory.release()  # the search's model
        record = dataclasses.replace(
            record,
            resources=Resources(
                offload=options.offload,
                models=dict(inputs.ran),
                peak_rss_bytes=memory.peak_rss_bytes(),
                seconds=time.perf_counter() - started,
            ),
        )
    files = write_reports(record, export_dir, json_copy)
    return ValidationRun(
        record=record,
        files=files,
        source_path=inputs.source.path,
        source_mismatch=inputs.source_mismatch,
        footprints=dict(inputs.needs),
    )


def check_report_paths(
    export_dir: str, json_copy: str | None, *, force: bool, files: tuple[str, ...] | None = None
) -> None:
    """Refuse (before any work) a `--json` copy into a missing folder or inside the export (push would
    publish a file validation.json does not hash), and, without `force`, replacing any report
    written (`files`, the first being the record the copy copies: validate's REPORT_FILES by
    default, eval passes its EVAL_FILES; and the `--json` copy)."""
    from converters.atomic import clean_stale
    from nvfp4tool.validate.report import REPORT_FILES

    names = files or REPORT_FILES
    if os.path.isdir(export_dir):
        clean_stale(export_dir)  # an interrupted report writer's leftovers, before the export is hashed

    if json_copy is not None:
        folder = os.path.dirname(os.path.abspath(json_copy))
        if not os.path.isdir(folder):
            raise NVFP4UsageError(f"--json {json_copy}: its folder does not exist")
        if os.path.isdir(export_dir) and os.path.commonpath(
            [os.path.realpath(folder), os.path.realpath(export_dir)]
        ) == os.path.realpath(export_dir):
            raise NVFP4UsageError(
                f"--json {json_copy}: inside the export {export_dir}, which already gets "
                f"{names[0]}; write the copy elsewhere"
            )
    for path in [os.path.join(export_dir, name) for name in names] + ([json_copy] if json_copy else []):
        if os.path.lexists(path) and (not force or os.path.isdir(path)):
            raise NVFP4ToolError(
                f"{path}: already exists; pass --force to replace it"
                if not os.path.isdir(path)
                else f"{path}: exists and is not a file; refusing to replace it"
            )


@dataclasses.dataclass(frozen=True)
class ValidationRun:
    """What `validate_export` did: the record, the files it wrote, the source's local path (for
    the commands it suggests; never saved)."""

    record: ValidationRecord
    files: list[str]
    source_path: str
    source_mismatch: str | None = None  # the source differs from the export's record (source_mismatch_ok)
    footprints: dict[str, Footprint] = dataclasses.field(default_factory=dict)  # {label: its estimate}


def run_validation(inputs: Inputs) -> ValidationRecord:
    """The validation record; `passed` is False if a threshold fails. <label> below is the
    export's quant ("nvfp4", "nvfp4-weight-only"), "fp8" and, for an export with an FP8 KV cache,
    "<quant>+fp8-kv" (metrics and generation only; thresholds judge "<quant>"): models {bf16: {ppl}, <label>:
    {kl_mean, kl_p99, top1, ppl, ppl_increase, logit_max_err, logit_mean_err}}, layers (weight and
    output SQNR per label, worst output first), generation (first divergence per prompt and
    label), kl_histogram, thresholds, failures [metric, value, limit, by, detail], passed.
    """
    options = inputs.options
    prompt_len = min(options.prompt_len, inputs.ids_SxL.shape[1])
    prompts = inputs.ids_SxL[: options.prompts, :prompt_len]

    # 1. the BF16 source: reference logits (spooled), its perplexity, every layer's output SQNR
    source = inputs.source
    spool = inputs.reference_logits = LogitSpool(
        os.path.join(inputs.scratch, "bf16.logits"), inputs.ids_SxL.shape, source.config.vocab_size
    )
    model, held = _open_model(
        "bf16",
        inputs,
        source_tensor_bytes(source),
        lambda mesh: model_from_tensors(
            source.config, source.tensors, dtype=None, compute_dtype=VALIDATION_DTYPE, mesh=mesh
        ),
        source.tensors,
        source.config,
    )
    powers = _OutputPowers(labels=tuple(c.label for c in inputs.candidates))
    totals: dict[str, dict[str, np.ndarray]] = {}

    def add_powers(name: str, record: dict[str, Any]) -> None:
        for label, pair in record.items():
            by_label = totals.setdefault(label, {})
            by_label[name] = by_label.get(name, 0.0) + np.asarray(pair, np.float64)

    bf16_nll = []
    for start, logits in model.logits(
        inputs.ids_SxL,
        options.batch_size,
        tap=powers,
        aux=lambda i: _layer_weights(inputs, i),
        on_record=add_powers,
        label="bf16 logits",
    ):
        logits = np.asarray(logits)
        spool.write(start, logits)
        bf16_nll.append(metrics.next_token_nll(logits, inputs.ids_SxL[start : start + len(logits)]).ravel())
    bf16_ppl = metrics.perplexity(np.concatenate(bf16_nll))
    reference_tokens = _greedy("bf16", held, served_linear, prompts, options)
    del model, held
    memory.release()

    # 2. each candidate against the spooled reference
    models: dict[str, Any] = {"bf16": {"ppl": bf16_ppl}}
    kl_tokens: dict[str, np.ndarray] = {}
    divergence: dict[str, list[int | None]] = {}
    skipped = None if reference_tokens is not None else _skip_reason(inputs)
    for c in inputs.runs:
        stats = _LogitStats()
        model, held = _open_model(
            c.label,
            inputs,
            c.exported.stored_tensor_bytes(),
            lambda mesh, c=c: c.exported.model(VALIDATION_DTYPE, mesh),
            c.exported,
            c.exported.config,
        )
        kv_scales = c.exported.kv_aux if c.fp8_kv else None
        for start, logits in model.logits(
            inputs.ids_SxL,
            options.batch_size,
            tap=Plain(served_linear),
            aux=kv_scales,
            kv_tap=ServedKVTap() if c.fp8_kv else None,
            label=f"{c.label} logits",
        ):
            logits = np.asarray(logits)
            stats.add(spool.read(start, len(logits)), logits, inputs.ids_SxL[start : start + len(logits)])
        models[c.label], kl_tokens[c.label] = stats.summary(bf16_ppl)
        tokens = (
            _greedy(c.label, held, served_linear, prompts, options, c.exported.served_kv() if c.fp8_kv else default_kv)
            if skipped is None
            else None
        )
        if tokens is None:
            skipped = skipped or _skip_reason(inputs)
        else:
            divergence[c.label] = [metrics.first_divergence(r, t) for r, t in zip(reference_tokens, tokens)]
        del model, held
        memory.release()
    generation = Generation(
        prompts=int(len(prompts)),
        prompt_len=int(prompt_len),
        tokens=int(options.gen_tokens),
        first_divergence={} if skipped else divergence,
        skipped=skipped,
    )
    if skipped:
        progress.info(f"greedy generation skipped: {skipped}")

    layers = layer_sqnr(inputs, totals)
    label = inputs.nvfp4.label
    flat_layers = [
        {
            "name": r.name,
            **{f"{k}_weight_sqnr_db": v for k, v in r.weight_sqnr_db.items()},
            **{f"{k}_output_sqnr_db": v for k, v in r.output_sqnr_db.items()},
        }
        for r in layers
    ]
    thresholds = options.judged_by(inputs.nvfp4.exported.quant)
    failures = check_thresholds({"models": models, "layers": flat_layers}, thresholds, label=label)
    finite = [v[np.isfinite(v)] for v in kl_tokens.values()]
    top = max([1e-7, *(float(np.max(v)) for v in finite if v.size)]) * 1.0001
    return ValidationRecord(
        export=Named.of(inputs.export_dir, validated_files(inputs.export_dir)),
        quant=inputs.nvfp4.exported.quant,
        format=inputs.nvfp4.exported.format,
        source=Named.of(source.path, {f: sha256_file(f) for f in source.weight_files}),
        source_kind=source.kind,
        source_step=source.step,
        reference=inputs.reference,
        reference_export=inputs.reference_export,
        data=DataRef(
            file=Named.of(options.data, {options.data: sha256_file(options.data)}),
            sequences=int(inputs.ids_SxL.shape[0]),
            seq_len=int(inputs.ids_SxL.shape[1]),
            tokens=int(inputs.ids_SxL.size),
        ),
        models=models,
        layers=layers,
        generation=generation,
        kl_histogram={k: _histogram(v, top) for k, v in kl_tokens.items()},
        thresholds=dataclasses.asdict(thresholds),
        failures=[Failure(**f) for f in failures],
        passed=not failures,
        source_mismatch_ok=inputs.source_mismatch is not None,
        reference_calibration=inputs.reference_calibration,
        source_config_files=definition_hashes(source),
        searched=searched_target(inputs.export_dir),
    )


def searched_target(export_dir: str) -> SearchedTarget | None:
    """The target an `export --auto-precision` export was searched for (its auto_precision.json), None without one."""
    if not os.path.exists(AutoPrecisionRecord.path(export_dir)):
        return None
    found = AutoPrecisionRecord.read(export_dir)
    last = found.steps[-1]
    return SearchedTarget(
        kl_target=found.kl_target,
        margin=found.margin,
        calibration_kl=last.measured_kl,
        bits_per_weight=last.bits_per_weight,
        calibration_tokens=found.windows[0] * found.windows[1],
        kv_cache=found.kv_cache,
    )


def layer_sqnr(inputs: Inputs, output_powers: dict[str, dict[str, np.ndarray]]) -> list[LayerSQNR]:
    """Per quantized module of the NVFP4 export: weight and output SQNR (dB), worst output first.

    Output SQNR (from the BF16 pass's sums): at each quantized linear the BF16 model's own input
    went through both the BF16 GEMM and the candidate's served GEMM (quantized weight, and for
    W4A4 the fake-quantized input), so each layer's error is measured on real activations, in
    isolation (a candidate made from another fold of the source, `Candidate.model`, gets that
    input carried into its own model and is compared with its own model's output). Weight SQNR:
    the weight of the BF16 model the candidate quantized vs its decoded weight, one module at a time.
    """
    exported = inputs.nvfp4.exported
    rows = {
        m: LayerSQNR(
            name=m,
            weight_sqnr_db={},
            output_sqnr_db={},
            quant=exported.quant_of(m) if exported.quant == formats.MIXED else None,
        )
        for m in exported.quantized
    }
    for c in inputs.candidates:
        model = inputs.source.tensors if c.model is None else c.model
        for m, row in rows.items():
            if m in c.exported.quantized:
                row.weight_sqnr_db[c.label] = metrics.sqnr_db(model.get(f"{m}.weight"), c.exported.dequantized(m))
        for m, (signal, noise) in output_powers.get(c.label, {}).items():
            if m in rows:
                rows[m].output_sqnr_db[c.label] = metrics.sqnr_from_sums(float(signal), float(noise))
    label = inputs.nvfp4.label
    return sorted(rows.values(), key=lambda r: (r.output_sqnr_db.get(label, np.inf), r.name))


def source_tensor_bytes(source: Checkpoint) -> dict[str, int]:
    """{tensor name: bytes as stored} of the source's weights."""
    tensors = source.tensors
    return {n: tensor_bytes(tensors, n) for n in source.config.expected_tensor_shapes()}


def source_bytes(source: Checkpoint) -> int:
    """The source's weights as stored (what holding it costs)."""
    return sum(source_tensor_bytes(source).values())


# ------------------------------------------------------------------------------------------
# helpers


def _open_model(label: str, inputs: Inputs, stored: dict[str, int], build, source, config):
    """(a LayerwiseModel, the held CausalLM or None): held when the offload mode says so for its
    footprint (`Inputs.footprint` of its tensors as `stored`), over every device when there are
    several (`LayerwiseModel.open`)."""
    need = inputs.footprint(config, stored)
    model = LayerwiseModel.open(
        config,
        build=build,
        source=source,
        offload=inputs.options.offload,
        what=f"{label} ({need.weights / 1e9:.2f} GB as stored)",
        weights=need.weights,
        working=need.working,
        streamed=need.streamed,
        compute_dtype=VALIDATION_DTYPE,
    )
    inputs.ran[label] = "streamed" if model.streamed else "held"
    inputs.needs[label] = need
    return model, model.whole


def _greedy(
    label: str, held, linear, prompts: np.ndarray, options: ValidateOptions, kv: KVFn = default_kv
) -> np.ndarray | None:
    """Greedy continuations of the prompts by a held model (None for a streamed one), its stored
    weights decoded once where the memory allows (`simulate.for_generation`); progress per token."""
    if held is None:
        return None
    what = f"greedy generation ({label})"
    progress.info(f"{what}: {len(prompts)} prompts x {options.gen_tokens} tokens")
    model = for_generation(held, what)
    with progress.task(what, total=len(prompts) * options.gen_tokens, unit="token") as task:

        def advance(i: int, tokens_B, logits_BxV) -> None:
            tokens_B.block_until_ready()  # counted when computed, not when queued
            task.advance(len(prompts))

        tokens = greedy_continuations(model, linear, prompts, options.gen_tokens, kv, on_token=advance)
    return tokens


def _skip_reason(inputs: Inputs) -> str:
    streamed = [label for label, how in inputs.ran.items() if how == "streamed"]
    why = (
        "--offload always" if inputs.options.offload == "always" else "not enough memory to hold it in its stored dtype"
    )
    return f"{', '.join(streamed)} streamed layer by layer ({why}); greedy generation needs the whole model"


@dataclasses.dataclass(frozen=True)
class _OutputPowers:
    """Tap of the BF16 pass: the BF16 GEMM, and for each candidate whose weights `aux` holds for this
    layer, [sum y_bf16^2, sum (y_bf16 - y_served)^2] of its served GEMM on the same input (carried
    into the candidate's own model first when it folded other scales: `_Carried`)."""

    labels: tuple[str, ...]

    def __call__(self, x, w_NxK, b_N, *, name, aux):
        y = served_linear(x, w_NxK, b_N, name=name)  # the BF16 source's plain GEMM
        record, last = {}, y
        for label in self.labels:
            if name in (aux or {}).get(label, {}):
                mine = aux[label][name]
                y_ref, x_in, b_in = y, x, b_N
                if mine.x is not None:
                    x_in = (x.astype(jnp.float32) * mine.x).astype(x.dtype)
                if mine.y is not None:
                    y_ref = y.astype(jnp.float32) * mine.y
                    b_in = None if b_N is None else (b_N.astype(jnp.float32) * mine.y).astype(b_N.dtype)
                # one model's decoded weight at a time: this served GEMM runs after the last one
                last = computed_after(last, lambda x, w, b: served_linear(x, w, b, name=name), x_in, mine.w, b_in)
                y32, y_q = y_ref.astype(jnp.float32), last.astype(jnp.float32)
                record[label] = jnp.stack([jnp.sum(y32**2), jnp.sum((y32 - y_q) ** 2)])
        return y, (record or None)


class _Carried(NamedTuple):
    """A candidate's stored weight for the BF16 pass's tap, and the factors carrying the pass's
    input and output into the candidate's own model (`model.fold.carried`; None: the same)."""

    w: Any
    x: np.ndarray | None = None
    y: np.ndarray | None = None


def _layer_weights(inputs: Inputs, layer: int | None) -> dict[str, dict[str, _Carried]]:
    """{label: {name as the block program sees it: `_Carried`}} of layer `layer` (None: the LM
    head) for every candidate."""

    def weight(c: Candidate, m: str) -> _Carried:
        w = c.exported.get(f"{m}.weight")
        return _Carried(w) if c.model is None else _Carried(w, *carried(c.model, inputs.source.tensors, m))

    return {
        c.label: {name: weight(c, m) for name, m in layer_modules(c.exported.quantized, layer).items()}
        for c in inputs.candidates
    }


class _LogitStats:
    """Per-token KL / agreement / NLL and logit errors of one candidate, accumulated over batches."""

    def __init__(self) -> None:
        self.kl, self.agree, self.nll = [], [], []
        self.max_err, self.abs_err_sum, self.count = 0.0, 0.0, 0

    def add(self, ref: np.ndarray, logits: np.ndarray, ids: np.ndarray) -> None:
        self.kl.append(metrics.token_kl(ref, logits).ravel())
        self.agree.append(metrics.top1_agree(ref, logits).ravel())
        self.nll.append(metrics.next_token_nll(logits, ids).ravel())
        max_err, mean_err = metrics.logit_errors(ref, logits)
        self.max_err = max(self.max_err, max_err)
        self.abs_err_sum += mean_err * ref.size
        self.count += ref.size

    def summary(self, bf16_ppl: float) -> tuple[dict[str, float], np.ndarray]:
        kl = np.concatenate(self.kl)
        ppl = metrics.perplexity(np.concatenate(self.nll))
        return {
            "kl_mean": float(kl.mean()),
            "kl_p99": metrics.percentile(kl, 99),
            "top1": float(np.concatenate(self.agree).mean()),
            "ppl": ppl,
            "ppl_increase": ppl / bf16_ppl - 1.0,
            "logit_max_err": self.max_err,
            "logit_mean_err": self.abs_err_sum / max(self.count, 1),
        }, kl


def _histogram(values: np.ndarray, top: float) -> Histogram:
    """Counts of the finite KL values over log-spaced bins from 1e-8 nats to `top` (values below go
    into the first); every label shares `top`, so their bins line up. A non-finite KL fails the
    kl_mean threshold; it has no bin."""
    edges = np.geomspace(1e-8, top, KL_BINS + 1)
    counts, _ = np.histogram(np.clip(values[np.isfinite(values)], edges[0], edges[-1]), bins=edges)
    return Histogram(edges=edges.tolist(), counts=counts.tolist())


# how validate and eval open a --source: no --model-config (a MaxText --source must be converted to HF first)
VALIDATE_OPTIONS = dataclasses.replace(CLI_OPTIONS, path="--source {}", model_config=None)


def source_of(export_dir: str, source: str | None, record: ExportRecord | None) -> tuple[str, int | None]:
    """(the BF16 source's path, its step): `--source` (at the step the export's record names), else
    the source the provenance record names, found by its hashes."""
    if source is not None:
        return source, None if record is None or record.source.kind != "run" else record.source.step
    return locate_source(export_dir)


def _check_calib_data(options: ValidateOptions) -> None:
    """`--calib-data` only calibrates the FP8 reference made on the fly, and never on the evaluation
    text (the reference would be judged on its own calibration data)."""
    if options.calib_data is None:
        return
    if options.reference != "fp8":
        raise NVFP4UsageError(
            f"--calib-data {options.calib_data}: only calibrates the FP8 reference made on "
            f"the fly (--reference fp8); with --reference {options.reference} it would be unused"
        )
    if not os.path.isfile(options.calib_data):
        raise NVFP4UsageError(f"--calib-data {options.calib_data}: not a file")
    if sha256_file(options.calib_data) == sha256_file(options.data):
        raise NVFP4UsageError(
            f"--calib-data {options.calib_data}: the same data as --data {options.data}; "
            "calibrate the FP8 reference on other text than it is evaluated on"
        )


@dataclasses.dataclass(frozen=True)
class _Calibration:
    """How the on-the-fly FP8 reference gets its input scales."""

    calib_data: str | None = None  # calibrate on this file
    input_amax: dict[str, float] | None = None  # or take these (the W4A4 export's)
    what: str = ""  # said in the record; "" until the FP8 export says what it used


def _reference_calibration(
    options: ValidateOptions, record: ExportRecord | None, source: Checkpoint
) -> _Calibration | None:
    """What calibrates the FP8 reference (None: no FP8 reference is made): --calib-data, else a
    training run's tracked input amax, else the W4A4 export's own calibrated input amax (its
    provenance record), never the evaluation data. Nothing of these: exit 2 naming --calib-data."""
    if options.reference != "fp8":
        return None
    if options.calib_data is not None:
        return _Calibration(calib_data=options.calib_data)
    if source.kind == "run" and source.input_amax is not None:
        return _Calibration(what="the training run's tracked input amax")
    plan = make_plan(source.config, "fp8", precision_map=source.precision_map)
    calibrated = ("nvfp4", formats.MIXED)  # exports whose record holds calibrated input amax
    amax = record.input_amax if record is not None and record.quant in calibrated and record.input_amax else {}
    if plan.quantized and all(m in amax and np.isfinite(amax[m]) and amax[m] > 0 for m in plan.quantized):
        calibrated = f"calibrated on `{record.calibration.file}`" if record.calibration else record.input_amax_origin
        return _Calibration(
            input_amax={m: float(amax[m]) for m in plan.quantized}, what=f"the export's input amax ({calibrated})"
        )
    why = (
        f"a {record.quant if record is not None else 'weight-only'} export carries no input scales"
        if record is None or record.quant not in calibrated
        else "the export's provenance record has no usable input amax for every linear"
    )
    raise NVFP4UsageError(
        f"--reference fp8 makes an FP8 reference that needs calibration data ({why}); pass "
        "--calib-data PATH (calibration text, not the --data evaluation text), or "
        "--reference bf16 / an FP8 export folder"
    )


@contextlib.contextmanager
def _scratch() -> Iterator[str]:
    """This validation's scratch folder (the BF16 logits spool, an FP8 export made on the fly):
    `nvfp4tool-validate-*` in the system temporary folder, marked with this process's pid
    (`atomic.scratch_dir`, which removes those of killed runs first); removed on exit, also when a
    signal ends the run (the CLI turns SIGTERM into an exception)."""
    folder = scratch_dir(SCRATCH_PREFIX)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _reference(
    options: ValidateOptions,
    source: Checkpoint,
    scratch: str,
    calibration: _Calibration | None,
    equalization: EqualizationRecord | None = None,
) -> tuple[Candidate | None, str, Named | None, str | None]:
    """(the FP8 candidate or None, what it is, the --reference folder named and hashed, what
    calibrated its input scales). Made on the fly for an equalized export, it folds the export's
    recorded scales too (`equalization`), so both quantize the same model."""
    if options.reference == "bf16":
        return None, "bf16", None, None
    if options.reference != "fp8":
        candidate = Candidate.load(options.reference, label="fp8")
        if candidate.exported.quant != "fp8":
            raise NVFP4ToolError(
                f"{options.reference}: a {candidate.exported.quant} export, "
                "not an FP8 one (--reference wants an `export --quant fp8` folder)"
            )
        return (
            candidate,
            "fp8 export",
            Named.of(options.reference, validated_files(options.reference)),
            _calibration_of(options.reference),
        )
    from nvfp4tool.export import export_checkpoint

    assert calibration is not None
    progress.info("making the FP8 reference (export --quant fp8)")
    out = os.path.join(scratch, "fp8")
    export_checkpoint(
        source.path,
        out,
        ExportOptions(
            quant="fp8",
            step=source.step,
            calib_data=calibration.calib_data,
            calib_samples=options.calib_samples,
            calib_seq_len=options.calib_seq_len,
            input_amax=calibration.input_amax,
            offload=options.offload,
            equalize=equalization.method if equalization else "none",
            equalization=equalization,
        ),
    )
    memory.release()
    return (
        Candidate.load(out, label="fp8"),
        "fp8 (exported on the fly from the source)",
        None,
        calibration.what or _calibration_of(out),
    )


def _model_of(candidate: Candidate, equalization, unfolded, source: Checkpoint):
    """The BF16 model `candidate` quantized: the validation's source model when its export folded
    the same scales as the validated export (`equalization`), else the unfolded source folded by
    its own recorded scales (an FP8 `--reference` export made without `--equalize`: the plain
    source), so its per-layer SQNR compares it with what it was made from."""
    folder = candidate.exported.folder
    own = ExportRecord.read(folder).equalization if ExportRecord.exists(folder) else None
    if own == equalization:
        return None
    return unfolded if own is None else EqualizedSource.from_record(unfolded, own, source.config)


def _calibration_of(fp8_export: str) -> str | None:
    """What calibrated an FP8 export's input scales, from its provenance record (None without one)."""
    if not ExportRecord.exists(fp8_export):
        return None
    record = ExportRecord.read(fp8_export)
    found = record.calibration
    if found is None:
        return record.input_amax_origin
    return f"calibration data `{found.file}` (sha256 {found.sha256[:12]}..., {found.samples} x {found.seq_len} tokens)"
