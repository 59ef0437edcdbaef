"""The family conformance suite: every family's tiny model (`conformance_fixtures.FAMILIES`: dense,
MoE, hybrid, hybrid MoE, Gemma 3, MLA) through the whole pipeline, CLI command after CLI command
in-process, each stage a test parametrized over the families and asserted as the per-family tests did:

train 2 steps with the NVFP4 recipe (finite losses, the weights moved, the MoE aux loss, the HF
folder with every tensor its config needs, the precision map and tracked input amax of every NVFP4
linear; the folder loads in transformers with our logits) -> export, each format x quant (W4A4 with
an FP8 KV cache, or its refusal in one line where the family has none) -> check at TP 1 and 2 (its
JSON names every linear: the run's NVFP4 linears quantized, every other excluded; the KV scales of
every attention; every expert calibrated) -> compressed-tensors' own NVFP4 decompression of every
module equals ours bit for bit -> validate against the BF16 source (finite numbers, the gates as
set, the simulated KV cache) -> eval (BF16, NVFP4 paired) -> push --dry-run (the card with both
tables). A family's own numerics and refusals stay in its own tests.
"""

from __future__ import annotations

import json
import math
import os

import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner

from nvfp4tool.checkpoints import open_checkpoint
from nvfp4tool.config import ModelConfig
from nvfp4tool.records.evaluation import EvalRecord
from nvfp4tool.records.export import ExportRecord
from nvfp4tool.train.metrics import read_metrics

from fixtures.conformance_fixtures import (
    EVAL_LIMIT,
    EVAL_TASKS,
    FAMILIES,
    FORMATS,
    QUANTS,
    SEQ,
    STEPS,
    THRESHOLDS,
    invoke,
)

pytestmark = pytest.mark.slow
EXPORTS = [(family, fmt, quant) for family in FAMILIES for fmt in FORMATS for quant in QUANTS]


def _trained(conformance, family: str) -> tuple[ModelConfig, dict[str, str]]:
    """The trained HF folder's config and the run's precision map (linear -> "nvfp4" / "bf16")."""
    hf = conformance.run(family) / "hf"
    return ModelConfig.from_hf_folder(str(hf)), json.loads((hf / "precision_map.json").read_text())


def _finite(values) -> bool:
    return all(math.isfinite(v) for v in values if isinstance(v, float))


@pytest.mark.parametrize("family", FAMILIES)
def test_train(conformance, family):
    run = conformance.run(family)
    records = read_metrics(run)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)) and _finite(r["loss"] for r in records), records
    hf = open_checkpoint(str(run / "hf"))
    config = hf.config
    assert sorted(hf.tensors.names()) == sorted(config.expected_tensor_shapes())
    source = open_checkpoint(conformance.source(family)).tensors
    moved = [  # the trained weights are not the source's rounded to the BF16 the run folder holds
        not np.array_equal(
            np.asarray(hf.tensors.get(n), np.float32),
            np.asarray(jnp.asarray(source.get(n), jnp.float32).astype(jnp.bfloat16), np.float32),
        )
        for n in (f"{m.name}.weight" for m in config.modules.linears)
        if n in hf.tensors.names()  # a tied lm_head is the embedding's
    ]
    assert sum(moved) > len(moved) // 2, moved
    if getattr(config.family_config, "router_aux_loss_coef", 0):  # the load-balancing loss is logged
        assert all(math.isfinite(r["aux_loss"]) and r["aux_loss"] > 0 for r in records), records
    _, pmap = _trained(conformance, family)
    linears = config.modules.linears
    assert set(pmap) == {m.name for m in linears}
    assert all(pmap[m.name] == "bf16" for m in linears if m.keep_dtype)  # routers, lm_head
    nvfp4 = {n for n, p in pmap.items() if p == "nvfp4"}
    assert nvfp4 and set(pmap.values()) == {"nvfp4", "bf16"}
    amax = json.loads((run / "hf" / "input_amax.json").read_text())
    assert set(amax) == nvfp4 and all(math.isfinite(v) and v >= 0 for v in amax.values())


@pytest.mark.peers
@pytest.mark.parametrize("family", FAMILIES)
def test_trained_model_loads_in_transformers_with_our_logits(conformance, family):
    torch = pytest.importorskip("torch")
    import transformers

    from converters.hf import HFFolderSource
    from nvfp4tool.model import forward, model_from_tensors

    hf = str(conformance.run(family) / "hf")
    config = ModelConfig.from_hf_folder(hf)
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 10))
    with torch.no_grad():
        want = reference(input_ids=torch.from_numpy(ids)).logits.numpy()
    got = np.asarray(forward(model_from_tensors(config, HFFolderSource(hf)), jnp.asarray(ids)))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family,fmt,quant", EXPORTS)
