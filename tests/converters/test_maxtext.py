"""MaxText <-> HF conversion end to end, against transformers and an independent MaxText fixture.

* An Orbax checkpoint built by `maxtext_fixture` (own layout code, plain CheckpointManager, with an
  opt_state) converts to an HF folder whose transformers logits equal the original's, and whose
  logits through our JAX model equal them too (max abs diff < 1e-4, fp32).
* Our writer's checkpoint restores with plain Orbax -- whole, and the way MaxText's
  `load_params_from_path` restores params -- to exactly the fixture's independent tree.
* HF -> MaxText -> HF is byte-identical for a bf16 model (fp32 MaxText storage), scanned and
  unscanned, both RoPE layouts; HF -> MaxText -> our model gives transformers' logits.
"""

from __future__ import annotations

import gc
import json
import os

import numpy as np
import pytest
from click.testing import CliRunner

from nvfp4tool.cli import cli

from fixtures.maxtext_fixture import maxtext_params_from_state_dict, record_array_opens, save_maxtext_checkpoint

pytestmark = pytest.mark.peers
torch = pytest.importorskip("torch")

VARIANTS = [(True, "half"), (True, "interleaved"), (False, "half"), (False, "interleaved")]
IDS_BxT = np.array([[5, 17, 99, 3, 250, 42, 7, 8, 9, 100, 11, 12], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """key -> (fp32 folder, bf16 folder, torch fp32 model) for the families MaxText stores."""
    from fixtures.hf_fixtures import build_tiny_model, build_torch_model

    root = tmp_path_factory.mktemp("hf")
    out = {}
    for key in ("llama3", "llama_tied"):
        fp32 = build_tiny_model(key, str(root / f"{key}-fp32"))
        bf16 = build_tiny_model(key, str(root / f"{key}-bf16"), dtype="bfloat16")
        out[key] = (fp32, bf16, build_torch_model(key))
    return out


def _convert(*args: str) -> None:
    result = CliRunner().invoke(cli, ["convert", *args])
    assert result.exit_code == 0, result.output
    assert "converted" in result.output


def _torch_logits(model_or_folder) -> np.ndarray:
    import transformers

    model = model_or_folder
    if isinstance(model_or_folder, str):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            model_or_folder, dtype=torch.float32, attn_implementation="eager"
        ).eval()
    with torch.no_grad():
        return model(torch.tensor(IDS_BxT)).logits.numpy()


def _our_logits(config, source) -> np.ndarray:
    from nvfp4tool.model import forward, model_from_tensors

    model = model_from_tensors(config, source)
    return np.asarray(forward(model, IDS_BxT, np.ones_like(IDS_BxT)))


@pytest.mark.parametrize("scanned,rope_layout", VARIANTS)
def test_fixture_checkpoint_converts_to_hf_with_the_original_logits(
    hf_models, tmp_path, scanned, rope_layout, monkeypatch
):
    from converters.hf import HFFolderSource
    from converters.maxtext import MaxTextSource
    from nvfp4tool.config import ModelConfig

    key = "llama3" if scanned else "llama_tied"
    folder, _, torch_model = hf_models[key]
    config = ModelConfig.from_hf_folder(folder)
    params = maxtext_params_from_state_dict(
        torch_model.state_dict(),
        num_layers=config.num_layers,
        head_dim=config.head_dim,
        scanned=scanned,
        interleaved=rope_layout == "interleaved",
        tied=config.tie_word_embeddings,
    )
    items = save_maxtext_checkpoint(str(tmp_path / "mt"), params, scanned=scanned)

    opened = record_array_opens(monkeypatch)
    # accepted forms: <base>, <base>/<step>, <base>/<step>/items
    src = {0: str(tmp_path / "mt"), 1: os.path.dirname(items), 2: items}[len(rope_layout) % 3]
    _convert(src, str(tmp_path / "hf"), "--to", "hf", "--model-config", folder, "--rope-layout", rope_layout)
    # Orbax's default chunks span the layers: each stack is re-chunked once into a scratch folder
    scratch = [p for p in opened if os.path.isabs(p)]
    from_checkpoint = [p for p in opened if not os.path.isabs(p)]
    assert len(from_checkpoint) == len(set(from_checkpoint)) == (12 if scanned else 1 + 1 + 9 * config.num_layers), (
        opened
    )
    assert all(name.startswith("params.params.") for name in from_checkpoint), opened  # no opt_state
    assert len(scratch) == (9 if scanned else 0)
    gc.collect()
    assert not any(os.path.exists(p) for p in scratch)  # removed with the source

    expected = _torch_logits(torch_model)
    np.testing.assert_allclose(_torch_logits(str(tmp_path / "hf")), expected, rtol=0, atol=1e-4)
    np.testing.assert_allclose(_our_logits(config, HFFolderSource(str(tmp_path / "hf"))), expected, rtol=0, atol=1e-4)
    source = MaxTextSource(src, config, rope_layout)
    assert source.scanned is scanned and source.custom_metadata == {"scan_layers": scanned}
    np.testing.assert_allclose(_our_logits(config, source), expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("scanned,rope_layout", VARIANTS)
def test_written_checkpoint_restores_with_plain_orbax_to_the_fixture_tree(hf_models, tmp_path, scanned, rope_layout):
    import jax
    import orbax.checkpoint as ocp

    from nvfp4tool.config import ModelConfig

    key = "llama3" if scanned else "llama_tied"
    folder, _, torch_model = hf_models[key]
    config = ModelConfig.from_hf_folder(folder)
    _convert(
        folder,
        str(tmp_path / "mt"),
        "--to",
        "maxtext",
        "--rope-layout",
        rope_layout,
        "--scan-layers" if scanned else "--no-scan-layers",
    )
    want = maxtext_params_from_state_dict(
        torch_model.state_dict(),
        num_layers=config.num_layers,
        head_dim=config.head_dim,
        scanned=scanned,
        interleaved=rope_layout == "interleaved",
        tied=config.tie_word_embeddings,
    )
    items = str(tmp_path / "mt" / "0" / "items")

    whole = ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).restore(items)
    assert set(whole) == {"step", "params"} and int(whole["step"]) == 0
    _assert_trees_equal(whole["params"]["params"], want)

    # MaxText's load_params_from_path: an abstract params collection with shardings, transforms={}
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = {"params": jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, np.float32, sharding=sharding), want)}
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True))
    restored = checkpointer.restore(
        items,
        item={"params": abstract},
        transforms={},
        restore_args={"params": ocp.checkpoint_utils.construct_restore_args(abstract)},
    )
    assert isinstance(jax.tree.leaves(restored)[0], jax.Array)
    _assert_trees_equal(restored["params"]["params"], want)

    manager = ocp.CheckpointManager(str(tmp_path / "mt"), item_names=("items",))
    assert manager.latest_step() == 0
    assert manager.metadata(0).custom_metadata == {"scan_layers": scanned}


