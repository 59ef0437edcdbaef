"""The adversarial corpus: realistic bad input to every command, and the safety promises for each
(the harness and its rules: `tests/fixtures/adversarial_harness.py`; friends: `tests/test_adversarial_*.py`)."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable

import numpy as np
import pytest
from bench_convert import synthetic_config, write_synthetic_hf_folder

from nvfp4tool.cli import cli

from fixtures.adversarial_harness import (
    BF16_INF,
    BF16_NAN,
    BINARY,
    CONFIG,
    DOWN,
    SEQ,
    TEXT,
    WEIGHTS,
    Case,
    World,
    drop_tensor,
    edit_header,
    edit_json,
    largest_chunk,
    poke,
    read_st,
    registrar,
    run_case,
    set_f32,
    truncate,
)

CASES: list[Case] = []
case = registrar(CASES)


def _with_config(change: Callable[[dict], None]) -> Callable[[World], str]:
    def build(w: World) -> str:
        hf = w.copy("hf")
        edit_json(os.path.join(hf, "config.json"), change)
        return hf

    return build


# ---------------------------------------------------------------------------------------- the corpus


def _hf_with(w: World, change: Callable[[str], None]) -> str:
    hf = w.copy("hf")
    change(os.path.join(hf, WEIGHTS))
    return hf


# ---- convert -------------------------------------------------------------------------------


@case("convert/onto-the-source", 2)
def _(w):
    hf = w.copy("hf")
    return ["convert", hf, hf, "--to", "hf", "--force"], (hf,)


@case("convert/into-the-parent-of-the-source", 2)
def _(w):
    hf = w.copy("hf")
    return ["convert", hf, w.root, "--to", "hf", "--force"], (hf,)


@case("convert/inside-the-source", 2)
def _(w):
    hf = w.copy("hf")
    return ["convert", hf, os.path.join(hf, "out"), "--to", "hf"], (hf,)


@case("convert/through-a-symlink-to-the-source", 2)
def _(w):
    hf = w.copy("hf")
    os.symlink(hf, w.path("link"))
    return ["convert", hf, w.path("link"), "--to", "hf", "--force"], ("link",)


@case("convert/nan-weight", 1)
def _(w):
    hf = _hf_with(w, lambda p: poke(p, f"{DOWN}.weight", lambda _: BF16_NAN, index=6, size=2))
    return ["convert", hf, w.path("out"), "--to", "hf"], (f"{DOWN}.weight",)


@case("convert/inf-weight", 1)
def _(w):
    hf = _hf_with(w, lambda p: poke(p, "model.norm.weight", lambda _: BF16_INF, index=0, size=2))
    return ["convert", hf, w.path("out"), "--to", "maxtext", "--rope-layout", "half"], ("model.norm.weight",)


@case("convert/dtype-relabelled-bf16-as-i16", 1)
def _(w):
    hf = _hf_with(w, lambda p: edit_header(p, lambda h: h[f"{DOWN}.weight"].update(dtype="I16")))
    return ["convert", hf, w.path("out"), "--to", "hf"], (f"{DOWN}.weight",)


@case("convert/overlapping-offsets", 1)
def _(w):
    def overlap(h):
        h["model.norm.weight"]["data_offsets"] = list(h["model.layers.1.input_layernorm.weight"]["data_offsets"])

    hf = _hf_with(w, lambda p: edit_header(p, overlap))
    return ["convert", hf, w.path("out"), "--to", "hf"], (WEIGHTS,)


@case("convert/truncated-weights", 1)
def _(w):
    hf = _hf_with(w, lambda p: truncate(p, 100))
    return ["convert", hf, w.path("out"), "--to", "hf"], (WEIGHTS,)


@case("convert/header-length-past-the-end", 1)
def _(w):
    def lie(p):
        with open(p, "r+b") as f:
            f.write(struct.pack("<Q", 10**9))

    hf = _hf_with(w, lie)
    return ["convert", hf, w.path("out"), "--to", "hf"], (WEIGHTS,)


@case("convert/header-not-json", 1)
def _(w):
    def garble(p):
        with open(p, "r+b") as f:
            f.seek(8)
            f.write(BINARY[:64])

    hf = _hf_with(w, garble)
    return ["convert", hf, w.path("out"), "--to", "hf"], (WEIGHTS,)


@case("convert/weights-path-is-a-folder", 1)
def _(w):
    def to_folder(p):
        os.remove(p)
        os.makedirs(p)

    hf = _hf_with(w, to_folder)
    return ["convert", hf, w.path("out"), "--to", "hf"], (WEIGHTS,)


@case("convert/config-not-json", 1)
def _(w):
    hf = w.copy("hf")
    w.file("hf/config.json", '{"model_type": "llama", ')
    return ["convert", hf, w.path("out"), "--to", "hf"], ("config.json",)


@case("convert/config-binary", 1)
def _(w):
    hf = w.copy("hf")
    w.file("hf/config.json", BINARY)
    return ["convert", hf, w.path("out"), "--to", "maxtext"], ("config.json",)


@case("convert/config-unsupported-architecture", 1)
def _(w):
    hf = _with_config(lambda c: c.update(model_type="gpt2", architectures=["GPT2LMHeadModel"]))(w)
    return ["convert", hf, w.path("out"), "--to", "hf"], ("config.json",)


@case("convert/config-more-layers-than-the-weights", 1)
def _(w):
    hf = _with_config(lambda c: c.update(num_hidden_layers=3))(w)
    return ["convert", hf, w.path("out"), "--to", "hf"], ("model.layers.2",)


@case("convert/tensor-shape-disagrees-with-config", 1)
def _(w):
    hf = _with_config(lambda c: c.update(intermediate_size=256))(w)
    return ["convert", hf, w.path("out"), "--to", "hf"], ("mlp",)


@case("convert/index-names-a-missing-shard", 1)
def _(w):
    hf = w.copy("hf")
    header, _ = read_st(os.path.join(hf, WEIGHTS))
    weight_map = {k: "model-00001-of-00002.safetensors" for k in header if k != "__metadata__"}
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    os.rename(os.path.join(hf, WEIGHTS), os.path.join(hf, "model-00001-of-00002.safetensors"))
    w.file("hf/model.safetensors.index.json", json.dumps({"metadata": {}, "weight_map": weight_map}))
    return ["convert", hf, w.path("out"), "--to", "hf"], ("model-00002-of-00002.safetensors",)


@case("convert/index-not-json", 1)
def _(w):
    hf = w.copy("hf")
    os.rename(os.path.join(hf, WEIGHTS), os.path.join(hf, "model-00001-of-00001.safetensors"))
    w.file("hf/model.safetensors.index.json", "{not json")
    return ["convert", hf, w.path("out"), "--to", "hf"], ("model.safetensors.index.json",)


@case("convert/existing-output-without-force", 1)
def _(w):
    hf = w.copy("hf")
    w.file("out/keep.txt", "mine")
    return ["convert", hf, w.path("out"), "--to", "hf"], (w.path("out"),)


@case("convert/output-is-a-file", 1)
def _(w):
    hf = w.copy("hf")
    w.file("out", "a file")
    return ["convert", hf, w.path("out"), "--to", "hf", "--force"], (w.path("out"),)


@case("convert/output-under-a-file", 1)
def _(w):
    hf = w.copy("hf")
    w.file("notes.txt", "a file")
    return ["convert", hf, w.path("notes.txt/out"), "--to", "hf"], ("notes.txt/out",)


@case("convert/maxtext-without-model-config", 2)
def _(w):
    return ["convert", w.copy("mt"), w.path("out"), "--to", "hf"], ("--model-config",)


@case("convert/maxtext-unknown-model-name", 2)
def _(w):
    return ["convert", w.copy("mt"), w.path("out"), "--to", "hf", "--model-config", "llama9-999b"], ("llama9-999b",)


@case("convert/maxtext-model-config-not-json", 1)
def _(w):
    bad = w.file("config.json", '{"hidden_size": 64,')
    return ["convert", w.copy("mt"), w.path("out"), "--to", "hf", "--model-config", bad, "--rope-layout", "half"], (
        "config.json",
    )


@case("convert/maxtext-truncated-chunk", 1)
def _(w):
    mt = w.copy("mt")
    truncate(largest_chunk(mt), 0.5)
    return ["convert", mt, w.path("out"), "--to", "hf", "--model-config", w.copy("hf"), "--rope-layout", "half"], (
        "mt",
    )


@case("convert/maxtext-garbage-chunk", 1)
def _(w):
    mt = w.copy("mt")
    chunk = largest_chunk(mt)
    with open(chunk, "r+b") as f:
        f.seek(os.path.getsize(chunk) // 2)
        f.write(b"\xff" * 256)  # NaN as raw f32/bf16 values, or an undecodable chunk if compressed
    return ["convert", mt, w.path("out"), "--to", "hf", "--model-config", w.copy("hf"), "--rope-layout", "half"], (
        "mt",
    )


# ---- train ---------------------------------------------------------------------------------


def _train(w: World, *args: str) -> list[str]:
    return [
        "train",
        "model=tiny",
        "tokenizer=train",
        "vocab_size=300",
        "steps=2",
        "seq_len=16",
        "batch_size=2",
        "eval_every=0",
        f"out={w.path('run')}",
        *args,
    ]


@case("train/binary-data", 1)
def _(w):
    return _train(w, f"data={w.file('bin.txt', BINARY)}"), ("bin.txt:1",)


@case("train/empty-data", 1)
def _(w):
    return _train(w, f"data={w.file('empty.txt', '')}"), ("empty.txt",)


@case("train/bad-jsonl-line", 1)
def _(w):
    data = w.file("docs.jsonl", json.dumps({"text": TEXT}) + '\n{"text": oops}\n')
    return _train(w, f"data={data}"), ("docs.jsonl:2",)


@case("train/jsonl-without-the-text-field", 1)
def _(w):
    data = w.file("docs.jsonl", json.dumps({"body": TEXT}) + "\n")
    return _train(w, f"data={data}"), ("docs.jsonl:1", "text")


@case("train/unsupported-data-type", 1)
def _(w):
    data = w.file("data.csv", "text\nhello\n")
    return _train(w, f"data={data}"), ("data.csv",)


@case("train/data-folder-without-data-files", 1)
def _(w):
    w.file("corpus/notes.md", TEXT)
    return _train(w, f"data={w.path('corpus')}"), ("corpus",)


@case("train/missing-data", 2)
def _(w):
    return _train(w, f"data={w.path('nothing.txt')}"), ("data=",)


@case("train/eval-fraction-zero", 2)
def _(w):
    return _train(w, f"data={w.file('t.txt', TEXT)}", "eval_fraction=0"), ("eval_fraction",)


@case("train/batch-larger-than-the-data", 1)
def _(w):
    return _train(w, f"data={w.file('t.txt', TEXT)}", "batch_size=4096"), ("batch_size",)


@case("train/missing-model", 2)
def _(w):
    return _train(w, f"data={w.file('t.txt', TEXT)}", f"model={w.path('no-model')}"), ("model=",)


@case("train/tokenizer-folder-without-tokenizer-json", 1)
def _(w):
    return _train(w, f"data={w.file('t.txt', TEXT)}", f"tokenizer={w.folder('tok')}"), ("tokenizer.json",)


@case("train/invalid-yaml", 1)
def _(w):
    config = w.file("run.yaml", "steps: 2\nrecipe: : nvfp4\n")
    return ["train", config, f"data={w.file('t.txt', TEXT)}", f"out={w.path('run')}"], ("run.yaml:2",)


@case("train/binary-yaml", 1)
def _(w):
    config = w.file("run.yaml", BINARY)
    return ["train", config, f"data={w.file('t.txt', TEXT)}", f"out={w.path('run')}"], ("run.yaml",)


@case("train/unknown-key", 2)
def _(w):
    return _train(w, f"data={w.file('t.txt', TEXT)}", "learning_rate=1e-3"), ("learning_rate",)


@case("train/negative-lr", 2)
def _(w):
    return _train(w, f"data={w.file('t.txt', TEXT)}", "lr=-1e-3"), ("lr=",)


@case("train/resume-in-a-folder-that-is-not-a-run", 1)
def _(w):
    w.file("run/notes.txt", "not a run")
    return _train(w, f"data={w.file('t.txt', TEXT)}", "resume=true"), (w.path("run"),)


@case("train/existing-output-without-force", 1)
def _(w):
    w.file("run/notes.txt", "my notes")
    return _train(w, f"data={w.file('t.txt', TEXT)}"), (w.path("run"),)


@case("train/output-is-the-data-folder", 2)
def _(w):
    data = w.file("corpus/t.txt", TEXT)
    args = _train(w, f"data={os.path.dirname(data)}", "force=true")
    return [a if not a.startswith("out=") else f"out={w.path('corpus')}" for a in args], ("corpus",)


# ---- export --------------------------------------------------------------------------------


def _export(w: World, src: str, *args: str, out: str | None = None) -> list[str]:
    return [
        "export",
        src,
        "--out",
        out or w.path("out"),
        "--calib-data",
        w.copy("ids", "ids.npy"),
        "--calib-samples",
        "4",
        "--calib-seq-len",
        str(SEQ),
        *args,
    ]


@case("export/onto-the-source", 2)
def _(w):
    hf = w.copy("hf")
    return _export(w, hf, "--force", out=hf), (hf,)


@case("export/inside-the-source", 2)
def _(w):
    hf = w.copy("hf")
    return _export(w, hf, out=os.path.join(hf, "nvfp4")), (hf,)


@case("export/into-the-parent-of-the-source", 2)
def _(w):
    hf = w.copy("hf")
    return _export(w, hf, "--force", out=w.root), (hf,)


@case("export/nan-weight", 1)
def _(w):
    hf = _hf_with(w, lambda p: poke(p, f"{DOWN}.weight", lambda _: BF16_NAN, index=10, size=2))
    return _export(w, hf), (f"{DOWN}.weight",)


@case("export/inf-weight-in-a-bf16-tensor", 1)
def _(w):
    hf = _hf_with(w, lambda p: poke(p, "lm_head.weight", lambda _: BF16_INF, index=2, size=2))
    return _export(w, hf), ("lm_head.weight",)


@case("export/dtype-relabelled", 1)
def _(w):
    hf = _hf_with(w, lambda p: edit_header(p, lambda h: h[f"{DOWN}.weight"].update(dtype="F16")))
    return _export(w, hf), (f"{DOWN}.weight",)


@case("export/truncated-weights", 1)
def _(w):
    return _export(w, _hf_with(w, lambda p: truncate(p, 0.5))), (WEIGHTS,)


@case("export/weights-path-is-a-folder", 1)
def _(w):
    def to_folder(p):
        os.remove(p)
        os.makedirs(p)

    return _export(w, _hf_with(w, to_folder)), (WEIGHTS,)


@case("export/config-not-json", 1)
def _(w):
    hf = w.copy("hf")
    w.file("hf/config.json", "{")
    return _export(w, hf), ("config.json",)


@case("export/calibration-text-is-binary", 1)
def _(w):
    args = _export(w, w.copy("hf"))
    args[args.index("--calib-data") + 1] = w.file("calib.txt", BINARY)
    return args, ("calib.txt",)


@case("export/calibration-text-is-empty", 1)
def _(w):
    args = _export(w, w.copy("hf"))
    args[args.index("--calib-data") + 1] = w.file("calib.txt", "")
    return args, ("calib.txt",)


@case("export/calibration-npy-of-floats", 1)
def _(w):
    path = w.path("calib.npy")
    np.save(path, np.zeros((8, SEQ), np.float32))
    args = _export(w, w.copy("hf"))
    args[args.index("--calib-data") + 1] = path
    return args, ("calib.npy",)


@case("export/calibration-ids-outside-the-vocabulary", 1)
def _(w):
    path = w.path("calib.npy")
    np.save(path, np.full((8, SEQ), CONFIG.vocab_size + 5, np.int64))
    args = _export(w, w.copy("hf"))
    args[args.index("--calib-data") + 1] = path
    return args, ("calib.npy",)


@case("export/calibration-npy-is-garbage", 1)
def _(w):
    args = _export(w, w.copy("hf"))
    args[args.index("--calib-data") + 1] = w.file("calib.npy", BINARY)
    return args, ("calib.npy",)


@case("export/calibration-jsonl-bad-line", 1)
def _(w):
    args = _export(w, w.copy("hf"))
    args[args.index("--calib-data") + 1] = w.file("calib.jsonl", json.dumps({"text": TEXT}) + "\n{oops\n")
    return args, ("calib.jsonl",)


@case("export/existing-output-without-force", 1)
def _(w):
    w.file("out/keep.txt", "mine")
    return _export(w, w.copy("hf")), (w.path("out"),)


@case("export/output-under-a-file", 1)
def _(w):
    w.file("notes.txt", "a file")
    return _export(w, w.copy("hf"), out=w.path("notes.txt/out")), ("notes.txt/out",)


@case("export/keep-bf16-pattern-matches-nothing", 2)
def _(w):
    return _export(w, w.copy("hf"), "--keep-bf16", "model.layers.*.mlp.gate"), ("--keep-bf16",)


@case("export/source-is-already-an-export", 1)
def _(w):
    mo = w.copy("mo")
    return _export(w, mo), (mo,)


# W4A16 and W4A4 refuse an input that is zero on every calibration token the same way (issue 39)
for _quant, _method in (("nvfp4-weight-only", "awq"), ("nvfp4", "awq"), ("nvfp4-weight-only", "smoothquant")):

    @case(f"export/equalize-{_method}-{_quant}-on-all-zero-activations", 1)
    def _(w, _quant=_quant, _method=_method):
        hf = w.copy("hf")
        poke(os.path.join(hf, WEIGHTS), "model.embed_tokens.weight", lambda b: bytes(len(b)))
        return _export(w, hf, "--quant", _quant, "--equalize", _method), (
            "model.layers.0.self_attn.q_proj",
            "zero on every calibration token",
        )


@case("export/k-not-a-multiple-of-16", 1)
def _(w):
    hf = w.path("odd")
    write_synthetic_hf_folder(
        hf, synthetic_config(hidden=64, mlp=72, layers=2, vocab=256, head_dim=16, kv_heads=2), seed=1
    )
    return _export(w, hf, "--quant", "nvfp4-weight-only"), ("--keep-bf16",)


@case("export/maxtext-without-model-config", 2)
def _(w):
    return _export(w, w.copy("mt"), "--quant", "nvfp4-weight-only"), ("--model-config",)


@case("export/maxtext-truncated-chunk", 1)
def _(w):
    mt = w.copy("mt")
    truncate(largest_chunk(mt), 0.5)
    return _export(w, mt, "--quant", "nvfp4-weight-only", "--model-config", w.copy("hf"), "--rope-layout", "half"), (
        "mt",
    )


# ---- convert-format ------------------------------------------------------------------------


def _export_with(w: World, key: str, change: Callable[[str], None]) -> str:
    folder = w.copy(key)
    change(os.path.join(folder, WEIGHTS))
    return folder


def _cf(src: str, out: str, to: str = "compressed-tensors", *args: str) -> list[str]:
    return ["convert-format", src, out, "--to", to, *args]


@case("convert-format/onto-the-source", 2)
def _(w):
    mo = w.copy("mo")
    return _cf(mo, mo, "compressed-tensors", "--force"), (mo,)


@case("convert-format/inside-the-source", 2)
def _(w):
    mo = w.copy("mo")
    return _cf(mo, os.path.join(mo, "ct")), (mo,)


@case("convert-format/zero-global-scale", 1, also=(f"{DOWN}.weight_scale_2",))
def _(w):
    mo = _export_with(w, "mo", lambda p: set_f32(p, f"{DOWN}.weight_scale_2", lambda _: 0.0))
    return _cf(mo, w.path("out")), (f"{DOWN}.weight_scale_2",)


@case("convert-format/missing-input-scale", 1)
def _(w):
    mo = _export_with(w, "mo", lambda p: drop_tensor(p, f"{DOWN}.input_scale"))
    return _cf(mo, w.path("out")), (f"{DOWN}",)


@case("convert-format/reciprocal-global-scale", 1)
def _(w):
    ct = _export_with(w, "ct", lambda p: set_f32(p, f"{DOWN}.weight_global_scale", lambda v: 1.0 / v))
    return _cf(ct, w.path("out"), "modelopt"), (f"{DOWN}.weight_global_scale",)


@case("convert-format/nan-input-scale", 1)
def _(w):
    mo = _export_with(w, "mo", lambda p: set_f32(p, f"{DOWN}.input_scale", lambda _: float("nan")))
    return _cf(mo, w.path("out")), (f"{DOWN}.input_scale",)


@case("convert-format/packed-weight-with-a-wrong-shape", 1)
def _(w):
    mo = _export_with(w, "mo", lambda p: edit_header(p, lambda h: h[f"{DOWN}.weight"].update(shape=[32, 128])))
    return _cf(mo, w.path("out")), (f"{DOWN}.weight",)


@case("convert-format/not-an-export", 1)
def _(w):
    hf = w.copy("hf")
    return _cf(hf, w.path("out")), (hf,)


@case("convert-format/hf-quant-config-not-json", 1)
def _(w):
    mo = w.copy("mo")
    w.file("mo/hf_quant_config.json", '{"quantization": ')
    return _cf(mo, w.path("out")), ("hf_quant_config.json",)


@case("convert-format/malformed-ignore-regex", 1)
def _(w):
    ct = w.copy("ct")
    edit_json(os.path.join(ct, "config.json"), lambda c: c["quantization_config"]["ignore"].append("re:lm_head[("))
    return _cf(ct, w.path("out"), "modelopt"), ("config.json",)


@case("convert-format/existing-output-without-force", 1)
def _(w):
    w.file("out/keep.txt", "mine")
    return _cf(w.copy("mo"), w.path("out")), (w.path("out"),)


# ---- validate ------------------------------------------------------------------------------


def _validate(w: World, export: str, *args: str, data: str | None = None) -> list[str]:
    return [
        "validate",
        export,
        "--data",
        data or w.copy("ids", "ids.npy"),
        "--reference",
        "bf16",
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
        w.copy("hf"),
        *args,
    ]


@case("eval/unknown-task-on-a-modelopt-export", 2)
def _(w):  # the eval command's own corpus is tests/eval/test_adversarial_eval.py
    return ["eval", w.copy("mo"), "--tasks", "no_such_task_24"], ("no_such_task_24",)


@case("validate/json-into-a-missing-folder", 2)
def _(w):
    return _validate(w, w.copy("mo"), "--json", w.path("reports/v.json")), ("--json",)


@case("validate/data-is-binary-text", 1)
def _(w):
    return _validate(w, w.copy("mo"), data=w.file("val.txt", BINARY)), ("val.txt",)


@case("validate/data-is-empty", 1)
def _(w):
    return _validate(w, w.copy("mo"), data=w.file("val.txt", "")), ("val.txt",)


@case("validate/data-npy-of-floats", 1)
def _(w):
    path = w.path("val.npy")
    np.save(path, np.ones((8, SEQ), np.float32))
    return _validate(w, w.copy("mo"), data=path), ("val.npy",)


@case("validate/data-jsonl-bad-line", 1)
def _(w):
    data = w.file("val.jsonl", json.dumps({"text": TEXT}) + "\n[1, 2\n")
    return _validate(w, w.copy("mo"), data=data), ("val.jsonl",)


@case("validate/no-provenance-and-no-source", 1)
def _(w):
    mo = w.copy("mo")
    os.remove(os.path.join(mo, "nvfp4tool_export.json"))
    args = _validate(w, mo)
    del args[args.index("--source") : args.index("--source") + 2]
    return args, ("nvfp4tool_export.json",)


@case("validate/provenance-not-json", 1)
def _(w):
    mo = w.copy("mo")
    w.file("mo/nvfp4tool_export.json", '{"source": ')
    args = _validate(w, mo)
    del args[args.index("--source") : args.index("--source") + 2]
    return args, ("nvfp4tool_export.json",)


@case("validate/source-is-an-empty-folder", 1)
def _(w):
    args = _validate(w, w.copy("mo"))
    args[args.index("--source") + 1] = w.folder("empty-source")
    return args, ("empty-source",)


@case("validate/source-misses-a-tensor", 1)
def _(w):
    _hf_with(w, lambda p: drop_tensor(p, f"{DOWN}.weight"))
    return _validate(w, w.copy("mo")), (f"{DOWN}.weight",)


@case("validate/export-is-a-plain-hf-folder", 1)
def _(w):
    return _validate(w, w.copy("hf", "plain")), ("plain",)


@case("validate/reference-is-not-an-fp8-export", 1)
def _(w):
    args = _validate(w, w.copy("mo"))
    args[args.index("--reference") + 1] = w.copy("ct")
    return args, ("--reference",)


@case("validate/export-misses-a-scale", 1)
def _(w):
    mo = _export_with(w, "mo", lambda p: drop_tensor(p, f"{DOWN}.weight_scale_2"))
    return _validate(w, mo), (f"{DOWN}.weight_scale_2",)


@case("validate/malformed-ignore-regex", 1)
def _(w):
    ct = w.copy("ct")
    edit_json(os.path.join(ct, "config.json"), lambda c: c["quantization_config"]["ignore"].append("re:[unclosed"))
    return _validate(w, ct), ("config.json",)


# ---- check ---------------------------------------------------------------------------------


@case("check/json-out-into-a-missing-folder", 2)
def _(w):
    return ["check", w.copy("mo"), "--json-out", w.path("reports/check.json")], ("--json-out",)


@case("check/plain-hf-folder", 1)
def _(w):
    hf = w.copy("hf")
    return ["check", hf], (hf,)


@case("check/config-not-json", 1, also=("config.json",))
def _(w):
    mo = w.copy("mo")
    w.file("mo/config.json", '{"architectures": [')
    return ["check", mo], (mo,)


@case("check/zero-global-scale", 1, also=(f"{DOWN}.weight_scale_2",))
def _(w):
    mo = _export_with(w, "mo", lambda p: set_f32(p, f"{DOWN}.weight_scale_2", lambda _: 0.0))
    return ["check", mo], (mo,)


@case("check/reciprocal-global-scale-modelopt", 1, also=(f"{DOWN}.weight_scale_2",))
def _(w):
    mo = _export_with(w, "mo", lambda p: set_f32(p, f"{DOWN}.weight_scale_2", lambda v: 1.0 / v))
    return ["check", mo], (mo,)


@case("check/reciprocal-global-scale-compressed-tensors", 1, also=(f"{DOWN}.weight_global_scale",))
def _(w):
    ct = _export_with(w, "ct", lambda p: set_f32(p, f"{DOWN}.weight_global_scale", lambda v: 1.0 / v))
    return ["check", ct], (ct,)


@case("check/global-scale-times-4", 1, also=(f"{DOWN}.weight_scale_2",))
def _(w):
    mo = _export_with(w, "mo", lambda p: set_f32(p, f"{DOWN}.weight_scale_2", lambda v: 4.0 * v))
    return ["check", mo], (mo,)


@case("check/bf16-tensor-relabelled-f16", 1, also=("lm_head.weight",))
def _(w):
    mo = _export_with(w, "mo", lambda p: edit_header(p, lambda h: h["lm_head.weight"].update(dtype="F16")))
    return ["check", mo], (mo,)


@case("check/nan-block-scale", 1, also=(f"{DOWN}.weight_scale",))
def _(w):
    mo = _export_with(w, "mo", lambda p: poke(p, f"{DOWN}.weight_scale", lambda _: b"\x7f", index=3, size=1))
    return ["check", mo], (mo,)


@case("check/truncated-weights", 1, also=(WEIGHTS,))
def _(w):
    mo = _export_with(w, "mo", lambda p: truncate(p, 64))
    return ["check", mo], (mo,)


@case("check/weights-are-a-symlink-loop", 1)
def _(w):
    mo = w.copy("mo")
    os.remove(os.path.join(mo, WEIGHTS))
    os.symlink(WEIGHTS, os.path.join(mo, WEIGHTS))
    return ["check", mo], (WEIGHTS,)


@case("check/malformed-ignore-regex", 1)
def _(w):
    ct = w.copy("ct")
    edit_json(os.path.join(ct, "config.json"), lambda c: c["quantization_config"]["ignore"].append("re:*lm_head"))
    return ["check", ct], ("config.json",)


@case("check/tp-degree-that-does-not-divide", 1, also=("o_proj",))
def _(w):
    mo = w.copy("mo")
    return ["check", mo, "--tp", "1,8"], (mo,)


# ---- push ----------------------------------------------------------------------------------

LOCAL_NOTHING = "http://127.0.0.1:9"  # the discard port: nothing listens (push must fail before it anyway)


@case("push/export-that-fails-check", 1, also=(f"{DOWN}.weight_scale_2",), hub=True)
def _(w):
    mo = _export_with(w, "mo", lambda p: set_f32(p, f"{DOWN}.weight_scale_2", lambda _: 0.0))
    return ["push", mo, "--repo-id", "org/m", "--endpoint", LOCAL_NOTHING], (mo,)


@case("push/no-validation-report", 1, hub=True)
def _(w):
    return ["push", w.copy("mo"), "--repo-id", "org/m", "--endpoint", LOCAL_NOTHING], ("validation.json",)


@case("push/failed-validation-report", 1, hub=True)
def _(w):
    mo = w.copy("mo")
    w.file("mo/validation.json", json.dumps({"passed": False, "failures": [{"metric": "kl_mean"}]}))
    return ["push", mo, "--repo-id", "org/m", "--endpoint", LOCAL_NOTHING], ("validation.json",)


@case("push/validation-report-not-json", 1, hub=True)
def _(w):
    mo = w.copy("mo")
    w.file("mo/validation.json", '{"passed": tru')
    return ["push", mo, "--repo-id", "org/m", "--endpoint", LOCAL_NOTHING], ("validation.json",)


@case("push/validation-report-not-an-object", 1, hub=True)
def _(w):
    mo = w.copy("mo")
    w.file("mo/validation.json", "[true]")
    return ["push", mo, "--repo-id", "org/m", "--endpoint", LOCAL_NOTHING], ("validation.json",)


@case("push/bad-repo-id", 2, hub=True)
def _(w):
    return ["push", w.copy("mo"), "--repo-id", "no slash here", "--dry-run"], ("--repo-id",)


@case("push/no-token", 1)
def _(w):
    return ["push", w.copy("mo"), "--repo-id", "org/m", "--endpoint", LOCAL_NOTHING, "--no-validation"], ("HF_TOKEN",)


@case("push/hub-that-never-answers", 1, hub=True)
def _(w):
    return [
        "push",
        w.copy("mo"),
        "--repo-id",
        "org/m",
        "--endpoint",
        "{silent}",
        "--no-validation",
        "--timeout",
        "0.2",
    ], ("{silent}", "no answer")


@case("push/hub-refuses-the-connection", 1, hub=True)
def _(w):
    return [
        "push",
        w.copy("mo"),
        "--repo-id",
        "org/m",
        "--endpoint",
        LOCAL_NOTHING,
        "--no-validation",
        "--timeout",
        "0.5",
    ], (LOCAL_NOTHING, "org/m")


# ---- plot ----------------------------------------------------------------------------------


@case("plot/folder-is-not-a-run", 1)
def _(w):
    return ["plot", w.folder("notarun"), "-o", w.path("loss.png")], ("notarun",)


@case("plot/metrics-binary", 1)
def _(w):
    w.file("run/metrics.jsonl", BINARY)
    return ["plot", w.path("run"), "-o", w.path("loss.png")], ("metrics.jsonl",)


@case("plot/metrics-bad-line", 1)
def _(w):
    w.file("run/metrics.jsonl", json.dumps({"step": 1, "loss": 2.0}) + '\n{"step": 2, "loss": \n')
    return ["plot", w.path("run"), "-o", w.path("loss.png")], ("metrics.jsonl",)


@case("plot/output-into-a-missing-folder", 2)
def _(w):
    w.file("run/metrics.jsonl", json.dumps({"step": 1, "loss": 2.0}) + "\n")
    return ["plot", w.path("run"), "-o", w.path("figs/loss.png")], ("-o",)


# ---- quickstart ----------------------------------------------------------------------------


@case("quickstart/out-is-a-file", 1)
def _(w):
    return ["quickstart", "--out", w.file("qs", "a file"), "--pretrain-steps", "1", "--finetune-steps", "1"], (
        w.path("qs"),
    )


@case("quickstart/out-exists-without-force", 1)
def _(w):
    w.file("qs/notes.txt", "mine")
    return ["quickstart", "--out", w.path("qs"), "--pretrain-steps", "1", "--finetune-steps", "1"], (w.path("qs"),)


@case("quickstart/out-under-a-file", 1)
def _(w):
    w.file("notes.txt", "a file")
    return ["quickstart", "--out", w.path("notes.txt/qs"), "--pretrain-steps", "1", "--finetune-steps", "1"], (
        "notes.txt/qs",
    )


# ---- data ----------------------------------------------------------------------------------


def _word_tokenizer(w: World) -> str:
    """A tiny word-level tokenizer folder (its end-of-text token in tokenizer_config.json)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted(set(TEXT.split())) + ["<eos>", "<unk>"]
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder = w.folder("tok")
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    w.file("tok/tokenizer_config.json", json.dumps({"eos_token": "<eos>"}))
    return folder