def test_export_passes_check_naming_every_linear(conformance, family, fmt, quant, tmp_path):
    folder = conformance.export(family, fmt, quant)
    invoke("check", folder, "--tp", "1,2", "--json-out", tmp_path / "check.json")
    report = json.loads((tmp_path / "check.json").read_text())
    assert report["ok"] and (report["format"], report["quant"], report["tp"]) == (fmt, quant, [1, 2])
    config, pmap = _trained(conformance, family)
    stored = config.family_spec.checkpoint_name
    quantized = {m["module"] for m in report["modules"]}
    assert quantized == {stored(n) for n, p in pmap.items() if p == "nvfp4"}
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    excluded = set(qc.get("ignore", qc.get("exclude_modules")))
    assert excluded == {stored(n) for n, p in pmap.items() if p == "bf16"}  # lm_head, routers, BF16 blocks
    assert {m["bits_per_param"] for m in report["modules"]} == {8.0 if quant == "fp8" else 4.5}
    attentions = [a for a in map(config.modules.attention, range(config.num_layers)) if a]
    if quant == "nvfp4" and not conformance.kv_problem(family):  # the FP8 KV cache: k and v scales of every attention
        assert report["kv_cache"] == "fp8" and all(s["ok"] for s in report["kv_scales"])
        assert sorted((s["attention"], s["which"]) for s in report["kv_scales"]) == sorted(
            (stored(a), w) for a in attentions for w in "kv"
        )
    else:
        assert report["kv_cache"] is None
    calibration = ExportRecord.read(str(folder)).calibration
    if quant != "nvfp4-weight-only" and config.router_names() and calibration.routed_tokens is not None:
        # every expert calibrated on all tokens, its routed tokens counted by name (a hybrid's
        # export counts none: export/calibrate.py's Tally does not route Nemotron-H's router)
        experts = [e for router in config.router_names() for e in config.modules.experts(router)]
        assert calibration.all_experts and list(calibration.routed_tokens) == experts


def test_a_family_without_an_fp8_kv_cache_refuses_it_in_one_line(conformance, tmp_path):
    """Where the family builds no FP8 KV cache for its model (`Family.export_problem`: MLA caches its
    latent), `export --kv-cache fp8` says so in one line, exit 1, nothing written; the suite's W4A4
    export of that family is made without one."""
    from nvfp4tool.cli import cli

    refusing = {family: problem for family in FAMILIES if (problem := conformance.kv_problem(family))}
    assert refusing  # the MLA family
    for family, problem in refusing.items():
        out = tmp_path / family
        args = [
            "export",
            conformance.run(family),
            "--out",
            out,
            "--quant",
            "nvfp4",
            "--kv-cache",
            "fp8",
            *conformance.calib,
        ]
        result = CliRunner().invoke(cli, [str(a) for a in args])
        assert result.exit_code == 1, result.output
        errors = [line for line in result.output.splitlines() if line.startswith("Error")]
        assert errors == [f"Error: {problem}"] and family in problem, result.output
        assert not out.exists()


@pytest.mark.peers
@pytest.mark.parametrize("family", FAMILIES)
def test_compressed_tensors_decompresses_every_module_to_our_weights(conformance, family):
    """compressed-tensors' own NVFP4 decompression of each stored module (W4A4 and W4A16) equals our
    dequantization rounded to BF16, bit for bit but at BF16 rounding ties (`_assert_bf16_equal`)."""
    import torch
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from safetensors.torch import load_file

    from nvfp4tool.export.simulate import load_export

    scheme = preset_name_to_scheme("NVFP4", ["Linear"])
    for quant in ("nvfp4", "nvfp4-weight-only"):
        folder = str(conformance.export(family, "compressed-tensors", quant))
        ours = load_export(folder)
        stored = ours.config.family_spec.checkpoint_name
        tensors = load_file(os.path.join(folder, "model.safetensors"))
        assert ours.quantized
        for module in ours.quantized:
            state = {
                s: tensors[f"{stored(module)}.{s}"] for s in ("weight_packed", "weight_scale", "weight_global_scale")
            }
            theirs = NVFP4PackedCompressor.decompress(state, scheme)["weight"]
            _assert_bf16_equal(theirs.view(torch.uint16).numpy(), np.asarray(ours.dequantized(module)), (quant, module))


def _assert_bf16_equal(theirs: np.ndarray, mine: np.ndarray, where) -> None:
    """`theirs` (BF16 bits) is `mine` (fp32) rounded to BF16, but where `mine` lies within 2 fp32 ulps
    of a tie between two BF16 values, which it may break the other way: compressed-tensors divides
    code x block scale by weight_global_scale, we (as vLLM) multiply by its fp32 reciprocal, so the
    two fp32 products can differ in their last bit (a trained DeepSeek-V3 expert: 149 elements of
    one block row, 1.5 x 352 / 3171.0967 = 0.16650390 vs our 0.16650392, the tie 0.166503906)."""
    ours = np.asarray(jnp.asarray(mine).astype(jnp.bfloat16)).view(np.uint16)
    differ = theirs != ours
    if not differ.any():
        return
    assert np.all(np.abs(theirs[differ].astype(np.int32) - ours[differ]) == 1), where  # BF16 neighbours
    a, b = (np.left_shift(x[differ].astype(np.uint32), 16).view(np.float32) for x in (theirs, ours))
    tie = (a.astype(np.float64) + b) / 2
    near = np.abs(mine[differ] - tie) <= 2 * np.spacing(np.abs(mine[differ]).astype(np.float32))
    assert near.all(), (where, mine[differ][~near], tie[~near])


