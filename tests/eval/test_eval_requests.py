"""How the lm-eval backend serves requests: rows shared by requests of one context (the same
log-likelihoods as each request run alone, fewer rows), generation kwargs decoded or refused, and
sampled passes averaged per item (`nvfp4tool eval --samples K`)."""

import numpy as np
import pytest
from click.testing import CliRunner

from nvfp4tool.cli import cli

from fixtures import REPO_ROOT


def test_shared_rows_serves_prefixes_of_one_context_from_the_longest_row():
    from nvfp4tool.eval.lm_backend import shared_rows

    contexts = [(1, 2), (1, 2), (1, 2), (1, 2), (7,), (1, 2, 3)]
    inputs = [[1, 2], [1, 2], [1, 2, 5], [1, 2, 6, 8], [7], [1, 2]]
    answered = shared_rows(contexts, inputs)
    # 0 and 1 are prefixes of 3 but not of 2; 2 and 3 diverge; 5 has another context (never shared)
    assert answered == {3: [3, 0, 1], 2: [2], 4: [4], 5: [5]}
    assert sorted(i for members in answered.values() for i in members) == list(range(6))


def test_shared_rows_give_each_request_its_own_loglikelihood(eval_models):
    from nvfp4tool.eval.lm_backend import NVFP4ToolLM

    lm = NVFP4ToolLM(path=eval_models["hf"], max_length=64, batch_size=4)
    rng = np.random.default_rng(3)
    requests = []
    for item in range(5):  # letter answers (one token) and options that extend one another
        context = rng.integers(1, 250, 6 + 3 * item).tolist()
        requests += [(None, context, [int(t)]) for t in rng.integers(1, 250, 4)]
        requests += [(None, context, [9, 11]), (None, context, [9, 11, 13]), (None, context, [9])]
    shared = lm._loglikelihood_tokens(requests)
    rows_shared = lm.counts["loglikelihood_rows_run"]
    lm.share_prefixes = False
    alone = lm._loglikelihood_tokens(requests)
    assert lm.counts["loglikelihood_rows_run"] - rows_shared == len(requests)
    # a row's input is context + continuation[:-1]: every request of an item (letters: the context
    # alone; [9], [9, 11]) is a prefix of the [9, 11, 13] request's input, one row per item
    assert rows_shared == 5
    np.testing.assert_allclose([s[0] for s in shared], [a[0] for a in alone], rtol=0, atol=1e-5)
    assert [s[1] for s in shared] == [a[1] for a in alone]


@pytest.mark.parametrize(
    "kwargs,expected",
    [
        ({"until": ["\n"], "do_sample": False}, (False, 1.0, None, 256)),
        ({"do_sample": True, "temperature": 0.0}, (False, 1.0, None, 256)),  # lm-eval: greedy at temperature 0
        ({"do_sample": True, "temperature": 0.7, "top_k": 40, "max_gen_toks": 9}, (True, 0.7, 40, 9)),
        ({"temperature": 0.5}, (True, 0.5, None, 256)),  # a temperature alone samples (lm-eval's normalization)
        ({"do_sample": False, "top_p": 1.0, "num_beams": 1}, (False, 1.0, None, 256)),  # neutral settings
    ],
)
def test_decoding_follows_lm_eval_normalization(kwargs, expected):
    from nvfp4tool.eval.lm_backend import decoding

    how = decoding(kwargs, 256)
    assert (how.sample, how.temperature, how.top_k, how.max_gen_toks) == expected


@pytest.mark.parametrize(
    "kwargs,named",
    [
        ({"do_sample": True, "temperature": 1.0, "top_p": 0.9}, "top_p=0.9"),
        ({"num_beams": 4}, "num_beams=4"),
        ({"repetition_penalty": 1.2}, "repetition_penalty=1.2"),
    ],
)
def test_decoding_refuses_what_it_does_not_implement(kwargs, named):
    from nvfp4tool.errors import NVFP4UsageError
    from nvfp4tool.eval.lm_backend import decoding

    with pytest.raises(NVFP4UsageError, match=named):
        decoding(kwargs, 256)


def test_average_passes_means_each_items_scores_and_refuses_other_prompts():
    from nvfp4tool.errors import NVFP4ToolError
    from nvfp4tool.eval.evaluate import average_passes

    def rows(scores, hashes=("a", "b")):
        return [
            {"doc_id": d, "filter": "strict", "prompt_hash": h, "metrics": ["exact_match"], "exact_match": s}
            for d, (h, s) in enumerate(zip(hashes, scores))
        ]

    averaged = average_passes("t", [rows([1.0, 0.0]), rows([0.0, 0.0]), rows([1.0, 1.0])])
    assert [r["exact_match"] for r in averaged] == pytest.approx([2 / 3, 1 / 3])
    assert [r["prompt_hash"] for r in averaged] == ["a", "b"]
    with pytest.raises(NVFP4ToolError, match="doc_id 1: a sampling pass asked another prompt"):
        average_passes("t", [rows([1.0, 0.0]), rows([1.0, 0.0], hashes=("a", "c"))])


