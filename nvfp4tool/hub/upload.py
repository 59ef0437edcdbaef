"""`push_checkpoint`: check an export, write its model card, and upload both to the Hugging Face Hub.

    result = push_checkpoint("out/llama-nvfp4", PushOptions(repo_id="org/llama-nvfp4"))

Every refusal (validation and its custody, check, the record's claims) comes before any staging or
network; `dry_run` stops before the token. Requests time out after `options.timeout` seconds.
Design notes: docs/design/hub.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from urllib.parse import urlparse

from nvfp4tool import progress
from nvfp4tool.errors import NVFP4ToolError, NVFP4UsageError
from nvfp4tool.hub.card import build_model_card, card_identity
from nvfp4tool.hub.custody import verify_claims, verify_custody, verify_eval
from nvfp4tool.records.validation import ValidationRecord
from nvfp4tool.validate.custody import CARD_FILE, upload_files


@dataclasses.dataclass(frozen=True)
class PushOptions:
    """How to publish one export."""

    repo_id: str  # "org/name"
    private: bool = False  # create the repo private (an existing repo keeps its visibility)
    revision: str | None = None  # branch to commit to (created from main if missing); None: main
    create_pr: bool = False  # open a pull request against main instead of committing
    dry_run: bool = False  # print the plan and the card; no token, no network
    endpoint: str | None = None  # a private Hub; None: HF_ENDPOINT or huggingface.co
    timeout: float = 30.0  # seconds without an answer before a request is retried
    tries: int = 3  # attempts per request (a streamed upload body: 1)
    require_validation: bool = True  # refuse a folder without validation.json
    base_model: str | None = None  # overrides the provenance's source repo id
    license: str | None = None  # overrides the source's license
    commit_message: str | None = None


@dataclasses.dataclass
class PushResult:
    """What was (or, in a dry run, would be) uploaded."""

    repo_id: str
    files: list[tuple[str, int]]  # (path in repo, bytes), README.md included, sorted
    card: str
    replaced_readme: bool  # the export had its own README.md, replaced in the upload
    dry_run: bool
    repo_url: str | None = None
    commit_url: str | None = None
    pr_url: str | None = None

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.files)

    def file_table(self) -> str:
        width = max(len(p) for p, _ in self.files)
        lines = [
            f"  {path:<{width}}  {format_size(size):>10}" + ("  (model card, generated)" if path == CARD_FILE else "")
            for path, size in self.files
        ]
        return "\n".join(lines + [f"  {len(self.files)} files, {format_size(self.total_bytes)}"])


def push_checkpoint(
    folder: str | os.PathLike,
    options: PushOptions,
    echo: Callable[[str], None] = progress.info,
    warn: Callable[[str], None] = progress.warn,
) -> PushResult:
    """Check, card and upload the export at `folder` as `options` say (see the module docstring).
    Status lines go to `echo`, the "Warning:" lines (custody's, the card's) to `warn`: by default
    `progress.warn`, shown even under --quiet."""
    folder = os.fspath(folder)
    _check_options(options)
    from nvfp4tool.check import check_checkpoint

    files = upload_files(folder)
    _refuse_leftovers(folder, files)
    validation = _read_validation(folder)
    notices = verify_custody(folder, validation, sorted(files), skip=(CARD_FILE,)) if validation is not None else []
    report = check_checkpoint(folder)
    if not report.ok:
        for problem in report.problems:
            echo(problem.line())
        raise NVFP4ToolError(report.failure("nothing uploaded"))
    echo(report.summary_line())
    if validation is None and options.require_validation:
        raise NVFP4ToolError(
            f"{ValidationRecord.path(folder)}: no validation report; run `nvfp4tool validate` "
            "on the export first, or pass --no-validation to publish without one"
        )
    if validation is not None:
        verify_claims(folder, validation, report)
    verify_eval(folder, validation)
    for notice in notices:
        warn(notice)
    base_model, license = card_identity(folder, options.base_model, options.license)
    if base_model is None:
        warn(
            "Warning: the model card has no base_model (neither the provenance nor the source's config.json "
            "`_name_or_path` names a Hub repo); "
            "pass --base-model ORG/NAME"
        )
    if license is None:
        warn(
            "Warning: the model card has no license (none in the source's README.md or config.json); pass --license ID"
        )
    card = build_model_card(
        folder, report, repo_id=options.repo_id, validation=validation, base_model=base_model, license=license
    )
    replaced = CARD_FILE in files
    files[CARD_FILE] = len(card.encode("utf-8"))
    result = PushResult(options.repo_id, sorted(files.items()), card, replaced, options.dry_run)
    if options.dry_run:
        return result
    _upload(folder, result, options)
    return result


def format_size(n_bytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n_bytes < 1000 or unit == "GB":
            return f"{n_bytes} B" if unit == "B" else f"{n_bytes:.1f} {unit}"
        n_bytes /= 1000
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------------------------- helpers


def _check_options(options: PushOptions) -> None:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(options.repo_id)
    except HFValidationError:
        raise NVFP4UsageError(f"--repo-id {options.repo_id!r}: expected ORG/NAME") from None
    if "/" not in options.repo_id:
        raise NVFP4UsageError(
            f"--repo-id {options.repo_id!r}: expected ORG/NAME (the user or organization, a slash, the model name)"
        )
    if not (math.isfinite(options.timeout) and options.timeout > 0):
        raise NVFP4UsageError(f"--timeout {options.timeout}: expected a number of seconds > 0")
    if options.tries < 1:
        raise NVFP4UsageError(f"tries={options.tries}: expected at least 1")
    if options.create_pr and options.revision not in (None, "main"):
        raise NVFP4UsageError("--create-pr opens a pull request against main: do not combine it with --revision")


def _refuse_leftovers(folder: str, files: dict[str, int]) -> None:
    """Refuse (with or without validation) a temporary file of an nvfp4tool writer in the export,
    naming it: never uploaded, never passed over silently."""
    from converters.atomic import MARKER_FILE, leftover_pid

    for name in sorted(files):
        base = name.rsplit("/", 1)[-1]
        pid = leftover_pid(base)
        if pid is not None or base == MARKER_FILE:
            raise NVFP4ToolError(
                f"{os.path.join(folder, *name.split('/'))}: a temporary file of an interrupted nvfp4tool "
                f"run{f' (pid {pid})' if pid is not None else ''}, not part of the export; nothing uploaded "
                "(rerun the interrupted eval or validate with --force, which removes it, or delete it)"
            )


def _read_validation(folder: str) -> ValidationRecord | None:
    """The export's validation record (None when absent); refuses a failed one."""
    path = ValidationRecord.path(folder)
    if not os.path.lexists(path):
        return None
    validation = ValidationRecord.read(folder)
    if not validation.passed:
        failed = ", ".join(f.metric for f in validation.failures)
        raise NVFP4ToolError(
            f"{path}: the export failed validation{f' ({failed})' if failed else ''}; "
            "fix it (see validation.md) before publishing"
        )
    return validation


