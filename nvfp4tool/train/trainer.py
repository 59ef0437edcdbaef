"""`nvfp4tool train`: the training loop (pretraining from scratch or fine-tuning a checkpoint).

    result = train(load_train_config("run.yaml", ["recipe=nvfp4", "steps=60"]))

Nothing is created before the whole job is known to be runnable (`_prepare`); a resume continues
bit-exactly or is refused. A step's metrics are read after the next step is dispatched. The run
folder holds run.json, metrics.jsonl, loss.png, checkpoints/<step>, hf/ (and maxtext/).
Design notes: docs/design/training.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from converters.atomic import atomic_output_dir, check_output_path
from nvfp4tool import progress
from nvfp4tool.checkpoints import (
    TEACHER_OPTIONS,
    TRAIN_OPTIONS,
    Checkpoint,
    open_checkpoint,
    resolve_rope_layout,
    run_steps,
)
from nvfp4tool.config import ModelConfig
from nvfp4tool.corpus import loader as loader_lib
from nvfp4tool.corpus.cache import TokenCache, is_cache, manifest_sha256, open_cache
from nvfp4tool.corpus.chat import FORMATS as SFT_FORMATS
from nvfp4tool.corpus.chat import SftCounts, SftEncoder, sft_options
from nvfp4tool.corpus.encode import EncodedBatch, encode_documents
from nvfp4tool.corpus.sources import data_sha256, iter_documents, iter_rows
from nvfp4tool.corpus.tokenizer import (
    TextTokenizer,
    load_tokenizer,
    save_tokenizer,
    tokenizer_sha256,
    train_bpe_tokenizer,
)
from nvfp4tool.corpus.windows import Windows, windows_in_memory
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError
from nvfp4tool.families import LM_HEAD, layer_index, layer_prefix
from nvfp4tool.formats.precision_file import PrecisionRule, format_precision_file, precision_rules
from nvfp4tool.model import CausalLM, ModelTensorSource, model_from_tensors
from nvfp4tool.model import sharding as mesh_lib
from nvfp4tool.model.fold import EqualizedSource
from nvfp4tool.recipes.precision import RecipeConfig, check_block_widths, precision_map
from nvfp4tool.records.corpus import CorpusManifest, CorpusSft
from nvfp4tool.records.export import EqualizationRecord, ExportRecord, SourceRecord, first_file_difference
from nvfp4tool.run.config import NEW_RUN_PACKING, TrainConfig, scans_layers
from nvfp4tool.run.records import (
    CHECKPOINTS_DIR,
    PRECISION_FILE,
    TOKENIZER_DIR,
    WEIGHTS_DIR,
    InputAmaxRecord,
    PrecisionMapRecord,
    RunRecord,
)
from nvfp4tool.train.checkpoint import Checkpoints, abstract_like
from nvfp4tool.train.distill import Distillation
from nvfp4tool.train.metrics import append_metrics, plot_runs, step_header, truncate_metrics
from nvfp4tool.train.presets import PRESETS, preset_config
from nvfp4tool.train.step import StepFns, make_optimizer, make_schedule

# Keys a resume may change: they do not touch the training math (the data, the tokenizer and the
# teacher are compared by content instead of by path).
RESUME_FREE_KEYS = frozenset(
    {
        "out",
        "resume",
        "force",
        "eval_every",
        "eval_batches",
        "checkpoint_every",
        "keep_checkpoints",
        "export_maxtext",
        "coordinator_address",
        "process_id",
        "data",
        "eval_data",
        "tokenizer",
        "teacher",
        "equalize_from",
        "loader_threads",
        "loader_prefetch",
    }
)


@dataclasses.dataclass
class TrainResult:
    """What a run produced."""

    out: Path
    losses: dict[int, float]  # step -> train loss (the steps this call ran)
    eval_losses: dict[int, float]
    final_step: int
    hf_dir: Path | None
    tokens_per_s: float


@dataclasses.dataclass
class _Prepared:
    """Everything checked and loaded before the run folder is touched."""

    record: RunRecord  # the run record (a resume: the one on disk)
    tokenizer: TextTokenizer
    save_tokenizer: bool  # trained here: save it into the run folder
    source: Checkpoint | None  # the opened model (None: a preset size from scratch)
    model_config: ModelConfig
    model: CausalLM
    teacher: CausalLM | None  # a distillation run's teacher (BF16)
    loader: loader_lib.Loader  # this process's rows of every training batch
    eval_windows: Windows | loader_lib.ConcatWindows
    recipe: RecipeConfig
    pmap: dict[str, str]
    mesh: Any
    resume_step: int | None  # the checkpoint a resume continues from (None: from the start)


def train(config: TrainConfig) -> TrainResult:
    """Run (or resume) the training job `config` and write its outputs under `config.out`."""
    _init_distributed(config)
    out = Path(config.out)
    is_main = jax.process_index() == 0
    job = _prepare(config, out)  # every check; nothing written yet
    _barrier("prepared")
    model_config, recipe, pmap, mesh = job.model_config, job.recipe, job.pmap, job.mesh
    switch_step = recipe.switch_step(config.steps)

    schedule = make_schedule(
        config.schedule,
        lr=config.lr,
        steps=config.steps,
        warmup_steps=config.warmup_steps,
        min_lr_ratio=config.min_lr_ratio,
        decay_fraction=config.decay_fraction,
    )
    optimizer = make_optimizer(
        schedule,
        weight_decay=config.weight_decay,
        beta1=config.beta1,
        beta2=config.beta2,
        eps=config.eps,
        clip_norm=config.clip_norm,
    )
    graphdef, params = nnx.split(job.model)
    distill, teacher = None, None
    if job.teacher is not None:
        teacher_graphdef, teacher_params = nnx.split(job.teacher)
        distill = Distillation(teacher_graphdef, config.temperature, config.distill_weight)
        host_teacher = teacher_params.to_pure_dict()
        teacher = mesh_lib.place_state(host_teacher, mesh_lib.state_shardings(mesh, host_teacher))
        del teacher_params, host_teacher
    fns = StepFns(graphdef, recipe, pmap, optimizer, config.grad_accum, distill)
    host_state = fns.init_state(params.to_pure_dict(), config.amax_history)
    shardings = mesh_lib.state_shardings(mesh, host_state)
    start_step, checkpoints = 0, None
    batches = job.loader.iterator()
    if job.resume_step is not None:  # the run folder exists: opening its checkpoints changes nothing
        checkpoints = Checkpoints(out, config.keep_checkpoints)
        restored, _, has_loader = checkpoints.restore(
            job.resume_step, abstract_like(host_state, shardings), loader=batches
        )
        start_step = job.resume_step
        if not has_loader:  # a checkpoint written before the loader's state was: its step is the position
            batches = job.loader.iterator(start=start_step)
        if loader_lib.next_index(batches) != start_step:
            raise NVFP4ToolError(
                f"{out / CHECKPOINTS_DIR / str(start_step)}: its loader state is at batch "
                f"{loader_lib.next_index(batches)}, not at its step {start_step}"
            )
    if is_main:
        _write_start(out, config, job)
        if config.resume:
            truncate_metrics(out, start_step)
            progress.info(
                f"resumed from {out / CHECKPOINTS_DIR / str(start_step)}"
                if start_step
                else f"{out}: no checkpoint yet; restarting the run from step 0"
            )
        progress.info(precision_summary(pmap, recipe.name, model_config.router_names()))
        _report_backend(recipe, config)
    _barrier("started")
    state = restored if job.resume_step is not None else mesh_lib.place_state(host_state, shardings)
    checkpoints = checkpoints or Checkpoints(out, config.keep_checkpoints)
    eval_windows = job.eval_windows
    tokenizer, source = job.tokenizer, job.source
    del host_state, params, job

    metric_sharding = mesh_lib.replicated(mesh)
    step_fn = jax.jit(
        _skipping_nonfinite(fns.train_step) if config.on_nonfinite == "skip" else fns.train_step,
        static_argnames="bf16_scope",
        donate_argnums=(),
        out_shardings=(shardings, metric_sharding),
    )
    eval_fn = jax.jit(fns.eval_metrics, static_argnames="bf16_scope", out_shardings=metric_sharding)
    batch_sharding = mesh_lib.batch_sharding(mesh, 3, batch_axis=1)
    batch_shape = (config.grad_accum, config.batch_size // config.grad_accum, config.seq_len + 1)
    eval_sharding = mesh_lib.batch_sharding(mesh, 2, batch_axis=0)
    tokens_per_step = config.batch_size * config.seq_len
    base_key = jax.random.key(config.seed)
    backend = recipe.backend()  # the GEMM path every step runs (metrics.jsonl records it per step)

    # A step's metrics stay on the device until the next step has been dispatched: `finish` reads
    # them then (so the device never waits for the host between steps), checks them and writes the
    # step's record. A step that evaluates or checkpoints (and the last) is finished at once, as is
    # the one before a step that compiles (so no step's time holds a compilation).
    losses, eval_losses = {}, {}
    run_start, run_tokens = time.perf_counter(), 0
    last_done = run_start  # when the last finished step's results were read
    compiled: set[tuple] = set()  # (BF16 scope, batch shape) of the step programs compiled so far

    def finish(done_step: _RunningStep, state, task) -> None:
        """Read step `done_step`'s metrics (waiting for it), stop on a non-finite one (or record it
        skipped), evaluate / checkpoint `state` (the state after it) where due, log the record."""
        nonlocal last_done, run_tokens
        step, metrics = done_step.step, jax.device_get(done_step.metrics)  # waits for the step
        done = time.perf_counter()
        step_time = done - max(done_step.dispatched, last_done)  # from when it could start on the device
        last_done = done
        loss, grad_norm, finite = (float(metrics["loss"]), float(metrics["grad_norm"]), bool(metrics["finite"]))
        record = {
            **step_header(step, backend),
            "loss": loss,
            "lr": float(done_step.lr),
            "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_step / step_time,
            "step_time_s": step_time,
        }
        if "aux_loss" in metrics:  # an MoE model: the routers' load-balancing loss (unweighted)
            record["aux_loss"] = float(metrics["aux_loss"])
        if distill is not None:  # the KL to the teacher, and the next-token CE when mixed in
            record["kl"] = float(metrics["kl"])
            if distill.weight < 1:
                record["ce"] = float(metrics["ce"])
        if not finite:
            if config.on_nonfinite == "stop":
                last = checkpoints.latest_step()
                raise NVFP4ToolError(
                    f"step {step}: non-finite loss ({loss}) or gradient norm ({grad_norm}); "
                    f"stopped. Last good checkpoint: "
                    f"{out / CHECKPOINTS_DIR / str(last) if last is not None else 'none'} "
                    "(set on_nonfinite=skip to skip such steps)"
                )
            record["skipped"] = True  # the step program kept the state before it (_skipping_nonfinite)
        losses[step] = loss
        run_tokens += tokens_per_step
        if _due(step, config.eval_every, config.steps):
            evaluated = _evaluate(
                eval_fn, state["params"], teacher, eval_windows, config, eval_sharding, mesh, done_step.scope
            )
            record.update({f"eval_{name}": value for name, value in evaluated.items()})
            eval_losses[step] = record["eval_loss"]
        if is_main:
            append_metrics(out, record)
        if _due(step, config.checkpoint_every, config.steps):
            checkpoints.save(
                step,
                state,
                {"step": step, "seed": config.seed, "batches_seen": step, "config": config.to_dict()},
                loader=batches,
            )
        extra = {
            name: f"{record[key]:.4f}"
            for name, key in (("aux", "aux_loss"), ("kl", "kl"), ("ce", "ce"))
            if key in record
        }
        task.advance(fields={"loss": f"{loss:.4f}", **extra, "tokens/s": f"{record['tokens_per_s']:,.0f}"})

    with progress.task("train", total=config.steps - start_step, unit="step") as task:
        pending = None  # the step dispatched last and not finished yet (never one that is due)
        try:
            for step in range(start_step + 1, config.steps + 1):
                scope = _bf16_scope(step, switch_step, recipe.switch_scope)
                # this process's rows, tokens with their segments / loss marks, as micro-batches
                rows = jax.tree.map(lambda a: a.reshape(config.grad_accum, -1, config.seq_len + 1), next(batches))
                if pending is not None and (scope, rows.tokens.shape) not in compiled:
                    done_step, pending = pending, None
                    finish(done_step, None, task)
                dispatched = time.perf_counter()
                lr = schedule(step - 1)  # on the device, read with the step's metrics
                with progress.compiling(
                    _compile_label("train step", scope), key=(step_fn, scope, rows.tokens.shape)
                ):  # the first step of a scope compiles
                    state, metrics = step_fn(
                        state,
                        jax.tree.map(lambda a: mesh_lib.from_process_rows(a, batch_sharding, batch_shape), rows),
                        jax.random.fold_in(base_key, step),
                        bf16_scope=scope,
                        teacher=teacher,
                    )
                compiled.add((scope, rows.tokens.shape))
                if pending is not None:  # the step before, now that this one is queued behind it
                    done_step, pending = pending, None
                    finish(done_step, None, task)
                pending = _RunningStep(step, scope, metrics, lr, dispatched)
                if _due(step, config.eval_every, config.steps) or _due(step, config.checkpoint_every, config.steps):
                    done_step, pending = pending, None
                    finish(done_step, state, task)
        except BaseException:
            if pending is not None:  # the step before the failure still gets its record, if it can
                with contextlib.suppress(Exception):
                    finish(pending, None, task)
            raise
    jax.block_until_ready(state)  # the run's time ends when its last update has been computed
    elapsed = time.perf_counter() - run_start
    checkpoints.close()
    batches.close()  # the loader's read-ahead threads

    hf_dir = None
    if is_main:
        if losses:
            plot_runs([out], out / "loss.png")
        hf_dir = _write_final(out, config, model_config, graphdef, state, pmap, tokenizer, source)
    return TrainResult(
        out=out,
        losses=losses,
        eval_losses=eval_losses,
        final_step=config.steps,
        hf_dir=hf_dir,
        tokens_per_s=run_tokens / max(elapsed, 1e-9),
    )


# ------------------------------------------------------------------------------------------
# setup: every check before anything is written


def _init_distributed(config: TrainConfig) -> None:
    if config.num_processes > 1 and not jax.distributed.is_initialized():
        if config.coordinator_address is None:
            raise NVFP4ToolError("num_processes > 1 needs coordinator_address=host:port")
        jax.distributed.initialize(
            coordinator_address=config.coordinator_address,
            num_processes=config.num_processes,
            process_id=config.process_id,
        )


def _prepare(config: TrainConfig, out: Path) -> _Prepared:
    """Check and load everything the run needs, in the order a user's mistakes are best reported;
    reads only (a tokenizer trained here lives in memory until `_write_start`)."""
    config.check_paths()
    recipe = config.resolved_recipe()  # quantizer / gemm resolved once (gemm=native refused here where it cannot run)
    _check_out(config, out)
    saved = RunRecord.read(out) if config.resume else None
    config = dataclasses.replace(config, packing=config.packing or (saved.packing if saved else NEW_RUN_PACKING))
    if saved is not None:
        _check_same_config(saved, config, out)
    source = None
    if config.model not in PRESETS:
        source = open_checkpoint(
            config.model, model_config=config.model_config, rope_layout=config.rope_layout, options=TRAIN_OPTIONS
        )
    equalization = None
    if config.equalize_from is not None:
        source, equalization = _equalized(config, source)
    tokenizer, trained_here = _tokenizer(config, out, source)
    mixture = loader_lib.parse_mixture(config.data)
    caches = _caches(config, tokenizer, [path for path, _ in mixture])  # before a model is built
    model_config, model = _model(config, tokenizer, source)
    pmap = precision_map(recipe, model_config, _precision_rules(config, model_config))
    check_block_widths(pmap, model_config)  # a width the recipe cannot block, named before the step compiles
    if source is None and config.rope_layout is not None:  # a preset: its family may fix the layout
        resolve_rope_layout(config.rope_layout, None, TRAIN_OPTIONS, family=model_config.family)
    teacher, teacher_record, teacher_config = None, None, None
    if config.teacher is not None:
        teacher, teacher_record, teacher_config = _teacher(config, model_config, tokenizer)
    tokenizer_folder = _tokenizer_folder(config, out, source, trained_here)
    train_sources, eval_windows, data_sft, eval_data_sft = _windows(
        config, tokenizer, [path for path, _ in mixture], tokenizer_folder, caches
    )
    padding = _padding_share(train_sources)
    progress.info(
        f"rows: {sum(len(w) for w in train_sources):,} training, {len(eval_windows):,} eval "
        f"(packing={config.packing}, {padding:.1%} padding)"
    )
    mesh = mesh_lib.make_mesh(config.mesh_data, config.mesh_fsdp)
    mesh_lib.check_divisible(config.batch_size, config.grad_accum, mesh)
    loader = _loader(config, train_sources, [w for _, w in mixture] if len(mixture) > 1 else None, mesh)
    if len(eval_windows) < mesh.size:
        raise NVFP4ToolError(f"too few eval windows ({len(eval_windows)}) for {mesh.size} devices")
    record = RunRecord(
        config=config.to_dict(),
        model_config=model_config.to_hf_config(),
        data_sha256=_mixture_sha256(mixture),
        eval_data_sha256=_data_sha256(config.eval_data) if config.eval_data else None,
        tokenizer_sha256=tokenizer_sha256(tokenizer),
        train_windows=sum(len(w) for w in train_sources),
        eval_windows=len(eval_windows),
        devices=jax.device_count(),
        processes=jax.process_count(),
        teacher=teacher_record,
        teacher_model_config=teacher_config,
        gemm_backend=recipe.backend(),
        equalization=equalization,
        data_weights=dict(mixture) if len(mixture) > 1 else None,
        data_sft=data_sft if any(s is not None for s in data_sft) else None,
        eval_data_sft=eval_data_sft,
        padding_share=padding,
    )
    resume_step = None
    if saved is not None:
        _check_same_run(saved, record, out, config.teacher)
        steps = run_steps(str(out))
        resume_step = steps[-1] if steps else None
        record = saved
    return _Prepared(
        record=record,
        tokenizer=tokenizer,
        save_tokenizer=trained_here,
        source=source,
        model_config=model_config,
        model=model,
        teacher=teacher,
        loader=loader,
        eval_windows=eval_windows,
        recipe=recipe,
        pmap=pmap,
        mesh=mesh,
        resume_step=resume_step,
    )


def _precision_rules(config: TrainConfig, model_config: ModelConfig) -> tuple[PrecisionRule, ...]:
    """The rules of `precision_file=` (a precision file, or a mixed export whose formats to train
    in), over the model's quantizable linears; () without it."""
    if config.precision_file is None:
        return ()
    return precision_rules(config.precision_file, [m.name for m in model_config.modules.linears if not m.keep_dtype])


