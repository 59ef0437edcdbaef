"""The adversarial corpus for `check` reading config.json and the tensors as the loaders do (issue 21),
and for the config parser's typed keys reaching every command that reads a config.

Each case: exit code, one `Error:` line naming the file / tensor / key, nothing created or changed,
the source untouched (`adversarial_harness.run_case`). Layouts: the dense W4A4 exports `mo`
(ModelOpt) and `ct` (compressed-tensors) of conftest's `pristine`, and a tiny Qwen3-MoE W4A4 export
with FP8 KV-cache scales in both layouts (`check_fixtures.build_moe_exports`, built once here);
"-no-record" cases remove the export's provenance record first (the model check must not depend on it).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from nvfp4tool.records.export import ExportRecord

from fixtures.adversarial_harness import (
    SEQ,
    WEIGHTS,
    Case,
    World,
    edit_header,
    edit_json,
    read_st,
    registrar,
    run_case,
    write_st,
)
from fixtures.check_fixtures import build_moe_exports

CASES: list[Case] = []
case = registrar(CASES)
LAYOUTS = ("mo", "ct")
MOE = {"mo": "moe-mo", "ct": "moe-ct"}
# The layouts' KV-cache scale names of attention module <a> (formats.*.KV_SCALES).
KV_K = {"mo": "{a}.k_proj.k_scale", "ct": "{a}.k_scale"}
GLOBAL = {"mo": "weight_scale_2", "ct": "weight_global_scale"}


@pytest.fixture(scope="module")
def paths(pristine, tmp_path_factory):
    """conftest's pristine fixtures plus the tiny MoE model and its two KV-cache exports."""
    return {**pristine, **build_moe_exports(str(tmp_path_factory.mktemp("check-moe")), pristine["ids"])}


def _export(
    w: World,
    key: str,
    *,
    record: bool = True,
    config: Callable[[dict], None] | None = None,
    weights: Callable[[str], None] | None = None,
) -> str:
    """A copy of export `key`, its config.json and weights edited, its provenance record removed
    unless `record`."""
    folder = w.copy(key)
    if config is not None:
        edit_json(os.path.join(folder, "config.json"), config)
    if weights is not None:
        weights(os.path.join(folder, WEIGHTS))
    if not record:
        os.remove(os.path.join(folder, ExportRecord.FILE_NAME))
    return folder


def add_copies(path: str, copies: dict[str, str]) -> None:
    """Append tensors `new` holding the bytes (dtype, shape) of existing tensors `old`."""
    header, data = read_st(path)
    for new, old in copies.items():
        begin, end = header[old]["data_offsets"]
        header[new] = {**header[old], "data_offsets": [len(data), len(data) + end - begin]}
        data += data[begin:end]
    write_st(path, header, data)


def _expert_copies(path: str, layer: int, old: int, new: int) -> dict[str, str]:
    header, _ = read_st(path)
    prefix = f"model.layers.{layer}.mlp.experts.{old}."
    return {n.replace(f".experts.{old}.", f".experts.{new}."): n for n in header if n.startswith(prefix)}


def _del(*keys: str) -> Callable[[dict], None]:
    def change(c: dict) -> None:
        for key in keys:
            del c[key]

    return change


def _set(**values) -> Callable[[dict], None]:
    return lambda c: c.update(values)


# ---- item 1: a config.json that does not parse as its family is an error naming the key ----------

for lay in LAYOUTS:
    for record in (True, False):
        tail = "" if record else "-no-record"

        @case(f"check/moe-num-experts-per-tok-9-of-4-{lay}{tail}", 1)
        def _(w, lay=lay, record=record):
            folder = _export(w, MOE[lay], record=record, config=_set(num_experts_per_tok=9))
            return ["check", folder], (folder, "config.json", "num_experts_per_tok", "got 9")

        @case(f"check/moe-num-experts-per-tok-removed-{lay}{tail}", 1)
        def _(w, lay=lay, record=record):
            folder = _export(w, MOE[lay], record=record, config=_del("num_experts_per_tok"))
            return ["check", folder], ("config.json", "missing required key 'num_experts_per_tok'")

    @case(f"check/moe-decoder-sparse-step-0-{lay}", 1)
    def _(w, lay=lay):
        folder = _export(w, MOE[lay], config=_set(decoder_sparse_step=0))
        return ["check", folder], ("config.json", "decoder_sparse_step must be a positive integer")

    @case(f"check/model-type-removed-{lay}-no-record", 1)
    def _(w, lay=lay):
        folder = _export(w, lay, record=False, config=_del("model_type"))
        return ["check", folder], ("config.json", "missing required key 'model_type'")

    @case(f"check/num-hidden-layers-a-float-{lay}", 1)
    def _(w, lay=lay):
        folder = _export(w, lay, config=_set(num_hidden_layers=2.0))
        return ["check", folder], ("config.json", "num_hidden_layers must be an integer, got 2.0")

    @case(f"check/moe-num-experts-per-tok-2.5-{lay}", 1)
    def _(w, lay=lay):
        folder = _export(w, MOE[lay], config=_set(num_experts_per_tok=2.5))
        return ["check", folder], ("config.json", "num_experts_per_tok must be an integer, got 2.5")

    @case(f"check/moe-expert-count-keys-disagree-{lay}", 1)
    def _(w, lay=lay):
        folder = _export(w, MOE[lay], config=_set(num_local_experts=8))
        return ["check", folder], ("config.json", "num_experts=4", "num_local_experts=8", "disagree")


