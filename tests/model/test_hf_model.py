"""Our JAX model against transformers' PyTorch implementation, family by family (fp32 on CPU).

The tiny models come from `hf_fixtures` (saved with `save_pretrained`, read back with our
`HFFolderSource`), so each comparison also covers the reader and the HF -> model name mapping.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
from flax import nnx

from converters.hf import HFFolderSource
from nvfp4tool.model import forward, generate, model_from_tensors
from nvfp4tool.model.linear import Seam, default_linear
from nvfp4tool.model.transformer import forward_side

from fixtures.hf_fixtures import FAMILY_KEYS, MOE_KEYS, build_tiny_model, build_torch_model

pytestmark = pytest.mark.peers
torch = pytest.importorskip("torch")

TOLERANCE = 1e-4  # fp32 vs fp32; observed ~1.5e-6 (different summation orders only)


def padded_batch(T: int = 12, vocab: int = 256, seed: int = 0):
    """Rows: full, left-padded by 4, right-padded by 3; pad id 0."""
    ids = np.random.default_rng(seed).integers(3, vocab, size=(3, T))
    mask = np.ones((3, T), np.int64)
    mask[1, :4] = 0
    mask[2, T - 3 :] = 0
    ids[mask == 0] = 0
    return ids, mask


def torch_logits(key: str, ids, mask, positions) -> np.ndarray:
    model = build_torch_model(key)
    with torch.no_grad():
        return model(
            input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), position_ids=torch.tensor(positions)
        ).logits.numpy()


def our_model(folder: str, **kwargs):
    source = HFFolderSource(folder)
    return model_from_tensors(source.config, source, **kwargs)


def real(mask) -> np.ndarray:
    return np.asarray(mask).astype(bool)


@pytest.fixture(scope="module")
def reference_logits():
    """key -> transformers logits on the padded batch (positions as HF's generate derives them)."""
    ids, mask = padded_batch()
    positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0)
    return {key: torch_logits(key, ids, mask, positions) for key in FAMILY_KEYS}


@pytest.mark.parametrize("key", FAMILY_KEYS)
def test_logits_match_transformers(key, hf_tiny_models, reference_logits):
    ids, mask = padded_batch()
    ours = np.asarray(forward(our_model(hf_tiny_models[key]), ids, mask))
    theirs = reference_logits[key]
    diff = np.abs(ours - theirs)[real(mask)].max()
    assert diff < TOLERANCE, f"{key}: max |diff| {diff:.3g}"
    assert np.abs(theirs).max() > 1.0  # logits are not degenerate


@pytest.mark.parametrize(
    "key, change",
    [
        ("llama3", {"rope_scaling": None}),
        ("llama_tied", {"rope_scaling": None}),
        ("mistral", {"sliding_window": None}),
    ],
)
def test_the_fixture_exercises_the_feature(key, change, hf_tiny_models, reference_logits):
    """Turning the feature off in our config moves the logits far outside the tolerance."""
    source = HFFolderSource(hf_tiny_models[key])
    model = model_from_tensors(dataclasses.replace(source.config, **change), source)
    ids, mask = padded_batch()
    diff = np.abs(np.asarray(forward(model, ids, mask)) - reference_logits[key])[real(mask)].max()
    assert diff > 100 * TOLERANCE


def test_scanned_model_matches_transformers(hf_tiny_models, reference_logits):
    ids, mask = padded_batch()
    ours = np.asarray(forward(our_model(hf_tiny_models["qwen3"], scan_layers=True), ids, mask))
    assert np.abs(ours - reference_logits["qwen3"])[real(mask)].max() < TOLERANCE


def test_bf16_checkpoint_read_correctly(tmp_path):
    """A bf16 save_pretrained folder: our fp32 model from it == transformers on the same bf16 values."""
    folder = build_tiny_model("qwen2", str(tmp_path / "bf16"), dtype="bfloat16")
    source = HFFolderSource(folder)
    assert source.dtype("model.layers.0.self_attn.q_proj.bias") == "bfloat16"
    assert source.config.dtype == "bfloat16"
    import transformers

    # transformers upcasts the stored bf16 values to fp32 itself (model.to(bf16) would also round
    # the RoPE inv_freq buffer, which real bf16 checkpoints do not store).
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    reference = build_torch_model("qwen2").to(torch.bfloat16).state_dict()
    for name in source.names():  # bit-exact bf16 values
        np.testing.assert_array_equal(
            source.get(name).view(np.uint16), reference[name].view(torch.int16).numpy().view(np.uint16), err_msg=name
        )
    ids, mask = padded_batch()
    positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0)
    with torch.no_grad():
        theirs = torch_model(
            input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), position_ids=torch.tensor(positions)
        ).logits.numpy()
    ours = np.asarray(forward(model_from_tensors(source.config, source), ids, mask))
    assert np.abs(ours - theirs)[real(mask)].max() < TOLERANCE


@pytest.mark.parametrize("key", ["llama3", "mistral", "qwen3_moe"])
def test_greedy_generation_matches_transformers(key, hf_tiny_models):
    ids, mask = padded_batch(T=8)
    ids, mask = ids[:2], mask[:2]  # full and left-padded rows (HF's generate expects left padding)
    torch_model = build_torch_model(key)
    with torch.no_grad():
        theirs = torch_model.generate(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            max_new_tokens=10,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=0,
        ).numpy()[:, ids.shape[1] :]
    ours = np.asarray(
        generate(our_model(hf_tiny_models[key]), ids, 10, attention_mask=mask, eos_token_id=2, pad_token_id=0)
    )
    np.testing.assert_array_equal(ours, theirs)
    assert len(set(ours.ravel().tolist())) > 3  # not a degenerate repeat of one token


def test_fixture_folders_have_the_expected_files(hf_tiny_models):
    for key, folder in hf_tiny_models.items():
        files = set(os.listdir(folder))
        assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= files, key


@pytest.mark.parametrize("key", MOE_KEYS)
def test_moe_fixture_leaves_an_expert_without_tokens(key, hf_tiny_models):
    """The parity batch routes no token to the last expert of any sparse layer (the case the
    users' uncalibrated-expert failures come from), and routes to several others."""
    from nvfp4tool.model.layers import route

    source = HFFolderSource(hf_tiny_models[key])
    config = source.config
    ids, mask = padded_batch()
    model = our_model(hf_tiny_models[key])

    @nnx.jit
    def router_logits(model):  # the routers' logits come back as the model's side results
        return forward_side(model, ids, mask, seam=Seam.of(default_linear))[1].router_logits

    routers = router_logits(model)
    assert sorted(routers) == config.router_names()
    for name, logits in routers.items():
        _, chosen = route(
            np.asarray(logits), config.family_config.num_experts_per_tok, config.family_config.norm_topk_prob
        )
        counts = np.asarray(chosen)[real(mask)].sum(axis=0)
        assert counts[-1] == 0 and (counts[:-1] > 0).sum() >= 3, (name, counts)
