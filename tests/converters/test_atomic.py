"""`converters.atomic.atomic_output_dir`: overlap refusal, stale-temporary cleanup (only ours),
restore of an interrupted replacement, permissions, one-line OS errors, kill -9 mid-write."""

from __future__ import annotations

import errno
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from converters import atomic
from converters.atomic import MARKER_FILE, atomic_output_dir, clean_stale_siblings
from nvfp4tool import progress
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError

from fixtures import REPO_ROOT
from fixtures.file_fixtures import Recorder, snapshot

ROOT = Path(REPO_ROOT)


@pytest.fixture
def said():
    recorder = Recorder()
    previous = progress.use_reporter(recorder)
    yield recorder.lines
    progress.use_reporter(previous)


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def marked(folder: Path, pid: int, files: dict[str, str] | None = None) -> Path:
    folder.mkdir(parents=True)
    (folder / MARKER_FILE).write_text(f"{pid}\n")
    for name, text in (files or {}).items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


def write(out, text="new", **kwargs):
    with atomic_output_dir(out, **kwargs) as tmp:
        Path(tmp, "data.txt").write_text(text)


# ------------------------------------------------------------------------------ overlap refusal


@pytest.fixture
def tree(tmp_path) -> Path:
    """tmp/work/src/{config.json, sub/w.bin} and a symlink tmp/work/link -> src."""
    src = tmp_path / "work" / "src"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text("{}")
    (src / "sub" / "w.bin").write_bytes(b"\x00\x01")
    (tmp_path / "work" / "link").symlink_to(src, target_is_directory=True)
    return tmp_path


OVERLAPS = [  # (output relative to tmp, input relative to tmp, relation)
    ("work/src", "work/src", "is"),
    ("work", "work/src", "contains"),
    ("work/src/sub", "work/src", "lies inside"),
    ("work/src/new", "work/src", "lies inside"),
    ("work/link", "work/src", "is"),  # the symlink resolves to the source
    ("work/link/new", "work/src", "lies inside"),
    ("work/src", "work/link", "is"),  # an input given through a symlink
]


@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("out, src, relation", OVERLAPS)
def test_output_overlapping_an_input_is_refused_and_nothing_touched(tree, out, src, relation, force):
    before = snapshot(tree)
    with pytest.raises(NVFP4UsageError) as error:
        write(tree / out, force=force, inputs=[tree / src], flag="--out")
    message = str(error.value)
    assert message.startswith(f"--out {tree / out}: {relation} the input {tree / src}")
    assert "\n" not in message
    assert snapshot(tree) == before


def test_unrelated_inputs_and_sibling_names_pass(tree):
    write(tree / "work" / "src-out", inputs=[tree / "work" / "src", None], flag="--out")  # a prefix, not inside
    assert (tree / "work" / "src-out" / "data.txt").read_text() == "new"


# ------------------------------------------------------------------------- stale temporary folders


def test_only_our_stale_temporaries_are_removed_and_said(tmp_path, said):
    out = tmp_path / "out"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stale_pid, stale_old_pid = dead_pid(), dead_pid()
        stale = marked(tmp_path / ".out.tmp-abc", stale_pid, {"model.safetensors": "half"})
        stale_old = marked(tmp_path / ".out.old-def", stale_old_pid)  # nothing inside: just removed
        keep = {
            "foreign": tmp_path / ".out.tmp-foreign",  # our name, no marker
            "garbage marker": tmp_path / ".out.tmp-garbage",
            "live writer": marked(tmp_path / ".out.tmp-live", live.pid),
            "other output": marked(tmp_path / ".other.tmp-x", dead_pid()),
            "similar name": marked(tmp_path / ".out.tmpx", dead_pid()),
            "ours, this process": marked(tmp_path / ".out.tmp-me", os.getpid()),
        }
        keep["foreign"].mkdir()
        (keep["foreign"] / "x").write_text("someone else's")
        marked(keep["garbage marker"], 0)
        (keep["garbage marker"] / MARKER_FILE).write_text("not a pid")
        write(out)
        assert not stale.exists() and not stale_old.exists()
        for what, path in keep.items():
            assert path.exists(), what
        assert sorted(said) == sorted(
            f"removed {path}: temporary folder of an interrupted run (pid {pid})"
            for path, pid in ((stale, stale_pid), (stale_old, stale_old_pid))
        )
        assert (out / "data.txt").read_text() == "new" and not (out / MARKER_FILE).exists()
    finally:
        live.kill()
        live.wait()


def test_interrupted_replacement_is_restored_not_lost(tmp_path, said):
    """Killed between moving the old output aside and moving the new one in: `out` is missing, the
    previous output waits in `.out.old-*/out`, the new one in a marked `.out.tmp-*`."""
    out = tmp_path / "out"
    marked(tmp_path / ".out.old-1", dead_pid(), {"out/data.txt": "previous"})
    marked(tmp_path / ".out.tmp-2", dead_pid(), {"data.txt": "complete but unpublished"})
    with pytest.raises(NVFP4ToolError, match="already exists; pass force=True"):
        write(out)  # the restored output is an existing output: not replaced without force
    assert sorted(os.listdir(tmp_path)) == ["out"] and (out / "data.txt").read_text() == "previous"
    assert said[0] == f"restored {out} from {tmp_path / '.out.old-1'} (a replacement was interrupted)"
    write(out, force=True)
    assert (out / "data.txt").read_text() == "new" and sorted(os.listdir(tmp_path)) == ["out"]


