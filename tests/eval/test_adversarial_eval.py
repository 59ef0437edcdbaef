"""Adversarial cases of `nvfp4tool eval` (issue 24) and of `push` with eval reports: each bad input is
refused with one `Error:` line naming it, exit 1 (bad data) or 2 (bad usage), before any model runs
or anything is staged, and nothing is written."""

import json
import os

import pytest

from fixtures.adversarial_harness import BINARY, Case, World, edit_json, registrar, run_case

CASES: list[Case] = []
case = registrar(CASES)

GOOD_TASK = """task: my_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_choice: "{{{{options}}}}"
doc_to_target: answer_index
"""


def _pair(w: World) -> str:
    """The export with its source next to it (where its provenance record finds it)."""
    w.copy("hf")
    return w.copy("nvfp4")


def _eval(w: World, *extra: str, export: str | None = None) -> list[str]:
    return ["eval", export or _pair(w), "--tasks", "nvfp4tool_mc", *extra]


def _task_file(w: World, drop: str | None = None, **change) -> str:
    data = w.file("data/mc.jsonl", json.dumps({"question": "1+1?", "options": ["2", "3"], "answer_index": 0}) + "\n")
    text = GOOD_TASK.format(data=data)
    lines = [line for line in text.splitlines() if drop is None or not line.startswith(f"{drop}:")]
    lines = [
        f"{line.split(':')[0]}: {change[line.split(':')[0]]}" if line.split(":")[0] in change else line
        for line in lines
    ]
    return w.file("tasks/my_mc.yaml", "\n".join(lines) + "\n")


# ---------------------------------------------------------------- the refusals


@case("eval/task-file-missing-doc_to_target", 1)
def _(w):
    path = _task_file(w, drop="doc_to_target")
    return ["eval", _pair(w), "--tasks", path], ("my_mc.yaml", "doc_to_target")


@case("eval/tokenizer-differs-from-source", 1)
def _(w):
    export = _pair(w)
    with open(os.path.join(w.copy("other"), "tokenizer.json"), "rb") as f:
        other = f.read()
    w.file("nvfp4/tokenizer.json", other)
    return _eval(w, export=export), ("tokenizer.json", "tokenizer differs")


@case("eval/reference-of-another-model", 1)
def _(w):
    return _eval(w, "--reference", w.copy("other_fp8")), ("other_fp8", "differs from the export's")


@case("eval/limit-zero", 2)
def _(w):
    return _eval(w, "--limit", "0"), ("--limit",)


@case("eval/unknown-task-name", 2)
def _(w):
    return ["eval", _pair(w), "--tasks", "nvfp4tool_mc,no_such_task_24"], ("no_such_task_24", "unknown task")


# ---------------------------------------------------------------- more of the same features


@case("eval/task-file-missing-doc_to_choice", 1)
def _(w):
    path = _task_file(w, drop="doc_to_choice")
    return ["eval", _pair(w), "--tasks", path], ("my_mc.yaml", "doc_to_choice")


@case("eval/task-file-bad-output-type", 1)
def _(w):
    path = _task_file(w, output_type="multiple_guess")
    return ["eval", _pair(w), "--tasks", path], ("my_mc.yaml", "multiple_guess")


@case("eval/task-file-not-yaml", 1)
def _(w):
    path = w.file("tasks/broken.yaml", BINARY)
    return ["eval", _pair(w), "--tasks", path], ("broken.yaml", "not a valid task YAML")


@case("eval/task-file-data-missing", 1)
def _(w):
    path = _task_file(w)
    os.remove(w.path("data/mc.jsonl"))
    return ["eval", _pair(w), "--tasks", path], ("my_mc", "cannot be built")


@case("eval/task-folder-without-yaml", 1)
def _(w):
    folder = w.folder("no_tasks")
    w.file("no_tasks/README.txt", "nothing here")
    return ["eval", _pair(w), "--tasks", folder], ("no_tasks", "no task YAML")


@case("eval/no-task-given", 2)
def _(w):
    return ["eval", _pair(w), "--tasks", " , "], ("--tasks",)


