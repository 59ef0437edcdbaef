"""The API of the `data` commands: `prepare_data` (`data prepare`), `verify_data` (`data verify`).
Design notes: docs/design/cli.md.
"""

from __future__ import annotations

from typing import Annotated

from nvfp4tool.api.rules import COUNT, FOLDER, PATH, OneOf, Range, checked, default
from nvfp4tool.corpus.cache import TokenCache, verify_cache
from nvfp4tool.corpus.chat import LOSS_ON_CHOICES, OVERLONG
from nvfp4tool.corpus.encode import FORMATS
from nvfp4tool.corpus.prepare import prepare_cache
from nvfp4tool.records.corpus import CorpusManifest


@checked
def prepare_data(
    *sources: Annotated[str, PATH],
    tokenizer: Annotated[str, PATH],
    out: str,
    text_field: str = default(prepare_cache, "text_field"),
    format: Annotated[str, OneOf(tuple(FORMATS))] = default(prepare_cache, "format"),
    loss_on: Annotated[str | None, OneOf(LOSS_ON_CHOICES)] = default(prepare_cache, "loss_on"),
    overlong: Annotated[str | None, OneOf(OVERLONG)] = default(prepare_cache, "overlong"),
    seq_len: Annotated[int | None, COUNT] = default(prepare_cache, "seq_len"),
    workers: Annotated[int, Range(low=0, integer=True)] = default(prepare_cache, "workers"),
    shard_tokens: Annotated[int, COUNT] = default(prepare_cache, "shard_tokens"),
    force: bool = default(prepare_cache, "force"),
) -> CorpusManifest:
    """`nvfp4tool data prepare SOURCE... --tokenizer TOK --out CACHE`: the token cache `train
    data=CACHE` reads; returns its manifest (CACHE/nvfp4tool_corpus.json)."""
    return prepare_cache(
        list(sources),
        tokenizer,
        out,
        text_field=text_field,
        format=format,
        loss_on=loss_on,
        overlong=overlong,
        seq_len=seq_len,
        workers=workers,
        shard_tokens=shard_tokens,
        force=force,
    )


@checked
def verify_data(cache: Annotated[str, FOLDER], *, skip_sources: bool = False) -> TokenCache:
    """`nvfp4tool data verify CACHE`: every file of the cache (and, unless `skip_sources`, each
    source file it records) against its recorded sha256; returns the cache (`.manifest`)."""
    return verify_cache(cache, sources=not skip_sources)
