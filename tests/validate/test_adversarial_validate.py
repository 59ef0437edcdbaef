"""Adversarial cases of `nvfp4tool validate` for issue 21 (proof bound to the bytes it proves):
a source that is not the export's recorded one, reports replaced without --force, an FP8 reference
with nothing to calibrate it on, calibration data where it is unused or bad. Each asserts the exit
code, one `Error:` line naming the file / tensor / option, and nothing created or changed
(`adversarial_harness.run_case`)."""

from __future__ import annotations

import base64
import os

import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner

from nvfp4tool.cli import cli

from fixtures.adversarial_harness import (
    BINARY,
    CONFIG,
    DOWN,
    SEQ,
    TEXT,
    WEIGHTS,
    Case,
    World,
    edit_json,
    poke,
    read_st,
    registrar,
    run_case,
    write_st,
    write_synthetic_hf_folder,
)

CASES: list[Case] = []
case = registrar(CASES)
EMBED = "model.embed_tokens.weight"
RECORD = "nvfp4tool_export.json"


@pytest.fixture(scope="module")
def paths(pristine, tmp_path_factory):
    """The pristine fixtures plus a W4A16 export of `hf`, an FP8 export of it and `hf` resharded
    into two files (the same weights in other files)."""
    root = tmp_path_factory.mktemp("adversarial_validate")
    extra = {"w4a16": str(root / "w4a16"), "fp8": str(root / "fp8"), "hf2": str(root / "hf2"), "awq": str(root / "awq")}
    runner = CliRunner()
    calib = ["--calib-data", pristine["ids"], "--calib-samples", "4", "--calib-seq-len", str(SEQ)]
    for argv in (
        ["export", pristine["hf"], "--out", extra["awq"], "--equalize", "awq", *calib],
        ["export", pristine["hf"], "--out", extra["w4a16"], "--quant", "nvfp4-weight-only"],
        [
            "export",
            pristine["hf"],
            "--out",
            extra["fp8"],
            "--quant",
            "fp8",
            "--calib-data",
            pristine["ids"],
            "--calib-samples",
            "4",
            "--calib-seq-len",
            str(SEQ),
        ],
        ["convert", pristine["hf"], extra["hf2"], "--to", "hf", "--max-shard-size", "100KB"],
    ):
        result = runner.invoke(cli, ["-q", *argv])
        assert result.exit_code == 0, result.output
    return {**pristine, **extra}


def _validate(w: World, export: str, *args: str, reference: str = "bf16", source: str | None = None) -> list[str]:
    return [
        "validate",
        export,
        "--data",
        w.copy("ids", "ids.npy"),
        "--reference",
        reference,
        "--samples",
        "4",
        "--seq-len",
        str(SEQ),
        "--prompts",
        "1",
        "--prompt-len",
        "8",
        "--gen-tokens",
        "4",
        "--source",
        source or w.copy("hf"),
        *args,
    ]


def _scaled(factor: float):
    def change(old: bytes) -> bytes:
        values = np.frombuffer(old, ml_dtypes.bfloat16).astype(np.float32) * factor
        return values.astype(ml_dtypes.bfloat16).tobytes()

    return change


def _flip_byte(old: bytes) -> bytes:
    return bytes([old[0] ^ 0x01]) + old[1:]


# ---- the source is not the export's recorded one -------------------------------------------


@case("validate/source-one-tensor-changed-by-1-percent", 1)
def _(w):
    hf = w.copy("hf")
    poke(os.path.join(hf, WEIGHTS), f"{DOWN}.weight", _scaled(1.01))
    return _validate(w, w.copy("mo"), source=hf), (os.path.join(hf, WEIGHTS), "sha256", "--source-mismatch-ok")


@case("validate/source-one-tensor-changed-compressed-tensors", 1)
def _(w):
    hf = w.copy("hf")
    poke(os.path.join(hf, WEIGHTS), f"{DOWN}.weight", _scaled(0.99))
    return _validate(w, w.copy("ct"), source=hf), (os.path.join(hf, WEIGHTS),)


@case("validate/source-with-other-weights", 1)
def _(w):
    other = w.path("other")
    write_synthetic_hf_folder(other, CONFIG, seed=4)
    return _validate(w, w.copy("mo"), source=other), (os.path.join(other, WEIGHTS), "not the source")


