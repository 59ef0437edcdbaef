"""Adversarial cases (issue 21, "Real layouts refused or mis-written"): transformers 5's fused MoE
expert layout broken in every way a reader must notice, and the RoPE layout Mixtral's and
Qwen3-MoE's MaxText decoders fix, asked the other way (see tests/fixtures/adversarial_harness.py).

Each source is read by `converters.hf.HFFolderSource` / `nvfp4tool.checkpoints.open_checkpoint`,
the one opener of convert, export, validate `--source` and train `model=` / `teacher=`, so each
refusal is tried through more than one of those commands. The fixtures are module-scoped and tiny
(hf_fixtures' Qwen3-MoE, 3 layers with the middle one dense, and Mixtral, saved both ways by
transformers itself; a 300-token Mixtral student for train; a MaxText Mixtral checkpoint; a W4A16
export of Mixtral to validate).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from fixtures.adversarial_harness import Case, World, drop_tensor, edit_header, edit_json, poke, registrar, run_case
from fixtures.hf_fixtures import build_tiny_model

CASES: list[Case] = []
case = registrar(CASES)

ST = "model.safetensors"
QWEN_L0 = "model.layers.0.mlp.experts"  # Qwen3-MoE fixture: layers 0 and 2 sparse, 1 dense
QWEN_L2 = "model.layers.2.mlp.experts"
MIX_L1 = "model.layers.1.mlp.experts"  # Mixtral fixture: 2 layers, 6 experts of width 128, hidden 64
SEQ = 16


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """Read-only originals; each case works on copies."""
    from nvfp4tool.convert import convert_checkpoint
    from nvfp4tool.export import ExportOptions, export_checkpoint

    root = tmp_path_factory.mktemp("layouts")
    out = {
        "qwen-fused": build_tiny_model("qwen3_moe", str(root / "qwen-fused"), fused=True),
        "mixtral-fused": build_tiny_model("mixtral", str(root / "mixtral-fused"), fused=True),
        "mixtral": build_tiny_model("mixtral", str(root / "mixtral")),
        # a student for `tokenizer=train vocab_size=300` (a trained tokenizer has at least 257 tokens)
        "mixtral-v300": build_tiny_model("mixtral", str(root / "mixtral-v300"), overrides={"vocab_size": 300}),
        "ids": str(root / "ids.npy"),
        "mixtral-mt": str(root / "mixtral-mt"),
        "mixtral-w4a16": str(root / "mixtral-w4a16"),
    }
    np.save(out["ids"], np.random.default_rng(0).integers(3, 256, (8, SEQ)))
    convert_checkpoint(out["mixtral"], out["mixtral-mt"], to="maxtext")
    export_checkpoint(
        out["mixtral"], out["mixtral-w4a16"], ExportOptions(quant="nvfp4-weight-only", show_progress=False)
    )
    return out


def _edited(w: World, key: str, change) -> str:
    """A copy of fixture `key` whose weights file went through `change(path)`."""
    folder = w.copy(key)
    change(os.path.join(folder, ST))
    return folder


def _reshape(name: str, shape: list[int]):
    return lambda p: edit_header(p, lambda h: h[name].update(shape=shape))


def _to_hf(w: World, src: str) -> list[str]:
    return ["convert", src, w.path("out"), "--to", "hf"]


def _export(w: World, src: str, *args: str) -> list[str]:
    return ["-q", "export", src, "--out", w.path("out"), *args]


def _validate(w: World, source: str) -> list[str]:
    return [
        "validate",
        w.copy("mixtral-w4a16"),
        "--data",
        w.copy("ids", "ids.npy"),
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
        source,
    ]


def _train(w: World, *args: str) -> list[str]:
    return [
        "train",
        "tokenizer=train",
        "vocab_size=300",
        "steps=2",
        "seq_len=16",
        "batch_size=2",
        "eval_every=0",
        f"data={w.file('t.txt', 'To be, or not to be, that is the question.' * 40)}",
        f"out={w.path('run')}",
        *args,
    ]


def _unfuse_layer(prefix: str, family_names: tuple[str, str, str], block: str):
    """Rewrite layer `prefix`'s fused experts as per-expert tensors (a folder mixing both layouts)."""

    def change(path: str) -> None:
        tensors = load_file(path)
        gate_up, down = tensors.pop(f"{prefix}.gate_up_proj"), tensors.pop(f"{prefix}.down_proj")
        F = gate_up.shape[1] // 2
        layer = prefix.rsplit(".mlp.", 1)[0]
        gate, up, down_name = family_names
        for e in range(gate_up.shape[0]):
            tensors[f"{layer}.{block}.experts.{e}.{gate}.weight"] = np.ascontiguousarray(gate_up[e, :F])
            tensors[f"{layer}.{block}.experts.{e}.{up}.weight"] = np.ascontiguousarray(gate_up[e, F:])
            tensors[f"{layer}.{block}.experts.{e}.{down_name}.weight"] = np.ascontiguousarray(down[e])
        save_file(tensors, path, metadata={"format": "pt"})

    return change


