"""Stage-2 credits: exact per-decision compute credits against fbs.engine.flops, per-token quality, sums, advantages."""

import dataclasses
import math

import pytest
import torch
from conftest import fbs_tiny, randomize

from fbs.engine.flops import FlopCounter
from fbs.rl.credit import (compute_credits, macs_saved, normalize_advantages, reward_to_go,
                           token_divergence)
from fbs.rl.reward import skip_reward
from fbs.rl.rollout import RolloutOptions, generate_trajectory

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [3, 17, 42, 9, 11]]


def _exact_relative(counter, trace, r):
    one = dataclasses.replace(trace, **{f.name: getattr(trace, f.name)[r:r + 1] for f in dataclasses.fields(trace)
                                        if isinstance(getattr(trace, f.name), torch.Tensor)})
    return counter.relative(one)[1]


@pytest.mark.parametrize("policy", ["project", "hole"])
def test_macs_saved_are_exactly_what_flops_counts(policy):
    """Per row, the MACs the decisions saved / c0 equal tflops_rel_exact had every pair run minus
    tflops_rel_exact as decoded, under both KV policies (hole: fewer keys for later tokens too). PAW (layer 1)
    and CH (layer 5) are not gated, as with the default never-skip sets."""
    model = randomize(fbs_tiny("llama", layers=6, kv_policy=policy, never_skip_first=2, ch_layers=(5,)), seed=4)
    assert model.layers_cfg.gated == (2, 3, 4)
    res = model.generate(PROMPTS, max_new_tokens=9, gate_sampling=True, seed=3, batch_policy="gather")
    tr = res.trace
    assert (~tr.executed & tr.valid.unsqueeze(-1)).any(), "the test needs skips"
    counter = FlopCounter(model)
    saved, c0 = macs_saved(counter, tr)
    valid = tr.valid.unsqueeze(-1).expand_as(tr.executed)
    everything = dataclasses.replace(tr, executed=valid.clone(), kv_written=valid.clone())
    for r in range(len(PROMPTS)):
        expect = _exact_relative(counter, everything, r) - _exact_relative(counter, tr, r)
        assert float(saved[r].sum() / c0[r]) == pytest.approx(expect, rel=1e-9, abs=1e-12)
    assert bool((saved[tr.executed | ~valid] == 0).all()) and bool((saved[~tr.executed & valid] > 0).all())


@pytest.mark.parametrize("measure", ["exact", "paper"])
def test_credits_sum_to_the_episode_reward(measure):
    model = randomize(fbs_tiny("llama", layers=6), seed=4)
    opts = RolloutOptions(max_new_tokens=8, alpha=0.2, beta=0.3, gamma=0.7, compute_measure=measure)
    traj = generate_trajectory(model, PROMPTS, opts, seed=5)
    cr = traj.credits
    # every credit is attached to a decision, a decoded token or (overhead) the episode, and they add up to R
    total = cr.compute.sum((1, 2)) + cr.quality.sum(1) + cr.overhead
    torch.testing.assert_close(total, traj.rewards)
    # ... which is the paper's formula R = alpha (1 - c/c0) - beta max(0, Delta-l)
    paper = skip_reward(traj.c_rel, traj.delta.double(), 0.2, 0.3)
    torch.testing.assert_close(traj.rewards, paper.total)
    assert bool((traj.delta > 0).all())
    # compute credits sit on skipped decisions only
    decided = torch.zeros_like(cr.compute, dtype=torch.bool)
    decided[traj.row.cpu(), traj.step.cpu(), traj.layer.cpu()] = True
    skipped = torch.zeros_like(decided)
    skipped[traj.row.cpu(), traj.step.cpu(), traj.layer.cpu()] = traj.skip.cpu()
    assert bool((cr.compute[~skipped] == 0).all()) and bool((cr.compute[skipped] > 0).all())
    if measure == "paper":
        assert float(cr.overhead.abs().max()) == 0.0
        n = traj.valid.sum(1).double() * model.num_layers
        torch.testing.assert_close(cr.compute.sum((1, 2)), 0.2 * traj.skip_ratio.double())
        torch.testing.assert_close(cr.compute[skipped], (0.2 / n)[traj.row[traj.skip].cpu()])
    else:
        assert bool((cr.overhead < 0).all())  # the FBS modules cost something whatever the gates decide