def _prepared(w: World) -> str:
    from nvfp4tool.corpus.prepare import prepare_cache

    prepare_cache([w.file("t.txt", TEXT)], _word_tokenizer(w), w.path("cache"), workers=0, shard_tokens=64)
    return w.path("cache")


@case("data/prepare-binary-source", 1)
def _(w):
    return ["data", "prepare", w.file("bin.txt", BINARY), "--tokenizer", _word_tokenizer(w), "--out", "c"], (
        "bin.txt:1",
    )


@case("data/prepare-missing-source", 2)
def _(w):
    return ["data", "prepare", w.path("nothing.jsonl"), "--tokenizer", _word_tokenizer(w), "--out", "c"], (
        "nothing.jsonl",
    )


@case("data/prepare-over-an-existing-cache", 1)
def _(w):
    cache = _prepared(w)
    return ["data", "prepare", w.path("t.txt"), "--tokenizer", w.path("tok"), "--out", cache], ("already exists",)


@case("data/verify-truncated-shard", 1)
def _(w):
    cache = _prepared(w)
    truncate(os.path.join(cache, "tokens-00001.bin"), 2)
    return ["data", "verify", cache], ("tokens-00001.bin",)


@case("data/verify-changed-source", 1)
def _(w):
    cache = _prepared(w)
    w.file("t.txt", TEXT + "more")
    return ["data", "verify", cache], ("t.txt", "changed since")


# ---------------------------------------------------------------------------------------- the test


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
@pytest.mark.slow  # > 15 s of the inner loop (tests/durations.json)
def test_bad_input_is_one_line_and_changes_nothing(case, pristine, tmp_path, monkeypatch, hub_env):
    run_case(case, pristine, tmp_path, monkeypatch)


def test_the_corpus_covers_every_command_with_60_cases():
    commands = {c.id.split("/")[0] for c in CASES}
    assert commands == set(cli.commands), commands ^ set(cli.commands)
    assert len(CASES) >= 60 and len({c.id for c in CASES}) == len(CASES)