@case("check/architectures-of-another-family-mo", 1)
def _(w):
    folder = _export(w, "mo", config=_set(architectures=["MixtralForCausalLM"]))
    return ["check", folder], ("config.json", "architectures 'MixtralForCausalLM'", "model_type is 'llama'")


@case("check/tie-word-embeddings-a-string-ct-no-record", 1)
def _(w):
    folder = _export(w, "ct", record=False, config=_set(tie_word_embeddings="false"))
    return ["check", folder], ("config.json", "tie_word_embeddings must be true or false")


@case("check/hidden-size-a-string-mo-no-record", 1)
def _(w):
    folder = _export(w, "mo", record=False, config=_set(hidden_size="64"))
    return ["check", folder], ("config.json", "hidden_size must be an integer, got '64'")


@case("check/moe-mlp-only-layers-out-of-range-ct", 1)
def _(w):
    folder = _export(w, MOE["ct"], config=_set(mlp_only_layers=[2]))
    return ["check", folder], ("config.json", "mlp_only_layers 2 is not a layer index")


# ---- item 2: every tensor belongs to config.json's model, or is a documented extra ----------------

for lay in LAYOUTS:
    for record in (True, False):
        tail = "" if record else "-no-record"

        @case(f"check/moe-expert-4-in-a-4-expert-layer-{lay}{tail}", 1)
        def _(w, lay=lay, record=record):
            folder = _export(w, MOE[lay], record=record, weights=lambda p: add_copies(p, _expert_copies(p, 1, 3, 4)))
            return ["check", folder], ("model.layers.1.mlp.experts.4.", "expert 4", "4 experts per sparse layer")

        @case(f"check/kv-scales-of-layer-5-in-a-2-layer-model-{lay}{tail}", 1)
        def _(w, lay=lay, record=record):
            k = KV_K[lay]
            copies = {
                k.format(a="model.layers.5.self_attn"): k.format(a="model.layers.1.self_attn"),
                k.replace("k", "v").format(a="model.layers.5.self_attn"): k.replace("k", "v").format(
                    a="model.layers.1.self_attn"
                ),
            }
            folder = _export(w, MOE[lay], record=record, weights=lambda p: add_copies(p, copies))
            return ["check", folder], ("model.layers.5.self_attn", "layer 5", "2 layers")

        @case(f"check/unknown-tensor-{lay}{tail}", 1)
        def _(w, lay=lay, record=record):
            folder = _export(
                w,
                lay,
                record=record,
                weights=lambda p: add_copies(p, {"model.vision_tower.proj.weight": "model.norm.weight"}),
            )
            return ["check", folder], ("model.vision_tower.proj.weight", "not a tensor of config.json's llama model")

    @case(f"check/layer-2-of-a-2-layer-model-{lay}-no-record", 1)
    def _(w, lay=lay):
        folder = _export(
            w,
            lay,
            record=False,
            weights=lambda p: add_copies(
                p, {"model.layers.2.input_layernorm.weight": "model.layers.1.input_layernorm.weight"}
            ),
        )
        return ["check", folder], ("model.layers.2.input_layernorm.weight", "layer 2", "2 layers")


@case("check/moe-expert-in-a-dense-layer-mo-no-record", 1, also=("dense in config.json's model",))
def _(w):
    folder = _export(w, MOE["mo"], record=False, config=_set(mlp_only_layers=[0]))
    return ["check", folder], ("model.layers.0.mlp.", "missing")


@case("check/lm-head-of-a-tied-model-ct-no-record", 1)
def _(w):
    folder = _export(w, "ct", record=False, config=_set(tie_word_embeddings=True))
    return ["check", folder], ("lm_head.weight", "tie_word_embeddings = true")


