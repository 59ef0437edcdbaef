"""The API of the stages that prove an export: `check`, `validate`, `evaluate`.

Each returns its report whether it passes or not (`.ok`, `.record.passed`): the CLI turns a
failure into exit 1, a Python caller decides. Bad arguments raise NVFP4UsageError.
Design notes: docs/design/cli.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Annotated, Any

from nvfp4tool import memory
from nvfp4tool.api.rules import COUNT, FILE, FOLDER, NEW_FILE, SEQ_LEN, OneOf, OneOfOrFolder, Range, checked, default
from nvfp4tool.check import CheckReport, check_checkpoint
from nvfp4tool.errors import NVFP4UsageError
from nvfp4tool.eval.evaluate import EvalOptions, EvalRun, evaluate_export
from nvfp4tool.validate.runner import ValidateOptions, ValidationRun, validate_export

_VALIDATE = ValidateOptions(data="")  # the validate defaults (data has none)
_EVAL = EvalOptions(tasks=())  # the eval defaults (tasks have none)
_AT_LEAST_0 = Range(low=0)
_FRACTION = Range(low=0, high=1)


@checked
def check(
    path: Annotated[str, FOLDER],
    *,
    tp: Iterable[int] = default(check_checkpoint, "tp"),
    json_out: Annotated[str | None, NEW_FILE] = None,
) -> CheckReport:
    """`nvfp4tool check PATH`: the serving checkpoint's problems and quantized modules for the
    tensor-parallel degrees `tp`; the JSON report also written to `json_out` when given."""
    from nvfp4tool.records.base import write_json

    report = check_checkpoint(path, tp=tp)
    if json_out:
        write_json(json_out, report.to_dict(), indent=2)
    return report


@checked
def validate(
    export: Annotated[str, FOLDER],
    *,
    data: Annotated[str, FILE],
    reference: Annotated[str, OneOfOrFolder(("fp8", "bf16"))] = _VALIDATE.reference,
    source: str | None = _VALIDATE.source,
    source_mismatch_ok: bool = _VALIDATE.source_mismatch_ok,
    calib_data: Annotated[str | None, FILE] = _VALIDATE.calib_data,
    calib_samples: Annotated[int, COUNT] = _VALIDATE.calib_samples,
    calib_seq_len: Annotated[int, SEQ_LEN] = _VALIDATE.calib_seq_len,
    json_copy: Annotated[str | None, NEW_FILE] = None,
    force: bool = False,
    samples: Annotated[int, COUNT] = _VALIDATE.samples,
    seq_len: Annotated[int, SEQ_LEN] = _VALIDATE.seq_len,
    batch_size: Annotated[int, COUNT] = _VALIDATE.batch_size,
    prompts: Annotated[int, COUNT] = _VALIDATE.prompts,
    prompt_len: Annotated[int, COUNT] = _VALIDATE.prompt_len,
    gen_tokens: Annotated[int, COUNT] = _VALIDATE.gen_tokens,
    # the limits: None takes the export's quant's default (`validate.thresholds.defaults_for`)
    max_kl_mean: Annotated[float | None, _AT_LEAST_0] = None,
    max_kl_p99: Annotated[float | None, _AT_LEAST_0] = None,
    min_top1: Annotated[float | None, _FRACTION] = None,
    max_ppl_increase: Annotated[float | None, _AT_LEAST_0] = None,
    min_layer_sqnr: Annotated[float | None, Range()] = None,
    offload: Annotated[str, OneOf(memory.OFFLOAD_MODES)] = _VALIDATE.offload,
    sensitivity: bool = False,
    kl_target: Annotated[float, Range(low=0, low_open=True)] = 0.01,
) -> ValidationRun:
    """`nvfp4tool validate EXPORT --data FILE`: the export against its BF16 source and an FP8
    reference; writes validation.json / .md and the plots into `export`. The run's `.record` is the
    ValidationRecord (`.passed`, `.failures`, `.models`); with `sensitivity`, `.record.sensitivity`
    holds the layers to keep in BF16 for `kl_target` (also written to EXPORT/keep_bf16.txt)."""
    options = ValidateOptions(
        data=data,
        reference=reference,
        source=source,
        samples=samples,
        seq_len=seq_len,
        batch_size=batch_size,
        prompts=prompts,
        prompt_len=prompt_len,
        gen_tokens=gen_tokens,
        offload=offload,
        source_mismatch_ok=source_mismatch_ok,
        calib_data=calib_data,
        calib_samples=calib_samples,
        calib_seq_len=calib_seq_len,
        limits={
            field: value
            for field, value in (
                ("max_kl_mean", max_kl_mean),
                ("max_kl_p99", max_kl_p99),
                ("min_top1", min_top1),
                ("max_ppl_increase", max_ppl_increase),
                ("min_layer_sqnr_db", min_layer_sqnr),
            )
            if value is not None
        },
    )
    return validate_export(
        export, options, json_copy=json_copy, kl_target=kl_target if sensitivity else None, force=force
    )


@checked
def evaluate(
    export: Annotated[str, FOLDER],
    *,
    tasks: str | Sequence[str],
    reference: Annotated[str | None, FOLDER] = _EVAL.reference,
    source: Annotated[str | None, FOLDER] = _EVAL.source,
    limit: Annotated[int | None, COUNT] = _EVAL.limit,
    seed: Annotated[int, Range(low=0, high=2**32 - 1, integer=True)] = _EVAL.seed,
    max_drop: Annotated[float | None, _FRACTION] = _EVAL.max_drop,
    max_drop_fp8: Annotated[float | None, _FRACTION] = _EVAL.max_drop_fp8,
    num_fewshot: Annotated[int | None, Range(low=0, integer=True)] = _EVAL.num_fewshot,
    batch_size: Annotated[int, COUNT] = _EVAL.batch_size,
    max_length: Annotated[int, SEQ_LEN] = _EVAL.max_length,
    max_gen_toks: Annotated[int, COUNT] = _EVAL.max_gen_toks,
    gen_kwargs: Mapping[str, Any] | None = _EVAL.gen_kwargs,
    samples: Annotated[int, COUNT] = _EVAL.samples,
    offload: Annotated[str, OneOf(memory.OFFLOAD_MODES)] = _EVAL.offload,
    chat_template: bool = _EVAL.chat_template,
    json_copy: Annotated[str | None, NEW_FILE] = None,
    force: bool = False,
) -> EvalRun:
    """`nvfp4tool eval EXPORT --tasks ...`: the same lm-eval tasks on BF16, FP8 and NVFP4, paired
    item by item; `tasks` is a list or a comma-separated text. The run's `.record` is the EvalRecord
    (`.passed`, `.failures`, `.tasks`); eval.json / .md / .png and eval_items.json go into `export`."""
    from nvfp4tool.eval.gen_settings import check as check_gen_kwargs

    names = tuple(t.strip() for t in (tasks.split(",") if isinstance(tasks, str) else tasks) if t.strip())
    if not names:
        raise NVFP4UsageError("--tasks: no task given")
    options = EvalOptions(
        tasks=names,
        reference=reference,
        source=source,
        limit=limit,
        seed=seed,
        max_drop=max_drop,
        max_drop_fp8=max_drop_fp8,
        batch_size=batch_size,
        max_length=max_length,
        max_gen_toks=max_gen_toks,
        num_fewshot=num_fewshot,
        offload=offload,
        chat_template=chat_template,
        gen_kwargs=None if gen_kwargs is None else check_gen_kwargs(gen_kwargs, "gen_kwargs"),
        samples=samples,
    )
    return evaluate_export(export, options, json_copy=json_copy, force=force)
