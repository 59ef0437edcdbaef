"""The one output convention: the library reports progress and status here; the CLI renders it.

    with progress.task("export", total=len(names), unit="tensor") as task:
        task.advance(description=name, nbytes=size)       # bytes feed the throughput column
    progress.info("resumed from runs/a/checkpoints/40")    # a status line (never `print`)
    progress.warn("Warning: the card has no license")       # shown even under --quiet

Library code never prints; the CLI installs a reporter (`for_cli`: rich, text / json lines, quiet).
Design notes: docs/design/progress.md.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import sys
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Protocol, TextIO

_LOG = logging.getLogger("nvfp4tool")

LOG_FORMATS = ("auto", "rich", "text", "json")  # --log-format
LOG_FORMAT_ENV = "NVFP4TOOL_LOG_FORMAT"  # the same, from the environment (the option wins)
INTERVAL_S = 10.0  # LineReporter: at most one progress line per task this often


class Task(Protocol):
    def advance(
        self, n: int = 1, *, description: str | None = None, nbytes: int = 0, fields: dict[str, Any] | None = None
    ) -> None: ...

    def close(self) -> None: ...


class Reporter(Protocol):
    def start(self, name: str, total: int | None, unit: str) -> Task: ...

    def info(self, message: str) -> None: ...


class _SilentTask:
    def advance(
        self, n: int = 1, *, description: str | None = None, nbytes: int = 0, fields: dict[str, Any] | None = None
    ) -> None:
        pass

    def close(self) -> None:
        pass


class LoggingReporter:
    """The default: no bars; status lines to the `nvfp4tool` logger (INFO)."""

    external_bars = True

    def start(self, name: str, total: int | None, unit: str) -> Task:
        return _SilentTask()

    def info(self, message: str) -> None:
        _LOG.info(message)

    def warn(self, message: str) -> None:
        _LOG.warning(message)


class QuietReporter:
    """`--quiet`: nothing but warnings (bare lines on stderr)."""

    external_bars = False

    def start(self, name: str, total: int | None, unit: str) -> Task:
        return _SilentTask()

    def info(self, message: str) -> None:
        pass

    def warn(self, message: str) -> None:
        sys.stderr.write(message + "\n")  # looked up now: the stream the command runs with
        sys.stderr.flush()

    def compiling(self, label: str, seconds: float | None) -> None:
        pass


class RichReporter:
    """Progress bars (count, throughput in units/s and bytes/s, ETA) and status lines, on stderr."""

    external_bars = True

    def __init__(self, console: Any | None = None) -> None:
        from rich.console import Console

        self.console = console or Console(stderr=True)

    def start(self, name: str, total: int | None, unit: str) -> Task:
        return _RichTask(self.console, name, total, unit)

    def info(self, message: str) -> None:
        self.console.print(message, markup=False, highlight=False, soft_wrap=True)

    def compiling(self, label: str, seconds: float | None) -> None:
        self.info(_compile_text(label, seconds))


class _RichTask:
    def __init__(self, console: Any, name: str, total: int | None, unit: str) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.unit, self.start_time, self.count, self.nbytes = unit, time.perf_counter(), 0, 0
        self.bar = Progress(
            TextColumn(name),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeRemainingColumn(),
            TextColumn("{task.description}"),
            console=console,
            transient=True,
        )
        self.bar.start()
        self.task = self.bar.add_task("", total=total, rate="")

    def advance(
        self, n: int = 1, *, description: str | None = None, nbytes: int = 0, fields: dict[str, Any] | None = None
    ) -> None:
        self.count += n
        self.nbytes += nbytes
        elapsed = max(time.perf_counter() - self.start_time, 1e-9)
        rate = f"{self.count / elapsed:.1f} {self.unit}/s"
        if self.nbytes:
            rate += f", {self.nbytes / elapsed / 1e6:.1f} MB/s"
        if fields:
            rate += " " + " ".join(f"{k} {v}" for k, v in fields.items())
        self.bar.update(
            self.task, advance=n, rate=rate, **({"description": description} if description is not None else {})
        )

    def close(self) -> None:
        self.bar.stop()


class LineReporter:
    """Plain lines for logs (`text`) or JSON lines (`json`) on `stream`, at a bounded rate (see the
    module docstring). `clock` (monotonic seconds) and `now` (a UTC datetime) are for tests."""

    external_bars = False

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        json_lines: bool = False,
        interval: float = INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        now: Callable[[], datetime.datetime] | None = None,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.json_lines, self.interval, self.clock = json_lines, interval, clock
        self.now = now or (lambda: datetime.datetime.now(datetime.timezone.utc))
        self._lock = threading.Lock()
        self._open = 0  # tasks started and not yet ended (a task started inside another is nested)

    def start(self, name: str, total: int | None, unit: str) -> Task:
        return _LineTask(self, name, total, unit)

    def info(self, message: str) -> None:
        self.emit({"event": "info", "message": message}, message)

    def warn(self, message: str) -> None:
        self.emit({"event": "warning", "message": message}, message)

    def compiling(self, label: str, seconds: float | None) -> None:
        self.emit(
            {
                "event": "compile_start" if seconds is None else "compile_done",
                "stage": label,
                "elapsed_s": None if seconds is None else round(seconds, 3),
            },
            _compile_text(label, seconds),
        )

    def emit(self, record: dict[str, Any], text: str) -> None:
        """One line: `record` as JSON (after `time`) or `text` after a timestamp."""
        stamp = self.now()
        if self.json_lines:
            line = json.dumps(
                {"time": stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z"), **record}, default=str
            )
        else:
            line = f"{stamp.strftime('%Y-%m-%dT%H:%M:%SZ')} {text}"
        with self._lock:
            self.stream.write(line + "\n")
            self.stream.flush()


class _LineTask:
    """A task's lines. A task started while another is open (a forward pass inside the sensitivity
    search, an evaluation inside training) is nested: it prints nothing until a progress line is
    due (it lasted `interval`), and its end only if it printed or lasted `interval`, so short inner
    tasks, however many, add no lines to their outer task's."""

    def __init__(self, reporter: LineReporter, name: str, total: int | None, unit: str) -> None:
        self.reporter, self.name, self.total, self.unit = reporter, name, total, unit
        self.count, self.nbytes, self.item, self.fields = 0, 0, None, {}
        self.started = self.last_line = reporter.clock()
        self.closed, self.printed = False, False
        with reporter._lock:
            self.nested = reporter._open > 0
            reporter._open += 1
        if not self.nested:
            self._line("start")

    def advance(
        self, n: int = 1, *, description: str | None = None, nbytes: int = 0, fields: dict[str, Any] | None = None
    ) -> None:
        self.count += n
        self.nbytes += nbytes
        if description is not None:
            self.item = description
        if fields:
            self.fields = dict(fields)
        finished = self.total is not None and self.count >= self.total  # its `done` line follows
        if not finished and self.reporter.clock() - self.last_line >= self.reporter.interval:
            self._line("progress")

    def close(self) -> None:
        self._end("done")

    def stop(self) -> None:
        """The task's block raised (an error, Ctrl-C): a `stopped` line where it stopped."""
        self._end("stopped")

    def _end(self, event: str) -> None:
        if self.closed:
            return
        self.closed = True
        with self.reporter._lock:
            self.reporter._open -= 1
        if self.printed or not self.nested or self.reporter.clock() - self.started >= self.reporter.interval:
            self._line(event)

    def _line(self, event: str) -> None:
        now = self.reporter.clock()
        self.last_line, self.printed = now, True
        elapsed = max(now - self.started, 0.0)
        rate = self.count / elapsed if elapsed > 0 and self.count else None
        bytes_per_s = self.nbytes / elapsed if elapsed > 0 and self.nbytes else None
        eta = (
            0.0
            if event == "done"
            else None
            if event == "stopped" or not rate or self.total is None
            else (self.total - self.count) / rate
        )
        record = {
            "event": event,
            "stage": self.name,
            "done": self.count,
            "total": self.total,
            "unit": self.unit,
            "rate": rate,
            "bytes_per_s": bytes_per_s,
            "elapsed_s": round(elapsed, 3),
            "eta_s": None if eta is None else round(max(eta, 0.0), 3),
            "item": self.item,
            "fields": {k: str(v) for k, v in self.fields.items()},
        }
        self.reporter.emit(record, self._text(event, elapsed, rate, bytes_per_s, eta))

    def _text(
        self, event: str, elapsed: float, rate: float | None, bytes_per_s: float | None, eta: float | None
    ) -> str:
        count = f"{self.count}/{self.total}" if self.total is not None else f"{self.count}"
        parts = [f"{count} {self.unit}"]
        if self.total and event != "start":
            parts[0] += f" ({100 * self.count / self.total:.0f}%)"
        if rate:
            parts.append(f"{rate:.1f} {self.unit}/s" if rate >= 1 else f"{1 / rate:.1f} s/{self.unit}")
        if bytes_per_s:
            parts.append(f"{bytes_per_s / 1e6:.1f} MB/s")
        if event != "start":
            parts.append(f"elapsed {format_seconds(elapsed)}")
        if event == "progress" and eta is not None:
            parts.append(f"ETA {format_seconds(eta)}")
        text = f"{self.name}: {'' if event == 'progress' else event + ', '}{', '.join(parts)}"
        if self.item is not None and event != "start":
            text += f"; {self.item}"
        if self.fields:
            text += "; " + " ".join(f"{k} {v}" for k, v in self.fields.items())
        return text


