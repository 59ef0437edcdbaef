"""`nvfp4tool eval`: the same lm-eval tasks on the same items for the BF16 source, an FP8 reference and
the NVFP4 export as served, compared item by item.

    run = evaluate_export("out/a-nvfp4", EvalOptions(tasks=("nvfp4tool_mc",), reference="out/a-fp8"))
    run.record.tasks["nvfp4tool_mc"]["paired"]["nvfp4-bf16"]["ci95"]

Everything is checked before any model runs; `max_drop` is a fraction (0.02 = 2 accuracy points).
Design notes: docs/design/eval.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import yaml

from nvfp4tool import memory, progress
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError
from nvfp4tool.records.evaluation import EvalItems, EvalRecord
from nvfp4tool.records.export import ExportRecord, sha256_file
from nvfp4tool.records.validation import Named

OUTPUT_TYPES = ("loglikelihood", "loglikelihood_rolling", "multiple_choice", "generate_until")
REQUIRED_FIELDS = ("task", "output_type", "doc_to_target")  # + doc_to_text unless rolling, doc_to_choice for MC
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json")
NGRAM = 4  # the n of the repeated n-gram rate


@dataclasses.dataclass(frozen=True)
class EvalOptions:
    """What `nvfp4tool eval` runs (the CLI flags)."""

    tasks: tuple[str, ...]  # lm-eval task names, task YAML files or folders of them
    reference: str | None = None  # an FP8 export folder (None: no FP8 column)
    source: str | None = None  # the BF16 source (default: the export's provenance record)
    limit: int | None = None  # the first `limit` items of each task
    seed: int = 0  # lm-eval's seeds and the sampling key
    max_drop: float | None = None  # most accepted drop of nvfp4-bf16's 95% interval lower end
    max_drop_fp8: float | None = None  # the same for nvfp4-fp8
    batch_size: int = 8
    max_length: int = 2048
    max_gen_toks: int = 256
    num_fewshot: int | None = None
    offload: str = "auto"
    chat_template: bool = True  # apply the tokenizer's chat template where it has one
    gen_kwargs: dict[str, Any] | None = None  # generation settings over every generative task's own
    samples: int = 1  # sampled generative tasks: generations per item, scores averaged per item


@dataclasses.dataclass(frozen=True)
class EvalRun:
    record: EvalRecord
    files: list[str]


# ------------------------------------------------------------------------------------------ tasks


class _TaskLoader(yaml.SafeLoader):
    """YAML with lm-eval's tags (`!function module.fn`) read as plain strings."""


_TaskLoader.add_multi_constructor(
    "!", lambda loader, suffix, node: loader.construct_scalar(node) if isinstance(node, yaml.ScalarNode) else None
)