def _rename(old: str, new: str):
    def change(path: str) -> None:
        tensors = load_file(path)
        tensors[new] = tensors.pop(old)
        save_file(tensors, path, metadata={"format": "pt"})

    return change


def _add(name: str, like: str):
    def change(path: str) -> None:
        tensors = load_file(path)
        tensors[name] = tensors[like].copy()
        save_file(tensors, path, metadata={"format": "pt"})

    return change


# ---- the fused expert layout: shapes ------------------------------------------------------------


@case("convert/fused-gate-up-wrong-shape", 1)
def _(w):
    # [8, 64, 64] -> [4, 128, 64]: the same bytes, half the experts with twice the rows
    src = _edited(w, "qwen-fused", _reshape(f"{QWEN_L0}.gate_up_proj", [4, 128, 64]))
    return _to_hf(w, src), (f"{QWEN_L0}.gate_up_proj", "[4, 128, 64]", "[8, 64, 64]", "fused expert layout")


@case("export/fused-down-proj-transposed", 1)
def _(w):
    # Mixtral's down_proj is [E, H, F] = [6, 64, 128]; stored [E, F, H] it is the wrong orientation
    src = _edited(w, "mixtral-fused", _reshape(f"{MIX_L1}.down_proj", [6, 128, 64]))
    return _export(w, src, "--quant", "nvfp4-weight-only"), (f"{MIX_L1}.down_proj", "[6, 64, 128]")


@case("convert/fused-gate-up-without-the-up-half", 1)
def _(w):
    # gate_up read as if each expert held only its gate rows: [6, 256, 64] -> [12, 128, 64]
    src = _edited(w, "mixtral-fused", _reshape(f"{MIX_L1}.gate_up_proj", [12, 128, 64]))
    return ["convert", src, w.path("out"), "--to", "maxtext"], (f"{MIX_L1}.gate_up_proj", "[6, 256, 64]")


@case("convert/fused-expert-count-disagrees-with-config", 1)
def _(w):
    # both expert-count keys say 4 (consistent); the fused tensors hold 6 experts
    src = w.copy("mixtral-fused")
    edit_json(
        os.path.join(src, "config.json"),
        lambda c: c.update({k: 4 for k in ("num_local_experts", "num_experts") if k in c}),
    )
    return ["convert", src, w.path("out"), "--to", "maxtext"], ("model.layers.0.mlp.gate.weight", "[6, 64]", "[4, 64]")


# ---- the fused expert layout: missing, mixed, extra ------------------------------------------------


@case("convert/fused-down-proj-missing", 1)
def _(w):
    src = _edited(w, "qwen-fused", lambda p: drop_tensor(p, f"{QWEN_L2}.down_proj"))
    return _to_hf(w, src), (f"{QWEN_L2}.down_proj", "missing", "fused expert layout")


@case("export/fused-gate-up-missing", 1)
def _(w):
    src = _edited(w, "mixtral-fused", lambda p: drop_tensor(p, f"{MIX_L1}.gate_up_proj"))
    return _export(w, src, "--quant", "nvfp4-weight-only"), (f"{MIX_L1}.gate_up_proj", "missing")


@case("train/model-fused-router-missing", 1)
def _(w):
    src = _edited(w, "mixtral-fused", lambda p: drop_tensor(p, "model.layers.0.mlp.gate.weight"))
    return _train(w, f"model={src}"), ("model.layers.0.mlp.gate.weight", "missing")


@case("train/teacher-fused-gate-up-wrong-shape", 1)
def _(w):
    # the student (per-expert Mixtral) is fine; the distillation teacher's fused layout is not
    teacher = _edited(w, "mixtral-fused", _reshape(f"{MIX_L1}.gate_up_proj", [6, 64, 256]))
    return (
        _train(w, f"model={w.copy('mixtral-v300')}", f"teacher={teacher}", "distill=kl"),
        (f"{MIX_L1}.gate_up_proj", "[6, 64, 256]", "[6, 256, 64]"),
    )


