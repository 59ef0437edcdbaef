"""The model card tells the truth about what ran (`nvfp4tool/hub/card.py`), and push's chain of
custody lets the honest cases through (`nvfp4tool/hub/custody.py`; the refusals are
tests/hub/test_adversarial_push.py).

Card: exactly the references validate ran (a `--reference bf16` run never reads "BF16 and FP8"),
every threshold with the ones that differ from its quant's defaults marked and a verdict that
says when limits were loosened, GPTQ and its settings named, the FP8 KV cache and the BF16 layers
listed, serving described for the quant actually exported (W4A16 and FP8 are not offered W4A4
kernels), `source_mismatch_ok` shown at the top; push warns once each when the card has no
base_model or no license. Exports are the tiny synthetic ones of tests/hub/test_push.py, validated by
`bind_validation` (a record as validate writes it), pushed with --dry-run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

import yaml
from click.testing import CliRunner
from test_push import REPO, _write_export, bind_validation

from nvfp4tool.cli import cli
from nvfp4tool.hub import PushOptions, push_checkpoint
from nvfp4tool.records.export import ExportRecord, GPTQRecord
from nvfp4tool.records.validation import Named
from nvfp4tool.validate.thresholds import defaults_for

DEFAULTS = defaults_for("nvfp4")  # the W4A4 exports these cards are written for
FP8_METRICS = {
    "kl_mean": 0.001,
    "kl_p99": 0.01,
    "top1": 0.99,
    "ppl": 9.51,
    "ppl_increase": 0.001,
    "logit_max_err": 0.1,
    "logit_mean_err": 0.001,
}


def _push(folder, **options):
    lines: list[str] = []
    result = push_checkpoint(
        folder, PushOptions(repo_id=REPO, dry_run=True, **options), echo=lines.append, warn=lines.append
    )
    return result.card, lines


def _section(card, title):
    return card.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


# ---------------------------------------------------------------------------------------- references


def test_bf16_only_run_never_claims_an_fp8_reference(tmp_path):
    folder = _write_export(tmp_path / "e", "compressed-tensors")
    card, _ = _push(folder)
    validation = _section(card, "Validation")
    assert "measured against the BF16 source `meta-llama/Llama-3.2-1B` only (no FP8 reference was run" in validation
    assert "FP8 reference " not in validation.replace("no FP8 reference was run", "")
    assert "BF16 and FP8" not in card


def test_fp8_reference_is_named_with_how_it_was_made(tmp_path):
    folder = _write_export(tmp_path / "e", "compressed-tensors")
    record = bind_validation(folder, reference="fp8 (exported on the fly from the source)")
    bind_validation(folder, reference=record.reference, models={**record.models, "fp8": FP8_METRICS})
    card, _ = _push(folder)
    assert (
        "measured against the BF16 source `meta-llama/Llama-3.2-1B` and the FP8 reference "
        "(fp8 (exported on the fly from the source))"
    ) in card
    bind_validation(
        folder,
        reference="fp8 export",
        models={**record.models, "fp8": FP8_METRICS},
        reference_export=Named("l-fp8", {"model.safetensors": "3" * 64}),
    )
    card, _ = _push(folder)
    assert "and the FP8 reference `l-fp8` (fp8 export)" in card
    what = "the export's input amax (calibrated on `calib.npy`)"
    bind_validation(
        folder, reference=record.reference, models={**record.models, "fp8": FP8_METRICS}, reference_calibration=what
    )
    card, _ = _push(folder)
    assert f"(fp8 (exported on the fly from the source); its input scales from {what})" in card
    assert f"reference: {record.reference}; its input scales from {what}" in _section(card, "Validation")


# ---------------------------------------------------------------------------------------- thresholds


def test_defaults_pass_says_so_and_lists_every_threshold(tmp_path):
    folder = _write_export(tmp_path / "e", "compressed-tensors")
    card, _ = _push(folder)
    assert "**PASSED** all thresholds at their defaults." in card
    for key, value in dataclasses.asdict(DEFAULTS).items():
        shown = "off" if value is None else f"{value:g}"
        assert f"| `{key}` | {shown} | {shown} |" in card


def test_loosened_thresholds_are_marked_and_the_verdict_says_so(tmp_path):
    folder = _write_export(tmp_path / "e", "compressed-tensors")
    loose_kl = DEFAULTS.max_kl_mean * 5
    bind_validation(
        folder, thresholds={**dataclasses.asdict(DEFAULTS), "max_kl_mean": loose_kl, "min_layer_sqnr_db": None}
    )
    card, _ = _push(folder)
    assert "PASSED all thresholds" not in card
    assert (
        f"**PASSED** its thresholds, **some loosened from the defaults**: `max_kl_mean` {loose_kl:g} "
        f"(default {DEFAULTS.max_kl_mean:g}); `min_layer_sqnr_db` off (default {DEFAULTS.min_layer_sqnr_db:g})."
    ) in card
    assert f"| `max_kl_mean` | {loose_kl:g} (**loosened**) | {DEFAULTS.max_kl_mean:g} |" in card
    assert f"| `min_layer_sqnr_db` | off (**loosened**) | {DEFAULTS.min_layer_sqnr_db:g} |" in card
    assert f"| `max_kl_p99` | {DEFAULTS.max_kl_p99:g} | {DEFAULTS.max_kl_p99:g} |" in card  # unchanged: unmarked


def test_defaults_are_the_exports_quants(tmp_path):
    """An FP8 export is judged, and its card compared, by FP8's defaults (KL mean 0.1), a W4A4 one by
    W4A4's (0.25): the same limit reads "loosened" on one card and "at the defaults" on the other."""
    assert defaults_for("fp8").max_kl_mean == 0.1 and DEFAULTS.max_kl_mean == 0.25
    fp8 = _write_export(tmp_path / "fp8", "compressed-tensors", quant="fp8")
    bind_validation(fp8, thresholds={**dataclasses.asdict(defaults_for("fp8")), "max_kl_mean": 0.25})
    card, _ = _push(fp8)
    assert "| threshold | used | default for fp8 |" in card
    assert "| `max_kl_mean` | 0.25 (**loosened**) | 0.1 |" in card
    nvfp4 = _write_export(tmp_path / "nvfp4", "compressed-tensors")
    card, _ = _push(nvfp4)
    assert "| `max_kl_mean` | 0.25 | 0.25 |" in card and "**PASSED** all thresholds at their defaults." in card


