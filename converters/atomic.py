"""Atomic output folders: write everything into a temporary sibling, rename into place at the end.

    with atomic_output_dir(out, force=False, inputs=(src,), flag="--out") as tmp:
        ...write files into tmp...

An output overlapping an input is refused (exit 2); an existing one is replaced only with `force=True`;
a failed write leaves nothing behind. `scratch_dir(prefix)`: marked work folders in the system temp.
Design notes: docs/design/converters.md.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator

from nvfp4tool import progress
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError

MARKER_FILE = ".nvfp4tool-partial"  # inside each temporary folder: the writer's pid


@contextlib.contextmanager
def atomic_output_dir(
    out_dir: str | os.PathLike, force: bool = False, *, inputs: Iterable[str | os.PathLike] = (), flag: str = "output"
) -> Iterator[str]:
    """Yield a fresh temporary folder next to `out_dir`; on success it becomes `out_dir`.

    Refuses before anything is written: an output overlapping one of `inputs` (NVFP4UsageError,
    naming `flag`), an existing `out_dir` without `force`, or one that is not a folder. Stale
    temporary siblings of ours are cleaned first (a previous output caught mid-replacement is put
    back before the existence check). Parent folders it had to create are removed again on failure.
    """
    out_dir = os.path.abspath(os.fspath(out_dir))
    check_output_path(out_dir, inputs, flag=flag)
    parent, base = os.path.split(out_dir)
    with _one_line(out_dir):
        clean_stale_siblings(out_dir)
    _check_replaceable(out_dir, force)
    created = _missing_ancestors(parent)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp_dir = tempfile.mkdtemp(prefix=f".{base}.tmp-", dir=parent)
    except OSError as bad:
        _remove_empty(created)
        raise NVFP4ToolError(f"{out_dir}: cannot create the output folder ({bad.strerror or bad})") from None
    try:
        with _one_line(out_dir):
            os.chmod(tmp_dir, 0o777 & ~_umask())  # mkdtemp makes it private (0700)
            _write_marker(tmp_dir)
            yield tmp_dir
            _check_replaceable(out_dir, force)  # someone may have created it meanwhile
            _publish(tmp_dir, out_dir)
    except BaseException:
        _remove(tmp_dir)
        _remove_empty(created)
        raise


def check_output_path(
    out_dir: str | os.PathLike, inputs: Iterable[str | os.PathLike], *, flag: str = "output", force: bool | None = None
) -> None:
    """NVFP4UsageError if `out_dir` is, contains or lies inside any of `inputs` (real paths); with
    `force` given, also the existing-output refusal of `atomic_output_dir`, so a writer can say both
    before any long work (atomic_output_dir checks again when it starts)."""
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
        raise NVFP4UsageError(
            f"{flag} {os.fspath(out_dir)}: {relation} the input {os.fspath(source)}; "
            f"writing there would destroy the source (choose another folder)"
        )
    if force is not None:
        _check_replaceable(os.path.abspath(os.fspath(out_dir)), force)


def clean_stale_siblings(out_dir: str) -> list[str]:
    """Remove our temporary siblings of `out_dir` whose writer has exited; returns what was removed.

    Ours: named `.<out>.tmp-*` / `.<out>.old-*` and holding a marker with a pid that is not
    running. A previous output caught mid-replacement (in `.<out>.old-*/<out>` while `out` is
    missing) is renamed back first. A marker left inside `out` itself (a run killed between
    publishing the folder and removing the marker: the output is complete) is removed too.
    """
    parent, base = os.path.split(os.path.abspath(out_dir))
    done = []
    for kind in ("old", "tmp"):  # put a previous output back before anything else
        for path in sorted(glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(base)}.{kind}-*"))):
            pid = _stale_pid(path)
            if pid is None:
                continue  # not ours, or its writer is still running
            kept = os.path.join(path, base)
            if kind == "old" and os.path.isdir(kept) and not os.path.lexists(out_dir):
                os.rename(kept, out_dir)  # interrupted mid-replacement: the previous output comes back
                progress.info(f"restored {out_dir} from {path} (a replacement was interrupted)")
            _remove(path)
            progress.info(f"removed {path}: temporary folder of an interrupted run (pid {pid})")
            done.append(path)
    pid = _stale_pid(out_dir) if not os.path.islink(out_dir) else None
    if pid is not None:
        os.unlink(os.path.join(out_dir, MARKER_FILE))
        progress.info(f"removed the marker of an interrupted run (pid {pid}) from {out_dir}")
    return done


def write_files(folder: str, names: list[str], write: Callable[[str], None]) -> list[str]:
    """Files `names` into the existing `folder`, each complete or not there: `write(stage)` writes
    them into a marked temporary sibling `.<folder>.tmp-*` (atomic_output_dir's naming), then each
    is renamed into `folder`. A run killed meanwhile leaves the sibling, never a temporary file
    inside `folder`; the next call (or atomic_output_dir) removes it first, as it removes the
    temporary files of older writers inside `folder` (`stale_files`). Returns the paths written.
    The one report writer of validate and eval."""
    folder = os.path.abspath(folder)
    parent, base = os.path.split(folder)
    clean_stale(folder)
    with _one_line(folder):
        stage = tempfile.mkdtemp(prefix=f".{base}.tmp-", dir=parent)
    try:
        with _one_line(folder):
            _write_marker(stage)
            write(stage)
            missing = [n for n in names if not os.path.isfile(os.path.join(stage, n))]
            if missing:
                raise NVFP4ToolError(f"{os.path.join(folder, missing[0])}: was not written")
            for name in names:
                os.replace(os.path.join(stage, name), os.path.join(folder, name))
    finally:
        _remove(stage)
    return [os.path.join(folder, name) for name in names]


def clean_stale(folder: str) -> None:
    """Remove what interrupted writers of `folder` left: its stale temporary siblings
    (`clean_stale_siblings`) and our stale temporary files inside it (`stale_files`), each said.
    Validate and eval call it before anything else (before hashing the export's files)."""
    folder = os.path.abspath(folder)
    with _one_line(folder):
        clean_stale_siblings(folder)
        for path, pid in stale_files(folder):
            os.unlink(path)
            progress.info(f"removed {path}: temporary file of an interrupted run (pid {pid})")


_TEMP_FILE = re.compile(r"^\.tmp-(\d+)-.+$|^.+\.tmp-(\d+)$")  # older report writers', records.base.write_json's


def leftover_pid(name: str) -> int | None:
    """The writer's pid when file `name` is one of our temporary files (`.tmp-PID-NAME` of the older
    eval report writer, `NAME.tmp-PID` of write_json), else None."""
    found = _TEMP_FILE.match(name)
    return int(found.group(1) or found.group(2)) if found else None


def stale_files(folder: str) -> list[tuple[str, int]]:
    """(path, pid) of our temporary files directly in `folder` whose writer has exited."""
    out = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        pid = leftover_pid(name)
        path = os.path.join(folder, name)
        if pid is not None and os.path.isfile(path) and not os.path.islink(path) and not _alive(pid):
            out.append((path, pid))
    return out


def scratch_dir(prefix: str) -> str:
    """A new folder in the system temporary folder for this process's work files, marked like the
    output siblings (its owner removes it when done). Stale ones of `prefix` (their process
    killed) are removed first, and said."""
    root = tempfile.gettempdir()
    for path in sorted(glob.glob(os.path.join(glob.escape(root), f"{glob.escape(prefix)}*"))):
        pid = _stale_pid(path)
        if pid is not None:
            _remove(path)
            progress.info(f"removed {path}: scratch folder of an interrupted run (pid {pid})")
    folder = tempfile.mkdtemp(prefix=prefix)
    _write_marker(folder)
    return folder


# ------------------------------------------------------------------------------------------
# helpers


def _publish(tmp_dir: str, out_dir: str) -> None:
    """Rename the finished `tmp_dir` to `out_dir` (moving an existing one aside first), then drop
    the marker. Killed at any point, `clean_stale_siblings` finds every folder marked."""
    parent, base = os.path.split(out_dir)
    if not os.path.exists(out_dir):
        os.rename(tmp_dir, out_dir)
    else:
        old_dir = tempfile.mkdtemp(prefix=f".{base}.old-", dir=parent)
        _write_marker(old_dir)
        os.rename(out_dir, os.path.join(old_dir, base))
        os.rename(tmp_dir, out_dir)
        _remove(old_dir)
    os.unlink(os.path.join(out_dir, MARKER_FILE))


@contextlib.contextmanager
def _one_line(out_dir: str) -> Iterator[None]:
    """An OSError becomes one NVFP4ToolError line naming `out_dir` (for the output, its temporary
    siblings and their contents) or the file it concerns (anything else, e.g. an unreadable input)."""
    try:
        yield
    except OSError as bad:
        where = bad.filename if isinstance(bad.filename, (str, bytes, os.PathLike)) else None
        if where is not None and not _ours(os.path.abspath(os.fsdecode(where)), out_dir):
            raise NVFP4ToolError(f"{os.fsdecode(where)}: {bad.strerror or bad}") from None
        raise NVFP4ToolError(f"{out_dir}: cannot write the output ({bad.strerror or bad})") from None


def _ours(path: str, out_dir: str) -> bool:
    """Whether `path` is `out_dir`, one of its temporary siblings, or inside one of them."""
    parent, base = os.path.split(out_dir)
    if path != parent and not _inside(path, parent):
        return False
    first = os.path.relpath(path, parent).split(os.sep)[0]
    return first == base or first.startswith(f".{base}.")


def _remove(folder: str) -> None:
    """Remove one of our temporary folders, its marker last (a kill midway leaves it marked)."""
    if not os.path.isdir(folder):
        return
    for entry in os.listdir(folder):
        if entry != MARKER_FILE:
            path = os.path.join(folder, entry)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(path)
    shutil.rmtree(folder, ignore_errors=True)


def _missing_ancestors(folder: str) -> list[str]:
    """The ancestors of `folder` (itself included) that do not exist, deepest first."""
    missing = []
    while not os.path.lexists(folder) and os.path.dirname(folder) != folder:
        missing.append(folder)
        folder = os.path.dirname(folder)
    return missing


def _remove_empty(folders: list[str]) -> None:
    for folder in folders:  # deepest first
        with contextlib.suppress(OSError):
            os.rmdir(folder)


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


def _stale_pid(folder: str) -> int | None:
    """The pid in `folder`'s marker if that process is gone; None if unmarked (not ours) or alive."""
    pid = _marker_pid(folder) if os.path.isdir(folder) else None
    return pid if pid is not None and not _alive(pid) else None


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