def test_replacement_finished_but_old_copy_left_is_removed(tmp_path):
    out = marked(tmp_path / "out", dead_pid(), {"data.txt": "new"})  # killed before the marker went
    marked(tmp_path / ".out.old-1", dead_pid(), {"out/data.txt": "previous"})
    assert clean_stale_siblings(str(out)) == [str(tmp_path / ".out.old-1")]
    assert (out / "data.txt").read_text() == "new" and not (out / MARKER_FILE).exists()
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_failed_write_leaves_nothing_and_removes_created_parents(tmp_path):
    out = tmp_path / "a" / "b" / "out"
    with pytest.raises(NVFP4ToolError, match="boom"):
        with atomic_output_dir(out) as tmp:
            Path(tmp, "half.bin").write_bytes(b"\0" * 10)
            raise NVFP4ToolError("boom")
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------- permissions, OS errors


@pytest.mark.parametrize("umask, mode", [(0o022, 0o755), (0o027, 0o750), (0o002, 0o775)])
def test_output_has_the_users_normal_permissions(tmp_path, umask, mode):
    previous = os.umask(umask)
    try:
        write(tmp_path / "out")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(os.stat(tmp_path / "out").st_mode) == mode


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_parent_is_one_line_naming_the_output(tmp_path):
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        with pytest.raises(NVFP4ToolError) as error:
            write(parent / "out")
    finally:
        parent.chmod(0o755)
    assert str(error.value) == f"{parent / 'out'}: cannot create the output folder (Permission denied)"


def test_cannot_create_the_temporary_folder_names_the_output(tmp_path, monkeypatch):
    def refuse(prefix, dir):
        raise PermissionError(errno.EACCES, "Permission denied", os.path.join(dir, prefix + "x"))

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    with pytest.raises(NVFP4ToolError) as error:
        write(tmp_path / "new" / "out")
    assert str(error.value) == f"{tmp_path / 'new' / 'out'}: cannot create the output folder (Permission denied)"
    assert os.listdir(tmp_path) == []  # the parent it created is gone again


@pytest.mark.parametrize("where, named", [("inside", "out"), ("input", "input")])
def test_os_error_while_writing_is_one_line(tmp_path, where, named):
    out = tmp_path / "out"
    with pytest.raises(NVFP4ToolError) as error:
        with atomic_output_dir(out) as tmp:
            path = os.path.join(tmp, "shard.bin") if where == "inside" else str(tmp_path / "input.bin")
            raise OSError(
                errno.ENOSPC if where == "inside" else errno.EACCES,
                "No space left on device" if where == "inside" else "Permission denied",
                path,
            )
    expected = (
        f"{out}: cannot write the output (No space left on device)"
        if named == "out"
        else f"{tmp_path / 'input.bin'}: Permission denied"
    )
    assert str(error.value) == expected
    assert os.listdir(tmp_path) == []


def test_a_file_or_symlink_in_place_is_never_replaced(tmp_path):
    (tmp_path / "f").write_text("x")
    (tmp_path / "target").mkdir()
    (tmp_path / "l").symlink_to(tmp_path / "target")
    for name in ("f", "l"):
        with pytest.raises(NVFP4ToolError, match="exists and is not a folder"):
            write(tmp_path / name, force=True)
    assert (tmp_path / "f").read_text() == "x" and os.listdir(tmp_path / "target") == []


# ------------------------------------------------------------------------------------ kill -9

_CHILD = """
import os, sys, time
from pathlib import Path
from converters.atomic import atomic_output_dir
out, ready, force = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
with atomic_output_dir(out, force=force) as tmp:
    Path(tmp, "part.bin").write_bytes(b"\\0" * 4096)
    Path(ready).write_text(tmp)
    time.sleep(60)
"""


@pytest.mark.parametrize("existing", [False, True])
def test_kill_9_mid_write_leaves_the_old_state_and_the_rerun_cleans_up(tmp_path, existing, said):
    out = tmp_path / "out"
    if existing:
        write(out, "previous")
    ready = tmp_path.parent / f"{tmp_path.name}.ready"
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(out), str(ready), "1"], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT))
    )
    try:
        for _ in range(600):
            if ready.exists() and ready.read_text():
                break
            assert child.poll() is None, "the child exited early"
            time.sleep(0.05)
        tmp = Path(ready.read_text())
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert tmp.exists() and tmp.name.startswith(".out.tmp-")  # the debris a kill leaves
    assert (out / "data.txt").read_text() == "previous" if existing else not out.exists()
    write(out, force=existing)
    assert not tmp.exists() and sorted(os.listdir(tmp_path)) == ["out"]
    assert f"removed {tmp}: temporary folder of an interrupted run (pid {child.pid})" in said


def test_scratch_dir_is_marked_and_stale_ones_are_removed(tmp_path, monkeypatch, said):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    stale_pid = dead_pid()
    stale = marked(tmp_path / "nvfp4tool-maxtext-old", stale_pid, {"stack/c/0": "x"})
    unmarked = tmp_path / "nvfp4tool-maxtext-unmarked"
    unmarked.mkdir()
    other = marked(tmp_path / "something-else", dead_pid())
    folder = atomic.scratch_dir("nvfp4tool-maxtext-")
    assert Path(folder).parent == tmp_path and (Path(folder) / MARKER_FILE).read_text() == f"{os.getpid()}\n"
    assert not stale.exists() and unmarked.exists() and other.exists()
    assert said == [f"removed {stale}: scratch folder of an interrupted run (pid {stale_pid})"]
    atomic.scratch_dir("nvfp4tool-maxtext-")  # a live owner's folder (this process) is kept
    assert Path(folder).exists()
