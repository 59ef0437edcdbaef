"""Tokenizers: load a model folder's `tokenizer.json`, or train a byte-level BPE one on the data.

A trained tokenizer is saved with transformers' `PreTrainedTokenizerFast.save_pretrained`
(`tokenizer.json` + `tokenizer_config.json`), so `AutoTokenizer.from_pretrained(folder)` loads it
and it ships with the model folder the trainer writes. `tokenizer_sha256` is the one identity of a
tokenizer (run.json, a token cache's manifest, a distillation teacher's).
Design notes: docs/design/data.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from nvfp4tool.errors import NVFP4ToolError

END_OF_TEXT = "<|endoftext|>"  # the document separator (and EOS) of tokenizers we train


@dataclasses.dataclass(frozen=True)
class TextTokenizer:
    """A `tokenizers.Tokenizer` and the id that ends a document."""

    tokenizer: Tokenizer
    eos_id: int

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids))


def load_tokenizer(folder: str | Path) -> TextTokenizer:
    """The tokenizer of a Hugging Face model folder; EOS from tokenizer_config.json or config.json."""
    folder = Path(folder)
    path = folder / "tokenizer.json"
    if not folder.is_dir():
        raise NVFP4ToolError(f"{folder}: not found (expected a folder with tokenizer.json)")
    if not path.is_file():
        raise NVFP4ToolError(f"{folder}: no tokenizer.json (train one with tokenizer=train)")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as bad:  # tokenizers raises a bare Exception for unreadable / malformed files
        raise NVFP4ToolError(f"{path}: not a valid tokenizer ({str(bad).splitlines()[0]})") from None
    return TextTokenizer(tokenizer, _eos_id(folder, tokenizer))


def tokenizer_sha256(tokenizer: TextTokenizer) -> str:
    """sha256 of the serialized tokenizer (`Tokenizer.to_str()`, the content of its tokenizer.json)."""
    return hashlib.sha256(tokenizer.tokenizer.to_str().encode("utf-8")).hexdigest()


def train_bpe_tokenizer(documents: Iterable[str], vocab_size: int, out_dir: str | Path) -> TextTokenizer:
    """Train a byte-level BPE tokenizer with `END_OF_TEXT` as its only special token; save it."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    save_tokenizer(tokenizer, out_dir)
    return TextTokenizer(tokenizer, tokenizer.token_to_id(END_OF_TEXT))


def save_tokenizer(tokenizer: Tokenizer, out_dir: str | Path) -> None:
    """Write tokenizer.json + tokenizer_config.json that transformers' AutoTokenizer loads."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=END_OF_TEXT, eos_token=END_OF_TEXT, unk_token=END_OF_TEXT
    )
    fast.save_pretrained(str(out_dir))


def _eos_id(folder: Path, tokenizer: Tokenizer) -> int:
    config_path = folder / "tokenizer_config.json"
    if config_path.is_file():
        eos = _json_object(config_path).get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str) and tokenizer.token_to_id(eos) is not None:
            return tokenizer.token_to_id(eos)
    model_config = folder / "config.json"
    if model_config.is_file():
        eos_id = _json_object(model_config).get("eos_token_id")
        if isinstance(eos_id, list) and eos_id:
            eos_id = eos_id[0]
        if isinstance(eos_id, int):
            return eos_id
    raise NVFP4ToolError(
        f"{folder}: cannot tell the end-of-text token (no eos_token in "
        "tokenizer_config.json, no eos_token_id in config.json)"
    )


def _json_object(path: Path) -> dict:
    try:
        obj = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as bad:
        raise NVFP4ToolError(f"{path}: not valid JSON ({bad})") from None
    if not isinstance(obj, dict):
        raise NVFP4ToolError(f"{path}: expected a JSON object")
    return obj
