"""`check` reads config.json and the tensors as the loaders do (issue 21): the good paths and what the
report holds. The refusals themselves are in test_adversarial_check.py."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
from click.testing import CliRunner
from safetensors.numpy import save_file

from converters.hf import scan_safetensors_header
from nvfp4tool.check import check_checkpoint
from nvfp4tool.cli import cli
from nvfp4tool.formats import SPECS

from fixtures.serving_fixtures import build_checkpoint, write_checkpoint

LAYERS = 2
CT = ("compressed-tensors", "nvfp4")


def _with_kv_scales(fmt: str = CT[0], quant: str = CT[1], *, announce: bool = True, layers=range(LAYERS)):
    """The serving fixture with FP8 KV-cache scales (k = 0.01 * (i + 1), v = 0.02 * (i + 1)) under
    the layout's names, the configs announcing them (`announce`)."""
    ckpt = build_checkpoint(fmt, quant)
    spec = SPECS[(fmt, quant)]
    for i in layers:
        k, v = spec.kv_scales.names(f"model.layers.{i}.self_attn")
        ckpt.tensors[k] = np.full(spec.kv_scales.shape, 0.01 * (i + 1), np.float32)
        ckpt.tensors[v] = np.full(spec.kv_scales.shape, 0.02 * (i + 1), np.float32)
    if announce:
        qc = spec.quantization_config(("lm_head",), kv_cache="fp8")
        ckpt.config["quantization_config"]["kv_cache_scheme"] = qc["kv_cache_scheme"]
    return ckpt


