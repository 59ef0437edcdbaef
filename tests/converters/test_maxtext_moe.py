"""MaxText <-> HF conversion of mixture-of-experts models (Mixtral, Qwen3-MoE), scanned and unscanned.

* HF -> MaxText -> HF is byte-identical (bf16 and fp32 sources, fp32 MaxText storage; fp32 only
  because the fixtures' query scales are exact: mixtral's head_dim 16 gives 1/4, qwen3_moe none).
* The MaxText side, checked independently of our reader: our writer's checkpoint restores with
  plain Orbax to exactly the tree `maxtext_fixture` builds from transformers' in-memory (fused)
  experts with its own layout code; and that fixture tree, saved by a plain CheckpointManager
  (chunks spanning experts and layers), converts to an HF folder whose transformers logits equal the
  original model's. Read back by `MaxTextSource`, our JAX model gives transformers' logits too.
* The tiny qwen3_moe fixture has a dense layer (`mlp_only_layers=[1]`), which MaxText's Qwen3-MoE
  decoder cannot hold: both directions refuse it with one line naming the option. The
  Qwen3-MoE round trips use the same config with `mlp_only_layers=[]` (built here).
* A NaN in one expert's stored values is one line naming the array, the expert and the layer.
"""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner
from test_maxtext import _assert_trees_equal, _convert, _our_logits, _torch_logits

from nvfp4tool.cli import cli
from nvfp4tool.families.moe import Experts

from fixtures import hf_fixtures
from fixtures.maxtext_fixture import maxtext_params_from_state_dict, record_array_opens, save_maxtext_checkpoint

pytestmark = pytest.mark.peers
torch = pytest.importorskip("torch")

SPARSE_QWEN = "qwen3_moe_all_sparse"
# key -> (MaxText RoutedMoE name, query kernel pre-scaled, stored arrays scanned / unscanned):
# mixtral 2 layers: embedding, final norm, lm_head + per layer 2 norms, q, k, v, o, router, wi_0,
# wi_1, wo; qwen3 3 layers: + q and k norms per layer.
FAMILIES = {"mixtral": ("MoeBlock_0", True, (13, 3 + 10 * 2)), SPARSE_QWEN: ("moe_block", False, (15, 3 + 12 * 3))}
CASES = [(key, scanned) for key in FAMILIES for scanned in (True, False)]


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    """key -> (fp32 folder, bf16 folder, torch fp32 model) for mixtral and all-sparse qwen3_moe,
    plus "qwen3_moe" (the mixed fixture) as (fp32 folder, None, None)."""
    root = tmp_path_factory.mktemp("hf_moe")
    name, kwargs = hf_fixtures.TINY_SPECS["qwen3_moe"]
    out = {"qwen3_moe": (hf_fixtures.build_tiny_model("qwen3_moe", str(root / "qwen3_moe")), None, None)}
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(hf_fixtures.TINY_SPECS, SPARSE_QWEN, (name, dict(kwargs, mlp_only_layers=[])))
        for key in FAMILIES:
            out[key] = (
                hf_fixtures.build_tiny_model(key, str(root / f"{key}-fp32")),
                hf_fixtures.build_tiny_model(key, str(root / f"{key}-bf16"), dtype="bfloat16"),
                hf_fixtures.build_torch_model(key),
            )
    return out


def _fixture_params(torch_model, config, key: str, scanned: bool) -> dict:
    block, scale_query, _ = FAMILIES[key]
    return maxtext_params_from_state_dict(
        torch_model.state_dict(),
        num_layers=config.num_layers,
        head_dim=config.head_dim,
        scanned=scanned,
        interleaved=False,
        tied=False,
        moe_block=block,
        scale_query=scale_query,
    )


def _assert_folders_identical(original_dir: str, back_dir: str) -> None:
    from converters.hf import HFFolderSource

    original, back = HFFolderSource(original_dir), HFFolderSource(back_dir)
    assert back.names() == original.names()
    for name in original.names():
        a, b = original.get(name), back.get(name)
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), name


