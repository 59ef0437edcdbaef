"""Atomic output folders: write everything into a temporary sibling, rename into place at the end.

    with atomic_output_dir(out, force=False, inputs=(src,), flag="--out") as tmp:
        ...write files into tmp...
    # out now exists, complete, with the user's normal permissions (0777 & ~umask)

Guarantees (the README's safety promises):
* An output that is, contains or lies inside any input (resolved real paths, symlinks included)
  is refused as bad usage (`NVFP4UsageError`, exit 2), `--force` or not: replacing it would
  destroy the source.
* An existing output is replaced only with `force=True`, and only once the new one is complete;
  a file (or a symlink) in its place is never replaced.
* A failed or interrupted write leaves neither a half-written `out` nor, on the next run, its
  temporary folder: each temporary sibling (`.<out>.tmp-*`, `.<out>.old-*`) carries a marker file
  with the writer's pid; the next run removes those whose writer is gone (only ours, recognised by
  name and marker) and says so. A previous output caught mid-replacement (in `.<out>.old-*` while
  `out` is missing) is put back rather than removed.
* Operating-system errors inside the temporary folder (read-only or full disk) become one line
  naming `out`, not the temporary path.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator

from nvfp4tool import progress
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError

MARKER_FILE = ".nvfp4tool-partial"  # inside each temporary folder: the writer's pid


@contextlib.contextmanager
def atomic_output_dir(out_dir: str | os.PathLike, force: bool = False, *,
                      inputs: Iterable[str | os.PathLike] = (), flag: str = "output") -> Iterator[str]:
    """Yield a fresh temporary folder next to `out_dir`; on success it becomes `out_dir`.

    Refuses before anything is written: an output overlapping one of `inputs` (NVFP4UsageError,
    naming `flag`), an existing `out_dir` without `force`, or one that is not a folder.
    """
    out_dir = os.path.abspath(os.fspath(out_dir))
    check_output_path(out_dir, inputs, flag=flag)
    _check_replaceable(out_dir, force)
    parent, base = os.path.split(out_dir)
    try:
        os.makedirs(parent, exist_ok=True)
        clean_stale_siblings(out_dir)
        tmp_dir = tempfile.mkdtemp(prefix=f".{base}.tmp-", dir=parent)
    except OSError as bad:
        raise NVFP4ToolError(f"{out_dir}: cannot create the output folder "
                             f"({bad.strerror or bad})") from None
    try:
        os.chmod(tmp_dir, 0o777 & ~_umask())  # mkdtemp makes it private (0700)
        _write_marker(tmp_dir)
        yield tmp_dir
        _check_replaceable(out_dir, force)  # someone may have created it meanwhile
        os.unlink(os.path.join(tmp_dir, MARKER_FILE))
        if os.path.exists(out_dir):
            old_dir = tempfile.mkdtemp(prefix=f".{base}.old-", dir=parent)
            _write_marker(old_dir)
            os.rename(out_dir, os.path.join(old_dir, base))
            os.rename(tmp_dir, out_dir)
            shutil.rmtree(old_dir, ignore_errors=True)
        else:
            os.rename(tmp_dir, out_dir)
    except OSError as bad:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        if isinstance(bad, (PermissionError,)) or bad.errno in (errno.ENOSPC, errno.EROFS, errno.EDQUOT,
                                                                  errno.EACCES):
            raise NVFP4ToolError(f"{out_dir}: cannot write the output ({bad.strerror or bad})") from None
        raise
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise


def check_output_path(out_dir: str | os.PathLike, inputs: Iterable[str | os.PathLike], *,
                      flag: str = "output") -> None:
    """NVFP4UsageError if `out_dir` is, contains or lies inside any of `inputs` (real paths)."""
    out_real = os.path.realpath(os.fspath(out_dir))
    for source in inputs:
        if source is None:
            continue
        src_real = os.path.realpath(os.fspath(source))
        if out_real == src_real:
            relation = "is"
        elif _inside(out_real, src_real):
            relation = "lies inside"
        elif _inside(src_real, out_real):
            relation = "contains"
        else:
            continue
        raise NVFP4UsageError(f"{flag} {os.fspath(out_dir)}: {relation} the input {os.fspath(source)}; "
                              f"writing there would destroy the source (choose another folder)")


def clean_stale_siblings(out_dir: str) -> list[str]:
    """Remove our temporary siblings of `out_dir` whose writer has exited; returns what was done."""
    parent, base = os.path.split(os.path.abspath(out_dir))
    done = []
    for path in sorted(glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(base)}.old-*"))
                       + glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(base)}.tmp-*"))):
        pid = _marker_pid(path)
        if pid is None or _alive(pid):
            continue  # not ours, or its writer is still running
        kept = os.path.join(path, base)
        if os.path.basename(path).startswith(f".{base}.old-") and os.path.isdir(kept) \
                and not os.path.lexists(out_dir):
            os.rename(kept, out_dir)  # interrupted mid-replacement: the previous output comes back
            progress.info(f"restored {out_dir} from {path} (a replacement was interrupted)")
        shutil.rmtree(path, ignore_errors=True)
        progress.info(f"removed {path}: temporary folder of an interrupted run (pid {pid})")
        done.append(path)
    return done


# ------------------------------------------------------------------------------------------
# helpers


def _check_replaceable(out_dir: str, force: bool) -> None:
    if not os.path.lexists(out_dir):
        return
    if not os.path.isdir(out_dir) or os.path.islink(out_dir):
        raise NVFP4ToolError(f"{out_dir}: exists and is not a folder; refusing to replace it")
    if not force:
        raise NVFP4ToolError(f"{out_dir}: already exists; pass force=True (--force) to replace it")


def _inside(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder and path != folder


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_marker(folder: str) -> None:
    with open(os.path.join(folder, MARKER_FILE), "w") as f:
        f.write(f"{os.getpid()}\n")


def _marker_pid(folder: str) -> int | None:
    try:
        with open(os.path.join(folder, MARKER_FILE)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