def test_tightened_thresholds_are_marked_as_tightened(tmp_path):
    folder = _write_export(tmp_path / "e", "compressed-tensors")
    bind_validation(
        folder, thresholds={**dataclasses.asdict(DEFAULTS), "min_top1": 0.5, "max_kl_p99": DEFAULTS.max_kl_p99 / 2}
    )
    card, _ = _push(folder)
    assert (
        "**PASSED** all thresholds (tightened from the defaults: `max_kl_p99` "
        f"{DEFAULTS.max_kl_p99 / 2:g} (default {DEFAULTS.max_kl_p99:g}); `min_top1` 0.5 (default off))."
    ) in card
    assert "| `min_top1` | 0.5 (**tightened**) | off |" in card and "loosened" not in card


# ---------------------------------------------------------------------------------------- methods


def _edit_provenance(folder, **changes):
    dataclasses.replace(ExportRecord.read(folder), **changes).write(folder)
    bind_validation(folder)  # validated after the edit


def test_gptq_export_names_gptq_and_its_settings(tmp_path):
    folder = _write_export(tmp_path / "e", "compressed-tensors")
    _edit_provenance(
        folder,
        weight_rounding="gptq",
        gptq=GPTQRecord(
            damp=0.05,
            block_size=128,
            act_order="static: 16-column blocks by descending sum of diag(H)",
            mean_output_err_reduction=0.25,
        ),
    )
    card, _ = _push(folder)
    provenance = _section(card, "Recipe and provenance")
    assert (
        "| weight rounding | GPTQ weight rounding (damp 0.05 x mean diag(H), 128-column blocks, act order "
        "static: 16-column blocks by descending sum of diag(H), block scales original; output error on the "
        "calibration inputs "
        "25.0% below round-to-nearest's, mean over the linears) |"
    ) in provenance
    assert "| block-scale search | none (rtn: each block's scale from its amax) |" in provenance
    assert "| scale search | rtn |" not in card
    assert "Methods that shaped the bytes: " in card and "; GPTQ weight rounding (damp 0.05" in card


