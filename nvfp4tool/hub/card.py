"""The model card (README.md) of a published export: Hub metadata, what was quantized and how, the proof.

    base_model, license = card_identity(folder)          # what the metadata will say (None: unknown)
    card = build_model_card(folder, report, repo_id="org/llama-nvfp4", validation=validation)

Design notes: docs/design/hub.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

from huggingface_hub import ModelCardData

from nvfp4tool import formats
from nvfp4tool.config import read_hf_config
from nvfp4tool.formats import modelopt
from nvfp4tool.records.export import AUTO_PRECISION_PNG, AutoPrecisionRecord, ExportRecord, source_license
from nvfp4tool.records.names import portable_name, source_repo_id
from nvfp4tool.records.validation import ValidationRecord

# library_name per format: compressed-tensors checkpoints load in transformers; ModelOpt ones do not.
LIBRARY_NAME = {"compressed-tensors": "transformers", "modelopt": "modelopt"}


def card_identity(
    folder: str, base_model: str | None = None, license: str | None = None
) -> tuple[str | None, str | None]:
    """(base_model, license) the card's metadata gives: the arguments when set, else the Hub repo id
    the provenance names as the source or, for a local source, the one its config names
    (`_name_or_path`, kept in the export's config.json: an owner/name, not a local path), and the
    license the provenance recorded from the source's README.md / config.json (or, for an older
    record, the source folder's); None where unknown."""
    provenance = _provenance(folder)
    source_name = provenance.source.name if provenance is not None else ""
    config = read_hf_config(folder)[1]
    named = config.get("_name_or_path")
    base_model = (
        base_model or source_repo_id(source_name) or (source_repo_id(named) if isinstance(named, str) else None)
    )
    recorded = provenance.source.license if provenance is not None else None
    license = license or recorded or _source_license(source_name, config)
    return base_model, license


def build_model_card(
    folder: str,
    report: Any,
    *,
    repo_id: str,
    validation: ValidationRecord | None,
    base_model: str | None = None,
    license: str | None = None,
) -> str:
    """README.md text for the export in `folder`, checked as `report` (a check.CheckReport).

    `base_model` / `license` override what the provenance record and the source folder say;
    `validation` is the export's validation record (None: published without validation)."""
    layout = formats.describe(folder)
    spec = layout.spec
    provenance = _provenance(folder)
    base_model, license = card_identity(folder, base_model, license)
    data = ModelCardData(
        base_model=base_model,
        base_model_relation="quantized" if base_model else None,
        library_name=LIBRARY_NAME.get(spec.format, spec.format),
        pipeline_tag="text-generation",
        tags=[*_layout_tags(layout), spec.format, "nvfp4tool"],
        license=license,
    )
    name = repo_id.split("/")[-1]
    model_type = read_hf_config(folder)[1].get("model_type")
    what = f"a `{model_type}` model" if isinstance(model_type, str) else "a model"
    sections = [
        f"# {name}\n\n{_layout_text(layout)} export of "
        f"{f'[{base_model}](https://huggingface.co/{base_model})' if base_model else what}"
        f" in the **{spec.format}** format, made with nvfp4tool and checked with `nvfp4tool check` "
        f"before upload ({report.tensors_checked} tensors, {len(report.modules)} quantized modules, "
        "no problems found).",
        *(
            [_mismatch_banner(validation, provenance)]
            if validation is not None and validation.source_mismatch_ok
            else []
        ),
        _quantized_section(report, layout, provenance),
        _validation_section(validation, provenance),
        *_eval_section(folder),
        _provenance_section(provenance),
        *_auto_precision_section(folder, validation),
        _serving_section(repo_id, layout, layout.kv_cache),
    ]
    return f"---\n{data.to_yaml()}\n---\n\n" + "\n\n".join(sections) + "\n"


def quant_text(spec: formats.LayoutSpec) -> str:
    """What a layout stores, in words: "NVFP4 weights and activations (W4A4)", ..."""
    weights = "NVFP4" if spec.is_nvfp4 else "FP8 E4M3"
    scales = "" if spec.is_nvfp4 else (", 128x128 block scales" if spec.is_fp8_block else ", per-tensor scales")
    activations = "weights and activations" if spec.quantizes_activations else "weights, BF16 activations"
    return f"{weights} {activations}{scales} ({_wa(spec).upper()})"


def quant_tags(spec: formats.LayoutSpec) -> list[str]:
    return [*(["nvfp4", "fp4"] if spec.is_nvfp4 else ["fp8"]), _wa(spec)]


def bits_by_quant(report: Any, layout: formats.FolderLayout) -> dict[str, tuple[int, int, float]]:
    """{quant: (linears, parameters, bits per parameter)} over the quantized linears `report`
    (a check.CheckReport) measured, per quant (each linear's own scheme) and under "all": the
    stored weight and block-scale bits per weight element (NVFP4 4.5, FP8 8)."""
    found: dict[str, list[float]] = {}
    for stats in report.modules:
        if stats.n is None or stats.k is None or stats.bits_per_param is None:
            continue
        spec = layout.spec_for(stats.module) or layout.spec
        for key in (spec.quant, "all"):
            count, params, bits = found.setdefault(key, [0, 0, 0.0])
            found[key] = [count + 1, params + stats.n * stats.k, bits + stats.bits_per_param * stats.n * stats.k]
    return {q: (int(c), int(p), b / p if p else 0.0) for q, (c, p, b) in found.items()}


def fp8_reference_ran(validation: ValidationRecord) -> bool:
    """Whether validate compared against an FP8 reference: its "fp8" column (an FP8 export is
    itself labelled "fp8" and has none)."""
    return validation.quant != "fp8" and "fp8" in validation.models


def threshold_changes(validation: ValidationRecord) -> list[tuple[str, float | None, float | None, str]]:
    """(limit, used, default, "loosened" | "tightened") for each recorded threshold that differs
    from its quant's default (`thresholds.defaults_for`); a `max_` limit is loosened upwards, a
    `min_` one downwards, and a limit turned off is loosened."""
    from nvfp4tool.validate.thresholds import defaults_for

    defaults = dataclasses.asdict(defaults_for(validation.quant))
    changes = []
    for key, default in defaults.items():
        used = validation.thresholds.get(key, default)
        if used == default:
            continue
        if used is None:
            how = "loosened"
        elif default is None:
            how = "tightened"
        else:
            how = "loosened" if (used > default) == key.startswith("max_") else "tightened"
        changes.append((key, used, default, how))
    return changes


# ---------------------------------------------------------------------------------------- helpers


def _provenance(folder: str) -> ExportRecord | None:
    return ExportRecord.read(folder) if ExportRecord.exists(folder) else None


def _layout_text(layout: formats.FolderLayout) -> str:
    """quant_text of a uniform folder; a mixed one's: "Mixed-precision (NVFP4 ... / FP8 ...)"."""
    if not layout.is_mixed:
        return quant_text(layout.spec)
    return "Mixed-precision per linear (" + "; ".join(quant_text(s) for s in layout.specs) + ")"


def _layout_tags(layout: formats.FolderLayout) -> list[str]:
    tags = [t for s in layout.specs for t in quant_tags(s)]
    return list(dict.fromkeys(tags + (["mixed-precision"] if layout.is_mixed else [])))


def _wa(spec: formats.LayoutSpec) -> str:
    """ "w4a4" / "w4a16" / "w8a8": weight bits, activation bits (16: BF16, not quantized)."""
    weight_bits = 4 if spec.is_nvfp4 else 8
    return f"w{weight_bits}a{weight_bits if spec.quantizes_activations else 16}"


def _quantized_section(report: Any, layout: formats.FolderLayout, provenance: ExportRecord | None) -> str:
    spec = layout.spec
    quantized = _collapse_layers(m.module for m in report.modules)
    kept = list(dict.fromkeys([*layout.exclude, *(provenance.exclude_modules if provenance else ())]))
    if spec.is_nvfp4:
        blocks = "16-element blocks with FP8 E4M3 block scales and one FP32 global scale per tensor"
    elif spec.is_fp8_block:
        blocks = "one FP32 scale per 128x128 weight block (8 + 32/16384 bits per parameter)"
    else:
        blocks = "one FP32 scale per tensor"
    if spec.has_input_scales:
        activations = "; activations quantized on the fly with a calibrated per-tensor input scale"
    elif spec.is_fp8_block:
        activations = "; activations quantized on the fly per token per 128 columns (dynamic scales)"
    else:
        activations = "; activations stay BF16 (weight-only, no input scales)"
    lines = ["## What was quantized", ""]
    if layout.is_mixed:
        lines += _mixed_lines(report, layout)
    else:
        lines += [f"{len(report.modules)} linear modules in {quant_text(spec)}, {blocks}{activations}.", ""]
    lines += ["| modules | count |", "|---|---|"]
    lines += [f"| `{pattern}` | {count} |" for pattern, count in quantized]
    lines += [
        "",
        "Kept in BF16: embeddings, norms"
        + (", and the excluded modules " + ", ".join(f"`{k}`" for k in _collapse_names(kept)) if kept else "")
        + ".",
    ]
    if layout.kv_cache is not None:
        lines += [
            "",
            f"KV cache: {layout.kv_cache.upper()} (E4M3) with one calibrated K and one V scale per "
            "attention layer (amax / 448, keys after RoPE); vLLM applies them with "
            f"`--kv-cache-dtype {layout.kv_cache}`.",
        ]
    if provenance is not None:
        lines += ["", "Methods that shaped the bytes: " + "; ".join(_methods(provenance)) + "."]
    return "\n".join(lines)


def _mixed_lines(report: Any, layout: formats.FolderLayout) -> list[str]:
    """A mixed folder's formats: linears, parameters and bits per parameter of each, and overall."""
    found = bits_by_quant(report, layout)
    block = "; fp8-block: one FP32 scale per 128x128 block" if any(s.is_fp8_block for s in layout.specs) else ""
    lines = [
        f"{len(report.modules)} linear modules, each in its own format (NVFP4: 16-element blocks with FP8 "
        f"E4M3 block scales and one FP32 global scale per tensor; FP8: one FP32 scale per tensor{block}):",
        "",
        "| format | linears | parameters | bits per parameter |",
        "|---|---:|---:|---:|",
    ]
    for spec in layout.specs:
        if spec.quant in found:
            count, params, bits = found[spec.quant]
            lines.append(f"| {quant_text(spec)} | {count} | {params:,} | {bits:.3f} |")
    if "all" in found:
        lines += ["", f"Over the quantized linears: {found['all'][2]:.3f} bits per parameter."]
    return lines + [""]


def _weight_blocks(provenance: ExportRecord) -> str:
    if provenance.quant == "fp8-block":
        return "128x128 weight blocks (an fp32 scale each)"
    return f"{'2d (16x16)' if provenance.weight_block == '2d' else '1d (1x16)'} weight blocks"


def _methods(provenance: ExportRecord) -> list[str]:
    """Every choice of the export that changed the written bytes, in words."""
    methods = [
        f"block-scale search {_scale_search(provenance.scale_search)}",
        _weight_blocks(provenance),
        _rounding(provenance),
    ]
    if provenance.quant not in ("nvfp4-weight-only", "fp8-block") and provenance.input_amax_origin:
        methods.append(f"input scales from {provenance.input_amax_origin}")
    if provenance.kv_cache != "none":
        methods.append(f"{provenance.kv_cache.upper()} KV-cache scales calibrated per attention layer")
    if provenance.exclude_modules:
        methods.append(
            f"{len(provenance.exclude_modules)} module(s) kept in BF16 ("
            + ", ".join(f"`{k}`" for k in _collapse_names(list(provenance.exclude_modules)))
            + ")"
        )
    return methods


def _scale_search(scale_search: str) -> str:
    return "none (rtn: each block's scale from its amax)" if scale_search == "rtn" else f"`{scale_search}`"


def _rounding(provenance: ExportRecord) -> str:
    if provenance.weight_rounding != "gptq":
        return "round-to-nearest weight codes"
    gptq = provenance.gptq
    if gptq is None:
        return "GPTQ weight rounding (settings not recorded)"
    return (
        f"GPTQ weight rounding (damp {gptq.damp:g} x mean diag(H), {gptq.block_size}-column blocks, "
        f"act order {gptq.act_order}, block scales {gptq.block_scales}; output error on the calibration inputs "
        f"{gptq.mean_output_err_reduction:.1%} below round-to-nearest's, mean over the linears)"
    )


def _mismatch_banner(validation: ValidationRecord, provenance: ExportRecord | None) -> str:
    exported = (
        f"the export's source `{portable_name(provenance.source.name)}` (nvfp4tool_export.json)"
        if provenance is not None
        else "the source the export was made from"
    )
    return (
        f"> **Validated against another source** (`nvfp4tool validate --source-mismatch-ok`): the numbers "
        f"below measure this export against `{validation.source.name}`, whose weights are not those of "
        f"{exported}."
    )


def _eval_section(folder: str) -> list[str]:
    """The task-accuracy table `nvfp4tool eval` measured (`eval.report.markdown`, the owner of
    that table), when eval.json is present (push's custody has checked it describes these bytes)."""
    from nvfp4tool.eval.report import markdown
    from nvfp4tool.records.evaluation import EvalRecord

    if not EvalRecord.exists(folder):
        return []
    return [
        markdown(EvalRecord.read(folder)).strip() + f"\n\nPer-item scores: `eval_items.json`; full report: "
        f"`{EvalRecord.FILE_NAME}`."
    ]


def _validation_section(validation: ValidationRecord | None, provenance: ExportRecord | None) -> str:
    from nvfp4tool.validate.report import markdown, verdict

    if validation is None:
        return (
            "## Validation\n\nNot validated: published with `--no-validation`. Run "
            "`nvfp4tool validate` against the BF16 source and an FP8 reference before relying on it."
        )
    outcome = "passed" if validation.passed else "did not pass"
    table = re.sub(r"\A## Validation\s*\n", "", markdown(validation)).strip()  # validate writes its own heading
    table = (
        table.replace(verdict(validation), _verdict(validation))
        if verdict(validation) in table
        else table + "\n\n" + _verdict(validation)
    )
    lines = [
        "## Validation",
        "",
        f"`nvfp4tool validate` {outcome} its thresholds, measured against {_references(validation)}. "
        f"Full report: `{ValidationRecord.FILE_NAME}`.",
        "",
    ]
    if validation.source_mismatch_ok:
        lines += [_mismatch_banner(validation, provenance), ""]
    lines += [table, "", _thresholds_table(validation)]
    return "\n".join(lines)


def _references(validation: ValidationRecord) -> str:
    """Exactly the models compared: the BF16 source, and an FP8 reference only when one ran."""
    source = f"the BF16 source `{validation.source.name}`"
    if not fp8_reference_ran(validation):
        return f"{source} only (no FP8 reference was run: `--reference bf16`)"
    named = f" `{validation.reference_export.name}`" if validation.reference_export is not None else ""
    calibrated = (
        f"; its input scales from {validation.reference_calibration}" if validation.reference_calibration else ""
    )
    return f"{source} and the FP8 reference{named} ({validation.reference}{calibrated})"


def _verdict(validation: ValidationRecord) -> str:
    from nvfp4tool.validate.report import verdict

    if not validation.passed:
        return verdict(validation)
    changes = threshold_changes(validation)
    loosened = [c for c in changes if c[3] == "loosened"]
    tightened = [c for c in changes if c[3] == "tightened"]
    if loosened:
        text = "**PASSED** its thresholds, **some loosened from the defaults**: " + "; ".join(
            f"`{k}` {_limit(u)} (default {_limit(d)})" for k, u, d, _ in loosened
        )
    else:
        text = "**PASSED** all thresholds" + (" at their defaults" if not tightened else "")
    if tightened:
        text += (
            (", tightened: " if loosened else " (tightened from the defaults: ")
            + "; ".join(f"`{k}` {_limit(u)} (default {_limit(d)})" for k, u, d, _ in tightened)
            + ("" if loosened else ")")
        )
    return text + "."


def _thresholds_table(validation: ValidationRecord) -> str:
    from nvfp4tool.validate.thresholds import defaults_for

    changed = {k: how for k, _, _, how in threshold_changes(validation)}
    rows = [f"| threshold | used | default for {validation.quant} |", "|---|---:|---:|"]
    for key, default in dataclasses.asdict(defaults_for(validation.quant)).items():
        used = validation.thresholds.get(key, default)
        mark = f" (**{changed[key]}**)" if key in changed else ""
        rows.append(f"| `{key}` | {_limit(used)}{mark} | {_limit(default)} |")
    return "\n".join(rows)


def _limit(value: float | None) -> str:
    return "off" if value is None else f"{value:g}"


def _provenance_section(provenance: ExportRecord | None) -> str:
    if provenance is None:
        return f"## Recipe and provenance\n\nNo provenance record (`{ExportRecord.FILE_NAME}`) in the export."
    source, calibration, tool = provenance.source, provenance.calibration, provenance.tool
    step = f", step {source.step}" if source.step is not None else ""
    rows = [
        ("tool", f"{tool.name} {tool.version}"),
        # a Hub repo id, else only the folder name: the card publishes no local path
        ("source", f"{portable_name(source.name)} ({source.kind}{step})"),
        ("format / quant", f"{provenance.format} / {provenance.quant}"),
        ("block-scale search", _scale_search(provenance.scale_search)),
        ("weight rounding", _rounding(provenance)),
        ("weight block scaling", "128x128" if provenance.quant == "fp8-block" else provenance.weight_block),
        ("input scales from", provenance.input_amax_origin),
        (
            "KV cache",
            None
            if provenance.kv_cache == "none"
            else f"{provenance.kv_cache.upper()} E4M3, one K and one V scale (amax / 448) per attention layer, "
            f"{len(provenance.kv_amax or {})} layers calibrated",
        ),
        ("kept in BF16", ", ".join(f"`{k}`" for k in _collapse_names(list(provenance.exclude_modules))) or "none"),
        (
            "calibration",
            None
            if calibration is None
            else f"{calibration.file}: samples {calibration.samples}, seq_len {calibration.seq_len}, "
            f"sha256 {calibration.sha256}",
        ),
        (
            "MoE experts",
            None
            if calibration is None or not calibration.all_experts
            else f"all-experts calibration; {len(calibration.unrouted_experts)} of {len(calibration.routed_tokens)} "
            f"experts got no routed calibration token",
        ),
    ]
    if provenance.recipe:
        rows.append(("training recipe", json.dumps(provenance.recipe, sort_keys=True)))
    errors = [layer.rel_l2 for layer in provenance.layers.values()]
    if errors:
        rows.append(
            (
                "weight rel. L2 error",
                f"mean {sum(errors) / len(errors):.4g}, max {max(errors):.4g} over {len(errors)} layers",
            )
        )
    body = "\n".join(f"| {k} | {v} |" for k, v in rows if v not in (None, ""))
    return (
        "## Recipe and provenance\n\n| | |\n|---|---|\n"
        + body
        + f"\n\nThe full record, with the sha256 of every source weight file and written tensor, is "
        f"`{ExportRecord.FILE_NAME}`."
    )


def _auto_precision_section(folder: str, validation: ValidationRecord | None) -> list[str]:
    """An `export --auto-precision` export: what the search aimed at and reached, its record and
    curve files, and the held-out KL beside it ([] for any other export)."""
    if not os.path.exists(AutoPrecisionRecord.path(folder)):
        return []
    found = AutoPrecisionRecord.read(folder)
    last = found.steps[-1]
    kv = f" with its FP8 KV cache (alone: KL {found.kv_cache_kl:.4g})" if found.kv_cache else ""
    text = (
        f"## Formats chosen by `--auto-precision {found.kl_target:g}`\n\n"
        f"Each linear's format (from {', '.join(found.ladder)}; a fused group as one) was searched for the fewest "
        f"bits per weight whose mean KL vs BF16 on {found.windows[0]} x {found.windows[1]} calibration tokens, "
        f"the mix run as served{kv}, is <= {found.margin:g} x {found.kl_target:g}: reached {last.measured_kl:.4g} at "
        f"{last.bits_per_weight:.3f} bits per weight over the quantized linears ({len(found.steps)} mixes measured). "
        f"The search is `{AutoPrecisionRecord.FILE_NAME}` (each unit's KL per format, each step), its KL-vs-bits "
        f"curve `{AUTO_PRECISION_PNG}`; neither holds weights."
    )
    if validation is not None and validation.labels:
        label = validation.searched_as(found.kv_cache)
        text += f" On the held-out validation text the KL mean ({label}) is {validation.models[label]['kl_mean']:.4g}."
    return [text]


def _serving_section(repo_id: str, layout: formats.FolderLayout, kv_cache: str | None) -> str:
    """How to serve what this layout stores (W4A4 / W4A16 / W8A8 from the spec; a mixed folder's
    per linear)."""
    kv_flag = f" --kv-cache-dtype {kv_cache}" if kv_cache else ""
    spec = layout.spec
    if layout.is_mixed:
        return _mixed_serving(repo_id, layout, kv_flag)
    if spec.is_nvfp4 and spec.has_input_scales:
        kernels = (
            "NVFP4 W4A4: FP4 tensor-core GEMMs on Blackwell; on Hopper/Ampere the weights run through "
            "weight-only FP4 Marlin kernels with BF16 activations"
        )
    elif spec.is_nvfp4:
        kernels = (
            "NVFP4 W4A16: weight-only FP4 Marlin kernels, activations in BF16 on every GPU; no FP4 "
            "activation GEMMs, also on Blackwell"
        )
    elif spec.is_fp8_block:
        kernels = (
            "FP8 W8A8 with 128x128 weight blocks and dynamic per-token-group activations: "
            "block-scaled FP8 GEMMs (CUTLASS / DeepGEMM / Triton) on Ada, Hopper and Blackwell"
        )
    else:
        kernels = "FP8 W8A8 per tensor: FP8 GEMMs on Ada, Hopper and Blackwell; weight-only FP8 Marlin on Ampere"
    if spec.format == "compressed-tensors":
        return (
            f"## How to serve it\n\nvLLM (compressed-tensors; {kernels}):\n\n"
            f"```bash\nvllm serve {repo_id}{kv_flag}\n```\n\n"
            "transformers (with `compressed-tensors` installed; decompresses to BF16, runs on CPU):\n\n"
            "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            f'model = AutoModelForCausalLM.from_pretrained("{repo_id}")\n'
            f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")\n```'
        )
    algo = modelopt.QUANT_ALGO[spec.quant]
    convert = "`nvfp4tool convert-format DIR OUT --to compressed-tensors` converts it losslessly"
    if not spec.has_input_scales and spec.is_nvfp4:
        return (
            f"## How to serve it\n\nModelOpt unified checkpoint, `quant_algo: {algo}` (not loadable by "
            f"transformers). vLLM's ModelOpt loader reads `{modelopt.QUANT_ALGO['nvfp4']}` (W4A4) and "
            f"`{modelopt.QUANT_ALGO['fp8']}` checkpoints, not this weight-only one: to serve it with vLLM, "
            f"convert it losslessly and serve the copy (vLLM compressed-tensors; {kernels}):\n\n"
            f"```bash\nnvfp4tool convert-format DIR OUT --to compressed-tensors\nvllm serve OUT{kv_flag}\n```"
        )
    if spec.is_fp8_block:
        return (
            f"## How to serve it\n\nModelOpt unified checkpoint, `quant_algo: {algo}` ({kernels}: vLLM's ModelOpt "
            f"loader runs FP8_PB_WO so, despite the name's weight-only). Not loadable by transformers: {convert}.\n\n"
            f"vLLM:\n\n```bash\nvllm serve {repo_id} --quantization modelopt{kv_flag}\n```"
        )
    vllm_quant = "modelopt_fp4" if spec.is_nvfp4 else "modelopt"
    return (
        f"## How to serve it\n\nModelOpt unified checkpoint, `quant_algo: {algo}` ({kernels}). Not "
        f"loadable by transformers: {convert}.\n\n"
        f"vLLM:\n\n```bash\nvllm serve {repo_id} --quantization {vllm_quant}{kv_flag}\n```\n\n"
        f"TensorRT-LLM:\n\n```bash\ntrtllm-serve {repo_id}\n```\n\n"
        f"SGLang:\n\n```bash\npython -m sglang.launch_server --model-path {repo_id} "
        f"--quantization {vllm_quant}\n```"
    )


def _mixed_serving(repo_id: str, layout: formats.FolderLayout, kv_flag: str) -> str:
    """A mixed folder: the engines pick each linear's kernels by its scheme."""
    formats_named = ", ".join(f"{_wa(s).upper()} ({s.quant})" for s in layout.specs)
    if layout.format == "compressed-tensors":
        return (
            f"## How to serve it\n\nvLLM (compressed-tensors `format: mixed-precision`; each linear's "
            f"config group picks its kernels: {formats_named}):\n\n```bash\nvllm serve {repo_id}{kv_flag}\n```\n\n"
            "transformers (with `compressed-tensors` installed; decompresses to BF16, runs on CPU):\n\n"
            "```python\nfrom transformers import AutoModelForCausalLM\n\n"
            f'model = AutoModelForCausalLM.from_pretrained("{repo_id}")\n```'
        )
    return (
        f"## How to serve it\n\nModelOpt unified checkpoint, `quant_algo: {modelopt.MIXED_ALGO}` with "
        f"`quantized_layers` naming each linear's algo ({formats_named}); vLLM's ModelOpt mixed-precision "
        f"loader reads it. Not loadable by transformers: `nvfp4tool convert-format DIR OUT --to "
        f"compressed-tensors` converts it losslessly.\n\n```bash\nvllm serve {repo_id}{kv_flag}\n```"
    )


def _source_license(source_name: str, config: dict) -> str | None:
    """`license` of the source folder the record names (relative to the working directory) as
    `records.export.source_license` reads it, else from the export's config.json, else None."""
    if source_name and os.path.isdir(source_name):
        found = source_license(source_name)
        if found is not None:
            return found
    license = config.get("license")
    return license if isinstance(license, str) else None


def _collapse_layers(names: Any) -> list[tuple[str, int]]:
    """model.layers.1.mlp.up_proj, model.layers.2.mlp.up_proj -> [("model.layers.{1,2}.mlp.up_proj", 2)]."""
    layers: dict[str, list[str]] = {}
    for name in names:
        match = re.search(r"\.(\d+)\.", name)
        pattern = name if match is None else name[: match.start()] + ".{}." + name[match.end() :]
        layers.setdefault(pattern, []).append(match.group(1) if match else "")
    return [
        (p if "{}" not in p else p.replace("{}", "{" + ",".join(ids) + "}" if len(ids) > 1 else ids[0]), len(ids))
        for p, ids in layers.items()
    ]


def _collapse_names(names: list[str]) -> list[str]:
    return [p for p, _ in _collapse_layers(names)]