def test_returns_are_own_compute_credit_plus_discounted_quality():
    model = randomize(fbs_tiny("llama", layers=6), seed=4)
    traj = generate_trajectory(model, PROMPTS, RolloutOptions(max_new_tokens=8, gamma=0.5), seed=5)
    q = traj.credits.quality
    for a in range(0, len(traj.skip), 7):
        r, t, l = int(traj.row[a]), int(traj.step[a]), int(traj.layer[a])
        rtg = sum(0.5 ** (k - t) * float(q[r, k]) for k in range(t, q.shape[1]))
        assert float(traj.returns[a]) == pytest.approx(float(traj.credits.compute[r, t, l]) + rtg, rel=1e-9, abs=1e-15)
    # with gamma = 1 the first decision of a row carries the row's whole quality term
    one = generate_trajectory(model, PROMPTS, RolloutOptions(max_new_tokens=8, gamma=1.0), seed=5)
    a = int(((one.step == 0) & (one.row == 0) & ~one.skip).nonzero()[0])
    assert float(one.returns[a]) == pytest.approx(float(one.credits.quality[0].sum()), rel=1e-9)


def test_reward_to_go_hand_computed():
    r = torch.tensor([[1.0, 2.0, 4.0], [0.0, 0.0, 8.0]], dtype=torch.float64)
    torch.testing.assert_close(reward_to_go(r, 0.5), torch.tensor([[3.0, 4.0, 4.0], [2.0, 4.0, 8.0]],
                                                                  dtype=torch.float64))
    torch.testing.assert_close(reward_to_go(r, 0.0), r)


def test_normalized_advantages_have_zero_mean_and_unit_std():
    g = torch.tensor([0.3, -1.0, 2.5, 0.0, 0.01], dtype=torch.float64)
    a = normalize_advantages(g)
    assert float(a.mean()) == pytest.approx(0.0, abs=1e-12)
    assert float(a.pow(2).mean().sqrt()) == pytest.approx(1.0, rel=1e-6)
    assert a.argsort().tolist() == g.argsort().tolist()
    model = randomize(fbs_tiny("llama", layers=6), seed=4)
    traj = generate_trajectory(model, PROMPTS, RolloutOptions(max_new_tokens=8), seed=5)
    assert float(traj.advantages.mean()) == pytest.approx(0.0, abs=1e-5)
    assert float(traj.advantages.pow(2).mean().sqrt()) == pytest.approx(1.0, rel=1e-4)


def test_token_divergence_hand_computed():
    full = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]]))
    fbs = torch.log(torch.tensor([[[0.25, 0.5, 0.25]]]))
    kl = 0.5 * math.log(2) + 0.25 * math.log(0.5)
    assert float(token_divergence(full, fbs, torch.tensor([[1]]), "kl")) == pytest.approx(kl, rel=1e-6)
    assert float(token_divergence(full, full, torch.tensor([[1]]), "kl")) == pytest.approx(0.0, abs=1e-7)
    assert float(token_divergence(full, fbs, torch.tensor([[1]]), "nll")) == pytest.approx(math.log(4), rel=1e-6)


def test_an_episode_that_never_skips_has_no_compute_or_quality_credit():
    model = randomize(fbs_tiny("llama", layers=6), seed=2, gate_bias=-30.0)   # p ~ 1e-13: every gate computes
    traj = generate_trajectory(model, PROMPTS[:1], RolloutOptions(max_new_tokens=6), seed=0)
    assert not bool(traj.skip.any()) and len(traj.skip) > 0
    assert float(traj.credits.compute.abs().max()) == 0.0
    assert float(traj.delta.abs().max()) < 1e-5
    counter = FlopCounter(model)
    _, overhead, c_rel = compute_credits(counter, model.generate(PROMPTS[:1], max_new_tokens=6, gate_sampling=True,
                                                                 seed=0).trace, 0.1)
    torch.testing.assert_close(overhead, 0.1 * (1 - c_rel))   # all of alpha (1 - c/c0) is the modules' overhead
