"""The Stage-2 reward (paper §3.1.3 "Reward function", appendix E.7 / D.3):

    R = alpha * (c0 - c) / c0  -  beta * max(0, Delta-l),
    Delta-l = (NLL_FBS(y* | p) - NLL_Full(y* | p)) / |y*|,

c / c0 is the executed compute of the decoded episode relative to full compute (the engine's trace),
y* the gold option text with the answer prefix, scored teacher-forced after the prompt.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class RewardParts(NamedTuple):
    """Per-episode reward decomposition; every field (B,)."""

    total: torch.Tensor            # R
    compute_term: torch.Tensor     # alpha (c0 - c) / c0
    quality_penalty: torch.Tensor  # beta max(0, Delta-l)  (>= 0; subtracted)
    delta_nll: torch.Tensor        # Delta-l in nats per gold token (may be negative)


def skip_reward(c_rel: torch.Tensor, delta_nll: torch.Tensor, alpha: float = 0.1, beta: float = 0.1) -> RewardParts:
    """``c_rel`` (B,) = c / c0; ``delta_nll`` (B,) per-token NLL increase of the gold option."""
    compute = alpha * (1.0 - c_rel)
    penalty = beta * delta_nll.clamp_min(0.0)
    return RewardParts(compute - penalty, compute, penalty, delta_nll)


def sequence_nll(logits: torch.Tensor, input_ids: torch.Tensor, target_mask: torch.Tensor) -> torch.Tensor:
    """Summed NLL of the tokens flagged by ``target_mask``, teacher-forced.

    logits (B, T, V) predict ``input_ids`` (B, T) shifted by one; target_mask (B, T) bool marks the tokens
    to score (position 0 cannot be scored). Returns (B,) in nats."""
    lp = F.log_softmax(logits[:, :-1].float(), dim=-1)                          # (B, T-1, V)
    tok = lp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)                     # (B, T-1)
    return -(tok * target_mask[:, 1:]).sum(-1)
