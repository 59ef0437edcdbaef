"""Generation settings and the lm-eval backend's model_args (issue 39): every value typed or refused
by its one owner (nvfp4tool/eval/gen_settings.py), out-of-range settings and seeds refused as usage
errors before any model is opened, unknown model_args named, and the lm-eval entry point's refusals
one line without a traceback."""

import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from nvfp4tool.cli import cli
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError
from nvfp4tool.eval import evaluate
from nvfp4tool.eval.gen_settings import boolean, check, parse

from fixtures import REPO_ROOT


def test_values_are_typed():
    assert parse("do_sample=false,temperature=0.7,top_k=50,max_gen_toks=8,until=Q:") == {
        "do_sample": False,
        "temperature": 0.7,
        "top_k": 50,
        "max_gen_toks": 8,
        "until": "Q:",
    }
    typed = parse("do_sample=TRUE,temperature=1,top_p=1")
    assert typed["do_sample"] is True and isinstance(typed["temperature"], float) and typed["top_p"] == 1.0
    assert check({"do_sample": 0, "max_gen_toks": 4.0, "until": ["a", "b"]}, "task t") == {
        "do_sample": False,
        "max_gen_toks": 4,
        "until": ["a", "b"],
    }
    assert boolean("1", "x") is True and boolean("False", "x") is False


BAD = [
    ("do_sample=no", "do_sample=no: not a boolean"),
    ("do_sample=maybe", "do_sample=maybe: not a boolean"),
    ("do_sample=yes", "do_sample=yes: not a boolean"),
    ("temperature=warm", "temperature=warm: not a number"),
    ("max_gen_toks=many", "max_gen_toks=many: not an integer"),
    ("top_k=some", "top_k=some: not an integer"),
    ("top_k=2.5", "top_k=2.5: not an integer"),
    ("max_gen_toks=0", "max_gen_toks=0: must be >= 1"),
    ("max_gen_toks=-1", "max_gen_toks=-1: must be >= 1"),
    ("top_k=-3", "top_k=-3: must be >= 0"),
    ("do_sample=true,temperature=-1", "temperature=-1: must be >= 0 (0 decodes greedily)"),
    ("temperature=inf", "temperature=inf: not a finite number"),
    ("temperature=nan", "temperature=nan: not a finite number"),
    ("top_p=0", "top_p=0: must be > 0"),
    ("top_p=1.5", "top_p=1.5: must be <= 1"),
    ("top_k=1,top_k=2", "top_k is given twice"),
]


@pytest.mark.parametrize(("text", "message"), BAD, ids=[t for t, _ in BAD])
def test_a_bad_setting_is_named(text, message):
    with pytest.raises(NVFP4UsageError) as raised:
        parse(text)
    assert str(raised.value).startswith("--gen-kwargs ") and message in str(raised.value)


def test_a_task_setting_is_checked_naming_the_task():
    with pytest.raises(NVFP4UsageError, match=r"^task t: generation_kwargs do_sample=no: not a boolean"):
        check({"do_sample": "no"}, "task t: generation_kwargs")
    with pytest.raises(NVFP4UsageError, match=r"until=3: expected a stop string"):
        check({"until": 3}, "task t: generation_kwargs")
    with pytest.raises(NVFP4UsageError, match=r"max_gen_toks=True: not an integer"):
        check({"max_gen_toks": True}, "task t: generation_kwargs")


@pytest.fixture
def no_model(monkeypatch, tmp_path):
    """An empty folder as EXPORT, and evaluation replaced by a failure: a refusal must come first."""

    def opened(*args, **kwargs):
        raise AssertionError("the evaluation started")

    monkeypatch.setattr(evaluate, "evaluate_export", opened)
    from nvfp4tool.api import proof  # the CLI calls the library through the API, which holds the name

    monkeypatch.setattr(proof, "evaluate_export", opened)
    folder = tmp_path / "export"
    folder.mkdir()
    return folder


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--gen-kwargs", "do_sample=no,temperature=0.7"], "--gen-kwargs do_sample=no: not a boolean"),
        (["--gen-kwargs", "max_gen_toks=0"], "--gen-kwargs max_gen_toks=0: must be >= 1"),
        (["--gen-kwargs", "top_k=-3,do_sample=true,temperature=1"], "--gen-kwargs top_k=-3: must be >= 0"),
        (["--gen-kwargs", "temperature=inf"], "--gen-kwargs temperature=inf: not a finite number"),
        (["--seed", "-1"], "--seed"),
        (["--seed", str(2**32)], "--seed"),
    ],
)
def test_eval_refuses_before_any_model_runs(no_model, extra, message):
    result = CliRunner().invoke(cli, ["eval", str(no_model), "--tasks", "nvfp4tool_gsm", *extra])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in result.output, result.output
    assert os.listdir(no_model) == []


def test_the_largest_seed_is_accepted(no_model):
    result = CliRunner().invoke(cli, ["eval", str(no_model), "--tasks", "nvfp4tool_gsm", "--seed", str(2**32 - 1)])
    assert result.exit_code == 1 and "AssertionError: the evaluation started" in result.output, result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"frobnicate": 1}, "model_args frobnicate: unknown (accepted: path, export,"),
        ({"fp8_kvv": "true", "ofload": "never"}, "model_args fp8_kvv, ofload: unknown"),
        ({"share_prefixes": "maybe"}, "model_args share_prefixes=maybe: not a boolean"),
        ({"fp8_kv": "no"}, "model_args fp8_kv=no: not a boolean"),
        ({"seed": -1}, "model_args seed=-1: must be in 0..2**32-1"),
        ({"seed": "abc"}, "model_args seed=abc: not an integer"),
    ],
)
def test_bad_model_args_are_usage_errors_before_anything_opens(tmp_path, args, message):
    from nvfp4tool.eval.lm_backend import NVFP4ToolLM

    with pytest.raises(NVFP4UsageError) as raised:
        NVFP4ToolLM(path=str(tmp_path / "no-such-folder"), **args)
    assert message in str(raised.value)


def test_batch_size_given_twice():
    from nvfp4tool.eval.lm_backend import NVFP4ToolLM

    with pytest.raises(NVFP4UsageError, match=r"batch_size given twice: model_args batch_size=4 and --batch_size 8"):
        NVFP4ToolLM.create_from_arg_string("path=/no/such,batch_size=4", {"batch_size": 8, "device": None})
    # lm-eval's default --batch_size (1) gives way to model_args': the model is opened (and missing)
    with pytest.raises(NVFP4ToolError, match=r"/no/such: not a folder"):
        NVFP4ToolLM.create_from_arg_string("path=/no/such,batch_size=4", {"batch_size": 1, "device": "cpu"})


@pytest.mark.parametrize(
    ("model_args", "code", "message"),
    [
        ("path=/no/such/export", 1, "error: /no/such/export: not a folder"),
        ("path=/no/such/export,max_length=abc", 2, "error: model_args max_length=abc: not an integer"),
        ("path=/no/such/export,frobnicate=1", 2, "error: model_args frobnicate: unknown"),
    ],
)
def test_the_lm_eval_entry_point_refuses_in_one_line(model_args, code, message):
    command = [sys.executable, "-m", "nvfp4tool.eval.lm_backend", "run", "--model", "nvfp4tool"]
    result = subprocess.run(
        [*command, "--model_args", model_args, "--tasks", "nvfp4tool_mc", "--limit", "1"],
        cwd=REPO_ROOT,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT), JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == code, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and message in result.stderr.splitlines()[-1], result.stderr[-3000:]
