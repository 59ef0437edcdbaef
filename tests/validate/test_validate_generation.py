"""Validate's greedy generation reports progress per token: one task counting prompts x tokens,
advanced by the batch as each token is computed, its weights decoded once (a status line)."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
from model.test_generate import _served
from model.test_model import CONFIGS

from nvfp4tool import progress
from nvfp4tool.export.simulate import served_linear
from nvfp4tool.validate import runner


class _Recorder:
    """A reporter that records each task's (name, total, unit) and its advances."""

    def __init__(self) -> None:
        self.lines, self.tasks = [], []

    def start(self, name, total, unit):
        record = {"name": name, "total": total, "unit": unit, "advances": []}
        self.tasks.append(record)

        class _Task:
            def advance(self, n=1, **kwargs):
                record["advances"].append(n)

            def close(self):
                record["closed"] = True

        return _Task()

    def info(self, message):
        self.lines.append(message)


def test_greedy_generation_reports_each_token():
    model = _served(CONFIGS["llama3"])
    prompts = np.random.default_rng(0).integers(0, 97, (3, 6))
    options = dataclasses.replace(runner.ValidateOptions(data="unused"), gen_tokens=4)
    recorder = _Recorder()
    previous = progress.use_reporter(recorder)
    try:
        tokens = runner._greedy("nvfp4", model, served_linear, prompts, options)
    finally:
        progress.use_reporter(previous)
    assert tokens.shape == (3, 4)
    assert recorder.tasks == [
        {"name": "greedy generation (nvfp4)", "total": 12, "unit": "token", "advances": [3, 3, 3, 3], "closed": True}
    ]
    assert recorder.lines[0] == "greedy generation (nvfp4): 3 prompts x 4 tokens"
    assert re.match(
        r"greedy generation \(nvfp4\): \d+ of \d+ linear weights decoded once for generation \(", recorder.lines[1]
    )
