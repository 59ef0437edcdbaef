"""nvfp4tool.numerics.metrics on constructed cases with closed-form answers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from nvfp4tool.numerics import metrics


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_identical_logits_give_zero_kl_full_agreement_and_zero_error():
    logits = np.random.default_rng(0).standard_normal((2, 5, 33)).astype(np.float32)
    assert np.all(metrics.token_kl(logits, logits) == 0.0)
    assert metrics.top1_agree(logits, logits).all()
    assert metrics.logit_errors(logits, logits) == (0.0, 0.0)
    assert metrics.sqnr_db(logits, logits) == math.inf


@pytest.mark.parametrize("delta", [0.5, -2.0, 3.0])
def test_kl_of_a_logit_shift_on_one_token_matches_the_closed_form(delta):
    # Q = P * exp(delta * 1_j) / Z  =>  KL(P||Q) = log(1 - p_j + p_j e^delta) - p_j delta
    ref = np.random.default_rng(1).standard_normal((4, 7, 50))
    j = 11
    shifted = ref.copy()
    shifted[..., j] += delta
    p_j = _softmax(ref)[..., j]
    expected = np.log(1 - p_j + p_j * np.exp(delta)) - p_j * delta
    np.testing.assert_allclose(metrics.token_kl(ref, shifted), expected, rtol=1e-9, atol=1e-15)
    assert np.all(expected > 0)


def test_top1_agreement_counts_changed_argmax():
    ref = np.zeros((1, 4, 8))
    ref[0, :, 3] = 1.0
    other = ref.copy()
    other[0, 1, 5] = 2.0  # token 1's argmax moves
    other[0, 2, 6] = 0.5  # token 2's stays
    assert metrics.top1_agree(ref, other).tolist() == [[True, False, True, True]]


def test_perplexity_of_a_uniform_model_is_the_vocab_size():
    vocab = 37
    ids = np.random.default_rng(2).integers(0, vocab, (3, 9))
    nll = metrics.next_token_nll(np.zeros((3, 9, vocab), np.float32), ids)
    assert nll.shape == (3, 8)
    assert metrics.perplexity(nll) == pytest.approx(vocab, rel=1e-12)


def test_next_token_nll_reads_the_next_token():
    logits = np.log(np.array([[[0.5, 0.25, 0.25], [0.1, 0.1, 0.8], [1 / 3, 1 / 3, 1 / 3]]]))
    nll = metrics.next_token_nll(logits, np.array([[0, 2, 1]]))
    np.testing.assert_allclose(nll, -np.log([[0.25, 0.1]]), rtol=1e-12)


def test_sqnr_of_a_known_noise_level():
    x = np.random.default_rng(3).standard_normal(1000)
    noise = 0.1 * x[::-1]  # same power / 100 -> exactly 20 dB
    assert metrics.sqnr_db(x, x + noise) == pytest.approx(20.0, abs=1e-9)
    assert metrics.sqnr_from_sums(4.0, 0.04) == pytest.approx(20.0)
    assert metrics.sqnr_from_sums(0.0, 1.0) == -math.inf


def test_logit_errors_max_and_mean():
    ref = np.zeros((2, 3))
    other = np.array([[0.0, -3.0, 0.0], [1.0, 0.0, 2.0]])
    assert metrics.logit_errors(ref, other) == (3.0, 1.0)


def test_first_divergence():
    assert metrics.first_divergence(np.array([1, 2, 3, 4]), np.array([1, 2, 3, 4])) is None
    assert metrics.first_divergence(np.array([1, 2, 3, 4]), np.array([1, 2, 9, 4])) == 2
    assert metrics.first_divergence(np.array([5]), np.array([6])) == 0
    with pytest.raises(ValueError):
        metrics.first_divergence(np.array([1, 2]), np.array([1]))


# ------------------------------------------------------------------------------------------
# thresholds: limits, and non-finite metrics that must fail whatever the limits


def _record(**nvfp4):
    """A minimal validation record: bf16, nvfp4 (overridable) and one layer row."""
    model = {
        "kl_mean": 0.01,
        "kl_p99": 0.05,
        "top1": 0.9,
        "ppl": 10.1,
        "ppl_increase": 0.01,
        "logit_max_err": 0.5,
        "logit_mean_err": 0.1,
    }
    layer = {"name": "model.layers.0.mlp.up_proj", "nvfp4_weight_sqnr_db": 20.0, "nvfp4_output_sqnr_db": 19.0}
    for key, value in nvfp4.items():
        (layer if key.endswith("sqnr_db") else model)[key] = value
    return {"models": {"bf16": {"ppl": 10.0}, "nvfp4": model}, "layers": [layer]}


@pytest.mark.parametrize(
    "change, failed",
    [
        ({}, []),
        ({"kl_mean": 0.2}, ["kl_mean"]),
        ({"kl_p99": 0.6}, ["kl_p99"]),
        ({"ppl_increase": 0.5}, ["ppl_increase"]),
        ({"nvfp4_weight_sqnr_db": 5.0}, ["layer_weight_sqnr_db"]),
        ({"nvfp4_weight_sqnr_db": math.inf}, []),  # an exact layer
        ({"kl_mean": math.nan}, ["kl_mean"]),
        ({"kl_mean": math.nan, "ppl": math.nan, "ppl_increase": math.nan}, ["kl_mean", "ppl", "ppl_increase"]),
        ({"kl_p99": math.inf}, ["kl_p99"]),
        ({"top1": math.nan}, ["top1"]),  # no limit on top1 by default: still fails
        ({"logit_max_err": math.inf}, ["logit_max_err"]),  # never has a limit
        ({"nvfp4_weight_sqnr_db": math.nan}, ["nvfp4_weight_sqnr_db"]),
        ({"nvfp4_output_sqnr_db": -math.inf}, ["nvfp4_output_sqnr_db"]),
        ({"ppl": np.float32("nan")}, ["ppl"]),
    ],
)
def test_thresholds_fail_limits_and_every_non_finite_metric(change, failed):
    from nvfp4tool.validate.thresholds import Thresholds, check_thresholds

    failures = check_thresholds(_record(**change), Thresholds(), label="nvfp4")
    assert sorted(f["metric"] for f in failures) == sorted(failed)
    for f in failures:
        assert f["by"] > 0
        if not math.isfinite(f["value"]) and f["value"] != math.inf:
            assert f["by"] == math.inf and "not a finite number" in f["detail"]


def test_non_finite_bf16_metric_fails_too():
    from nvfp4tool.validate.thresholds import Thresholds, check_thresholds

    record = _record()
    record["models"]["bf16"]["ppl"] = math.nan
    failures = check_thresholds(record, Thresholds(), label="nvfp4")
    assert [(f["metric"], f["detail"]) for f in failures] == [("ppl", "bf16 model: not a finite number")]


@pytest.mark.parametrize("field", ["max_kl_mean", "max_kl_p99", "min_top1", "max_ppl_increase", "min_layer_sqnr_db"])
@pytest.mark.parametrize("value", [math.nan, math.inf, "0.1"])
def test_non_finite_threshold_is_a_usage_error(field, value):
    from nvfp4tool.errors import NVFP4UsageError
    from nvfp4tool.validate.thresholds import Thresholds

    with pytest.raises(NVFP4UsageError, match=field):
        Thresholds(**{field: value})


def test_default_limits_are_the_exports_quants_and_given_limits_override_them():
    """validate judges an export by its quant's defaults (W4A4 looser than W4A16, W4A16's p99 looser
    than FP8's), with the limits a user gave over them; the best published exports of each kind
    pass their own (accuracy-smollm2.md: FP8, `w4a16-best`, `w4a4-ptq`), RTN W4A4 does not."""
    from nvfp4tool.errors import NVFP4UsageError
    from nvfp4tool.validate.runner import ValidateOptions
    from nvfp4tool.validate.thresholds import Thresholds, check_thresholds, defaults_for

    options = ValidateOptions(data="ids.npy")
    assert options.judged_by("fp8") == Thresholds()
    assert options.judged_by("nvfp4-weight-only") == Thresholds(max_kl_p99=1.0)
    assert options.judged_by("nvfp4") == Thresholds(max_kl_mean=0.25, max_kl_p99=2.0, max_ppl_increase=0.25)
    given = ValidateOptions(data="ids.npy", limits={"max_kl_mean": 0.3, "min_top1": 0.5})
    assert given.judged_by("nvfp4") == Thresholds(max_kl_mean=0.3, max_kl_p99=2.0, max_ppl_increase=0.25, min_top1=0.5)
    fixed = ValidateOptions(data="ids.npy", thresholds=Thresholds(max_kl_mean=1e-9))
    assert fixed.judged_by("nvfp4").max_kl_mean == 1e-9
    with pytest.raises(NVFP4UsageError, match="unknown threshold names"):
        ValidateOptions(data="ids.npy", limits={"max_kl": 1.0}).judged_by("nvfp4")

    measured = {  # (quant, KL mean, KL p99, ppl increase) on SmolLM2-135M, held-out text
        "fp8": ("fp8", 0.04509, 0.3156, 0.0458),
        "w4a16-best": ("nvfp4-weight-only", 0.0794, 0.9022, 0.0825),
        "w4a4-ptq": ("nvfp4", 0.2322, 1.946, 0.2293),
        "w4a4 rtn": ("nvfp4", 0.4550, 2.516, 0.5042),
    }
    for name, (quant, kl, p99, ppl) in measured.items():
        record = _record(kl_mean=kl, kl_p99=p99, ppl_increase=ppl, ppl=10.0 * (1 + ppl))
        failed = check_thresholds(record, defaults_for(quant), label="nvfp4")
        assert (failed == []) == (name != "w4a4 rtn"), (name, failed)
