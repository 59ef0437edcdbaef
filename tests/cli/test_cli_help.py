"""Help that stands alone (issue 26): every option of every command says what it does and its real
default and range; `train --help` and `train --list-keys` list every TrainConfig key."""

from __future__ import annotations

import dataclasses
import re

import click
import pytest
from click.testing import CliRunner

from nvfp4tool.cli import cli
from nvfp4tool.run.config import TrainConfig, key_table


def _options():
    """(command, option) for every option of the group and of every command (hidden ones too)."""
    for param in cli.params:
        if isinstance(param, click.Option):
            yield "nvfp4tool", param
    for name, command in sorted(cli.commands.items()):
        for param in command.params:
            if isinstance(param, click.Option) and param.name != "help":
                yield name, param


OPTIONS = list(_options())


@pytest.mark.parametrize("command,option", OPTIONS, ids=[f"{c} {o.opts[-1]}" for c, o in OPTIONS])
def test_every_option_has_help_and_its_default(command, option):
    assert option.help and len(option.help) > 10, f"{command} {option.opts}: no help text"
    has_default = option.default is not None and not option.is_flag and not option.multiple and not option.required
    if has_default:  # shown by click, or said in the text
        assert option.show_default or "default" in option.help.lower(), f"{command} {option.opts}: default not shown"


def test_the_command_list_shows_each_summary_whole():
    """`nvfp4tool --help` at 80 columns: each command's summary whole (click cuts a long first
    sentence with "..."), and each one that command's own (its short_help)."""
    text = CliRunner().invoke(cli, ["--help"], terminal_width=80).output
    listed = text.split("Commands:", 1)[1].splitlines()[1:]
    assert len(listed) == len(cli.commands), text
    for line in listed:
        name, summary = line.split(None, 1)
        assert summary == cli.commands[name].short_help and not summary.endswith("..."), line


@pytest.mark.parametrize("command", sorted(cli.commands))
def test_help_shows_no_meaningless_range_or_single_choice(command):
    text = CliRunner().invoke(cli, [command, "--help"], terminal_width=200).output
    assert "None" not in text, f"`{command} --help` prints None:\n{text}"
    for choices in re.findall(r"\[([a-z0-9|.-]+)\]", text):  # a choice list of one is no choice
        assert "|" in choices or choices in ("required",), f"`{command} --help`: single choice [{choices}]"


def test_validate_help_states_the_real_threshold_defaults():
    text = CliRunner().invoke(cli, ["validate", "--help"], terminal_width=200).output
    assert re.search(
        r"--min-layer-sqnr.*Default by the export's quant: 12 for every quant\.\s+\[any finite number\]", text
    )
    assert re.search(r"--min-top1 .*default: no\s+limit", text)
    assert re.search(r"--max-kl-mean .*KL.*quant: fp8 0\.1, nvfp4-weight-only 0\.1, nvfp4 0\.25\.\s+\[x>=0\]", text)
    assert re.search(r"--max-kl-p99 .*quant: fp8 0\.5, nvfp4-weight-only 1, nvfp4 2\.\s+\[x>=0\]", text)


def test_export_still_accepts_the_hidden_to_safetensors():
    result = CliRunner().invoke(cli, ["export", "--help"])
    assert "--to" not in result.output and "--scale-search [rtn|4over6|mse]" in result.output
    result = CliRunner().invoke(cli, ["export", "/nonexistent-src", "--to", "safetensors", "--out", "/tmp/x"])
    assert "--to" not in result.output  # accepted; the missing source is what is refused
    assert CliRunner().invoke(cli, ["export", "x", "--to", "gguf", "--out", "y"]).exit_code == 2


def test_every_train_key_has_a_description():
    rows = key_table()
    assert [r[0] for r in rows] == [f.name for f in dataclasses.fields(TrainConfig)]
    for key, kind, default, text in rows:
        assert text and len(text) > 10, f"train key {key}: no description"
        assert kind and default, key


def test_train_help_and_list_keys_show_every_key_with_type_and_default():
    helped = CliRunner().invoke(cli, ["train", "--help"], terminal_width=200)
    listed = CliRunner().invoke(cli, ["train", "--list-keys"])
    assert helped.exit_code == 0 and listed.exit_code == 0, listed.output
    lines = listed.output.splitlines()
    assert lines[0].split() == ["key", "type", "default", "description"]
    by_key = {line.split()[0]: line for line in lines[1:]}
    for key, kind, default, text in key_table():
        assert re.search(
            rf"^  {key} +{re.escape(text)}  \[{kind}; default: {re.escape(default)}\]$", helped.output, re.M
        ), key
        assert by_key[key].split(None, 1)[1].startswith(kind) and default in by_key[key] and text in by_key[key]
    assert "batch_size" in by_key and "16" in by_key["batch_size"]


def test_a_reader_that_closes_the_pipe_ends_the_listing_quietly():
    """`nvfp4tool train --list-keys | head -1` with the reader gone before the first write (a pipe
    whose read end is closed: deterministic, unlike racing a live reader): SIGPIPE's exit status
    (141), nothing on stderr."""
    import os
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        child = subprocess.run(
            [sys.executable, "-c", "from nvfp4tool.cli import main; main(['train', '--list-keys'])"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            timeout=120,
        )
    finally:
        os.close(write_end)
    err = child.stderr.decode()
    assert child.returncode == 141 and err == "", (child.returncode, err)
    listed = CliRunner().invoke(cli, ["--help"])
    assert "Llama-family" not in listed.output and "(dense, MoE, hybrid)" in listed.output
