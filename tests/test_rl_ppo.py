"""Stage-2 PPO: the clipped loss and the KL penalty by hand, and one step on a tiny model (gates only train)."""

import math

import pytest
import torch
from conftest import fbs_tiny, randomize

from fbs.rl.ppo import GateClippedPPOLoss, bernoulli_kl, ppo_step
from fbs.rl.rollout import RolloutOptions, action_logprobs, action_probs, generate_trajectory
from fbs.rl.stage2 import frozen_fingerprint, select_policy, verify_frozen


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


def test_clipped_loss_with_one_advantage_per_action():
    old = torch.log(torch.tensor([0.4, 0.4, 0.4]))
    new = torch.log(torch.tensor([0.6, 0.2, 0.2]))
    out = GateClippedPPOLoss(0.2)(new, old, torch.tensor([1.0, 1.0, -2.0]), torch.ones(3, dtype=torch.bool))
    torch.testing.assert_close(out.loss, torch.tensor((-1.2 - 0.5 + 1.6) / 3))


def test_bernoulli_kl_hand_computed():
    kl = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    torch.testing.assert_close(bernoulli_kl(torch.tensor([0.25, 0.3]), torch.tensor([0.5, 0.3])),
                               torch.tensor([kl, 0.0]))


def test_action_logprobs():
    p = torch.tensor([0.25, 0.25])
    torch.testing.assert_close(action_logprobs(p, torch.tensor([True, False])), torch.log(torch.tensor([0.25, 0.75])))


def test_ppo_step_trains_gates_only():
    model = randomize(fbs_tiny("llama", layers=6), seed=3)
    named = select_policy(model)
    assert named and all(n.startswith("gates.") for n in named)
    assert not any(p.requires_grad for n, p in model.named_parameters() if not n.startswith("gates."))
    ref = __import__("copy").deepcopy(model.gates)
    traj = generate_trajectory(model, [[5, 6, 7, 8], [9, 10], [11, 12, 13]], RolloutOptions(max_new_tokens=6),
                               seed=1, ref_gates=ref)
    # old log-probs are the current gates' on the recorded inputs: the first PPO epoch starts at ratio 1
    torch.testing.assert_close(action_logprobs(action_probs(model.gates, traj.inputs), traj.skip), traj.old_logprob)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    fingerprint = frozen_fingerprint(model)
    opt = torch.optim.Adam(list(named.values()), lr=1e-2)
    stats = ppo_step(model.gates, opt, traj, GateClippedPPOLoss(0.2), epochs=3, kl_coef=0.1)
    assert stats.grad_norm > 0 and stats.kl_ref > 0 and stats.approx_kl > 0
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(n.startswith("gates.") for n in changed)
    assert any(n.startswith("gates.out") for n in changed)
    for n, p in model.named_parameters():
        if not n.startswith("gates."):
            assert torch.equal(p, before[n]), n
    assert frozen_fingerprint(model) == fingerprint
    verify_frozen(model, named)
    model.paw.requires_grad_(True)
    with pytest.raises(RuntimeError, match="gates only"):
        verify_frozen(model, named)


def test_ppo_moves_the_policy_towards_positive_advantages():
    """Skips with positive advantage get more likely, computes with negative advantage less likely."""
    model = randomize(fbs_tiny("llama", layers=6), seed=3)
    named = select_policy(model)
    traj = generate_trajectory(model, [[5, 6, 7, 8], [9, 10]], RolloutOptions(max_new_tokens=6), seed=1)
    adv = torch.where(traj.skip, 1.0, -1.0)        # reward skipping everywhere
    traj = traj._replace(advantages=adv)
    p0 = action_probs(model.gates, traj.inputs).detach()
    ppo_step(model.gates, torch.optim.Adam(list(named.values()), lr=1e-2), traj, GateClippedPPOLoss(0.2), epochs=2,
             kl_coef=0.0)
    assert float(action_probs(model.gates, traj.inputs).detach().mean()) > float(p0.mean())
