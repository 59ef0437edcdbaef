"""The one output convention: the library reports progress and status here; the CLI renders it.

    from nvfp4tool import progress

    with progress.task("export", total=len(names), unit="tensor") as task:
        for name in names:
            ...
            task.advance(description=name, nbytes=size)   # bytes feed the throughput column
    progress.info("resumed from runs/a/checkpoints/40")    # a status line (never `print`)

Library code never prints. Without a reporter installed (library use, tests) tasks are silent and
`info` goes to the `nvfp4tool` logger at INFO. The CLI installs `RichReporter` (progress bars with
throughput and ETA on stderr, status lines on stderr) or `QuietReporter` (`--quiet`: nothing but
errors) with `use_reporter(...)`. A reporter implements `start(name, total, unit)` -> a task
object with `advance(n, description, nbytes, fields)` and `close()`, plus `info(message)`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any, Protocol

_LOG = logging.getLogger("nvfp4tool")


class Task(Protocol):
    def advance(self, n: int = 1, *, description: str | None = None, nbytes: int = 0,
                fields: dict[str, Any] | None = None) -> None: ...

    def close(self) -> None: ...


class Reporter(Protocol):
    def start(self, name: str, total: int | None, unit: str) -> Task: ...

    def info(self, message: str) -> None: ...


class _SilentTask:
    def advance(self, n: int = 1, *, description: str | None = None, nbytes: int = 0,
                fields: dict[str, Any] | None = None) -> None:
        pass

    def close(self) -> None:
        pass


class LoggingReporter:
    """The default: no bars; status lines to the `nvfp4tool` logger (INFO)."""

    def start(self, name: str, total: int | None, unit: str) -> Task:
        return _SilentTask()

    def info(self, message: str) -> None:
        _LOG.info(message)


class QuietReporter:
    """`--quiet`: nothing at all."""

    def start(self, name: str, total: int | None, unit: str) -> Task:
        return _SilentTask()

    def info(self, message: str) -> None:
        pass


class RichReporter:
    """Progress bars (count, throughput in units/s and bytes/s, ETA) and status lines, on stderr."""

    def __init__(self, console: Any | None = None) -> None:
        from rich.console import Console

        self.console = console or Console(stderr=True)

    def start(self, name: str, total: int | None, unit: str) -> Task:
        return _RichTask(self.console, name, total, unit)

    def info(self, message: str) -> None:
        self.console.print(message, markup=False, highlight=False, soft_wrap=True)


class _RichTask:
    def __init__(self, console: Any, name: str, total: int | None, unit: str) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.unit, self.start_time, self.count, self.nbytes = unit, time.perf_counter(), 0, 0
        self.bar = Progress(TextColumn(name), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[rate]}"), TimeRemainingColumn(),
                            TextColumn("{task.description}"), console=console, transient=True)
        self.bar.start()
        self.task = self.bar.add_task("", total=total, rate="")

    def advance(self, n: int = 1, *, description: str | None = None, nbytes: int = 0,
                fields: dict[str, Any] | None = None) -> None:
        self.count += n
        self.nbytes += nbytes
        elapsed = max(time.perf_counter() - self.start_time, 1e-9)
        rate = f"{self.count / elapsed:.1f} {self.unit}/s"
        if self.nbytes:
            rate += f", {self.nbytes / elapsed / 1e6:.1f} MB/s"
        if fields:
            rate += " " + " ".join(f"{k} {v}" for k, v in fields.items())
        self.bar.update(self.task, advance=n, rate=rate,
                        **({"description": description} if description is not None else {}))

    def close(self) -> None:
        self.bar.stop()


_reporter: Reporter = LoggingReporter()


def use_reporter(reporter: Reporter) -> Reporter:
    """Install `reporter` for this process; returns the previous one (the CLI restores it)."""
    global _reporter
    previous, _reporter = _reporter, reporter
    return previous


def reporter() -> Reporter:
    return _reporter


@contextlib.contextmanager
def task(name: str, total: int | None = None, unit: str = "item") -> Iterator[Task]:
    """A progress task for the duration of the block (closed even on error)."""
    handle = _reporter.start(name, total, unit)
    try:
        yield handle
    finally:
        handle.close()


def info(message: str) -> None:
    """A status line (the library's only way to say something)."""
    _reporter.info(message)
