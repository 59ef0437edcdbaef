"""Progress when stderr is not a terminal (issue 26): `nvfp4tool.progress.LineReporter`.

CliRunner's stderr is no terminal, so every command here runs as it runs in a log (Slurm, CI,
`nohup`): `--log-format auto` = timestamped text lines. The table drives each long command on the
session's tiny fixtures (`pristine`) and asserts its stages' `done` lines (done/total and elapsed),
that every stderr line is a timestamped one, and that `--quiet` prints nothing on stderr;
`--log-format json` (and `NVFP4TOOL_LOG_FORMAT=json`) lines parse with the documented keys. The
rate bound, nesting, `stopped` and `compiling` are unit-tested with a fake clock. (validate,
validate --sensitivity and the GPTQ export assert their lines in their own CLI tests,
test_validate_cli.py and test_gptq_export.py, whose runs are already there.)
"""

from __future__ import annotations

import io
import json
import re

import numpy as np
import pytest
from click.testing import CliRunner

from nvfp4tool import progress
from nvfp4tool.cli import cli

from fixtures.hub_server import HubServer

STAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"
ELAPSED = r"(?:\d+\.\d s|\d+m\d\ds|\d+h\d\dm)"
DONE = re.compile(
    rf"^{STAMP} (?P<stage>.+?): done, (?P<done>\d+)/(?P<total>\d+) (?P<unit>\S+) \(\d+%\)"
    rf"(?:, [^;]*?)?, elapsed (?P<elapsed>{ELAPSED})"
)
TASK_KEYS = {
    "time",
    "event",
    "stage",
    "done",
    "total",
    "unit",
    "rate",
    "bytes_per_s",
    "elapsed_s",
    "eta_s",
    "item",
    "fields",
}


def done_lines(stderr: str) -> dict[str, re.Match]:
    """{stage: its `done` line's match} of a text-format stderr."""
    return {m["stage"]: m for m in map(DONE.match, stderr.splitlines()) if m}


@pytest.fixture(scope="module")
def train_inputs(tmp_path_factory):
    from nvfp4tool.corpus.sources import embedded_corpus
    from nvfp4tool.corpus.tokenizer import train_bpe_tokenizer

    root = tmp_path_factory.mktemp("progress_train")
    text = embedded_corpus()[1].read_text(encoding="utf-8")[:6000]
    (root / "corpus.txt").write_text(text, encoding="utf-8")
    train_bpe_tokenizer([text], 300, root / "tokenizer")
    return root


def _convert(p, out, train):
    return ["convert", p["hf"], out, "--to", "maxtext", "--model-config", p["hf"], "--rope-layout", "half"]


def _convert_format(p, out, train):
    return ["convert-format", p["mo"], out, "--to", "compressed-tensors"]


def _check(p, out, train):
    return ["check", p["mo"], "--tp", "1,2"]


def _export(p, out, train):
    return ["export", p["hf"], "--out", out, "--calib-data", p["ids"], "--calib-samples", "4", "--calib-seq-len", "32"]


def _train(p, out, train):
    return [
        "train",
        "model=tiny",
        f"data={train / 'corpus.txt'}",
        f"tokenizer={train / 'tokenizer'}",
        "recipe=bf16",
        "steps=2",
        "seq_len=16",
        "batch_size=4",
        "eval_every=2",
        "eval_batches=1",
        "checkpoint_every=0",
        f"out={out}",
    ]


# (id, argv builder, stages whose `done` line must appear {stage: unit}, status fragments, also quiet)
COMMANDS = [
    ("convert", _convert, {"convert": "tensor"}, [], True),
    ("convert-format", _convert_format, {"convert-format": "tensor"}, [], True),
    ("check", _check, {"check": "module"}, [], True),
    (
        "export",
        _export,
        {"loading weights": "tensor", "calibration": "window", "export": "tensor"},
        ["loading calibration"],
        True,
    ),
    # a -q train run is test_adversarial_train's fixture (it asserts an empty stderr): not twice here
    (
        "train",
        _train,
        {"train": "step"},
        ["compiling train step ...", "compiled train step in", "compiled eval step in"],
        False,
    ),
]


