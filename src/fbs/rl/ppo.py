"""PPO over skip-gate decisions (paper §2.5 / §3.1.3 Stage-2; Schulman et al. 2017, Eq. 7).

An action is one (token, layer) gate decision; its probability is p (skip) or 1 - p (compute). Each action
has its own advantage (:mod:`fbs.rl.credit`: its compute credit plus the quality reward-to-go of its
token, normalised over the batch). The loss is the clipped surrogate averaged over the batch's actions plus
``kl_coef`` x the mean Bernoulli KL(pi || pi_ref) to the Stage-1 gate policy at the same states.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from .rollout import Trajectory, action_logprobs, action_probs


class PPOLossOutput(NamedTuple):
    loss: torch.Tensor         # scalar, differentiable
    policy_loss: torch.Tensor  # scalar, detached (= loss)
    ratio: torch.Tensor        # scalar, detached: mean pi / pi_old over actions
    clipfrac: torch.Tensor     # scalar, detached: share of actions where the clip was active
    approx_kl: torch.Tensor    # scalar, detached: mean 0.5 (log pi - log pi_old)^2


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp_min(1)


class GateClippedPPOLoss(nn.Module):
    """L = mean_actions max(-A r, -A clip(r, 1 - eps, 1 + eps)), r = exp(log pi - log pi_old).

    logprobs, old_logprobs, mask: (B, ...) over the actions of B episodes; advantages: the same shape (one
    per action) or (B,) (one per episode, shared by its actions)."""

    def __init__(self, epsilon: float = 0.2):
        super().__init__()
        if not 0 < epsilon < 1:
            raise ValueError(f"epsilon must be in (0, 1), got {epsilon}")
        self.epsilon = epsilon

    def forward(self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor) -> PPOLossOutput:
        adv = advantages.to(logprobs.dtype)
        if adv.shape != logprobs.shape:
            adv = adv.view(-1, *([1] * (logprobs.dim() - 1)))                   # (B, 1, ...)
        mask = mask.to(logprobs.dtype)
        log_ratio = (logprobs - old_logprobs) * mask
        ratio = log_ratio.exp()
        unclipped = -adv * ratio
        clipped = -adv * ratio.clamp(1 - self.epsilon, 1 + self.epsilon)
        loss = _masked_mean(torch.maximum(unclipped, clipped), mask)
        clipfrac = _masked_mean((clipped > unclipped).to(mask.dtype), mask)
        kl = _masked_mean(0.5 * log_ratio.pow(2), mask)
        return PPOLossOutput(loss, loss.detach(), _masked_mean(ratio, mask).detach(), clipfrac.detach(), kl.detach())


def bernoulli_kl(p: torch.Tensor, q: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """KL(Bernoulli(p) || Bernoulli(q)) elementwise, in nats."""
    p, q = p.clamp(eps, 1 - eps), q.clamp(eps, 1 - eps)
    return p * (p.log() - q.log()) + (1 - p) * (torch.log1p(-p) - torch.log1p(-q))


class PPOStats(NamedTuple):
    loss: float        # total loss of the last update
    policy_loss: float
    ratio: float
    clipfrac: float
    approx_kl: float   # to the rollout policy
    kl_ref: float      # mean Bernoulli KL to the Stage-1 gates
    grad_norm: float


def ppo_step(gates: nn.Module, optimizer: torch.optim.Optimizer, traj: Trajectory, loss_fn: GateClippedPPOLoss,
             epochs: int = 4, grad_clip: float = 1.0, kl_coef: float = 0.1) -> PPOStats:
    """``epochs`` full-batch updates of ``gates`` on one trajectory batch, from the recorded gate inputs
    (no backbone pass); returns the stats of the last update. The caller freezes everything but the gates."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not len(traj.skip):
        return PPOStats(0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0)
    ones = torch.ones_like(traj.old_logprob)
    for _ in range(epochs):
        probs = action_probs(gates, traj.inputs)                                 # (A,)
        out = loss_fn(action_logprobs(probs, traj.skip), traj.old_logprob, traj.advantages, ones)
        kl_ref = bernoulli_kl(probs, traj.ref_prob).mean()
        loss = out.loss + kl_coef * kl_ref
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return PPOStats(float(loss.detach()), float(out.policy_loss), float(out.ratio), float(out.clipfrac),
                    float(out.approx_kl), float(kl_ref.detach()), float(norm))
