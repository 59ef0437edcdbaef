"""validate's prose on the terminal and in a log (issue 42): each sentence (the verdict, how the
models ran, a skipped generation) is printed as one whole line, not wrapped at the console's 80
columns mid-sentence."""

from __future__ import annotations

import dataclasses
import io

from fixtures.validate_fixtures import validation_record

SKIPPED = "--gen-tokens 0 asked for no generated tokens, so no prompt was generated from (first divergence: -)"


def test_validate_prints_each_sentence_whole_on_one_line():
    from rich.console import Console

    from nvfp4tool.records.validation import Failure, Generation, Resources
    from nvfp4tool.validate.report import print_report, resources_line, verdict

    record = validation_record(passed=False)
    failures = [
        Failure(metric="kl_mean", value=0.236, limit=0.05, by=0.186, detail="nvfp4 vs bf16 [per token, mean]"),
        Failure(metric="ppl_increase", value=0.21, limit=0.05, by=0.16, detail="nvfp4 vs bf16 (relative)"),
    ]
    record = dataclasses.replace(
        record,
        failures=failures,
        generation=dataclasses.replace(record.generation, skipped=SKIPPED),
        resources=Resources(
            offload="auto",
            models={"bf16": "held", "fp8": "held", "nvfp4": "streamed"},
            peak_rss_bytes=2_330_000_000,
            seconds=1982.4,
        ),
    )
    assert isinstance(record.generation, Generation)
    out = io.StringIO()
    print_report(record, Console(file=out, width=80, force_terminal=False, color_system=None))
    lines = out.getvalue().splitlines()
    expected = [
        verdict(record).replace("**", ""),
        resources_line(record),
        f"greedy generation skipped: {SKIPPED}",
    ]
    for sentence in expected:
        assert len(sentence) > 80  # longer than the console: it would have wrapped
        assert sentence in lines, (sentence, out.getvalue())