@pytest.mark.parametrize("key,scanned", CASES)
def test_hf_to_maxtext_to_hf_is_byte_identical_and_the_tree_is_maxtexts(
    moe_models, tmp_path, key, scanned, monkeypatch
):
    import orbax.checkpoint as ocp

    from converters.maxtext import MaxTextSource
    from nvfp4tool.config import ModelConfig

    folder_fp32, folder_bf16, torch_model = moe_models[key]
    flag = "--scan-layers" if scanned else "--no-scan-layers"
    for folder, name in ((folder_bf16, "bf16"), (folder_fp32, "fp32")):
        _convert(folder, str(tmp_path / f"mt-{name}"), "--to", "maxtext", "--rope-layout", "half", flag)
        _convert(
            str(tmp_path / f"mt-{name}"),
            str(tmp_path / f"back-{name}"),
            "--to",
            "hf",
            "--model-config",
            folder,
            "--rope-layout",
            "half",
        )
        _assert_folders_identical(folder, str(tmp_path / f"back-{name}"))

    config = ModelConfig.from_hf_folder(folder_fp32)
    items = str(tmp_path / "mt-fp32" / "0" / "items")
    restored = ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).restore(items)
    _assert_trees_equal(restored["params"]["params"], _fixture_params(torch_model, config, key, scanned))

    # Read back expert by expert: our writer chunks experts arrays one expert (and layer) per chunk,
    # so no array is re-chunked into scratch and each is opened once.
    opened = record_array_opens(monkeypatch)
    source = MaxTextSource(str(tmp_path / "mt-fp32"), config, "half")
    assert source.scanned is scanned
    np.testing.assert_allclose(_our_logits(config, source), _torch_logits(torch_model), rtol=0, atol=1e-4)
    assert len(opened) == len(set(opened)) == FAMILIES[key][2][0 if scanned else 1], opened
    assert all(name.startswith("params.params.") for name in opened), opened  # none in scratch


@pytest.mark.parametrize("key,scanned", CASES)
def test_fixture_checkpoint_converts_to_hf_with_the_original_logits(moe_models, tmp_path, key, scanned):
    from nvfp4tool.config import ModelConfig

    folder, _, torch_model = moe_models[key]
    config = ModelConfig.from_hf_folder(folder)
    save_maxtext_checkpoint(str(tmp_path / "mt"), _fixture_params(torch_model, config, key, scanned), scanned=scanned)
    _convert(
        str(tmp_path / "mt"), str(tmp_path / "hf"), "--to", "hf", "--model-config", folder, "--rope-layout", "half"
    )
    np.testing.assert_allclose(_torch_logits(str(tmp_path / "hf")), _torch_logits(torch_model), rtol=0, atol=1e-4)


