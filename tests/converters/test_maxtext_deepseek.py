"""MaxText <-> HF conversion of DeepSeek-V3 (MLA + DeepSeekMoE), scanned and unscanned.

* HF -> MaxText -> HF is byte-identical (the tiny fixture with q_lora_rank set and null: 1 dense
  layer of 3, fp32 MaxText storage).
* The MaxText tree our writer saves restores with plain Orbax to exactly the tree `_script_tree`
  builds from the HF files: a numpy reading of MaxText's own converter
  (checkpoint_conversion/standalone_scripts/convert_deepseek_family_ckpt.py, written out here, no
  code copied): `decoder/dense_layers` and `decoder/moe_layers` stacked separately on axis 1,
  `self_attention/{wq_a,wq_b,q_norm,wkv_a,wkv_b,kv_norm,out}` (or `query`), the routed experts
  `DeepSeekMoeBlock_0/MoeBlock_0/wi_0 [X, L, E, F]`, the router `gate/kernel` and its `gate/bias`,
  `shared_experts/wi_0/kernel`; unscanned `decoder/dense_layers_{j}` / `moe_layers_{j}` (the
  correction bias whatever q_lora_rank is: the script's q_lora_rank test stands for DeepSeek-V2-Lite,
  which has none; docs/design/maxtext-layout.md).
* That tree, saved by a plain Orbax CheckpointManager, converts back to the HF files' bytes.
* MaxText's name `deepseek3-671b` is DeepSeek-V3's geometry (671B / 37B), and its scanned
  parameters have the shapes the script builds for it.
* rope_interleave=false is refused in one line naming the family and the field.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from test_maxtext import _assert_trees_equal, _convert
from test_maxtext_moe import _assert_folders_identical

from nvfp4tool.cli import cli

from fixtures.deepseek_fixtures import LORA, NO_LORA, hf_folder
from fixtures.maxtext_fixture import save_maxtext_checkpoint

pytestmark = pytest.mark.peers
torch = pytest.importorskip("torch")

_WI = (("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj"))  # MaxText = HF gate / up / down
CASES = [(key, scanned) for key in ("lora", "no_lora") for scanned in (True, False)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_deepseek")
    return {"lora": hf_folder(root, LORA, 0)[0], "no_lora": hf_folder(root, NO_LORA, 1)[0]}


def _hf_tensors(folder: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(f"{folder}/model.safetensors")


def _script_tree(folder: str, scanned: bool) -> dict:
    """MaxText's params tree as its DeepSeek converter lays it out, from the HF files (fp32)."""
    hf = json.load(open(f"{folder}/config.json"))
    t = {k: v.astype(np.float32) for k, v in _hf_tensors(folder).items()}
    N, E, k = hf["num_attention_heads"], hf["hidden_size"], hf["first_k_dense_replace"]
    nope, rope, v, R = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"], hf["kv_lora_rank"]

    def layer(i: int) -> dict:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        attn = {
            "kv_norm": {"scale": t[a + "kv_a_layernorm.weight"]},
            "wkv_a": {"kernel": t[a + "kv_a_proj_with_mqa.weight"].T},
            "wkv_b": {"kernel": t[a + "kv_b_proj.weight"].T.reshape(R, N, nope + v)},
            "out": {"kernel": t[a + "o_proj.weight"].T.reshape(N, v, E)},
        }
        if hf["q_lora_rank"]:
            attn["q_norm"] = {"scale": t[a + "q_a_layernorm.weight"]}
            attn["wq_a"] = {"kernel": t[a + "q_a_proj.weight"].T}
            attn["wq_b"] = {"kernel": t[a + "q_b_proj.weight"].T.reshape(hf["q_lora_rank"], N, nope + rope)}
        else:
            attn["query"] = {"kernel": t[a + "q_proj.weight"].T.reshape(E, N, nope + rope)}
        out = {
            "self_attention": attn,
            "pre_self_attention_layer_norm": {"scale": t[p + "input_layernorm.weight"]},
            "post_self_attention_layer_norm": {"scale": t[p + "post_attention_layernorm.weight"]},
        }
        m = p + "mlp."
        if i < k:
            out["mlp"] = _swiglu(t, m)
            return out
        experts = range(hf["n_routed_experts"])
        routed = {x: np.stack([t[f"{m}experts.{e}.{h}.weight"].T for e in experts]) for x, h in _WI}
        routed["gate"] = {"kernel": t[m + "gate.weight"].T, "bias": t[m + "gate.e_score_correction_bias"]}
        out["DeepSeekMoeBlock_0"] = {"MoeBlock_0": routed, "shared_experts": _swiglu(t, m + "shared_experts.")}
        return out

    stacks = {"dense_layers": range(0, k), "moe_layers": range(k, hf["num_hidden_layers"])}
    decoder = {"decoder_norm": {"scale": t["model.norm.weight"]}, "logits_dense": {"kernel": t["lm_head.weight"].T}}
    for name, layers in stacks.items():
        trees = [layer(i) for i in layers]
        if scanned:  # the layer axis at 1 (the routed experts: after the experts axis)
            decoder[name] = _stack(trees)
        else:
            decoder.update({f"{name}_{j}": tree for j, tree in enumerate(trees)})
    return {"decoder": decoder, "token_embedder": {"embedding": t["model.embed_tokens.weight"]}}


