"""The lm-eval backend against lm-eval's own `hf` backend (transformers, fp32) on the tiny model:
per-request loglikelihoods within 1e-4 per scored token, identical generations and identical
per-item correctness, for a multiple-choice task (options as continuations, and letters: one-token
continuations, every choice of an item read from one shared row), a generative and a
rolling-loglikelihood task (the shipped offline tasks)."""

import numpy as np
import pytest

from fixtures.eval_fixtures import assert_samples_match, lm_eval_samples

LIMIT = 6
MAX_LENGTH = 128


def _samples(model, model_args=None, **kwargs):
    return lm_eval_samples(model, model_args, limit=LIMIT, **kwargs)


@pytest.mark.slow
@pytest.mark.peers
def test_bf16_backend_equals_lm_eval_hf_backend(eval_models):
    from nvfp4tool.eval.lm_backend import NVFP4ToolLM

    lm = NVFP4ToolLM(path=eval_models["hf"], max_length=MAX_LENGTH, batch_size=4)
    ours = _samples(lm)
    letter_requests = sum(len(s["resps"]) for s in ours["nvfp4tool_mc_letter"])
    assert lm.counts["loglikelihood_rows_run"] <= lm.counts["loglikelihood"] - letter_requests + LIMIT
    theirs = _samples(
        "hf", f"pretrained={eval_models['hf']},dtype=float32,max_length={MAX_LENGTH}", batch_size=1, device="cpu"
    )
    assert_samples_match(ours, theirs, LIMIT)
    mc = ours["nvfp4tool_mc"]
    assert len({int(np.argmax([r[0][0] for r in s["resps"]])) for s in mc}) > 1  # not one constant answer
