"""Per-(token, layer) credit for Stage-2 (paper §3.1.3 "Reward function", appendix E.7).

The episode reward of the paper, R = alpha (1 - c / c0) - beta Delta-l, is split into credits that each
belong to something the policy did (DESIGN.md §5: compute is counted from what ran):

* **compute**, one credit per gate decision (token t, layer l): alpha x the multiply-accumulates the
  decision saved / c0. A skip saves the layer's cost at its context length (``LayerCost`` of
  :mod:`fbs.engine.flops`) minus the K/V projection it still wrote (``project``); under ``hole`` a skip also removes
  one key from the attention of every later token that runs that layer. A "compute" decision saves nothing.
* **overhead**, one per episode: alpha x (- the MACs of PAW, CH and SG) / c0. No gate decision changes it
  while PAW and CH layers are not gated (true of the default never-skip sets: PAW on layer 1, CH among the
  last six), so it enters R but no action's return. If a PAW or CH layer is gated, the module MACs a skip
  saves stay in this credit (a skipped PAW layer's window, and so its cost, is never known).
* **quality**, one per decoded token t: -beta d_t / n, with d_t the token's divergence from the full-depth
  model (``kl``: KL(p_full || p_fbs) of the next-token distribution on the generated context; ``nll``: the
  full-depth model's NLL of the generated token) and n the episode's decoded tokens, so the episode's
  quality term is beta x mean_t d_t (Delta-l, nats per token; d_t >= 0, so the paper's max(0, .) is moot).

The credits of an episode sum to its reward (``tests/test_rl_credit.py``). The return of action (t, l) is
its own compute credit plus the discounted quality reward-to-go from t: a decision at token t changes
token t's output and, through the K/V it leaves in the cache, later tokens', never earlier ones.
Advantages are the returns normalised over the batch (zero mean, unit standard deviation).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from ..engine.flops import FlopCounter

if TYPE_CHECKING:
    from ..engine import DecodeTrace


class Credits(NamedTuple):
    """Credits of B episodes over N decode steps and L layers; they sum to the episode rewards."""

    compute: torch.Tensor   # (B, N, L) float64: alpha x MACs saved by the decision / c0 (0 where nothing was decided)
    quality: torch.Tensor   # (B, N) float64: -beta d_t / n at decoded tokens, 0 elsewhere
    overhead: torch.Tensor  # (B,) float64: alpha x (action-independent compute) / c0, <= 0

    @property
    def total(self) -> torch.Tensor:
        """(B,) the episode rewards R."""
        return self.compute.sum((1, 2)) + self.quality.sum(1) + self.overhead

    @property
    def compute_term(self) -> torch.Tensor:
        """(B,) alpha (1 - c / c0)."""
        return self.compute.sum((1, 2)) + self.overhead


def _row(trace: DecodeTrace, r: int) -> DecodeTrace:
    return dataclasses.replace(trace, **{f.name: getattr(trace, f.name)[r:r + 1] for f in dataclasses.fields(trace)
                                         if isinstance(getattr(trace, f.name), torch.Tensor)})


def macs_saved(counter: FlopCounter, trace: DecodeTrace) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, N, L) MACs each (token, layer) pair saved by not running, and (B,) c0, the MACs of the base model
    computing every layer for the same tokens (``FlopCounter``'s normalizer)."""
    cost, valid = counter.cost, trace.valid                                  # valid (B, N)
    ran = trace.executed & valid.unsqueeze(-1)                               # (B, N, L)
    skipped = ~trace.executed & valid.unsqueeze(-1)
    unwritten = (~trace.kv_written & valid.unsqueeze(-1)).double()
    # a layer attending to every key: the cost of this pair had it run with nothing skipped before it
    full = cost.layer_macs(trace.context_len.double() + 1)                   # (B, N)
    # runs of this layer by later tokens, each of which attends to one key fewer when this pair wrote none
    later_runs = ran.double().flip(1).cumsum(1).flip(1) - ran.double()       # (B, N, L)
    saved = skipped.double() * (full.unsqueeze(-1) - cost.kv_proj * (1 - unwritten)
                                + cost.per_key * unwritten * later_runs)
    c0 = (valid.double() * (cost.num_layers * full + cost.lm_head)).sum(1)  # (B,)
    return saved, c0


