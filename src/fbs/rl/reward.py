"""The Stage-2 reward (paper §3.1.3 "Reward function", appendix E.7 / D.3):

    R = alpha * (c0 - c) / c0  -  beta * max(0, Delta-l),

c / c0 the executed compute of the decoded episode relative to full compute (the engine's trace) and
Delta-l a per-token quality degradation. The paper scores the gold option of a multiple-choice prompt
teacher-forced; this recipe uses the mean divergence of the episode's own decoded tokens from the
full-depth model (:mod:`fbs.rl.credit`), which is >= 0. :mod:`fbs.rl.credit` splits R into per-decision
and per-token credits; :func:`skip_reward` is the episode-level formula they sum to.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class RewardParts(NamedTuple):
    """Per-episode reward decomposition; every field (B,)."""

    total: torch.Tensor            # R
    compute_term: torch.Tensor     # alpha (c0 - c) / c0
    quality_penalty: torch.Tensor  # beta max(0, Delta-l)  (>= 0; subtracted)
    delta_nll: torch.Tensor        # Delta-l in nats per token (may be negative)


def skip_reward(c_rel: torch.Tensor, delta_nll: torch.Tensor, alpha: float = 0.1, beta: float = 0.1) -> RewardParts:
    """``c_rel`` (B,) = c / c0; ``delta_nll`` (B,) per-token quality degradation."""
    compute = alpha * (1.0 - c_rel)
    penalty = beta * delta_nll.clamp_min(0.0)
    return RewardParts(compute - penalty, compute, penalty, delta_nll)