@pytest.mark.parametrize("scanned,rope_layout", VARIANTS)
def test_hf_to_maxtext_to_hf_is_byte_identical_and_keeps_the_logits(hf_models, tmp_path, scanned, rope_layout):
    from converters.hf import HFFolderSource
    from converters.maxtext import MaxTextSource
    from nvfp4tool.config import ModelConfig

    key = "llama3" if scanned else "llama_tied"
    folder_fp32, folder_bf16, torch_model = hf_models[key]
    flag = "--scan-layers" if scanned else "--no-scan-layers"
    _convert(folder_bf16, str(tmp_path / "mt"), "--to", "maxtext", "--rope-layout", rope_layout, flag)
    _convert(
        str(tmp_path / "mt"),
        str(tmp_path / "back"),
        "--to",
        "hf",
        "--model-config",
        folder_bf16,
        "--rope-layout",
        rope_layout,
    )
    original, back = HFFolderSource(folder_bf16), HFFolderSource(str(tmp_path / "back"))
    assert back.names() == original.names()
    for name in original.names():
        a, b = original.get(name), back.get(name)
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), name
    with open(os.path.join(folder_bf16, "config.json")) as f:
        source_config = json.load(f)
    with open(tmp_path / "back" / "config.json") as f:
        back_config = json.load(f)
    for k in (
        "hidden_size",
        "num_hidden_layers",
        "num_key_value_heads",
        "head_dim",
        "rope_theta",
        "tie_word_embeddings",
        "vocab_size",
    ):
        assert back_config.get(k) == source_config.get(k), k

    # fp32 model through MaxText, read back by MaxTextSource into our model: transformers' logits
    _convert(folder_fp32, str(tmp_path / "mt32"), "--to", "maxtext", "--rope-layout", rope_layout, flag)
    config = ModelConfig.from_hf_folder(folder_fp32)
    source = MaxTextSource(str(tmp_path / "mt32"), config, rope_layout)
    np.testing.assert_allclose(_our_logits(config, source), _torch_logits(torch_model), rtol=0, atol=1e-4)


def _assert_trees_equal(got: dict, want: dict, path: str = "") -> None:
    assert set(got) == set(want), (path, sorted(got), sorted(want))
    for k in want:
        if isinstance(want[k], dict):
            _assert_trees_equal(got[k], want[k], f"{path}/{k}")
        else:
            g = np.asarray(got[k])
            assert g.shape == want[k].shape and g.dtype == want[k].dtype, f"{path}/{k}"
            assert g.tobytes() == want[k].tobytes(), f"{path}/{k} differs"