@case("eval/reference-not-fp8", 1)
def _(w):
    return _eval(w, "--reference", w.copy("nvfp4", "nvfp4_again")), ("nvfp4_again", "not an FP8 one")


@case("eval/reference-tokenizer-differs", 1)
def _(w):
    reference = w.copy("fp8")
    with open(os.path.join(w.copy("other"), "tokenizer.json"), "rb") as f:
        w.file("fp8/tokenizer.json", f.read())
    return _eval(w, "--reference", reference), ("fp8", "tokenizer differs")


@case("eval/source-of-another-model", 1)
def _(w):
    return _eval(w, "--source", w.copy("other")), ("other", "not the source the export was made from")


@case("eval/export-is-a-bf16-folder", 1)
def _(w):
    return _eval(w, export=w.copy("hf")), ("hf", "not an export")


@case("eval/export-fails-check", 1)
def _(w):
    export = _pair(w)
    edit_json(os.path.join(export, "config.json"), lambda c: c.update(hidden_size=96))
    return _eval(w, export=export), ("nvfp4",)


@case("eval/report-exists-without-force", 1)
def _(w):
    export = _pair(w)
    w.file("nvfp4/eval.json", "{}")
    return _eval(w, export=export), ("eval.json", "--force")


@case("eval/json-copy-inside-export", 2)
def _(w):
    export = _pair(w)
    return _eval(w, "--json", os.path.join(export, "copy.json"), export=export), ("--json", "inside the export")


@case("eval/max-drop-above-one", 2)
def _(w):
    return _eval(w, "--max-drop", "2"), ("--max-drop",)


@case("eval/max-drop-nan", 2)
def _(w):
    return _eval(w, "--max-drop", "nan"), ("--max-drop",)


@case("eval/generation-leaves-no-context", 2)
def _(w):
    return (["eval", _pair(w), "--tasks", "nvfp4tool_gsm", "--max-length", "24"], ("--max-length 24", "nvfp4tool_gsm"))


@case("eval/samples-without-sampling", 2)
def _(w):
    return (
        ["eval", _pair(w), "--tasks", "nvfp4tool_gsm", "--samples", "4"],
        ("--samples 4", "no task samples", "--gen-kwargs"),
    )


@case("eval/gen-kwargs-without-a-generative-task", 2)
def _(w):
    return _eval(w, "--gen-kwargs", "do_sample=true,temperature=0.7"), ("--gen-kwargs", "generates text")


@case("eval/gen-kwargs-not-key-value", 2)
def _(w):
    return (
        ["eval", _pair(w), "--tasks", "nvfp4tool_gsm", "--gen-kwargs", "temperature"],
        ("--gen-kwargs", "KEY=VALUE"),
    )


@case("eval/gen-kwargs-unsupported-top-p", 2)
def _(w):
    return (
        ["eval", _pair(w), "--tasks", "nvfp4tool_gsm", "--gen-kwargs", "do_sample=true,temperature=1,top_p=0.9"],
        ("top_p=0.9", "not supported"),
    )


@case("eval/gen-kwargs-boolean-no", 2)
def _(w):
    sampled = ["--gen-kwargs", "do_sample=no,temperature=0.7", "--samples", "2"]
    return ["eval", _pair(w), "--tasks", "nvfp4tool_gsm", *sampled], ("--gen-kwargs do_sample=no", "not a boolean")


@case("eval/gen-kwargs-temperature-not-a-number", 2)
def _(w):
    return (
        ["eval", _pair(w), "--tasks", "nvfp4tool_gsm", "--gen-kwargs", "do_sample=true,temperature=warm"],
        ("--gen-kwargs temperature=warm", "not a number"),
    )


@case("eval/gen-kwargs-negative-temperature", 2)
def _(w):
    return (
        ["eval", _pair(w), "--tasks", "nvfp4tool_gsm", "--gen-kwargs", "do_sample=true,temperature=-1"],
        ("--gen-kwargs temperature=-1", "must be >= 0"),
    )