@case("validate/source-embedding-byte-changed-names-the-tensor", 1)
def _(w):
    hf = w.copy("hf")
    poke(os.path.join(hf, WEIGHTS), EMBED, _flip_byte, index=10, size=1)
    return _validate(w, w.copy("mo"), source=hf), (WEIGHTS, EMBED)


@case("validate/source-norm-byte-changed-names-the-tensor", 1)
def _(w):
    hf = w.copy("hf")
    poke(os.path.join(hf, WEIGHTS), "model.layers.1.post_attention_layernorm.weight", _flip_byte, index=2, size=1)
    return _validate(w, w.copy("ct"), source=hf), ("model.layers.1.post_attention_layernorm.weight",)


@case("validate/source-resharded-recorded-file-missing", 1)
def _(w):
    hf2 = w.copy("hf2")
    return _validate(w, w.copy("mo"), source=hf2), (os.path.join(hf2, WEIGHTS), "missing")


@case("validate/source-weight-file-renamed", 1)
def _(w):
    hf = w.copy("hf")
    os.rename(os.path.join(hf, WEIGHTS), os.path.join(hf, "model-00001-of-00001.safetensors"))
    return _validate(w, w.copy("mo"), source=hf), (WEIGHTS,)


@case("validate/source-extra-weight-file", 1)
def _(w):
    hf = w.copy("hf")
    header, data = read_st(os.path.join(hf, WEIGHTS))
    write_st(
        os.path.join(hf, "extra.safetensors"),
        {"__metadata__": {"format": "pt"}, "extra.bias": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}},
        b"\0" * 8,
    )
    return _validate(w, w.copy("mo"), source=hf), ("extra",)


# the files that define the source besides its weights are bound with them (issue 39)


@case("validate/source-config-rope-theta-changed", 1)
def _(w):
    hf = w.copy("hf")
    edit_json(os.path.join(hf, "config.json"), lambda c: c.update(rope_theta=c.get("rope_theta", 10000.0) * 2))
    return _validate(w, w.copy("mo"), source=hf), (os.path.join(hf, "config.json"), "sha256", "--source-mismatch-ok")


@case("validate/source-config-changed-compressed-tensors", 1)
def _(w):
    hf = w.copy("hf")
    edit_json(os.path.join(hf, "config.json"), lambda c: c.update(rms_norm_eps=1e-3))
    return _validate(w, w.copy("ct"), source=hf), (os.path.join(hf, "config.json"), "not the source")


@case("validate/source-generation-config-added", 1)
def _(w):
    hf = w.copy("hf")
    w.file("hf/generation_config.json", '{"do_sample": true, "temperature": 0.7}')
    return _validate(w, w.copy("mo"), source=hf), (os.path.join(hf, "generation_config.json"), "does not record")


@case("validate/source-tokenizer-file-added", 1)
def _(w):
    hf = w.copy("hf")
    w.file("hf/tokenizer_config.json", '{"eos_token": "</s>"}')
    return _validate(w, w.copy("ct"), source=hf), (os.path.join(hf, "tokenizer_config.json"),)


@case("validate/record-source-config-hash-edited", 1)
def _(w):
    mo = w.copy("mo")
    edit_json(os.path.join(mo, RECORD), lambda r: r["source"]["config_files"].update({"config.json": "0" * 64}))
    return _validate(w, mo), ("config.json", RECORD)


@case("validate/source-is-the-export-itself", 1)
def _(w):
    mo = w.copy("mo")
    return _validate(w, mo, source=mo), ("--source", "a quantized export (modelopt nvfp4)", "not a BF16")


@case("validate/source-is-another-export", 1)
def _(w):
    return _validate(w, w.copy("mo"), source=w.copy("ct")), ("--source", "compressed-tensors", "not a BF16")


@case("validate/located-source-edited", 1)
def _(w):
    hf = w.copy("hf")
    poke(os.path.join(hf, WEIGHTS), EMBED, _flip_byte, index=0, size=1)
    args = _validate(w, w.copy("mo"))
    del args[args.index("--source") : args.index("--source") + 2]
    return args, (RECORD, "--source")