def _inputs(config: TrainConfig) -> list[str]:
    """The paths the run reads (the run folder may not be, contain or lie inside any of them)."""
    paths = [
        *(path for path, _ in loader_lib.parse_mixture(config.data)),
        config.eval_data,
        config.model_config,
        config.teacher,
        config.equalize_from,
        config.precision_file,
        None if config.model in PRESETS else config.model,
        None if config.tokenizer in (None, "train") else config.tokenizer,
    ]
    return [p for p in paths if p is not None and Path(p).exists()]


def _check_out(config: TrainConfig, out: Path) -> None:
    check_output_path(out, _inputs(config), flag="out")
    if out.exists() and not out.is_dir():
        raise NVFP4ToolError(f"{out}: exists and is not a folder")
    if config.resume:
        if not RunRecord.exists(out):
            raise NVFP4ToolError(f"{out}: resume=true but this is not a run folder (no {RunRecord.FILE_NAME})")
    elif out.exists() and any(out.iterdir()) and not config.force:
        raise NVFP4ToolError(f"{out}: already exists (resume=true to continue it, force=true to replace it)")


def _check_same_config(saved: RunRecord, config: TrainConfig, out: Path) -> None:
    """Refuse a resume whose configuration differs in a key that changes the training math."""
    before, now = {**saved.train_config().to_dict(), "packing": saved.packing}, config.to_dict()
    changed = [f"{k} {before[k]!r} -> {now[k]!r}" for k in now if k not in RESUME_FREE_KEYS and before[k] != now[k]]
    if changed:
        raise NVFP4ToolError(
            f"{out}: cannot resume bit-exactly: {'; '.join(changed)} since the run "
            "started (nothing was changed; use another out= for a new run)"
        )


