"""The exit-code contract for every command: bad usage exits 2, rejected by the option types
before any library code runs, with one `Error:` line naming the option as the user typed it.

Each command's library entry point is replaced by a function that fails the test if called, so
a case passes only if the CLI itself refused the usage.
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from nvfp4tool.cli import cli

# the library function each command calls (module, attribute), patched to fail if reached
ENTRY_POINTS = [
    ("nvfp4tool.convert", "convert_checkpoint"),
    ("nvfp4tool.train.trainer", "train"),
    ("nvfp4tool.train.metrics", "plot_runs"),
    ("nvfp4tool.check", "check_checkpoint"),
    ("nvfp4tool.export", "export_checkpoint"),
    ("nvfp4tool.export.convert_format", "convert_format"),
    ("nvfp4tool.hub", "push_checkpoint"),
    ("nvfp4tool.validate.runner", "validate_export"),
    ("nvfp4tool.quickstart", "run_quickstart"),
    ("nvfp4tool.corpus.prepare", "prepare_cache"),
    ("nvfp4tool.corpus.cache", "verify_cache"),
]

# A missing checkpoint (convert / export SRC, validate --source, train model=) is refused by the
# one checkpoint opener, exit 2 with the same message everywhere: tests/converters/test_checkpoints.py.
# (argv with {d} = an existing folder, {f} = an existing file, {m} = a missing path; what the
# Error line must name). Every case exits 2.
CASES = [
    # global
    (["--verbose", "--quiet", "check", "{d}"], "--quiet"),
    (["no-such-command"], "no-such-command"),
    # convert
    (["convert", "{d}", "{d}/out"], "--to"),
    (["convert", "{d}", "{d}/out", "--to", "gguf"], "--to"),
    (["convert", "{d}", "{d}/out", "--to", "hf", "--dtype", "fp16"], "--dtype"),
    (["convert", "{d}", "{d}/out", "--to", "maxtext", "--rope-layout", "sideways"], "--rope-layout"),
    (["convert", "{d}", "{d}/out", "--to", "hf", "--max-shard-size", "5XB"], "--max-shard-size"),
    (["convert", "{d}", "{d}/out", "--to", "hf", "--max-shard-size", "0"], "--max-shard-size"),
    # train (key=value: the config is built before the trainer runs)
    (["train", "data={f}", "steps=0"], "steps=0"),
    (["train", "data={f}", "lr=-1"], "lr=-1"),
    (["train", "data={m}"], "data="),
    (["train", "data={f}", "recipe=fp2"], "recipe="),
    (["train", "data={f}", "no_such_key=1"], "no_such_key"),
    (["train", "{m}.yaml", "data={f}"], ".yaml: config file not found"),
    (["train"], "data=PATH is required"),
    # data
    (["data", "prepare", "{m}", "--tokenizer", "{d}", "--out", "{d}/c"], "{m}"),
    (["data", "prepare", "{f}", "--tokenizer", "{m}", "--out", "{d}/c"], "--tokenizer"),
    (["data", "prepare", "{f}", "--tokenizer", "{d}"], "--out"),
    (["data", "prepare", "{f}", "--tokenizer", "{d}", "--out", "{d}/c", "--workers", "-1"], "--workers"),
    (["data", "prepare", "{f}", "--tokenizer", "{d}", "--out", "{d}/c", "--shard-tokens", "0"], "--shard-tokens"),
    (["data", "verify", "{m}"], "{m}"),
    (["data", "verify", "{f}"], "{f}"),
    # plot
    (["plot"], "RUNS"),
    (["plot", "{m}"], "{m}"),
    (["plot", "{f}"], "{f}"),
    (["plot", "{d}", "-o", "{m}/loss.png"], "-o"),
    (["plot", "{d}", "-o", "{d}"], "-o"),
    (["plot", "{d}", "--label", "a", "--label", "b"], "--label"),
    # check
    (["check", "{m}"], "{m}"),
    (["check", "{f}"], "{f}"),
    (["check", "{d}", "--tp", "0"], "--tp"),
    (["check", "{d}", "--tp", "2,x"], "--tp"),
    (["check", "{d}", "--tp", ""], "--tp"),
    (["check", "{d}", "--json-out", "{m}/report.json"], "--json-out"),
    (["check", "{d}", "--json-out", "{d}"], "--json-out"),
    # export
    (["export", "{d}"], "--out"),
    (["export", "{d}", "--out", "{d}/o", "--format", "gguf"], "--format"),
    (["export", "{d}", "--out", "{d}/o", "--quant", "int4"], "--quant"),
    (["export", "{d}", "--out", "{d}/o", "--scale-search", "best"], "--scale-search"),
    (["export", "{d}", "--out", "{d}/o", "--weight-block", "3d"], "--weight-block"),
    (["export", "{d}", "--out", "{d}/o", "--calib-samples", "0"], "--calib-samples"),
    (["export", "{d}", "--out", "{d}/o", "--calib-samples", "-4"], "--calib-samples"),
    (["export", "{d}", "--out", "{d}/o", "--calib-seq-len", "1"], "--calib-seq-len"),
    (["export", "{d}", "--out", "{d}/o", "--calib-data", "{m}"], "--calib-data"),
    (["export", "{d}", "--out", "{d}/o", "--calib-data", "{d}"], "--calib-data"),
    (["export", "{d}", "--out", "{d}/o", "--step", "-1"], "--step"),
    (["export", "{d}", "--out", "{d}/o", "--max-shard-size", "big"], "--max-shard-size"),
    (["export", "{d}", "--out", "{d}/o", "--rope-layout", "x"], "--rope-layout"),
    (["export", "{d}", "--out", "{d}/o", "--to", "gguf"], "--to"),
    # convert-format
    (["convert-format", "{d}", "{d}/o"], "--to"),
    (["convert-format", "{d}", "{d}/o", "--to", "gguf"], "--to"),
    (["convert-format", "{m}", "{d}/o", "--to", "modelopt"], "{m}"),
    (["convert-format", "{f}", "{d}/o", "--to", "modelopt"], "{f}"),
    # validate
    # eval (option types reject these before lm-eval or a model is touched)
    (["eval", "{d}"], "--tasks"),
    (["eval", "{d}", "--tasks", "nvfp4tool_mc", "--limit", "0"], "--limit"),
    (["eval", "{d}", "--tasks", "nvfp4tool_mc", "--max-drop", "-0.1"], "--max-drop"),
    (["eval", "{d}", "--tasks", "nvfp4tool_mc", "--max-drop", "inf"], "--max-drop"),
    (["eval", "{d}", "--tasks", "nvfp4tool_mc", "--batch-size", "0"], "--batch-size"),
    (["eval", "{d}", "--tasks", "nvfp4tool_mc", "--num-fewshot", "-1"], "--num-fewshot"),
    (["eval", "{d}", "--tasks", "nvfp4tool_mc", "--offload", "sometimes"], "--offload"),
    (["eval", "{d}", "--tasks", "nvfp4tool_mc", "--reference", "{d}/missing"], "--reference"),
    (["validate", "{d}", "--data", "{f}", "--samples", "0"], "--samples"),
    (["validate", "{d}", "--data", "{f}", "--seq-len", "0"], "--seq-len"),
    (["validate", "{d}", "--data", "{f}", "--seq-len", "1"], "--seq-len"),
    (["validate", "{d}", "--data", "{f}", "--batch-size", "0"], "--batch-size"),
    (["validate", "{d}", "--data", "{f}", "--prompts", "0"], "--prompts"),
    (["validate", "{d}", "--data", "{f}", "--prompt-len", "0"], "--prompt-len"),
    (["validate", "{d}", "--data", "{f}", "--gen-tokens", "-1"], "--gen-tokens"),
    (["validate", "{d}", "--data", "{f}", "--max-kl-mean", "-0.1"], "--max-kl-mean"),
    (["validate", "{d}", "--data", "{f}", "--max-kl-mean", "nan"], "--max-kl-mean"),
    (["validate", "{d}", "--data", "{f}", "--max-kl-p99", "inf"], "--max-kl-p99"),
    (["validate", "{d}", "--data", "{f}", "--min-top1", "1.5"], "--min-top1"),
    (["validate", "{d}", "--data", "{f}", "--max-ppl-increase", "-1"], "--max-ppl-increase"),
    (["validate", "{d}", "--data", "{f}", "--min-layer-sqnr", "nan"], "--min-layer-sqnr"),
    (["validate", "{d}", "--data", "{f}", "--kl-target", "0"], "--kl-target"),
    (["validate", "{d}", "--data", "{f}", "--reference", "fp16"], "--reference"),
    (["validate", "{d}", "--data", "{f}", "--reference", "{m}"], "--reference"),
    (["validate", "{d}", "--data", "{f}", "--json", "{m}/v.json"], "--json"),
    (["validate", "{d}", "--data", "{m}"], "--data"),
    (["validate", "{d}"], "--data"),
    (["validate", "{m}", "--data", "{f}"], "{m}"),
    # push
    (["push", "{d}"], "--repo-id"),
    (["push", "{m}", "--repo-id", "a/b"], "{m}"),
    (["push", "{d}", "--repo-id", "a/b", "--timeout", "0"], "--timeout"),
    (["push", "{d}", "--repo-id", "a/b", "--timeout", "nan"], "--timeout"),
    (["push", "{d}", "--repo-id", "a/b", "--endpoint", "hub.example.com"], "--endpoint"),
    # quickstart
    (["quickstart", "--pretrain-steps", "0"], "--pretrain-steps"),
    (["quickstart", "--finetune-steps", "-1"], "--finetune-steps"),
    (["quickstart", "--pretrain-steps", "many"], "--pretrain-steps"),
]


@pytest.fixture
def library_never_runs(monkeypatch):
    import importlib

    def refuse(*args, **kwargs):
        raise AssertionError("the library ran: the CLI should have refused the usage")

    for module, name in ENTRY_POINTS:
        monkeypatch.setattr(importlib.import_module(module), name, refuse)


@pytest.mark.parametrize("argv, names", CASES, ids=[" ".join(argv) for argv, _ in CASES])
def test_bad_usage_exits_2_before_the_library_runs(tmp_path, monkeypatch, library_never_runs, argv, names):
    folder, file, missing = tmp_path / "folder", tmp_path / "file.txt", tmp_path / "missing"
    folder.mkdir()
    file.write_text("some text\n")
    monkeypatch.chdir(tmp_path)

    def fill(text):
        return text.format(d=folder, f=file, m=missing)

    result = CliRunner().invoke(cli, [fill(a) for a in argv])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.output
    assert fill(names) in errors[0], result.output
    assert "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt", "folder"]  # nothing created
    assert list(folder.iterdir()) == []


@pytest.mark.parametrize("command", sorted(cli.commands))
def test_every_command_is_covered(command):
    assert any(argv[0] == command for argv, _ in CASES)
