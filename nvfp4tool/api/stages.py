"""The API of the stages that make checkpoints: `convert`, `train` (and `plot` of its runs), `export`,
`convert_format`.

Each takes its command's arguments positionally and its options as keywords, with the defaults of
the library's options (the CLI reads them from here), and returns what the stage wrote.
Design notes: docs/design/cli.md.
"""

from __future__ import annotations

import typing
from typing import TYPE_CHECKING, Annotated, Any

from converters.layout import ROPE_LAYOUTS
from nvfp4tool import formats, memory
from nvfp4tool.api.rules import COUNT, FILE, FOLDER, NEW_FILE, SEQ_LEN, OneOf, Range, Size, checked, default
from nvfp4tool.convert import FORMATS as CONVERT_FORMATS
from nvfp4tool.convert import OUTPUT_DTYPES, ConvertSummary, convert_checkpoint
from nvfp4tool.errors import NVFP4UsageError
from nvfp4tool.export import ExportOptions, ExportSummary, export_checkpoint, recipes
from nvfp4tool.export.convert_format import FormatConversion
from nvfp4tool.export.convert_format import convert_format as convert_export_format
from nvfp4tool.export.equalize import METHODS as EQUALIZE_METHODS
from nvfp4tool.export.gptq import BLOCK_SCALES
from nvfp4tool.export.job import WEIGHT_ROUNDINGS
from nvfp4tool.export.scale_search import METHODS as SCALE_SEARCHES
from nvfp4tool.numerics.nvfp4 import Block

if TYPE_CHECKING:
    from nvfp4tool.train.trainer import TrainResult

_EXPORT = ExportOptions()  # the export defaults
WEIGHT_BLOCKS = typing.get_args(Block)  # 1d, 2d
KV_CACHES = ("none", *formats.KV_CACHES)


@checked
def convert(
    src: str,
    dst: str,
    *,
    to: Annotated[str, OneOf(CONVERT_FORMATS)],
    scan_layers: bool = default(convert_checkpoint, "scan_layers"),
    model_config: str | None = default(convert_checkpoint, "model_config"),
    rope_layout: Annotated[str | None, OneOf(ROPE_LAYOUTS)] = default(convert_checkpoint, "rope_layout"),
    dtype: Annotated[str | None, OneOf(OUTPUT_DTYPES)] = default(convert_checkpoint, "dtype"),
    max_shard_size: Annotated[str | int, Size()] = default(convert_checkpoint, "max_shard_size"),
    force: bool = default(convert_checkpoint, "force"),
) -> ConvertSummary:
    """`nvfp4tool convert SRC DST --to hf|maxtext`: convert or reshard a checkpoint."""
    return convert_checkpoint(
        src,
        dst,
        to=to,
        model_config=model_config,
        scan_layers=scan_layers,
        rope_layout=rope_layout,
        dtype=dtype,
        max_shard_size=max_shard_size,
        force=force,
    )


def train(config: str | None = None, *overrides: str, **keys: Any) -> TrainResult:
    """`nvfp4tool train [CONFIG.yaml] [key=value ...]`: the YAML file's keys, then the `key=value`
    texts (parsed as the command line's), then `keys` (Python values, checked against each key's
    type); returns the `TrainResult` (its run folder holds run.json, metrics.jsonl, hf/)."""
    from nvfp4tool.run.config import load_train_config
    from nvfp4tool.train.trainer import train as run_training

    return run_training(load_train_config(config, list(overrides), keys))


@checked
def plot(
    *runs: Annotated[str, FOLDER], out: Annotated[str, NEW_FILE] = "loss.png", labels: tuple[str, ...] = ()
) -> dict[str, dict]:
    """`nvfp4tool plot RUN... -o PNG`: the runs' loss curves overlaid and their relative gap to the
    first; returns the plotted series (also written as JSON beside the PNG)."""
    from nvfp4tool.train.metrics import plot_runs

    if not runs:
        raise NVFP4UsageError("plot: no RUN given")
    if labels and len(labels) != len(runs):
        raise NVFP4UsageError(f"{len(labels)} --label for {len(runs)} runs")
    return plot_runs(list(runs), out, list(labels) or None)


