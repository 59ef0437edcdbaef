"""Command-line wiring only: parse options, call one library function, turn errors into exit codes.

Exit codes: 0 success, 1 a failed check or bad input (`NVFP4ToolError`, one line), 2 bad usage
(click). A traceback is shown only with `-v/--verbose`.
"""

from __future__ import annotations

import logging
import sys

import click

from nvfp4tool import __version__
from nvfp4tool.errors import NVFP4ToolError


class _Group(click.Group):
    """A click group that prints user errors as one line and hides tracebacks unless verbose."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
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


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    cli.main(args=argv, prog_name="nvfp4tool")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
