"""SIGTERM's SystemExit, when Python swallows it (raised inside a gc callback or `__del__`), is sent
again rather than lost (`cli._redeliver_swallowed_exit`)."""

import signal
import subprocess
import sys
import textwrap
import threading
import types

from nvfp4tool import cli


def test_a_swallowed_sigterm_exit_is_sent_again_and_other_unraisables_pass_on(monkeypatch):
    sent, passed = [], []
    monkeypatch.setattr(cli.os, "kill", lambda pid, sig: sent.append(sig))
    monkeypatch.setattr(cli, "_previous_unraisablehook", passed.append)
    cli._redeliver_swallowed_exit(types.SimpleNamespace(exc_value=SystemExit(128 + signal.SIGTERM)))
    for thread in threading.enumerate():  # the signal is sent from another thread
        if thread is not threading.current_thread() and thread.daemon:
            thread.join(timeout=5)
    assert sent == [signal.SIGTERM] and passed == []
    other = types.SimpleNamespace(exc_value=ValueError("x"))
    cli._redeliver_swallowed_exit(other)
    assert sent == [signal.SIGTERM] and passed == [other]


SWALLOWED = textwrap.dedent(
    """
    import os, signal, sys, time
    from nvfp4tool import cli

    cli.install_signal_handlers()

    class Dies:
        def __del__(self):  # the SIGTERM's SystemExit is raised here, where Python swallows it
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100_000):
                pass

    Dies()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        sum(range(1000))
    print("finished as if never signalled")
    """
)


def test_a_sigterm_swallowed_in_a_del_still_ends_the_process_with_143():
    """The real thing, in a child process: the signal lands in a `__del__`, the hook sends it again,
    and the process ends with 128 + SIGTERM instead of running on to exit 0."""
    done = subprocess.run([sys.executable, "-c", SWALLOWED], capture_output=True, text=True, timeout=60)
    assert done.returncode == 128 + signal.SIGTERM, done.stdout + done.stderr
    assert "finished as if never signalled" not in done.stdout
