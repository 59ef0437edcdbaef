"""Datasets of the offline tasks shipped with nvfp4tool (lm-eval `custom_dataset` functions).

Each reads a file inside the package (nothing is downloaded): `data/mc.jsonl` (multiple choice,
MMLU-Pro's schema: question_id, question, options, answer, answer_index, cot_content, category,
src), `data/gsm.jsonl` (generative, GSM8K's schema: question, answer ending in `#### N`), and the
held-out Shakespeare text `nvfp4tool/data/shakespeare_val.txt` in pages of `PAGE_LINES` lines
(rolling loglikelihood). `lettered` / `letters` ask the multiple-choice items as MMLU does (options
listed A, B, ...; the answer a letter). The items were written for the tests: they exercise the code paths, they
do not measure a model's knowledge.
"""

from __future__ import annotations

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
PAGE_LINES = 40  # lines of Shakespeare per rolling-loglikelihood document
PAGES = 8


def _jsonl(name: str) -> list[dict]:
    with open(os.path.join(HERE, "data", name), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _split(rows: list[dict]):
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def mc(**kwargs):
    """The multiple-choice items (MMLU-Pro schema)."""
    return _split(_jsonl("mc.jsonl"))


def gsm(**kwargs):
    """The generative items (GSM8K schema)."""
    return _split(_jsonl("gsm.jsonl"))


def text(**kwargs):
    """Pages of held-out Shakespeare (`page`), for perplexity."""
    path = os.path.join(os.path.dirname(HERE), "..", "data", "shakespeare_val.txt")
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    pages = ["\n".join(lines[i * PAGE_LINES : (i + 1) * PAGE_LINES]) for i in range(PAGES)]
    return _split([{"page": p} for p in pages if p.strip()])


LETTERS = "ABCDEFGHIJ"  # MMLU-Pro's up to ten options


def lettered(doc: dict) -> str:
    """The question with its options listed by letter, ending at "Answer:"."""
    options = "\n".join(f"{LETTERS[i]}. {option}" for i, option in enumerate(doc["options"]))
    return f"Question: {doc['question']}\n{options}\nAnswer:"


def letters(doc: dict) -> list[str]:
    """The answer letters of an item's options."""
    return list(LETTERS[: len(doc["options"])])
