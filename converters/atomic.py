"""Atomic output folders: write everything into a temporary sibling, rename into place at the end.

A failed or interrupted write leaves neither a half-written `out_dir` nor the temporary folder;
an existing `out_dir` is replaced only with `force=True` (and only once the new one is complete).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterator

from nvfp4tool.errors import NVFP4ToolError


@contextlib.contextmanager
def atomic_output_dir(out_dir: str | os.PathLike, force: bool = False) -> Iterator[str]:
    """Yield a fresh temporary folder next to `out_dir`; on success it becomes `out_dir`.

    Raises NVFP4ToolError before anything is written when `out_dir` exists and `force` is False,
    or when `out_dir` exists and is not a folder.
    """
    out_dir = os.path.abspath(os.fspath(out_dir))
    _check_replaceable(out_dir, force)
    parent, base = os.path.split(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=f".{base}.tmp-", dir=parent)
    try:
        yield tmp_dir
        _check_replaceable(out_dir, force)  # someone may have created it meanwhile
        if os.path.exists(out_dir):
            old_dir = tempfile.mkdtemp(prefix=f".{base}.old-", dir=parent)
            os.rename(out_dir, os.path.join(old_dir, base))
            os.rename(tmp_dir, out_dir)
            shutil.rmtree(old_dir, ignore_errors=True)
        else:
            os.rename(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise


def _check_replaceable(out_dir: str, force: bool) -> None:
    if not os.path.lexists(out_dir):
        return
    if not os.path.isdir(out_dir) or os.path.islink(out_dir):
        raise NVFP4ToolError(f"{out_dir}: exists and is not a folder; refusing to replace it")
    if not force:
        raise NVFP4ToolError(f"{out_dir}: already exists; pass force=True (--force) to replace it")