@checked
def export(
    source: str,
    out: str,
    *,
    recipe: Annotated[str | None, OneOf(recipes.names())] = None,
    format: Annotated[str, OneOf(formats.FORMATS)] = _EXPORT.format,
    quant: Annotated[str, OneOf(formats.QUANTS)] = _EXPORT.quant,
    calib_data: Annotated[str | None, FILE] = _EXPORT.calib_data,
    calib_samples: Annotated[int, COUNT] = _EXPORT.calib_samples,
    calib_seq_len: Annotated[int, SEQ_LEN] = _EXPORT.calib_seq_len,
    offload: Annotated[str, OneOf(memory.OFFLOAD_MODES)] = _EXPORT.offload,
    kv_cache: Annotated[str, OneOf(KV_CACHES)] = _EXPORT.kv_cache,
    keep_bf16: tuple[str, ...] = _EXPORT.keep_bf16,
    keep_bf16_file: Annotated[str | None, FILE] = _EXPORT.keep_bf16_file,
    precision_file: Annotated[str | None, FILE] = _EXPORT.precision_file,
    auto_precision: Annotated[float | None, Range(low=0, low_open=True)] = _EXPORT.auto_precision,
    auto_precision_samples: Annotated[int, Range(low=1, integer=True)] = _EXPORT.auto_precision_samples,
    scale_search: Annotated[str, OneOf(SCALE_SEARCHES)] = _EXPORT.scale_search,
    weight_rounding: Annotated[str, OneOf(WEIGHT_ROUNDINGS)] = _EXPORT.weight_rounding,
    equalize: Annotated[str, OneOf(EQUALIZE_METHODS)] = _EXPORT.equalize,
    gptq_damp: float = _EXPORT.gptq_damp,
    gptq_block_scales: Annotated[str, OneOf(BLOCK_SCALES)] = _EXPORT.gptq_block_scales,
    weight_block: Annotated[str | None, OneOf(WEIGHT_BLOCKS)] = _EXPORT.weight_block,
    max_shard_size: Annotated[str | int, Size()] = _EXPORT.max_shard_size,
    step: Annotated[int | None, Range(low=0, integer=True)] = _EXPORT.step,
    model_config: str | None = _EXPORT.model_config,
    rope_layout: Annotated[str | None, OneOf(ROPE_LAYOUTS)] = _EXPORT.rope_layout,
    force: bool = _EXPORT.force,
) -> ExportSummary:
    """`nvfp4tool export SOURCE --out OUT`: an NVFP4 / FP8 serving checkpoint of `source` (an HF
    folder, a MaxText checkpoint or a training run); the summary's `.record` is the ExportRecord
    written as OUT/nvfp4tool_export.json. `recipe`: a named combination of the options
    (`export.recipes`), under any option set to other than its default."""
    if calib_data is None:
        given = {"calib_samples": calib_samples, "calib_seq_len": calib_seq_len}
        sized = [name for name, value in given.items() if value != getattr(_EXPORT, name)]
        if sized:
            raise NVFP4UsageError(f"{sized[0]} sizes the calibration: it needs calib_data (or drop {sized[0]})")
    if auto_precision is None and auto_precision_samples != _EXPORT.auto_precision_samples:
        raise NVFP4UsageError(
            "auto_precision_samples sizes the auto-precision search: it needs auto_precision "
            "(or drop auto_precision_samples)"
        )
    options = ExportOptions(
        format=format,
        quant=quant,
        scale_search=scale_search,
        weight_rounding=weight_rounding,
        equalize=equalize,
        gptq_damp=gptq_damp,
        gptq_block_scales=gptq_block_scales,
        weight_block=weight_block,
        keep_bf16=tuple(keep_bf16),
        keep_bf16_file=keep_bf16_file,
        precision_file=precision_file,
        auto_precision=auto_precision,
        auto_precision_samples=auto_precision_samples,
        calib_data=calib_data,
        calib_samples=calib_samples,
        calib_seq_len=calib_seq_len,
        offload=offload,
        kv_cache=kv_cache,
        max_shard_size=max_shard_size,
        step=step,
        model_config=model_config,
        rope_layout=rope_layout,
        force=force,
    )
    if recipe is not None:
        options = recipes.apply_recipe(options, recipe, given=recipes.set_fields(options))
    return export_checkpoint(source, out, options)


@checked
def convert_format(
    src: Annotated[str, FOLDER],
    out: str,
    *,
    to: Annotated[str, OneOf(formats.FORMATS)],
    force: bool = default(convert_export_format, "force"),
) -> FormatConversion:
    """`nvfp4tool convert-format SRC OUT --to LAYOUT`: the export rewritten losslessly in the other
    layout; `.record` is the ExportRecord carried over into OUT (None when SRC had none)."""
    return convert_export_format(src, out, to=to, force=force)
