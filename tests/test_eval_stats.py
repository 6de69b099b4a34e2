"""Bootstrap CI / p-value (appendix B.6) and Benjamini-Hochberg on hand-computed cases."""

import numpy as np
import pytest

from fbs.eval.stats import (benjamini_hochberg, bh_adjusted, bootstrap_ci, paired_bootstrap, ppl_metric)


def test_paired_bootstrap_hand_case():
    a, b = [1.0, 0.0, 1.0], [0.0, 0.0, 1.0]
    idx = np.array([[0, 1, 2], [1, 1, 1], [0, 0, 2], [2, 1, 0]])
    # d = [1/3, 0, 2/3, 1/3]; P(d<=0) = 1/4, P(d>=0) = 1 -> p = 0.5
    r = paired_bootstrap(a, b, indices=idx)
    assert r.delta == pytest.approx(1 / 3)
    assert r.p_value == pytest.approx(0.5)
    # numpy linear percentiles of sorted [0, 1/3, 1/3, 2/3]: 2.5% -> 0.075 * 1/3, 97.5% -> 1/3 + 0.925 * 1/3
    assert r.ci_low == pytest.approx(0.025)
    assert r.ci_high == pytest.approx(1 / 3 + 0.925 / 3)
    assert not r.significant


def test_paired_bootstrap_lower_is_better_orientation():
    # per-document NLL: A is lower (better) on every document -> delta of ppl negative, p = 0
    a, b = [1.0, 2.0, 1.5, 1.2], [1.5, 2.6, 2.0, 1.9]
    r = paired_bootstrap(a, b, metric=ppl_metric, higher_is_better=False, n_resamples=200, seed=3)
    assert r.delta < 0 and r.ci_high < 0
    assert r.p_value == 0.0 and r.significant


def test_identical_systems_give_p_one():
    x = np.random.default_rng(0).random(50)
    r = paired_bootstrap(x, x.copy(), n_resamples=100)
    assert r.delta == 0 and r.p_value == 1.0 and r.ci_low == r.ci_high == 0


def test_bootstrap_is_seeded_and_uses_1000_resamples():
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 2, 80), rng.integers(0, 2, 80)
    r1, r2 = paired_bootstrap(a, b, seed=7), paired_bootstrap(a, b, seed=7)
    assert r1 == r2 and r1.n_resamples == 1000
    lo, hi = bootstrap_ci(a, seed=7)
    assert lo <= a.mean() <= hi


def test_benjamini_hochberg_hand_case():
    p = [0.205, 0.001, 0.042, 0.008, 0.039, 0.074, 0.041, 0.06]
    # sorted: .001 .008 .039 .041 .042 .06 .074 .205 vs k*0.05/8 = .00625 .0125 .01875 ... -> largest k = 2
    assert benjamini_hochberg(p, q=0.05) == [False, True, False, True, False, False, False, False]
    q = bh_adjusted(p)
    expect = {0.001: 0.008, 0.008: 0.032, 0.039: 0.0672, 0.041: 0.0672, 0.042: 0.0672, 0.06: 0.08,
              0.074: 0.074 * 8 / 7, 0.205: 0.205}
    assert q == pytest.approx([expect[v] for v in p])