def _upload(folder: str, result: PushResult, options: PushOptions) -> None:
    from huggingface_hub import HfApi, get_token

    token = get_token()
    if not token:
        raise NVFP4ToolError("no Hugging Face token: set HF_TOKEN or run `hf auth login` (or use --dry-run)")
    api = HfApi(endpoint=options.endpoint, token=token)
    with (
        tempfile.TemporaryDirectory(prefix="nvfp4tool-push-") as staging,
        _bounded_http(options.timeout, options.tries),
        _hub_bars_follow_reporter(),
    ):
        _stage(folder, staging, result)
        try:
            repo_url = api.create_repo(options.repo_id, private=options.private, exist_ok=True, repo_type="model")
            if options.revision not in (None, "main"):
                api.create_branch(options.repo_id, branch=options.revision, exist_ok=True)
            # huggingface_hub's bars show the upload where they may (a terminal); else our lines
            with progress.task(
                "upload",
                total=len(result.files),
                unit="file",
                enabled=not getattr(progress.reporter(), "external_bars", True),
            ) as task:
                commit = api.upload_folder(
                    repo_id=options.repo_id,
                    folder_path=staging,
                    repo_type="model",
                    revision=options.revision,
                    create_pr=options.create_pr,
                    commit_message=options.commit_message or "Upload checked export with model card (nvfp4tool push)",
                )
                task.advance(len(result.files), nbytes=result.total_bytes)
        except Exception as exc:  # any failure of the upload: one line, the token masked
            no_answer = _cause(exc, _NoAnswer)
            if no_answer is not None:
                raise NVFP4ToolError(f"{no_answer}; nothing more was sent to {options.repo_id}") from None
            raise NVFP4ToolError(_upload_error(options, api.endpoint, exc, token)) from None
    result.repo_url = str(repo_url)
    result.commit_url = getattr(commit, "commit_url", None)
    result.pr_url = getattr(commit, "pr_url", None)


