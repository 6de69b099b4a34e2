"""Stage-2 PPO: the clipped loss by hand, the baseline, and one step on a tiny model (frozen backbone)."""

import pytest
import torch
from conftest import fbs_tiny, randomize

from fbs.rl.ppo import GateClippedPPOLoss, RewardBaseline, ppo_step
from fbs.rl.rollout import RolloutOptions, action_logprobs, gate_logprobs, generate_trajectory
from fbs.rl.stage2 import select_policy


pytestmark = pytest.mark.usefixtures("one_thread")


def test_clipped_loss_hand_computed():
    # episode 0 (A = +1): ratios 1.5 (clipped to 1.2), 0.5 (unclipped: min picks 0.5); episode 1 (A = -2):
    # ratio 0.5 -> clipped 0.8 gives the larger loss 1.6; the masked action is ignored
    old = torch.log(torch.tensor([[0.4, 0.4], [0.4, 0.4]]))
    new = torch.log(torch.tensor([[0.6, 0.2], [0.2, 0.9]]))
    mask = torch.tensor([[True, True], [True, False]])
    out = GateClippedPPOLoss(0.2)(new, old, torch.tensor([1.0, -2.0]), mask)
    # per-action losses: -1.2, -0.5, +1.6 -> mean (1.6 - 1.7) / 3
    torch.testing.assert_close(out.loss, torch.tensor((-1.2 - 0.5 + 1.6) / 3))
    torch.testing.assert_close(out.clipfrac, torch.tensor(2 / 3))
    torch.testing.assert_close(out.ratio, torch.tensor((1.5 + 0.5 + 0.5) / 3))
    # gradient flows only through unclipped actions: d/d new_logprob of action (0,1) = -A*r/3
    new.requires_grad_(True)
    GateClippedPPOLoss(0.2)(new, old, torch.tensor([1.0, -2.0]), mask).loss.backward()
    torch.testing.assert_close(new.grad, torch.tensor([[0.0, -0.5 / 3], [0.0, 0.0]]))


def test_action_logprobs():
    p = torch.tensor([0.25, 0.25])
    torch.testing.assert_close(action_logprobs(p, torch.tensor([True, False])), torch.log(torch.tensor([0.25, 0.75])))


def test_running_mean_baseline():
    b = RewardBaseline("running_mean", momentum=0.5)
    torch.testing.assert_close(b.advantages(torch.tensor([1.0, 3.0])), torch.tensor([-1.0, 1.0]))  # first: batch mean
    torch.testing.assert_close(b.advantages(torch.tensor([4.0, 4.0])), torch.tensor([2.0, 2.0]))    # b = 2
    assert b.value == 3.0
    torch.testing.assert_close(RewardBaseline("batch_mean").advantages(torch.tensor([1.0, 2.0])), torch.tensor([-0.5, 0.5]))


def test_ppo_step_trains_gates_only():
    model = randomize(fbs_tiny("llama", layers=6), seed=3)
    traj = generate_trajectory(model, [[5, 6, 7, 8], [9, 10]], [[11, 12, 13], [14, 15, 16]],
                               RolloutOptions(max_new_tokens=5), seed=1)
    # old log-probs are the replayed ones: the first PPO epoch starts at ratio 1
    lp, _ = gate_logprobs(model, traj.decode, traj.gate_from)
    torch.testing.assert_close(lp, traj.decode.old_logprobs)
    named = select_policy(model, train_paw=False)
    assert named and all(n.startswith("gates.") for n in named)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.Adam(list(named.values()), lr=1e-2)
    stats = ppo_step(model, opt, traj, torch.tensor([1.0, -1.0]), GateClippedPPOLoss(0.2), epochs=2)
    assert stats.grad_norm > 0
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(n.startswith("gates.") for n in changed)
    for n, p in model.named_parameters():
        if not n.startswith("gates."):
            assert torch.equal(p, before[n]), n
    assert any(n.startswith("gates.out") for n in changed)