def _check_same_run(saved: RunRecord, now: RunRecord, out: Path, teacher: str | None) -> None:
    """Refuse a resume on other data, another tokenizer, model or teacher, or another device count
    (a distillation run whose run.json predates teacher records: the teacher cannot be compared)."""
    _check_same_rows(saved, now, out)
    if now.teacher is not None and saved.teacher is None:
        raise NVFP4ToolError(
            f"{out}: cannot resume bit-exactly: its {RunRecord.FILE_NAME} records no teacher "
            f"weight hashes (written by an older nvfp4tool), so teacher={teacher} cannot be "
            "shown to be the teacher the run started with (nothing was changed; use another "
            "out= for a new run)"
        )
    changed = [
        what
        for what, a, b in (
            ("the training data", saved.data_sha256, now.data_sha256),
            ("the eval data", saved.eval_data_sha256, now.eval_data_sha256),
            ("the tokenizer", saved.tokenizer_sha256, now.tokenizer_sha256),
            ("the model config", saved.model_config, json.loads(json.dumps(now.model_config))),  # as stored
            (
                f"the teacher's weights (teacher={teacher}: {_first_changed_file(saved.teacher, now.teacher)})",
                saved.teacher and (saved.teacher.kind, saved.teacher.files),
                now.teacher and (now.teacher.kind, now.teacher.files),
            ),
            (
                f"the teacher's model config (teacher={teacher})",
                saved.teacher_model_config,
                json.loads(json.dumps(now.teacher_model_config)),
            ),
            (
                f"the folded scales (equalize_from={now.config['equalize_from']})",
                saved.equalization and saved.equalization.to_json(),
                now.equalization and now.equalization.to_json(),
            ),
            (f"the device count ({saved.devices} -> {now.devices})", saved.devices, now.devices),
            (f"the process count ({saved.processes} -> {now.processes})", saved.processes, now.processes),
            # the GEMM sums in another order (a recorded gemm only; pallas and xla quantize bit for bit)
            (
                f"the nvfp4 GEMM (gemm {_gemm(saved)} -> {_gemm(now)})",
                _gemm(saved),
                _gemm(now) if _gemm(saved) else None,
            ),
        )
        if a != b
    ]
    if changed:
        raise NVFP4ToolError(
            f"{out}: cannot resume bit-exactly: {', '.join(changed)} changed since the "
            "run started (nothing was changed; use another out= for a new run)"
        )