def test_kv_scales_are_listed_in_the_report_the_json_and_the_table(tmp_path):
    folder = write_checkpoint(tmp_path / "kv", _with_kv_scales())
    report = check_checkpoint(folder)
    assert report.ok, [p.line() for p in report.problems]
    assert report.kv_cache == "fp8"
    got = {(s.attention, s.which): (s.tensor, s.dtype, s.value, s.ok) for s in report.kv_scales}
    assert got == {
        (f"model.layers.{i}.self_attn", w): (
            f"model.layers.{i}.self_attn.{w}_scale",
            "F32",
            float(np.float32(f * (i + 1))),
            True,
        )
        for i in range(LAYERS)
        for w, f in (("k", 0.01), ("v", 0.02))
    }
    assert "FP8 KV-cache scales of 2 layers" in report.summary_line()

    result = CliRunner().invoke(cli, ["check", folder, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["kv_cache"] == "fp8" and len(data["kv_scales"]) == 2 * LAYERS
    assert data["kv_scales"][0] == {
        "attention": "model.layers.0.self_attn",
        "which": "k",
        "tensor": "model.layers.0.self_attn.k_scale",
        "dtype": "F32",
        "shape": [1],
        "value": float(np.float32(0.01)),
        "ok": True,
    }
    table = CliRunner().invoke(cli, ["check", folder])
    assert table.exit_code == 0, table.output
    assert "FP8 KV-cache scales" in table.output and "model.layers.1.self_attn" in table.output


def test_a_broken_kv_scale_is_listed_as_not_ok(tmp_path):
    ckpt = _with_kv_scales()
    ckpt.tensors["model.layers.1.self_attn.v_scale"] = np.zeros(1, np.float32)
    report = check_checkpoint(write_checkpoint(tmp_path / "kv", ckpt))
    assert [p.tensor for p in report.problems] == ["model.layers.1.self_attn.v_scale"]
    assert [s.tensor for s in report.kv_scales if not s.ok] == ["model.layers.1.self_attn.v_scale"]


def test_no_kv_cache_lists_no_scales(tmp_path):
    report = check_checkpoint(write_checkpoint(tmp_path / "plain", build_checkpoint("modelopt", "nvfp4")))
    assert report.ok and report.kv_cache is None and report.kv_scales == []
    assert report.to_dict()["kv_scales"] == [] and "KV-cache" not in report.summary_line()


def test_kv_scales_of_a_layer_the_model_lacks_are_the_model_checks(tmp_path):
    # Announced or not (then every scale is also unannounced), a scale of layer 2 in a 2-layer model
    # is named as not the model's.
    for announce in (True, False):
        ckpt = _with_kv_scales(announce=announce, layers=range(LAYERS + 1))
        report = check_checkpoint(write_checkpoint(tmp_path / f"kv{announce}", ckpt))
        assert len(report.problems) == (1 if announce else 1 + 2 * LAYERS), [p.line() for p in report.problems]
        problem = next(p for p in report.problems if "layers.2" in p.tensor)
        assert problem.tensor == "model.layers.2.self_attn.k_scale, model.layers.2.self_attn.v_scale"
        assert "layer 2, but config.json's model has 2 layers" in problem.message
        assert len(report.kv_scales) == (2 * LAYERS if announce else 0)


def test_a_config_that_does_not_parse_is_the_first_problem_and_no_model_check(tmp_path):
    ckpt = build_checkpoint("modelopt", "nvfp4")
    ckpt.config["num_attention_heads"] = 4.0
    del ckpt.tensors["model.norm.weight"]  # would be reported by the model check
    report = check_checkpoint(write_checkpoint(tmp_path / "c", ckpt))
    assert not report.model_checked and len(report.problems) == 1
    assert report.problems[0].line().startswith("<config>: config.json: num_attention_heads must be an integer")


def test_every_tensor_belongs_to_the_model(tmp_path):
    ckpt = build_checkpoint("modelopt", "fp8")
    ckpt.tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, ml_dtypes.bfloat16)
    report = check_checkpoint(write_checkpoint(tmp_path / "c", ckpt))
    assert [p.tensor for p in report.problems] == ["model.layers.0.self_attn.rotary_emb.inv_freq"]
    assert "not a tensor of config.json's llama model" in report.problems[0].message


def test_metadata_format_pt_or_no_metadata_passes_other_formats_do_not(tmp_path):
    ckpt = build_checkpoint("compressed-tensors", "nvfp4-weight-only")
    folder = write_checkpoint(tmp_path / "pt", ckpt)  # {"format": "pt"}
    assert check_checkpoint(folder).ok
    save_file(ckpt.tensors, str(tmp_path / "pt" / "model.safetensors"))  # no __metadata__ at all
    assert check_checkpoint(folder).ok
    save_file(ckpt.tensors, str(tmp_path / "pt" / "model.safetensors"), metadata={"format": "np"})
    report = check_checkpoint(folder)
    assert [p.tensor for p in report.problems] == ["model.safetensors"]
    assert "format is 'np', not 'pt'" in report.problems[0].message
    # Only the serving rule: a source's reader does not care.
    path = str(tmp_path / "pt" / "model.safetensors")
    assert scan_safetensors_header(path)[1] == [] and len(scan_safetensors_header(path, serving=True)[1]) == 1


def test_an_extra_expert_is_judged_by_the_layers_experts_whatever_the_layer_kind():
    """The message about an expert tensor the model lacks reads the module table's experts of its
    layer, not one layer kind: the hybrid's "moe" layers (a kind other than attention+moe, as a
    new family's may be) were called dense."""
    from nvfp4tool.check.model import _why_not_in_model
    from nvfp4tool.train.presets import preset_config

    config = preset_config("tiny-hybrid-moe", 64, 128)  # ME-M*EME: layer 1 has 8 experts, layer 0 none
    spec = SPECS[CT]
    extra = _why_not_in_model("model.layers.1.mixer.experts.9.up_proj.weight", config, spec)
    assert extra.startswith("expert 9, but config.json's model has 8 experts per sparse layer (experts 0..7)")
    dense = _why_not_in_model("model.layers.0.mixer.experts.0.up_proj.weight", config, spec)
    assert dense.startswith("an expert of layer 0, which is dense")
