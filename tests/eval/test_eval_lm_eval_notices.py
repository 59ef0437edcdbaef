"""lm-eval's "Custom kwargs can be passed to `--metadata`" notice (issue 42: printed once per task):
lm-eval logs it whenever it builds a task whose data comes from a `custom_dataset` function, which
every task shipped with nvfp4tool is, and eval has no `--metadata` to pass. Building the shipped
tasks logs it no more; lm-eval's other warnings still show."""

from __future__ import annotations

import logging


def test_building_the_shipped_tasks_logs_no_metadata_notice_and_keeps_other_warnings(caplog):
    from nvfp4tool.eval.evaluate import _build_tasks, resolve_tasks

    names, manager = resolve_tasks(("nvfp4tool_mc", "nvfp4tool_text"))
    with caplog.at_level(logging.WARNING):
        _build_tasks(names, manager)
        logging.getLogger("lm_eval.api.task").warning("a real warning of a task")
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("lm_eval")]
    assert not [m for m in messages if "Custom kwargs" in m], messages
    assert "a real warning of a task" in messages
    # lm-eval's own warnings while it built the tasks still pass (here: nvfp4tool_text's metrics)
    assert any("nvfp4tool_text" in m for m in messages), messages