def compute_credits(counter: FlopCounter, trace: DecodeTrace, alpha: float, measure: str = "exact"
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(compute credits (B, N, L), overhead credits (B,), c / c0 (B,)) of an engine trace.

    ``exact``: c / c0 is ``tflops_rel_exact`` of each row (all executed MACs incl. FBS overhead);
    ``paper``: the executed share of (token, layer) pairs, every skip saving 1 / (n L), no overhead."""
    b, n, L = trace.executed.shape
    if measure == "paper":
        skipped = (~trace.executed & trace.valid.unsqueeze(-1)).double()
        pairs = (trace.valid.sum(1) * L).double().clamp_min(1)
        credit = alpha * skipped / pairs.view(-1, 1, 1)
        c_rel = torch.where(trace.valid.any(1), 1 - skipped.sum((1, 2)) / pairs, torch.ones(b, dtype=torch.float64))
        return credit, torch.zeros(b, dtype=torch.float64), c_rel
    if measure != "exact":
        raise ValueError(f"compute measure must be exact or paper, got {measure!r}")
    saved, c0 = macs_saved(counter, trace)
    credit = alpha * saved / c0.clamp_min(1).view(-1, 1, 1)
    c_rel = torch.tensor([counter.relative(_row(trace, r))[1] if bool(trace.valid[r].any()) else 1.0
                          for r in range(b)], dtype=torch.float64)
    # what remains of alpha (1 - c/c0) after the decisions' savings is the FBS modules' cost
    overhead = torch.where(trace.valid.any(1), alpha * (1 - c_rel) - credit.sum((1, 2)), torch.zeros_like(c_rel))
    return credit, overhead, c_rel


def token_divergence(full_logits: torch.Tensor, fbs_logits: torch.Tensor, targets: torch.Tensor,
                     kind: str = "kl") -> torch.Tensor:
    """Per-position quality signal d_t >= 0 from (B, N, V) logits of the full-depth and the skipping model.

    ``kl``: KL(p_full || p_fbs); ``nll``: -log p_full(targets) (B, N), the full-depth model's NLL of the
    token the skipping model emitted."""
    full = F.log_softmax(full_logits.float(), dim=-1)
    if kind == "nll":
        return -full.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if kind != "kl":
        raise ValueError(f"quality must be kl or nll, got {kind!r}")
    fbs = F.log_softmax(fbs_logits.float(), dim=-1)
    return (full.exp() * (full - fbs)).sum(-1).clamp_min(0.0)


def quality_credits(divergence: torch.Tensor, valid: torch.Tensor, beta: float) -> torch.Tensor:
    """(B, N) -beta d_t / n over each row's n decoded tokens (0 elsewhere)."""
    n = valid.sum(1, keepdim=True).clamp_min(1).double()
    return -beta * divergence.double() * valid / n


def reward_to_go(rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = sum_{t' >= t} gamma^(t' - t) r_t' along the last dimension of (B, N) rewards."""
    out = torch.zeros_like(rewards)
    acc = torch.zeros_like(rewards[:, 0])
    for t in range(rewards.shape[1] - 1, -1, -1):
        acc = rewards[:, t] + gamma * acc
        out[:, t] = acc
    return out


def action_returns(credits: Credits, gamma: float) -> torch.Tensor:
    """(B, N, L) return of each decision: its own compute credit + the discounted quality reward-to-go."""
    return credits.compute + reward_to_go(credits.quality, gamma).unsqueeze(-1)


def normalize_advantages(returns: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(A,) returns of all actions of a batch -> zero mean, unit standard deviation (population std)."""
    centered = returns - returns.mean()
    std = centered.pow(2).mean().sqrt()
    return centered / (std + eps) if returns.numel() > 1 else centered