def _swiglu(t: dict[str, np.ndarray], prefix: str) -> dict:
    """A SwiGLU MLP's MaxText kernels: gate/up/down transposed as wi_0 / wi_1 / wo."""
    return {x: {"kernel": t[f"{prefix}{h}.weight"].T} for x, h in _WI}


def _stack(trees: list) -> dict | np.ndarray:
    if isinstance(trees[0], dict):
        return {key: _stack([tree[key] for tree in trees]) for key in trees[0]}
    return np.stack(trees, axis=1)


@pytest.mark.parametrize("key,scanned", CASES)
def test_hf_to_maxtext_to_hf_is_byte_identical_and_the_tree_is_maxtexts(folders, tmp_path, key, scanned):
    import orbax.checkpoint as ocp

    folder = folders[key]
    flag = "--scan-layers" if scanned else "--no-scan-layers"
    _convert(folder, str(tmp_path / "mt"), "--to", "maxtext", flag)
    _convert(str(tmp_path / "mt"), str(tmp_path / "back"), "--to", "hf", "--model-config", folder)
    _assert_folders_identical(folder, str(tmp_path / "back"))

    restored = ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).restore(str(tmp_path / "mt" / "0" / "items"))
    _assert_trees_equal(restored["params"]["params"], _script_tree(folder, scanned))


@pytest.mark.parametrize("scanned", [True, False])
def test_the_scripts_tree_saved_by_plain_orbax_reads_back_as_the_hf_files(folders, tmp_path, scanned):
    """The reader against the independent tree (chunked as Orbax's defaults chunk it, with an
    optimizer state beside it): the HF folder it converts to holds the original's bytes."""
    folder = folders["lora"]
    save_maxtext_checkpoint(str(tmp_path / "mt"), _script_tree(folder, scanned), scanned=scanned)
    _convert(str(tmp_path / "mt"), str(tmp_path / "hf"), "--to", "hf", "--model-config", folder)
    _assert_folders_identical(folder, str(tmp_path / "hf"))


def test_deepseek3_671b_is_the_scripts_geometry_with_its_stacked_shapes():
    from converters import layout, maxtext_models
    from nvfp4tool.config import ModelConfig
    from nvfp4tool.families.deepseek_v3 import parameter_count

    config = ModelConfig.from_hf_config(maxtext_models.maxtext_hf_config("deepseek3-671b"))
    assert parameter_count(config) == (671_026_419_200, 37_552_297_472)
    shapes = {
        "/".join(layout.placement(rule, config, scanned=True, layer=layout.layers_of(rule, config)[0])[0]): (
            layout.maxtext_shape(rule, config, scanned=True)
        )
        for rule in layout.rules_for(config)
    }
    # MODEL_PARAMS_DICT["deepseek3-671b"] through the script's reshapes, the layer axis moved to 1
    dense, moe = "decoder/dense_layers", "decoder/moe_layers"
    want = {
        f"{dense}/self_attention/wq_a/kernel": (7168, 3, 1536),
        f"{dense}/self_attention/wq_b/kernel": (1536, 3, 128, 192),
        f"{dense}/self_attention/wkv_a/kernel": (7168, 3, 576),
        f"{dense}/self_attention/kv_norm/scale": (512, 3),
        f"{dense}/self_attention/wkv_b/kernel": (512, 3, 128, 256),
        f"{dense}/self_attention/out/kernel": (128, 3, 128, 7168),
        f"{dense}/mlp/wi_0/kernel": (7168, 3, 18432),
        f"{dense}/mlp/wo/kernel": (18432, 3, 7168),
        f"{moe}/self_attention/wq_b/kernel": (1536, 58, 128, 192),
        f"{moe}/pre_self_attention_layer_norm/scale": (7168, 58),
        f"{moe}/DeepSeekMoeBlock_0/MoeBlock_0/gate/kernel": (7168, 58, 256),
        f"{moe}/DeepSeekMoeBlock_0/MoeBlock_0/gate/bias": (256, 58),
        f"{moe}/DeepSeekMoeBlock_0/MoeBlock_0/wi_0": (256, 58, 7168, 2048),
        f"{moe}/DeepSeekMoeBlock_0/MoeBlock_0/wo": (256, 58, 2048, 7168),
        f"{moe}/DeepSeekMoeBlock_0/shared_experts/wi_1/kernel": (7168, 58, 2048),
        "decoder/logits_dense/kernel": (7168, 129280),
        "token_embedder/embedding": (129280, 7168),
    }
    assert {k: shapes[k] for k in want} == want
    # embedding, final norm, lm_head; per stack 2 norms + 7 MLA (no q_proj); dense MLP 3; router, bias,
    # 3 experts, 3 shared
    assert len(shapes) == 3 + 2 * 9 + 3 + 1 + 1 + 3 + 3


def test_rope_interleave_false_is_refused_in_one_line(folders, tmp_path):
    import shutil

    folder = str(tmp_path / "half")
    shutil.copytree(folders["lora"], folder)
    hf = json.load(open(f"{folder}/config.json"))
    json.dump(dict(hf, rope_interleave=False), open(f"{folder}/config.json", "w"))
    result = CliRunner().invoke(cli, ["convert", folder, str(tmp_path / "mt"), "--to", "maxtext"])
    assert result.exit_code == 1, result.output
    assert "deepseek_v3 with rope_interleave=false has no MaxText layout" in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert not (tmp_path / "mt").exists()
