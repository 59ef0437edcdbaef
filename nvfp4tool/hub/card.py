"""The model card (README.md) of a published export: Hub metadata, what was quantized, the proof.

    card = build_model_card(folder, report, repo_id="org/llama-nvfp4", validation=validation)

Sections: YAML metadata (`huggingface_hub.ModelCardData`: base_model, base_model_relation:
quantized, library_name, pipeline_tag, tags, license), what was quantized and what kept in
BF16 (from the check report and the configs), the validation table (`validation.md` as written
by `nvfp4tool validate`, else the metrics of its `ValidationRecord`), the recipe and provenance
(the typed `ExportRecord`, `nvfp4tool_export.json`), and how to serve it (vLLM / transformers for compressed-tensors;
vLLM / TensorRT-LLM / SGLang for ModelOpt).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from huggingface_hub import ModelCardData

from nvfp4tool import formats
from nvfp4tool.config import read_hf_config
from nvfp4tool.records.export import ExportRecord
from nvfp4tool.records.names import portable_name, source_repo_id
from nvfp4tool.records.validation import ValidationRecord
from nvfp4tool.validate.report import VALIDATION_MD

# library_name per format: compressed-tensors checkpoints load in transformers; ModelOpt ones do not.
LIBRARY_NAME = {"compressed-tensors": "transformers", "modelopt": "modelopt"}
_QUANT_TAGS = {"nvfp4": ["nvfp4", "fp4", "w4a4"], "nvfp4-weight-only": ["nvfp4", "fp4", "w4a16"],
               "fp8": ["fp8", "w8a8"]}
_QUANT_TEXT = {"nvfp4": "NVFP4 weights and activations (W4A4)",
               "nvfp4-weight-only": "NVFP4 weights, BF16 activations (W4A16)",
               "fp8": "FP8 E4M3 weights and activations, per-tensor scales (W8A8)"}


def build_model_card(folder: str, report: Any, *, repo_id: str, validation: ValidationRecord | None,
                     base_model: str | None = None, license: str | None = None) -> str:
    """README.md text for the export in `folder`, checked as `report` (a check.CheckReport).

    `base_model` / `license` override what the provenance record and the source folder say;
    `validation` is the export's validation record (None: published without validation)."""
    layout = formats.describe(folder)
    provenance = ExportRecord.read(folder) if ExportRecord.exists(folder) else None
    source_name = provenance.source.name if provenance is not None else ""
    base_model = base_model or source_repo_id(source_name)
    license = license or _source_license(source_name, read_hf_config(folder)[1])
    data = ModelCardData(
        base_model=base_model, base_model_relation="quantized" if base_model else None,
        library_name=LIBRARY_NAME.get(report.format, report.format), pipeline_tag="text-generation",
        tags=[*_QUANT_TAGS.get(report.quant, [report.quant]), report.format, "nvfp4tool"], license=license)
    name = repo_id.split("/")[-1]
    sections = [
        f"# {name}\n\n{_QUANT_TEXT.get(report.quant, report.quant)} export of "
        f"{f'[{base_model}](https://huggingface.co/{base_model})' if base_model else 'a Llama-family model'}"
        f" in the **{report.format}** format, made with nvfp4tool and checked with `nvfp4tool check` "
        f"before upload ({report.tensors_checked} tensors, {len(report.modules)} quantized modules, "
        "no problems found).",
        _quantized_section(report, layout, provenance),
        _validation_section(folder, validation),
        _provenance_section(provenance),
        _serving_section(repo_id, report.format, report.quant),
    ]
    return f"---\n{data.to_yaml()}\n---\n\n" + "\n\n".join(sections) + "\n"


# ---------------------------------------------------------------------------------------- helpers


def _quantized_section(report: Any, layout: formats.FolderLayout, provenance: ExportRecord | None) -> str:
    quantized = _collapse_layers(m.module for m in report.modules)
    kept = list(dict.fromkeys([*layout.exclude, *(provenance.exclude_modules if provenance else ())]))
    lines = ["## What was quantized", "",
             f"{len(report.modules)} linear modules in {_QUANT_TEXT.get(report.quant, report.quant)}, "
             "16-element blocks with FP8 E4M3 block scales and one FP32 global scale per tensor."
             if report.quant != "fp8" else
             f"{len(report.modules)} linear modules in {_QUANT_TEXT['fp8']}.", "",
             "| modules | count |", "|---|---|"]
    lines += [f"| `{pattern}` | {count} |" for pattern, count in quantized]
    lines += ["", "Kept in BF16: embeddings, norms"
              + (", and the excluded modules " + ", ".join(f"`{k}`" for k in _collapse_names(kept))
                 if kept else "") + "."]
    if layout.kv_cache is not None:
        lines += ["", f"KV cache: {layout.kv_cache.upper()} (E4M3) with one calibrated K and one V scale per "
                      "attention layer (amax / 448, keys after RoPE); vLLM applies them with "
                      f"`--kv-cache-dtype {layout.kv_cache}`."]
    return "\n".join(lines)


