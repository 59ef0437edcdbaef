"""SIGTERM's SystemExit, when Python swallows it (raised inside a gc callback or `__del__`), is sent
again rather than lost (`cli._redeliver_swallowed_exit`)."""

import signal
import types

from nvfp4tool import cli


def test_a_swallowed_sigterm_exit_is_sent_again_and_other_unraisables_pass_on(monkeypatch):
    sent, passed = [], []
    monkeypatch.setattr(cli.os, "kill", lambda pid, sig: sent.append(sig))
    monkeypatch.setattr(cli, "_previous_unraisablehook", passed.append)
    cli._redeliver_swallowed_exit(types.SimpleNamespace(exc_value=SystemExit(128 + signal.SIGTERM)))
    assert sent == [signal.SIGTERM] and passed == []
    other = types.SimpleNamespace(exc_value=ValueError("x"))
    cli._redeliver_swallowed_exit(other)
    assert sent == [signal.SIGTERM] and passed == [other]