def _check_same_rows(saved: RunRecord, now: RunRecord, out: Path) -> None:
    """Refuse a resume that would read other rows than the run trained on: fine-tuning rows with
    packing=segmented were cut from the token stream before they held whole conversations (the
    change that began recording `padding_share`), so a run.json without the key and with such
    rows started on the stream cut, which this nvfp4tool no longer builds for them."""
    fine_tuning = now.data_sft is not None or now.eval_data_sft is not None
    if saved.padding_share is None and fine_tuning and saved.packing != "concat":
        raise NVFP4ToolError(
            f"{RunRecord.path(out)}: no padding_share: the run started before fine-tuning rows held whole "
            f"conversations (its packing={saved.packing} rows were cut from the token stream; this nvfp4tool "
            "packs whole ones), so a resume would read other rows (nothing was changed; use another out= for "
            "a new run)"
        )


def _gemm(record: RunRecord) -> str | None:
    return None if record.gemm_backend is None else record.gemm_backend["gemm"]


def _tokenizer(config: TrainConfig, out: Path, source: Checkpoint | None) -> tuple[TextTokenizer, bool]:
    """(the tokenizer, whether it was trained here and still has to be saved into the run)."""
    saved = out / TOKENIZER_DIR
    if config.resume and (saved / "tokenizer.json").is_file():
        return load_tokenizer(saved), False  # checked against the run record's hash in _prepare
    if config.tokenizer not in (None, "train"):
        return load_tokenizer(config.tokenizer), False
    if config.tokenizer is None and source is not None:
        if source.aux_dir is not None and (Path(source.aux_dir) / "tokenizer.json").is_file():
            return load_tokenizer(source.aux_dir), False
        raise NVFP4ToolError(f"{config.model}: no tokenizer.json; pass tokenizer=PATH or tokenizer=train")
    caches = [path for path, _ in loader_lib.parse_mixture(config.data) if is_cache(path)]
    if caches:
        raise NVFP4UsageError(
            f"train config: tokenizer={config.tokenizer or 'train'}: data={caches[0]} is a token cache "
            "(already tokenized); pass tokenizer=FOLDER, the tokenizer it was prepared with"
        )
    if config.format in SFT_FORMATS:
        raise NVFP4UsageError(
            f"train config: format={config.format}: a tokenizer trained here has no chat template "
            "(nor the model's end-of-text token); pass tokenizer=FOLDER, the model's tokenizer"
        )
    with tempfile.TemporaryDirectory(prefix="nvfp4tool-tokenizer-") as scratch:
        paths = [path for path, _ in loader_lib.parse_mixture(config.data)]
        documents = (text for path in paths for text in iter_documents(path, config.text_field))
        with progress.task("tokenizer training", total=1, unit="tokenizer") as task:  # a large corpus: minutes
            train_bpe_tokenizer(documents, config.vocab_size, scratch)
            task.advance(description=f"{config.vocab_size} tokens")
        # as read back from its files: what a resume loads (and hashes) is the same tokenizer
        return load_tokenizer(scratch), True