@pytest.mark.parametrize(
    "build, stages, fragments, quiet",
    [
        pytest.param(build, stages, fragments, quiet, id=f"{name}-{'quiet' if quiet else 'lines'}")
        for name, build, stages, fragments, also_quiet in COMMANDS
        for quiet in (False, True)[: 1 + also_quiet]
    ],
)
@pytest.mark.slow  # > 15 s of the inner loop (tests/durations.json)
def test_a_piped_command_prints_progress_lines_and_quiet_none(
    build, stages, fragments, quiet, pristine, train_inputs, tmp_path, monkeypatch
):
    monkeypatch.delenv(progress.LOG_FORMAT_ENV, raising=False)
    out = str(tmp_path / "out")
    result = CliRunner().invoke(cli, [*(["--quiet"] if quiet else []), *build(pristine, out, train_inputs)])
    assert result.exit_code == 0, result.output
    if quiet:
        assert result.stderr == "", result.stderr
        return
    lines = result.stderr.splitlines()
    assert lines and all(re.match(rf"{STAMP} ", line) for line in lines), result.stderr  # nothing but our lines
    found = done_lines(result.stderr)
    for stage, unit in stages.items():
        assert stage in found, f"no done line for {stage}:\n{result.stderr}"
        assert found[stage]["unit"] == unit and found[stage]["done"] == found[stage]["total"], found[stage][0]
        assert re.search(rf"{STAMP} {re.escape(stage)}: start, 0/\d+ {unit}$", result.stderr, re.M), result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, f"{fragment!r} not in:\n{result.stderr}"
    assert result.stdout.strip() and not re.match(STAMP, result.stdout)  # the result stays on stdout, unstamped


def test_push_to_a_hub_reports_the_upload_and_quiet_prints_only_warnings(pristine, hub_env, tmp_path, monkeypatch):
    monkeypatch.delenv(progress.LOG_FORMAT_ENV, raising=False)
    argv = ["push", pristine["mo"], "--repo-id", "org/progress", "--no-validation"]
    with HubServer() as hub:
        loud = CliRunner().invoke(cli, [*argv, "--endpoint", hub.url])
        quiet = CliRunner().invoke(cli, ["-q", *argv, "--endpoint", hub.url])
    assert loud.exit_code == 0 and quiet.exit_code == 0, loud.output + quiet.output
    upload = done_lines(loud.stderr)["upload"]
    assert upload["unit"] == "file" and int(upload["done"]) == int(upload["total"]) > 1
    assert "MB/s" in upload[0]
    assert all(re.match(rf"{STAMP} ", line) for line in loud.stderr.splitlines()), loud.stderr  # no tqdm bars
    # --quiet: no progress or status line; the warnings stay, bare (the fixture's card has no license)
    warnings = [re.sub(rf"^{STAMP} ", "", line) for line in loud.stderr.splitlines() if " Warning: " in line]
    assert warnings and quiet.stderr.splitlines() == warnings, quiet.stderr


@pytest.mark.parametrize("how", ["option", "env"])
def test_json_lines_parse_with_the_documented_keys(how, pristine, tmp_path, monkeypatch):
    argv = ["convert-format", pristine["mo"], str(tmp_path / "ct"), "--to", "compressed-tensors"]
    if how == "option":
        monkeypatch.setenv(progress.LOG_FORMAT_ENV, "text")  # the option wins over the environment
        argv = ["--log-format", "json", *argv]
    else:
        monkeypatch.setenv(progress.LOG_FORMAT_ENV, "json")
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.stderr.splitlines()]
    events = [(r["event"], r.get("stage")) for r in records]
    assert ("start", "convert-format") in events and ("done", "convert-format") in events, events
    for record in records:
        if record["event"] in ("start", "progress", "done"):
            assert set(record) == TASK_KEYS, record
            assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", record["time"])
    done = next(r for r in records if r["event"] == "done" and r["stage"] == "convert-format")
    assert done["done"] == done["total"] > 0 and done["unit"] == "tensor" and done["elapsed_s"] >= 0
    assert done["eta_s"] == 0 and done["rate"] > 0


def test_a_bad_log_format_in_the_environment_is_a_usage_error(monkeypatch, tmp_path):
    monkeypatch.setenv(progress.LOG_FORMAT_ENV, "xml")
    result = CliRunner().invoke(cli, ["check", str(tmp_path)])
    assert result.exit_code == 2
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "--log-format" in errors[0] and "xml" in errors[0], result.output


# ---------------------------------------------------------------------------------------- units


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _reporter(json_lines=False):
    stream, clock = io.StringIO(), FakeClock()
    return progress.LineReporter(stream, json_lines=json_lines, clock=clock), stream, clock


# (advances, seconds between two, most lines: start + one per 10 s + done, fewest)
RATES = [
    (1000, 0.001, 2, 2),  # 1000 advances in 1 s: start and done only
    (1000, 0.1, 2 + 10, 2 + 9),  # 100 s: about one line per 10 s
    (5, 30.0, 2 + 5, 2 + 4),  # slow steps: each a line (the last one is the done line)
    (100000, 0.0, 2, 2),
]


@pytest.mark.parametrize("advances, step, most, fewest", RATES)
def test_lines_are_bounded_by_the_interval(advances, step, most, fewest):
    reporter, stream, clock = _reporter()
    with _installed(reporter):
        with progress.task("stage", total=advances, unit="item") as task:
            for _ in range(advances):
                clock.t += step
                task.advance()
    lines = stream.getvalue().splitlines()
    assert fewest <= len(lines) <= most, lines
    assert "stage: start, 0/" in lines[0] and "stage: done," in lines[-1]
    assert f"{advances}/{advances} item" in lines[-1]


