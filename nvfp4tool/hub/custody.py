"""The chain of custody `push` enforces: what it uploads is what `nvfp4tool validate` validated,
and what was validated is the source the export was made from.

    notices = verify_custody(folder, validation, upload_paths)   # before check, card, staging
    verify_claims(folder, validation, report)                    # after check: the record's own story

Design notes: docs/design/hub.md.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
from typing import Any

from nvfp4tool.errors import NVFP4ToolError
from nvfp4tool.hub.card import fp8_reference_ran
from nvfp4tool.records.export import ExportRecord, first_file_difference, sha256_file
from nvfp4tool.records.validation import ValidationRecord

REVALIDATE = "rerun `nvfp4tool validate` on the export"


def verify_custody(
    folder: str, validation: ValidationRecord, upload: list[str], *, skip: tuple[str, ...] = ()
) -> list[str]:
    """Refuse (NVFP4ToolError) an export whose files are not the validated ones or a validation of
    another source; returns the notices to print (a source mismatch the record allows). `upload`:
    the paths (POSIX, relative to `folder`) push would send; `skip`: paths push replaces itself.
    The provenance record is read only once its bytes are known to be the validated ones."""
    _verify_files(folder, validation, upload, skip)
    provenance = ExportRecord.read(folder) if ExportRecord.exists(folder) else None
    return _verify_source(folder, validation, provenance)


def verify_claims(folder: str, validation: ValidationRecord, report: Any) -> None:
    """Refuse a validation.json that contradicts itself or the checked export (`report`: the
    check.CheckReport of `folder`), or a validation.md that is not its rendering."""
    where = ValidationRecord.path(folder)
    if (validation.quant, validation.format) != (report.quant, report.format):
        raise NVFP4ToolError(
            f"{where}: validated a {validation.format} {validation.quant} export, but "
            f"{folder} is {report.format} {report.quant}; {REVALIDATE}"
        )
    for label in ("bf16", validation.quant):
        if label not in validation.models:
            raise NVFP4ToolError(f"{where}: models: no metrics of {label!r}; {REVALIDATE}")
    has_fp8 = fp8_reference_ran(validation)
    if validation.quant != "fp8" and (validation.reference == "bf16") == has_fp8:
        raise NVFP4ToolError(
            f"{where}: reference {validation.reference!r} but "
            f"{'an' if has_fp8 else 'no'} FP8 column in models; {REVALIDATE}"
        )
    thresholds = recorded_thresholds(validation, where)
    if validation.passed and validation.failures:
        raise NVFP4ToolError(
            f"{where}: passed is true but it lists {len(validation.failures)} failed limit(s) "
            f"({', '.join(f.metric for f in validation.failures)}); {REVALIDATE}"
        )
    if validation.passed:
        failed = _recheck(validation, thresholds, where)
        if failed:
            first = failed[0]
            raise NVFP4ToolError(
                f"{where}: passed is true but its own metrics fail its thresholds: "
                f"{first['metric']} ({first['detail']}) = {first['value']:.4g}, limit "
                f"{first['limit']:.4g}; {REVALIDATE}"
            )
    _verify_markdown(folder, validation)


def recorded_thresholds(validation: ValidationRecord, where: str = ValidationRecord.FILE_NAME):
    """The `Thresholds` validation.json records (every field; NVFP4ToolError naming the first
    missing or unknown one)."""
    from nvfp4tool.validate.thresholds import Thresholds

    fields = [f.name for f in dataclasses.fields(Thresholds)]
    unknown = [k for k in validation.thresholds if k not in fields]
    missing = [k for k in fields if k not in validation.thresholds]
    if unknown or missing:
        raise NVFP4ToolError(
            f"{where}: thresholds: "
            + (f"unknown limit {unknown[0]!r}" if unknown else f"missing limit {missing[0]!r}")
            + f" (expected: {', '.join(fields)}); {REVALIDATE}"
        )
    return Thresholds(**{k: validation.thresholds[k] for k in fields})


# ---------------------------------------------------------------------------------------- helpers


def _verify_files(folder: str, validation: ValidationRecord, upload: list[str], skip: tuple[str, ...]) -> None:
    from nvfp4tool.records.evaluation import EVAL_FILES
    from nvfp4tool.validate.report import REPORT_FILES

    where = ValidationRecord.path(folder)
    validated = validation.export.sha256
    for name in validated:
        if (
            not name
            or os.path.isabs(name)
            or "\\" in name
            or posixpath.normpath(name) != name
            or name.split("/")[0] == ".."
        ):
            raise NVFP4ToolError(
                f"{where}: export.sha256 lists {name!r}, not a file inside the export "
                f"(a malformed record); {REVALIDATE}"
            )
    uploaded = set(upload)
    for name in sorted(set(validated) | (uploaded - set(REPORT_FILES) - set(EVAL_FILES))):
        if name in skip:
            continue
        path = os.path.join(folder, *name.split("/"))
        if name not in validated:
            raise NVFP4ToolError(
                f"{path}: not validated (validation.json does not list it: added or renamed "
                f"after validation?); {REVALIDATE}, or remove the file"
            )
        if not os.path.isfile(path):
            raise NVFP4ToolError(
                f"{path}: validated (listed in validation.json) but missing from the export; "
                f"restore it, or {REVALIDATE}"
            )
        digest = sha256_file(path)
        if digest != validated[name]:
            raise NVFP4ToolError(
                f"{path}: changed since validation (sha256 {digest[:12]}..., validation.json "
                f"recorded {validated[name][:12]}...); {REVALIDATE}"
            )


def _verify_source(folder: str, validation: ValidationRecord, provenance: ExportRecord | None) -> list[str]:
    if provenance is None:
        return []
    problem = source_difference(validation, provenance)
    if problem is None:
        return []
    where = ValidationRecord.path(folder)
    if validation.source_mismatch_ok:
        return [
            f"Warning: {where}: validated against a source that is not the export's ({problem}); "
            "published as `validate --source-mismatch-ok` recorded it, and the card says so"
        ]
    raise NVFP4ToolError(
        f"{where}: not a validation of this export's source: {problem}; rerun `nvfp4tool "
        "validate` with the source the export was made from"
    )


def source_difference(validation: ValidationRecord, provenance: ExportRecord) -> str | None:
    """How validation.json's source differs from the provenance record's (the first difference),
    or None when they are the same: same name, kind, step, weight-file hashes and hashes of the
    files that define the source besides its weights (config, generation settings, tokenizer)."""
    record, named = provenance.source, validation.source
    prov = ExportRecord.FILE_NAME
    if named.name != record.name:
        same = " (same weight files)" if named.sha256 == record.files else ""
        return f"it names {named.name!r}, {prov} names {record.name!r}{same}"
    if (validation.source_kind, validation.source_step) != (record.kind, record.step):
        return (
            f"{_kind(validation.source_kind, validation.source_step)} in validation.json, "
            f"{_kind(record.kind, record.step)} in {prov}"
        )
    found = first_file_difference(record.files, named.sha256)
    if found is None:
        return _definition_difference(validation, record)
    name, how = found
    if how == "missing":
        return f"weight file {name!r} of {prov} is not among the validated source's files"
    if how == "extra":
        return f"weight file {name!r} of the validated source is not in {prov}"
    return (
        f"weight file {name!r} differs (sha256 {named.sha256[name][:12]}... validated, "
        f"{record.files[name][:12]}... in {prov})"
    )


def _definition_difference(validation: ValidationRecord, record) -> str | None:
    """How the validated source's defining files besides its weights (config.json, generation
    settings, tokenizer files) differ from the provenance record's; None when the same, or when the
    provenance record predates binding them."""
    if record.config_files is None:
        return None
    prov = ExportRecord.FILE_NAME
    if validation.source_config_files is None:
        return f"validation.json records no hashes of the source's config and tokenizer files, {prov} does"
    found = first_file_difference(record.config_files, validation.source_config_files)
    if found is None:
        return None
    name, how = found
    if how == "missing":
        return f"file {name!r} that defines the source in {prov} is not among the validated source's files"
    if how == "extra":
        return f"file {name!r} that defines the validated source is not in {prov}"
    return (
        f"file {name!r} that defines the source differs (sha256 {validation.source_config_files[name][:12]}... "
        f"validated, {record.config_files[name][:12]}... in {prov})"
    )


def _kind(kind: str, step: int | None) -> str:
    return f"{kind} source" + (f" at step {step}" if step is not None else "")


def _recheck(validation: ValidationRecord, thresholds: Any, where: str) -> list[dict[str, Any]]:
    """The record's metrics against its own thresholds, as validate judged them (the flat rows
    `check_thresholds` reads: `<label>_weight_sqnr_db` per layer)."""
    from nvfp4tool.validate.thresholds import check_thresholds

    layers = [
        {
            "name": row.name,
            **{f"{k}_weight_sqnr_db": v for k, v in row.weight_sqnr_db.items()},
            **{f"{k}_output_sqnr_db": v for k, v in row.output_sqnr_db.items()},
        }
        for row in validation.layers
    ]
    try:
        return check_thresholds({"models": validation.models, "layers": layers}, thresholds, label=validation.quant)
    except KeyError as missing:
        raise NVFP4ToolError(
            f"{where}: models.{validation.quant}: no {missing.args[0]!r} metric though its limit is set; {REVALIDATE}"
        ) from None


def verify_eval(folder: str, validation: ValidationRecord | None) -> None:
    """Refuse eval reports that do not describe these bytes: an `eval.json` (strictly read) whose
    export hashes are not the validated ones (or, without a validation, not the files' current
    ones), an `eval.md` that is not its rendering, an unreadable `eval_items.json`, or eval reports
    without `eval.json`. Nothing to check when `nvfp4tool eval` never ran."""
    from nvfp4tool.eval.report import markdown
    from nvfp4tool.records.evaluation import EVAL_FILES, EVAL_MD, EvalItems, EvalRecord
    from nvfp4tool.validate.custody import validated_files

    rerun = "rerun `nvfp4tool eval --force` on the export, or remove the eval files"
    if not EvalRecord.exists(folder):
        stray = [n for n in EVAL_FILES if os.path.exists(os.path.join(folder, n))]
        if stray:
            raise NVFP4ToolError(
                f"{os.path.join(folder, stray[0])}: an eval report without {EvalRecord.FILE_NAME}; {rerun}"
            )
        return
    record = EvalRecord.read(folder)
    expected = (
        validation.export.sha256
        if validation is not None
        else {os.path.relpath(f, folder).replace(os.sep, "/"): h for f, h in validated_files(folder).items()}
    )
    if record.export.sha256 != expected:
        changed = sorted(set(record.export.sha256) ^ set(expected)) or sorted(
            n for n in expected if record.export.sha256.get(n) != expected[n]
        )
        raise NVFP4ToolError(
            f"{EvalRecord.path(folder)}: measured other bytes than the "
            f"{'validated' if validation is not None else 'present'} export "
            f"(first: {changed[0] if changed else '?'}); {rerun}"
        )
    if EvalItems.exists(folder):
        EvalItems.read(folder)
    _verify_rendering(
        os.path.join(folder, EVAL_MD),
        markdown(record),
        f"differs from what {EvalRecord.FILE_NAME} says (edited?); {rerun}",
    )


def _verify_markdown(folder: str, validation: ValidationRecord) -> None:
    from nvfp4tool.validate.report import VALIDATION_MD, markdown

    _verify_rendering(
        os.path.join(folder, VALIDATION_MD),
        markdown(validation),
        f"differs from what {ValidationRecord.FILE_NAME} says (edited after validation?); "
        f"{REVALIDATE}, or remove {VALIDATION_MD}",
    )


def _verify_rendering(path: str, expected: str, problem: str) -> None:
    """A report's Markdown (when present) must be exactly its record's rendering; else `path: problem`."""
    if not os.path.isfile(path):
        return
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as bad:
        raise NVFP4ToolError(f"{path}: cannot read ({getattr(bad, 'strerror', None) or bad})") from None
    if text != expected:
        raise NVFP4ToolError(f"{path}: {problem}")
