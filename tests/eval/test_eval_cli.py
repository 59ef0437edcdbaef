"""`nvfp4tool eval` end to end on the tiny model: BF16, FP8 and NVFP4 as served on the shipped tasks,
the records it writes (eval.json typed and consistent with the per-item side file, eval.md, the
PNG, the --json copy) and the --max-drop verdict."""

import json
import os
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from nvfp4tool.cli import cli

LIMIT = 4


@pytest.mark.slow
def test_eval_three_models_paired_records(eval_models, tmp_path):
    from nvfp4tool.eval.paired import paired
    from nvfp4tool.records.evaluation import PAIRED_KEYS, EvalItems, EvalRecord

    shutil.copytree(eval_models["hf"], tmp_path / "hf")
    export = str(shutil.copytree(eval_models["nvfp4"], tmp_path / "nvfp4"))
    copy = str(tmp_path / "e.json")
    result = CliRunner().invoke(
        cli,
        [
            "eval",
            export,
            "--tasks",
            "nvfp4tool_mc,nvfp4tool_gsm",
            "--reference",
            eval_models["fp8"],
            "--limit",
            str(LIMIT),
            "--batch-size",
            "4",
            "--max-length",
            "64",
            "--max-drop-fp8",
            "0.5",
            "--json",
            copy,
        ],
    )
    assert result.exit_code == 0, result.output
    assert "NVFP4 - BF16" in result.output and "McNemar p" in result.output
    assert "it/s]" not in result.output and "Tokenizing inputs" not in result.output  # lm-eval's tqdm bars off
    record = EvalRecord.read(export)
    assert record.labels == ["bf16", "fp8", "nvfp4"] and record.limit == LIMIT
    assert record.max_drop is None and record.max_drop_fp8 == 0.5
    lows = [e["paired"]["nvfp4-fp8"]["ci95"][0] for e in (*record.tasks.values(), record.overall)]
    assert record.passed == all(low >= -0.5 for low in lows) == (not record.failures)
    task = record.tasks["nvfp4tool_mc"]
    assert task["metric"] == "acc"
    assert {k: task[k]["n"] for k in record.labels} == {"bf16": LIMIT, "fp8": LIMIT, "nvfp4": LIMIT}
    assert set(task["paired"]) == {"nvfp4-bf16", "nvfp4-fp8"}
    items = EvalItems.read(export).tasks["nvfp4tool_mc"]
    assert items["doc_id"] == list(range(LIMIT)) and len(set(items["prompt_hash"])) == LIMIT
    for label in record.labels:
        assert task[label]["acc"] == pytest.approx(np.mean(items[label]))
    for pair, stats in task["paired"].items():
        assert set(PAIRED_KEYS) <= set(stats)
        again = paired(np.array(items["nvfp4"]), np.array(items[pair.split("-")[1]]))
        assert stats["diff"] == pytest.approx(again.diff)
        assert (stats["right_to_wrong"], stats["wrong_to_right"]) == (again.right_to_wrong, again.wrong_to_right)
    gsm = record.tasks["nvfp4tool_gsm"]
    assert gsm["metric"] == "exact_match" and set(gsm["paired"]) == {"nvfp4-bf16", "nvfp4-fp8"}
    for label in record.labels:
        signs = gsm[label]
        assert 0 < signs["mean_output_tokens"] <= 24 and 0 <= signs["hit_max_gen_toks"] <= 1
        assert 0 <= signs["repeated_4gram_rate"] < 1
    assert record.overall["bf16"]["n"] == 2 * LIMIT and "nvfp4-bf16" in record.overall["paired"]
    assert record.resources["models"] == {"bf16": "held", "fp8": "held", "nvfp4": "held"}
    assert record.resources["seconds"] > 0 and record.resources["peak_rss_bytes"] > 0
    assert record.source.name == "hf" and record.reference.name == "fp8"
    with open(copy) as f:
        assert json.load(f) == record.to_json()
    with open(os.path.join(export, "eval.md")) as f:
        md = f.read()
    assert "## Task accuracy" in md and "| nvfp4tool_mc | acc | 4 |" in md and "| nvfp4tool_gsm |" in md
    assert "| overall | pooled | 8 |" in md and "Generation (degeneration signs)" in md
    with open(os.path.join(export, "eval.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_max_drop_judges_the_interval_lower_end():
    from nvfp4tool.eval.evaluate import EvalOptions, _drop_failures

    stats = {"diff": -0.004, "ci95": [-0.012, 0.004]}
    both = {"nvfp4-bf16": stats, "nvfp4-fp8": {"diff": -0.03, "ci95": [-0.05, -0.01]}}
    judged = lambda **kw: _drop_failures("t", both, EvalOptions(tasks=("t",), **kw))  # noqa: E731
    assert judged() == []
    assert judged(max_drop=0.02) == []
    (failure,) = judged(max_drop=0.01)
    assert "nvfp4 - bf16" in failure and "-0.0120" in failure and "(--max-drop)" in failure
    (failure,) = judged(max_drop=0.02, max_drop_fp8=0.04)
    assert "nvfp4 - fp8" in failure and "-0.0500" in failure and "--max-drop-fp8" in failure
    assert judged(max_drop_fp8=0.06) == []
    assert _drop_failures(
        "t",
        {"nvfp4-bf16": {"diff": -0.5, "ci95": None}},  # n = 1: the difference itself
        EvalOptions(tasks=("t",), max_drop=0.1),
    )


def test_record_refuses_a_task_without_paired_fields(tmp_path):
    from nvfp4tool.records.base import RecordError, write_json
    from nvfp4tool.records.evaluation import EvalRecord

    named = {"name": "x", "sha256": {}}
    obj = {
        "export": named,
        "quant": "nvfp4",
        "source": named,
        "reference": None,
        "labels": ["bf16", "nvfp4"],
        "tasks": {
            "t": {
                "metric": "acc",
                "bf16": {"acc": 1.0, "n": 1},
                "nvfp4": {"acc": 1.0, "n": 1},
                "paired": {"nvfp4-bf16": {"diff": 0.0}},
            }
        },
        "overall": {},
        "limit": None,
        "seed": 0,
        "max_drop": None,
        "failures": [],
        "passed": True,
        "lm_eval_version": "0.4.13",
        "resources": {},
    }
    write_json(str(tmp_path / "eval.json"), obj)
    with pytest.raises(RecordError, match="paired.nvfp4-bf16: missing se"):
        EvalRecord.read(str(tmp_path))


def test_push_card_shows_the_eval_table(eval_models, tmp_path):
    from fixtures.eval_fixtures import write_eval_reports

    export = str(shutil.copytree(eval_models["nvfp4"], tmp_path / "nvfp4"))
    write_eval_reports(export)
    result = CliRunner().invoke(cli, ["push", export, "--repo-id", "org/m", "--dry-run", "--no-validation"])
    assert result.exit_code == 0, result.output
    card = result.output.split("model card (README.md):", 1)[1]
    with open(os.path.join(export, "eval.md")) as f:
        table = f.read().strip()
    assert table in card and "| nvfp4tool_mc | acc | 6 |" in card
    assert "eval.json" in result.output and "eval_items.json" in result.output  # published with the export


def test_a_user_task_file_with_local_data_resolves_and_builds(tmp_path):
    """--tasks takes a YAML file reading a local JSONL (dataset_path: json + data_files): no network."""
    from nvfp4tool.eval.evaluate import _build_tasks, resolve_tasks

    data = tmp_path / "mc.jsonl"
    data.write_text(
        "\n".join(
            json.dumps({"question": f"{i}+1?", "options": [str(i + 1), str(i)], "answer_index": 0}) for i in range(3)
        )
        + "\n"
    )
    task = tmp_path / "tasks" / "mine.yaml"
    task.parent.mkdir()
    task.write_text(
        f"task: my_local_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        'test_split: test\noutput_type: multiple_choice\ndoc_to_text: "Q: {{question}}\\nA:"\n'
        'doc_to_choice: "{{options}}"\ndoc_to_target: answer_index\n'
    )
    names, manager = resolve_tasks((str(task), "nvfp4tool_mc"))
    assert names == ["my_local_mc", "nvfp4tool_mc"]
    built = _build_tasks(names, manager)
    assert len(list(built["my_local_mc"].eval_docs)) == 3 and len(list(built["nvfp4tool_mc"].eval_docs)) == 40
    assert resolve_tasks((str(task.parent),))[0] == ["my_local_mc"]


def test_a_task_file_takes_its_fields_from_its_include(tmp_path):
    from nvfp4tool.errors import NVFP4ToolError
    from nvfp4tool.eval.evaluate import _task_file

    (tmp_path / "_template.yaml").write_text(
        "dataset_path: json\noutput_type: multiple_choice\ndoc_to_text: q\ndoc_to_choice: c\ndoc_to_target: 0\n"
    )
    (tmp_path / "mine.yaml").write_text("include: _template.yaml\ntask: mine\ndoc_to_text: mine\n")
    config = _task_file(str(tmp_path / "mine.yaml"))
    assert config["task"] == "mine" and config["doc_to_text"] == "mine" and config["output_type"] == "multiple_choice"
    (tmp_path / "bad.yaml").write_text("include: _missing.yaml\ntask: bad\n")
    with pytest.raises(NVFP4ToolError, match="_missing.yaml: cannot read"):
        _task_file(str(tmp_path / "bad.yaml"))


def test_lm_eval_mmlu_pro_and_gsm8k_cot_run_offline_from_local_parquet(tmp_path):
    """docs/commands/eval.md's offline MMLU-Pro / GSM8K-CoT files: lm-eval's own task files included, the data
    from local parquet (stand-ins in each schema here); both resolve and build without a network."""
    import os

    import lm_eval
    import pandas as pd

    from nvfp4tool.eval.evaluate import _build_tasks, resolve_tasks

    tasks = os.path.join(os.path.dirname(lm_eval.__file__), "tasks")
    mmlu = [
        {
            "question_id": i,
            "question": f"What is {i} + 1?",
            "options": [str(i + 1), str(i), str(i + 2)],
            "answer": "A",
            "answer_index": 0,
            "cot_content": "A: The answer is (A).",
            "category": "math",
            "src": "stand-in",
        }
        for i in range(7)
    ]
    gsm = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(3)]
    for name, rows in (("test", mmlu), ("validation", mmlu), ("gsm_test", gsm), ("gsm_train", gsm)):
        pd.DataFrame(rows).to_parquet(tmp_path / f"{name}.parquet")
    (tmp_path / "mmlu_pro_math_local.yaml").write_text(
        f"include: {tasks}/mmlu_pro/mmlu_pro_math.yaml\ntask: mmlu_pro_math_local\ndataset_path: parquet\n"
        f"dataset_kwargs:\n  data_files:\n    test: {tmp_path}/test.parquet\n"
        f"    validation: {tmp_path}/validation.parquet\n"
    )
    (tmp_path / "gsm8k_cot_local.yaml").write_text(
        f"include: {tasks}/gsm8k/gsm8k-cot.yaml\ntask: gsm8k_cot_local\ndataset_path: parquet\ndataset_name: null\n"
        f"dataset_kwargs:\n  data_files:\n    test: {tmp_path}/gsm_test.parquet\n"
        f"    train: {tmp_path}/gsm_train.parquet\n"
    )
    names, manager = resolve_tasks((str(tmp_path / "mmlu_pro_math_local.yaml"), str(tmp_path / "gsm8k_cot_local.yaml")))
    built = _build_tasks(names, manager)
    assert {n: len(list(t.eval_docs)) for n, t in built.items()} == {"mmlu_pro_math_local": 7, "gsm8k_cot_local": 3}
    assert {t.config.output_type for t in built.values()} == {"generate_until"}
    assert built["mmlu_pro_math_local"].config.num_fewshot == 5  # lm-eval's own settings, kept
