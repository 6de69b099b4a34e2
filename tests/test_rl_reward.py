"""Stage-2 reward: the paper's formula on hand-computed numbers and on episodes of a tiny model that skip all."""

import pytest
import torch
from conftest import fbs_tiny, randomize

from fbs.rl.reward import skip_reward
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


def test_episode_always_skipping_hand_computed():
    model = randomize(fbs_tiny("llama", layers=6), seed=2, gate_bias=30.0)  # every gated layer skips: 4 of 6
    prompts = [[3, 17, 42, 9, 11]]
    traj = generate_trajectory(model, prompts, RolloutOptions(max_new_tokens=6, compute_measure="paper"), seed=0)
    gated = list(model.layers_cfg.gated)
    assert len(gated) == 4 and int(traj.num_new) == 6 and bool(traj.skip.all())
    torch.testing.assert_close(traj.c_rel, torch.tensor([2 / 6], dtype=torch.float64))
    torch.testing.assert_close(traj.compute_term, torch.tensor([0.1 * 4 / 6], dtype=torch.float64))
    # Delta-l by hand: mean over the 5 decoded tokens of KL(full || all-gated-layers-skipped)
    ids = torch.tensor([prompts[0] + traj_tokens(model, prompts)])
    plan = torch.zeros(1, ids.shape[1], 6, dtype=torch.bool)
    plan[:, 5:10, gated] = True
    with torch.no_grad():
        fbs = model(ids, gate_mode="plan", skip_plan=plan, gate_from=5).logits[0, 5:10].log_softmax(-1)
        full = model(ids, gate_mode="off").logits[0, 5:10].log_softmax(-1)
    delta = (full.exp() * (full - fbs)).sum(-1).mean()
    torch.testing.assert_close(traj.delta.float(), delta.view(1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(traj.rewards.float(), (0.1 * 4 / 6 - 0.1 * delta).view(1), atol=1e-6, rtol=1e-5)
    assert float(delta) > 0.01


def traj_tokens(model, prompts):
    return model.generate(prompts, max_new_tokens=6, gate_sampling=True, seed=0).new_tokens[0]
