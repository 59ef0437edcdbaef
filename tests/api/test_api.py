"""nvfp4tool.api against the CLI: the same keywords, defaults and rules, bad arguments refused before
any work, and each command a call of its function."""

from __future__ import annotations

import inspect
import os

import click
import pytest
from click.testing import CliRunner

from nvfp4tool import api
from nvfp4tool.api import rules
from nvfp4tool.cli import cli
from nvfp4tool.errors import NVFP4UsageError
from nvfp4tool.export import ExportOptions

COMMANDS = {
    "convert": api.convert,
    "export": api.export,
    "check": api.check,
    "validate": api.validate,
    "eval": api.evaluate,
    "push": api.push,
    "quickstart": api.quickstart,
    "convert-format": api.convert_format,
    "data prepare": api.prepare_data,
    "data verify": api.verify_data,
    "plot": api.plot,
}
CLI_ONLY = {  # what only the command line has: its output form, and a hidden alias
    "check": {"as_json"},
    "export": {"to"},
}
API_ONLY = {"quickstart": {"echo"}}  # where a Python caller gets the stage lines
SPELLING = {"fmt": "format", "data_format": "format", "license_": "license"}  # click parameter -> keyword
RENAMED = {"export": {"src": "source"}, "plot": {"out_png": "out"}}  # export SRC is api.export(source, ...)


def _command(name: str) -> click.Command:
    """`nvfp4tool NAME` ("data prepare": a subcommand)."""
    command = cli
    for part in name.split():
        command = command.commands[part]
    return command


def test_every_command_has_a_function():
    commands = [f"{n} {s}" for n, c in cli.commands.items() for s in getattr(c, "commands", {})]
    commands += [n for n, c in cli.commands.items() if not hasattr(c, "commands")]
    assert set(commands) - {"train"} == set(COMMANDS)  # train: api.train(config, *overrides, **keys)


def _keywords(fn) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(fn).parameters)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_is_a_keyword_with_the_same_default(name):
    command, fn = _command(name), COMMANDS[name]
    spelling = {**SPELLING, **RENAMED.get(name, {})}
    params = {spelling.get(p.name, p.name): p for p in command.params if p.name not in CLI_ONLY.get(name, set())}
    keywords = {k: p for k, p in _keywords(fn).items() if k not in API_ONLY.get(name, set())}
    assert set(params) == set(keywords), (
        f"{name}: CLI-only {set(params) - set(keywords)}, API-only {set(keywords) - set(params)}"
    )
    for key, param in params.items():
        if isinstance(param, click.Argument):
            kind = inspect.Parameter.VAR_POSITIONAL if param.nargs == -1 else inspect.Parameter.POSITIONAL_OR_KEYWORD
            assert keywords[key].kind is kind, f"{name} {key}: not positional as on the command line"
            continue
        expected = keywords[key].default
        if key == "tp":  # the command line's text of the API's tuple
            expected = ",".join(map(str, expected))
        if expected is inspect.Parameter.empty:
            assert param.required, f"{name} --{key}: the API requires it, the CLI does not"
        else:
            assert param.default == expected, f"{name} --{key}: CLI default {param.default!r}, API {expected!r}"


def test_the_defaults_are_the_library_options_own():
    """Read from the options records, not retyped: the API's default is the library's value."""
    for field in ("format", "quant", "calib_samples", "calib_seq_len", "scale_search", "gptq_damp", "offload"):
        assert rules.default(api.export, field) == getattr(ExportOptions(), field)
    # the limits default to the export's quant's (validate.thresholds.defaults_for): None here
    assert rules.default(api.validate, "min_layer_sqnr") is None and rules.default(api.validate, "max_kl_mean") is None