def _validation_section(folder: str, validation: ValidationRecord | None) -> str:
    if validation is None:
        return ("## Validation\n\nNot validated: published with `--no-validation`. Run "
                "`nvfp4tool validate` against the BF16 and FP8 references before relying on it.")
    verdict = "passed" if validation.passed else "did not pass"
    md_path = os.path.join(folder, VALIDATION_MD)
    if os.path.isfile(md_path):
        with open(md_path, encoding="utf-8") as f:
            table = f.read().strip()
        table = re.sub(r"\A## Validation\s*\n", "", table).strip()  # validate writes its own heading
    else:  # no Markdown beside the JSON: one row per metric of the export vs BF16
        metrics = validation.models.get(validation.quant, {})
        table = "\n".join(["| metric (vs BF16) | value |", "|---|---|",
                           *(f"| {k} | {_fmt_value(v)} |" for k, v in metrics.items())])
    return (f"## Validation\n\n`nvfp4tool validate` {verdict} its thresholds against the BF16 and FP8 "
            f"references (full report: `{ValidationRecord.FILE_NAME}`).\n\n{table}")


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
        ("scale search", provenance.scale_search),
        ("weight block scaling", provenance.weight_block),
        ("input scales from", provenance.input_amax_origin),
        ("calibration", None if calibration is None else
         f"samples {calibration.samples}, seq_len {calibration.seq_len}, sha256 {calibration.sha256}"),
        ("MoE experts", None if calibration is None or not calibration.all_experts else
         f"all-experts calibration; {len(calibration.unrouted_experts)} of {len(calibration.routed_tokens)} "
         f"experts got no routed calibration token"),
    ]
    if provenance.recipe:
        rows.append(("training recipe", json.dumps(provenance.recipe, sort_keys=True)))
    errors = [layer.rel_l2 for layer in provenance.layers.values()]
    if errors:
        rows.append(("weight rel. L2 error", f"mean {sum(errors) / len(errors):.4g}, max {max(errors):.4g} "
                                             f"over {len(errors)} layers"))
    body = "\n".join(f"| {k} | {v} |" for k, v in rows if v not in (None, ""))
    return ("## Recipe and provenance\n\n| | |\n|---|---|\n" + body +
            f"\n\nThe full record, with the sha256 of every source weight file and written tensor, is "
            f"`{ExportRecord.FILE_NAME}`.")


def _serving_section(repo_id: str, fmt: str, quant: str) -> str:
    if fmt == "compressed-tensors":
        return ("## How to serve it\n\nvLLM (compressed-tensors; native W4A4 on Blackwell, weight-only "
                "Marlin fallback on Hopper/Ampere):\n\n"
                f"```bash\nvllm serve {repo_id}\n```\n\n"
                "transformers (with `compressed-tensors` installed; decompresses to BF16, runs on CPU):\n\n"
                "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
                f"model = AutoModelForCausalLM.from_pretrained(\"{repo_id}\")\n"
                f"tokenizer = AutoTokenizer.from_pretrained(\"{repo_id}\")\n```")
    vllm_quant = "modelopt" if quant == "fp8" else "modelopt_fp4"
    return ("## How to serve it\n\nModelOpt unified checkpoint (not loadable by transformers; "
            "`nvfp4tool convert-format DIR OUT --to compressed-tensors` converts it losslessly).\n\n"
            f"vLLM:\n\n```bash\nvllm serve {repo_id} --quantization {vllm_quant}\n```\n\n"
            f"TensorRT-LLM:\n\n```bash\ntrtllm-serve {repo_id}\n```\n\n"
            f"SGLang:\n\n```bash\npython -m sglang.launch_server --model-path {repo_id} "
            f"--quantization {vllm_quant}\n```")


def _source_license(source_name: str, config: dict) -> str | None:
    """`license` from the source folder's README.md metadata (the folder the record names, relative
    to the working directory), else from config.json, else None."""
    readme = os.path.join(source_name, "README.md") if source_name else ""
    if readme and os.path.isfile(readme):
        from huggingface_hub import metadata_load

        try:
            license = (metadata_load(readme) or {}).get("license")
        except Exception:  # an unreadable source card is not a reason to refuse the push
            license = None
        if isinstance(license, str):
            return license
    license = config.get("license")
    return license if isinstance(license, str) else None


def _collapse_layers(names: Any) -> list[tuple[str, int]]:
    """model.layers.1.mlp.up_proj, model.layers.2.mlp.up_proj -> [("model.layers.{1,2}.mlp.up_proj", 2)]."""
    layers: dict[str, list[str]] = {}
    for name in names:
        match = re.search(r"\.(\d+)\.", name)
        pattern = name if match is None else name[:match.start()] + ".{}." + name[match.end():]
        layers.setdefault(pattern, []).append(match.group(1) if match else "")
    return [(p if "{}" not in p else p.replace("{}", "{" + ",".join(ids) + "}" if len(ids) > 1 else ids[0]),
             len(ids)) for p, ids in layers.items()]


def _collapse_names(names: list[str]) -> list[str]:
    return [p for p, _ in _collapse_layers(names)]


def _fmt_value(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