@case("convert/fused-and-per-expert-layers-mixed", 1)
def _(w):
    src = _edited(w, "qwen-fused", _unfuse_layer(QWEN_L2, ("gate_proj", "up_proj", "down_proj"), "mlp"))
    return _to_hf(w, src), (f"{QWEN_L0}.", "model.layers.2.mlp.experts.0.", "one layout")


@case("validate/source-fused-and-per-expert-mixed", 1)
def _(w):
    src = _edited(w, "mixtral-fused", _unfuse_layer(MIX_L1, ("w1", "w3", "w2"), "block_sparse_moe"))
    return _validate(w, src), (
        "model.layers.0.mlp.experts.",
        "model.layers.1.block_sparse_moe.experts.0.",
        "one layout",
    )


@case("export/fused-experts-with-the-per-expert-router-name", 1)
def _(w):
    # Mixtral's fused layout renames the whole block, router included; the old router name beside
    # fused experts is a mix
    src = _edited(
        w, "mixtral-fused", _rename("model.layers.1.mlp.gate.weight", "model.layers.1.block_sparse_moe.gate.weight")
    )
    return _export(w, src, "--quant", "nvfp4-weight-only"), (
        "model.layers.1.block_sparse_moe.gate.weight",
        "one layout",
    )


@case("convert/fused-experts-in-the-dense-layer", 1)
def _(w):
    # layer 1 of the Qwen3-MoE fixture is dense (mlp_only_layers=[1]): experts there are not the model's
    src = _edited(w, "qwen-fused", _add("model.layers.1.mlp.experts.gate_up_proj", f"{QWEN_L0}.gate_up_proj"))
    return _to_hf(w, src), ("model.layers.1.mlp.experts.gate_up_proj", "unexpected")


@case("convert/fused-experts-of-a-layer-past-the-config", 1)
def _(w):
    src = _edited(w, "mixtral-fused", _add("model.layers.5.mlp.experts.down_proj", f"{MIX_L1}.down_proj"))
    return _to_hf(w, src), ("model.layers.5.mlp.experts.down_proj", "unexpected")


# ---- the fused expert layout: values and dtypes ------------------------------------------------------


@case("convert/fused-gate-up-relabelled-int32", 1)
def _(w):
    src = _edited(w, "qwen-fused", lambda p: edit_header(p, lambda h: h[f"{QWEN_L2}.gate_up_proj"].update(dtype="I32")))
    return _to_hf(w, src), (f"{QWEN_L2}.gate_up_proj", "int32")


@case("export/fused-up-rows-nan", 1)
def _(w):
    # expert 3's up rows start at row 128 of its [256, 64] slice: float32 NaN in its first value
    offset = ((3 * 256) + 128) * 64 * 4
    src = _edited(
        w,
        "mixtral-fused",
        lambda p: poke(p, f"{MIX_L1}.gate_up_proj", lambda _: np.float32(np.nan).tobytes(), index=offset, size=4),
    )
    return _export(w, src, "--quant", "nvfp4-weight-only"), (
        f"{MIX_L1}.gate_up_proj",
        "expert 3",
        "rows 128-255",
        "non-finite",
    )


@case("convert/fused-down-proj-inf-in-the-last-expert", 1)
def _(w):
    # Qwen3-MoE down_proj [8, 64, 32] float32: +inf in the very last value (expert 7, row 63)
    src = _edited(
        w,
        "qwen-fused",
        lambda p: poke(
            p, f"{QWEN_L2}.down_proj", lambda _: np.float32(np.inf).tobytes(), index=8 * 64 * 32 * 4 - 4, size=4
        ),
    )
    return _to_hf(w, src), (f"{QWEN_L2}.down_proj", "expert 7", "rows 0-63", "non-finite")


@case("convert/fused-gate-up-flattened", 1)
def _(w):
    src = _edited(w, "qwen-fused", _reshape(f"{QWEN_L2}.gate_up_proj", [8, 64 * 64]))
    return _to_hf(w, src), (f"{QWEN_L2}.gate_up_proj", "[8, 4096]", "[8, 64, 64]")


@case("export/fused-router-wrong-shape", 1)
def _(w):
    # Qwen3-MoE's router keeps its name in both layouts: [8, 64] stored as [4, 128]
    src = _edited(w, "qwen-fused", _reshape("model.layers.2.mlp.gate.weight", [4, 128]))
    return _export(w, src, "--quant", "nvfp4-weight-only"), ("model.layers.2.mlp.gate.weight", "[4, 128]", "[8, 64]")


