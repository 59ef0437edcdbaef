"""The deepseek_v3 family through the model against transformers' `DeepseekV3ForCausalLM` (fp32,
eager): an HF folder it saved, read by our reader and run by our Flax model, gives its logits to
float32 rounding on a padded batch, with q_lora_rank set and null, one dense layer of three and
grouped routing (n_group 4, topk_group 2) with a non-zero correction bias, unscanned and scanned;
cached greedy generation from the latent decode state equals recomputation and transformers'
`generate`; our writer's folder loads in transformers and gives its logits bit for bit; MTP layers
are refused by name.
"""

from __future__ import annotations

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

from converters.hf import HFFolderSource, write_hf_folder
from nvfp4tool.config import ModelConfig
from nvfp4tool.model import forward, generate, model_from_tensors
from nvfp4tool.model.weights import ModelTensorSource

from fixtures.deepseek_fixtures import LORA, NO_LORA, hf_folder

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, tuple[str, object]]:
    root = tmp_path_factory.mktemp("deepseek")
    return {"lora": hf_folder(root, LORA, seed=3), "no-lora": hf_folder(root, NO_LORA, seed=4)}


def _batch(t: int, vocab: int, rows: int = 2) -> tuple[np.ndarray, np.ndarray]:
    ids = np.random.default_rng(t).integers(3, vocab, (rows, t))
    mask = np.ones((rows, t), np.int64)
    mask[1, :3] = 0  # left padding
    ids[1, :3] = 0
    return ids, mask


