"""Stage-2 reward: the formula on hand-computed numbers and on hand-built episodes of a tiny model."""

import math

import pytest
import torch
from conftest import fbs_tiny, randomize

from fbs.rl.reward import sequence_nll, skip_reward
from fbs.rl.rollout import RolloutOptions, generate_trajectory


pytestmark = pytest.mark.usefixtures("one_thread")


def test_skip_reward_hand_computed():
    # c/c0 = 0.7, Delta-l = 0.5: 0.1 * 0.3 - 0.1 * 0.5 = -0.02; Delta-l < 0 is not rewarded
    parts = skip_reward(torch.tensor([0.7, 0.6, 1.0]), torch.tensor([0.5, -0.3, 0.0]), alpha=0.1, beta=0.1)
    torch.testing.assert_close(parts.compute_term, torch.tensor([0.03, 0.04, 0.0]))
    torch.testing.assert_close(parts.quality_penalty, torch.tensor([0.05, 0.0, 0.0]))
    torch.testing.assert_close(parts.total, torch.tensor([-0.02, 0.04, 0.0]))
    torch.testing.assert_close(skip_reward(torch.tensor([0.5]), torch.tensor([1.0]), 0.2, 0.05).total,
                               torch.tensor([0.1 - 0.05]))


def test_sequence_nll_hand_computed():
    # vocab 2; logits equal -> each scored token costs log 2; the second row scores one token only
    logits = torch.zeros(2, 3, 2)
    logits[0, 1] = torch.tensor([0.0, math.log(3.0)])   # p(token 1 | pos 1) = 3/4
    ids = torch.tensor([[0, 1, 1], [0, 0, 1]])
    target = torch.tensor([[False, True, True], [False, False, True]])
    torch.testing.assert_close(sequence_nll(logits, ids, target),
                               torch.tensor([math.log(2) - math.log(0.75), math.log(2)]))


def _episode(gate_bias: float, measure: str):
    model = randomize(fbs_tiny("llama", layers=6), seed=2, gate_bias=gate_bias)
    prompts, golds = [[3, 17, 42, 9, 11]], [[20, 21, 22, 23]]
    opts = RolloutOptions(max_new_tokens=6, alpha=0.1, beta=0.1, compute_measure=measure)
    return model, prompts, golds, generate_trajectory(model, prompts, golds, opts, seed=0)


def test_episode_never_skipping_earns_nothing():
    _, _, _, tr = _episode(-30.0, "paper")     # p ~ 1e-13: every gate computes
    assert int(tr.decode.skip_plan.sum()) == 0 and int(tr.score.skip_plan.sum()) == 0
    torch.testing.assert_close(tr.c_rel, torch.tensor([1.0]))
    assert float(tr.delta_nll.abs().max()) < 1e-5
    assert float(tr.rewards.abs().max()) < 1e-6


def test_episode_always_skipping_hand_computed():
    model, prompts, golds, tr = _episode(30.0, "paper")  # every gated layer skips: 4 of 6 layers
    gated = list(model.layers_cfg.gated)
    assert len(gated) == 4 and int(tr.num_new) == 6
    torch.testing.assert_close(tr.c_rel, torch.tensor([2 / 6]))
    torch.testing.assert_close(tr.compute_term, torch.tensor([0.1 * 4 / 6]))
    # Delta-l by hand: skip all gated layers on the first 3 gold tokens (the last one's output is unused)
    ids = torch.tensor([prompts[0] + golds[0]])
    plan = torch.zeros(1, ids.shape[1], 6, dtype=torch.bool)
    plan[:, 5:8, gated] = True
    with torch.no_grad():
        fbs = model(ids, gate_mode="plan", skip_plan=plan, gate_from=5).logits
        full = model(ids, gate_mode="off").logits
    target = torch.zeros_like(ids, dtype=torch.bool)
    target[:, 5:] = True
    delta = (sequence_nll(fbs, ids, target) - sequence_nll(full, ids, target)) / 4
    torch.testing.assert_close(tr.delta_nll, delta, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tr.rewards, 0.1 * 4 / 6 - 0.1 * delta.clamp_min(0), atol=1e-6, rtol=1e-5)
    assert float(delta) != pytest.approx(0.0)