def _model(config: TrainConfig, tokenizer: TextTokenizer, source: Checkpoint | None) -> tuple[ModelConfig, CausalLM]:
    kwargs = dict(compute_dtype=jnp.bfloat16, remat=config.remat)
    if source is None:
        model_config = preset_config(config.model, tokenizer.vocab_size, max(config.seq_len, 2048))
        model_config = dataclasses.replace(model_config, eos_token_id=tokenizer.eos_id, bos_token_id=tokenizer.eos_id)
        return model_config, CausalLM(
            model_config,
            param_dtype=jnp.float32,
            rngs=nnx.Rngs(config.seed),
            scan_layers=scans_layers(config.scan_layers, model_config.num_layers),
            **kwargs,
        )
    if tokenizer.vocab_size > source.config.vocab_size:
        raise NVFP4ToolError(
            f"tokenizer has {tokenizer.vocab_size} tokens but {config.model} embeds only {source.config.vocab_size}"
        )
    return source.config, model_from_tensors(
        source.config,
        source.tensors,
        dtype=jnp.float32,
        scan_layers=scans_layers(config.scan_layers, source.config.num_layers),
        **kwargs,
    )


def _equalized(config: TrainConfig, source: Checkpoint | None) -> tuple[Checkpoint, EqualizationRecord]:
    """`model=` with the scales `export --equalize` recorded in `equalize_from` folded in, each
    folded tensor rounded to the dtype the source stores it in: the folded model that export
    checked against the original (the same function within that rounding), whose weights suit
    NVFP4's grid better, for QAD to start from. The export must record `model` as its source (the
    sha256 of each weight file, as validate binds an export to its source)."""
    where = config.equalize_from
    if source is None:
        raise NVFP4UsageError(
            f"train config: equalize_from={where}: needs model=CHECKPOINT (the model the export "
            f"equalized), not the preset {config.model!r}"
        )
    if not ExportRecord.exists(where):
        raise NVFP4ToolError(f"equalize_from={where}: not an nvfp4tool export (no {ExportRecord.FILE_NAME})")
    record = ExportRecord.read(where)
    if record.equalization is None:
        raise NVFP4ToolError(
            f"equalize_from={where}: the export was not equalized (--equalize none): no scales to fold"
        )
    now = SourceRecord.of(source)
    difference = first_file_difference(record.source.files, now.files)
    if (record.source.kind, record.source.step) != (now.kind, now.step) or difference is not None:
        what = (
            f"weight file {difference[0]} {difference[1]}"
            if difference is not None
            else f"{now.kind} at step {now.step}, recorded {record.source.kind} at step {record.source.step}"
        )
        raise NVFP4ToolError(
            f"equalize_from={where}: not the export of model={config.model} ({what}: "
            f"{ExportRecord.path(where)} records the source {record.source.name!r})"
        )
    tensors = EqualizedSource.from_export(source.tensors, where, record, source.config, as_stored=True)
    progress.info(
        f"equalize_from={where}: the model starts with the {len(record.equalization.sites)} "
        f"{record.equalization.method} scales it recorded folded in (checked there: KL "
        f"{record.equalization.check_kl_mean:.2g} nats to the original)"
    )
    return dataclasses.replace(source, tensors=tensors), record.equalization


