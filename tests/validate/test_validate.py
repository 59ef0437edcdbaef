"""nvfp4tool.validate on tiny synthetic exports: identical models, a correct NVFP4 export, a broken
one (one block scale x16), the reports, and the sensitivity search."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import types

import jax.numpy as jnp
import numpy as np
import pytest

from converters.hf import HFFolderSource
from nvfp4tool.export.auto_precision import BITS, upgrade_search
from nvfp4tool.export.provenance import sha256_file
from nvfp4tool.export.simulate import served_linear
from nvfp4tool.families import group_glob as group_pattern
from nvfp4tool.model.layerwise import LayerwiseModel
from nvfp4tool.model.linear import Plain
from nvfp4tool.recipes.precision import fused_group
from nvfp4tool.records.validation import ValidationRecord
from nvfp4tool.validate import report
from nvfp4tool.validate.runner import Candidate, ValidateOptions, open_inputs, run_validation
from nvfp4tool.validate.sensitivity import _layer_bf16, _Mixed, _trajectory, sensitivity

from fixtures.validate_fixtures import BROKEN_MODULE, CONFIG, SEQ_LEN, break_block_scale, build_exports, rerecord

GEN_TOKENS = 12


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return build_exports(str(tmp_path_factory.mktemp("validate")))


def _options(paths, **kw):
    kw.setdefault("reference", paths["fp8"])
    return ValidateOptions(
        data=paths["ids"],
        samples=8,
        seq_len=SEQ_LEN,
        batch_size=4,
        prompts=2,
        prompt_len=8,
        gen_tokens=GEN_TOKENS,
        **kw,
    )


@pytest.fixture(scope="module")
def good(paths):
    with open_inputs(paths["nvfp4"], _options(paths)) as inputs:
        yield inputs, run_validation(inputs)


@pytest.fixture(scope="module")
def broken(paths):
    with open_inputs(paths["broken"], _options(paths)) as inputs:
        yield inputs, run_validation(inputs)


@pytest.fixture(scope="module")
def planted(paths):
    """The broken export with a second block scale of BROKEN_MODULE x16: a layer the most harmful
    per bit too (one block scale barely moves the KL of this random model: layer 1's o_proj, half
    its weights, costs nearly as much), measured against BF16 only."""
    import shutil

    folder = os.path.join(os.path.dirname(paths["broken"]), "planted")  # beside its source, as recorded
    shutil.copytree(paths["broken"], folder)
    break_block_scale(folder, BROKEN_MODULE, factor_log2=4)
    rerecord(folder, BROKEN_MODULE)
    with open_inputs(folder, _options(paths, reference="bf16")) as inputs:
        yield inputs, run_validation(inputs)


class _SourceServedAsIs:
    """The BF16 source standing in for an export whose every linear is "quantized" losslessly."""

    def __init__(self, folder):
        from nvfp4tool.model.weights import model_from_tensors

        self.source, self.config, self.quant, self.format = HFFolderSource(folder), CONFIG, "nvfp4", "modelopt"
        self.kv_cache = None  # no FP8 KV cache
        self.quantized = tuple(n for n in CONFIG.linear_names() if n != "lm_head")
        self.get = self.source.get
        self.model = lambda compute_dtype=jnp.float32, mesh=None: model_from_tensors(
            CONFIG, self.source, dtype=None, compute_dtype=compute_dtype, mesh=mesh
        )

    def stored_bytes(self):
        return 0

    def stored_tensor_bytes(self):  # what validate's estimate reads (validate/footprint.py)
        return {}

    def dequantized(self, module):
        return self.source.get(f"{module}.weight").astype(np.float32)


@pytest.mark.parametrize("offload", ["never", "always"])
@pytest.mark.slow  # > 15 s of the inner loop (tests/durations.json)
def test_identical_models_give_zero_kl_full_agreement_and_no_divergence(paths, offload):
    with open_inputs(paths["nvfp4"], _options(paths, reference="bf16", offload=offload)) as inputs:
        inputs = dataclasses.replace(inputs, nvfp4=Candidate("nvfp4", _SourceServedAsIs(paths["src"])))
        record = run_validation(inputs)
    m = record.models["nvfp4"]
    assert (m["kl_mean"], m["kl_p99"], m["top1"], m["logit_max_err"]) == (0.0, 0.0, 1.0, 0.0)
    assert m["ppl"] == record.models["bf16"]["ppl"] and m["ppl_increase"] == 0.0
    if offload == "never":
        assert record.generation.first_divergence["nvfp4"] == [None, None]
        assert record.generation.skipped is None
    else:  # a streamed model cannot generate: said, not omitted
        assert record.generation.first_divergence == {}
        assert "streamed layer by layer (--offload always)" in record.generation.skipped
        assert "skipped" in report.markdown(record)
    assert all(r.weight_sqnr_db["nvfp4"] == math.inf and r.output_sqnr_db["nvfp4"] == math.inf for r in record.layers)
    assert record.passed and record.failures == []


@pytest.mark.slow  # > 15 s of the inner loop (tests/durations.json)
def test_good_export_passes_and_fp8_is_closer_than_nvfp4(good):
    _, record = good
    nv, fp8 = record.models["nvfp4"], record.models["fp8"]
    assert record.passed, record.failures
    assert 0 < fp8["kl_mean"] < nv["kl_mean"] < 0.1
    assert nv["kl_p99"] >= nv["kl_mean"]
    assert 0.5 < nv["top1"] <= 1.0
    for row in record.layers:
        # RTN NVFP4 on Gaussian weights: ~20.5 dB (relative L2 error 0.094); FP8 ~31 dB
        assert 18 < row.weight_sqnr_db["nvfp4"] < row.weight_sqnr_db["fp8"]
        assert row.output_sqnr_db["nvfp4"] < row.output_sqnr_db["fp8"]
    assert len(record.generation.first_divergence["fp8"]) == 2
    assert (record.data.sequences, record.data.seq_len, record.data.tokens) == (8, SEQ_LEN, 8 * SEQ_LEN)


def test_the_record_names_no_local_path_and_hashes_what_it_names(paths, good):
    """validation.json is published with the export: folder / file names and hashes only."""
    _, record = good
    text = json.dumps(record.to_json())
    root = os.path.dirname(paths["src"])
    assert root not in text and os.sep + "tmp" not in text
    assert (record.export.name, record.source.name, record.data.file.name) == ("nvfp4", "src", "ids.npy")
    assert record.reference == "fp8 export" and record.reference_export.name == "fp8"
    assert record.source.sha256 == {"model.safetensors": sha256_file(os.path.join(paths["src"], "model.safetensors"))}
    assert record.data.file.sha256 == {"ids.npy": sha256_file(paths["ids"])}
    assert "model.safetensors" in record.export.sha256 and "config.json" in record.export.sha256
    assert ValidationRecord.from_json(json.loads(text)) == record


def test_broken_block_scale_fails_and_names_the_layer(good, broken):
    _, record = broken
    assert not record.passed
    assert record.layers[0].name == BROKEN_MODULE
    failed = [f for f in record.failures if f.metric == "layer_weight_sqnr_db"]
    assert [f.detail for f in failed] == [BROKEN_MODULE]
    assert failed[0].by == pytest.approx(failed[0].limit - failed[0].value)
    good_row = next(r for r in good[1].layers if r.name == BROKEN_MODULE)
    assert record.layers[0].weight_sqnr_db["nvfp4"] < good_row.weight_sqnr_db["nvfp4"] - 10
    assert record.models["nvfp4"]["kl_mean"] > good[1].models["nvfp4"]["kl_mean"]
    assert "FAILED" in report.markdown(record) and BROKEN_MODULE in report.verdict(record)


def test_reports_are_written_into_the_export(good, tmp_path):
    _, record = good
    folder = tmp_path / "export"
    folder.mkdir()
    paths = report.write_reports(record, str(folder), json_copy=str(tmp_path / "copy.json"))
    written = [*report.REPORT_FILES, "copy.json"]
    if record.sensitivity is None:  # the keep-BF16 file is --sensitivity's result
        written.remove(report.KEEP_BF16_TXT)
    assert sorted(os.path.basename(p) for p in paths) == sorted(written)
    saved = ValidationRecord.read(folder)
    assert saved == ValidationRecord.read_file(tmp_path / "copy.json")
    assert saved.models["nvfp4"]["kl_mean"] == record.models["nvfp4"]["kl_mean"]
    assert sum(saved.kl_histogram["nvfp4"].counts) == record.data.tokens  # one KL per position
    md = (folder / report.VALIDATION_MD).read_text()
    assert "| KL mean (nats) |" in md and "PASSED" in md
    for png in (report.SQNR_PNG, report.KL_PNG):
        assert (folder / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("keep", [False, True])
def test_mixed_model_is_the_served_export_or_the_bf16_source(good, keep):
    """Keep flags all off: the export as served; all on: the BF16 source (lm_head is BF16 in both)."""
    from nvfp4tool.model import default_linear
    from nvfp4tool.model.weights import model_from_tensors

    inputs, _ = good
    exported, source = inputs.nvfp4.exported, inputs.source.tensors
    quantized = list(exported.quantized)

    def aux(layer):
        bf16 = _layer_bf16(source, quantized, layer)
        return {"bf16": bf16, "keep": {n: jnp.asarray(keep) for n in bf16}}

    ids = inputs.ids_SxL[:4]
    ((_, mixed),) = LayerwiseModel.held(exported.model()).logits(ids, 4, tap=_Mixed(), aux=aux)
    expected_model = (
        model_from_tensors(CONFIG, source, dtype=None, compute_dtype=jnp.float32) if keep else exported.model()
    )
    ((_, expected),) = LayerwiseModel.held(expected_model).logits(
        ids, 4, tap=Plain(default_linear if keep else served_linear)
    )
    np.testing.assert_array_equal(np.asarray(mixed), np.asarray(expected))


@pytest.mark.parametrize("offload", ["never", "always"])
@pytest.mark.slow  # > 15 s of the inner loop (tests/durations.json)
def test_sensitivity_keeps_the_broken_layer_first(good, planted, offload):
    # between the correct export's KL and the broken one's: keeping the broken layer suffices
    target = 0.5 * (good[1].models["nvfp4"]["kl_mean"] + planted[1].models["nvfp4"]["kl_mean"])
    inputs = dataclasses.replace(planted[0], options=dataclasses.replace(planted[0].options, offload=offload))
    found = sensitivity(inputs, kl_target=target)
    assert inputs.ran["sensitivity"] == {"never": "held", "always": "streamed"}[offload]
    assert found.harm[0].group == fused_group(BROKEN_MODULE)
    assert found.trajectory[1].kept[0] == fused_group(BROKEN_MODULE)  # the search's first upgrade
    assert found.keep_bf16[0] == BROKEN_MODULE
    assert found.met and found.trajectory[-1].kl_mean <= target < found.trajectory[0].kl_mean
    assert found.precision_map[BROKEN_MODULE] == "bf16"
    # each step's size, from the shapes alone: NVFP4 1D is 4 bits + one FP8 scale per 16 weights
    # (+ a few bytes of global scales per module), a kept weight 16 bits
    shapes = CONFIG.expected_tensor_shapes()
    weights = {m: int(np.prod(shapes[f"{m}.weight"])) for m in found.precision_map}
    for step in found.trajectory:
        kept = {m for m in weights if fused_group(m) in step.kept}
        expected = sum(n * (16 if m in kept else 4.5) for m, n in weights.items()) / sum(weights.values())
        assert expected <= step.bits_per_weight <= expected + 8 * 16 * len(weights) / sum(weights.values())
        assert step.bits_per_weight < step.bits_per_parameter < 16.0
    assert [s.step for s in found.trajectory][:2] == ["start", "keep"]
    assert found.trajectory[-1].bits_per_weight > found.trajectory[0].bits_per_weight
    assert list(found.precision_map.values()).count("bf16") == sum(
        len([m for m in found.precision_map if fused_group(m) == g])
        for g in {fused_group(m) for m, p in found.precision_map.items() if p == "bf16"}
    )


def test_search_prunes_a_group_made_redundant_by_later_ones():
    """validate's search is the export's (`upgrade_search`), each unit on its own ladder (its format
    in a mixed export, then BF16), no margin: the error a removes is also removed by keeping b and c
    together; the first round keeps all three at once (the correction-scaled prediction of fewer
    misses the target), then a is not needed any more and goes back to its format."""
    ladders = {"a": ("fp8", "bf16"), "b": ("nvfp4", "bf16"), "c": ("nvfp4-weight-only", "bf16")}
    alone = {
        "a": {"fp8": 0.5, "bf16": 0.0},
        "b": {"nvfp4": 0.1, "bf16": 0.0},
        "c": {"nvfp4-weight-only": 0.3, "bf16": 0.0},
    }
    measured = []

    def kl(assign):
        measured.append(dict(assign))
        kept = {u for u, f in assign.items() if f == "bf16"}
        return (
            0.01
            + 0.3 * ("c" not in kept)
            + 0.1 * ("b" not in kept)
            + 0.5 * ("a" not in kept and not {"b", "c"} <= kept)
        )

    weights = dict.fromkeys(ladders, 100)
    steps, final = upgrade_search(weights, ladders, alone, kl, 0.05, margin=1.0)
    assert measured[0] == {"a": "fp8", "b": "nvfp4", "c": "nvfp4-weight-only"}  # each unit starts at its own format
    assert all(f in ladders[u] for trial in measured for u, f in trial.items())  # and never leaves its ladder
    assert [(s.step, s.upgraded) for s in steps] == [
        ("start", {}),
        ("upgrade", {"a": "bf16", "c": "bf16", "b": "bf16"}),  # most KL saved per added bit first
        ("prune", {"a": "fp8"}),  # b and c tried first (more bits saved per KL added): still needed
    ]
    assert final == {"a": "fp8", "b": "bf16", "c": "bf16"} and steps[-1].measured_kl == pytest.approx(0.01)
    assert len(measured) == 5  # start, the round, three prune trials
    assert [s.bits_per_weight for s in steps] == [(8 + 4.5 + 4.5) / 3, 16.0, (8 + 16 + 16) / 3]
    assert BITS["fp8"] == 8 and BITS["nvfp4"] == BITS["nvfp4-weight-only"] == 4.5
    # validate's record of it: the units in BF16 after each step, in the order they were kept
    sizes = types.SimpleNamespace(bits=lambda kept: {"bits_per_weight": 4.5 + len(kept), "bits_per_parameter": 5.0})
    assert [(s.step, s.kept, s.kl_mean, s.bits_per_weight) for s in _trajectory(steps, sizes)] == [
        ("start", [], pytest.approx(0.91), 4.5),
        ("keep", ["a", "c", "b"], pytest.approx(0.01), 7.5),
        ("prune", ["c", "b"], pytest.approx(0.01), 6.5),
    ]
    # a target not met even with every unit in BF16 returns the climb, its last step the result
    steps, final = upgrade_search(
        {"a": 1}, {"a": ("nvfp4", "bf16")}, {"a": {"nvfp4": 1.0, "bf16": 0.0}}, lambda a: 1.0, 0.2, margin=1.0
    )
    assert [s.step for s in steps] == ["start", "upgrade"] and final == {"a": "bf16"} and steps[-1].measured_kl > 0.2


def test_group_patterns_match_exactly_their_members():
    import fnmatch

    names = CONFIG.linear_names()
    for group in {fused_group(n) for n in names}:
        members = [n for n in names if fused_group(n) == group]
        pattern = group_pattern(group, members)
        assert [n for n in names if fnmatch.fnmatchcase(n, pattern)] == members


def test_unit_patterns_match_exactly_their_members():
    """--sensitivity's units are scheme groups: a MoE layer's routed experts (gate, up and down of
    every expert) are one unit, whose keep-BF16 patterns name exactly them."""
    import fnmatch

    import transformers

    from nvfp4tool.config import ModelConfig
    from nvfp4tool.families import scheme_group
    from nvfp4tool.validate.sensitivity import unit_patterns

    from fixtures.hf_fixtures import TINY_SPECS

    cls, kw = TINY_SPECS["qwen3_moe"]
    names = ModelConfig.from_hf_config(getattr(transformers, cls)(**kw).to_dict()).linear_names()
    units = {scheme_group(n) for n in names}
    experts = [n for n in names if scheme_group(n) == "model.layers.0.mlp.experts"]
    assert len(experts) == 8 * 3 and {fused_group(n) for n in experts} > {"model.layers.0.mlp.experts.7.gate_up"}
    for unit in units:
        members = [n for n in names if scheme_group(n) == unit]
        patterns = unit_patterns(unit, members)
        assert [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)] == members


def test_threshold_options_are_reported_with_their_limits(paths, good):
    inputs, _ = good
    from nvfp4tool.validate.thresholds import Thresholds

    strict = dataclasses.replace(_options(paths), thresholds=Thresholds(max_kl_mean=1e-9))
    record = run_validation(dataclasses.replace(inputs, options=strict))
    assert [f.metric for f in record.failures] == ["kl_mean"]
    f = record.failures[0]
    assert f.by == pytest.approx(record.models["nvfp4"]["kl_mean"] - 1e-9)


def test_streamed_validation_reports_the_held_numbers(paths, good):
    """--offload always (every model streamed layer by layer) gives the held run's numbers."""
    held = good[1]
    with open_inputs(paths["nvfp4"], _options(paths, offload="always")) as inputs:
        record = run_validation(inputs)
        assert inputs.ran == {"bf16": "streamed", "nvfp4": "streamed", "fp8": "streamed"}
    assert held.generation.skipped is None and good[0].ran == {"bf16": "held", "nvfp4": "held", "fp8": "held"}
    assert record.models.keys() == held.models.keys()
    for label, metrics in held.models.items():
        for key, value in metrics.items():
            assert record.models[label][key] == pytest.approx(value, rel=1e-6, abs=1e-12), (label, key)
    assert [r.name for r in record.layers] == [r.name for r in held.layers]
    for streamed_row, held_row in zip(record.layers, held.layers):
        for label, value in held_row.output_sqnr_db.items():
            assert streamed_row.output_sqnr_db[label] == pytest.approx(value, rel=1e-6)
        assert streamed_row.weight_sqnr_db == held_row.weight_sqnr_db
    assert record.kl_histogram == held.kl_histogram
