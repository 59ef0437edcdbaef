"""The tiny model the eval tests run: a transformers Llama (hidden 64, 2 layers) with a byte-level BPE
tokenizer trained on Shakespeare, saved in BF16 with `save_pretrained`, its NVFP4 W4A4 export and
its FP8 export (made by the CLI, calibrated on the same ids), and a second, different model for the
refusals. `build_eval_models(root)` builds them all (~15 s); a module-scoped fixture calls it once."""

from __future__ import annotations

import os

import numpy as np
import pytest
from click.testing import CliRunner

from nvfp4tool.cli import cli

VOCAB = 300
TASKS = ("nvfp4tool_mc", "nvfp4tool_gsm", "nvfp4tool_text")


def write_tiny_llama(out_dir: str, *, seed: int, tokenizer_text: str | None = None) -> str:
    """A tiny Llama in BF16 with its tokenizer (trained on `tokenizer_text`: Shakespeare by default)."""
    import torch

    from hf_fixtures import build_torch_model
    from nvfp4tool.train.tokenizer import train_bpe_tokenizer

    if tokenizer_text is None:
        here = os.path.dirname(os.path.abspath(__file__))
        with open(os.path.join(here, "..", "nvfp4tool", "data", "shakespeare_train.txt"), encoding="utf-8") as f:
            tokenizer_text = f.read()[:50_000]
    os.makedirs(out_dir, exist_ok=True)
    tokenizer = train_bpe_tokenizer([tokenizer_text], VOCAB, out_dir)
    eos = tokenizer.eos_id
    model = build_torch_model("llama3", seed=seed, overrides=dict(
        vocab_size=tokenizer.vocab_size, rope_scaling=None, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
        max_position_embeddings=256))
    with torch.no_grad():  # decisive logits: greedy choices far from ties between fp32 implementations
        model.lm_head.weight.mul_(6.0)
    model.to(torch.bfloat16).save_pretrained(out_dir)
    return out_dir


_BUILT: dict[str, str] = {}  # one build per test process, whichever module asks first


@pytest.fixture(scope="session")
def eval_models(tmp_path_factory) -> dict[str, str]:
    """The read-only models of the eval tests (`build_eval_models`), built once per process."""
    if not _BUILT:
        _BUILT.update(build_eval_models(str(tmp_path_factory.mktemp("eval-models"))))
    return dict(_BUILT)


def build_eval_models(root: str) -> dict[str, str]:
    paths = {"hf": os.path.join(root, "hf"), "ids": os.path.join(root, "ids.npy"),
             "nvfp4": os.path.join(root, "nvfp4"), "fp8": os.path.join(root, "fp8"),
             "other": os.path.join(root, "other")}
    write_tiny_llama(paths["hf"], seed=5)
    np.save(paths["ids"], np.random.default_rng(0).integers(0, VOCAB, (4, 32)))
    runner = CliRunner()
    for key, quant in (("nvfp4", "nvfp4"), ("fp8", "fp8")):
        result = runner.invoke(cli, ["-q", "export", paths["hf"], "--out", paths[key], "--quant", quant,
                                     "--calib-data", paths["ids"], "--calib-samples", "4", "--calib-seq-len", "32"])
        assert result.exit_code == 0, result.output
    write_tiny_llama(paths["other"], seed=6)
    return paths