@pytest.mark.parametrize("direction", ["to_maxtext", "to_hf"])
def test_qwen3_moe_with_dense_layers_is_refused_naming_the_option(moe_models, tmp_path, direction):
    mixed = moe_models["qwen3_moe"][0]
    if direction == "to_maxtext":
        args = [mixed, str(tmp_path / "out"), "--to", "maxtext", "--rope-layout", "half"]
    else:  # a MaxText checkpoint read with the mixed config
        _convert(moe_models[SPARSE_QWEN][0], str(tmp_path / "mt"), "--to", "maxtext", "--rope-layout", "half")
        args = [
            str(tmp_path / "mt"),
            str(tmp_path / "out"),
            "--to",
            "hf",
            "--model-config",
            mixed,
            "--rope-layout",
            "half",
        ]
    result = CliRunner().invoke(cli, ["convert", *args])
    assert result.exit_code == 1, result.output
    message = result.output.strip().splitlines()[-1]
    assert "dense layers [1] (mlp_only_layers=[1], decoder_sparse_step=1) has no MaxText layout" in message
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "scanned,where",
    [(True, "decoder/layers/MoeBlock_0/wi_1 expert 2 layer 1"), (False, "decoder/layers_1/MoeBlock_0/wi_1 expert 2")],
)
def test_a_non_finite_expert_value_is_one_line_naming_array_expert_and_layer(tmp_path, scanned, where):
    import glob
    import os

    from converters.hf import write_hf_folder
    from converters.maxtext import write_maxtext
    from converters.tensor_source import DictTensorSource
    from nvfp4tool.config import ModelConfig

    config = ModelConfig(
        family="mixtral",
        vocab_size=48,
        hidden_size=32,
        intermediate_size=24,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        dtype="float32",
        family_config=Experts(num_experts=3, num_experts_per_tok=2, norm_topk_prob=True),
    )
    rng = np.random.default_rng(0)
    tensors = {n: rng.standard_normal(s).astype(np.float32) for n, s in config.expected_tensor_shapes().items()}
    write_hf_folder(str(tmp_path / "hf"), config, DictTensorSource(tensors), dtype=None)
    mt = str(tmp_path / "mt")
    write_maxtext(mt, config, DictTensorSource(tensors), rope_layout="half", scan_layers=scanned)
    # expert 2's w3 (up) of layer 1 as stored: transposed, [E, F]; find its first values on disk
    w3 = tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    pattern = np.ascontiguousarray(w3.T).tobytes()[:16]
    hits = [
        (path, data.find(pattern))
        for path in glob.glob(os.path.join(mt, "**", "d", "*"), recursive=True)
        for data in [open(path, "rb").read()]
        if pattern in data
    ]
    assert len(hits) == 1, hits
    with open(hits[0][0], "r+b") as f:
        f.seek(hits[0][1])
        f.write(np.float32(np.nan).tobytes())
    result = CliRunner().invoke(
        cli,
        [
            "convert",
            mt,
            str(tmp_path / "out"),
            "--to",
            "hf",
            "--model-config",
            str(tmp_path / "hf"),
            "--rope-layout",
            "half",
        ],
    )
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]  # after progress lines
    assert errors == [
        f"Error: {mt}: parameter params/params/{where} has 1 non-finite value (NaN or inf), e.g. nan at index [0, 0]"
    ], result.output
    assert result.stdout == "" and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("key", FAMILIES)
def test_the_family_fixes_the_rope_layout(moe_models, tmp_path, key):
    """MaxText's Mixtral and Qwen3-MoE decoders are half-split: both directions take the layout from
    the family without `--rope-layout` (an HF config, not a MaxText name), writing what
    `--rope-layout half` writes; `--rope-layout interleaved` is refused (test_adversarial_convert.py)."""
    import orbax.checkpoint as ocp

    folder = moe_models[key][0]
    _convert(folder, str(tmp_path / "mt"), "--to", "maxtext")
    _convert(folder, str(tmp_path / "mt-half"), "--to", "maxtext", "--rope-layout", "half")
    restore = ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).restore
    _assert_trees_equal(
        restore(str(tmp_path / "mt" / "0" / "items"))["params"]["params"],
        restore(str(tmp_path / "mt-half" / "0" / "items"))["params"]["params"],
    )
    _convert(str(tmp_path / "mt"), str(tmp_path / "back"), "--to", "hf", "--model-config", folder)
    _assert_folders_identical(folder, str(tmp_path / "back"))


def test_the_reader_and_the_writer_refuse_interleaved_for_a_fixed_family(tmp_path):
    """Under the commands' exit-2 refusal, the library guards itself too: nothing is read or written."""
    from converters import maxtext_models
    from converters.maxtext import MaxTextSource, write_maxtext
    from converters.tensor_source import DictTensorSource
    from nvfp4tool.config import ModelConfig
    from nvfp4tool.errors import NVFP4ToolError

    for name in ("mixtral-8x7b", "qwen3-30b-a3b"):
        config = ModelConfig.from_hf_config(maxtext_models.maxtext_hf_config(name))
        with pytest.raises(
            NVFP4ToolError, match=f"RoPE layout 'interleaved' for {config.family}, whose MaxText decoder fixes 'half'"
        ):
            write_maxtext(str(tmp_path / "out"), config, DictTensorSource({}), rope_layout="interleaved")
        with pytest.raises(NVFP4ToolError, match="RoPE layout 'interleaved'"):
            MaxTextSource(str(tmp_path / "nowhere"), config, "interleaved")
    assert list(tmp_path.iterdir()) == []
