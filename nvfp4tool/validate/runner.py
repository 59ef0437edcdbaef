"""Run the BF16 source, the FP8 reference and the NVFP4 export on the same token batches.

    record = run_validation("out/m-nvfp4", ValidateOptions(data="val.txt", reference="fp8"))
    record.models["nvfp4"]["kl_mean"], record.failures, record.passed   # a ValidationRecord
    run = validate_export("out/m-nvfp4", options, json_copy="v.json")  # + validation.json etc.

The NVFP4 export runs as served (`export.simulate`: weights decoded from the stored bytes, W4A4
inputs fake-quantized with the stored input scale). The BF16 source is found through the export's
provenance record (or `source=`). The FP8 reference is an FP8 export folder (`reference=PATH`), or
made on the fly from the source by `nvfp4tool export --quant fp8` into a temporary folder and run
through the same simulation (`reference="fp8"`); `reference="bf16"` compares against BF16 only.
Every model computes in fp32 on its (dequantized) weights, so the only differences are the ones
quantization makes. The source is opened by `nvfp4tool.checkpoints`; the record names the export,
the source, the reference and the data by Hub id or folder / file name plus sha256 (never a local
path: it is published with the export). Progress goes through `nvfp4tool.progress`.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nvfp4tool import progress
from nvfp4tool.checkpoints import CLI_OPTIONS, Checkpoint, open_checkpoint
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError
from nvfp4tool.export.provenance import locate_source
from nvfp4tool.records.export import sha256_file
from nvfp4tool.export.simulate import ExportedModel, load_export
from nvfp4tool.model import default_linear, forward
from nvfp4tool.records.validation import (DataRef, Failure, Generation, Histogram, LayerSQNR, Named,
                                          ValidationRecord)
from nvfp4tool.validate import metrics
from nvfp4tool.validate.generation import greedy_continuations
from nvfp4tool.validate.thresholds import Thresholds, check_thresholds

KL_BINS = 40  # log-spaced bins of the per-token KL histogram


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
    thresholds: Thresholds = Thresholds()


@dataclasses.dataclass
class Candidate:
    """A quantized model as served: the export read back, its model and its LinearFn."""

    label: str  # "nvfp4" / "fp8"
    exported: ExportedModel
    model: Any
    linear: Any

    @classmethod
    def load(cls, folder: str, label: str | None = None) -> Candidate:
        """The export in `folder` as served; refused (exit 1, its first problem) if `check` fails,
        so validate never reports numbers for a checkpoint no engine should load."""
        from nvfp4tool.check import check_checkpoint

        report = check_checkpoint(folder)
        if not report.ok:
            raise NVFP4ToolError(report.failure("not validated"))
        exported = load_export(folder)
        return cls(label or exported.quant, exported, exported.model(dtype=jnp.float32), exported.linear())

    def weights(self) -> dict[str, jax.Array]:
        """{quantized module: its dequantized fp32 weight [N, K]}."""
        return {m: jnp.asarray(self.exported.tensors[f"{m}.weight"], jnp.float32)
                for m in self.exported.quantized}


@dataclasses.dataclass
class Loaded:
    """Everything a validation (or a sensitivity search) runs on."""

    export_dir: str
    source: Checkpoint  # the BF16 source, opened
    bf16_model: Any
    bf16_weights: dict[str, jax.Array]  # {linear module: fp32 weight} of the source
    nvfp4: Candidate
    fp8: Candidate | None
    reference: str  # what the FP8 column is (see ValidationRecord.reference)
    reference_export: Named | None  # the --reference folder, named and hashed
    ids_SxL: np.ndarray


@dataclasses.dataclass(frozen=True)
class ValidationRun:
    """What `validate_export` did: the record, the files it wrote, the source's local path (for
    the commands it suggests; never saved)."""

    record: ValidationRecord
    files: list[str]
    source_path: str


def load_models(export_dir: str, options: ValidateOptions) -> Loaded:
    """Load the export, its BF16 source, the FP8 reference and the token batches."""
    from nvfp4tool.export.calibrate import load_calibration_ids
    from nvfp4tool.model.weights import model_from_tensors

    for flag, value in (("--samples", options.samples), ("--seq-len", options.seq_len),
                        ("--batch-size", options.batch_size), ("--prompts", options.prompts),
                        ("--prompt-len", options.prompt_len), ("--gen-tokens", options.gen_tokens)):
        if value < 1:
            raise NVFP4UsageError(f"{flag} must be >= 1, got {value}")
    if options.reference not in ("fp8", "bf16") and not os.path.isdir(options.reference):
        raise NVFP4ToolError(f"--reference {options.reference}: not fp8, bf16 or an export folder")
    progress.info(f"loading {export_dir}")
    nvfp4 = Candidate.load(export_dir)
    if not nvfp4.exported.quantized:
        raise NVFP4ToolError(f"{export_dir}: no quantized linear modules (everything is BF16): nothing to validate")
    if nvfp4.exported.quant == "fp8" and options.reference != "bf16":
        raise NVFP4ToolError(f"{export_dir}: an FP8 export; validate it with --reference bf16")
    source_path, step = _source_of(export_dir, options.source)
    progress.info(f"loading the BF16 source {source_path}")
    source = open_checkpoint(source_path, step=step, options=_VALIDATE_OPTIONS)
    bf16_model = model_from_tensors(source.config, source.tensors, dtype=jnp.float32)
    bf16_weights = {m: jnp.asarray(source.tensors.get(f"{m}.weight"), jnp.float32)
                    for m in nvfp4.exported.quantized}
    tokenizer_dir = export_dir if os.path.isfile(os.path.join(export_dir, "tokenizer.json")) else source.aux_dir
    ids = load_calibration_ids(options.data, samples=options.samples, seq_len=options.seq_len,
                               tokenizer_dir=tokenizer_dir, vocab_size=nvfp4.exported.config.vocab_size,
                               flags=("--samples", "--seq-len"))
    fp8, reference, reference_export = _reference(options, source)
    return Loaded(export_dir=export_dir, source=source, bf16_model=bf16_model, bf16_weights=bf16_weights,
                  nvfp4=nvfp4, fp8=fp8, reference=reference, reference_export=reference_export, ids_SxL=ids)


def validate_export(export_dir: str, options: ValidateOptions, *, json_copy: str | None = None,
                    kl_target: float | None = None) -> ValidationRun:
    """Validate, optionally search the layers to keep in BF16 (`kl_target`), write the reports
    (validation.json / .md and the plots into the export, a copy of the JSON at `json_copy`)."""
    from nvfp4tool.validate.report import write_reports
    from nvfp4tool.validate.sensitivity import sensitivity

    if json_copy is not None and not os.path.isdir(os.path.dirname(os.path.abspath(json_copy))):
        raise NVFP4UsageError(f"--json {json_copy}: its folder does not exist")
    loaded = load_models(export_dir, options)
    record = run_validation(export_dir, options, loaded)
    if kl_target is not None:
        record = dataclasses.replace(record, sensitivity=sensitivity(
            loaded, kl_target=kl_target, batch_size=options.batch_size))
    files = write_reports(record, export_dir, json_copy)
    return ValidationRun(record=record, files=files, source_path=loaded.source.path)


def run_validation(export_dir: str, options: ValidateOptions, loaded: Loaded | None = None) -> ValidationRecord:
    """The validation record; `passed` is False if a threshold fails. <label> below is the
    export's quant ("nvfp4", "nvfp4-weight-only") and "fp8": models {bf16: {ppl}, <label>:
    {kl_mean, kl_p99, top1, ppl, ppl_increase, logit_max_err, logit_mean_err}}, layers (weight and
    output SQNR per label, worst output first), generation (first divergence per prompt and
    label), kl_histogram, thresholds, failures [metric, value, limit, by, detail], passed.
    """
    loaded = loaded or load_models(export_dir, options)
    candidates = [c for c in (loaded.nvfp4, loaded.fp8) if c is not None]
    batches = [loaded.ids_SxL[i:i + options.batch_size]
               for i in range(0, len(loaded.ids_SxL), options.batch_size)]

    stats = {c.label: _LogitStats() for c in candidates}
    bf16_nll = []
    with progress.task("logits", total=len(batches), unit="batch") as task:
        for ids in batches:
            ref = np.asarray(forward(loaded.bf16_model, ids))
            bf16_nll.append(metrics.next_token_nll(ref, ids).ravel())
            for c in candidates:
                stats[c.label].add(ref, np.asarray(forward(c.model, ids, linear=c.linear)), ids)
            task.advance()
    bf16_ppl = metrics.perplexity(np.concatenate(bf16_nll))
    models: dict[str, Any] = {"bf16": {"ppl": bf16_ppl}}
    kl_tokens: dict[str, np.ndarray] = {}
    for c in candidates:
        models[c.label], kl_tokens[c.label] = stats[c.label].summary(bf16_ppl)

    progress.info("per-layer SQNR")
    layers = layer_sqnr(loaded, candidates, batches)

    progress.info(f"greedy generation: {options.prompts} prompts x {options.gen_tokens} tokens")
    generation = _generation(loaded, candidates, options)

    label = loaded.nvfp4.label
    flat_layers = [{"name": r.name, **{f"{k}_weight_sqnr_db": v for k, v in r.weight_sqnr_db.items()},
                    **{f"{k}_output_sqnr_db": v for k, v in r.output_sqnr_db.items()}} for r in layers]
    failures = check_thresholds({"models": models, "layers": flat_layers}, options.thresholds, label=label)
    finite = [v[np.isfinite(v)] for v in kl_tokens.values()]
    top = max([1e-7, *(float(np.max(v)) for v in finite if v.size)]) * 1.0001
    return ValidationRecord(
        export=Named.of(export_dir, _folder_hashes(export_dir)),
        quant=loaded.nvfp4.exported.quant,
        format=loaded.nvfp4.exported.format,
        source=Named.of(loaded.source.path, {f: sha256_file(f) for f in loaded.source.weight_files}),
        source_kind=loaded.source.kind,
        source_step=loaded.source.step,
        reference=loaded.reference,
        reference_export=loaded.reference_export,
        data=DataRef(file=Named.of(options.data, {options.data: sha256_file(options.data)}),
                     sequences=int(loaded.ids_SxL.shape[0]), seq_len=int(loaded.ids_SxL.shape[1]),
                     tokens=int(loaded.ids_SxL.size)),
        models=models,
        layers=layers,
        generation=generation,
        kl_histogram={k: _histogram(v, top) for k, v in kl_tokens.items()},
        thresholds=dataclasses.asdict(options.thresholds),
        failures=[Failure(**f) for f in failures],
        passed=not failures,
    )


def layer_sqnr(loaded: Loaded, candidates: list[Candidate], batches: list[np.ndarray]) -> list[LayerSQNR]:
    """Per quantized module of the NVFP4 export: weight and output SQNR (dB), worst output first.

    Output SQNR: the BF16 model runs on the batches; at each quantized linear its own input goes
    through both the BF16 GEMM and the candidate's served GEMM (quantized weight, and for W4A4 the
    fake-quantized input), so each layer's error is measured on real activations, in isolation.
    """
    rows = {m: LayerSQNR(name=m, weight_sqnr_db={}, output_sqnr_db={}) for m in loaded.nvfp4.exported.quantized}
    graphdef, state = nnx.split(loaded.bf16_model)
    for c in candidates:
        weights = c.weights()
        for m, row in rows.items():
            if m in weights:
                row.weight_sqnr_db[c.label] = metrics.sqnr_db(loaded.bf16_weights[m], weights[m])
        powers = _output_power_fn(graphdef, c.linear)
        totals: dict[str, np.ndarray] = {}
        for ids in batches:
            for m, sums in powers(state, weights, jnp.asarray(ids)).items():
                totals[m] = totals.get(m, 0.0) + np.asarray(sums, np.float64)
        for m, (signal, noise) in totals.items():
            if m in rows:
                rows[m].output_sqnr_db[c.label] = metrics.sqnr_from_sums(float(signal), float(noise))
    label = loaded.nvfp4.label
    return sorted(rows.values(), key=lambda r: (r.output_sqnr_db.get(label, np.inf), r.name))


# ------------------------------------------------------------------------------------------
# helpers


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
        return {"kl_mean": float(kl.mean()), "kl_p99": metrics.percentile(kl, 99),
                "top1": float(np.concatenate(self.agree).mean()), "ppl": ppl,
                "ppl_increase": ppl / bf16_ppl - 1.0, "logit_max_err": self.max_err,
                "logit_mean_err": self.abs_err_sum / max(self.count, 1)}, kl


def _output_power_fn(graphdef, candidate_linear):
    """jit(state, weights, ids) -> {module: [sum y_bf16^2, sum (y_bf16 - y_served)^2]}."""

    def powers(state, weights, ids_BxT):
        sums: dict[str, jax.Array] = {}

        def linear(x, w_NxK, b_N, *, name):
            y = default_linear(x, w_NxK, b_N, name=name)
            if name in weights:
                y_q = candidate_linear(x, weights[name], b_N, name=name)
                y32 = y.astype(jnp.float32)
                pair = jnp.stack([jnp.sum(y32 ** 2), jnp.sum((y32 - y_q.astype(jnp.float32)) ** 2)])
                sums[name] = sums[name] + pair if name in sums else pair
            return y

        forward(nnx.merge(graphdef, state), ids_BxT, linear=linear)
        return sums

    return jax.jit(powers)


def _generation(loaded: Loaded, candidates: list[Candidate], options: ValidateOptions) -> Generation:
    prompt_len = min(options.prompt_len, loaded.ids_SxL.shape[1])
    prompts = loaded.ids_SxL[:options.prompts, :prompt_len]
    ref = greedy_continuations(loaded.bf16_model, None, prompts, options.gen_tokens)
    divergence = {}
    for c in candidates:
        tokens = greedy_continuations(c.model, c.linear, prompts, options.gen_tokens)
        divergence[c.label] = [metrics.first_divergence(r, t) for r, t in zip(ref, tokens)]
    return Generation(prompts=int(len(prompts)), prompt_len=int(prompt_len), tokens=int(options.gen_tokens),
                      first_divergence=divergence)


def _histogram(values: np.ndarray, top: float) -> Histogram:
    """Counts of the finite KL values over log-spaced bins from 1e-8 nats to `top` (values below go
    into the first); every label shares `top`, so their bins line up. A non-finite KL fails the
    kl_mean threshold; it has no bin."""
    edges = np.geomspace(1e-8, top, KL_BINS + 1)
    counts, _ = np.histogram(np.clip(values[np.isfinite(values)], edges[0], edges[-1]), bins=edges)
    return Histogram(edges=edges.tolist(), counts=counts.tolist())


def _folder_hashes(folder: str) -> dict[str, str]:
    """{file: sha256} of an export's files, without the reports validate writes into it."""
    from nvfp4tool.validate.report import REPORT_FILES

    return {os.path.join(folder, f): sha256_file(os.path.join(folder, f)) for f in sorted(os.listdir(folder))
            if f not in REPORT_FILES and os.path.isfile(os.path.join(folder, f))}


