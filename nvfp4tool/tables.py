"""The one way the commands print a rich table: every cell value in full, never cut with "…"; and a
line of prose beside it, whole.

    print_table(console, table)   # check's module table, validate's metric / layer / sensitivity tables
    print_line(console, text)     # a verdict, how the models ran: one line, never wrapped mid-sentence

On a terminal the table fits the terminal's width and a cell too long for its column wraps (folds)
onto further lines; anywhere else (a pipe, a log file, CliRunner) the table is printed at its
natural width, however wide, so that a log holds whole values ("384x576", "model.layers.11...").
The same values are in each command's JSON (`check --json`, validation.json). A line of prose is
printed as it is (no markup, no wrapping at the console's width, 80 columns when not on a terminal):
a terminal folds it, a log keeps it on one line.
"""

from __future__ import annotations

from typing import Any

_UNBOUNDED = 100_000  # "as wide as the content": the width a table is measured in when not on a terminal


def print_table(console: Any, table: Any) -> None:
    """Print `table` (rich.table.Table) on `console` with no cell cut (see the module docstring)."""
    from rich.measure import Measurement

    for column in table.columns:  # wrap a long value rather than cut it with an ellipsis
        column.no_wrap = False
        column.overflow = "fold"
    if console.is_terminal:
        console.print(table)
        return
    natural = Measurement.get(console, console.options.update_width(_UNBOUNDED), table).maximum
    width = console.width
    console.width = max(width, natural)  # Console.print(width=) cannot exceed the console's own width
    try:
        console.print(table)
    finally:
        console.width = width


def print_line(console: Any, text: str) -> None:
    """Print `text` on `console` whole: no rich markup read from it, not wrapped at the console's width."""
    console.print(text, markup=False, highlight=False, soft_wrap=True)