def _teacher(
    config: TrainConfig, model_config: ModelConfig, tokenizer: TextTokenizer
) -> tuple[CausalLM, SourceRecord, dict[str, Any]]:
    """(the distillation teacher in BF16, its record, its HF config), opened as the model is; it
    must predict over the student's vocabulary with the student's tokenizer (a bad-data error
    naming the teacher otherwise). The record names it as an export names its source (the sha256 of
    each weight file), which a resume compares."""
    opened = open_checkpoint(
        config.teacher, model_config=config.model_config, rope_layout=config.rope_layout, options=TEACHER_OPTIONS
    )
    if opened.config.vocab_size != model_config.vocab_size:
        raise NVFP4ToolError(
            f"teacher={config.teacher}: vocabulary of {opened.config.vocab_size} tokens, "
            f"the student's has {model_config.vocab_size}; distillation needs the same tokenizer"
        )
    if opened.aux_dir is not None and (Path(opened.aux_dir) / "tokenizer.json").is_file():
        if tokenizer_sha256(load_tokenizer(opened.aux_dir)) != tokenizer_sha256(tokenizer):
            raise NVFP4ToolError(
                f"teacher={config.teacher}: its tokenizer.json differs from the run's "
                "tokenizer; distillation needs the same tokenizer"
            )
    model = model_from_tensors(opened.config, opened.tensors, dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16)
    return model, SourceRecord.of(opened), opened.config.to_hf_config()


def _first_changed_file(saved: SourceRecord | None, now: SourceRecord | None) -> str:
    """The first weight file (in name order) whose hash differs between two teacher records, or
    that only one of them has; a changed kind of checkpoint is named as such."""
    if saved is None or now is None:
        return "no teacher"
    if saved.kind != now.kind:
        return f"a {now.kind} checkpoint, the run started with a {saved.kind} checkpoint"
    found = first_file_difference(saved.files, now.files)
    if found is None:
        return "no file differs"
    name, how = found
    return f"{name} " + {"missing": "is missing", "extra": "is new", "differs": "differs"}[how]


def _output_rope_layout(config: TrainConfig, source: Checkpoint | None) -> str:
    """The RoPE layout of the `export_maxtext` output: the source's MaxText side, else half."""
    if source is not None and (source.rope_layout or source.maxtext_name):
        return source.maxtext_rope_layout()
    return config.rope_layout or "half"


Sft = CorpusSft | None  # what the fine-tuning formats did to a data key's rows (None: text)


def _caches(config: TrainConfig, tokenizer: TextTokenizer, paths: list[str]) -> dict[str, TokenCache]:
    """The token caches among the training sources `paths` and `eval_data`, opened (sizes checked,
    a file whose mtime moved rehashed), each refused unless prepared with the run's tokenizer."""
    caches = {}
    for key, path in [*(("data", p) for p in paths), ("eval_data", config.eval_data)]:
        if path is not None and path not in caches and is_cache(path):
            caches[path] = open_cache(path)
            caches[path].check_tokenizer(tokenizer, key)
    return caches


def _windows(
    config: TrainConfig,
    tokenizer: TextTokenizer,
    paths: list[str],
    tokenizer_folder: Path | None,
    caches: dict[str, TokenCache] | None = None,
) -> tuple[list[Windows], Windows | loader_lib.ConcatWindows, list[Sft], Sft]:
    """(each training source's windows, the eval windows, each source's fine-tuning counts,
    eval_data's): a token cache memory-mapped (`caches`: opened, its tokenizer checked, `_caches`
    when not given; its format must be the one asked for), other data read and tokenized here;
    eval from `eval_data`, else the last `eval_fraction` of each source, concatenated in the
    sources' order."""
    caches = _caches(config, tokenizer, paths) if caches is None else caches

    def windows_of(key: str, path: str) -> tuple[Windows, Sft]:
        if path in caches:
            cache = caches[path]
            sft = _cache_sft(config, cache.manifest, key, path)  # its rows fit seq_len before they are packed
            return cache.windows(config.seq_len, config.packing), sft
        data_format = config.format or "text"
        spec = sft_options(data_format, config.loss_on, config.overlong, label="train config: ")
        if spec is None:
            documents = iter_documents(path, config.text_field)
            windows = windows_in_memory(
                encode_documents(tokenizer, documents), config.seq_len, config.packing, label=f"{key}={path}"
            )
            return windows, None
        if tokenizer_folder is None:
            raise NVFP4UsageError(
                f"train config: format={data_format} needs the tokenizer's folder (its chat template, its "
                "end-of-text token): pass tokenizer=FOLDER, or a model folder that holds one"
            )
        spec = dataclasses.replace(spec, seq_len=config.seq_len)  # rows are held to the run's rows
        encoder = SftEncoder(tokenizer_folder, spec)
        encoder.check()
        counts = SftCounts()
        encoded = encode_documents(tokenizer, iter_rows(path), format=data_format, sft=encoder)
        windows = windows_in_memory(
            _counted(encoded, counts),
            config.seq_len,
            config.packing,
            format=data_format,
            pad_id=tokenizer.eos_id,
            label=f"{key}={path}",
        )
        counts.report(spec, f"{key}={path}")
        return windows, counts.record(spec, encoder.chat_template_sha256())

    data = [windows_of("data", path) for path in paths]
    sfts = [sft for _, sft in data]
    if config.eval_data:
        eval_windows, eval_sft = windows_of("eval_data", config.eval_data)
        return [windows for windows, _ in data], eval_windows, sfts, eval_sft
    splits = [windows.split(config.eval_fraction) for windows, _ in data]
    held_out = [held for _, held in splits]
    eval_windows = held_out[0] if len(held_out) == 1 else loader_lib.ConcatWindows(held_out)
    return [train for train, _ in splits], eval_windows, sfts, None