def test_rtn_export_says_round_to_nearest_and_lists_bf16_layers(tmp_path):
    folder = _write_export(tmp_path / "e", "compressed-tensors")
    card, _ = _push(folder)
    assert "| weight rounding | round-to-nearest weight codes |" in card and "GPTQ" not in card
    assert "| kept in BF16 | `lm_head` |" in card and "1 module(s) kept in BF16 (`lm_head`)" in card


def test_fp8_kv_cache_and_scale_search_rows(tmp_path):
    from nvfp4tool.hub import card as card_module

    folder = _write_export(tmp_path / "e", "compressed-tensors", validation=False)
    record = dataclasses.replace(
        ExportRecord.read(folder),
        kv_cache="fp8",
        scale_search="4over6",
        kv_amax={"model.layers.0.self_attn": (3.0, 1.0), "model.layers.1.self_attn": (2.0, 1.5)},
    )
    section = card_module._provenance_section(record)
    assert (
        "| KV cache | FP8 E4M3, one K and one V scale (amax / 448) per attention layer, 2 layers calibrated |"
    ) in section
    assert "| block-scale search | `4over6` |" in section
    assert "FP8 KV-cache scales calibrated per attention layer" in "; ".join(card_module._methods(record))


# ---------------------------------------------------------------------------------------- serving per quant


def test_w4a16_compressed_tensors_is_not_offered_w4a4_kernels(tmp_path):
    folder = _write_export(tmp_path / "e", "compressed-tensors", quant="nvfp4-weight-only")
    card, _ = _push(folder)
    meta = yaml.safe_load(card.split("---\n")[1])
    assert meta["tags"] == ["nvfp4", "fp4", "w4a16", "compressed-tensors", "nvfp4tool"]
    serving = _section(card, "How to serve it")
    assert "NVFP4 W4A16: weight-only FP4 Marlin kernels, activations in BF16" in serving
    assert "W4A4" not in card and "FP4 tensor-core GEMMs" not in card
    assert "NVFP4 weights, BF16 activations (W4A16)" in card
    assert "activations stay BF16 (weight-only, no input scales)" in card


def test_w4a16_modelopt_says_how_vllm_can_serve_it(tmp_path):
    folder = _write_export(tmp_path / "e", "modelopt", quant="nvfp4-weight-only")
    card, _ = _push(folder)
    serving = _section(card, "How to serve it")
    assert "`quant_algo: W4A16_NVFP4`" in serving and "not this weight-only one" in serving
    assert "nvfp4tool convert-format DIR OUT --to compressed-tensors\nvllm serve OUT" in serving
    assert "modelopt_fp4" not in card
    assert "W4A4" not in card.replace("vLLM's ModelOpt loader reads `NVFP4` (W4A4)", "")


def test_fp8_export_is_described_as_fp8(tmp_path):
    for fmt in ("compressed-tensors", "modelopt"):
        folder = _write_export(tmp_path / fmt, fmt, quant="fp8")
        card, _ = _push(folder)
        assert yaml.safe_load(card.split("---\n")[1])["tags"][:2] == ["fp8", "w8a8"]
        assert "FP8 W8A8 per tensor: FP8 GEMMs on Ada, Hopper and Blackwell" in card
        assert "NVFP4" not in card and "FP4" not in card
    assert "--quantization modelopt\n" in card


# ---------------------------------------------------------------------------------------- custody, honest cases


def test_source_mismatch_ok_goes_on_says_so_and_the_card_shows_it(tmp_path):
    folder = _write_export(tmp_path / "e", "compressed-tensors")
    bind_validation(folder, source=Named("my-finetune", {"model.safetensors": "4" * 64}), source_mismatch_ok=True)
    card, lines = _push(folder)
    notices = [line for line in lines if "validated against a source that is not the export's" in line]
    assert len(notices) == 1 and notices[0].startswith("Warning: ") and "'my-finetune'" in notices[0]
    banner = (
        "> **Validated against another source** (`nvfp4tool validate --source-mismatch-ok`): the numbers "
        "below measure this export against `my-finetune`, whose weights are not those of the export's "
        "source `meta-llama/Llama-3.2-1B` (nvfp4tool_export.json)."
    )
    top, validation = card.split("## What was quantized")[0], _section(card, "Validation")
    assert banner in top and banner in validation
    assert "measured against the BF16 source `my-finetune`" in validation