def _reference_logits(reference, ids, mask) -> np.ndarray:
    with torch.no_grad():
        return reference(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits.numpy()


@pytest.mark.parametrize("key, scan", [("lora", False), ("no-lora", False), ("lora", True)])
def test_logits_equal_transformers(folders, key, scan):
    folder, reference = folders[key]
    config = ModelConfig.from_hf_folder(folder)
    assert [config.layer_kind(i) for i in range(3)] == ["mla+mlp", "mla+moe", "mla+moe"]
    model = model_from_tensors(config, HFFolderSource(folder), scan_layers=scan)
    ids, mask = _batch(9, LORA["vocab_size"])
    want = _reference_logits(reference, ids, mask)
    got = np.asarray(forward(model, jnp.asarray(ids), jnp.asarray(mask)))
    real = mask.astype(bool)
    assert np.abs(want[real]).max() > 1.0  # the fixture's logits are not trivially small
    np.testing.assert_allclose(got[real], want[real], rtol=1e-4, atol=1e-4)


def test_rope_interleave_and_the_correction_bias_act(folders):
    """The fixture exercises both: without the interleaved layout, or with the correction bias
    zeroed, transformers' own logits move well beyond the tolerance above."""
    folder, reference = folders["lora"]
    ids, mask = _batch(9, LORA["vocab_size"])
    want = _reference_logits(reference, ids, mask)
    reference.config.rope_interleave = False
    try:
        moved = _reference_logits(reference, ids, mask)
    finally:
        reference.config.rope_interleave = True
    assert np.abs(moved - want).max() > 1e-2
    biases = [m.gate.e_score_correction_bias for m in (layer.mlp for layer in reference.model.layers[1:])]
    kept = [b.clone() for b in biases]
    try:
        for b in biases:
            b.zero_()
        assert np.abs(_reference_logits(reference, ids, mask) - want).max() > 1e-2
    finally:
        for b, k in zip(biases, kept):
            b.copy_(k)


@pytest.mark.slow  # compiles prefill and decode programs
def test_cached_generation_equals_recomputation_and_transformers(folders):
    """Greedy decoding from the latent decode state ([B, S, kv_lora_rank] latent + [B, S, rope]
    k_pe, as vLLM caches it) picks the tokens full recomputation picks, a left-padded row included,
    and those of transformers' own cached `generate`."""
    folder, reference = folders["lora"]
    model = model_from_tensors(ModelConfig.from_hf_folder(folder), HFFolderSource(folder))
    ids, mask = _batch(6, LORA["vocab_size"])
    state = model.layers[0].empty_state(2, 13, jnp.float32)
    assert [a.shape for a in state] == [(2, 13, LORA["kv_lora_rank"]), (2, 13, LORA["qk_rope_head_dim"])]
    new = np.asarray(generate(model, jnp.asarray(ids), 7, attention_mask=jnp.asarray(mask)))
    seq, seq_mask = ids.copy(), mask.copy()
    for step in range(7):
        token = np.asarray(forward(model, jnp.asarray(seq), jnp.asarray(seq_mask)))[:, -1].argmax(-1)
        assert (token == new[:, step]).all(), step
        seq = np.concatenate([seq, token[:, None]], axis=1)
        seq_mask = np.concatenate([seq_mask, np.ones((2, 1), np.int64)], axis=1)
    with torch.no_grad():
        want = reference.generate(
            torch.from_numpy(ids[:1]), attention_mask=torch.from_numpy(mask[:1]), max_new_tokens=7, do_sample=False
        ).numpy()[:, 6:]
    np.testing.assert_array_equal(new[:1], want)


def test_written_folder_loads_in_transformers(folders, tmp_path):
    """HF -> ours -> HF: the same tensors under the same names, config.json keys transformers
    reads kept (plus scoring_func / topk_method, which vLLM reads), and transformers' model of the
    written folder gives the source's logits bit for bit."""
    from safetensors import safe_open
    from transformers import DeepseekV3ForCausalLM

    folder, reference = folders["lora"]
    config = ModelConfig.from_hf_folder(folder)
    model = model_from_tensors(config, HFFolderSource(folder))
    out = tmp_path / "ours"
    write_hf_folder(out, config, ModelTensorSource(model), dtype="fp32")
    with (
        safe_open(f"{folder}/model.safetensors", framework="numpy") as a,
        safe_open(str(out / "model.safetensors"), framework="numpy") as b,
    ):
        assert set(a.keys()) == set(b.keys())
        for name in a.keys():
            np.testing.assert_array_equal(a.get_tensor(name), b.get_tensor(name), err_msg=name)
    written = json.loads((out / "config.json").read_text())
    for key, value in LORA.items():
        assert written[key] == value, key
    assert (written["scoring_func"], written["topk_method"]) == ("sigmoid", "noaux_tc")
    assert ModelConfig.from_hf_config(written) == config
    again = DeepseekV3ForCausalLM.from_pretrained(out, attn_implementation="eager").float().eval()
    ids, mask = _batch(7, LORA["vocab_size"])
    assert np.array_equal(_reference_logits(reference, ids, mask), _reference_logits(again, ids, mask))


def test_multi_token_prediction_layers_are_refused_by_name(folders, tmp_path):
    """DeepSeek-V3 stores its MTP layer as `model.layers.61.*` (layer num_hidden_layers), which
    transformers does not build and vLLM's DeepseekV3ForCausalLM skips: the reader refuses it in one
    line naming the first such tensor and what it is."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from nvfp4tool.errors import NVFP4ToolError

    folder, _ = folders["lora"]
    copy = tmp_path / "mtp"
    shutil.copytree(folder, copy)
    tensors = load_file(f"{copy}/model.safetensors")
    tensors["model.layers.3.eh_proj.weight"] = np.ones((32, 64), np.float32)
    tensors["model.layers.3.enorm.weight"] = np.ones(32, np.float32)
    save_file(tensors, f"{copy}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        NVFP4ToolError, match=r"'model\.layers\.3\.eh_proj\.weight' belongs to a multi-token-prediction"
    ) as e:
        HFFolderSource(copy)
    assert "\n" not in str(e.value)


YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=8,
    beta_fast=8.0,
    beta_slow=1.0,
    mscale=0.707,
    mscale_all_dim=1.0,
)


@pytest.mark.parametrize(
    "scaling",
    [YARN, dict(YARN, mscale=None, mscale_all_dim=None), dict(YARN, truncate=False, attention_factor=1.3)],
    ids=["mscale", "no-mscale", "attention-factor"],
)
def test_yarn_frequencies_equal_transformers(scaling):
    """rope.py's yarn frequencies and attention factor equal transformers' `_compute_yarn_parameters`
    bit for bit (DeepSeek-V3's RoPE: mscale / mscale_all_dim, an explicit attention_factor, truncate)."""
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    from nvfp4tool.families.rope_scaling import rope_scaling_from_hf
    from nvfp4tool.model.rope import Rotation, frequencies

    given = {k: v for k, v in scaling.items() if v is not None}
    want, want_factor = _compute_yarn_parameters(
        DeepseekV3Config(**dict(LORA, max_position_embeddings=32, rope_parameters=given))
    )
    record = rope_scaling_from_hf(given, "config.json")
    got, factor = frequencies(Rotation(LORA["qk_rope_head_dim"], 10000.0, record))
    assert got.tobytes() == want.numpy().tobytes() and factor == want_factor
    assert record.to_hf() == {k: v for k, v in given.items() if k != "rope_theta"}


def test_yarn_logits_equal_transformers(tmp_path):
    """DeepSeek-V3 with YaRN RoPE (its published rope_scaling's keys, scaled to the tiny model):
    the attention factor on cos / sin and the softmax scale times mscale(factor, mscale_all_dim)^2,
    as transformers' DeepseekV3Attention; a padded batch longer than the original context."""
    options = dict(LORA, max_position_embeddings=32, rope_parameters=YARN)
    folder, reference = hf_folder(tmp_path, options, seed=9)
    config = ModelConfig.from_hf_folder(folder)
    assert config.rope_scaling.rope_type == "yarn"
    attention = config.family_spec.layer_attention(config, 0)
    assert attention.rope_dim == LORA["qk_rope_head_dim"] and attention.softmax_scale == pytest.approx(
        16**-0.5 * (0.1 * math.log(4.0) + 1) ** 2
    )
    model = model_from_tensors(config, HFFolderSource(folder))
    ids, mask = _batch(12, LORA["vocab_size"])
    want = _reference_logits(reference, ids, mask)
    got = np.asarray(forward(model, jnp.asarray(ids), jnp.asarray(mask)))
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], want[real], rtol=1e-4, atol=1e-4)
    written = config.to_hf_config()
    assert ModelConfig.from_hf_config(written) == config
