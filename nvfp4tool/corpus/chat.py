"""Chat and prompt/completion rows for supervised fine-tuning: token ids and which tokens carry loss.

`format=chat` rows hold `messages` (role / content: `system` first only, `user`, `assistant`);
`format=prompt_completion` rows hold `prompt` and `completion` (TRL's schema: two strings, or two
lists of messages). Messages are rendered with the tokenizer's own chat template through
transformers. `loss_on` marks the assistant's / the completion's tokens (found through the
template's `{% generation %}` markers, else by rendering the conversation prefix by prefix) or
all. A row longer than `seq_len + 1` tokens is dropped or truncated (`overlong=`) and counted
(`SftCounts`); a bad row is refused in one line naming the row and the field.
Design notes: docs/design/data.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from nvfp4tool import progress
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError
from nvfp4tool.records.corpus import CorpusSft

FORMATS = ("chat", "prompt_completion")
LOSS_ON = {"chat": ("assistant", "all"), "prompt_completion": ("completion", "all")}  # first: the default
LOSS_ON_CHOICES = ("assistant", "completion", "all")
OVERLONG = ("drop", "truncate")
ROLES = ("system", "user", "assistant")
# transformers' own test for a template with generation markers (chat_template_utils.render_jinja_template)
_GENERATION_TAG = re.compile(r"\{\%-?\s*generation\s*-?\%\}")


@dataclasses.dataclass(frozen=True)
class SftSpec:
    """How rows become training examples: the row format, which tokens carry loss, and what
    happens to a row longer than `seq_len + 1` tokens (None: no limit)."""

    format: str
    loss_on: str | None = None  # None: LOSS_ON[format][0]
    overlong: str = "drop"
    seq_len: int | None = None

    def __post_init__(self):
        if self.format not in FORMATS:
            raise NVFP4UsageError(f"format={self.format}: expected one of {', '.join(FORMATS)}")
        if self.loss_on is None:
            object.__setattr__(self, "loss_on", LOSS_ON[self.format][0])
        if self.loss_on not in LOSS_ON[self.format]:
            raise NVFP4UsageError(
                f"loss_on={self.loss_on}: format={self.format} takes {' | '.join(LOSS_ON[self.format])}"
            )
        if self.overlong not in OVERLONG:
            raise NVFP4UsageError(f"overlong={self.overlong}: expected {' | '.join(OVERLONG)}")
        if self.seq_len is not None and self.seq_len < 1:
            raise NVFP4UsageError(f"seq_len={self.seq_len}: expected an integer >= 1")


@dataclasses.dataclass(frozen=True)
class Encoded:
    """One row as tokens: `ids` [n] int32, `loss` [n] bool (token t is a target carrying loss);
    `status` kept | truncated | dropped (a dropped row has no tokens)."""

    ids: np.ndarray
    loss: np.ndarray
    status: str = "kept"


@dataclasses.dataclass
class SftCounts:
    """What encoding did to the rows, for the cache manifest and run.json: never a silent change."""

    rows: int = 0  # rows read
    dropped: int = 0  # longer than seq_len + 1 tokens, left out (overlong=drop)
    truncated: int = 0  # longer than seq_len + 1 tokens, cut to seq_len + 1 (overlong=truncate)
    tokens: int = 0  # tokens of the rows kept
    loss_tokens: int = 0  # of which carry loss

    def merge(self, other: SftCounts) -> None:
        """Add another batch's counts (a worker process's) to these."""
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))

    def record(self, spec: SftSpec, chat_template_sha256: str | None) -> CorpusSft:
        """The counts as the cache manifest and run.json record them."""
        return CorpusSft(
            loss_on=spec.loss_on,
            overlong=spec.overlong,
            seq_len=spec.seq_len,
            chat_template_sha256=chat_template_sha256,
            **dataclasses.asdict(self),
        )

    def add(self, encoded: Encoded) -> None:
        self.rows += 1
        self.dropped += encoded.status == "dropped"
        self.truncated += encoded.status == "truncated"
        self.tokens += len(encoded.ids)
        self.loss_tokens += int(np.count_nonzero(encoded.loss))

    @property
    def loss_share(self) -> float:
        """The share of the kept tokens that carry loss (0 when none were kept)."""
        return self.loss_tokens / self.tokens if self.tokens else 0.0

    def report(self, spec: SftSpec, name: str) -> None:
        """The summary line in the logs, prefixed with `name` (the data): a warning, shown even
        with --quiet, when rows were dropped or truncated."""
        line = f"{name}: {self.summary(spec)}"
        (progress.warn if self.dropped or self.truncated else progress.info)(line)

    def summary(self, spec: SftSpec) -> str:
        """One line: rows, what overlong rows became, the share of tokens carrying loss."""
        line = f"{spec.format}: {self.rows:,} rows, {self.tokens:,} tokens, {self.loss_share:.1%} carry loss"
        line += f" (loss_on={spec.loss_on})"
        if spec.seq_len is not None:
            changed = self.dropped if spec.overlong == "drop" else self.truncated
            verb = "dropped" if spec.overlong == "drop" else "truncated"
            line += (
                f"; {changed:,} longer than seq_len + 1 = {spec.seq_len + 1} tokens {verb} (overlong={spec.overlong})"
            )
        return line


def sft_options(
    format: str, loss_on: str | None, overlong: str | None, seq_len: int | None = None, label: str = ""
) -> SftSpec | None:
    """The spec of a fine-tuning format; None for another format, which takes none of the options
    (a usage error, prefixed with `label`, when one is given)."""
    if format not in FORMATS:
        given = [f"{k}={v}" for k, v in (("loss_on", loss_on), ("overlong", overlong), ("seq_len", seq_len)) if v]
        if given:
            raise NVFP4UsageError(f"{label}{given[0]}: only for format {' / '.join(FORMATS)} (format={format})")
        return None
    try:
        return SftSpec(format, loss_on, overlong or "drop", seq_len)
    except NVFP4UsageError as bad:
        raise NVFP4UsageError(f"{label}{bad}") from None


def sft_encoder(
    tokenizer_folder: str | Path,
    format: str,
    loss_on: str | None,
    overlong: str | None,
    seq_len: int | None,
    label: str = "",
) -> SftEncoder | None:
    """The encoder of a fine-tuning format (None for another format: see `sft_options`)."""
    spec = sft_options(format, loss_on, overlong, seq_len, label)
    return None if spec is None else SftEncoder(tokenizer_folder, spec)


def encode_rows(rows: Iterable[tuple[str, Any]], encoder: SftEncoder, counts: SftCounts) -> Iterator[Encoded]:
    """The kept rows of (where, row) pairs as `Encoded`, each row counted in `counts`."""
    for where, row in rows:
        encoded = encoder.encode(row, where)
        counts.add(encoded)
        if encoded.status != "dropped":
            yield encoded


class SftEncoder:
    """Encodes rows with one tokenizer folder's tokenizer and chat template. Picklable (a worker
    process loads the tokenizer again on first use)."""

    def __init__(self, tokenizer_folder: str | Path, spec: SftSpec):
        self.folder = Path(tokenizer_folder)
        self.spec = spec
        self._tokenizer = None

    def __getstate__(self):
        return {**self.__dict__, "_tokenizer": None}

    def check(self) -> None:
        """Load the tokenizer now (and, for format=chat, its chat template): refused before any
        output is created."""
        if self.spec.format == "chat":
            self._chat_tokenizer()
        else:
            self._eos_id()

    def chat_template_sha256(self) -> str | None:
        """sha256 of the folder's chat template (None: the tokenizer has none)."""
        try:
            template = self.tokenizer.get_chat_template()
        except ValueError:
            return None
        return hashlib.sha256(template.encode("utf-8")).hexdigest()

    def encode(self, row: Any, where: str) -> Encoded:
        """One row (a dict) as tokens and loss marks; `where` names it in errors (`file:line`)."""
        if not isinstance(row, dict):
            raise NVFP4ToolError(f"{where}: expected a JSON object, got {type(row).__name__}")
        if self.spec.format == "chat":
            ids, loss = self._chat(row, where)
        else:
            ids, loss = self._prompt_completion(row, where)
        return _fit(ids, loss, self.spec)

    # -- chat -----------------------------------------------------------------------------------

    def _chat(self, row: dict, where: str) -> tuple[np.ndarray, np.ndarray]:
        if "messages" not in row:
            raise NVFP4ToolError(f"{where}: no 'messages' field (format=chat)")
        messages = _messages(row["messages"], where, "messages")
        if not any(m["role"] == "assistant" for m in messages):
            raise NVFP4ToolError(f"{where}: messages: no assistant turn (nothing to learn from)")
        tokenizer = self._chat_tokenizer()
        if self.spec.loss_on == "all":
            ids, _ = self._tokenize(self._render(messages, False, where))
            return ids, np.ones(len(ids), bool)
        if _GENERATION_TAG.search(tokenizer.get_chat_template()):
            return self._marked_by_template(messages, where)
        full = self._render(messages, False, where)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                before = self._render(messages[:i], True, where)
                through = self._render(messages[: i + 1], False, where)
                if not through.startswith(before):
                    why = f"messages[:{i}] with the generation prompt does not render as a prefix of messages[:{i + 1}]"
                    raise self._unmarkable(where, why)
                if not full.startswith(through):
                    raise self._unmarkable(where, f"messages[:{i + 1}] does not render as a prefix of the conversation")
                spans.append((len(before), len(through)))
        ids, offsets = self._tokenize(full)
        loss = _overlapping(offsets, spans)
        if not loss.any():
            raise self._unmarkable(where, "the assistant's turns render as no text")
        return ids, loss

    def _marked_by_template(self, messages: list[dict], where: str) -> tuple[np.ndarray, np.ndarray]:
        """The assistant's tokens as transformers marks them from the template's generation tags."""
        with self._template_refusals(where):
            out = self._chat_tokenizer().apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
        loss = np.asarray(out["assistant_masks"], bool)
        if not loss.any():
            raise self._unmarkable(where, "its {% generation %} markers mark no token of the assistant's turns")
        return np.asarray(out["input_ids"], np.int32), loss

    # -- prompt / completion --------------------------------------------------------------------

    def _prompt_completion(self, row: dict, where: str) -> tuple[np.ndarray, np.ndarray]:
        for name in ("prompt", "completion"):
            if name not in row:
                raise NVFP4ToolError(f"{where}: no '{name}' field (format=prompt_completion)")
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            text = prompt + completion
            ids, offsets = self._tokenize(text)
            eos_id = self._eos_id()
            ids = np.append(ids, np.int32(eos_id))
            loss = np.append(_overlapping(offsets, [(len(prompt), len(text))]), True)  # the end of text is learnt
        elif isinstance(prompt, list) and isinstance(completion, list):
            if not completion:
                raise NVFP4ToolError(f"{where}: completion: an empty list of messages")
            messages = _messages(prompt + completion, where, "prompt + completion")
            self._chat_tokenizer()
            before = self._render(messages[: len(prompt)], True, where) if prompt else ""
            full = self._render(messages, False, where)
            if not full.startswith(before):
                raise self._unmarkable(
                    where, "rendering the prompt with the generation prompt is not a prefix of the whole"
                )
            ids, offsets = self._tokenize(full)
            loss = _overlapping(offsets, [(len(before), len(full))])
        else:
            raise NVFP4ToolError(
                f"{where}: prompt / completion: expected two strings or two lists of messages, "
                f"got {type(prompt).__name__} / {type(completion).__name__}"
            )
        if self.spec.loss_on == "all":
            loss = np.ones(len(ids), bool)
        return ids, loss

    # -- the tokenizer --------------------------------------------------------------------------

    @property
    def tokenizer(self):
        """transformers' tokenizer of the folder (a fast one: its offsets map tokens to text)."""
        if self._tokenizer is None:
            self._tokenizer = _load_tokenizer(self.folder)
        return self._tokenizer

    def _chat_tokenizer(self):
        tokenizer = self.tokenizer
        try:
            tokenizer.get_chat_template()
        except ValueError:
            raise NVFP4ToolError(
                f"{self.folder}: the tokenizer has no chat template (tokenizer_config.json 'chat_template' "
                f"or chat_template.jinja); format={self.spec.format} with messages needs one"
            ) from None
        return tokenizer

    def _render(self, messages: list[dict], generation_prompt: bool, where: str) -> str:
        with self._template_refusals(where):
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    @contextlib.contextmanager
    def _template_refusals(self, where: str) -> Iterator[None]:
        """A template's own refusal (`raise_exception(...)`, e.g. roles that do not alternate) as one line."""
        import jinja2

        try:
            yield
        except jinja2.TemplateError as bad:
            reason = (str(bad).splitlines() or [type(bad).__name__])[0]
            raise NVFP4ToolError(
                f"{where}: the chat template of {self.folder} refused the conversation ({reason})"
            ) from None

    def _tokenize(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids [n] int32, character offsets [n, 2]) of `text`, without added special tokens (as
        transformers' apply_chat_template tokenizes a rendering)."""
        out = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = np.asarray(out["offset_mapping"], np.int64).reshape(-1, 2)
        return np.asarray(out["input_ids"], np.int32), offsets

    def _eos_id(self) -> int:
        eos_id = self.tokenizer.eos_token_id
        if eos_id is None:
            raise NVFP4ToolError(f"{self.folder}: the tokenizer has no end-of-text token (eos_token)")
        return eos_id

    def _unmarkable(self, where: str, why: str) -> NVFP4ToolError:
        return NVFP4ToolError(
            f"{self.folder}: the chat template cannot mark the assistant's span: {why} ({where}); "
            "add {% generation %} / {% endgeneration %} around the assistant's turn in the template, or use loss_on=all"
        )


# ------------------------------------------------------------------------------------------
# helpers


def _messages(value: Any, where: str, field: str) -> list[dict]:
    """The messages of a row, checked: a non-empty list of {role, content} with known roles, a
    system message first only; only role and content are kept."""
    if not isinstance(value, list):
        raise NVFP4ToolError(f"{where}: {field}: expected a list of messages, got {type(value).__name__}")
    if not value:
        raise NVFP4ToolError(f"{where}: {field}: an empty conversation")
    messages = []
    for i, message in enumerate(value):
        name = f"{field}[{i}]" if field == "messages" else f"{field} message {i}"
        if not isinstance(message, dict):
            raise NVFP4ToolError(
                f"{where}: {name}: expected an object with role and content, got {type(message).__name__}"
            )
        for key in ("role", "content"):
            if key not in message:
                raise NVFP4ToolError(f"{where}: {name}: no '{key}'")
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise NVFP4ToolError(f"{where}: {name}.role: unknown role {role!r} (expected {', '.join(ROLES)})")
        if role == "system" and i > 0:
            raise NVFP4ToolError(f"{where}: {name}.role: a system message is allowed first only")
        if not isinstance(content, str):
            raise NVFP4ToolError(f"{where}: {name}.content: expected a string, got {type(content).__name__}")
        messages.append({"role": role, "content": content})
    if messages[0]["role"] == "assistant":
        raise NVFP4ToolError(
            f"{where}: {field}[0]: the conversation opens with an assistant turn (a user turn comes first)"
        )
    return messages


def _overlapping(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """[n] bool: the tokens whose characters overlap one of the spans [start, end) of the text,
    transformers' rule for `return_assistant_tokens_mask` (a token cut by a span's edge counts)."""
    loss = np.zeros(len(offsets), bool)
    for start, end in spans:
        loss |= (offsets[:, 1] > start) & (offsets[:, 0] < end)
    return loss


def _fit(ids: np.ndarray, loss: np.ndarray, spec: SftSpec) -> Encoded:
    """The row as kept, truncated to seq_len + 1 tokens, or dropped, by `spec.overlong`."""
    if spec.seq_len is None or len(ids) <= spec.seq_len + 1:
        return Encoded(ids, loss)
    if spec.overlong == "drop":
        return Encoded(ids[:0], loss[:0], "dropped")
    return Encoded(ids[: spec.seq_len + 1], loss[: spec.seq_len + 1], "truncated")


def _load_tokenizer(folder: Path):
    if not folder.is_dir():
        raise NVFP4ToolError(f"{folder}: not found (expected a tokenizer folder)")
    import transformers

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    except Exception as bad:  # transformers and tokenizers raise many types for a damaged folder
        reason = (str(bad).splitlines() or [type(bad).__name__])[0]
        raise NVFP4ToolError(f"{folder}: cannot load the tokenizer ({reason})") from None
    if not tokenizer.is_fast:
        raise NVFP4ToolError(f"{folder}: not a fast tokenizer (tokenizer.json); its token offsets are needed")
    return tokenizer
