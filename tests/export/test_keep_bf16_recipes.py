"""The keep-BF16 recipes shipped with the package (`nvfp4tool/data/keep_bf16-*.txt`): they parse, they
keep exactly what NVIDIA's published DeepSeek NVFP4 checkpoints keep, and `--keep-bf16-file NAME`
finds them.

The DeepSeek-V3 module names are written out by hand here from transformers' DeepseekV3 module tree
and the published config (61 layers, the first 3 dense, q_lora_rank 1536, 256 routed experts + 1
shared): the deepseek_v3 family is not on this branch yet to compute them from a config."""

from __future__ import annotations

import fnmatch
import re

import pytest

from nvfp4tool.export.plan import read_keep_bf16_file, shipped_keep_bf16_file, shipped_keep_bf16_files

LAYERS, DENSE, EXPERTS = 61, 3, 256
ATTENTION_LORA = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
ATTENTION_NO_LORA = ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")  # q_lora_rank null (V2-Lite)
MLP = ("gate_proj", "up_proj", "down_proj")


def deepseek_v3_linears(attention=ATTENTION_LORA) -> list[str]:
    names = []
    for i in range(LAYERS):
        names += [f"model.layers.{i}.self_attn.{p}" for p in attention]
        if i < DENSE:
            names += [f"model.layers.{i}.mlp.{p}" for p in MLP]
            continue
        names.append(f"model.layers.{i}.mlp.gate")  # the router
        names += [f"model.layers.{i}.mlp.experts.{e}.{p}" for e in range(EXPERTS) for p in MLP]
        names += [f"model.layers.{i}.mlp.shared_experts.{p}" for p in MLP]
    return names + ["lm_head"]


def kept(names: list[str], patterns) -> set[str]:
    """The names some fnmatch pattern matches (one regex of them all: ~50k names x 62 patterns)."""
    matches = re.compile("|".join(fnmatch.translate(p) for p in patterns)).match
    return {n for n in names if matches(n)}


# nvidia/DeepSeek-R1-0528-NVFP4's hf_quant_config.json exclude_modules, as ModelOpt matches them
# (fnmatch): lm_head and every layer's self_attn*.
PUBLISHED_V1 = ["lm_head"] + [f"model.layers.{i}.self_attn*" for i in range(LAYERS)]


def test_shipped_recipes_parse_and_are_found_by_name():
    files = shipped_keep_bf16_files()
    assert sorted(files) == ["nvidia-deepseek-r1", "nvidia-deepseek-r1-v2"]
    assert list(read_keep_bf16_file(files["nvidia-deepseek-r1"])) == ["lm_head", "*.self_attn.*"]
    assert list(read_keep_bf16_file(files["nvidia-deepseek-r1-v2"])) == [
        "lm_head",
        "*.self_attn.q_*proj",
        "*.self_attn.kv_*proj*",
    ]
    for name, path in files.items():
        with open(path) as f:
            header = f.read()
        assert "https://huggingface.co/nvidia/DeepSeek-R1-0528" in header and "ptq.py" in header, name
        assert shipped_keep_bf16_file(name) == path


def test_v1_recipe_keeps_what_nvidias_published_exclude_modules_keep():
    names = deepseek_v3_linears()
    ours = kept(names, read_keep_bf16_file(shipped_keep_bf16_files()["nvidia-deepseek-r1"]))
    assert ours == kept(names, PUBLISHED_V1)
    assert len(ours) == LAYERS * len(ATTENTION_LORA) + 1  # every MLA linear and lm_head, no MLP / expert


@pytest.mark.parametrize("attention", [ATTENTION_LORA, ATTENTION_NO_LORA], ids=["q_lora", "q_proj"])
def test_v2_recipe_quantizes_o_proj_too(attention):
    """ptq.py's default: "*attn*" disabled, then "*wo*" (o_proj) quantized."""
    names = deepseek_v3_linears(attention)
    ours = kept(names, read_keep_bf16_file(shipped_keep_bf16_files()["nvidia-deepseek-r1-v2"]))
    assert ours == kept(names, PUBLISHED_V1) - {n for n in names if n.endswith(".self_attn.o_proj")}
    assert all(any(fnmatch.fnmatchcase(n, p) for n in names) for p in ("*.self_attn.q_*proj", "*.self_attn.kv_*proj*"))


def test_export_takes_a_recipe_by_name_and_a_file_of_that_name_wins(tmp_path, monkeypatch):
    """The export API's rule accepts the names (and files), the job resolves a name to the shipped
    file unless a file of that name exists; the CLI refuses an unknown name as bad usage."""
    from click.testing import CliRunner

    from nvfp4tool import api
    from nvfp4tool.api.rules import rule
    from nvfp4tool.cli import cli
    from nvfp4tool.export import ExportOptions
    from nvfp4tool.export.job import prepare_job

    from fixtures.export_fixtures import synthetic_config, write_synthetic_hf_folder

    src = str(tmp_path / "hf")
    write_synthetic_hf_folder(src, synthetic_config(hidden=64, mlp=128, layers=2, vocab=64, head_dim=16), seed=0)
    check = rule(api.export, "keep_bf16_file").problem
    assert check("nvidia-deepseek-r1") is None and check(src + "/config.json") is None
    assert "nvidia-deepseek-r1-v2" in check("nvidia-deepseek-r2")
    options = ExportOptions(quant="nvfp4-weight-only", keep_bf16_file="nvidia-deepseek-r1", show_progress=False)
    job = prepare_job(src, str(tmp_path / "out"), options)
    assert set(job.plan.excluded) == {n for n in job.source.config.linear_names() if ".self_attn." in n} | {"lm_head"}
    monkeypatch.chdir(tmp_path)
    (tmp_path / "nvidia-deepseek-r1").write_text("lm_head\n")  # a file of the recipe's name wins
    assert shipped_keep_bf16_file("nvidia-deepseek-r1") is None
    assert prepare_job(src, str(tmp_path / "out"), options).plan.excluded == ("lm_head",)
    result = CliRunner().invoke(cli, ["export", src, "--out", "o", "--keep-bf16-file", "nvidia-deepseek-r2"])
    assert result.exit_code == 2 and "not an existing file or one of nvidia-deepseek-r1" in result.output