# validate takes no --model-config: a MaxText --source must be converted to HF first
_VALIDATE_OPTIONS = dataclasses.replace(CLI_OPTIONS, path="--source {}", model_config=None)


def _source_of(export_dir: str, source: str | None) -> tuple[str, int | None]:
    """(the BF16 source's path, its step): `--source`, else the export's provenance record."""
    if source is not None:
        return source, None
    return locate_source(export_dir)


def _reference(options: ValidateOptions, source: Checkpoint) -> tuple[Candidate | None, str, Named | None]:
    """(the FP8 candidate or None, what it is, the --reference folder named and hashed)."""
    if options.reference == "bf16":
        return None, "bf16", None
    if options.reference != "fp8":
        candidate = Candidate.load(options.reference, label="fp8")
        if candidate.exported.quant != "fp8":
            raise NVFP4ToolError(f"{options.reference}: a {candidate.exported.quant} export, "
                                 "not an FP8 one (--reference wants an `export --quant fp8` folder)")
        return candidate, "fp8 export", Named.of(options.reference, _folder_hashes(options.reference))
    from nvfp4tool.export import ExportOptions, export_checkpoint

    progress.info("making the FP8 reference (export --quant fp8)")
    # A training run brings its tracked input amax; other sources calibrate on the data.
    calib = None if source.kind == "run" else options.data
    with tempfile.TemporaryDirectory(prefix="nvfp4tool-fp8-") as tmp:
        out = os.path.join(tmp, "fp8")
        export_checkpoint(source.path, out, ExportOptions(
            quant="fp8", step=source.step, calib_data=calib, calib_samples=options.samples,
            calib_seq_len=options.seq_len, show_progress=False))
        return Candidate.load(out, label="fp8"), "fp8 (exported on the fly from the source)", None
