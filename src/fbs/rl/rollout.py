"""Stage-2 episodes: decode with sampled gates through the engine, score the gold option, recompute log-probs.

An episode for one prompt p (paper §3.1.3, appendix E.7):

1. **Decode** up to ``max_new_tokens`` with :func:`fbs.engine.generate` and ``gate_sampling=True``: every
   gated (token, layer) decision is a Bernoulli(p) action, executed with true layer skipping. The trace
   gives the decisions, their probabilities and the executed compute c / c0 (``tflops_rel_exact`` of the
   episode's own trace, or the paper's layer-count estimate).
2. **Score** the gold option y* teacher-forced after p. The policy's gates are *sampled in the parallel
   forward* (``gate_mode="soft"`` with a seeded generator: hard Bernoulli samples, layer by layer), then
   replayed with ``gate_mode="plan"``: the replay gives NLL_FBS and the log-probs, ``gate_mode="off"``
   gives NLL_Full. These decisions are actions too and share the episode's reward. The prompt itself is
   never gated (the engine prefills it with every layer).
3. **Log-probs** of every action, log p or log(1 - p), come from a parallel ``gate_mode="plan"`` forward
   that replays the decisions (:func:`gate_logprobs`), so PPO's new and old log-probs come from one code
   path. The engine's recorded ``gate_p`` equals the recomputed p (``project`` KV policy); the largest
   difference is logged as ``gate_p_mismatch``.

Layout: rows are left-padded to the longest prompt P, so generated / gold token j sits at position P + j
in every row and ``gate_from = P`` for the whole batch.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from ..engine import DecodeTrace
from ..flops import FlopCounter
from .reward import RewardParts, sequence_nll, skip_reward


class GateActions(NamedTuple):
    """Gate decisions over one batch of left-padded sequences. T = P + new tokens, L = decoder layers."""

    input_ids: torch.Tensor       # (B, T) long, 0 at padding
    attention_mask: torch.Tensor  # (B, T) bool
    skip_plan: torch.Tensor       # (B, T, L) bool, the sampled decisions (True = skip), False off-action
    action_mask: torch.Tensor     # (B, T, L) bool, the (token, layer) pairs that were decisions
    old_logprobs: torch.Tensor    # (B, T, L) float, log-prob of each decision when sampled, 0 off-action


class Trajectory(NamedTuple):
    """One batch of episodes (B prompts)."""

    decode: GateActions           # decisions made while decoding (engine)
    score: GateActions            # decisions made while scoring the gold option (parallel forward)
    gate_from: int                # P: first gated position (the longest prompt's length)
    rewards: torch.Tensor         # (B,) R
    compute_term: torch.Tensor    # (B,) alpha (c0 - c) / c0
    quality_penalty: torch.Tensor  # (B,) beta max(0, Delta-l)
    delta_nll: torch.Tensor       # (B,) Delta-l, nats per gold token
    c_rel: torch.Tensor           # (B,) c / c0
    skip_ratio: torch.Tensor      # (B,) skipped share of decoded (token, layer) pairs, all layers
    num_new: torch.Tensor         # (B,) long, generated tokens
    gate_p_mismatch: float        # max |engine gate_p - recomputed p| over decode actions


@dataclasses.dataclass
class RolloutOptions:
    max_new_tokens: int = 128
    do_sample: bool = False          # token sampling; the gates are always sampled
    temperature: float = 1.0
    alpha: float = 0.1
    beta: float = 0.1
    compute_measure: str = "exact"   # exact: trace tflops_rel_exact | paper: executed layer share


def _left_pad(rows: list[list[int]], width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    mask = torch.zeros(len(rows), width, dtype=torch.bool, device=device)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r, device=device)
        mask[i, width - len(r):] = True
    return ids, mask


def _with_suffix(prompts: list[list[int]], suffixes: list[list[int]], device):
    """Left-padded prompts (to P) followed by right-padded suffixes (to S): ids, mask (B, P + S) and P."""
    p = max(len(x) for x in prompts)
    s = max(1, max(len(x) for x in suffixes))
    ids, mask = _left_pad(prompts, p, device)
    ids = torch.cat([ids, ids.new_zeros(len(prompts), s)], 1)
    mask = torch.cat([mask, mask.new_zeros(len(prompts), s)], 1)
    for i, x in enumerate(suffixes):
        ids[i, p:p + len(x)] = torch.tensor(x, dtype=torch.long, device=device)
        mask[i, p:p + len(x)] = True
    return ids, mask, p


def action_logprobs(probs: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
    """log p where the decision was skip, log(1 - p) where it was compute; (…) -> (…)."""
    p = probs.float().clamp(1e-6, 1 - 1e-6)
    return torch.where(skip, p.log(), torch.log1p(-p))


def gate_logprobs(model, acts: GateActions, gate_from: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replay ``acts`` in a parallel forward; returns (log-probs (B, T, L) masked to 0 off-action, p (B, T, L))."""
    out = model(acts.input_ids, acts.attention_mask, gate_mode="plan", skip_plan=acts.skip_plan,
                gate_from=gate_from, soft_window=False)
    lp = action_logprobs(out.gate_probs, acts.skip_plan) * acts.action_mask
    return lp, out.gate_probs


