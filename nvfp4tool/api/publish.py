"""The API of publishing and of the tour: `push`, `quickstart`.
Design notes: docs/design/cli.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from nvfp4tool import progress
from nvfp4tool.api.rules import COUNT, FOLDER, Range, Url, checked
from nvfp4tool.hub import PushOptions, PushResult, push_checkpoint
from nvfp4tool.quickstart import QuickstartOptions, run_quickstart

_PUSH = PushOptions(repo_id="")  # the push defaults (repo_id has none)
_QUICKSTART = QuickstartOptions()


@checked
def push(
    path: Annotated[str, FOLDER],
    *,
    repo_id: str,
    private: bool = _PUSH.private,
    revision: str | None = _PUSH.revision,
    create_pr: bool = _PUSH.create_pr,
    dry_run: bool = _PUSH.dry_run,
    endpoint: Annotated[str | None, Url()] = _PUSH.endpoint,
    timeout: Annotated[float, Range(low=0, low_open=True)] = _PUSH.timeout,
    no_validation: bool = not _PUSH.require_validation,
    base_model: str | None = _PUSH.base_model,
    license: str | None = _PUSH.license,
) -> PushResult:
    """`nvfp4tool push PATH --repo-id ORG/NAME`: check the export, write its model card and upload
    both (with `dry_run`, nothing: the result holds the file list and the card)."""
    options = PushOptions(
        repo_id=repo_id,
        private=private,
        revision=revision,
        create_pr=create_pr,
        dry_run=dry_run,
        endpoint=endpoint,
        timeout=timeout,
        require_validation=not no_validation,
        base_model=base_model,
        license=license,
    )
    return push_checkpoint(path, options)


@checked
def quickstart(
    *,
    out: str = _QUICKSTART.out,
    pretrain_steps: Annotated[int, COUNT] = _QUICKSTART.pretrain_steps,
    finetune_steps: Annotated[int, COUNT] = _QUICKSTART.finetune_steps,
    force: bool = _QUICKSTART.force,
    echo: Callable[[str], None] = progress.info,
) -> dict[str, Any]:
    """`nvfp4tool quickstart`: every stage on the embedded tiny model; returns the figures it also
    writes to OUT/quickstart.json. Each stage's result line goes to `echo`."""
    options = QuickstartOptions(out=out, pretrain_steps=pretrain_steps, finetune_steps=finetune_steps, force=force)
    return run_quickstart(options, echo=echo)
