"""`Record`: the one strict JSON reader/writer of the files stages hand each other.

    RunRecord(step=3).write(folder)            # folder/run.json, written atomically
    record = RunRecord.read(folder)            # NVFP4ToolError naming the file on any defect

A subclass declares `FILE_NAME` and its fields; any defect on reading is a `RecordError` (exit 1).
Design notes: docs/design/records.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import types
import typing
from collections.abc import Iterator
from typing import Any, ClassVar, TypeVar

from nvfp4tool.errors import NVFP4ToolError

R = TypeVar("R", bound="Record")


class RecordError(NVFP4ToolError):
    """A record file is missing, unreadable or does not match its schema (names the file)."""


@dataclasses.dataclass(frozen=True)
class Record:
    """Base of every record; subclasses are frozen dataclasses with a FILE_NAME."""

    FILE_NAME: ClassVar[str] = ""

    # ---------------------------------------------------------------- reading
    @classmethod
    def path(cls, folder: str | os.PathLike) -> str:
        return os.path.join(os.fspath(folder), cls.FILE_NAME)

    @classmethod
    def exists(cls, folder: str | os.PathLike) -> bool:
        return os.path.isfile(cls.path(folder))

    @classmethod
    def read(cls: type[R], folder: str | os.PathLike) -> R:
        """The record in `folder` (RecordError naming the file if missing or malformed)."""
        return cls.read_file(cls.path(folder))

    @classmethod
    def read_file(cls: type[R], path: str | os.PathLike) -> R:
        path = os.fspath(path)
        return cls.from_json(read_json_file(path), path=path)

    @classmethod
    def from_json(cls: type[R], obj: Any, *, path: str = "") -> R:
        """Build from a parsed JSON object, checking keys and types (`path` names it in errors)."""
        label = path or cls.FILE_NAME or cls.__name__
        if not isinstance(obj, dict):
            raise RecordError(f"{label}: expected a JSON object, got {_json_type(obj)}")
        return cls(**cls._from_json_fields(obj, label))

    @classmethod
    def _from_json_fields(cls, obj: dict[str, Any], label: str) -> dict[str, Any]:
        return fields_from_json(cls, obj, label)

    # ---------------------------------------------------------------- writing
    def to_json(self) -> dict[str, Any]:
        """The JSON object (nested records converted, tuples as lists)."""
        return {f.name: _to_json(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def write(self, folder: str | os.PathLike, *, indent: int = 1) -> str:
        """Write FILE_NAME into `folder` atomically; returns the path."""
        path = self.path(folder)
        write_json(path, self.to_json(), indent=indent)
        return path


def fields_from_json(cls: type, obj: dict[str, Any], label: str, *, require_all: bool = False) -> dict[str, Any]:
    """The keyword arguments of dataclass `cls` from a JSON object, each checked against its field's
    annotation; RecordError naming `label` and the key for an unknown key or a missing one (a field
    without a default, or any field with `require_all`)."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(obj) - set(fields))
    if unknown:
        raise RecordError(f"{label}: unknown key {unknown[0]!r} (expected: {', '.join(fields)})")
    missing = [
        name
        for name, f in fields.items()
        if name not in obj
        and (require_all or (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING))
    ]
    if missing:
        raise RecordError(f"{label}: missing key {missing[0]!r}")
    hints = typing.get_type_hints(cls)
    return {name: _convert(value, hints.get(name, Any), f"{label}: {name}") for name, value in obj.items()}