def _padding_share(sources: list[Windows]) -> float:
    """The share of padding among the tokens of all training rows (rows weighed by their count)."""
    rows = sum(len(w) for w in sources)
    return sum(w.padding_share() * len(w) for w in sources) / rows if rows else 0.0


def _counted(encoded: Iterator[EncodedBatch], counts: SftCounts) -> Iterator[EncodedBatch]:
    for batch in encoded:
        if batch.sft is not None:
            counts.merge(batch.sft)
        yield batch


def _cache_sft(config: TrainConfig, manifest: CorpusManifest, key: str, path: str) -> Sft:
    """The cache's fine-tuning record, refusing train keys that ask for what it does not hold."""
    sft = manifest.sft
    held = {"format": manifest.format, "loss_on": sft and sft.loss_on, "overlong": sft and sft.overlong}
    for name, value in held.items():
        asked = getattr(config, name)
        if asked is not None and asked != value:
            raise NVFP4UsageError(
                f"train config: {name}={asked}: {key}={path} is a token cache of "
                f"{name}={value} (prepared so; data prepare again to change it)"
            )
    if sft is not None and sft.seq_len is not None and config.seq_len < sft.seq_len:
        raise NVFP4UsageError(
            f"train config: seq_len={config.seq_len}: {key}={path} holds rows of up to seq_len + 1 = "
            f"{sft.seq_len + 1} tokens (data prepare --seq-len {sft.seq_len}); prepare it again with "
            f"--seq-len {config.seq_len}"
        )
    return sft


def _tokenizer_folder(config: TrainConfig, out: Path, source: Checkpoint | None, trained_here: bool) -> Path | None:
    """The folder the run's tokenizer was read from (as `_tokenizer` chose it; None: trained here)."""
    saved = out / TOKENIZER_DIR
    if trained_here:
        return None
    if config.resume and (saved / "tokenizer.json").is_file():
        return saved
    if config.tokenizer not in (None, "train"):
        return Path(config.tokenizer)
    return Path(source.aux_dir) if source is not None and source.aux_dir is not None else None


def _loader(config: TrainConfig, sources: list[Windows], weights: list[float] | None, mesh) -> loader_lib.Loader:
    """The run's loader (this process's rows of each batch), checked to read the rows the batch
    sharding places on this process's devices."""
    loader = loader_lib.Loader(
        sources,
        weights,
        batch_size=config.batch_size,
        seed=config.seed,
        num_batches=config.steps,
        grad_accum=config.grad_accum,
        threads=config.loader_threads,
        prefetch=config.loader_prefetch,
    )
    micro = config.batch_size // config.grad_accum
    shape = (config.grad_accum, micro, config.seq_len + 1)
    held = mesh_lib.process_rows(mesh_lib.batch_sharding(mesh, 3, batch_axis=1), shape, axis=1)
    placed = (np.arange(config.grad_accum)[:, None] * micro + held[None, :]).reshape(-1)
    if not np.array_equal(placed, loader.rows):
        raise NVFP4ToolError(
            f"process {jax.process_index()}: its devices hold rows {placed.tolist()} of each batch, "
            f"the loader's process shard reads {loader.rows.tolist()} (the devices are not in process order)"
        )
    return loader


def _mixture_sha256(mixture: list[tuple[str, float]]) -> str:
    """The training data's hash: one source's `_data_sha256`; a mixture's, of each source's hash
    and weight in order (so a changed weight is changed data)."""
    if len(mixture) == 1:
        return _data_sha256(mixture[0][0])
    return hashlib.sha256(json.dumps([[_data_sha256(p), w] for p, w in mixture]).encode()).hexdigest()


def _data_sha256(path: str) -> str:
    """A token cache: its manifest's sha256 (which binds every shard's); other data: its bytes'."""
    return manifest_sha256(path) if is_cache(path) else data_sha256(path)


# ------------------------------------------------------------------------------------------
# loop helpers


def _bf16_scope(step: int, switch_step: int | None, scope: str) -> str:
    return "none" if switch_step is None or step < switch_step else scope


def _compile_label(what: str, scope: str) -> str:
    """What `progress.compiling` calls a step program ("train step", "train step (BF16 scope last)")."""
    return what if scope == "none" else f"{what} (BF16 scope {scope})"


@dataclasses.dataclass(frozen=True)
class _RunningStep:
    """A dispatched training step whose results are still on the device."""

    step: int
    scope: str  # its BF16 scope (the eval after it runs in the same)
    metrics: dict[str, jax.Array]  # `StepFns.train_step`'s
    lr: jax.Array  # the schedule's learning rate of the step
    dispatched: float  # perf_counter() just before it was dispatched


def _skipping_nonfinite(train_step):
    """`train_step` for `on_nonfinite=skip`: where the step's loss or gradient norm is not finite,
    the state it returns is the one it was given (only its step counter advanced), chosen on the
    device so the next step can be dispatched before the host has read the metrics."""

    def step(state, *args, **kwargs):
        new_state, metrics = train_step(state, *args, **kwargs)
        kept = {
            key: jax.tree.map(lambda old, new: jnp.where(metrics["finite"], new, old), state[key], value)
            for key, value in new_state.items()
            if key != "step"
        }
        return {**kept, "step": new_state["step"]}, metrics

    return step


def _due(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and step % every == 0)


