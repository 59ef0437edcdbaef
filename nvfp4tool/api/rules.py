"""What an API argument may be, declared once on its parameter (`Annotated[int, COUNT]`): `checked`
refuses a bad value before the stage runs (NVFP4UsageError naming the function and the keyword),
and the CLI builds its click types from the same rules, so an option and its keyword agree.

    Range   a finite number within bounds (an integer where `integer`)
    OneOf   one of the library's names (its constant: formats.FORMATS, memory.OFFLOAD_MODES, ...)
    Exists  an existing file or folder (FILE, FOLDER, PATH: either)
    NewFile a file to write, in an existing folder
    OneOfOrFolder, Url   validate's --reference, push's --endpoint
    Size    a shard size ("5GB")

Design notes: docs/design/cli.md.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import numbers
import os
import typing
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

from nvfp4tool.errors import NVFP4UsageError


@dataclasses.dataclass(frozen=True)
class Range:
    """A finite number in [low, high] (an end open where `low_open`); an int where `integer`."""

    low: float | None = None
    high: float | None = None
    integer: bool = False
    low_open: bool = False

    def problem(self, value: Any) -> str | None:
        if self.integer and not (isinstance(value, numbers.Integral) and not isinstance(value, bool)):
            return "expected an integer"
        if not self.integer and not (isinstance(value, numbers.Real) and not isinstance(value, bool)):
            return "expected a number"
        if not math.isfinite(value):
            return "expected a finite number"
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return f"expected {'>' if self.low_open else '>='} {self.low:g}"
        if self.high is not None and value > self.high:
            return f"expected <= {self.high:g}"
        return None


@dataclasses.dataclass(frozen=True)
class OneOf:
    """One of `choices`."""

    choices: tuple[str, ...]

    def problem(self, value: Any) -> str | None:
        return None if value in self.choices else f"expected one of {', '.join(self.choices)}"


@dataclasses.dataclass(frozen=True)
class Exists:
    """An existing file (where `file`) or folder (where `folder`)."""

    file: bool = True
    folder: bool = False

    def problem(self, value: Any) -> str | None:
        if not isinstance(value, (str, os.PathLike)):
            return "expected a path"
        if (self.file and os.path.isfile(value)) or (self.folder and os.path.isdir(value)):
            return None
        return f"not an existing {' or '.join(k for k, ok in (('file', self.file), ('folder', self.folder)) if ok)}"


@dataclasses.dataclass(frozen=True)
class NewFile:
    """A file to write: not a folder, in a folder that exists."""

    def problem(self, value: Any) -> str | None:
        if not isinstance(value, (str, os.PathLike)):
            return "expected a path"
        if os.path.isdir(value):
            return "is a folder"
        folder = os.path.dirname(os.path.abspath(value))
        return None if os.path.isdir(folder) else f"folder {folder!r} does not exist"


@dataclasses.dataclass(frozen=True)
class OneOfOrFolder:
    """One of `choices` or an existing folder."""

    choices: tuple[str, ...]

    def problem(self, value: Any) -> str | None:
        if value in self.choices or (isinstance(value, (str, os.PathLike)) and os.path.isdir(value)):
            return None
        return f"not {', '.join(self.choices)} or an existing export folder"


@dataclasses.dataclass(frozen=True)
class Url:
    """An http(s) URL."""

    def problem(self, value: Any) -> str | None:
        url = urlparse(value) if isinstance(value, str) else None
        if url is None or url.scheme not in ("http", "https") or not url.netloc:
            return "not an http(s) URL (e.g. https://hub.example.com)"
        return None


@dataclasses.dataclass(frozen=True)
class Size:
    """A size in bytes: an int or text like "5GB" (`converters.hf.parse_size` owns the syntax)."""

    def problem(self, value: Any) -> str | None:
        from converters.hf import parse_size

        try:
            parse_size(value)
        except NVFP4UsageError as bad:
            return str(bad)
        return None


COUNT = Range(low=1, integer=True)  # a number of things: samples, steps, tokens...
SEQ_LEN = Range(low=2, integer=True)  # tokens of a window: one input and its next token at least
FILE = Exists()
FOLDER = Exists(file=False, folder=True)
PATH = Exists(folder=True)  # a file or a folder
NEW_FILE = NewFile()
Rule = Range | OneOf | Exists | NewFile | OneOfOrFolder | Url | Size


def checked(fn: Callable) -> Callable:
    """`fn` refusing, before it runs, an argument its annotation's rule does not allow (None is
    allowed where it is the parameter's default)."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        for name, value in bound.arguments.items():
            found = rule(fn, name)
            if found is None or (value is None and signature.parameters[name].default is None):
                continue
            many = signature.parameters[name].kind is inspect.Parameter.VAR_POSITIONAL
            for one in value if many else [value]:  # *args: each one
                problem = found.problem(one)
                if problem is not None:
                    where = f"{fn.__module__.rpartition('.')[0]}.{fn.__name__}"
                    raise NVFP4UsageError(f"{where}: {name}={one!r}: {problem}")
        return fn(*args, **kwargs)

    return wrapper


def rule(fn: Callable, name: str) -> Rule | None:
    """The rule on parameter `name` of `fn` (an API function), or None."""
    hint = _hints(inspect.unwrap(fn)).get(name)
    found = [m for m in getattr(hint, "__metadata__", ()) if isinstance(m, typing.get_args(Rule))]
    return found[0] if found else None


def default(fn: Callable, name: str) -> Any:
    """The default of parameter `name` of `fn`: where the CLI reads its option's default."""
    value = inspect.signature(fn).parameters[name].default
    if value is inspect.Parameter.empty:
        raise TypeError(f"{fn.__qualname__}: {name} has no default")
    return value


@functools.cache
def _hints(fn: Callable) -> dict[str, Any]:
    return typing.get_type_hints(fn, include_extras=True)
