"""Command-line wiring only: parse options, call one `nvfp4tool.api` function, turn errors into exit codes.

Exit codes: 0 success; 1 a failed check or bad data (`NVFP4ToolError`, or an OS error naming a
file); 2 bad usage (`NVFP4UsageError`, bad option values rejected by the click types). A traceback
only with `-v`. `main` turns SIGTERM into SystemExit; every command runs with a progress reporter.
Design notes: docs/design/cli.md.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import threading

import click

from nvfp4tool import __version__, api, progress
from nvfp4tool.api import rules
from nvfp4tool.api.rules import default, rule
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError


class _Group(click.Group):
    """A click group that prints user errors as one line and hides tracebacks unless verbose."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except NVFP4UsageError as exc:
            if _verbose(ctx):
                raise
            raise click.UsageError(str(exc), ctx) from None
        except NVFP4ToolError as exc:
            if _verbose(ctx):
                raise
            raise click.ClickException(str(exc)) from None
        except BrokenPipeError:  # the reader closed stdout (`| head`): stop quietly, as Unix tools do
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
            raise SystemExit(128 + signal.SIGPIPE) from None
        except Exception as exc:  # an internal error: one line unless --verbose
            if _verbose(ctx):
                raise
            if isinstance(exc, OSError) and exc.filename:  # the user's file (a folder, no permission, disk full)
                raise click.ClickException(f"{exc.filename}: {exc.strerror or exc}") from None
            raise click.ClickException(
                f"internal error: {type(exc).__name__}: {exc} (rerun with --verbose for the traceback)"
            ) from None


def _verbose(ctx: click.Context) -> bool:
    return bool(ctx.obj and ctx.obj.get("verbose"))


# ---------------------------------------------------------------------------------------- option types


class _FiniteFloat(click.FloatRange):
    """A float in a range that must also be finite (click's FloatRange lets nan and inf through)."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number

    def _describe_range(self) -> str:
        """The range in --help: "finite" without bounds (click's own would print "x<=None")."""
        if self.min is None and self.max is None:
            return "any finite number"
        return super()._describe_range()


class _NewFile(click.Path):
    """A file the command writes: not a folder, and its folder must exist."""

    def __init__(self) -> None:
        super().__init__(dir_okay=False)

    def convert(self, value, param, ctx):
        path = super().convert(value, param, ctx)
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            self.fail(f"{path!r}: folder {folder!r} does not exist.", param, ctx)
        return path


_COUNT = click.IntRange(min=1)  # a number of things: samples, steps, tokens...


def _api(fn, name: str) -> dict:
    """The click `type` (or `callback`) and `default` of the option of keyword `name` of the API
    function `fn`: the API owns each option's rule and default (`nvfp4tool.api.rules`)."""
    return {**_checks(fn, name), "default": default(fn, name)}


def _checks(fn, name: str) -> dict:
    """The click type that applies the rule on keyword `name` of `fn`, or for a rule click has no
    type for, a callback that applies it: a bad value exits 2 before the library runs."""
    found = rule(fn, name)
    if isinstance(found, rules.Range):
        bounds = {"min": found.low, "max": found.high, "min_open": found.low_open}
        return {"type": click.IntRange(**bounds) if found.integer else _FiniteFloat(**bounds)}
    if isinstance(found, rules.OneOf):
        return {"type": click.Choice(list(found.choices))}
    if isinstance(found, rules.Exists):
        return {"type": click.Path(exists=True, file_okay=found.file, dir_okay=found.folder)}
    if isinstance(found, rules.NewFile):
        return {"type": _NewFile()}
    if found is None:
        raise TypeError(f"{fn.__qualname__}: {name} has no rule")

    def apply(ctx: click.Context, param: click.Parameter, value):
        problem = None if value is None else found.problem(value)
        if problem is not None:
            raise click.BadParameter(f"{value!r} is {problem}.", ctx, param)
        return value

    return {"callback": apply}


def _offload(fn):
    """The --offload option of the command of API function `fn`."""
    return click.option(
        "--offload",
        **_api(fn, "offload"),
        show_default=True,
        help="Run the model held in memory (never), streamed layer by layer from its files (always: peak = "
        "one layer + embeddings/LM head + activations), or decide from its size and the free memory (auto).",
    )


def _size(ctx: click.Context, param: click.Parameter, value: str) -> str:
    """--max-shard-size: parsed once here (converters.hf.parse_size owns the syntax) so a bad one exits 2."""
    from converters.hf import parse_size

    try:
        parse_size(value)
    except NVFP4ToolError as bad:
        raise click.BadParameter(str(bad), ctx, param) from None
    return value


def _tp(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    """--tp: parsed by nvfp4tool.check.parse_tp (the owner of its syntax)."""
    from nvfp4tool.check import parse_tp

    try:
        return parse_tp(value)
    except NVFP4UsageError as bad:
        raise click.BadParameter(str(bad), ctx, param) from None


def _damp(ctx: click.Context, param: click.Parameter, value: float) -> float:
    """export --gptq-damp: finite, in nvfp4tool.export.gptq.DAMP_RANGE (0 < damp <= 1, the owner)."""
    from nvfp4tool.export.gptq import DAMP_RANGE

    low, high = DAMP_RANGE
    if not low < value <= high:  # also nan (and inf, 1e300)
        raise click.BadParameter(
            f"{value!r} is not > {low:g} and <= {high:g} (a fraction of the mean Hessian diagonal; default 0.05).",
            ctx,
            param,
        )
    return value


# ---------------------------------------------------------------------------------------- commands


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="nvfp4tool")
@click.option("-v", "--verbose", is_flag=True, help="Show debug logging and full tracebacks.")
@click.option(
    "-q", "--quiet", is_flag=True, help="No progress (bars, lines) or status lines; results, warnings and errors only."
)
@click.option(
    "--log-format",
    type=click.Choice(progress.LOG_FORMATS),
    default="auto",
    show_default=True,
    envvar=progress.LOG_FORMAT_ENV,
    show_envvar=True,
    help="Progress and status on stderr: rich (bars), text (timestamped lines at most every "
    f"{progress.INTERVAL_S:g} s per stage: done/total, throughput, elapsed, ETA), json (the same "
    "as one JSON object a line), auto (rich on a terminal, text otherwise).",
)
@click.pass_context
def cli(ctx: click.Context, verbose: bool, quiet: bool, log_format: str) -> None:
    """nvfp4tool: NVFP4 training, export and validation of language models in JAX (dense, MoE, hybrid).

    \b
    Example:
      nvfp4tool convert ./Llama-3.2-1B ./llama-maxtext --to maxtext --model-config llama3.2-1b
    """
    if verbose and quiet:
        raise click.UsageError("--verbose and --quiet contradict each other", ctx)
    ctx.ensure_object(dict)
    ctx.obj["verbose"] = verbose
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.ERROR if quiet else logging.WARNING, format="%(message)s"
    )
    previous = progress.use_reporter(progress.for_cli(quiet=quiet, log_format=log_format))
    ctx.call_on_close(lambda: progress.use_reporter(previous))