@case("validate/record-source-hash-edited", 1)
def _(w):
    mo = w.copy("mo")
    edit_json(os.path.join(mo, RECORD), lambda r: r["source"]["files"].update({WEIGHTS: "0" * 64}))
    return _validate(w, mo), (WEIGHTS, RECORD)


@case("validate/record-source-names-no-files", 1)
def _(w):
    mo = w.copy("mo")
    edit_json(os.path.join(mo, RECORD), lambda r: r["source"].update(files={}))
    return _validate(w, mo), (WEIGHTS, "does not record")


@case("validate/record-source-is-maxtext", 1)
def _(w):
    mo = w.copy("mo")
    edit_json(os.path.join(mo, RECORD), lambda r: r["source"].update(kind="maxtext"))
    return _validate(w, mo), (RECORD, "MaxText", "--source-mismatch-ok")


@case("validate/record-source-is-a-training-run", 1)
def _(w):
    mo = w.copy("mo")
    edit_json(os.path.join(mo, RECORD), lambda r: r["source"].update(kind="run"))
    return _validate(w, mo), ("training run", RECORD)


@case("validate/mismatch-ok-does-not-excuse-a-broken-source", 1)
def _(w):
    hf = w.copy("hf")
    poke(os.path.join(hf, WEIGHTS), f"{DOWN}.weight", lambda _: b"\xc0\x7f", index=4, size=2)  # a BF16 NaN
    return _validate(w, w.copy("mo"), "--source-mismatch-ok", "--force", source=hf), (f"{DOWN}.weight",)


@case("validate/fp8-reference-of-another-source", 1)
def _(w):
    fp8 = w.copy("fp8")
    edit_json(os.path.join(fp8, RECORD), lambda r: r["source"]["files"].update({WEIGHTS: "1" * 64}))
    return _validate(w, w.copy("mo"), reference=fp8), (os.path.join(fp8, RECORD), WEIGHTS)


@case("validate/fp8-reference-of-another-training-step", 1)
def _(w):
    fp8 = w.copy("fp8")
    edit_json(os.path.join(fp8, RECORD), lambda r: r["source"].update(kind="run", step=3))
    return _validate(w, w.copy("ct"), reference=fp8), (os.path.join(fp8, RECORD),)


# ---- an equalized export's recorded scales are bound to the bytes they made (issue 39) -----


def _edit_scales(w: World, change) -> str:
    awq = w.copy("awq")

    def edit(record):
        for site in record["equalization"]["sites"].values():
            s = np.frombuffer(base64.b64decode(site["scales"]), "<f4").copy()
            site["scales"] = base64.b64encode(change(s).astype("<f4").tobytes()).decode()

    edit_json(os.path.join(awq, RECORD), edit)
    return awq


@case("validate/equalization-scales-doubled", 1)
def _(w):
    awq = _edit_scales(w, lambda s: s * 2)
    return _validate(w, awq), (os.path.join(awq, RECORD), "input_layernorm.weight", "did not make")


@case("validate/equalization-scales-halved-force-does-not-excuse", 1)
def _(w):
    awq = _edit_scales(w, lambda s: s / 2)
    return _validate(w, awq, "--force"), (os.path.join(awq, RECORD), "equalization site")


@case("validate/equalization-scales-negated", 1)
def _(w):
    awq = _edit_scales(w, lambda s: -s)
    return _validate(w, awq), (os.path.join(awq, RECORD), "finite and > 0")


@case("validate/equalization-scale-nan", 1)
def _(w):
    awq = _edit_scales(w, lambda s: np.where(np.arange(s.size) == 1, np.nan, s))
    return _validate(w, awq), (os.path.join(awq, RECORD), "channel 1 is nan")


@case("validate/equalization-scales-too-many", 1)
def _(w):
    awq = _edit_scales(w, lambda s: np.concatenate([s, s[:1]]))
    return _validate(w, awq), (os.path.join(awq, RECORD), "scales, expected")


# ---- reports are outputs -------------------------------------------------------------------

for _name in ("validation.json", "validation.md", "validation_layer_sqnr.png", "validation_kl_hist.png"):

    @case(f"validate/rerun-without-force-{_name}-exists", 1)
    def _(w, _name=_name):
        mo = w.copy("mo")
        w.file(f"mo/{_name}", "an earlier report")
        return _validate(w, mo), (os.path.join(mo, _name), "--force")