def read_json_file(path: str | os.PathLike) -> Any:
    """The parsed JSON of `path` (NaN / Infinity refused); RecordError naming the file when it is
    missing, a folder, binary, unreadable or not JSON. The one JSON-file reader of the package."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f, parse_constant=_refuse_constant)
    except FileNotFoundError:
        raise RecordError(f"{path}: not found") from None
    except IsADirectoryError:
        raise RecordError(f"{path}: is a folder, expected a JSON file") from None
    except UnicodeDecodeError:
        raise RecordError(f"{path}: not UTF-8 text (binary data?)") from None
    except (json.JSONDecodeError, _NonFinite) as bad:
        raise RecordError(f"{path}: not valid JSON ({bad})") from None
    except OSError as bad:
        raise RecordError(f"{path}: cannot read ({bad.strerror or bad})") from None


def iter_jsonl(path: str | os.PathLike, *, allow_nan: bool = False) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) of each non-blank line of a JSON-lines file, read line by line;
    RecordError naming `file:line` for a line that is not UTF-8 (binary data) or not JSON.
    `allow_nan`: accept NaN / Infinity (a training log records the loss of a skipped step as is)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as bad:
                    raise RecordError(
                        f"{path}:{number}: not UTF-8 text (byte {raw[bad.start]:#04x}); binary data given as text?"
                    ) from None
                if not line.strip():
                    continue
                try:
                    yield number, (json.loads(line) if allow_nan else json.loads(line, parse_constant=_refuse_constant))
                except (json.JSONDecodeError, _NonFinite) as bad:
                    raise RecordError(f"{path}:{number}: not valid JSON ({getattr(bad, 'msg', bad)})") from None
    except OSError as bad:
        raise RecordError(f"{path}: cannot read ({bad.strerror or bad})") from None


def write_json(path: str, obj: Any, *, indent: int = 1) -> None:
    """Write a JSON file atomically (temporary sibling, then rename); non-finite floats refused."""
    try:
        text = json.dumps(obj, indent=indent, allow_nan=False)
    except ValueError as bad:
        raise RecordError(f"{path}: refusing to write a non-finite number ({bad})") from None
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text + "\n")
        os.replace(tmp, path)
    except OSError as bad:
        with _suppress():
            os.unlink(tmp)
        raise RecordError(f"{path}: cannot write ({bad.strerror or bad})") from None


# ------------------------------------------------------------------------------------------
# helpers


class _NonFinite(ValueError):
    pass


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return True


def _refuse_constant(name: str) -> Any:
    raise _NonFinite(f"non-finite number {name}")


def _json_type(value: Any) -> str:
    return {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        type(None): "null",
        int: "a number",
        float: "a number",
    }.get(type(value), type(value).__name__)


def _to_json(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_json()
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_json(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        raise RecordError(f"refusing to write a non-finite number {value}")
    return value


def _convert(value: Any, hint: Any, label: str) -> Any:
    """Check `value` against the annotation `hint`; convert lists to tuples / nested records."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(value, option, label)
            except RecordError as bad:
                errors.append(bad)
        raise errors[0] if errors else RecordError(f"{label}: unexpected null")
    if isinstance(hint, type) and issubclass(hint, Record):
        return hint.from_json(value, path=label)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RecordError(f"{label}: expected a number, got {_json_type(value)}")
        return float(value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecordError(f"{label}: expected an integer, got {_json_type(value)}")
        return value
    if hint in (str, bool):
        if not isinstance(value, hint):
            raise RecordError(f"{label}: expected {_json_type(hint())}, got {_json_type(value)}")
        return value
    if hint is type(None):
        if value is not None:
            raise RecordError(f"{label}: expected null, got {_json_type(value)}")
        return None
    if origin in (list, tuple) or hint in (list, tuple):
        if not isinstance(value, list):
            raise RecordError(f"{label}: expected a list, got {_json_type(value)}")
        args = typing.get_args(hint)
        item = args[0] if args else Any
        items = [_convert(v, item, f"{label}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if (origin is tuple or hint is tuple) else items
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise RecordError(f"{label}: expected an object, got {_json_type(value)}")
        args = typing.get_args(hint)
        item = args[1] if len(args) == 2 else Any
        return {k: _convert(v, item, f"{label}.{k}") for k, v in value.items()}
    if typing.get_origin(hint) is typing.Literal:
        if value not in typing.get_args(hint):
            raise RecordError(f"{label}: {value!r} is not one of {typing.get_args(hint)}")
        return value
    return value