@pytest.mark.parametrize(
    "call, named",
    [
        (lambda d: api.export(d["src"], d["out"], calib_samples=0), "calib_samples=0: expected >= 1"),
        (lambda d: api.export(d["src"], d["out"], quant="int4"), "quant='int4': expected one of nvfp4, "),
        (lambda d: api.export(d["src"], d["out"], calib_data=d["missing"]), "calib_data="),
        (lambda d: api.export(d["src"], d["out"], step=-1), "step=-1: expected >= 0"),
        (lambda d: api.export(d["src"], d["out"], calib_seq_len=True), "calib_seq_len=True: expected an integer"),
        (lambda d: api.export(d["src"], d["out"], calib_samples=8), "calib_samples sizes the calibration"),
        (lambda d: api.export(d["src"], d["out"], max_shard_size="5XB"), "max_shard_size='5XB'"),
        (lambda d: api.convert(d["src"], d["out"], to="hf", dtype="fp16"), "dtype='fp16': expected one of bf16, fp32"),
        (lambda d: api.validate(d["src"], data=d["data"], samples=0), "samples=0: expected >= 1"),
        (lambda d: api.validate(d["src"], data=d["data"], max_kl_mean=float("nan")), "expected a finite number"),
        (lambda d: api.validate(d["src"], data=d["data"], reference="int8"), "not fp8, bf16 or an existing"),
        (lambda d: api.validate(d["src"], data=d["data"], json_copy=d["missing"] + "/v.json"), "does not exist"),
        (lambda d: api.evaluate(d["src"], tasks="nvfp4tool_mc", seed=-1), "seed=-1: expected >= 0"),
        (lambda d: api.evaluate(d["src"], tasks=" , "), "no task given"),
        (lambda d: api.evaluate(d["src"], tasks="x", gen_kwargs={"temperature": -1}), "gen_kwargs temperature"),
        (lambda d: api.check(d["missing"]), "path="),
        (lambda d: api.push(d["src"], repo_id="o/n", endpoint="ftp://hub"), "not an http(s) URL"),
        (lambda d: api.push(d["src"], repo_id="o/n", timeout=0), "timeout=0: expected > 0"),
        (lambda d: api.convert(d["src"], d["out"], to="gguf"), "to='gguf': expected one of hf, maxtext"),
        (lambda d: api.quickstart(out=d["out"], pretrain_steps=0), "pretrain_steps=0"),
        (lambda d: api.prepare_data(d["src"], d["missing"], tokenizer=d["src"], out=d["out"]), "sources='"),
        (lambda d: api.prepare_data(d["src"], tokenizer=d["src"], out=d["out"], workers=-1), "workers=-1"),
        (lambda d: api.verify_data(d["missing"]), "cache="),
        (lambda d: api.plot(d["src"], labels=("a", "b")), "2 --label for 1 runs"),
        (lambda d: api.plot(d["src"], out=d["missing"] + "/loss.png"), "does not exist"),
        (lambda d: api.convert_format(d["src"], d["out"], to="gguf"), "to='gguf'"),
        (lambda d: api.train(steps="many"), "steps"),
        (lambda d: api.train(no_such_key=1), "no_such_key"),
    ],
)
def test_a_bad_argument_is_a_usage_error_naming_it_before_any_work(tmp_path, call, named):
    paths = {"src": str(tmp_path), "out": str(tmp_path / "out"), "missing": str(tmp_path / "missing")}
    paths["data"] = str(tmp_path / "val.txt")
    with open(paths["data"], "w") as f:
        f.write("text")
    with pytest.raises(NVFP4UsageError, match=None) as raised:
        call(paths)
    assert named in str(raised.value) and "\n" not in str(raised.value)
    assert sorted(os.listdir(tmp_path)) == ["val.txt"]  # nothing created


def test_the_cli_refuses_with_the_api_rule_before_the_library_runs(tmp_path):
    """The click types are built from the API's rules: the same bounds, exit 2, click's message."""
    runner = CliRunner()
    result = runner.invoke(cli, ["validate", str(tmp_path), "--data", __file__, "--reference", "int8"])
    assert result.exit_code == 2
    assert "Invalid value for '--reference': 'int8' is not fp8, bf16 or an existing export folder." in result.output
    result = runner.invoke(cli, ["export", str(tmp_path), "--out", str(tmp_path / "o"), "--calib-seq-len", "1"])
    assert result.exit_code == 2 and "1 is not in the range x>=2" in result.output


class _Called(Exception):
    pass


@pytest.mark.parametrize(
    "argv, name, given",
    [
        (["convert", "{d}", "{d}/out", "--to", "hf"], "convert", {"src": "{d}", "dst": "{d}/out", "to": "hf"}),
        (["export", "{d}", "--out", "{d}/out"], "export", {"source": "{d}", "out": "{d}/out"}),
        (
            ["convert-format", "{d}", "{d}/o", "--to", "modelopt"],
            "convert_format",
            {"src": "{d}", "out": "{d}/o", "to": "modelopt"},
        ),
        (["check", "{d}", "--tp", "1,2"], "check", {"path": "{d}", "tp": (1, 2)}),
        (["validate", "{d}", "--data", "{f}"], "validate", {"export": "{d}", "data": "{f}"}),
        (["eval", "{d}", "--tasks", "a,b"], "evaluate", {"export": "{d}", "tasks": "a,b"}),
        (["push", "{d}", "--repo-id", "o/n"], "push", {"path": "{d}", "repo_id": "o/n"}),
        (["quickstart"], "quickstart", {"echo": click.echo}),
        (
            ["data", "prepare", "{f}", "--tokenizer", "{d}", "--out", "{d}/c"],
            "prepare_data",
            {"sources": ("{f}",), "tokenizer": "{d}", "out": "{d}/c"},
        ),
        (["data", "verify", "{d}"], "verify_data", {"cache": "{d}"}),
        (["plot", "{d}"], "plot", {"runs": ("{d}",)}),
        (["train", "model=tiny", "steps=3"], "train", {"config": None, "overrides": ("model=tiny", "steps=3")}),
    ],
)
def test_each_command_is_one_call_of_its_function_with_the_defaults(tmp_path, monkeypatch, argv, name, given):
    """The command passes every keyword (train: its texts): what it parsed, and for every option not
    given the function's own default."""
    fn, calls = getattr(api, name), []
    path = str(tmp_path / "val.txt")
    with open(path, "w") as f:
        f.write("text")

    def fill(value):
        if isinstance(value, tuple):
            return tuple(fill(v) for v in value)
        return value.format(d=tmp_path, f=path) if isinstance(value, str) else value

    def record(*args, **kwargs):
        calls.append(inspect.signature(fn).bind(*args, **kwargs).arguments)
        raise _Called

    monkeypatch.setattr(api, name, record)
    result = CliRunner().invoke(cli, ["-v", *(fill(a) for a in argv)])  # -v: our exception, not a line
    assert isinstance(result.exception, _Called), result.output
    (arguments,) = calls
    expected = {k: p.default for k, p in _keywords(fn).items() if p.default is not inspect.Parameter.empty}
    expected.update({k: fill(v) for k, v in given.items()})
    assert set(arguments) == {k for k, p in _keywords(fn).items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
    assert {k: arguments[k] for k in expected} == expected