def test_a_progress_line_has_count_throughput_elapsed_eta_and_fields():
    reporter, stream, clock = _reporter()
    with _installed(reporter), progress.task("export", total=10, unit="tensor") as task:
        clock.t = 12.0
        task.advance(4, description="model.layers.3.mlp.up_proj", nbytes=8_000_000, fields={"loss": "3.2100"})
    line = stream.getvalue().splitlines()[1]
    assert re.fullmatch(
        rf"{STAMP} export: 4/10 tensor \(40%\), 3\.0 s/tensor, 0\.7 MB/s, elapsed 12\.0 s, "
        r"ETA 18\.0 s; model\.layers\.3\.mlp\.up_proj; loss 3\.2100",
        line,
    ), line


def test_nested_short_tasks_print_nothing_and_a_failure_says_stopped():
    reporter, stream, clock = _reporter()
    with _installed(reporter):
        with pytest.raises(ValueError):
            with progress.task("sensitivity", total=50, unit="group") as outer:
                for _ in range(50):
                    with progress.task("forward", total=2, unit="layer") as inner:  # 2 s each: silent
                        clock.t += 1
                        inner.advance()
                        clock.t += 1
                        inner.advance()
                    outer.advance()
                with progress.task("forward", total=2, unit="layer") as inner:  # 12 s: prints
                    clock.t += 12
                    inner.advance()
                    raise ValueError("boom")
    lines = stream.getvalue().splitlines()
    stages = [line.split(" ", 1)[1] for line in lines]
    assert stages[0] == "sensitivity: start, 0/50 group"
    assert sum(s.startswith("sensitivity: ") and "group" in s for s in stages) <= 2 + 100 // 10 + 1
    assert [s for s in stages if s.startswith("forward")] == [
        "forward: 1/2 layer (50%), 12.0 s/layer, elapsed 12.0 s, ETA 12.0 s",
        "forward: stopped, 1/2 layer (50%), 12.0 s/layer, elapsed 12.0 s",
    ]
    assert stages[-1].startswith("sensitivity: stopped, 50/50 group")


def test_compiling_reports_the_first_call_of_a_key_once():
    reporter, stream, _ = _reporter(json_lines=True)
    key = ("test_progress_lines", object())
    with _installed(reporter):
        for _ in range(3):
            with progress.compiling("train step", key=key):
                pass
        with progress.compiling("one-off"):
            pass
    records = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [(r["event"], r["stage"]) for r in records] == [
        ("compile_start", "train step"),
        ("compile_done", "train step"),
        ("compile_start", "one-off"),
        ("compile_done", "one-off"),
    ]
    assert records[0]["elapsed_s"] is None and records[1]["elapsed_s"] >= 0


def test_compiling_without_a_compiling_method_falls_back_to_status_lines():
    from fixtures.reporters import _Lines  # a reporter that records status lines and has no `compiling`

    lines = _Lines()
    with _installed(lines), progress.compiling("eval step"):
        pass
    assert lines.lines[0] == "compiling eval step ..." and lines.lines[1].startswith("compiled eval step in ")


@pytest.mark.parametrize(
    "quiet, log_format, tty, kind",
    [
        (False, "auto", True, progress.RichReporter),
        (False, "auto", False, progress.LineReporter),
        (False, "text", True, progress.LineReporter),
        (False, "json", False, progress.LineReporter),
        (False, "rich", False, progress.RichReporter),
        (True, "json", False, progress.QuietReporter),
        (True, "auto", True, progress.QuietReporter),
    ],
)
def test_for_cli_picks_bars_on_a_terminal_and_lines_in_a_log(quiet, log_format, tty, kind):
    class Stream(io.StringIO):
        def isatty(self):
            return tty

    chosen = progress.for_cli(quiet=quiet, log_format=log_format, stream=Stream())
    assert type(chosen) is kind
    if kind is progress.LineReporter:
        assert chosen.json_lines == (log_format == "json")


def test_large_file_hashing_reports_a_task(tmp_path, monkeypatch):
    from nvfp4tool.records import export as records_export

    path = tmp_path / "weights.bin"
    path.write_bytes(np.arange(300_000, dtype=np.uint8).tobytes())
    monkeypatch.setattr(records_export, "HASH_TASK_BYTES", 100_000)
    reporter, stream, _ = _reporter()
    with _installed(reporter):
        digest = records_export._sha256_file.__wrapped__(str(path), (0, 0, 300_000, 0), 1 << 16)
    import hashlib

    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    done = done_lines(stream.getvalue())["sha256 weights.bin"]
    assert (done["done"], done["total"], done["unit"]) == ("5", "5", "chunk")


class _installed:
    """Install a reporter for the block."""

    def __init__(self, reporter) -> None:
        self.reporter = reporter

    def __enter__(self):
        self.previous = progress.use_reporter(self.reporter)
        return self.reporter

    def __exit__(self, *exc):
        progress.use_reporter(self.previous)
