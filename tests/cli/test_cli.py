"""The CLI's contract: version, help for every command, one-line errors and exit codes."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from nvfp4tool import __version__, progress
from nvfp4tool.cli import cli
from nvfp4tool.errors import NVFP4ToolError


def test_version():
    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0
    assert __version__ in result.output


@pytest.mark.parametrize("command", sorted(cli.commands))
def test_every_command_has_help_with_an_example(command):
    result = CliRunner().invoke(cli, [command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Example" in result.output, f"`{command} --help` shows no example"


def test_unknown_command_is_a_usage_error():
    result = CliRunner().invoke(cli, ["no-such-command"])
    assert result.exit_code == 2


@pytest.fixture
def failing_command():
    """Temporarily register commands that fail in the two ways the CLI must handle."""

    @cli.command("_fail-user")
    def fail_user():
        raise NVFP4ToolError("model.safetensors: tensor lm_head.weight: shape mismatch")

    @cli.command("_fail-internal")
    def fail_internal():
        raise RuntimeError("boom")

    @cli.command("_fail-os")
    def fail_os():
        open("/no/such/folder/weights.safetensors", "rb")

    yield
    del cli.commands["_fail-user"], cli.commands["_fail-internal"], cli.commands["_fail-os"]


@pytest.fixture
def reporting_command():
    """A command that reports through nvfp4tool.progress and prints a result line."""
    seen = []

    @cli.command("_report")
    def report():
        seen.append(progress.reporter())
        with progress.task("work", total=2, unit="item") as task:
            task.advance(description="first")
            task.advance(description="second")
        progress.info("status: halfway there")
        click.echo("result: 2 items")

    yield seen
    del cli.commands["_report"]


def test_user_error_is_one_line_exit_1(failing_command):
    result = CliRunner().invoke(cli, ["_fail-user"])
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert lines == ["Error: model.safetensors: tensor lm_head.weight: shape mismatch"]


def test_internal_error_hides_traceback_unless_verbose(failing_command):
    quiet = CliRunner().invoke(cli, ["_fail-internal"])
    assert quiet.exit_code == 1
    assert "Traceback" not in quiet.output
    assert len(quiet.output.strip().splitlines()) == 1
    assert "RuntimeError: boom" in quiet.output

    loud = CliRunner().invoke(cli, ["--verbose", "_fail-internal"])
    assert loud.exit_code == 1
    assert isinstance(loud.exception, RuntimeError)


def test_user_error_with_verbose_reraises(failing_command):
    result = CliRunner().invoke(cli, ["-v", "_fail-user"])
    assert result.exit_code == 1
    assert isinstance(result.exception, NVFP4ToolError)
    assert not isinstance(result.exception, click.ClickException)


def test_user_os_error_is_one_line_naming_the_file(failing_command):
    result = CliRunner().invoke(cli, ["_fail-os"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        "Error: /no/such/folder/weights.safetensors: No such file or directory"
    ]


@pytest.mark.parametrize(
    "flags, reporter, status_shown",
    [
        ([], progress.LineReporter, True),  # CliRunner's stderr is no terminal: auto = text lines
        (["--log-format", "rich"], progress.RichReporter, True),
        (["--log-format", "json"], progress.LineReporter, True),
        (["--quiet"], progress.QuietReporter, False),
        (["-q"], progress.QuietReporter, False),
        (["--quiet", "--log-format", "json"], progress.QuietReporter, False),
    ],
)
def test_each_command_runs_with_the_reporter_and_restores_the_previous(
    reporting_command, flags, reporter, status_shown
):
    sentinel = progress.LoggingReporter()
    previous = progress.use_reporter(sentinel)
    try:
        result = CliRunner().invoke(cli, [*flags, "_report"])
        assert progress.reporter() is sentinel  # restored after the command
    finally:
        progress.use_reporter(previous)
    assert result.exit_code == 0, result.output
    assert type(reporting_command[0]) is reporter
    assert result.stdout == "result: 2 items\n"  # the result always prints, on stdout
    assert ("status: halfway there" in result.stderr) is status_shown
    if not status_shown:
        assert result.stderr == ""


def test_reporter_is_restored_after_a_failing_command(failing_command):
    sentinel = progress.LoggingReporter()
    previous = progress.use_reporter(sentinel)
    try:
        assert CliRunner().invoke(cli, ["--quiet", "_fail-user"]).exit_code == 1
        assert progress.reporter() is sentinel
    finally:
        progress.use_reporter(previous)


def test_verbose_and_quiet_together_is_a_usage_error():
    result = CliRunner().invoke(cli, ["-v", "-q", "check", "."])
    assert result.exit_code == 2 and "--quiet" in result.output
