"""Gemma 3 (`gemma3_text`) through the model against transformers' `Gemma3ForCausalLM` (fp32, eager):
the padded-batch logits of the shared fixture are `test_hf_model`'s (every family key); here a
5 local : 1 global stack scanned (runs of 5 and 1, split where the layer's window and RoPE
change) and unscanned, both equal to transformers, and cached greedy generation (sliding-window
layers past their window) equal to full recomputation and to transformers' own `generate`.
"""

from __future__ import annotations

import numpy as np
import pytest

from converters.hf import HFFolderSource
from nvfp4tool.config import ModelConfig
from nvfp4tool.model import forward, generate, model_from_tensors
from nvfp4tool.model.linear import Seam
from nvfp4tool.model.transformer import layer_runs

from fixtures.hf_fixtures import build_tiny_model, build_torch_model

pytestmark = pytest.mark.peers
torch = pytest.importorskip("torch")

LOCAL, GLOBAL = "sliding_attention", "full_attention"
FIVE_TO_ONE = {"num_hidden_layers": 7, "layer_types": [LOCAL] * 5 + [GLOBAL, LOCAL]}


def _batch(T: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A full row, a left-padded one and a right-padded one (pad id 0)."""
    ids = np.random.default_rng(seed).integers(3, 256, size=(3, T))
    mask = np.ones((3, T), np.int64)
    mask[1, :4] = 0
    mask[2, T - 3 :] = 0
    ids[mask == 0] = 0
    return ids, mask


def test_a_scanned_five_local_one_global_stack_equals_unscanned_and_transformers(tmp_path):
    folder = build_tiny_model("gemma3", str(tmp_path / "g"), overrides=FIVE_TO_ONE)
    source = HFFolderSource(folder)
    config = source.config
    assert layer_runs(config, Seam(), scan=True) == [
        ("attention+mlp", [0, 1, 2, 3, 4]),
        ("attention+mlp", [5]),
        ("attention+mlp", [6]),
    ]
    ids, mask = _batch(12)
    positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0)
    with torch.no_grad():
        theirs = (
            build_torch_model("gemma3", overrides=FIVE_TO_ONE)(
                input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), position_ids=torch.tensor(positions)
            )
            .logits.float()
            .numpy()
        )
    real = mask.astype(bool)
    assert np.abs(theirs[real]).max() > 1.0
    results = {}
    for scan in (False, True):
        results[scan] = np.asarray(forward(model_from_tensors(config, source, scan_layers=scan), ids, mask))
        np.testing.assert_allclose(results[scan][real], theirs[real], rtol=0, atol=1e-4)
    np.testing.assert_allclose(results[True][real], results[False][real], rtol=0, atol=1e-5)


def test_cached_generation_equals_recomputation_and_transformers(hf_tiny_models):
    """Prompts of 8 (one left-padded by 4) and 10 new tokens: the window-4 local layers' keys slide
    past the prompt; the cached decode, full recomputation and transformers' `generate` (its
    sliding-window cache) pick the same tokens."""
    config = ModelConfig.from_hf_folder(hf_tiny_models["gemma3"])
    model = model_from_tensors(config, HFFolderSource(hf_tiny_models["gemma3"]))
    ids, mask = _batch(8)
    ids, mask = ids[:2], mask[:2]
    new = np.asarray(generate(model, ids, 10, attention_mask=mask, eos_token_id=2, pad_token_id=0))
    assert (new != 2).all()  # no row stopped: every token below is a greedy pick
    # recomputation: one uncached forward over prompt + generated tokens; greedy decoding is causal,
    # so the argmax after each prefix is the token generated there
    seq, seq_mask = np.concatenate([ids, new], axis=1), np.concatenate([mask, np.ones_like(new)], axis=1)
    recomputed = np.asarray(forward(model, seq, seq_mask))[:, ids.shape[1] - 1 : -1].argmax(-1)
    np.testing.assert_array_equal(recomputed, new)
    with torch.no_grad():
        theirs = (
            build_torch_model("gemma3")
            .generate(
                input_ids=torch.tensor(ids),
                attention_mask=torch.tensor(mask),
                max_new_tokens=10,
                do_sample=False,
                eos_token_id=2,
                pad_token_id=0,
            )
            .numpy()[:, ids.shape[1] :]
        )
    np.testing.assert_array_equal(new, theirs)
    assert len(set(new.ravel().tolist())) > 3  # not a degenerate repeat of one token