def _evaluate(
    eval_fn, params, teacher, eval_windows, config: TrainConfig, sharding, mesh, scope: str
) -> dict[str, float]:
    """Mean eval metrics (`StepFns.eval_metrics`: "loss", and "kl" to a teacher) over up to
    `eval_batches` full batches of held-out windows (trimmed to the mesh)."""
    batch = max(mesh.size, (config.batch_size // config.grad_accum) // mesh.size * mesh.size)
    usable = len(eval_windows) // mesh.size * mesh.size
    results, weights = [], []
    chunks = list(itertools.islice(eval_windows.batches(batch, count=usable), config.eval_batches))
    with progress.task("eval", total=len(chunks), unit="batch") as task:
        for chunk in chunks:  # a Batch: tokens with their segments / loss marks
            with progress.compiling(_compile_label("eval step", scope), key=(eval_fn, scope, chunk.tokens.shape)):
                metrics = eval_fn(
                    params,
                    jax.tree.map(lambda a: mesh_lib.to_global(a, sharding), chunk),
                    bf16_scope=scope,
                    teacher=teacher,
                )
            results.append({name: float(value) for name, value in metrics.items()})
            weights.append(len(chunk.tokens))
            task.advance()
    if not results:
        raise NVFP4ToolError(f"too few eval windows ({len(eval_windows)}) for {mesh.size} devices")
    return {name: float(np.average([r[name] for r in results], weights=weights)) for name in results[0]}


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


# ------------------------------------------------------------------------------------------
# outputs


def _write_start(out: Path, config: TrainConfig, job: _Prepared) -> None:
    """Create (or, with force, replace) the run folder atomically with run.json and a tokenizer
    trained here. A resume writes nothing here: its run.json stays as the run started."""
    if config.resume:
        return
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()  # an empty folder is no run to protect
    with atomic_output_dir(out, force=config.force, inputs=_inputs(config), flag="out") as tmp:
        if job.save_tokenizer:
            save_tokenizer(job.tokenizer.tokenizer, Path(tmp) / TOKENIZER_DIR)
        job.record.write(tmp)


def precision_summary(pmap: dict[str, str], recipe: str, routers: list[str]) -> str:
    """One line on what runs in which precision: a BF16 run says it runs BF16 (nothing is "kept")."""
    counts: dict[str, int] = {}
    for precision in pmap.values():
        counts[precision] = counts.get(precision, 0) + 1
    if set(counts) <= {"bf16"}:
        return f"recipe {recipe}: all {len(pmap)} linear layers run in BF16 (nothing quantized)"
    always = [LM_HEAD] + (["the MoE routers"] if routers else [])
    # the blocks holding a BF16 linear (apart from the routers, which always are)
    kept = [
        layer_prefix(i)
        for i in sorted({layer_index(n) for n, p in pmap.items() if p == "bf16" and n != LM_HEAD and n not in routers})
    ]
    quantized = ", ".join(f"{n} of {len(pmap)} linear layers in {p}" for p, n in sorted(counts.items()) if p != "bf16")
    return f"recipe {recipe}: {quantized}; kept in bf16: {', '.join(always + kept)}"


def _report_backend(recipe: RecipeConfig, config: TrainConfig) -> None:
    """One line: the nvfp4 GEMM path the run resolved (as run.json and metrics.jsonl record it)."""
    backend = recipe.backend()
    if backend is not None:
        how = {key: "" if getattr(config, key) != "auto" else f" (auto on {jax.default_backend()})" for key in backend}
        progress.info(
            f"nvfp4 GEMMs: quantizer={backend['quantizer']}{how['quantizer']}, gemm={backend['gemm']}{how['gemm']}"
        )


def _write_final(
    out: Path,
    config: TrainConfig,
    model_config: ModelConfig,
    graphdef,
    state,
    pmap: dict[str, str],
    tokenizer: TextTokenizer,
    source: Checkpoint | None,
) -> Path:
    from converters.hf import write_hf_folder

    params = jax.tree.map(np.asarray, state["params"])
    model = nnx.merge(graphdef, params)
    hf_dir = out / WEIGHTS_DIR
    tokenizer_dir = out / TOKENIZER_DIR
    amax = InputAmaxRecord({n: float(np.max(np.asarray(h))) for n, h in state["amax"].items()})

    def finish(folder: str) -> None:  # published together with the weights, or not at all
        if not all((Path(folder) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
            save_tokenizer(tokenizer.tokenizer, Path(folder))
        amax.write(folder)
        PrecisionMapRecord(dict(pmap)).write(folder)
        if config.precision_file is not None:  # export of the run reads its rules (`Checkpoint.precision_file`)
            text = format_precision_file(
                _precision_rules(config, model_config),
                [f"the per-linear formats this run trained with (train precision_file={config.precision_file})"],
            )
            (Path(folder) / PRECISION_FILE).write_text(text, encoding="utf-8")

    # the tokenizer's files (its chat template with them) come from where the run's tokenizer came
    # from: the one trained here, the model's folder, or for a preset the `tokenizer` folder
    if tokenizer_dir.is_dir():
        copy_from = tokenizer_dir
    elif source is not None:
        copy_from = source.aux_dir
    else:
        copy_from = config.tokenizer if config.tokenizer not in (None, "train") else None
    write_hf_folder(
        hf_dir,
        model_config,
        ModelTensorSource(model, path=str(out)),
        dtype="bf16",
        copy_from=copy_from,
        force=True,
        finish=finish,
    )
    if config.export_maxtext:
        from converters.hf import HFFolderSource
        from converters.maxtext import write_maxtext

        write_maxtext(
            out / "maxtext",
            model_config,
            HFFolderSource(hf_dir),
            scan_layers=True,
            rope_layout=_output_rope_layout(config, source),
            force=True,
        )
    return hf_dir