@cli.command("convert", short_help="Convert between HF safetensors and MaxText, or reshard")
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@click.option("--to", "to", **_checks(api.convert, "to"), required=True, help="Output format.")
@click.option(
    "--scan-layers/--no-scan-layers",
    default=default(api.convert, "scan_layers"),
    show_default=True,
    help="MaxText output: stack the layers (decoder/layers, layer axis 1) or not.",
)
@click.option(
    "--model-config",
    default=default(api.convert, "model_config"),
    help="HF config.json, HF folder, or MaxText model name (e.g. llama3.1-8b). Required for a MaxText source.",
)
@click.option(
    "--rope-layout",
    **_api(api.convert, "rope_layout"),
    help="RoPE row layout on the MaxText side (default: from the MaxText model name; "
    "a family whose MaxText decoder fixes one always has it: docs/commands/convert.md).",
)
@click.option(
    "--dtype",
    **_api(api.convert, "dtype"),
    help="Output dtype (MaxText default fp32; HF default: the model config's).",
)
@click.option(
    "--max-shard-size",
    default=default(api.convert, "max_shard_size"),
    show_default=True,
    callback=_size,
    help="HF output shard size.",
)
@click.option("--force", is_flag=True, default=default(api.convert, "force"), help="Replace DST if it exists.")
def convert_command(
    src: str,
    dst: str,
    to: str,
    scan_layers: bool,
    model_config: str | None,
    rope_layout: str | None,
    dtype: str | None,
    max_shard_size: str,
    force: bool,
) -> None:
    """Convert a checkpoint between HF safetensors and MaxText (Orbax), or reshard an HF folder.

    \b
    Example:
      nvfp4tool convert ./Llama-3.1-8B ./ckpt --to maxtext --model-config llama3.1-8b
      nvfp4tool convert ./ckpt/0/items ./hf --to hf --model-config llama3.1-8b
    """
    summary = api.convert(
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
    click.echo(summary.line())


class _TrainCommand(click.Command):
    """`train --help`: the options, then every key of TrainConfig (type, default, one line)."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        from nvfp4tool.run.config import key_table

        super().format_options(ctx, formatter)
        with formatter.section("Keys (key=value, or in CONFIG.yaml; table: --list-keys)"):
            formatter.write_dl(
                [(key, f"{text}  [{kind}; default: {default}]") for key, kind, default, text in key_table()]
            )


def _list_keys(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    """train --list-keys: the key table, in full, then exit."""
    if not value or ctx.resilient_parsing:
        return
    from nvfp4tool.run.config import key_table

    rows = [("key", "type", "default", "description")] + key_table()
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[3])
    ctx.exit(0)


@cli.command(
    "train",
    cls=_TrainCommand,
    context_settings={"ignore_unknown_options": True},
    short_help="Train or fine-tune with a precision recipe (NVFP4, FP8)",
)
@click.argument("args", nargs=-1)
@click.option(
    "--list-keys",
    is_flag=True,
    is_eager=True,
    expose_value=False,
    callback=_list_keys,
    help="Print every config key with its type, default and description, and exit.",
)
def train_command(args: tuple[str, ...]) -> None:
    """Train or fine-tune with a precision recipe: [CONFIG.yaml] [key=value ...].

    Every key of the YAML file can be overridden on the command line; the keys are listed below
    (`--list-keys` prints them as a table).

    \b
    Example:
      nvfp4tool train model=tiny data=corpus.txt recipe=nvfp4 steps=60 out=runs/a
      nvfp4tool train run.yaml lr=3e-4 resume=true
    """
    yaml_path = args[0] if args and "=" not in args[0] else None
    result = api.train(yaml_path, *(args[1:] if yaml_path else args))
    if result.losses:
        last = max(result.losses)
        eval_text = f", eval loss {result.eval_losses[last]:.4f}" if last in result.eval_losses else ""
        click.echo(f"step {last}: train loss {result.losses[last]:.4f}{eval_text}; {result.tokens_per_s:,.0f} tokens/s")
    click.echo(f"run folder: {result.out}  (metrics.jsonl, loss.png, checkpoints/, hf/)")


@cli.group("data", short_help="Prepare and verify token caches for train")
def data_group() -> None:
    """Tokenize training data once into a token cache (`data prepare`) that `train data=CACHE`
    memory-maps, and check a cache (`data verify`).

    \b
    Example:
      nvfp4tool data prepare corpus/ --tokenizer tok/ --out cache/
      nvfp4tool train data=cache/ tokenizer=tok/ out=runs/a
    """


@data_group.command("prepare", short_help="Tokenize documents into a token cache")
@click.argument("sources", nargs=-1, required=True, **_checks(api.prepare_data, "sources"))
@click.option(
    "--tokenizer",
    "tokenizer",
    required=True,
    **_checks(api.prepare_data, "tokenizer"),
    help="Folder with tokenizer.json.",
)
@click.option("--out", "out", required=True, type=click.Path(), help="Cache folder to write (atomically).")
@click.option(
    "--text-field",
    default=default(api.prepare_data, "text_field"),
    show_default=True,
    help="JSONL key / Parquet or dataset column holding the documents.",
)
@click.option(
    "--format",
    "data_format",
    **_api(api.prepare_data, "format"),
    show_default=True,
    help="text: documents; chat: rows of `messages`; prompt_completion: rows of `prompt` and `completion`.",
)
@click.option(
    "--loss-on",
    **_api(api.prepare_data, "loss_on"),
    help="chat: assistant (default) | all; prompt_completion: completion (default) | all.",
)
@click.option(
    "--overlong",
    **_api(api.prepare_data, "overlong"),
    help="chat / prompt_completion: a row longer than --seq-len + 1 tokens is dropped (default) or truncated.",
)
@click.option(
    "--seq-len",
    **_api(api.prepare_data, "seq_len"),
    help="chat / prompt_completion: the row length --overlong holds rows to (default: no limit).",
)
@click.option(
    "--workers",
    **_api(api.prepare_data, "workers"),
    show_default=True,
    help="Tokenizer worker processes (0: tokenize in this process).",
)
@click.option(
    "--shard-tokens",
    **_api(api.prepare_data, "shard_tokens"),
    show_default=True,
    help="Tokens per shard file.",
)
@click.option(
    "--force", is_flag=True, default=default(api.prepare_data, "force"), help="Replace an existing cache folder."
)
def data_prepare_command(
    sources: tuple[str, ...],
    tokenizer: str,
    out: str,
    text_field: str,
    data_format: str,
    loss_on: str | None,
    overlong: str | None,
    seq_len: int | None,
    workers: int,
    shard_tokens: int,
    force: bool,
) -> None:
    """Tokenize SOURCE... (text / JSONL / Parquet files or folders, `save_to_disk` datasets, read in
    the order given) into a token cache for `train data=CACHE`.

    \b
    Example:
      nvfp4tool data prepare corpus.jsonl more/ --tokenizer tok/ --out cache/ --workers 8
      nvfp4tool data prepare chats.jsonl --format chat --seq-len 2048 --tokenizer tok/ --out sft-cache/
    """
    manifest = api.prepare_data(
        *sources,
        tokenizer=tokenizer,
        out=out,
        text_field=text_field,
        format=data_format,
        loss_on=loss_on,
        overlong=overlong,
        seq_len=seq_len,
        workers=workers,
        shard_tokens=shard_tokens,
        force=force,
    )
    sft = manifest.sft
    loss = "" if sft is None else f", {sft.loss_share:.1%} carrying loss"
    click.echo(
        f"{out}: {manifest.documents:,} documents, {manifest.tokens:,} {manifest.dtype} tokens{loss} "
        f"in {len(manifest.shards)} shard(s)"
    )


@data_group.command("verify", short_help="Rehash a token cache and its sources")
@click.argument("cache", **_checks(api.verify_data, "cache"))
@click.option(
    "--skip-sources",
    is_flag=True,
    default=default(api.verify_data, "skip_sources"),
    help="Check only the cache's own files, not the source files it records.",
)
def data_verify_command(cache: str, skip_sources: bool) -> None:
    """Check every file of CACHE against its manifest's sha256 and, unless --skip-sources, each
    source file it records against its recorded sha256 (a source given to prepare as a relative
    path is found from the cache folder, from any current folder).

    \b
    Example:
      nvfp4tool data verify cache/
    """
    opened = api.verify_data(cache, skip_sources=skip_sources)
    manifest = opened.manifest
    sources = "" if skip_sources else f"; its {len(manifest.sources)} source file(s) unchanged"
    click.echo(
        f"{cache}: ok: {len(manifest.shards)} shard(s), {manifest.tokens:,} tokens, "
        f"{manifest.documents:,} documents{sources}"
    )


@cli.command("plot", short_help="Overlay training runs' loss curves and their gap")
@click.argument("runs", nargs=-1, required=True, **_checks(api.plot, "runs"))
@click.option(
    "-o",
    "--out",
    "out_png",
    **_api(api.plot, "out"),
    show_default=True,
    help="PNG to write (a JSON of the plotted series is written beside it).",
)
@click.option(
    "--label",
    "labels",
    multiple=True,
    default=default(api.plot, "labels"),
    help="Legend label per run (default: folder names).",
)
def plot_command(runs: tuple[str, ...], out_png: str, labels: tuple[str, ...]) -> None:
    """Overlay training runs' loss curves and their relative gap to the first run.

    \b
    Example:
      nvfp4tool plot runs/bf16 runs/nvfp4 -o compare.png
    """
    series = api.plot(*runs, out=out_png, labels=labels)
    for label, s in series.items():
        if s["loss"]:
            click.echo(f"{label}: {len(s['loss'])} steps, final loss {s['loss'][-1]:.4f}")
    click.echo(f"wrote {out_png}")


@cli.command("check", short_help="Check an NVFP4/FP8 serving checkpoint before serving")
@click.argument("path", **_checks(api.check, "path"))
@click.option(
    "--tp",
    default=",".join(str(degree) for degree in default(api.check, "tp")),
    show_default=True,
    callback=_tp,
    help="Tensor-parallel degrees to check the K/N splits for, comma-separated (e.g. 1,2,4,8).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout instead of the table.")
@click.option("--json-out", **_api(api.check, "json_out"), help="Also write the JSON report to this file.")
def check_command(path: str, tp: tuple[int, ...], as_json: bool, json_out: str | None) -> None:
    """Check an NVFP4/FP8 serving checkpoint (ModelOpt or compressed-tensors) before serving it.

    Prints one line per problem (module: tensor: what is wrong) and a table of the quantized
    modules; exits 1 if there is any problem.

    \b
    Example:
      nvfp4tool check ./llama-nvfp4 --tp 1,2,4,8
      nvfp4tool check ./llama-nvfp4 --json > report.json
    """
    import json

    from rich.console import Console

    from nvfp4tool.check import print_report

    report = api.check(path, tp=tp, json_out=json_out)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        print_report(report, Console())
    if not report.ok:
        raise NVFP4ToolError(report.failure())


@cli.command("export", short_help="Export a model as an NVFP4 / FP8 serving checkpoint")
@click.argument("src", type=click.Path())
@click.option(
    "--to",
    "to",
    type=click.Choice(["safetensors"]),
    default="safetensors",
    show_default=True,
    hidden=True,
    help="Output container; safetensors is the only one (accepted for older scripts).",
)
@click.option("--out", "out", required=True, type=click.Path(), help="Output folder (written atomically).")
@click.option(
    "--recipe",
    **_api(api.export, "recipe"),
    help="A named combination of the options below that we stand behind (docs/commands/export.md#recipes: "
    "what each costs and gave on SmolLM2-135M); an option you also set wins over the recipe's.",
)
@click.option(
    "--format",
    "fmt",
    **_api(api.export, "format"),
    show_default=True,
    help="modelopt: vLLM modelopt_fp4 / TensorRT-LLM / SGLang; "
    "compressed-tensors: vLLM compressed-tensors / transformers.",
)
@click.option(
    "--quant",
    **_api(api.export, "quant"),
    show_default=True,
    help="nvfp4 = W4A4, nvfp4-weight-only = W4A16, fp8 = W8A8 per tensor.",
)
@click.option(
    "--calib-data",
    **_api(api.export, "calib_data"),
    help="Calibration text (.txt/.jsonl) or token ids (.npy) for the input scales, GPTQ, --equalize and the "
    "KV-cache scales (an error where none of them is needed).",
)
@click.option(
    "--calib-samples",
    **_api(api.export, "calib_samples"),
    show_default=True,
    help="Most calibration windows used (a file with fewer: said and recorded); needs --calib-data.",
)
@click.option(
    "--calib-seq-len",
    **_api(api.export, "calib_seq_len"),
    show_default=True,
    help="Most tokens per calibration window (shorter rows: said and recorded); needs --calib-data.",
)
@_offload(api.export)
@click.option(
    "--kv-cache",
    **_api(api.export, "kv_cache"),
    show_default=True,
    help="fp8: calibrate every attention layer's K (after RoPE) / V amax and write FP8 KV-cache "
    "scales (amax / 448) and the config keys engines read (needs --calib-data).",
)
@click.option(
    "--keep-bf16",
    multiple=True,
    default=default(api.export, "keep_bf16"),
    help="fnmatch pattern of linear modules kept in BF16 (repeatable; default: none beyond the run's).",
)
@click.option(
    "--keep-bf16-file",
    **_api(api.export, "keep_bf16_file"),
    help="File of --keep-bf16 patterns, one pattern or module name per line, # comments (e.g. the "
    "keep_bf16.txt of `validate --sensitivity`); a pattern matching no module is refused. "
    "Default: none.",
)
@click.option(
    "--precision-file",
    **_api(api.export, "precision_file"),
    help="File of per-linear formats, one 'PATTERN FORMAT' line each (fnmatch over module names, "
    "e.g. 'model.layers.1.self_attn.* fp8'; FORMAT nvfp4, nvfp4-weight-only, fp8 or bf16; # comments; "
    "the last matching line wins; modules no line matches take --quant): one mixed-precision "
    "checkpoint. A fused group (q/k/v, gate/up) split across formats is refused. Default: none.",
)
@click.option(
    "--auto-precision",
    **_api(api.export, "auto_precision"),
    metavar="KL",
    help="Choose each linear's format (--quant, then fp8, then bf16; a fused group as one) for the fewest "
    "bits per weight whose mean KL vs BF16, measured on the calibration windows with the mix run as served, "
    "is <= 0.9 x KL nats; writes auto_precision.json / .png beside the export (needs --calib-data).",
)
@click.option(
    "--auto-precision-samples",
    **_api(api.export, "auto_precision_samples"),
    metavar="N",
    show_default=True,
    help="The --auto-precision search scores on the N windows of --calib-data that follow the "
    "--calib-samples calibration windows: text that GPTQ, --equalize and the input amax never fitted.",
)
@click.option(
    "--scale-search",
    **_api(api.export, "scale_search"),
    show_default=True,
    help="NVFP4 block scales: rtn = the standard amax scale of each 16-value block; 4over6 = per block "
    "the better of the scales mapping its amax to 6 or to 4; mse = per block the E4M3 scale among the "
    "RTN one and its neighbours with the least squared error (the stored format is standard either way).",
)
@click.option(
    "--weight-rounding",
    **_api(api.export, "weight_rounding"),
    show_default=True,
    help="gptq: error-compensating rounding with each linear's calibration Hessian, layer by layer "
    "(needs --calib-data; NVFP4 only; the scales stay those of --scale-search).",
)
@click.option(
    "--equalize",
    **_api(api.export, "equalize"),
    show_default=True,
    help="Equivalent scaling before quantizing, folded into the preceding norm or linear (a plain "
    "checkpoint, the same function in BF16, checked): awq = per site the scale mean|x|^alpha with "
    "the least NVFP4 output error; smoothquant = max|x|^0.5 / max|w|^0.5 (needs --calib-data; NVFP4).",
)
@click.option(
    "--gptq-damp",
    type=float,
    default=default(api.export, "gptq_damp"),
    show_default=True,
    callback=_damp,
    help="GPTQ damping: H += damp * mean(diag H) * I; 0 < damp <= 1.",
)
@click.option(
    "--gptq-block-scales",
    **_api(api.export, "gptq_block_scales"),
    show_default=True,
    help="GPTQ's block scales: original = chosen first on the original weight by --scale-search (RTN's); "
    "updated = each 16-column block's chosen by --scale-search when GPTQ reaches it, on the weights "
    "its earlier columns' errors have updated (as the reference GPTQ's groups). Needs --weight-rounding "
    "gptq.",
)
@click.option(
    "--weight-block",
    **_api(api.export, "weight_block"),
    help="Block scaling of the weights (default: the run's, 2d for nvfp4 runs; else 1d).",
)
@click.option(
    "--max-shard-size",
    default=default(api.export, "max_shard_size"),
    show_default=True,
    callback=_size,
    help="Largest safetensors file written (e.g. 500MB, 5GB); bigger models are split.",
)
@click.option(
    "--step",
    **_api(api.export, "step"),
    help="Training run: export this checkpoint step (default: the final weights).",
)
@click.option(
    "--model-config",
    default=default(api.export, "model_config"),
    help="MaxText source: MaxText model name (e.g. llama3.1-8b) or HF config.json / folder "
    "(required for a MaxText source; default: none).",
)
@click.option(
    "--rope-layout",
    **_api(api.export, "rope_layout"),
    help="MaxText source with an HF --model-config: its RoPE row layout (default: the one the family "
    "fixes, docs/commands/convert.md; else required).",
)
@click.option("--force", is_flag=True, default=default(api.export, "force"), help="Replace an existing output folder.")
def export_command(
    src,
    to,
    out,
    recipe,
    fmt,
    quant,
    calib_data,
    calib_samples,
    calib_seq_len,
    offload,
    kv_cache,
    keep_bf16,
    keep_bf16_file,
    precision_file,
    auto_precision,
    auto_precision_samples,
    scale_search,
    weight_rounding,
    equalize,
    gptq_damp,
    gptq_block_scales,
    weight_block,
    max_shard_size,
    step,
    model_config,
    rope_layout,
    force,
) -> None:
    """Export SRC (HF folder, MaxText checkpoint or training run) as a serving checkpoint.

    \b
    Example:
      nvfp4tool export runs/a --out out/a-nvfp4 --format compressed-tensors
      nvfp4tool export hf/m --out out/m-nvfp4 --calib-data calib.txt --kv-cache fp8
      nvfp4tool export hf/m --out out/m-gptq --calib-data calib.txt --weight-rounding gptq
      nvfp4tool export hf/m --out out/m-awq --calib-data calib.txt --equalize awq
      nvfp4tool export hf/m --out out/m-w4a16 --calib-data calib.txt --recipe w4a16-best
    """
    del to  # safetensors is the only container
    ctx = click.get_current_context()
    for name in ("calib_samples", "calib_seq_len"):  # said, not silently ignored
        if calib_data is None and ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE:
            flag = "--" + name.replace("_", "-")
            raise click.UsageError(f"{flag} sizes the calibration: it needs --calib-data PATH (or drop {flag})", ctx)
    if (
        auto_precision is None
        and ctx.get_parameter_source("auto_precision_samples") is click.core.ParameterSource.COMMANDLINE
    ):
        raise click.UsageError(
            "--auto-precision-samples sizes the search: it needs --auto-precision KL "
            "(or drop --auto-precision-samples)",
            ctx,
        )
    if recipe is not None:
        _check_recipe_overrides(ctx, recipe)
    summary = api.export(
        src,
        out,
        recipe=recipe,
        format=fmt,
        quant=quant,
        scale_search=scale_search,
        weight_rounding=weight_rounding,
        equalize=equalize,
        gptq_damp=gptq_damp,
        gptq_block_scales=gptq_block_scales,
        weight_block=weight_block,
        keep_bf16=keep_bf16,
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
    click.echo(summary.line())


def _check_recipe_overrides(ctx: click.Context, recipe: str) -> None:
    """A recipe yields to the options set to other than their defaults (`export.recipes`); an option
    typed at its default that the recipe sets otherwise would be silently overridden: refused."""
    from nvfp4tool.export.recipes import SETTABLE, read_recipe

    sets = read_recipe(recipe).options
    for param in ctx.command.params:
        field = "format" if param.name == "fmt" else param.name
        typed = ctx.get_parameter_source(param.name) is click.core.ParameterSource.COMMANDLINE
        value = ctx.params[param.name]
        if field in SETTABLE and field in sets and field != "keep_bf16" and typed and value == param.default:
            if sets[field] != value:
                raise click.UsageError(
                    f"--recipe {recipe} sets {param.opts[0]} {sets[field]}; {param.opts[0]} {value} is the "
                    "default, which a recipe overrides: give the options one by one instead of the recipe",
                    ctx,
                )


@cli.command("convert-format", short_help="Convert an export: ModelOpt <-> compressed-tensors")
@click.argument("src", **_checks(api.convert_format, "src"))
@click.argument("out", type=click.Path())
@click.option(
    "--to",
    "to",
    **_checks(api.convert_format, "to"),
    required=True,
    help="Layout to write: modelopt (vLLM modelopt_fp4 / TensorRT-LLM / SGLang) or compressed-tensors "
    "(vLLM compressed-tensors / transformers).",
)
@click.option(
    "--force", is_flag=True, default=default(api.convert_format, "force"), help="Replace an existing output folder."
)
def convert_format_command(src, out, to, force) -> None:
    """Convert an export between the ModelOpt and compressed-tensors layouts, losslessly.

    \b
    Example:
      nvfp4tool convert-format out/a-nvfp4 out/a-nvfp4-ct --to compressed-tensors
    """
    converted = api.convert_format(src, out, to=to, force=force)
    click.echo(f"wrote {out} ({to}) in {converted.seconds:.1f} s")


@cli.command("push", short_help="Check an export, write its model card, upload to the Hub")
@click.argument("path", **_checks(api.push, "path"))
@click.option("--repo-id", required=True, help="Hub repository, ORG/NAME (created if missing).")
@click.option("--private", is_flag=True, default=default(api.push, "private"), help="Create the repository private.")
@click.option(
    "--revision", default=default(api.push, "revision"), help="Branch to commit to (created from main if missing)."
)
@click.option(
    "--create-pr",
    is_flag=True,
    default=default(api.push, "create_pr"),
    help="Open a pull request against main instead of committing.",
)
@click.option(
    "--dry-run",
    is_flag=True,
    default=default(api.push, "dry_run"),
    help="Print the file list, sizes and model card; upload nothing.",
)
@click.option(
    "--endpoint",
    **_api(api.push, "endpoint"),
    help="Hub URL for a private Hub (default: HF_ENDPOINT or huggingface.co).",
)
@click.option(
    "--timeout",
    **_api(api.push, "timeout"),
    show_default=True,
    help="Seconds to wait for each answer of the Hub before retrying (3 tries per request).",
)
@click.option(
    "--no-validation",
    is_flag=True,
    default=default(api.push, "no_validation"),
    help="Publish without a validation.json from `nvfp4tool validate` (the card says so); "
    "a validation.json present is still checked against the files. Default: off.",
)
@click.option(
    "--base-model",
    default=default(api.push, "base_model"),
    help="Source repo id for the card (default: from the provenance).",
)
@click.option(
    "--license", "license_", default=default(api.push, "license"), help="License for the card (default: the source's)."
)
def push_command(
    path, repo_id, private, revision, create_pr, dry_run, endpoint, timeout, no_validation, base_model, license_
) -> None:
    """Check an export, write its model card and upload both to the Hugging Face Hub.

    Refuses a checkpoint that fails `nvfp4tool check`, one without validation.json unless
    --no-validation, and one whose files or source are not what validation.json validated (a file
    changed, added or removed after validation; a validation of another source). The export folder
    is not modified: README.md is added in the upload only.
    Token: HF_TOKEN or the saved login (never printed).

    \b
    Example:
      nvfp4tool push out/llama-nvfp4 --repo-id my-org/Llama-3.2-1B-NVFP4 --dry-run
      nvfp4tool push out/llama-nvfp4 --repo-id my-org/Llama-3.2-1B-NVFP4 --private
    """
    result = api.push(
        path,
        repo_id=repo_id,
        private=private,
        revision=revision,
        create_pr=create_pr,
        dry_run=dry_run,
        endpoint=endpoint,
        timeout=timeout,
        no_validation=no_validation,
        base_model=base_model,
        license=license_,
    )
    click.echo(("would upload" if dry_run else "uploaded") + f" to {repo_id}:\n{result.file_table()}")
    if result.replaced_readme:
        click.echo(f"note: {path}/README.md is replaced by the generated model card in the upload")
    if dry_run:
        click.echo("\nmodel card (README.md):\n" + result.card)
    else:
        click.echo(f"done: {result.pr_url or result.commit_url or result.repo_url}")


def _threshold_default(field: str) -> str:
    """A validate threshold's defaults per quant, for its --help (kept in nvfp4tool.validate.thresholds)."""
    from nvfp4tool.validate.thresholds import defaults_help

    return f"Default by the export's quant: {defaults_help(field)}."


@cli.command("validate", short_help="Prove an export against its BF16 source and FP8")
@click.argument("export", **_checks(api.validate, "export"))
@click.option(
    "--data",
    required=True,
    **_checks(api.validate, "data"),
    help="Evaluation text (.txt/.jsonl, tokenized with the export's tokenizer) or ids (.npy).",
)
@click.option(
    "--reference",
    **_api(api.validate, "reference"),
    show_default=True,
    help="fp8 (FP8 export made on the fly from the source), bf16 (no FP8 column), "
    "or the folder of an `export --quant fp8`.",
)
@click.option(
    "--source",
    type=click.Path(),
    default=default(api.validate, "source"),
    help="The BF16 source (default: named by the export's nvfp4tool_export.json). Its weight files "
    "must have the sha256 that record names.",
)
@click.option(
    "--source-mismatch-ok",
    is_flag=True,
    default=default(api.validate, "source_mismatch_ok"),
    help="Validate against a --source whose weights differ from the export's provenance record "
    "(default: refused); the report and the model card say so.",
)
@click.option(
    "--calib-data",
    **_api(api.validate, "calib_data"),
    help="Calibration text (.txt/.jsonl) or ids (.npy) for the FP8 reference made on the fly "
    "(--reference fp8; default: the W4A4 export's own input amax or a training run's tracked "
    "amax; never --data).",
)
@click.option(
    "--calib-samples",
    **_api(api.validate, "calib_samples"),
    show_default=True,
    help="Sequences of --calib-data read.",
)
@click.option(
    "--calib-seq-len",
    **_api(api.validate, "calib_seq_len"),
    show_default=True,
    help="Tokens per --calib-data sequence.",
)
@click.option("--json", "json_copy", **_api(api.validate, "json_copy"), help="Also write validation.json here.")
@click.option(
    "--force",
    is_flag=True,
    default=default(api.validate, "force"),
    help="Replace existing reports (validation.json / .md, the PNGs, the --json copy); default: refused.",
)
@click.option("--samples", **_api(api.validate, "samples"), show_default=True, help="Sequences evaluated.")
@click.option(
    "--seq-len",
    **_api(api.validate, "seq_len"),
    show_default=True,
    help="Tokens per evaluated sequence.",
)
@click.option(
    "--batch-size",
    **_api(api.validate, "batch_size"),
    show_default=True,
    help="Sequences per forward pass (memory, not results).",
)
@click.option("--prompts", **_api(api.validate, "prompts"), show_default=True, help="Greedy-generation prompts.")
@click.option(
    "--prompt-len",
    **_api(api.validate, "prompt_len"),
    show_default=True,
    help="Tokens of --data each greedy prompt starts from.",
)
@click.option(
    "--gen-tokens",
    **_api(api.validate, "gen_tokens"),
    show_default=True,
    help="Greedy continuation length.",
)
@click.option(
    "--max-kl-mean",
    **_api(api.validate, "max_kl_mean"),
    help="Most mean KL(BF16 || NVFP4) per token, in nats. " + _threshold_default("max_kl_mean"),
)
@click.option(
    "--max-kl-p99",
    **_api(api.validate, "max_kl_p99"),
    help="Most 99th-percentile per-token KL, in nats. " + _threshold_default("max_kl_p99"),
)
@click.option(
    "--min-top1",
    **_api(api.validate, "min_top1"),
    help="Least fraction of tokens whose arg-max matches BF16's (default: no "
    "limit, since on near-flat logits top-1 agreement measures tie-breaking, not damage).",
)
@click.option(
    "--max-ppl-increase",
    **_api(api.validate, "max_ppl_increase"),
    help="Relative: ppl / ppl_bf16 - 1. " + _threshold_default("max_ppl_increase"),
)
@click.option(
    "--min-layer-sqnr",
    **_api(api.validate, "min_layer_sqnr"),
    help="Floor (dB) of every quantized layer's weight SQNR. " + _threshold_default("min_layer_sqnr_db"),
)
@_offload(api.validate)
@click.option(
    "--sensitivity",
    is_flag=True,
    default=default(api.validate, "sensitivity"),
    help="Also find the layers to keep in BF16 for --kl-target and write them to EXPORT/keep_bf16.txt "
    "(for `export --keep-bf16-file`).",
)
@click.option(
    "--kl-target",
    **_api(api.validate, "kl_target"),
    show_default=True,
    help="KL mean target of --sensitivity.",
)
def validate_command(
    export,
    data,
    reference,
    source,
    source_mismatch_ok,
    calib_data,
    calib_samples,
    calib_seq_len,
    json_copy,
    force,
    samples,
    seq_len,
    batch_size,
    prompts,
    prompt_len,
    gen_tokens,
    max_kl_mean,
    max_kl_p99,
    min_top1,
    max_ppl_increase,
    min_layer_sqnr,
    offload,
    sensitivity,
    kl_target,
) -> None:
    """Prove an NVFP4 export against its BF16 source and an FP8 reference; exit 1 if it fails.

    Writes validation.json, validation.md and PNG plots into EXPORT (replacing them only with
    --force). The source must be the one the export's provenance record names (same weight hashes).

    \b
    Example:
      nvfp4tool validate out/m-nvfp4 --reference fp8 --data val.txt --json v.json
      nvfp4tool validate out/m-nvfp4 --data val.txt --sensitivity --kl-target 0.005
    """
    from rich.console import Console

    from nvfp4tool.tables import print_line
    from nvfp4tool.validate.report import KEEP_BF16_TXT, print_report
    from nvfp4tool.validate.sensitivity import export_with_file

    console = Console()
    run = api.validate(
        export,
        data=data,
        reference=reference,
        source=source,
        source_mismatch_ok=source_mismatch_ok,
        calib_data=calib_data,
        calib_samples=calib_samples,
        calib_seq_len=calib_seq_len,
        json_copy=json_copy,
        force=force,
        samples=samples,
        seq_len=seq_len,
        batch_size=batch_size,
        prompts=prompts,
        prompt_len=prompt_len,
        gen_tokens=gen_tokens,
        max_kl_mean=max_kl_mean,
        max_kl_p99=max_kl_p99,
        min_top1=min_top1,
        max_ppl_increase=max_ppl_increase,
        min_layer_sqnr=min_layer_sqnr,
        offload=offload,
        sensitivity=sensitivity,
        kl_target=kl_target,
    )
    record = run.record
    if run.source_mismatch is not None:
        click.echo(f"note: --source-mismatch-ok: {run.source_mismatch}; validation.json records it")
    print_report(record, console)
    if record.sensitivity is not None:
        found = record.sensitivity
        print_line(
            console,
            f"sensitivity: KL target {kl_target} {'met' if found.met else 'NOT met'} "
            f"keeping {len(found.keep_bf16)} group(s) in BF16 "
            f"(KL {found.trajectory[0].kl_mean:.4g} -> {found.trajectory[-1].kl_mean:.4g}"
            f"{found.trajectory[-1].size_text()})",
        )
        keep_file = os.path.join(export, KEEP_BF16_TXT)
        click.echo(
            f"the {len(found.keep_bf16)} pattern(s) are in {keep_file}; export with them:\n  "
            + export_with_file(run.source_path, keep_file, found)
        )
    click.echo(f"wrote {', '.join(run.files)}")
    if not record.passed:
        raise NVFP4ToolError(
            f"{export}: validation failed: "
            + "; ".join(f"{f.metric} ({f.detail}) off by {f.by:.4g}" for f in record.failures)
        )


@cli.command("eval", short_help="Task accuracy as served: BF16, FP8, NVFP4, paired")
@click.argument("export", **_checks(api.evaluate, "export"))
@click.option(
    "--tasks",
    required=True,
    help="Comma-separated lm-eval task names, task YAML files or folders of them (lm-eval's "
    "include_path); shipped offline: nvfp4tool_mc, nvfp4tool_mc_letter, nvfp4tool_gsm, "
    "nvfp4tool_text.",
)
@click.option(
    "--reference",
    **_api(api.evaluate, "reference"),
    help="An FP8 export (`export --quant fp8`) of the same source, run as served for the FP8 column (default: none).",
)
@click.option(
    "--source",
    **_api(api.evaluate, "source"),
    help="The BF16 source (default: named by the export's nvfp4tool_export.json; its weight files "
    "must have the sha256 that record names).",
)
@click.option(
    "--limit",
    **_api(api.evaluate, "limit"),
    help="Evaluate only the first N items of each task (recorded in eval.json; default: all).",
)
@click.option(
    "--seed",
    **_api(api.evaluate, "seed"),
    show_default=True,
    help="lm-eval's random seeds (few-shot sampling) and the key of sampled decoding.",
)
@click.option(
    "--max-drop",
    **_api(api.evaluate, "max_drop"),
    help="Fail (exit 1) when the lower end of the 95% interval of NVFP4 - BF16 (per task and "
    "overall) is below -MAX_DROP, a fraction (0.02 = 2 points; default: no threshold).",
)
@click.option(
    "--max-drop-fp8",
    **_api(api.evaluate, "max_drop_fp8"),
    help="The same threshold for NVFP4 - FP8 (needs --reference; default: none).",
)
@click.option(
    "--num-fewshot",
    **_api(api.evaluate, "num_fewshot"),
    help="Few-shot examples per prompt (default: each task's own).",
)
@click.option(
    "--batch-size",
    **_api(api.evaluate, "batch_size"),
    show_default=True,
    help="Requests per forward pass / generation batch (memory and speed, not results).",
)
@click.option(
    "--max-length",
    **_api(api.evaluate, "max_length"),
    show_default=True,
    help="Most tokens of context a request sees (longer ones are left-truncated).",
)
@click.option(
    "--max-gen-toks",
    **_api(api.evaluate, "max_gen_toks"),
    show_default=True,
    help="Most new tokens of a generative request whose task sets none.",
)
@click.option(
    "--gen-kwargs",
    default=None,
    help="Generation settings over every generative task's own, lm-eval's form: "
    "do_sample=true,temperature=0.7,top_k=50 (also until, max_gen_toks).",
)
@click.option(
    "--samples",
    **_api(api.evaluate, "samples"),
    show_default=True,
    help="Generations per item of a sampled task (seeds SEED, SEED+1, ...), its score their mean; "
    "needs sampled decoding.",
)
@_offload(api.evaluate)
@click.option(
    "--chat-template/--no-chat-template",
    default=default(api.evaluate, "chat_template"),
    show_default=True,
    help="Wrap prompts in the tokenizer's chat template where the tokenizer has one.",
)
@click.option("--json", "json_copy", **_api(api.evaluate, "json_copy"), help="Also write eval.json here.")
@click.option(
    "--force",
    is_flag=True,
    default=default(api.evaluate, "force"),
    help="Replace existing reports (eval.json / .md / .png, eval_items.json, the --json copy); default: refused.",
)
def eval_command(
    export,
    tasks,
    reference,
    source,
    limit,
    seed,
    max_drop,
    max_drop_fp8,
    num_fewshot,
    batch_size,
    max_length,
    max_gen_toks,
    gen_kwargs,
    samples,
    offload,
    chat_template,
    json_copy,
    force,
) -> None:
    """Task accuracy as served: the same lm-eval tasks on BF16, FP8 and NVFP4, paired item by item.

    Writes eval.json (with eval_items.json, the per-item scores), eval.md (the model-card table)
    and eval.png into EXPORT; exit 1 if --max-drop fails.

    \b
    Example:
      nvfp4tool eval out/m-nvfp4 --tasks nvfp4tool_mc,nvfp4tool_gsm --reference out/m-fp8 --limit 200
      nvfp4tool eval out/m-nvfp4 --tasks ./mmlu_pro_local/ --max-drop 0.01 --json e.json
    """
    from rich.console import Console

    from nvfp4tool.eval.report import print_report

    run = api.evaluate(
        export,
        tasks=tasks,
        reference=reference,
        source=source,
        limit=limit,
        seed=seed,
        max_drop=max_drop,
        max_drop_fp8=max_drop_fp8,
        num_fewshot=num_fewshot,
        batch_size=batch_size,
        max_length=max_length,
        max_gen_toks=max_gen_toks,
        gen_kwargs=_gen_kwargs(gen_kwargs),
        samples=samples,
        offload=offload,
        chat_template=chat_template,
        json_copy=json_copy,
        force=force,
    )
    print_report(run.record, Console())
    click.echo(f"wrote {', '.join(run.files)}")
    if not run.record.passed:
        raise NVFP4ToolError(f"{export}: eval failed: " + "; ".join(run.record.failures))


def _gen_kwargs(text: str | None) -> dict | None:
    """--gen-kwargs "k=v,k=v" typed and checked (`eval.gen_settings`), or None."""
    if text is None:
        return None
    from nvfp4tool.eval.gen_settings import parse

    return parse(text, "--gen-kwargs")


@cli.command("quickstart", short_help="Run the whole pipeline on the embedded tiny model")
@click.option(
    "--out", default=default(api.quickstart, "out"), show_default=True, help="Folder for every stage's output."
)
@click.option(
    "--pretrain-steps",
    **_api(api.quickstart, "pretrain_steps"),
    show_default=True,
    help="Steps of the BF16 pretraining stage.",
)
@click.option(
    "--finetune-steps",
    **_api(api.quickstart, "finetune_steps"),
    show_default=True,
    help="Steps of the NVFP4-recipe fine-tuning stage.",
)
@click.option(
    "--force", is_flag=True, default=default(api.quickstart, "force"), help="Replace an existing --out folder."
)
def quickstart_command(out: str, pretrain_steps: int, finetune_steps: int, force: bool) -> None:
    """Run the whole pipeline on the embedded tiny model and Shakespeare corpus.

    Pretrain (BF16) -> fine-tune (NVFP4 recipe) -> export NVFP4 and FP8 -> validate -> check ->
    push --dry-run. A few minutes on a 2-core CPU.

    \b
    Example:
      nvfp4tool quickstart --out qs --force
    """
    api.quickstart(out=out, pretrain_steps=pretrain_steps, finetune_steps=finetune_steps, force=force, echo=click.echo)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point. SIGTERM ends any command the way Ctrl-C (SIGINT,
    KeyboardInterrupt) does, by an exception (SystemExit 143) that unwinds it, so every temporary
    folder and file is removed on the way out (`converters.atomic`); the default SIGTERM action
    would leave them behind."""
    install_signal_handlers()
    cli.main(args=argv, prog_name="nvfp4tool")


def install_signal_handlers() -> None:
    """SIGTERM raises SystemExit(143) (in the main thread), and one swallowed where Python cannot
    raise it is sent again (`_redeliver_swallowed_exit`)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_signal)
        if sys.unraisablehook is not _redeliver_swallowed_exit:
            global _previous_unraisablehook
            _previous_unraisablehook, sys.unraisablehook = sys.unraisablehook, _redeliver_swallowed_exit


def _exit_on_signal(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


_previous_unraisablehook = sys.unraisablehook
_REDELIVER_AFTER_S = 0.05  # the swallowed SIGTERM is sent again this long after (its hook has returned)


def _redeliver_swallowed_exit(unraisable) -> None:
    """A SIGTERM that arrives while Python runs a gc callback or a `__del__` (JAX has a gc
    callback) raises its SystemExit there, where Python only prints it and goes on: the command
    would then finish as if never signalled. Send the signal again, so it lands outside: from
    another thread, a moment later, since one sent before this hook returns runs its handler
    inside the hook, where its SystemExit is swallowed again (a later swallow sends it once more)."""
    exc = unraisable.exc_value
    if isinstance(exc, SystemExit) and exc.code == 128 + signal.SIGTERM:
        again = threading.Timer(_REDELIVER_AFTER_S, os.kill, args=(os.getpid(), signal.SIGTERM))
        again.daemon = True
        again.start()
        return
    _previous_unraisablehook(unraisable)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
