"""The task-accuracy result `eval.json` and its per-item side file `eval_items.json` (written by
`nvfp4tool eval` into the export; users and scripts parse them).

    record = EvalRecord.read(export_dir)
    record.tasks["nvfp4tool_mc"]["nvfp4"]["acc"], record.tasks[t]["paired"]["nvfp4-bf16"]["ci95"]

`EVAL_FILES` names every file eval writes into the export.
Design notes: docs/design/records.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from nvfp4tool.records.base import Record, RecordError
from nvfp4tool.records.validation import Named

EVAL_MD = "eval.md"  # the model-card table (`eval.report.markdown`)
EVAL_PNG = "eval.png"  # the paired differences per task with their 95% intervals

PAIRED_KEYS = (
    "diff",
    "se",
    "ci95",
    "unpaired_se",
    "mcnemar_p",
    "right_to_wrong",
    "wrong_to_right",
    "flip_rate",
    "min_detectable",
)


@dataclasses.dataclass(frozen=True)
class EvalRecord(Record):
    """`eval.json`: lm-eval task accuracy of the export as served, its BF16 source and an FP8 reference."""

    FILE_NAME: ClassVar[str] = "eval.json"

    export: Named
    quant: str
    source: Named
    reference: Named | None  # the FP8 reference export (None: no FP8 column)
    labels: list[str]  # the models evaluated, in order ("bf16", ["fp8"], "nvfp4")
    tasks: dict[str, dict[str, Any]]
    overall: dict[str, Any]
    limit: int | None  # items per task (the first `limit` doc_ids of each task's test split)
    seed: int
    max_drop: float | None  # the threshold: most accepted drop of nvfp4-bf16's 95% interval's lower end
    failures: list[str]
    passed: bool
    lm_eval_version: str
    resources: dict[str, Any]  # seconds, peak_rss_bytes, models {label: held|streamed}, items_per_s
    chat_template: bool = False  # prompts went through the tokenizer's chat template
    gen_kwargs: dict[str, Any] | None = None  # generation settings given over the tasks' own (--gen-kwargs)
    max_drop_fp8: float | None = None  # the same threshold for nvfp4-fp8
    samples: int = 1  # generations per item of a sampled task, its per-item scores their mean
    sampled_tasks: list[str] = dataclasses.field(default_factory=list)  # the tasks `samples` applied to
    # how the reports name the export's column (`formats.quant_title`: "NVFP4 W4A16", "Mixed
    # (NVFP4/FP8/BF16)"); None: a record written before it (named by `quant` alone)
    quant_title: str | None = None

    @classmethod
    def _from_json_fields(cls, obj: dict[str, Any], label: str) -> dict[str, Any]:
        fields = super()._from_json_fields(obj, label)
        for task, entry in fields["tasks"].items():
            for model in fields["labels"]:
                if not isinstance(entry.get(model), dict) or "n" not in entry[model]:
                    raise RecordError(f"{label}: tasks.{task}.{model}: missing (or without n)")
            paired = entry.get("paired")
            if not isinstance(paired, dict):
                raise RecordError(f"{label}: tasks.{task}.paired: missing")
            for pair, stats in paired.items():
                missing = [k for k in PAIRED_KEYS if not isinstance(stats, dict) or k not in stats]
                if missing:
                    raise RecordError(f"{label}: tasks.{task}.paired.{pair}: missing {', '.join(missing)}")
        return fields


@dataclasses.dataclass(frozen=True)
class EvalItems(Record):
    """`eval_items.json`: per task, the paired items (doc_id, prompt hash) and each model's score."""

    FILE_NAME: ClassVar[str] = "eval_items.json"

    tasks: dict[str, dict[str, list]]  # {task: {"doc_id": [...], "prompt_hash": [...], label: [score...]}}


# every file eval writes into the export, named here (below validate and hub) because validation's
# hashes and push's checks leave them out
EVAL_FILES = (EvalRecord.FILE_NAME, EVAL_MD, EVAL_PNG, EvalItems.FILE_NAME)