def _read_task_yaml(path: str, seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """A task YAML mapping with its `include:` files merged under it (lm-eval's rule: the file's own
    keys win), relative to its folder."""
    if os.path.abspath(path) in seen:
        raise NVFP4ToolError(f"{path}: includes itself")
    try:
        with open(path, "rb") as f:
            config = yaml.load(f.read().decode("utf-8"), Loader=_TaskLoader)
    except OSError as bad:
        raise NVFP4ToolError(f"{path}: cannot read ({bad.strerror})") from None
    except (UnicodeDecodeError, yaml.YAMLError) as bad:
        raise NVFP4ToolError(f"{path}: not a valid task YAML file ({str(bad).splitlines()[0]})") from None
    if not isinstance(config, dict):
        raise NVFP4ToolError(f"{path}: not a task (expected a YAML mapping with task, output_type, ...)")
    includes = config.pop("include", None)
    merged: dict[str, Any] = {}
    for name in [includes] if isinstance(includes, str) else includes or []:
        merged.update(
            _read_task_yaml(
                os.path.join(os.path.dirname(os.path.abspath(path)), str(name)), seen + (os.path.abspath(path),)
            )
        )
    merged.update(config)
    return merged


def _task_file(path: str) -> dict[str, Any]:
    """A task YAML file (with its includes), its required fields checked (NVFP4ToolError naming the
    file and the field)."""
    config = _read_task_yaml(path)
    if "group" in config and "task" in config and isinstance(config["task"], list):
        if not isinstance(config["group"], str) or not config["group"]:
            raise NVFP4ToolError(f"{path}: `group` is {_yaml_kind(config['group'])}, expected the group's name")
        return config  # a group of tasks: lm-eval resolves its members
    for field in REQUIRED_FIELDS:
        if field not in config:
            raise NVFP4ToolError(f"{path}: the task has no `{field}` field")
    if not isinstance(config["task"], str) or not config["task"]:
        raise NVFP4ToolError(
            f"{path}: `task` is {_yaml_kind(config['task'])}, expected the task's name (a string; "
            "a list of tasks needs a `group` name)"
        )
    if config["output_type"] not in OUTPUT_TYPES:
        raise NVFP4ToolError(f"{path}: output_type {config['output_type']!r} is not one of {', '.join(OUTPUT_TYPES)}")
    if config["output_type"] != "loglikelihood_rolling" and "doc_to_text" not in config:
        raise NVFP4ToolError(f"{path}: the task has no `doc_to_text` field")
    if config["output_type"] == "multiple_choice" and "doc_to_choice" not in config:
        raise NVFP4ToolError(f"{path}: a multiple_choice task without `doc_to_choice`")
    if "dataset_path" not in config and "custom_dataset" not in config:
        raise NVFP4ToolError(f"{path}: the task has no `dataset_path` (e.g. json or parquet with data_files)")
    if config.get("dataset_path") == "json" and "custom_dataset" not in config:
        for data in _local_data_files(config):
            _check_json_data(data, config["task"])
    return config


def _yaml_kind(value: Any) -> str:
    if isinstance(value, str):
        return "an empty string"
    return {bool: "a boolean", int: "a number", float: "a number", list: "a list", dict: "a mapping"}.get(
        type(value), "null" if value is None else type(value).__name__
    )


def _local_data_files(config: dict[str, Any]) -> list[str]:
    """The local files of a task's `dataset_kwargs.data_files` (a path, a list, or split -> path or
    list; relative to the working directory, as datasets reads them); globs and URLs are left to datasets."""
    kwargs = config.get("dataset_kwargs")
    files = kwargs.get("data_files") if isinstance(kwargs, dict) else None
    values = list(files.values()) if isinstance(files, dict) else [files]
    paths = [p for v in values for p in (v if isinstance(v, list) else [v]) if isinstance(p, str)]
    return [p for p in paths if "://" not in p and not any(c in p for c in "*?[") and os.path.isfile(p)]


def _check_json_data(path: str, task: str) -> None:
    """A json task's data file: not empty, and JSON lines (or one JSON document); the package's
    JSON readers name the file and the line."""
    from nvfp4tool.records.base import RecordError, iter_jsonl, read_json_file

    try:
        rows = sum(1 for _ in iter_jsonl(path))
    except RecordError as bad:
        try:
            read_json_file(path)  # one JSON document (a list of items): datasets reads that too
        except RecordError:
            raise NVFP4ToolError(f"{bad} (the data file of task {task})") from None
        return
    if rows == 0:
        raise NVFP4ToolError(f"{path}: empty, no items (the data file of task {task})")


def resolve_tasks(specs: tuple[str, ...]) -> tuple[list[str], Any]:
    """(task names, lm-eval TaskManager) for `--tasks`: names, YAML files and folders of YAML files
    (their folders become lm-eval `include_path`s). Unknown names exit 2; bad files exit 1."""
    from nvfp4tool.eval.lm_backend import task_manager

    if not specs:
        raise NVFP4UsageError("--tasks: no task given")
    names, include = [], []
    for spec in specs:
        if os.path.isfile(spec):
            config = _task_file(spec)
            include.append(os.path.dirname(os.path.abspath(spec)))
            names.append(str(config.get("group") if isinstance(config.get("task"), list) else config["task"]))
        elif os.path.isdir(spec):
            files = sorted(os.path.join(spec, f) for f in os.listdir(spec) if f.endswith((".yaml", ".yml")))
            if not files:
                raise NVFP4ToolError(f"{spec}: no task YAML files in the folder")
            for path in files:
                config = _task_file(path)
                names.append(str(config.get("group") if isinstance(config.get("task"), list) else config["task"]))
            include.append(os.path.abspath(spec))
        else:
            names.append(spec)
    include = list(dict.fromkeys(include))
    manager = task_manager(tuple(include), defaults=False)
    missing = [n for n in names if n not in manager.all_tasks]
    unknown = [n for n in missing if not _in_lm_eval_yaml(n)]
    if missing and not unknown:
        manager = task_manager(tuple(include), defaults=True)  # lm-eval's own tasks (indexing takes ~20 s)
        unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise NVFP4UsageError(
            f"--tasks {unknown[0]}: unknown task (not an lm-eval task name, nor a task YAML file or folder)"
        )
    return list(dict.fromkeys(names)), manager


def _in_lm_eval_yaml(name: str) -> bool:
    """Whether any of lm-eval's own task YAML files contains `name` (a task, group or tag name is
    written in its file): a byte search, so an unknown name is refused without parsing lm-eval's
    thousands of task files into its index."""
    import lm_eval.tasks

    needle = name.encode()
    root = os.path.dirname(os.path.abspath(lm_eval.tasks.__file__))
    for folder, _, files in os.walk(root):
        for file in files:
            if file.endswith((".yaml", ".yml")):
                with open(os.path.join(folder, file), "rb") as f:
                    if needle in f.read():
                        return True
    return False


def _build_tasks(names: list[str], manager) -> dict[str, Any]:
    """Every task built and its dataset read, before any model runs (one line naming the task)."""
    from lm_eval.tasks import get_task_dict

    from nvfp4tool.eval.items import check_items

    found = {}
    for name in names:
        try:
            with _datasets_quiet(), _without_metadata_notice():
                built = get_task_dict([name], manager)
        except Exception as bad:  # lm-eval / datasets raise anything for a broken task
            raise NVFP4ToolError(
                f"task {name}: cannot be built ({type(bad).__name__}: {str(bad).splitlines()[0] if str(bad) else ''})"
            ) from None
        found.update(_leaves(built))
    for name, task in found.items():
        try:
            docs = list(task.eval_docs)
        except Exception as bad:
            raise NVFP4ToolError(f"task {name}: its documents cannot be read ({type(bad).__name__}: {bad})") from None
        if not docs:
            raise NVFP4ToolError(f"task {name}: no documents in its evaluation split")
        check_items(name, task, docs)
    return found


METADATA_NOTICE = "Custom kwargs can be passed to `--metadata`"  # lm-eval's, per custom_dataset task


class _MetadataNoticeFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return METADATA_NOTICE not in record.getMessage()


@contextlib.contextmanager
def _without_metadata_notice() -> Iterator[None]:
    """lm-eval's notice that a `custom_dataset` task takes kwargs from its `--metadata` option off
    while eval builds its tasks: the shipped tasks read their data with `custom_dataset`, so lm-eval
    printed it for every task, and eval has no `--metadata` to pass. Every other lm-eval message
    (a task's real warnings) still shows."""
    logger = logging.getLogger("lm_eval.api.task")
    notice = _MetadataNoticeFilter()
    logger.addFilter(notice)
    try:
        yield
    finally:
        logger.removeFilter(notice)


@contextlib.contextmanager
def _datasets_quiet() -> Iterator[None]:
    """HF datasets' progress bars ("Generating test split: ...") off while eval builds its tasks
    (our progress lines say what runs; under --quiet nothing may print)."""
    import datasets

    was = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was:
            datasets.enable_progress_bars()


def _leaves(tasks: dict) -> dict[str, Any]:
    out = {}
    for key, value in tasks.items():
        if isinstance(value, dict):
            out.update(_leaves(value))
        else:
            out[getattr(key, "group_name", key) if not isinstance(key, str) else key] = value
    return out


# ------------------------------------------------------------------------------------------ inputs


@dataclasses.dataclass
class _Inputs:
    export_dir: str
    source_path: str
    source_step: int | None
    source_named: Named
    reference_named: Named | None
    quant: str
    quant_title: str  # how the reports name the export (`ExportedModel.title`)
    task_names: list[str]
    manager: Any
    limits: dict[str, int]  # items evaluated per task
    sampled: list[str]  # generative tasks that sample (run `samples` times, averaged per item)


def check_outputs(export_dir: str, json_copy: str | None, *, force: bool) -> None:
    """Refuse (before any work) a --json copy inside the export or in a missing folder, and, without
    `force`, replacing any report eval writes (validate's check, over eval's files)."""
    from nvfp4tool.records.evaluation import EVAL_FILES
    from nvfp4tool.validate.runner import check_report_paths

    check_report_paths(export_dir, json_copy, force=force, files=EVAL_FILES)


def tokenizer_hashes(folder: str) -> dict[str, str]:
    """{tokenizer file name: sha256} of the tokenizer files a folder has."""
    return {
        name: sha256_file(os.path.join(folder, name))
        for name in TOKENIZER_FILES
        if os.path.isfile(os.path.join(folder, name))
    }


def _open_inputs(export_dir: str, options: EvalOptions) -> _Inputs:
    from nvfp4tool.check import check_checkpoint
    from nvfp4tool.checkpoints import open_checkpoint
    from nvfp4tool.formats import is_quantized_export
    from nvfp4tool.validate.custody import reference_mismatch, source_mismatch, validated_files
    from nvfp4tool.validate.runner import VALIDATE_OPTIONS, source_of

    if options.max_drop_fp8 is not None and options.reference is None:
        raise NVFP4UsageError("--max-drop-fp8: there is no FP8 column to judge without --reference")
    if options.limit is not None and options.limit < 1:
        raise NVFP4UsageError(f"--limit must be >= 1, got {options.limit}")
    names, manager = resolve_tasks(options.tasks)
    if not is_quantized_export(export_dir):
        raise NVFP4ToolError(
            f"{export_dir}: not an export (its config.json declares no quantization); "
            "eval runs an `nvfp4tool export` folder against its source"
        )
    report = check_checkpoint(export_dir)
    if not report.ok:
        raise NVFP4ToolError(report.failure("not evaluated"))
    memory.release()
    record = ExportRecord.read(export_dir) if ExportRecord.exists(export_dir) else None
    if record is None and options.source is None:
        raise NVFP4UsageError(
            f"{export_dir}: no {ExportRecord.FILE_NAME}; pass --source (the BF16 model it was made from)"
        )
    source_path, step = source_of(export_dir, options.source, record)
    source = open_checkpoint(source_path, step=step, options=VALIDATE_OPTIONS)
    mismatch = None if record is None else source_mismatch(export_dir, record, source)
    if mismatch is not None:
        raise NVFP4ToolError(f"{mismatch}: not the source the export was made from; pass the right --source")
    _same_tokenizer(export_dir, source.aux_dir or source.path, "the source")
    reference_named = None
    if options.reference is not None:
        if not is_quantized_export(options.reference):
            raise NVFP4ToolError(f"--reference {options.reference}: not an export folder")
        from nvfp4tool import formats

        quant = formats.describe(options.reference).quant
        if quant != "fp8":
            raise NVFP4ToolError(
                f"--reference {options.reference}: a {quant} export, not an FP8 one "
                "(--reference wants an `export --quant fp8` folder)"
            )
        found = None if record is None else reference_mismatch(options.reference, record)
        if found is not None:
            raise NVFP4ToolError(f"{found}: the FP8 reference must be an export of the same source")
        if not ExportRecord.exists(options.reference):
            raise NVFP4ToolError(
                f"--reference {options.reference}: no {ExportRecord.FILE_NAME}, so nothing says it "
                "is an export of the same source"
            )
        reference_report = check_checkpoint(options.reference)
        if not reference_report.ok:
            raise NVFP4ToolError(reference_report.failure("not evaluated"))
        _same_tokenizer(export_dir, options.reference, "the reference")
        reference_named = Named.of(options.reference, validated_files(options.reference))
    from nvfp4tool import formats
    from nvfp4tool.eval.lm_backend import decoding
    from nvfp4tool.export.simulate import load_export

    tasks = _build_tasks(names, manager)
    generative, sampled = [], []
    for name, task in tasks.items():
        if getattr(task, "OUTPUT_TYPE", None) == "generate_until":
            how = decoding(
                {**(task.config.generation_kwargs or {}), **(options.gen_kwargs or {})},
                options.max_gen_toks,
                origin=f"task {name}: generation_kwargs",
            )
            generative.append(name)
            if how.sample:
                sampled.append(name)
            if options.offload == "always":
                raise NVFP4UsageError(
                    f"--offload always: task {name} generates text, which needs each model held "
                    "whole (--offload auto or never)"
                )
            if how.max_gen_toks >= options.max_length:
                raise NVFP4UsageError(
                    f"--max-length {options.max_length}: task {name} generates up to "
                    f"{how.max_gen_toks} "
                    "tokens (max_gen_toks / --max-gen-toks); the context needs room too"
                )
    if options.gen_kwargs and not generative:
        raise NVFP4UsageError(f"--gen-kwargs: none of the tasks ({', '.join(tasks)}) generates text")
    if options.samples > 1 and not sampled:
        raise NVFP4UsageError(
            f"--samples {options.samples}: no task samples (greedy decoding gives the same "
            "text every time); sample with --gen-kwargs do_sample=true,temperature=T"
        )
    from nvfp4tool.eval.items import check_fewshot

    for name, task in tasks.items():
        if options.num_fewshot is not None:
            check_fewshot(name, task, options.num_fewshot, flag="--num-fewshot")
        else:
            check_fewshot(name, task, task.config.num_fewshot or 0, flag="its num_fewshot")
    sizes = {name: len(list(task.eval_docs)) for name, task in tasks.items()}
    limits = {name: size if options.limit is None else min(options.limit, size) for name, size in sizes.items()}
    return _Inputs(
        export_dir=export_dir,
        source_path=source.path,
        source_step=source.step,
        source_named=Named.of(source.path, {f: sha256_file(f) for f in source.weight_files}),
        reference_named=reference_named,
        quant=formats.describe(export_dir).quant,
        quant_title=load_export(export_dir).title,
        task_names=list(tasks),
        manager=manager,
        limits=limits,
        sampled=sampled,
    )


def _same_tokenizer(export_dir: str, other: str, what: str) -> None:
    ours, theirs = tokenizer_hashes(export_dir), tokenizer_hashes(other)
    if "tokenizer.json" not in ours and "tokenizer.model" not in ours:
        raise NVFP4ToolError(f"{export_dir}: no tokenizer (tokenizer.json); lm-eval tasks need the model's tokenizer")
    for name in sorted(set(ours) | set(theirs)):
        if name in ("tokenizer.json", "tokenizer.model") and ours.get(name) != theirs.get(name):
            raise NVFP4ToolError(
                f"{os.path.join(other, name)}: {what}'s tokenizer differs from the export's "
                f"({os.path.join(export_dir, name)}); the models would not see the same tokens"
            )


# ------------------------------------------------------------------------------------------ running


@contextlib.contextmanager
def _quiet_lm_eval() -> Iterator[None]:
    """lm-eval's own INFO / WARNING logging and its tqdm bars off (our progress lines say what runs,
    with rates, and stay lines when piped), and its `git describe` of the working directory not run
    (a hash of wherever the user stands, recorded nowhere here; outside a repository git prints
    "fatal: not a git repository" to the terminal)."""
    from unittest import mock

    import lm_eval.api.model
    import lm_eval.api.task
    import lm_eval.evaluator
    import tqdm

    def quiet(*args, **kwargs):  # lm-eval passes its own disable=False to some bars
        return tqdm.tqdm(*args, **{**kwargs, "disable": True})

    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with (
            mock.patch.object(lm_eval.api.task, "tqdm", quiet),
            mock.patch.object(lm_eval.api.model, "tqdm", quiet),
            mock.patch.object(lm_eval.evaluator, "get_git_commit_hash", lambda: None),
        ):
            yield
    finally:
        logger.setLevel(level)


def _run_model(
    label: str, path: str, inputs: _Inputs, options: EvalOptions, step: int | None = None
) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """(lm-eval results, logged samples, the backend) of one model on every task. With `samples` > 1
    the sampled generative tasks run that many times, the sampling key seeded `seed + pass` (prompts
    and few-shot examples the same each time), and their per-item scores are averaged."""
    progress.info(f"eval: {label} on {', '.join(inputs.task_names)}")
    lm = open_lm(label, path, options, step)
    results, samples = _simple_evaluate(lm, inputs.task_names, inputs, options)
    passes = {task: [samples.get(task, [])] for task in inputs.sampled}
    for k in range(1, options.samples if inputs.sampled else 1):
        progress.info(f"eval: {label}: sample {k + 1} of {options.samples} on {', '.join(inputs.sampled)}")
        lm.seed = options.seed + k
        _, again = _simple_evaluate(lm, inputs.sampled, inputs, options)
        for task in inputs.sampled:
            passes[task].append(again.get(task, []))
    for task, rows in passes.items():
        if len(rows) > 1:
            samples[task] = average_passes(task, rows)
    return results, samples, lm


def open_lm(label: str, path: str, options: EvalOptions, step: int | None = None):
    """The lm-eval model of one of eval's models (`lm_backend.open_variant` + `NVFP4ToolLM`) with
    eval's settings."""
    from nvfp4tool.eval.lm_backend import NVFP4ToolLM, open_variant

    variant = open_variant(
        path,
        label=label,
        offload=options.offload,
        step=step,
        batch_size=options.batch_size,
        max_length=options.max_length,
    )
    return NVFP4ToolLM(
        variant=variant,
        batch_size=options.batch_size,
        max_length=options.max_length,
        max_gen_toks=options.max_gen_toks,
        seed=options.seed,
    )


def _simple_evaluate(lm, tasks: list[str], inputs: _Inputs, options: EvalOptions):
    import lm_eval

    with _quiet_lm_eval():
        out = lm_eval.simple_evaluate(
            model=lm,
            tasks=list(tasks),
            task_manager=inputs.manager,
            apply_chat_template=options.chat_template and bool(lm.tokenizer.chat_template),
            gen_kwargs=options.gen_kwargs or None,
            limit=options.limit,
            num_fewshot=options.num_fewshot,
            log_samples=True,
            bootstrap_iters=0,
            random_seed=options.seed,
            numpy_random_seed=options.seed,
            torch_random_seed=options.seed,
            fewshot_random_seed=options.seed,
        )
    return out["results"], out["samples"]


def average_passes(task: str, passes: list[list[dict]]) -> list[dict]:
    """One sample row per (item, filter) whose metrics are the mean over the passes (each pass one
    sampled generation per item); the passes must have asked the same prompts of the same items."""
    first = passes[0]
    keyed = [{(r["doc_id"], r.get("filter")): r for r in rows} for rows in passes]
    out = []
    for row in first:
        key = (row["doc_id"], row.get("filter"))
        same = [k.get(key) for k in keyed]
        if any(r is None or r["prompt_hash"] != row["prompt_hash"] for r in same):
            raise NVFP4ToolError(
                f"task {task}: doc_id {row['doc_id']}: a sampling pass asked another prompt; cannot average"
            )
        averaged = dict(row)
        for name in row["metrics"]:
            values = [r.get(name) for r in same]
            if all(isinstance(v, (bool, int, float, np.number)) for v in values):
                averaged[name] = float(np.mean([float(v) for v in values]))
        out.append(averaged)
    return out


def evaluate_export(
    export_dir: str, options: EvalOptions, *, json_copy: str | None = None, force: bool = False
) -> EvalRun:
    """Check everything, run the models one at a time, pair them, write the reports."""
    from nvfp4tool.eval.report import write_reports
    from nvfp4tool.validate.custody import validated_files

    check_outputs(export_dir, json_copy, force=force)
    inputs = _open_inputs(export_dir, options)
    started = time.perf_counter()
    runs = [("bf16", inputs.source_path, inputs.source_step)]
    if options.reference is not None:
        runs.append(("fp8", options.reference, None))
    runs.append(("nvfp4", export_dir, None))
    results, samples, how, rates = {}, {}, {}, {}
    for label, path, step in runs:
        t0 = time.perf_counter()
        results[label], samples[label], lm = _run_model(label, path, inputs, options, step)
        how[label] = lm.variant.how
        chat = bool(lm.tokenizer.chat_template)
        items = sum(inputs.limits.values())
        rates[label] = items / (time.perf_counter() - t0)
        progress.info(
            f"eval: {label} done, {items} items in {time.perf_counter() - t0:.1f} s ({rates[label]:.2f} items/s)"
        )
        degeneration = _degeneration(samples[label], lm)
        for task, signs in degeneration.items():
            results[label].setdefault(task, {}).update(signs)
        del lm
        memory.release()
    record, items = _record(inputs, options, results, samples, [r[0] for r in runs])
    record = dataclasses.replace(
        record,
        chat_template=options.chat_template and chat,
        export=Named.of(export_dir, validated_files(export_dir)),
        resources={
            "seconds": time.perf_counter() - started,
            "peak_rss_bytes": memory.peak_rss_bytes(),
            "models": how,
            "items_per_s": rates,
        },
    )
    files = write_reports(record, items, export_dir, json_copy)
    return EvalRun(record=record, files=files)


# ------------------------------------------------------------------------------------------ pairing


def _per_item(task: str, rows: list[dict], label: str) -> tuple[str | None, dict[int, tuple[str, float]]]:
    """(METRIC, {doc_id: (prompt_hash, score)}) of one model's samples of one task: the first
    filter's samples, the first metric with a number in [0, 1] per item (None: no such metric)."""
    if not rows:
        return None, {}
    first_filter = rows[0].get("filter")
    rows = [r for r in rows if r.get("filter") == first_filter]
    metric = None
    for name in rows[0]["metrics"]:
        values = [r.get(name) for r in rows]
        if all(isinstance(v, (bool, int, float, np.number)) for v in values) and all(
            0 <= float(v) <= 1 for v in values
        ):
            metric = name
            break
    if metric is None:
        return None, {}
    found = {}
    for r in rows:
        if r["doc_id"] in found:
            raise NVFP4ToolError(f"task {task}: doc_id {r['doc_id']} appears twice in {label}'s samples")
        found[int(r["doc_id"])] = (str(r["prompt_hash"]), float(r[metric]))
    return metric, found


def _record(inputs: _Inputs, options: EvalOptions, results, samples, labels: list[str]):
    from importlib.metadata import version

    from nvfp4tool.eval.paired import mean_stderr, paired

    tasks: dict[str, dict[str, Any]] = {}
    item_file: dict[str, dict[str, list]] = {}
    pooled: dict[str, list[float]] = {label: [] for label in labels}
    failures: list[str] = []
    for task in inputs.task_names:
        per_model = {label: _per_item(task, samples[label].get(task, []), label) for label in labels}
        metric = per_model[labels[0]][0]
        entry: dict[str, Any] = {"metric": metric, "paired": {}}
        if metric is None:  # no per-item 0/1 scores: lm-eval's aggregates per model
            for label in labels:
                entry[label] = {"n": inputs.limits[task], **_aggregates(results[label].get(task, {}))}
            tasks[task] = entry
            continue
        docs = sorted(per_model[labels[0]][1])
        for label in labels[1:]:
            other = per_model[label][1]
            if per_model[label][0] != metric or sorted(other) != docs:
                raise NVFP4ToolError(f"task {task}: {label} was scored on other items than bf16; cannot pair")
            for d in docs:
                if other[d][0] != per_model[labels[0]][1][d][0]:
                    raise NVFP4ToolError(
                        f"task {task}: doc_id {d}: {label}'s prompt differs from bf16's "
                        "(prompt hashes differ); cannot pair"
                    )
        scores = {label: np.array([per_model[label][1][d][1] for d in docs]) for label in labels}
        for label in labels:
            signs = {k: v for k, v in results[label].get(task, {}).items() if k in _DEGENERATION}
            entry[label] = {
                metric: float(scores[label].mean()),
                "n": len(docs),
                "stderr": mean_stderr(scores[label]),
                **signs,
            }
            pooled[label].extend(scores[label].tolist())
        for label in labels[:-1]:
            entry["paired"][f"nvfp4-{label}"] = _paired_dict(paired(scores["nvfp4"], scores[label]))
        item_file[task] = {
            "doc_id": docs,
            "prompt_hash": [per_model[labels[0]][1][d][0] for d in docs],
            **{label: scores[label].tolist() for label in labels},
        }
        tasks[task] = entry
        failures += _drop_failures(task, entry["paired"], options)
    overall: dict[str, Any] = {"paired": {}}
    if pooled[labels[0]]:
        for label in labels:
            values = np.array(pooled[label])
            overall[label] = {"score": float(values.mean()), "n": int(values.size), "stderr": mean_stderr(values)}
        for label in labels[:-1]:
            overall["paired"][f"nvfp4-{label}"] = _paired_dict(
                paired(np.array(pooled["nvfp4"]), np.array(pooled[label]))
            )
        if len([t for t in tasks.values() if t["paired"]]) > 1:
            failures += _drop_failures("overall", overall["paired"], options)
    record = EvalRecord(
        export=Named(name="", sha256={}),
        quant=inputs.quant,
        quant_title=inputs.quant_title,
        source=inputs.source_named,
        reference=inputs.reference_named,
        labels=labels,
        tasks=tasks,
        overall=overall,
        limit=options.limit,
        seed=options.seed,
        max_drop=options.max_drop,
        max_drop_fp8=options.max_drop_fp8,
        failures=failures,
        passed=not failures,
        lm_eval_version=version("lm_eval"),
        resources={},
        gen_kwargs=options.gen_kwargs or None,
        samples=options.samples if inputs.sampled else 1,
        sampled_tasks=list(inputs.sampled),
    )
    return record, EvalItems(tasks=item_file)


_DEGENERATION = ("mean_output_tokens", "hit_max_gen_toks", "repeated_4gram_rate")


def _degeneration(samples: dict[str, list[dict]], lm) -> dict[str, dict[str, float]]:
    """Per generative task: mean output length (tokens), share of outputs that ran to max_gen_toks,
    repeated 4-gram rate (share of an output's 4-grams seen earlier in it, averaged)."""
    from nvfp4tool.eval.lm_backend import gen_key

    out = {}
    for task, rows in samples.items():
        first = {}
        for r in rows:
            first.setdefault(r["doc_id"], r)  # one row per item (a task with several filters repeats it)
        outputs = [
            o
            for r in first.values()
            for a in r["arguments"]
            if isinstance(a, (list, tuple)) and len(a) == 2 and isinstance(a[1], dict)
            for o in lm.generated.get(gen_key(a), [])
        ]
        if not outputs:
            continue
        lengths = [len(tokens) for tokens, _ in outputs]
        repeats = [_repeated_ngrams(tokens) for tokens, _ in outputs if len(tokens) >= NGRAM]
        out[task] = {
            "mean_output_tokens": float(np.mean(lengths)),
            "hit_max_gen_toks": float(np.mean([hit for _, hit in outputs])),
            "repeated_4gram_rate": float(np.mean(repeats)) if repeats else 0.0,
        }
    return out


def _repeated_ngrams(tokens: list[int]) -> float:
    grams = [tuple(tokens[i : i + NGRAM]) for i in range(len(tokens) - NGRAM + 1)]
    return 1.0 - len(set(grams)) / len(grams)


def _aggregates(result: dict[str, Any]) -> dict[str, float]:
    """lm-eval's aggregate metrics of a task ("word_perplexity,none" -> "word_perplexity"), numbers only."""
    out = {}
    for key, value in result.items():
        name, _, _ = key.partition(",")
        if name in ("alias", "samples") or name.endswith("_stderr") or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)) and np.isfinite(value):
            out.setdefault(name, float(value))
    return out


def _paired_dict(stats) -> dict[str, Any]:
    values = dataclasses.asdict(stats)
    values.pop("n")
    if values["ci95"] is not None:
        values["ci95"] = [float(v) for v in values["ci95"]]
    return values


DROP_FLAGS = {"nvfp4-bf16": ("max_drop", "--max-drop"), "nvfp4-fp8": ("max_drop_fp8", "--max-drop-fp8")}


def _drop_failures(task: str, paired_stats: dict[str, Any], options: EvalOptions) -> list[str]:
    """The thresholds' verdict on one task's (or overall's) paired differences: a line per pair whose
    95% interval's lower end (the difference itself when n = 1) is below -its max drop."""
    out = []
    for pair, (field, flag) in DROP_FLAGS.items():
        max_drop, stats = getattr(options, field), paired_stats.get(pair)
        if max_drop is None or stats is None:
            continue
        low = stats["ci95"][0] if stats["ci95"] is not None else stats["diff"]
        if low < -max_drop:
            out.append(
                f"{task}: {pair.replace('-', ' - ')} 95% interval reaches {low:+.4f} "
                f"(diff {stats['diff']:+.4f}), below -{max_drop:g} ({flag})"
            )
    return out
