"""The lm-eval backend against lm-eval's own `hf` backend (transformers, fp32) on the tiny model:
per-request loglikelihoods within 1e-4 per scored token, identical generations and identical
per-item correctness, for a multiple-choice task (options as continuations, and letters: one-token
continuations, every choice of an item read from one shared row), a generative and a
rolling-loglikelihood task (the shipped offline tasks)."""

import numpy as np
import pytest

from eval_fixtures import TASKS, eval_models  # noqa: F401

LIMIT = 6
MAX_LENGTH = 128


def _samples(model, model_args=None, **kwargs):
    import lm_eval

    from nvfp4tool.validate.lm_backend import task_manager

    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(TASKS),
                                  task_manager=task_manager((), defaults=False), limit=LIMIT, log_samples=True,
                                  bootstrap_iters=0, **kwargs)
    return out["samples"]


@pytest.mark.slow
@pytest.mark.peers
def test_bf16_backend_equals_lm_eval_hf_backend(eval_models):
    from nvfp4tool.validate.lm_backend import NVFP4ToolLM

    lm = NVFP4ToolLM(path=eval_models["hf"], max_length=MAX_LENGTH, batch_size=4)
    ours = _samples(lm)
    letter_requests = sum(len(s["resps"]) for s in ours["nvfp4tool_mc_letter"])
    assert lm.counts["loglikelihood_rows_run"] <= lm.counts["loglikelihood"] - letter_requests + LIMIT
    theirs = _samples("hf", f"pretrained={eval_models['hf']},dtype=float32,max_length={MAX_LENGTH}",
                      batch_size=1, device="cpu")
    for task in TASKS:
        assert [s["doc_id"] for s in ours[task]] == [s["doc_id"] for s in theirs[task]] == list(range(LIMIT))
        for a, b in zip(ours[task], theirs[task]):
            assert a["prompt_hash"] == b["prompt_hash"]
            if task == "nvfp4tool_gsm":
                assert a["resps"] == b["resps"]  # the generated text, cut at the stop strings
                assert a["exact_match"] == b["exact_match"]
            else:
                mine = np.array([r[0][0] if isinstance(r[0], (list, tuple)) else r[0] for r in a["resps"]])
                ref = np.array([r[0][0] if isinstance(r[0], (list, tuple)) else r[0] for r in b["resps"]])
                tokens = 1 if task.startswith("nvfp4tool_mc") else len(a["doc"]["page"])  # bytes >= tokens
                np.testing.assert_allclose(mine, ref, rtol=0, atol=1e-4 * tokens)
                for metric in a["metrics"]:
                    if task.startswith("nvfp4tool_mc"):
                        assert a[metric] == b[metric]
    mc = ours["nvfp4tool_mc"]
    assert len({int(np.argmax([r[0][0] for r in s["resps"]])) for s in mc}) > 1  # not one constant answer