@case("eval/max-drop-fp8-without-reference", 2)
def _(w):
    return _eval(w, "--max-drop-fp8", "0.01"), ("--max-drop-fp8", "--reference")


@case("eval/samples-zero", 2)
def _(w):
    return (["eval", _pair(w), "--tasks", "nvfp4tool_gsm", "--samples", "0"], ("--samples",))


# ---------------------------------------------------------------- task items (issue 39: one validator)

GOOD_ITEM = {"question": "1+1?", "options": ["2", "3"], "answer_index": 0}


def _items_task(w: World, *items: dict, raw: str | None = None, **change) -> str:
    """my_mc.yaml over a data file of `items` (JSON lines) or of the text `raw`."""
    text = raw if raw is not None else "".join(json.dumps(item) + "\n" for item in items)
    data = w.file("data/mc.jsonl", text)
    lines = [
        f"{line.split(':')[0]}: {change[line.split(':')[0]]}" if line.split(":")[0] in change else line
        for line in GOOD_TASK.format(data=data).splitlines()
    ]
    return w.file("tasks/my_mc.yaml", "\n".join(lines) + "\n")


@case("eval/item-answer-index-minus-one", 1)
def _(w):
    path = _items_task(w, GOOD_ITEM, {**GOOD_ITEM, "answer_index": -1})
    return ["eval", _pair(w), "--tasks", path], ("task my_mc", "item 1", "answer_index", "-1", "outside")


@case("eval/item-answer-index-past-the-options", 1)
def _(w):
    path = _items_task(w, GOOD_ITEM, GOOD_ITEM, {**GOOD_ITEM, "answer_index": 2})
    return ["eval", _pair(w), "--tasks", path], ("task my_mc", "item 2", "answer_index", "outside")


@case("eval/item-empty-options", 1)
def _(w):
    path = _items_task(w, GOOD_ITEM, {**GOOD_ITEM, "options": []})
    return ["eval", _pair(w), "--tasks", path], ("task my_mc", "item 1", "options", "empty list")


@case("eval/item-answer-index-boolean", 1)
def _(w):
    path = _items_task(w, GOOD_ITEM, {**GOOD_ITEM, "answer_index": True})
    return ["eval", _pair(w), "--tasks", path], ("task my_mc", "item 1", "answer_index", "a boolean")


@case("eval/item-answer-index-not-an-integer", 1)
def _(w):
    path = _items_task(w, {**GOOD_ITEM, "answer_index": 0.5})
    return ["eval", _pair(w), "--tasks", path], ("task my_mc", "item 0", "answer_index", "a number")


@case("eval/item-answer-index-missing", 1)
def _(w):
    path = _items_task(w, GOOD_ITEM, {"question": "2+2?", "options": ["4", "5"]})
    return ["eval", _pair(w), "--tasks", path], ("task my_mc", "item 1", "no `answer_index` field")


@case("eval/item-options-missing", 1)
def _(w):
    path = _items_task(w, GOOD_ITEM, {"question": "2+2?", "answer_index": 0})
    return ["eval", _pair(w), "--tasks", path], ("task my_mc", "item 1", "no `options` field")


@case("eval/task-data-file-empty", 1)
def _(w):
    path = _items_task(w, raw="")
    return ["eval", _pair(w), "--tasks", path], ("data/mc.jsonl", "empty", "my_mc")


@case("eval/task-data-file-blank-lines", 1)
def _(w):
    path = _items_task(w, raw="\n  \n")
    return ["eval", _pair(w), "--tasks", path], ("data/mc.jsonl", "empty", "my_mc")


@case("eval/task-data-file-not-json", 1)
def _(w):
    path = _items_task(w, raw=json.dumps(GOOD_ITEM) + "\nquestion: 2+2?\n")
    return ["eval", _pair(w), "--tasks", path], ("data/mc.jsonl:2", "not valid JSON", "my_mc")


@case("eval/task-data-file-binary", 1)
def _(w):
    path = _items_task(w, raw="")
    w.file("data/mc.jsonl", BINARY)
    return ["eval", _pair(w), "--tasks", path], ("data/mc.jsonl", "my_mc")


