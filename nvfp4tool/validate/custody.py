"""Chain of custody, validate's side: a validation is bound to the bytes it proves.

    problem = source_mismatch(export_dir, record, source)  # None, or one line naming the first differing file
    problem = reference_mismatch(fp8_dir, record)            # the --reference FP8 export of another source?
    hashes = validated_files(export_dir)                    # {absolute path: sha256} recorded as `export`

Design notes: docs/design/validate.md.
"""

from __future__ import annotations

import hashlib
import os

from converters.hf import read_safetensors_header
from nvfp4tool.checkpoints import Checkpoint
from nvfp4tool.records.export import ExportRecord, definition_hashes, first_file_difference, sha256_file

_KINDS = {"hf": "an HF folder", "run": "a training run", "maxtext": "a MaxText checkpoint"}
CARD_FILE = "README.md"  # the model card push writes into the repository
_SKIPPED_DIRS = {".git", ".cache"}  # what upload_folder leaves out by default (.git, .cache/huggingface)


def source_mismatch(export_dir: str, record: ExportRecord, source: Checkpoint) -> str | None:
    """None if `source` is the export's recorded source, else one line naming the first difference."""
    where = ExportRecord.path(export_dir)
    recorded = record.source
    name = recorded.name
    if recorded.kind == "maxtext":
        return (
            f"{where}: the export was made from the MaxText checkpoint {name!r}, which validate cannot "
            f"open; the weight files of the HF --source {source.path} cannot be compared with the recorded ones"
        )
    if source.kind != recorded.kind:
        return (
            f"{source.path}: {_KINDS.get(source.kind, source.kind)}, but {where} records the source "
            f"{name!r} as {_KINDS.get(recorded.kind, recorded.kind)}"
        )
    if source.step != recorded.step:
        return f"{source.path}: step {source.step}, but {where} records the source {name!r} at step {recorded.step}"
    actual = {os.path.relpath(f, source.path): f for f in source.weight_files}
    for rel, digest in sorted(recorded.files.items()):  # the recorded files first, then any extra one
        if rel not in actual:
            return (
                f"{os.path.join(source.path, rel)}: missing; {where} records it among the weight files "
                f"of the source {name!r}"
            )
        if sha256_file(actual[rel]) != digest:
            return (
                f"{actual[rel]}: sha256 differs from the one {where} records for the source {name!r}"
                + _first_tensor(actual[rel], record)
            )
    for rel in sorted(set(actual) - set(recorded.files)):
        return f"{actual[rel]}: a weight file {where} does not record for the source {name!r}"
    return _definition_mismatch(where, recorded, source)


def _definition_mismatch(where: str, recorded, source: Checkpoint) -> str | None:
    """The first of the source's defining files besides its weights (config.json, generation
    settings, tokenizer files) that is not as the record states (records written before these
    were bound state none: nothing to compare)."""
    if recorded.config_files is None:
        return None
    found = first_file_difference(recorded.config_files, definition_hashes(source))
    if found is None:
        return None
    rel, how = found
    path = os.path.join(source.path, rel)
    what = f"the source {recorded.name!r}"
    return {
        "missing": f"{path}: missing; {where} records it among the files that define {what} with its weights",
        "extra": f"{path}: a file that defines the model, which {where} does not record for {what}",
        "differs": f"{path}: sha256 differs from the one {where} records for {what} (it defines the "
        "model with the weights: another config, generation settings or tokenizer)",
    }[how]


def reference_mismatch(fp8_dir: str, record: ExportRecord) -> str | None:
    """None if the FP8 export `fp8_dir` records the same source weights as `record` (or records
    nothing), else one line naming the first weight file they disagree on."""
    if not ExportRecord.exists(fp8_dir):
        return None
    theirs, ours = ExportRecord.read(fp8_dir).source, record.source
    if not (theirs.files or ours.files):
        return None
    found = first_file_difference(ours.files, theirs.files)
    if found is None and (theirs.kind, theirs.step) == (ours.kind, ours.step):
        return None
    what = (
        f"weight file {found[0]}"
        if found is not None
        else f"{theirs.kind} at step {theirs.step}, the export's {ours.kind} at step {ours.step}"
    )
    return f"{ExportRecord.path(fp8_dir)}: its source {theirs.name!r} differs from the export's {ours.name!r} ({what})"


def validated_files(export_dir: str) -> dict[str, str]:
    """{absolute file: sha256} of every file of the export that push uploads, without the reports
    validate writes (validation.json, validation.md, the PNGs), those eval writes (eval.json, ...) and
    the model card push makes."""
    from nvfp4tool.records.evaluation import EVAL_FILES
    from nvfp4tool.validate.report import REPORT_FILES

    skip = {*REPORT_FILES, *EVAL_FILES, CARD_FILE}
    return {
        os.path.join(export_dir, *rel.split("/")): sha256_file(os.path.join(export_dir, *rel.split("/")))
        for rel in sorted(upload_files(export_dir))
        if rel not in skip
    }


def upload_files(folder: str) -> dict[str, int]:
    """Path in repo (POSIX) -> size, for every file `push` (huggingface_hub's upload_folder) would send."""
    files = {}
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS)
        for name in names:
            path = os.path.join(root, name)
            files[os.path.relpath(path, folder).replace(os.sep, "/")] = os.path.getsize(path)
    return files


def _first_tensor(file: str, record: ExportRecord) -> str:
    """ " (tensor NAME differs from the export's copy)" for the first tensor of `file` that the export
    stored as it is in the source (same dtype and shape) and whose bytes differ; "" if none."""
    for entry in read_safetensors_header(file).values():
        stored = record.tensors.get(entry.name)
        if (
            stored is None
            or stored.amax is not None
            or stored.dtype != entry.code
            or tuple(stored.shape) != tuple(entry.shape)
        ):
            continue
        with open(file, "rb") as f:
            f.seek(entry.start)
            digest = hashlib.sha256(f.read(entry.nbytes)).hexdigest()
        if digest != stored.sha256:
            return f" (tensor {entry.name} differs from the export's copy)"
    return ""
