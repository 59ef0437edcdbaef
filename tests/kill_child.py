"""Child process of tests/test_kill.py: run one nvfp4tool command and stop at a chosen point.

    python tests/kill_child.py POINT READY_FILE nvfp4tool-arguments...

POINT is where the command stops, writes its temporary output folder's path into READY_FILE and
sleeps until the test kills it (SIGKILL):
    start    the temporary output folder exists and is marked, nothing written into it yet
    mid      the MID_AT-th tensor read after that (env, default 12): the output is half-written
    publish  the output is complete in its temporary folder, not yet renamed into place
    replace  (with --force over an existing output) the previous output has been moved aside and
             the new one not yet moved in
    gptq     (export --weight-rounding gptq) the GPTQ_AT-th linear (env, default 3) is about to be
             rounded: the earlier ones' records are spilled inside the temporary output folder
    write    (export) the WRITE_AT-th tensor (env, default 12) is handed to the safetensors writer
The points are reached by wrapping module attributes from here (converters.atomic's marker writer,
publisher and `os`; the tensor readers of converters.hf and converters.maxtext; export's GPTQ
rounding and tensor loader): the code under test is unchanged and carries no test hook.
"""

from __future__ import annotations

import os
import sys
import time

from converters import atomic, hf, maxtext

POINT, READY = sys.argv[1], sys.argv[2]
MID_AT = int(os.environ.get("MID_AT", "12"))
TMP_PREFIX = os.environ.get("TMP_PREFIX", ".")  # which temporary folder counts (train makes two)
_state = {"tmp": None, "reads": 0}


def _stop_here() -> None:
    with open(READY + ".part", "w") as f:
        f.write(_state["tmp"] or "")
    os.rename(READY + ".part", READY)
    time.sleep(600)


def _write_marker(folder: str) -> None:
    _real_write_marker(folder)
    name = os.path.basename(folder)
    if ".tmp-" in name and name.startswith(TMP_PREFIX) and _state["tmp"] is None:
        _state["tmp"] = folder
        if POINT == "start":
            _stop_here()


def _counting(read):
    def wrapped(*args, **kwargs):
        if _state["tmp"] is not None:
            _state["reads"] += 1
            if POINT == "mid" and _state["reads"] == MID_AT:
                _stop_here()
        return read(*args, **kwargs)

    return wrapped


def _publish(tmp_dir: str, out_dir: str) -> None:
    if POINT == "publish" and tmp_dir == _state["tmp"]:
        _stop_here()
    _real_publish(tmp_dir, out_dir)


class _RenameStops:
    """`os` for converters.atomic, whose rename stops once an existing output was moved aside."""

    def __getattr__(self, name):
        return getattr(os, name)

    @staticmethod
    def rename(src, dst):
        os.rename(src, dst)
        if POINT == "replace" and ".old-" in os.path.basename(os.path.dirname(dst)):
            _stop_here()


_real_write_marker, _real_publish = atomic._write_marker, atomic._publish
atomic._write_marker, atomic._publish, atomic.os = _write_marker, _publish, _RenameStops()
hf.read_tensor = _counting(hf.read_tensor)
maxtext._fetch = _counting(maxtext._fetch)


def _stop_at_call(function, point: str, at: int):
    """`function`, stopping (at `point`) on its `at`-th call once the temporary folder exists."""
    calls = {"n": 0}

    def wrapped(*args, **kwargs):
        if POINT == point and _state["tmp"] is not None:
            calls["n"] += 1
            if calls["n"] == at:
                _stop_here()
        return function(*args, **kwargs)

    return wrapped


if POINT in ("gptq", "write"):  # export's own points (importing them costs jax: only when asked)
    from nvfp4tool.export import gptq_pass, writer

    gptq_pass.gptq_quantize = _stop_at_call(gptq_pass.gptq_quantize, "gptq", int(os.environ.get("GPTQ_AT", "3")))
    writer._ModuleLoader.load = _stop_at_call(writer._ModuleLoader.load, "write", int(os.environ.get("WRITE_AT", "12")))

if __name__ == "__main__":
    from nvfp4tool.cli import main

    main(sys.argv[3:])  # exits; reaching no point is seen by the test as an early exit
