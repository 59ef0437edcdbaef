"""The CLI's contract: version, help for every command, one-line errors and exit codes."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from nvfp4tool import __version__
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

    yield
    del cli.commands["_fail-user"], cli.commands["_fail-internal"]


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