@case("eval/task-name-a-list", 1)
def _(w):
    path = _items_task(w, GOOD_ITEM, task="[a, b]")
    return ["eval", _pair(w), "--tasks", path], ("my_mc.yaml", "`task`", "a list")


@case("eval/task-name-a-number", 1)
def _(w):
    path = _items_task(w, GOOD_ITEM, task="7")
    return ["eval", _pair(w), "--tasks", path], ("my_mc.yaml", "`task`", "a number")


@case("eval/num-fewshot-beyond-the-pool", 2)
def _(w):
    path = _items_task(w, GOOD_ITEM, {**GOOD_ITEM, "question": "1+2?"})
    return ["eval", _pair(w), "--tasks", path, "--num-fewshot", "3"], ("--num-fewshot 3", "my_mc", "2 few-shot")


@case("eval/num-fewshot-beyond-a-shipped-pool", 2)
def _(w):
    return _eval(w, "--num-fewshot", "500"), ("--num-fewshot 500", "nvfp4tool_mc", "40 few-shot")


# ---------------------------------------------------------------- push and the eval reports


def _evaluated(w: World) -> str:
    from fixtures.eval_fixtures import write_eval_reports

    export = w.copy("nvfp4", "evaluated")
    write_eval_reports(export)
    return export


def _dry(export: str) -> list[str]:
    return ["push", export, "--repo-id", "org/m", "--dry-run", "--no-validation"]


@case("push/eval-json-of-other-bytes", 1)
def _(w):
    export = _evaluated(w)
    edit_json(os.path.join(export, "tokenizer_config.json"), lambda c: c.update(model_max_length=99))
    return _dry(export), ("eval.json", "measured other bytes", "tokenizer_config.json")


@case("push/eval-md-edited", 1)
def _(w):
    export = _evaluated(w)
    with open(os.path.join(export, "eval.md"), "a") as f:
        f.write("| made_up | acc | 6 | 99 |\n")
    return _dry(export), ("eval.md", "differs from what eval.json says")


@case("push/eval-md-without-eval-json", 1)
def _(w):
    export = _evaluated(w)
    os.remove(os.path.join(export, "eval.json"))
    return _dry(export), ("eval", "without eval.json")


@case("push/eval-json-not-a-record", 1)
def _(w):
    export = _evaluated(w)
    edit_json(os.path.join(export, "eval.json"), lambda r: r.pop("tasks"))
    return _dry(export), ("eval.json", "tasks")


@pytest.fixture
def pristine(eval_models):
    return eval_models


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
@pytest.mark.slow  # > 15 s of the inner loop (tests/durations.json)
def test_bad_input_is_one_line_and_changes_nothing(case, pristine, tmp_path, monkeypatch, hub_env):
    run_case(case, pristine, tmp_path, monkeypatch)


@pytest.mark.slow  # builds the eval models (tests/fixtures/eval_fixtures.py) when first in its process
def test_quiet_eval_prints_only_its_error_line(pristine, tmp_path, monkeypatch, hub_env):
    """Under -q nothing but the result or the error prints: HF datasets' progress bars ("Generating
    test split") included, which eval's task building used to let through."""
    import datasets
    from click.testing import CliRunner

    from nvfp4tool.cli import cli

    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.chdir(tmp_path)
    datasets.enable_progress_bars()  # as a fresh process has them
    world = World(str(tmp_path / "w"), pristine)
    path = _items_task(world, GOOD_ITEM, {**GOOD_ITEM, "question": "1+2?"})
    result = CliRunner().invoke(cli, ["-q", "eval", _pair(world), "--tasks", path, "--num-fewshot", "5"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines[-1].startswith("Error: --num-fewshot 5:") and "Generating" not in result.output, result.output
    assert lines[:-1] == ["Usage: cli [OPTIONS] COMMAND [ARGS]...", "Try 'cli --help' for help."], result.output
    assert datasets.is_progress_bar_enabled()  # restored after the build
