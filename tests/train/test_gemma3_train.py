"""Training Gemma 3: the `tiny-gemma3` preset (3 local window-16 layers : 1 global, tied, (1 + w)
norms starting at zero) runs 2 steps of the NVFP4 recipe from the CLI, and the run's HF folder is
what transformers' Gemma3ForCausalLM loads, with the logits our model computes from it."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner

from converters.hf import HFFolderSource
from nvfp4tool.cli import cli
from nvfp4tool.config import ModelConfig
from nvfp4tool.model import forward, model_from_tensors


@pytest.mark.peers
@pytest.mark.slow  # > 15 s of the inner loop (tests/durations.json)
def test_tiny_gemma3_trains_with_the_recipe_and_loads_in_transformers(tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import Gemma3ForCausalLM

    data = tmp_path / "train.txt"
    data.write_text(open("nvfp4tool/data/shakespeare_train.txt", encoding="utf-8").read()[:60000])
    out = tmp_path / "run"
    args = ["train", "model=tiny-gemma3", f"data={data}", "recipe=nvfp4", "steps=2", "seq_len=32"]
    args += ["batch_size=2", "eval_every=0", "vocab_size=512", f"out={out}"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert len(losses) == 2 and all(np.isfinite(losses))
    hf = out / "hf"
    config = ModelConfig.from_hf_folder(hf)
    assert config.family == "gemma3_text" and config.tie_word_embeddings
    reference = Gemma3ForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager").eval()
    model = model_from_tensors(config, HFFolderSource(hf))
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 20))  # past the window of 16
    with torch.no_grad():
        want = reference(input_ids=torch.from_numpy(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(forward(model, jnp.asarray(ids))), want, rtol=1e-4, atol=1e-4)