@pytest.mark.slow
def test_sampled_generation_is_averaged_over_k_samples_per_item(eval_models, tmp_path):
    import shutil

    from nvfp4tool.records.evaluation import EvalItems, EvalRecord

    shutil.copytree(eval_models["hf"], tmp_path / "hf")
    export = str(shutil.copytree(eval_models["nvfp4"], tmp_path / "nvfp4"))
    result = CliRunner().invoke(
        cli,
        [
            "eval",
            export,
            "--tasks",
            "nvfp4tool_gsm,nvfp4tool_mc",
            "--limit",
            "4",
            "--batch-size",
            "4",
            "--max-length",
            "64",
            "--samples",
            "3",
            "--gen-kwargs",
            "do_sample=true,temperature=1.5,max_gen_toks=12",
        ],
    )
    assert result.exit_code == 0, result.output
    record = EvalRecord.read(export)
    assert record.samples == 3 and record.sampled_tasks == ["nvfp4tool_gsm"]
    assert record.gen_kwargs == {"do_sample": True, "temperature": 1.5, "max_gen_toks": 12}
    items = EvalItems.read(export).tasks
    for label in record.labels:
        assert all(round(3 * s) == pytest.approx(3 * s) for s in items["nvfp4tool_gsm"][label])  # k/3
        assert set(items["nvfp4tool_mc"][label]) <= {0.0, 1.0}  # loglikelihood tasks run once
    gsm = record.tasks["nvfp4tool_gsm"]
    for label in record.labels:
        assert gsm[label]["exact_match"] == pytest.approx(np.mean(items["nvfp4tool_gsm"][label]))
        assert gsm[label]["mean_output_tokens"] <= 12
    with open(f"{export}/eval.md") as f:
        assert "3 generations per item" in f.read()


def test_streamed_weights_give_the_held_loglikelihoods_and_refuse_generation(eval_models):
    """offload=always reads each layer of the NVFP4 export as it runs (validate's streamed model):
    the same log-likelihoods as the held model; generation, which needs it whole, is refused."""
    from nvfp4tool.errors import NVFP4ToolError
    from nvfp4tool.eval.lm_backend import NVFP4ToolLM

    rng = np.random.default_rng(4)
    requests = [(None, rng.integers(1, 250, n).tolist(), rng.integers(1, 250, 3).tolist()) for n in (5, 17, 40)]
    held = NVFP4ToolLM(path=eval_models["nvfp4"], max_length=64, batch_size=2, offload="never")
    streamed = NVFP4ToolLM(path=eval_models["nvfp4"], max_length=64, batch_size=2, offload="always")
    assert (held.variant.how, streamed.variant.how) == ("held", "streamed")
    a, b = held._loglikelihood_tokens(requests), streamed._loglikelihood_tokens(requests)
    np.testing.assert_allclose([x[0] for x in a], [x[0] for x in b], rtol=0, atol=1e-5)
    assert [x[1] for x in a] == [x[1] for x in b]

    class Request:
        args = ("Question: 1+1?\nAnswer:", {"until": ["\n"], "max_gen_toks": 4})

    with pytest.raises(NVFP4ToolError, match="streamed layer by layer"):
        streamed.generate_until([Request()])


@pytest.mark.slow
def test_lm_eval_command_line_runs_the_registered_model(eval_models):
    """`python -m nvfp4tool.eval.lm_backend run --model nvfp4tool ...` is lm-eval's own command
    line with the model registered and the shipped tasks on its include path."""
    import os
    import subprocess
    import sys

    root = REPO_ROOT
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "nvfp4tool.eval.lm_backend",
            "run",
            "--model",
            "nvfp4tool",
            "--model_args",
            f"path={eval_models['nvfp4']},max_length=64",
            "--tasks",
            "nvfp4tool_mc_letter",
            "--limit",
            "2",
            "--batch_size",
            "2",
        ],
        cwd=root,
        env={**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    row = next(line for line in done.stdout.splitlines() if line.startswith("|nvfp4tool_mc_letter"))
    assert "|acc" in row.replace(" ", "") and "nvfp4tool ({'path'" in done.stdout