@case("convert/fused-weights-truncated-inside-gate-up", 1)
def _(w):
    def cut(path: str) -> None:
        from fixtures.adversarial_harness import read_st

        header, data = read_st(path)
        begin, end = header[f"{QWEN_L0}.gate_up_proj"]["data_offsets"]
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - len(data) + (begin + end) // 2)

    src = _edited(w, "qwen-fused", cut)
    return _to_hf(w, src), (ST, f"{QWEN_L0}.gate_up_proj")


# ---- the RoPE layout Mixtral's and Qwen3-MoE's MaxText decoders fix --------------------------------------


@case("convert/interleaved-rope-for-mixtral", 2)
def _(w):
    return (
        ["convert", w.copy("mixtral"), w.path("out"), "--to", "maxtext", "--rope-layout", "interleaved"],
        ("--rope-layout interleaved", "mixtral", "half"),
    )


@case("convert/interleaved-rope-for-qwen3-moe", 2)
def _(w):
    return (
        ["convert", w.copy("qwen-fused"), w.path("out"), "--to", "maxtext", "--rope-layout", "interleaved"],
        ("--rope-layout interleaved", "qwen3_moe", "half"),
    )


@case("convert/interleaved-rope-reading-mixtral-maxtext", 2)
def _(w):
    return (
        [
            "convert",
            w.copy("mixtral-mt"),
            w.path("out"),
            "--to",
            "hf",
            "--model-config",
            w.copy("mixtral"),
            "--rope-layout",
            "interleaved",
        ],
        ("--rope-layout interleaved", "mixtral"),
    )


@case("convert/interleaved-rope-with-a-mixtral-maxtext-name", 2)
def _(w):
    return (
        [
            "convert",
            w.copy("mixtral-mt"),
            w.path("out"),
            "--to",
            "hf",
            "--model-config",
            "mixtral-8x7b",
            "--rope-layout",
            "interleaved",
        ],
        ("--rope-layout interleaved", "mixtral"),
    )


@case("export/interleaved-rope-for-a-mixtral-maxtext-source", 2)
def _(w):
    return (
        _export(
            w,
            w.copy("mixtral-mt"),
            "--model-config",
            w.copy("mixtral"),
            "--rope-layout",
            "interleaved",
            "--quant",
            "nvfp4-weight-only",
        ),
        ("--rope-layout interleaved", "mixtral"),
    )


@case("export/interleaved-rope-for-an-hf-qwen3-moe-source", 2)
def _(w):
    return (
        _export(w, w.copy("qwen-fused"), "--rope-layout", "interleaved", "--quant", "nvfp4-weight-only"),
        ("--rope-layout interleaved", "qwen3_moe"),
    )


@case("convert/interleaved-rope-with-a-qwen3-moe-maxtext-name", 2)
def _(w):
    return (
        [
            "convert",
            w.copy("mixtral-mt"),
            w.path("out"),
            "--to",
            "hf",
            "--model-config",
            "qwen3-30b-a3b",
            "--rope-layout",
            "interleaved",
        ],
        ("--rope-layout interleaved", "qwen3_moe"),
    )


@case("train/interleaved-rope-for-a-mixtral-model", 2)
def _(w):
    return _train(w, f"model={w.copy('mixtral')}", "rope_layout=interleaved"), ("rope_layout=interleaved", "mixtral")


@case("train/interleaved-rope-for-the-moe-preset", 2)
def _(w):
    return _train(w, "model=tiny-moe", "rope_layout=interleaved"), ("rope_layout=interleaved", "qwen3_moe")


SLOW = {"train/interleaved-rope-for-the-moe-preset"}  # trains a tokenizer and builds the model first


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c.id in SLOW else c for c in CASES], ids=[c.id for c in CASES]
)
@pytest.mark.slow  # > 15 s of the inner loop (tests/durations.json)
def test_bad_input_is_one_line_and_changes_nothing(case, paths, tmp_path, monkeypatch, hub_env):
    run_case(case, paths, tmp_path, monkeypatch)


def test_the_corpus_has_its_cases():
    assert len(CASES) >= 8 and len({c.id for c in CASES}) == len(CASES)
    assert {c.id.split("/")[0] for c in CASES} == {"convert", "export", "validate", "train"}