@case("check/moe-global-scale-of-a-missing-expert-ct-no-record", 1)
def _(w):
    name = f"model.layers.0.mlp.experts.6.gate_proj.{GLOBAL['ct']}"
    folder = _export(
        w,
        MOE["ct"],
        record=False,
        weights=lambda p: add_copies(p, {name: f"model.layers.0.mlp.experts.0.gate_proj.{GLOBAL['ct']}"}),
    )
    return ["check", folder], (name, "expert 6")


# ---- item 3: safetensors metadata `format` must be "pt" -------------------------------------------

for lay in LAYOUTS:

    @case(f"check/metadata-format-tf-{lay}", 1)
    def _(w, lay=lay):
        folder = _export(w, lay, weights=lambda p: edit_header(p, lambda h: h["__metadata__"].update(format="tf")))
        return ["check", folder], (WEIGHTS, "format is 'tf', not 'pt'")


@case("check/metadata-without-format-mo-no-record", 1)
def _(w):
    folder = _export(
        w,
        "mo",
        record=False,
        weights=lambda p: edit_header(p, lambda h: h.update({"__metadata__": {"producer": "someone"}})),
    )
    return ["check", folder], (WEIGHTS, "format is None, not 'pt'")


@case("check/moe-metadata-format-flax-ct", 1)
def _(w):
    folder = _export(w, MOE["ct"], weights=lambda p: edit_header(p, lambda h: h["__metadata__"].update(format="flax")))
    return ["check", folder], (WEIGHTS, "format is 'flax'")


# ---- item 5: the typed keys reach every command that reads a config ------------------------------


def _hf(w: World, key: str, change: Callable[[dict], None]) -> str:
    folder = w.copy(key)
    edit_json(os.path.join(folder, "config.json"), change)
    return folder


@case("export/source-num-experts-per-tok-2.5", 1)
def _(w):
    src = _hf(w, "moe", _set(num_experts_per_tok=2.5))
    return ["export", src, "--out", w.path("out"), "--quant", "nvfp4-weight-only"], (
        "config.json",
        "num_experts_per_tok must be an integer, got 2.5",
    )


@case("export/source-expert-count-keys-disagree", 1)
def _(w):
    src = _hf(w, "moe", _set(num_local_experts=8))
    return ["export", src, "--out", w.path("out"), "--quant", "nvfp4-weight-only"], (
        "config.json",
        "num_experts=4 and num_local_experts=8 disagree",
    )


@case("convert/source-expert-count-keys-disagree", 1)
def _(w):
    src = _hf(w, "moe", _set(num_local_experts=8))
    return ["convert", src, w.path("out"), "--to", "hf"], ("config.json", "num_local_experts=8")


@case("convert/source-num-attention-heads-a-float", 1)
def _(w):
    src = _hf(w, "hf", _set(num_attention_heads=4.0))
    return ["convert", src, w.path("out"), "--to", "hf"], ("config.json", "num_attention_heads must be an integer")


@case("convert/source-model-type-removed", 1)
def _(w):
    src = _hf(w, "hf", _del("model_type"))
    return ["convert", src, w.path("out"), "--to", "hf"], ("config.json", "missing required key 'model_type'")


@case("validate/source-num-hidden-layers-a-string", 1)
def _(w):
    src = _hf(w, "hf", _set(num_hidden_layers="2"))
    return [
        "validate",
        w.copy("mo"),
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
        src,
    ], ("config.json", "num_hidden_layers must be an integer")


@case("train/model-num-experts-per-tok-2.5", 1)
def _(w):
    src = _hf(w, "moe", _set(num_experts_per_tok=2.5))
    data = w.file("t.txt", "To be, or not to be, that is the question.\n" * 40)
    return [
        "train",
        f"model={src}",
        "tokenizer=train",
        "vocab_size=256",
        "steps=2",
        "seq_len=16",
        "batch_size=2",
        "eval_every=0",
        f"out={w.path('run')}",
        f"data={data}",
    ], ("config.json", "num_experts_per_tok must be an integer")


# ---------------------------------------------------------------------------------------- the test


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
@pytest.mark.slow  # > 15 s of the inner loop (tests/durations.json)
def test_bad_input_is_one_line_and_changes_nothing(case, paths, tmp_path, monkeypatch, hub_env):
    run_case(case, paths, tmp_path, monkeypatch)


def test_the_corpus_covers_each_item_on_both_layouts():
    ids = {c.id for c in CASES}
    assert len(ids) == len(CASES) and len(CASES) >= 14
    for lay in LAYOUTS:
        for stem in (
            "moe-num-experts-per-tok-9-of-4",
            "moe-expert-4-in-a-4-expert-layer",
            "kv-scales-of-layer-5-in-a-2-layer-model",
            "unknown-tensor",
        ):
            assert {f"check/{stem}-{lay}", f"check/{stem}-{lay}-no-record"} <= ids
        assert f"check/metadata-format-tf-{lay}" in ids
