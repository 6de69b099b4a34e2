"""PPO over skip-gate decisions (paper §2.5 / §3.1.3 Stage-2; Schulman et al. 2017, Eq. 7).

An action is one (token, layer) gate decision; its probability is p (skip) or 1 - p (compute). All
decisions of an episode share the episode's advantage A = R - b, with b a baseline (:class:`RewardBaseline`).
The clipped surrogate is averaged over all actions of the batch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from .rollout import Trajectory, gate_logprobs


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

    logprobs, old_logprobs, mask: (B, ...) over the actions of B episodes; advantages: (B,)."""

    def __init__(self, epsilon: float = 0.2):
        super().__init__()
        if not 0 < epsilon < 1:
            raise ValueError(f"epsilon must be in (0, 1), got {epsilon}")
        self.epsilon = epsilon

    def forward(self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor) -> PPOLossOutput:
        adv = advantages.to(logprobs.dtype).view(-1, *([1] * (logprobs.dim() - 1)))  # (B, 1, ...)
        mask = mask.to(logprobs.dtype)
        log_ratio = (logprobs - old_logprobs) * mask
        ratio = log_ratio.exp()
        unclipped = -adv * ratio
        clipped = -adv * ratio.clamp(1 - self.epsilon, 1 + self.epsilon)
        loss = _masked_mean(torch.maximum(unclipped, clipped), mask)
        clipfrac = _masked_mean((clipped > unclipped).to(mask.dtype), mask)
        kl = _masked_mean(0.5 * log_ratio.pow(2), mask)
        return PPOLossOutput(loss, loss.detach(), _masked_mean(ratio, mask).detach(), clipfrac.detach(), kl.detach())


class RewardBaseline:
    """Value baseline b for A = R - b: an exponential running mean of past batch rewards (``running_mean``)
    or the current batch mean (``batch_mean``, a leave-nothing-out estimate). No learned value head: the
    reward is one scalar per episode and its prompt-to-prompt variation is small next to the gate noise."""

    def __init__(self, kind: str = "running_mean", momentum: float = 0.9):
        if kind not in ("running_mean", "batch_mean"):
            raise ValueError(f"baseline must be running_mean or batch_mean, got {kind!r}")
        self.kind, self.momentum, self.value, self.count = kind, momentum, 0.0, 0

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """Advantages of this batch (B,), then fold the batch into the running mean."""
        mean = float(rewards.mean())
        if self.kind == "batch_mean":
            b = mean
        else:
            b = self.value if self.count else mean
            self.value = mean if not self.count else self.momentum * self.value + (1 - self.momentum) * mean
        self.count += 1
        return rewards - b

    def state_dict(self) -> dict:
        return {"kind": self.kind, "value": self.value, "count": self.count}

    def load_state_dict(self, d: dict) -> None:
        self.value, self.count = float(d["value"]), int(d["count"])


class PPOStats(NamedTuple):
    loss: float
    ratio: float
    clipfrac: float
    approx_kl: float
    grad_norm: float


def ppo_step(model, optimizer: torch.optim.Optimizer, traj: Trajectory, advantages: torch.Tensor,
             loss_fn: GateClippedPPOLoss, epochs: int = 2, grad_clip: float = 1.0) -> PPOStats:
    """``epochs`` optimizer updates on one trajectory batch (decode and scoring actions together);
    returns the stats of the last update. The caller freezes everything but the policy parameters."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    adv = advantages.to(traj.decode.input_ids.device)
    for _ in range(epochs):
        lp_dec, _ = gate_logprobs(model, traj.decode, traj.gate_from)
        lp_sc, _ = gate_logprobs(model, traj.score, traj.gate_from)
        b = lp_dec.shape[0]
        out = loss_fn(torch.cat([lp_dec.reshape(b, -1), lp_sc.reshape(b, -1)], 1),
                      torch.cat([traj.decode.old_logprobs.reshape(b, -1), traj.score.old_logprobs.reshape(b, -1)], 1),
                      adv,
                      torch.cat([traj.decode.action_mask.reshape(b, -1), traj.score.action_mask.reshape(b, -1)], 1))
        optimizer.zero_grad(set_to_none=True)
        if out.loss.requires_grad:
            out.loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return PPOStats(float(out.policy_loss), float(out.ratio), float(out.clipfrac), float(out.approx_kl), float(norm))
