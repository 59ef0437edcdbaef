"""`nvfp4tool train`: the training loop (pretraining from scratch or fine-tuning a checkpoint).

    result = train(load_train_config("run.yaml", ["recipe=nvfp4", "steps=60"]))

The run folder `out` ends up holding: `run.json` (config, model config, precision map),
`metrics.jsonl` and `loss.png`, `checkpoints/<step>` (Orbax: params, optimizer, amax history),
`tokenizer/` (when trained here), and the final weights as an HF folder `hf/` (BF16, with
tokenizer, `precision_map.json` and `input_amax.json` for export) and, on request, `maxtext/`.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nvfp4tool.config import ModelConfig
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError
from nvfp4tool.model import CausalLM, ModelTensorSource, model_from_tensors
from nvfp4tool.recipes.precision import precision_map
from nvfp4tool.train import data as data_lib
from nvfp4tool.train import mesh as mesh_lib
from nvfp4tool.train.checkpoint import Checkpoints, abstract_like
from nvfp4tool.train.config import TrainConfig
from nvfp4tool.train.metrics import append_metrics, plot_runs, truncate_metrics
from nvfp4tool.train.presets import PRESETS, preset_config
from nvfp4tool.train.step import StepFns, make_optimizer, make_schedule
from nvfp4tool.train.tokenizer import TextTokenizer, load_tokenizer, train_bpe_tokenizer

RUN_FILE = "run.json"
INPUT_AMAX_FILE = "input_amax.json"
PRECISION_MAP_FILE = "precision_map.json"


@dataclasses.dataclass
class TrainResult:
    """What a run produced."""

    out: Path
    losses: dict[int, float]  # step -> train loss (the steps this call ran)
    eval_losses: dict[int, float]
    final_step: int
    hf_dir: Path | None
    tokens_per_s: float


def train(config: TrainConfig, *, show_progress: bool = True,
          on_step: Callable[[dict[str, Any]], None] | None = None) -> TrainResult:
    """Run (or resume) the training job `config` and write its outputs under `config.out`."""
    _init_distributed(config)
    out = Path(config.out)
    is_main = jax.process_index() == 0
    _prepare_out(out, config, is_main)

    tokenizer = _tokenizer(config, out)
    model_config, model = _model(config, tokenizer)
    train_windows, eval_windows = _windows(config, tokenizer)
    recipe = config.recipe_config()
    pmap = precision_map(recipe, model_config)
    switch_step = recipe.switch_step(config.steps)
    if is_main:
        _write_run_record(out, config, model_config, pmap, len(train_windows), len(eval_windows))
        _print_precision_map(pmap, recipe.name)

    schedule = make_schedule(config.schedule, lr=config.lr, steps=config.steps,
                             warmup_steps=config.warmup_steps, min_lr_ratio=config.min_lr_ratio,
                             decay_fraction=config.decay_fraction)
    optimizer = make_optimizer(schedule, weight_decay=config.weight_decay, beta1=config.beta1,
                               beta2=config.beta2, eps=config.eps, clip_norm=config.clip_norm)
    graphdef, params = nnx.split(model)
    fns = StepFns(graphdef, recipe, pmap, optimizer, config.grad_accum)
    mesh = mesh_lib.make_mesh(config.mesh_data, config.mesh_fsdp)
    mesh_lib.check_divisible(config.batch_size, config.grad_accum, mesh)
    host_state = fns.init_state(params.to_pure_dict(), config.amax_history)
    shardings = mesh_lib.state_shardings(mesh, host_state)
    checkpoints = Checkpoints(out, config.keep_checkpoints)
    start_step = 0
    if config.resume and checkpoints.latest_step() is not None:
        start_step = checkpoints.latest_step()
        state, meta = checkpoints.restore(start_step, abstract_like(host_state, shardings))
        _check_resumable(meta, config, out)
        if is_main:
            truncate_metrics(out, start_step)
            print(f"resumed from {out}/checkpoints/{start_step}")
    else:
        state = mesh_lib.place_state(host_state, shardings)
    del host_state, params, model

    metric_sharding = mesh_lib.replicated(mesh)
    step_fn = jax.jit(fns.train_step, static_argnames="bf16_scope", donate_argnums=(),
                      out_shardings=(shardings, metric_sharding))
    eval_fn = jax.jit(fns.eval_loss, static_argnames="bf16_scope", out_shardings=metric_sharding)
    batch_sharding = mesh_lib.batch_sharding(mesh, 3, batch_axis=1)
    eval_sharding = mesh_lib.batch_sharding(mesh, 2, batch_axis=0)
    tokens_per_step = config.batch_size * config.seq_len
    base_key = jax.random.key(config.seed)

    losses, eval_losses = {}, {}
    run_start, run_tokens = time.perf_counter(), 0
    with _progress(show_progress and is_main, config.steps, start_step) as advance:
        for step in range(start_step + 1, config.steps + 1):
            scope = _bf16_scope(step, switch_step, recipe.switch_scope)
            indices = data_lib.batch_indices(len(train_windows), config.batch_size, config.seed, step - 1)
            windows = train_windows[indices].reshape(config.grad_accum, -1, config.seq_len + 1)
            t0 = time.perf_counter()
            new_state, metrics = step_fn(state, mesh_lib.to_global(windows, batch_sharding),
                                         jax.random.fold_in(base_key, step), bf16_scope=scope)
            loss, grad_norm, finite = (float(metrics["loss"]), float(metrics["grad_norm"]),
                                       bool(metrics["finite"]))
            step_time = time.perf_counter() - t0
            record = {"step": step, "loss": loss, "lr": float(schedule(step - 1)),
                      "grad_norm": grad_norm, "tokens_per_s": tokens_per_step / step_time,
                      "step_time_s": step_time}
            if not finite:
                if config.on_nonfinite == "stop":
                    last = checkpoints.latest_step()
                    raise NVFP4ToolError(
                        f"step {step}: non-finite loss ({loss}) or gradient norm ({grad_norm}); "
                        f"stopped. Last good checkpoint: "
                        f"{out / 'checkpoints' / str(last) if last is not None else 'none'} "
                        "(set on_nonfinite=skip to skip such steps)")
                record["skipped"] = True
                new_state = jax.tree.map(lambda old, new: old, state, new_state)
                new_state["step"] = state["step"] + 1
            state = new_state
            losses[step] = loss
            run_tokens += tokens_per_step
            if _due(step, config.eval_every, config.steps):
                record["eval_loss"] = _evaluate(eval_fn, state["params"], eval_windows, config,
                                                eval_sharding, mesh, scope)
                eval_losses[step] = record["eval_loss"]
            if is_main:
                append_metrics(out, record)
            if on_step is not None:
                on_step(record)
            if _due(step, config.checkpoint_every, config.steps):
                checkpoints.save(step, state, {"step": step, "seed": config.seed,
                                               "batches_seen": step, "config": config.to_dict()})
            advance(record)
    elapsed = time.perf_counter() - run_start
    checkpoints.close()

    hf_dir = None
    if is_main:
        if losses:
            plot_runs([out], out / "loss.png")
        hf_dir = _write_final(out, config, model_config, graphdef, state, pmap, tokenizer)
    return TrainResult(out=out, losses=losses, eval_losses=eval_losses, final_step=config.steps,
                       hf_dir=hf_dir, tokens_per_s=run_tokens / max(elapsed, 1e-9))


# ------------------------------------------------------------------------------------------
# setup


def _init_distributed(config: TrainConfig) -> None:
    if config.num_processes > 1 and not jax.distributed.is_initialized():
        if config.coordinator_address is None:
            raise NVFP4ToolError("num_processes > 1 needs coordinator_address=host:port")
        jax.distributed.initialize(coordinator_address=config.coordinator_address,
                                   num_processes=config.num_processes, process_id=config.process_id)


def _prepare_out(out: Path, config: TrainConfig, is_main: bool) -> None:
    if config.resume:
        if not (out / RUN_FILE).is_file():
            raise NVFP4ToolError(f"{out}: resume=true but this is not a run folder (no {RUN_FILE})")
        return
    if out.exists() and any(out.iterdir()):
        if not config.force:
            raise NVFP4ToolError(f"{out}: already exists (resume=true to continue it, force=true to "
                                 "replace it)")
        if is_main:
            shutil.rmtree(out)
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
    _barrier("prepare_out")


def _tokenizer(config: TrainConfig, out: Path) -> TextTokenizer:
    saved = out / "tokenizer"
    if config.resume and (saved / "tokenizer.json").is_file():
        return load_tokenizer(saved)
    if config.tokenizer not in (None, "train"):
        return load_tokenizer(config.tokenizer)
    model_path = Path(config.model)
    if config.tokenizer is None and (model_path / "tokenizer.json").is_file():
        return load_tokenizer(model_path)
    if config.tokenizer is None and config.model not in PRESETS:
        raise NVFP4ToolError(f"{config.model}: no tokenizer.json; pass tokenizer=PATH or tokenizer=train")
    documents = data_lib.iter_documents(config.data, config.text_field)
    return train_bpe_tokenizer(documents, config.vocab_size, saved)


def _model(config: TrainConfig, tokenizer: TextTokenizer) -> tuple[ModelConfig, CausalLM]:
    kwargs = dict(compute_dtype=jnp.bfloat16)
    if config.model in PRESETS:
        model_config = preset_config(config.model, tokenizer.vocab_size, max(config.seq_len, 2048))
        model_config = dataclasses.replace(model_config, eos_token_id=tokenizer.eos_id,
                                           bos_token_id=tokenizer.eos_id)
        return model_config, CausalLM(model_config, param_dtype=jnp.float32,
                                      rngs=nnx.Rngs(config.seed), **kwargs)
    from converters.convert import detect_format, load_model_config
    from converters.hf import HFFolderSource
    from converters.maxtext import MaxTextSource

    if detect_format(config.model) == "hf":
        source = HFFolderSource(config.model)
        model_config = source.config
    else:
        if config.model_config is None:
            raise NVFP4ToolError(f"{config.model}: a MaxText checkpoint carries no config; pass "
                                 "model_config=<HF config.json | MaxText model name>")
        model_config, _ = load_model_config(config.model_config)
        layout = _maxtext_rope_layout(config)
        if layout is None:
            raise NVFP4UsageError(f"{config.model}: which RoPE layout does this MaxText checkpoint use? "
                                  "set rope_layout=interleaved|half or give a MaxText model name as "
                                  "model_config (llama3.1-* are interleaved)")
        source = MaxTextSource(config.model, model_config, layout)
    if tokenizer.vocab_size > model_config.vocab_size:
        raise NVFP4ToolError(f"tokenizer has {tokenizer.vocab_size} tokens but {config.model} "
                             f"embeds only {model_config.vocab_size}")
    return model_config, model_from_tensors(model_config, source, dtype=jnp.float32, **kwargs)


def _maxtext_rope_layout(config: TrainConfig) -> str | None:
    """The MaxText side's RoPE layout: the explicit key, else the MaxText model name's, else None."""
    from converters.maxtext_models import MAXTEXT_MODELS, rope_layout_for

    if config.rope_layout is not None:
        return config.rope_layout
    if config.model_config in MAXTEXT_MODELS:
        return rope_layout_for(config.model_config)
    return None


def _windows(config: TrainConfig, tokenizer: TextTokenizer) -> tuple[np.ndarray, np.ndarray]:
    def windows_of(path: str) -> np.ndarray:
        docs = (tokenizer.encode(d) for d in data_lib.iter_documents(path, config.text_field))
        return data_lib.pack_windows(docs, config.seq_len, tokenizer.eos_id)

    if config.eval_data:
        return windows_of(config.data), windows_of(config.eval_data)
    return data_lib.split_eval(windows_of(config.data), config.eval_fraction)


def _check_resumable(meta: dict[str, Any], config: TrainConfig, out: Path) -> None:
    saved = meta.get("config", {})
    changed = [k for k in ("model", "data", "recipe", "seq_len", "batch_size", "grad_accum", "seed",
                           "steps", "lr", "schedule") if saved.get(k) != getattr(config, k)]
    if changed:
        raise NVFP4ToolError(f"{out}: cannot resume bit-exactly: {', '.join(changed)} changed since "
                             "the checkpoint")


# ------------------------------------------------------------------------------------------
# loop helpers


def _bf16_scope(step: int, switch_step: int | None, scope: str) -> str:
    return "none" if switch_step is None or step < switch_step else scope


def _due(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and step % every == 0)


def _evaluate(eval_fn, params, eval_windows, config: TrainConfig, sharding, mesh, scope: str) -> float:
    """Mean loss over up to `eval_batches` full batches of held-out windows (trimmed to the mesh)."""
    batch = max(mesh.size, (config.batch_size // config.grad_accum) // mesh.size * mesh.size)
    usable = len(eval_windows) // mesh.size * mesh.size
    losses, weights = [], []
    for chunk in list(data_lib.eval_batches(eval_windows[:usable], batch))[:config.eval_batches]:
        losses.append(float(eval_fn(params, mesh_lib.to_global(chunk, sharding), bf16_scope=scope)))
        weights.append(len(chunk))
    if not losses:
        raise NVFP4ToolError(f"too few eval windows ({len(eval_windows)}) for {mesh.size} devices")
    return float(np.average(losses, weights=weights))


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


# ------------------------------------------------------------------------------------------
# outputs


def _write_run_record(out: Path, config: TrainConfig, model_config: ModelConfig, pmap: dict,
                      num_train: int, num_eval: int) -> None:
    record = {"config": config.to_dict(), "model_config": model_config.to_hf_config(),
              "precision_map": pmap, "train_windows": num_train, "eval_windows": num_eval,
              "devices": jax.device_count(), "processes": jax.process_count()}
    (out / RUN_FILE).write_text(json.dumps(record, indent=2))


def _print_precision_map(pmap: dict[str, str], recipe: str) -> None:
    counts: dict[str, int] = {}
    for precision in pmap.values():
        counts[precision] = counts.get(precision, 0) + 1
    kept = sorted({n.rsplit(".", 2)[0] for n, p in pmap.items() if p == "bf16" and n != "lm_head"})
    print(f"recipe {recipe}: " + ", ".join(f"{n} linear layers in {p}" for p, n in sorted(counts.items()))
          + f"; kept in bf16: lm_head{', ' if kept else ''}{', '.join(kept)}")


def _write_final(out: Path, config: TrainConfig, model_config: ModelConfig, graphdef, state,
                 pmap: dict, tokenizer: TextTokenizer) -> Path:
    from converters.hf import write_hf_folder

    params = jax.tree.map(np.asarray, state["params"])
    model = nnx.merge(graphdef, params)
    hf_dir = out / "hf"
    tokenizer_dir = out / "tokenizer"
    write_hf_folder(hf_dir, model_config, ModelTensorSource(model, path=str(out)), dtype="bf16",
                    copy_from=tokenizer_dir if tokenizer_dir.is_dir() else (
                        config.model if Path(config.model).is_dir() else None), force=True)
    if not tokenizer_dir.is_dir() and not (hf_dir / "tokenizer.json").is_file():
        from nvfp4tool.train.tokenizer import save_tokenizer

        save_tokenizer(tokenizer.tokenizer, hf_dir)
    amax = {n: float(np.max(np.asarray(h))) for n, h in state["amax"].items()}
    (hf_dir / INPUT_AMAX_FILE).write_text(json.dumps(amax, indent=1))
    (hf_dir / PRECISION_MAP_FILE).write_text(json.dumps(pmap, indent=1))
    if config.export_maxtext:
        from converters.hf import HFFolderSource
        from converters.maxtext import write_maxtext

        write_maxtext(out / "maxtext", model_config, HFFolderSource(hf_dir), scan_layers=True,
                      rope_layout=_maxtext_rope_layout(config) or "half", force=True)
    return hf_dir


class _progress:
    """A rich progress bar with loss, tokens/s and ETA (or nothing when disabled)."""

    def __init__(self, enabled: bool, total: int, completed: int) -> None:
        self.enabled, self.total, self.completed = enabled, total, completed

    def __enter__(self):
        if not self.enabled:
            return lambda record: None
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self._bar = Progress(TextColumn("train"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                             TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                             TimeRemainingColumn())
        self._bar.__enter__()
        task = self._bar.add_task("train", total=self.total, completed=self.completed, loss="-", tps="-")

        def advance(record: dict) -> None:
            self._bar.update(task, advance=1, loss=f"{record['loss']:.4f}",
                             tps=f"{record['tokens_per_s']:,.0f}")

        return advance

    def __exit__(self, *exc):
        if self.enabled:
            self._bar.__exit__(*exc)
        return False