@case("validate/json-copy-exists", 1)
def _(w):
    copy = w.file("v.json", "{}")
    return _validate(w, w.copy("mo"), "--json", copy), (copy, "--force")


@case("validate/sensitivity-rerun-without-force", 1)
def _(w):
    mo = w.copy("mo")
    w.file("mo/validation.json", "{}")
    return _validate(w, mo, "--sensitivity", "--kl-target", "0.5"), ("validation.json", "--force")


@case("validate/report-path-is-a-folder-even-with-force", 1)
def _(w):
    mo = w.copy("mo")
    w.folder("mo/validation.md")
    w.file("mo/validation.md/keep.txt", "mine")
    return _validate(w, mo, "--force"), (os.path.join(mo, "validation.md"),)


@case("validate/json-copy-inside-the-export", 2)
def _(w):
    mo = w.copy("mo")
    return _validate(w, mo, "--json", os.path.join(mo, "v.json")), ("--json",)


# ---- the FP8 reference's calibration -------------------------------------------------------


@case("validate/fp8-reference-of-a-w4a16-export-without-calib-data", 2)
def _(w):
    return _validate(w, w.copy("w4a16"), reference="fp8"), ("--calib-data", "--reference bf16")


@case("validate/fp8-reference-record-without-input-amax", 2)
def _(w):
    mo = w.copy("mo")
    edit_json(os.path.join(mo, RECORD), lambda r: r.update(input_amax=None))
    return _validate(w, mo, reference="fp8"), ("--calib-data",)


@case("validate/calib-data-with-reference-bf16", 2)
def _(w):
    return _validate(w, w.copy("mo"), "--calib-data", w.file("calib.txt", TEXT)), ("--calib-data", "bf16")


@case("validate/calib-data-with-an-fp8-export-reference", 2)
def _(w):
    return (
        _validate(w, w.copy("mo"), "--calib-data", w.file("calib.txt", TEXT), reference=w.copy("fp8")),
        ("--calib-data",),
    )


@case("validate/calib-data-is-the-evaluation-data", 2)
def _(w):
    args = _validate(w, w.copy("mo"), reference="fp8")
    copy = w.path("same.npy")
    np.save(copy, np.load(w.copy("ids", "ids.npy")))
    return args + ["--calib-data", copy], ("--calib-data", "--data")


@case("validate/calib-data-is-binary-text", 1)
def _(w):
    calib = w.file("calib.txt", BINARY)
    return _validate(w, w.copy("w4a16"), "--calib-data", calib, reference="fp8"), ("calib.txt",)


@case("validate/calib-data-npy-of-floats", 1)
def _(w):
    calib = w.path("calib.npy")
    np.save(calib, np.ones((4, SEQ), np.float32))
    return _validate(w, w.copy("w4a16"), "--calib-data", calib, reference="fp8"), ("calib.npy",)


@case("validate/calib-data-ids-outside-the-vocabulary", 1)
def _(w):
    calib = w.path("calib.npy")
    np.save(calib, np.full((4, SEQ), CONFIG.vocab_size + 3, np.int64))
    return _validate(w, w.copy("mo"), "--calib-data", calib, reference="fp8"), ("calib.npy",)


@case("validate/calib-data-empty", 1)
def _(w):
    calib = w.file("calib.txt", "")
    return _validate(w, w.copy("w4a16"), "--calib-data", calib, reference="fp8"), ("calib.txt",)


@case("validate/calib-data-missing", 2)
def _(w):
    return _validate(w, w.copy("mo"), "--calib-data", w.path("nope.txt"), reference="fp8"), ("--calib-data",)


@case("validate/calib-samples-zero", 2)
def _(w):
    return _validate(w, w.copy("mo"), "--calib-samples", "0", reference="fp8"), ("--calib-samples",)


@case("validate/calib-seq-len-one", 2)
def _(w):
    return _validate(w, w.copy("mo"), "--calib-seq-len", "1", reference="fp8"), ("--calib-seq-len",)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
@pytest.mark.slow  # > 15 s of the inner loop (tests/durations.json)
def test_bad_input_is_one_line_and_changes_nothing(case, paths, tmp_path, monkeypatch, hub_env):
    run_case(case, paths, tmp_path, monkeypatch)
