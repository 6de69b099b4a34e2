"""Stage-2 acceptance: the equal-PPL comparison of two fronts, by hand and on synthetic per-block scores."""

import math

import numpy as np
import pytest

from fbs.rl.accept import AcceptConfig, Sweep, compare, front_skip


def test_front_skip_interpolates_the_upper_envelope():
    ppl = np.array([10.0, 12.0, 11.0, 14.0])
    skip = np.array([0.0, 0.2, 0.25, 0.3])       # (11, 0.25) dominates (12, 0.2): the envelope is 0.25 there
    assert front_skip(ppl, skip, 10.5) == pytest.approx(0.125)
    assert front_skip(ppl, skip, 12.0) == pytest.approx(0.25)
    assert front_skip(ppl, skip, 13.0) == pytest.approx(0.275)
    assert front_skip(ppl, skip, 20.0) == pytest.approx(0.3)   # flat beyond the last point
    assert front_skip(ppl, skip, 9.0) == 0.0


def _sweep(name, rng, shift, n=40):
    """Per-block NLL rising with skip; ``shift`` > 0 buys the same skip for less NLL (a better front)."""
    base = rng.normal(2.5, 0.3, n)
    pairs = np.full(n, 1000)
    nll, skipped = {None: base}, {None: np.zeros(n)}
    for tau in (0.3, 0.5, 0.7):
        s = 0.4 * (1 - tau)                                        # skip share at this tau
        nll[tau] = base + 1.0 * s * (1 - shift) + rng.normal(0, 0.01, n)
        skipped[tau] = np.round(pairs * s)
    return Sweep(name, nll, skipped, pairs)


def test_compare_finds_a_better_front_with_a_ci_above_zero():
    rng = np.random.default_rng(0)
    norl = _sweep("norl", rng, 0.0)
    rl = Sweep("rl", {k: v.copy() for k, v in norl.nll.items()}, {k: v.copy() for k, v in norl.skipped.items()},
               norl.pairs.copy())
    for tau in (0.3, 0.5, 0.7):
        rl.nll[tau] = norl.nll[None] + 0.5 * (norl.nll[tau] - norl.nll[None])   # half the NLL cost per skip
    rows = compare(norl, rl, resamples=200, seed=1)
    assert [r["tau"] for r in rows] == [0.3, 0.5, 0.7]
    mid = rows[1]
    assert mid["ppl_level"] == pytest.approx(math.exp(float(norl.nll[0.5].mean())))
    assert mid["skip_norl"] == pytest.approx(0.2, abs=1e-3) and mid["skip_rl"] > mid["skip_norl"]
    assert mid["delta_skip"] > 0 and mid["ci"][0] > 0 and mid["p_not_more"] == 0.0
    same = compare(norl, norl, resamples=50, seed=1)
    assert all(r["delta_skip"] == 0.0 and r["ci"] == [0.0, 0.0] for r in same)


def test_accept_config_needs_a_held_out_set():
    with pytest.raises(ValueError, match="held-out"):
        AcceptConfig(init_from="x")
    assert AcceptConfig(init_from="x", ood=True).steps >= 30


def test_verdict_needs_a_ci_above_zero_and_enough_steps_for_a_negative_result():
    from fbs.rl.accept import _verdict

    win = {"set": "ood", "primary": {"delta_skip": 0.05, "ci": [0.01, 0.09]}}
    lose = {"set": "ood", "primary": {"delta_skip": 0.01, "ci": [-0.02, 0.04]}}
    assert _verdict([win], 30).startswith("accepted") and "+5.0 points" in _verdict([win], 2)
    assert _verdict([lose], 30).startswith("not accepted") and _verdict([lose], 2).startswith("inconclusive")