def test_an_export_readme_edited_after_validation_is_still_pushed(tmp_path):
    """README.md is replaced by the generated card in the upload, so it is outside the custody."""
    folder = _write_export(tmp_path / "e", "compressed-tensors")
    with open(os.path.join(folder, "README.md"), "w") as f:
        f.write("my notes, written after validation\n")
    result = CliRunner().invoke(cli, ["push", folder, "--repo-id", REPO, "--dry-run"])
    assert result.exit_code == 0, result.output


def test_validation_with_no_validation_flag_is_still_held_to_its_files(tmp_path):
    """--no-validation allows a missing validation.json; a present one is still on the card, so
    its chain of custody still holds."""
    folder = _write_export(tmp_path / "e", "compressed-tensors")
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"model_max_length": 256}, f)
    result = CliRunner().invoke(cli, ["push", folder, "--repo-id", REPO, "--dry-run", "--no-validation"])
    assert result.exit_code == 1 and "tokenizer_config.json: changed since validation" in result.output


# ---------------------------------------------------------------------------------------- warnings


def test_warns_once_each_for_unknown_base_model_and_license(tmp_path):
    folder = _write_export(tmp_path / "e", "compressed-tensors", source_name="llama-local")
    _, lines = _push(folder)
    warnings = [line for line in lines if line.startswith("Warning:")]
    assert len(warnings) == 2
    assert "no base_model" in warnings[0] and "--base-model" in warnings[0]
    assert "no license" in warnings[1] and "--license" in warnings[1]
    _, lines = _push(folder, base_model="org/llama", license="apache-2.0")
    assert not [line for line in lines if line.startswith("Warning:")]


def test_warnings_reach_the_cli_output(tmp_path):
    folder = _write_export(tmp_path / "e", "compressed-tensors")  # base_model known, license not
    result = CliRunner().invoke(cli, ["push", folder, "--repo-id", REPO, "--dry-run"])
    assert result.exit_code == 0, result.output
    # piped (CliRunner's stderr is no terminal), a status line comes after its log stamp
    warnings = [
        line for line in result.output.splitlines() if re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ )?Warning:", line)
    ]
    assert len(warnings) == 1 and "no license" in warnings[0]


def test_quiet_push_still_prints_the_card_warnings(tmp_path):
    """--quiet silences status lines, never a warning: both of the card's reach stderr, nothing else."""
    folder = _write_export(tmp_path / "e", "compressed-tensors", source_name="llama-local")
    result = CliRunner().invoke(cli, ["-q", "push", folder, "--repo-id", REPO, "--dry-run"])
    assert result.exit_code == 0, result.output
    warnings = result.stderr.splitlines()
    assert len(warnings) == 2, result.stderr
    assert warnings[0].startswith("Warning: the model card has no base_model") and "--base-model" in warnings[0]
    assert warnings[1].startswith("Warning: the model card has no license") and "--license" in warnings[1]
    assert "Warning" not in result.stdout


def test_quiet_push_still_prints_the_custody_warning(tmp_path):
    """A validation of another source that `validate --source-mismatch-ok` allowed: its warning
    reaches stderr under --quiet too, once (--license: the fixture's other warning is not earned)."""
    folder = _write_export(tmp_path / "e", "compressed-tensors")
    bind_validation(folder, source=Named("my-finetune", {"model.safetensors": "4" * 64}), source_mismatch_ok=True)
    result = CliRunner().invoke(cli, ["-q", "push", folder, "--repo-id", REPO, "--dry-run", "--license", "mit"])
    assert result.exit_code == 0, result.output
    warnings = result.stderr.splitlines()
    assert len(warnings) == 1, result.stderr
    assert warnings[0].startswith("Warning: ") and "validated against a source that is not the export's" in warnings[0]
    assert "'my-finetune'" in warnings[0]