def format_seconds(seconds: float) -> str:
    """4.2 s, 3m07s, 1h02m."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    return f"{minutes // 60}h{minutes % 60:02d}m"


def _compile_text(label: str, seconds: float | None) -> str:
    return f"compiling {label} ..." if seconds is None else f"compiled {label} in {format_seconds(seconds)}"


def for_cli(*, quiet: bool, log_format: str, stream: TextIO | None = None) -> Reporter:
    """The reporter a command runs with: `--quiet` silences everything; `log_format` (one of
    LOG_FORMATS): `auto` is `rich` when `stream` (default stderr) is a terminal, else `text`."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format {log_format!r} is not one of {', '.join(LOG_FORMATS)}")
    if quiet:
        return QuietReporter()
    stream = stream if stream is not None else sys.stderr
    if log_format == "auto":
        isatty = getattr(stream, "isatty", None)
        log_format = "rich" if isatty is not None and isatty() else "text"
    if log_format == "rich":
        return RichReporter()
    return LineReporter(stream, json_lines=log_format == "json")


_reporter: Reporter = LoggingReporter()
_compiled: set[Hashable] = set()  # `compiling` keys already compiled in this process (as jit's caches are)


def use_reporter(reporter: Reporter) -> Reporter:
    """Install `reporter` for this process; returns the previous one (the CLI restores it)."""
    global _reporter
    previous, _reporter = _reporter, reporter
    return previous