@pytest.mark.parametrize("family", FAMILIES)
def test_validate(conformance, family):
    folder = conformance.validated(family)
    record = json.loads((folder / "validation.json").read_text())
    assert record["passed"] and not record["failures"]
    set_as = {"min-layer-sqnr": "min_layer_sqnr_db"}
    assert {set_as.get(k, k.replace("-", "_")): v for k, v in THRESHOLDS.items()} == record["thresholds"]
    models = record["models"]
    fp8_kv = not conformance.kv_problem(family)
    assert set(models) == {"bf16", "nvfp4"} | ({"nvfp4+fp8-kv"} if fp8_kv else set())  # --reference bf16
    for label, metrics in models.items():
        assert metrics and _finite(metrics.values()), label
    if fp8_kv:
        assert models["nvfp4"]["kl_mean"] != models["nvfp4+fp8-kv"]["kl_mean"]  # the KV cache is simulated
    assert record["data"]["seq_len"] == SEQ and record["generation"]["skipped"] is None
    _, pmap = _trained(conformance, family)
    assert {layer["name"] for layer in record["layers"]} == {n for n, p in pmap.items() if p == "nvfp4"}
    for layer in record["layers"]:
        assert _finite(layer["weight_sqnr_db"].values()) and _finite(layer["output_sqnr_db"].values()), layer


# the families whose layers run different block programs (Gemma 3's local and global RoPE tables,
# MLA's latent projections): streamed layer by layer, each layer's program is looked up on its own
STREAMED = ("gemma3", "deepseek_v3")


@pytest.mark.parametrize("family", STREAMED)
def test_validate_streamed_equals_held(conformance, family, tmp_path):
    """validate on the W4A16 export (no KV cache to simulate twice over), held and streamed layer by
    layer: the same metrics; greedy generation held."""
    import shutil

    from nvfp4tool.validate.runner import ValidateOptions, validate_export
    from nvfp4tool.validate.thresholds import Thresholds

    quant = "nvfp4-weight-only"
    np.save(tmp_path / "val.npy", np.random.default_rng(5).integers(3, 256, (4, 24)))
    no_gates = Thresholds(
        max_kl_mean=None, max_kl_p99=None, min_top1=None, max_ppl_increase=None, min_layer_sqnr_db=None
    )
    records = {}
    for offload in ("never", "always"):
        folder = tmp_path / offload
        shutil.copytree(conformance.export(family, "compressed-tensors", quant), folder)
        options = ValidateOptions(
            data=str(tmp_path / "val.npy"),
            source=str(conformance.run(family)),
            samples=4,
            seq_len=24,
            batch_size=2,
            prompts=1,
            prompt_len=8,
            gen_tokens=4,
            offload=offload,
            reference="bf16",
            thresholds=no_gates,
        )
        records[offload] = validate_export(str(folder), options).record
    held, streamed = records["never"], records["always"]
    assert held.generation.skipped is None and held.generation.tokens == 4
    for metric in ("kl_mean", "top1", "ppl"):
        np.testing.assert_allclose(held.models[quant][metric], streamed.models[quant][metric], rtol=1e-5)
    assert 0 < held.models[quant]["kl_mean"] < 1
    assert [layer.name for layer in held.layers] == [layer.name for layer in streamed.layers]
    for a, b in zip(held.layers, streamed.layers, strict=True):  # each layer's program and RoPE table
        np.testing.assert_allclose(a.output_sqnr_db[quant], b.output_sqnr_db[quant], rtol=1e-4, err_msg=a.name)


@pytest.mark.parametrize("family", FAMILIES)
def test_eval(conformance, family):
    record = EvalRecord.read(str(conformance.evaluated(family)))
    assert record.labels == ["bf16", "nvfp4"] and record.limit == EVAL_LIMIT and record.passed
    task = record.tasks[EVAL_TASKS]
    assert task["metric"] == "acc" and set(task["paired"]) == {"nvfp4-bf16"}
    for label in record.labels:
        assert task[label]["n"] == EVAL_LIMIT and 0 <= task[label]["acc"] <= 1, label


@pytest.mark.parametrize("family", FAMILIES)
def test_push_dry_run(conformance, family, hub_env):
    folder = conformance.evaluated(family)
    conformance.validated(family)
    before = sorted(os.listdir(folder))
    output = invoke("push", folder, "--repo-id", f"org/{family}-nvfp4", "--dry-run")
    assert sorted(os.listdir(folder)) == before  # README.md goes into the upload only
    for name in before:
        assert name in output, name
    assert "| KL mean (nats) |" in output and "## Task accuracy" in output  # validate's and eval's tables
    assert f"| {EVAL_TASKS} | acc | {EVAL_LIMIT} |" in output