def row_compute(counter: FlopCounter, trace: DecodeTrace, row: int, measure: str) -> float:
    """c / c0 of one row of a batched trace (1.0 when the row decoded no token through the layers)."""
    one = dataclasses.replace(trace, **{f.name: getattr(trace, f.name)[row:row + 1] for f in dataclasses.fields(trace)
                                        if isinstance(getattr(trace, f.name), torch.Tensor)})
    if not bool(one.valid.any()):
        return 1.0
    paper, exact = counter.relative(one)
    return exact if measure == "exact" else paper


@torch.no_grad()
def decode_episodes(model, prompts: list[list[int]], opts: RolloutOptions, seed: int):
    """Engine rollouts with sampled gates -> (GateActions, engine gate_p aligned to it (B, T, L), c_rel, skip_ratio, n_new)."""
    dev = model.preview_ids.device
    res = model.generate(prompts, max_new_tokens=opts.max_new_tokens, gate_sampling=True, seed=seed,
                         do_sample=opts.do_sample, temperature=opts.temperature)
    tr = res.trace
    ids, mask, p = _with_suffix(prompts, res.new_tokens, dev)
    b, t, L = ids.shape[0], ids.shape[1], model.num_layers
    n = tr.valid.shape[1]
    plan = torch.zeros(b, t, L, dtype=torch.bool, device=dev)
    amask = torch.zeros_like(plan)
    engine_p = torch.zeros(b, t, L, device=dev)
    valid = tr.valid.to(dev).unsqueeze(-1)                                     # (B, N, 1)
    decided = ~torch.isnan(tr.gate_p.to(dev)) & valid                          # (B, N, L)
    plan[:, p:p + n] = tr.intended_skip.to(dev) & decided
    amask[:, p:p + n] = decided
    engine_p[:, p:p + n] = torch.nan_to_num(tr.gate_p.to(dev), nan=0.0)
    counter = FlopCounter(model)
    c_rel = torch.tensor([row_compute(counter, tr, r, opts.compute_measure) for r in range(b)])
    ex = (tr.executed & tr.valid.unsqueeze(-1)).sum((1, 2)).float()
    tot = (tr.valid.sum(1) * L).float()
    skip = torch.where(tot > 0, 1 - ex / tot.clamp_min(1), torch.zeros_like(tot))
    n_new = torch.tensor([len(x) for x in res.new_tokens])
    acts = GateActions(ids, mask, plan, amask, torch.zeros(b, t, L, device=dev))
    return acts, engine_p, c_rel, skip, n_new, p


@torch.no_grad()
def score_episodes(model, prompts: list[list[int]], golds: list[list[int]], seed: int):
    """Gold-option scoring under sampled gates -> (GateActions, Delta-l (B,), P)."""
    dev = model.preview_ids.device
    ids, mask, p = _with_suffix(prompts, golds, dev)
    b, t, L = ids.shape[0], ids.shape[1], model.num_layers
    target = mask.clone()
    target[:, :p] = False                                                       # score only gold tokens
    gen = torch.Generator(device=dev).manual_seed(seed)
    sampled = model(ids, mask, gate_mode="soft", gate_from=p, soft_window=False, generator=gen)
    # a decision matters only where the token's output is consumed: gold positions but the last one
    consumed = torch.zeros_like(mask)
    for i, g in enumerate(golds):
        consumed[i, p:p + len(g) - 1] = True
    gated = torch.zeros(L, dtype=torch.bool, device=dev)
    gated[list(model.layers_cfg.gated)] = True
    amask = consumed.unsqueeze(-1) & gated                                       # (B, T, L)
    plan = (sampled.skips > 0.5) & amask
    fbs = model(ids, mask, gate_mode="plan", skip_plan=plan, gate_from=p, soft_window=False)
    full = model(ids, mask, gate_mode="off", soft_window=False)
    n_gold = torch.tensor([max(1, len(g)) for g in golds], device=dev, dtype=torch.float32)
    delta = (sequence_nll(fbs.logits, ids, target) - sequence_nll(full.logits, ids, target)) / n_gold
    acts = GateActions(ids, mask, plan, amask, torch.zeros(b, t, L, device=dev))
    return acts, delta.cpu(), p


@torch.no_grad()
def generate_trajectory(model, prompts: list[list[int]], golds: list[list[int]], opts: RolloutOptions,
                        seed: int) -> Trajectory:
    """B episodes (token-id prompts and gold-option ids) -> a :class:`Trajectory` with old log-probs filled."""
    dec, engine_p, c_rel, skip, n_new, p_dec = decode_episodes(model, prompts, opts, seed)
    sc, delta, p_sc = score_episodes(model, prompts, golds, seed + 1)
    assert p_dec == p_sc
    lp_dec, p_re = gate_logprobs(model, dec, p_dec)
    lp_sc, _ = gate_logprobs(model, sc, p_sc)
    mismatch = float(((p_re.float() - engine_p) * dec.action_mask).abs().max()) if dec.action_mask.any() else 0.0
    parts: RewardParts = skip_reward(c_rel, delta, opts.alpha, opts.beta)
    return Trajectory(dec._replace(old_logprobs=lp_dec), sc._replace(old_logprobs=lp_sc), p_dec,
                      parts.total, parts.compute_term, parts.quality_penalty, parts.delta_nll, c_rel, skip, n_new,
                      mismatch)