def reporter() -> Reporter:
    return _reporter


@contextlib.contextmanager
def task(name: str, total: int | None = None, unit: str = "item", *, enabled: bool = True) -> Iterator[Task]:
    """A progress task for the duration of the block (closed even on error; a silent one when not
    `enabled`)."""
    handle = _reporter.start(name, total, unit) if enabled else _SilentTask()
    try:
        yield handle
    except BaseException:
        getattr(handle, "stop", handle.close)()  # a reporter that tells a stop from an end says so
        raise
    handle.close()


def info(message: str) -> None:
    """A status line (the library's only way to say something)."""
    _reporter.info(message)


def warn(message: str) -> None:
    """A warning line: something the user must see, shown by every reporter, `--quiet`'s
    included (on stderr); a reporter without `warn` shows it as a status line."""
    getattr(_reporter, "warn", _reporter.info)(message)


@contextlib.contextmanager
def compiling(label: str, key: Hashable | None = None) -> Iterator[None]:
    """Around a call that compiles (a jitted function's first call with new static arguments or
    shapes): "compiling LABEL ..." before, "compiled LABEL in 41.2 s" after (the time of the whole
    block: tracing, XLA compilation, the first dispatch). With `key`, only the first block with that
    key in this process reports (mirror jit's cache key: the function, its static arguments, the
    shapes); later ones run silently. No `compiled` line when the block raises."""
    if key is not None:
        if key in _compiled:
            yield
            return
    report = getattr(_reporter, "compiling", None) or (lambda lbl, s: _reporter.info(_compile_text(lbl, s)))
    report(label, None)
    started = time.perf_counter()
    yield
    if key is not None:
        _compiled.add(key)
    report(label, time.perf_counter() - started)
