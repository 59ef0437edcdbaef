"""`nvfp4tool eval` on the hybrid nemotron_h family against lm-eval's own `hf` backend
(transformers' NemotronHForCausalLM, fp32): per-request loglikelihoods within 1e-4 per scored
token, identical generations and per-item correctness (the Mamba layers' recurrent state through generate_until) on the
shipped offline tasks, for a tiny MoE hybrid with a byte-level BPE tokenizer."""

from __future__ import annotations

import os

import pytest

from fixtures import REPO_ROOT
from fixtures.eval_fixtures import VOCAB, assert_samples_match, lm_eval_samples
from fixtures.hybrid_fixtures import MOE

LIMIT = 4
MAX_LENGTH = 128


@pytest.mark.slow
@pytest.mark.peers
def test_hybrid_backend_equals_lm_eval_hf_backend(tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import NemotronHConfig, NemotronHForCausalLM

    from nvfp4tool.corpus.tokenizer import train_bpe_tokenizer
    from nvfp4tool.eval.lm_backend import NVFP4ToolLM

    folder = str(tmp_path / "hybrid")
    with open(os.path.join(REPO_ROOT, "nvfp4tool", "data", "shakespeare_train.txt"), encoding="utf-8") as f:
        tokenizer = train_bpe_tokenizer([f.read()[:50_000]], VOCAB, folder)
    eos = tokenizer.eos_id
    torch.manual_seed(0)
    options = dict(
        MOE,
        vocab_size=tokenizer.vocab_size,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
        max_position_embeddings=256,
    )
    model = NemotronHForCausalLM(NemotronHConfig(**options)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("dt_bias"):
                p.copy_(p.abs() + 0.5)  # dt above time_step_min: transformers' prefill clamp never acts
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif not name.endswith(("A_log", "D", "e_score_correction_bias")):
                p.copy_(torch.randn_like(p) * (0.5 if "lm_head" in name else 0.15))
    model.to(torch.bfloat16).save_pretrained(folder)

    ours = lm_eval_samples(NVFP4ToolLM(path=folder, max_length=MAX_LENGTH, batch_size=4), limit=LIMIT)
    theirs = lm_eval_samples(
        "hf", f"pretrained={folder},dtype=float32,max_length={MAX_LENGTH}", limit=LIMIT, batch_size=1, device="cpu"
    )
    assert_samples_match(ours, theirs, LIMIT)
