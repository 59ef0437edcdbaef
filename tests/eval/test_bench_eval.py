"""scripts/bench_eval.py: the shared-rows check fails loudly on any per-item difference, bad options
are refused, and (slow) one model end to end on the tiny preset writes every figure."""

from __future__ import annotations

import json
import os
import sys

import pytest

from fixtures import REPO_ROOT

sys.path.insert(0, os.path.join(REPO_ROOT, "scripts"))
import bench_eval


def _rows(scores: list[float], hashes: str = "abc") -> list[dict]:
    return [
        {"doc_id": i, "prompt_hash": hashes[i], "filter": "none", "metrics": ["acc"], "acc": s}
        for i, s in enumerate(scores)
    ]


def test_same_scores_is_the_mean_when_identical_and_refuses_any_difference():
    assert bench_eval.same_scores("m", _rows([1.0, 0.0, 1.0]), _rows([1.0, 0.0, 1.0])) == pytest.approx(2 / 3)
    with pytest.raises(RuntimeError, match=r"m: per-item acc with share_prefixes on differs from off \(doc_ids \[1\]"):
        bench_eval.same_scores("m", _rows([1.0, 0.0, 1.0]), _rows([1.0, 1.0, 1.0]))
    with pytest.raises(RuntimeError, match=r"doc_ids \[2\]"):  # same scores, another prompt
        bench_eval.same_scores("m", _rows([1.0, 0.0, 1.0]), _rows([1.0, 0.0, 1.0], "abd"))
    with pytest.raises(RuntimeError, match=r"doc_ids \[2\]"):  # an item missing
        bench_eval.same_scores("m", _rows([1.0, 0.0, 1.0]), _rows([1.0, 0.0]))
    with pytest.raises(RuntimeError, match="0 scored shared"):
        bench_eval.same_scores("m", [], [])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--models", "bf16,int4"], "--models bf16,int4"),
        (["--limit", "0"], "--limit must be >= 1"),
        (["--max-length", "8192"], "--max-length must be in"),
        (["--preset", "1b"], "invalid choice"),
        (["--json", "/no/such/folder/x.json"], "--json /no/such/folder/x.json"),
    ],
)
def test_bad_options_are_refused_before_anything_is_built(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_eval.main(argv + ["--workdir", str(tmp_path / "w")])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


@pytest.mark.slow
def test_tiny_preset_one_model_writes_every_figure(tmp_path):
    out = tmp_path / "bench.json"
    result = bench_eval.main(
        ["--preset", "tiny", "--limit", "2", "--models", "bf16", "--workdir", str(tmp_path / "w"), "--json", str(out)]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["preset"] == "tiny" and result["model"]["hidden"] == 128 and result["model"]["layers"] == 4
    assert {"cores", "ram_gb", "loadavg_1m", "loadavg_1m_end", "commit"} <= set(result["machine"])
    assert set(result["versions"]) == {"jax", "lm_eval", "transformers"}
    assert result["parameters"] == {
        "limit": 2,
        "batch_size": 8,
        "max_length": 256,
        "vocab_size": 512,
        "calib": [4, 32],
        "models": ["bf16"],
    }
    assert set(result["built_s"]) == {"hf", "nvfp4", "fp8"} and list(result["models"]) == ["bf16"]
    figures = result["models"]["bf16"]
    assert figures["how"] == "held"
    mc, gsm = figures["tasks"]["nvfp4tool_mc"], figures["tasks"]["nvfp4tool_gsm"]
    for run in ("first", "steady"):
        assert mc[run]["items"] == gsm[run]["items"] == 2
        assert gsm[run]["requests"] == 2 and gsm[run]["rows_run"] is None  # one generation per item
        # a request per option; shared prefixes (one-token options) ride on one row
        assert mc[run]["requests"] > 2 and 2 <= mc[run]["rows_run"] <= mc[run]["requests"]
        assert mc[run]["rows_run"] == mc["first"]["rows_run"]
        for r in (mc[run], gsm[run]):
            assert r["items_per_s"] == pytest.approx(r["items"] / r["seconds"])
    shared = figures["shared_rows"]
    assert shared["identical_acc"] and shared["shared"]["rows_run"] == shared["first_shared"]["rows_run"] == 2
    assert shared["unshared"]["rows_run"] == shared["unshared"]["requests"] == mc["first"]["requests"]
    assert shared["rows_ratio"] == shared["unshared"]["rows_run"] / 2
    # a second run finds the models built
    assert bench_eval.build_models(os.path.dirname(result["paths"]["hf"]), "tiny", 512)[1] == {}
