"""Write the shipped chat set `nvfp4tool/data/chat_shakespeare.jsonl` from the shipped Shakespeare
corpus (`nvfp4tool/data/shakespeare_train.txt`), deterministically: the same file on every run.

Each line is one conversation ({"messages": [...]}, format=chat): questions about the speeches of
the two plays in the corpus, answered by quoting or continuing them (who speaks a line, how a
speech goes on, who answers whom, who speaks next), some with a system message, some with a
second turn. The quoted text is the corpus's own (nvfp4tool/data/chat_shakespeare.README.txt).

    python scripts/make_chat_set.py            # rewrites nvfp4tool/data/chat_shakespeare.jsonl
    python scripts/make_chat_set.py --check    # exit 1 when the shipped file differs
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "nvfp4tool" / "data" / "shakespeare_train.txt"
OUT = ROOT / "nvfp4tool" / "data" / "chat_shakespeare.jsonl"
CONVERSATIONS = 200
SEED = 43  # the issue that asked for the set
MAX_SPEECH_CHARS = 360  # speeches quoted whole are at most this long (the file stays < 200 KB)
SYSTEM = "You answer questions about Shakespeare's plays by quoting their text exactly."
SPEAKER = re.compile(r"^([A-Z][A-Z' ]+[A-Z])\.$")  # "COUNTESS." opens a speech; "ACT I." does not (below)


def speeches(text: str) -> list[dict]:
    """The speeches of the corpus in order: {play, speaker, lines}, from each play's first act on
    (not its list of persons), stage directions left out."""
    found, play, speaker, lines, previous_blank, acting = [], None, None, [], True, False
    raw = text.splitlines()
    for i, line in enumerate(raw):
        stripped = line.strip()
        if i + 2 < len(raw) and raw[i + 2].strip() == "by William Shakespeare":
            play, acting = _title(stripped), False
        acting = acting or stripped.startswith("ACT ")
        match = SPEAKER.match(stripped)
        if not acting:
            continue
        if previous_blank and match and not stripped.startswith(("ACT ", "SCENE ")):
            _close(found, play, speaker, lines)
            speaker, lines = match.group(1), []
        elif not stripped:
            if lines and speaker:
                _close(found, play, speaker, lines)
                speaker, lines = None, []
        elif speaker and not stripped.startswith("["):
            lines.append(stripped)
        previous_blank = not stripped
    _close(found, play, speaker, lines)
    return found


def _title(name: str) -> str:
    """ "ALL'S WELL THAT ENDS WELL" -> "All's Well That Ends Well", "KING OF FRANCE" -> "King of France"."""
    words = name.lower().split()
    return " ".join(w if (k and w in ("and", "of", "the")) else w[:1].upper() + w[1:] for k, w in enumerate(words))


def _close(found: list[dict], play, speaker, lines) -> None:
    if play and speaker and lines:
        found.append({"play": play, "speaker": _title(speaker), "lines": list(lines)})


def _quoted(lines: list[str], most: int) -> str:
    """The first `most` lines, "[...]" marking the rest left out."""
    return "\n".join(lines[:most]) + ("\n[...]" if len(lines) > most else "")


def conversations(all_speeches: list[dict], count: int, seed: int) -> list[dict]:
    """`count` conversations, each built from one speech (and its neighbours) chosen by `seed`."""
    rng = random.Random(seed)
    usable = [
        i
        for i, s in enumerate(all_speeches)
        if 0 < i < len(all_speeches) - 1 and len("\n".join(s["lines"])) <= MAX_SPEECH_CHARS
    ]
    makers = (_who_speaks, _continue, _answer, _who_speaks_then_continue)
    chosen = sorted(rng.sample(usable, count))
    return [makers[k % len(makers)](all_speeches, i, rng) for k, i in enumerate(chosen)]


def _who_speaks(all_speeches, i, rng) -> dict:
    s = all_speeches[i]
    line = rng.choice([x for x in s["lines"] if len(x.split()) >= 5] or s["lines"][:1])
    return _chat(
        rng,
        [
            ("user", f'In {s["play"]}, who says "{line}"?'),
            ("assistant", f"{s['speaker']} says it, in this speech:\n" + "\n".join(s["lines"])),
        ],
    )


def _continue(all_speeches, i, rng) -> dict:
    s = all_speeches[i]
    if len(s["lines"]) < 2:
        return _answer(all_speeches, i, rng)
    return _chat(
        rng,
        [
            ("user", f"Continue this speech of {s['speaker']} in {s['play']}:\n{s['lines'][0]}"),
            ("assistant", "\n".join(s["lines"][1:])),
        ],
    )


def _answer(all_speeches, i, rng) -> dict:
    before, s = all_speeches[i - 1], all_speeches[i]
    return _chat(
        rng,
        [
            (
                "user",
                f"In {s['play']}, {before['speaker']} says:\n"
                + _quoted(before["lines"], 3)
                + "\nWho answers, and how?",
            ),
            ("assistant", f"{s['speaker']} answers:\n" + "\n".join(s["lines"])),
        ],
    )


def _who_speaks_then_continue(all_speeches, i, rng) -> dict:
    s = all_speeches[i]
    after = all_speeches[i + 1]
    return _chat(
        rng,
        [
            ("user", f'Who speaks the line "{s["lines"][0]}" in {s["play"]}?'),
            ("assistant", f"{s['speaker']}."),
            ("user", "And what is said next?"),
            ("assistant", f"{after['speaker']} speaks next:\n" + _quoted(after["lines"], 4)),
        ],
    )


def _chat(rng, turns) -> dict:
    messages = [{"role": role, "content": content} for role, content in turns]
    if rng.random() < 0.3:
        messages.insert(0, {"role": "system", "content": SYSTEM})
    return {"messages": messages}


def render() -> str:
    text = SOURCE.read_text(encoding="utf-8")
    rows = conversations(speeches(text), CONVERSATIONS, SEED)
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the shipped file instead of writing it")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        same = OUT.is_file() and OUT.read_text(encoding="utf-8") == text
        print(f"{OUT}: {'up to date' if same else 'differs from what this script writes'}")
        return 0 if same else 1
    OUT.write_text(text, encoding="utf-8")
    print(f"{OUT}: {CONVERSATIONS} conversations, {len(text.encode()):,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
