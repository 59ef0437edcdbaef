"""The paired statistics (`eval.paired`) against statsmodels' McNemar and a direct bootstrap, on
constructed tables: no flips, all flips, tiny n, lopsided and balanced flips."""

import numpy as np
import pytest
from statsmodels.stats.contingency_tables import mcnemar

from nvfp4tool.eval.paired import binom_cdf_half, mcnemar_exact, paired


def _items(both: int, r2w: int, w2r: int, neither: int):
    """(candidate, reference) 0/1 vectors with those cell counts, shuffled."""
    ref = np.array([1] * both + [1] * r2w + [0] * w2r + [0] * neither)
    cand = np.array([1] * both + [0] * r2w + [1] * w2r + [0] * neither)
    order = np.random.default_rng(both + 7 * r2w + 13 * w2r).permutation(len(ref))
    return cand[order], ref[order]


TABLES = [
    (50, 0, 0, 50),
    (0, 30, 0, 0),
    (0, 12, 9, 0),
    (3, 1, 0, 1),
    (1, 0, 0, 0),
    (0, 0, 1, 0),
    (400, 9, 2, 89),
    (380, 20, 22, 78),
    (0, 0, 0, 5),
    (5000, 61, 58, 900),
]


@pytest.mark.parametrize("table", TABLES, ids=[str(t) for t in TABLES])
def test_mcnemar_equals_statsmodels_exact(table):
    both, r2w, w2r, neither = table
    cand, ref = _items(*table)
    stats = paired(cand, ref)
    theirs = mcnemar([[both, r2w], [w2r, neither]], exact=True).pvalue
    assert stats.mcnemar_p == pytest.approx(float(theirs), rel=1e-12, abs=1e-300)
    assert (stats.right_to_wrong, stats.wrong_to_right) == (r2w, w2r)
    n = sum(table)
    assert stats.n == n and stats.flip_rate == (r2w + w2r) / n
    assert stats.diff == pytest.approx((w2r - r2w) / n)


def test_no_flips_and_all_flips():
    none = paired(*_items(50, 0, 0, 50))
    assert none.diff == 0 and none.se == 0 and none.ci95 == (0, 0) and none.mcnemar_p == 1.0
    assert none.min_detectable == pytest.approx(2.8016 * np.sqrt(1 / 100 / 100), rel=1e-4)  # one-flip floor
    assert none.unpaired_se > 0.04  # what an unpaired comparison of two 50% accuracies would claim
    every = paired(*_items(0, 30, 0, 0))
    assert every.diff == -1.0 and every.se == 0 and every.flip_rate == 1.0
    assert every.mcnemar_p == pytest.approx(2 * 0.5**30)


def test_tiny_n():
    one = paired(np.array([1]), np.array([0]))
    assert (one.diff, one.se, one.ci95, one.min_detectable, one.unpaired_se) == (1.0, None, None, None, None)
    assert one.mcnemar_p == 1.0  # one flip: 2 * P[B(1, .5) <= 0] = 1
    two = paired(np.array([1, 0]), np.array([0, 0]))
    assert two.se == pytest.approx(np.std([1, 0], ddof=1) / np.sqrt(2))


@pytest.mark.parametrize("table", [(380, 20, 22, 78), (400, 9, 2, 89), (100, 40, 10, 50)])
def test_paired_se_equals_the_bootstrap(table):
    cand, ref = _items(*table)
    stats = paired(cand, ref)
    rng = np.random.default_rng(0)
    picks = rng.integers(0, len(cand), (4000, len(cand)))
    boot = (cand[picks] - ref[picks]).mean(axis=1)
    assert stats.se == pytest.approx(boot.std(), rel=0.06)
    low, high = np.percentile(boot, [2.5, 97.5])
    assert stats.ci95[0] == pytest.approx(low, abs=0.4 * stats.se)
    assert stats.ci95[1] == pytest.approx(high, abs=0.4 * stats.se)
    assert stats.se < stats.unpaired_se  # pairing removes the items both get right or wrong


def test_binomial_cdf_exact():
    assert binom_cdf_half(0, 0) == 1.0 and binom_cdf_half(-1, 3) == 0.0
    assert binom_cdf_half(1, 3) == pytest.approx(0.5, rel=1e-12)
    from math import comb

    from scipy.stats import binom

    assert binom_cdf_half(7, 20) == pytest.approx(sum(comb(20, i) for i in range(8)) / 2**20, rel=1e-12)
    for k, n in ((5990, 12032), (3, 4000), (150, 310)):
        assert binom_cdf_half(k, n) == pytest.approx(float(binom.cdf(k, n, 0.5)), rel=1e-9, abs=1e-300)
    assert mcnemar_exact(0, 0) == 1.0


def test_fractional_scores_and_refusals():
    stats = paired(np.array([0.5, 1.0, 0.25]), np.array([1.0, 1.0, 0.0]))
    assert stats.diff == pytest.approx(-0.25 / 3) and (stats.right_to_wrong, stats.wrong_to_right) == (1, 1)
    with pytest.raises(ValueError):
        paired(np.array([1, 0]), np.array([1]))
    with pytest.raises(ValueError):
        paired(np.array([np.nan]), np.array([1.0]))
