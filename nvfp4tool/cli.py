"""Command-line wiring only: parse options, call one library function, turn errors into exit codes.

Exit codes: 0 success, 1 a failed check or bad input (`NVFP4ToolError`, one line), 2 bad usage
(click). A traceback is shown only with `-v/--verbose`.
"""

from __future__ import annotations

import logging
import sys

import click

from nvfp4tool import __version__
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
        except Exception as exc:  # an internal error: one line unless --verbose
            if _verbose(ctx):
                raise
            raise click.ClickException(
                f"internal error: {type(exc).__name__}: {exc} (rerun with --verbose for the traceback)"
            ) from None


def _verbose(ctx: click.Context) -> bool:
    return bool(ctx.obj and ctx.obj.get("verbose"))


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="nvfp4tool")
@click.option("-v", "--verbose", is_flag=True, help="Show debug logging and full tracebacks.")
@click.pass_context
def cli(ctx: click.Context, verbose: bool) -> None:
    """nvfp4tool: NVFP4 training, export and validation for Llama-family models in JAX.

    \b
    Example:
      nvfp4tool convert ./Llama-3.2-1B ./llama-maxtext --to maxtext --model-config llama3.2-1b
    """
    ctx.ensure_object(dict)
    ctx.obj["verbose"] = verbose
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, format="%(message)s")


@cli.command("convert")
@click.argument("src", type=click.Path(exists=True))
@click.argument("dst", type=click.Path())
@click.option("--to", "to", type=click.Choice(["hf", "maxtext"]), required=True,
              help="Output format.")
@click.option("--scan-layers/--no-scan-layers", default=True, show_default=True,
              help="MaxText output: stack the layers (decoder/layers, layer axis 1) or not.")
@click.option("--model-config", default=None,
              help="HF config.json, HF folder, or MaxText model name (e.g. llama3.1-8b). "
                   "Required for a MaxText source.")
@click.option("--rope-layout", type=click.Choice(["interleaved", "half"]), default=None,
              help="RoPE row layout on the MaxText side (default: from the MaxText model name).")
@click.option("--dtype", type=click.Choice(["bf16", "fp32"]), default=None,
              help="Output dtype (MaxText default fp32; HF default: the model config's).")
@click.option("--max-shard-size", default="5GB", show_default=True, help="HF output shard size.")
@click.option("--force", is_flag=True, help="Replace DST if it exists.")
def convert_command(src: str, dst: str, to: str, scan_layers: bool, model_config: str | None,
                    rope_layout: str | None, dtype: str | None, max_shard_size: str,
                    force: bool) -> None:
    """Convert a checkpoint between HF safetensors and MaxText (Orbax), or reshard an HF folder.

    \b
    Example:
      nvfp4tool convert ./Llama-3.1-8B ./ckpt --to maxtext --model-config llama3.1-8b
      nvfp4tool convert ./ckpt/0/items ./hf --to hf --model-config llama3.1-8b
    """
    from rich.console import Console
    from rich.progress import Progress

    from converters.convert import ConvertUsageError, convert_checkpoint

    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("converting", total=None)

        def on_tensor(name: str, nbytes: int) -> None:
            progress.update(task, advance=1, description=name)

        try:
            summary = convert_checkpoint(src, dst, to=to, model_config=model_config,
                                         scan_layers=scan_layers, rope_layout=rope_layout,
                                         dtype=dtype, max_shard_size=max_shard_size, force=force,
                                         on_tensor=on_tensor)
        except ConvertUsageError as err:
            raise click.UsageError(str(err)) from None
    click.echo(summary.line())


@cli.command("train", context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1)
def train_command(args: tuple[str, ...]) -> None:
    """Train or fine-tune with a precision recipe: [CONFIG.yaml] [key=value ...].

    Every key of the YAML file can be overridden on the command line (see README for the keys:
    model, data, recipe, steps, seq_len, batch_size, seed, out, checkpoint_every, resume, ...).

    \b
    Example:
      nvfp4tool train model=tiny data=corpus.txt recipe=nvfp4 steps=60 out=runs/a
      nvfp4tool train run.yaml lr=3e-4 resume=true
    """
    from nvfp4tool.train.config import load_train_config
    from nvfp4tool.train.trainer import train

    yaml_path = args[0] if args and "=" not in args[0] else None
    overrides = list(args[1:] if yaml_path else args)
    result = train(load_train_config(yaml_path, overrides))
    if result.losses:
        last = max(result.losses)
        eval_text = f", eval loss {result.eval_losses[last]:.4f}" if last in result.eval_losses else ""
        click.echo(f"step {last}: train loss {result.losses[last]:.4f}{eval_text}; "
                   f"{result.tokens_per_s:,.0f} tokens/s")
    click.echo(f"run folder: {result.out}  (metrics.jsonl, loss.png, checkpoints/, hf/)")


@cli.command("plot")
@click.argument("runs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False))
@click.option("-o", "--out", "out_png", default="loss.png", show_default=True,
              help="PNG to write (a JSON of the plotted series is written beside it).")
@click.option("--label", "labels", multiple=True, help="Legend label per run (default: folder names).")
def plot_command(runs: tuple[str, ...], out_png: str, labels: tuple[str, ...]) -> None:
    """Overlay training runs' loss curves and their relative gap to the first run.

    \b
    Example:
      nvfp4tool plot runs/bf16 runs/nvfp4 -o compare.png
    """
    from nvfp4tool.train.metrics import plot_runs

    if labels and len(labels) != len(runs):
        raise click.UsageError(f"{len(labels)} --label for {len(runs)} runs")
    series = plot_runs(list(runs), out_png, list(labels) or None)
    for label, s in series.items():
        if s["loss"]:
            click.echo(f"{label}: {len(s['loss'])} steps, final loss {s['loss'][-1]:.4f}")
    click.echo(f"wrote {out_png}")


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    cli.main(args=argv, prog_name="nvfp4tool")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