def _stage(folder: str, staging: str, result: PushResult) -> None:
    """Symlink each export file into `staging` (copy where links are not allowed); write the card."""
    for path, _ in result.files:
        if path == CARD_FILE:
            continue
        target = os.path.join(staging, *path.split("/"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        source = os.path.abspath(os.path.join(folder, *path.split("/")))
        try:
            os.symlink(source, target)
        except OSError:
            shutil.copyfile(source, target)
    with open(os.path.join(staging, CARD_FILE), "w", encoding="utf-8") as f:
        f.write(result.card)


class _NoAnswer(Exception):
    """A request that got no answer in `timeout` seconds, `tries` times (not an httpx error, so
    huggingface_hub's own retry loop does not multiply the attempts)."""

    def __init__(self, url: str, timeout: float, tries: int) -> None:
        parts = urlparse(url)
        super().__init__(
            f"{parts.scheme}://{parts.netloc}: no answer after {timeout:g} s "
            f"({tries} {'try' if tries == 1 else 'tries'})"
        )


@contextlib.contextmanager
def _bounded_http(timeout: float, tries: int) -> Iterator[None]:
    """huggingface_hub's shared client with a timeout and a bounded retry, for the block's duration."""
    import httpx2
    from huggingface_hub import set_client_factory
    from huggingface_hub.utils import _http

    class BoundedTransport(httpx2.HTTPTransport):
        def handle_request(self, request: httpx2.Request) -> httpx2.Response:
            attempts = tries if isinstance(request.stream, httpx2.ByteStream) else 1  # else not replayable
            for _ in range(attempts):
                try:
                    return super().handle_request(request)
                except httpx2.TimeoutException:
                    continue
            raise _NoAnswer(str(request.url), timeout, attempts)

    previous = _http._GLOBAL_CLIENT_FACTORY  # no public getter; restored below
    set_client_factory(
        lambda: httpx2.Client(follow_redirects=True, timeout=httpx2.Timeout(timeout), transport=BoundedTransport())
    )
    try:
        yield
    finally:
        set_client_factory(previous)


@contextlib.contextmanager
def _hub_bars_follow_reporter() -> Iterator[None]:
    """huggingface_hub's own upload bars (tqdm) are off unless the reporter allows third-party bars
    (`external_bars`: off with --quiet and in log lines, where tqdm's redraws would flood the log)."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    silence = not getattr(progress.reporter(), "external_bars", True) and not are_progress_bars_disabled()
    if silence:
        disable_progress_bars()
    try:
        yield
    finally:
        if silence:
            enable_progress_bars()


def _cause(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    """`exc` or the first exception of `kind` in its chain of causes (huggingface_hub wraps some)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _upload_error(options: PushOptions, endpoint: str, exc: Exception, token: str) -> str:
    """One line naming the repo, the endpoint, the HTTP status and the server's message; no token."""
    http_error = exc
    while http_error.__cause__ is not None and getattr(http_error, "response", None) is None:
        http_error = http_error.__cause__  # e.g. RuntimeError("Error while uploading 'x'") from an HTTP error
    status = getattr(getattr(http_error, "response", None), "status_code", None)
    if status is None:
        what = f"{type(exc).__name__}: {exc}"
    else:
        wrapper = f"{exc} " if http_error is not exc else ""
        what = f"{wrapper}HTTP {status}: {getattr(http_error, 'server_message', None) or http_error}"
        if status == 401:
            what += " (is HF_TOKEN / the saved login valid for this Hub?)"
    if "xet" in what.lower():  # a Hub without Xet storage (older / private deployments)
        what += " (if this Hub has no Xet storage, set HF_HUB_DISABLE_XET=1 to upload through plain LFS)"
    line = " ".join(f"{options.repo_id}: upload to {endpoint} failed, {what}".split())
    return line.replace(token, "***")
