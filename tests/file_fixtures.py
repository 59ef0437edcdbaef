"""Helpers the file-safety tests share: a snapshot of a folder tree, a reporter that records status
lines, and editing a safetensors header in place (data bytes kept)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from nvfp4tool import progress


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under root (symlinks not followed) -> its bytes (None for folders and links)."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            found[os.path.relpath(path, root)] = (
                None if os.path.isdir(path) or os.path.islink(path) else open(path, "rb").read()
            )
    return found


class Recorder:
    """A progress reporter that keeps the status lines (`progress.use_reporter(Recorder())`)."""

    def __init__(self):
        self.lines: list[str] = []

    def start(self, name, total, unit):
        return progress.QuietReporter().start(name, total, unit)

    def info(self, message):
        self.lines.append(message)


def rewrite_header(path: str | Path, edit) -> None:
    """Apply `edit` to a safetensors file's JSON header, keeping the data bytes."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header, data = json.loads(f.read(n)), f.read()
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)
