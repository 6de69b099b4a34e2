"""Stage-2 episodes: batched decoding with sampled gates through the engine, then one replay for credits.

A batch of B prompts (paper §3.1.3, appendix E.7) becomes a :class:`Trajectory` in four steps:

1. **Decode** all B prompts in one ``model.generate(prompts, gate_sampling=True, batch_policy="gather")``
   call: every gated (token, layer) decision is a Bernoulli(p) action, executed with true layer skipping;
   rows that stop early leave the batch. The prompt is prefilled with every layer.
2. **Replay** the decisions in a teacher-forced parallel forward (``gate_mode="plan"``), which under the
   ``project`` KV policy equals the cached decode (``tests/test_model_equivalence.py``). It gives the
   skipping model's next-token logits and, recorded on the way, the arguments of ``SkipGates.logits`` at
   every action: the gates' inputs. With the backbone, PAW and CH frozen and the decisions fixed, these
   inputs do not depend on the gate parameters, so PPO recomputes log pi from them alone (a few small
   matmuls per update, no backbone pass). The recomputed p equals the engine's (``gate_p_mismatch``).
3. **Full depth**: ``gate_mode="off"`` on the same tokens gives the reference logits; the quality signal
   d_t compares them with the replay's at every decoded token (:func:`fbs.rl.credit.token_divergence`).
4. **Credits** (:mod:`fbs.rl.credit`): exact per-decision compute credits from the trace, per-token
   quality rewards, returns (own compute credit + discounted quality reward-to-go), normalised advantages,
   and the Stage-1 gate policy's p at every action (``ref_gates``) for the KL penalty.

Layout: rows are left-padded to the longest prompt P, so generated token j sits at position P + j and
decode step j (the engine's trace step that consumed token j) is the replay's position P + j.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, NamedTuple

import torch

from ..engine.flops import FlopCounter
from .credit import (Credits, action_returns, compute_credits, normalize_advantages, quality_credits,
                     token_divergence)


class Trajectory(NamedTuple):
    """B episodes. A = gate decisions of the batch, ordered by layer, then row, then step."""

    inputs: dict[int, tuple]      # gated layer -> SkipGates.logits arguments at its actions, each (1, A_l, ...) or None
    row: torch.Tensor             # (A,) long, episode of each action
    step: torch.Tensor            # (A,) long, decode step (token P + step)
    layer: torch.Tensor           # (A,) long
    skip: torch.Tensor            # (A,) bool, the sampled decision
    old_logprob: torch.Tensor     # (A,) log-prob of the decision under the rollout policy
    ref_prob: torch.Tensor        # (A,) skip probability under the Stage-1 (reference) gates
    returns: torch.Tensor         # (A,) float64, own compute credit + discounted quality reward-to-go
    advantages: torch.Tensor      # (A,) float32, returns normalised over the batch
    credits: Credits              # per-episode credits (B, N, L) / (B, N) / (B,)
    divergence: torch.Tensor      # (B, N) d_t at decoded tokens, 0 elsewhere
    valid: torch.Tensor           # (B, N) bool, decode steps that consumed a token
    c_rel: torch.Tensor           # (B,) c / c0
    skip_ratio: torch.Tensor      # (B,) skipped share of decoded (token, layer) pairs, all layers
    num_new: torch.Tensor         # (B,) long, generated tokens
    gate_p_mismatch: float        # max |engine gate_p - recomputed p| over actions

    @property
    def rewards(self) -> torch.Tensor:
        """(B,) R = alpha (1 - c / c0) - beta Delta-l."""
        return self.credits.total

    @property
    def compute_term(self) -> torch.Tensor:
        return self.credits.compute_term

    @property
    def quality_penalty(self) -> torch.Tensor:
        """(B,) beta Delta-l (>= 0, subtracted)."""
        return -self.credits.quality.sum(1)

    @property
    def delta(self) -> torch.Tensor:
        """(B,) Delta-l: mean d_t over each episode's decoded tokens (nats per token)."""
        return (self.divergence * self.valid).sum(1) / self.valid.sum(1).clamp_min(1)


@dataclasses.dataclass
class RolloutOptions:
    max_new_tokens: int = 128
    do_sample: bool = False          # token sampling; the gates are always sampled
    temperature: float = 1.0
    alpha: float = 0.1
    beta: float = 0.1
    gamma: float = 0.5               # discount of the quality reward-to-go (per token)
    quality: str = "kl"              # kl: KL(full || fbs) per token | nll: full-depth NLL of the emitted token
    compute_measure: str = "exact"   # exact: tflops_rel_exact's MACs | paper: executed layer share


def _with_suffix(prompts: list[list[int]], suffixes: list[list[int]], device):
    """Left-padded prompts (to P) followed by right-padded suffixes (to S): ids, mask (B, P + S) and P."""
    p = max(len(x) for x in prompts)
    s = max(1, max(len(x) for x in suffixes))
    ids = torch.zeros(len(prompts), p + s, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for i, (x, y) in enumerate(zip(prompts, suffixes)):
        ids[i, p - len(x):p + len(y)] = torch.tensor(x + y, dtype=torch.long, device=device)
        mask[i, p - len(x):p + len(y)] = True
    return ids, mask, p


def action_logprobs(probs: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
    """log p where the decision was skip, log(1 - p) where it was compute; (…) -> (…)."""
    p = probs.float().clamp(1e-6, 1 - 1e-6)
    return torch.where(skip, p.log(), torch.log1p(-p))


@contextlib.contextmanager
def recording_gate_inputs(gates, select: dict[int, torch.Tensor]) -> Iterator[dict[int, tuple]]:
    """Record the arguments of ``gates.logits(layer, ...)`` during a parallel forward, at the (B, T) positions
    ``select[layer]`` marks: yields a dict filled with layer -> tuple of (1, A_l, ...) tensors (or None).

    The forward calls ``SkipGates.prob`` -> ``logits`` once per gated layer; this wraps ``logits`` on the
    instance for the duration of the block only."""
    store: dict[int, tuple] = {}
    original = gates.logits

    def take(a, m):
        return a[m].unsqueeze(0).detach() if isinstance(a, torch.Tensor) else a

    def logits(layer, *args):
        m = select.get(layer)
        if m is not None and layer not in store:
            store[layer] = tuple(take(a, m) for a in args)
        return original(layer, *args)

    gates.logits = logits
    try:
        yield store
    finally:
        del gates.logits


def action_probs(gates, inputs: dict[int, tuple]) -> torch.Tensor:
    """(A,) skip probabilities of ``gates`` at recorded actions, in the trajectory's order (by layer)."""
    return torch.cat([gates.prob(l, *inputs[l]).reshape(-1) for l in sorted(inputs)])


@torch.no_grad()
def generate_trajectory(model, prompts: list[list[int]], opts: RolloutOptions, seed: int,
                        ref_gates=None) -> Trajectory:
    """B episodes from token-id prompts -> a :class:`Trajectory`; ``ref_gates`` (default: the current gates)
    is the policy of the KL penalty."""
    dev = model.preview_ids.device
    res = model.generate(prompts, max_new_tokens=opts.max_new_tokens, gate_sampling=True, seed=seed,
                         do_sample=opts.do_sample, temperature=opts.temperature, batch_policy="gather")
    tr = res.trace
    ids, mask, p = _with_suffix(prompts, res.new_tokens, dev)
    b, n, L = tr.executed.shape
    valid = tr.valid.to(dev)
    decided = ~torch.isnan(tr.gate_p.to(dev)) & valid.unsqueeze(-1)          # (B, N, L)
    skip = tr.intended_skip.to(dev) & decided
    if bool((skip == tr.executed.to(dev))[decided].any()):
        raise RuntimeError("the engine ran a layer its gate skipped (or the reverse); Stage-2 needs batch_policy='gather'")
    plan = torch.zeros(b, ids.shape[1], L, dtype=torch.bool, device=dev)
    amask = torch.zeros_like(plan)
    plan[:, p:p + n], amask[:, p:p + n] = skip, decided
    layers = [l for l in range(L) if bool(amask[..., l].any())]

    with recording_gate_inputs(model.gates, {l: amask[..., l] for l in layers}) as inputs:
        fbs = model(ids, mask, gate_mode="plan", skip_plan=plan, gate_from=p, soft_window=False).logits[:, p:p + n]
    if sorted(inputs) != layers:
        raise RuntimeError(f"recorded gate inputs for layers {sorted(inputs)}, expected {layers}: the parallel "
                           "forward no longer calls model.gates.logits per gated layer")
    full = model(ids, mask, gate_mode="off", soft_window=False).logits[:, p:p + n]
    targets = torch.zeros(b, n, dtype=torch.long, device=dev)                 # token P + j + 1, read by step j
    targets[:, :n - 1] = ids[:, p + 1:p + n]
    div = token_divergence(full, fbs, targets, opts.quality) * valid
    del fbs, full

    compute, overhead, c_rel = compute_credits(FlopCounter(model), tr, opts.alpha, opts.compute_measure)
    credits = Credits(compute, quality_credits(div.cpu(), tr.valid, opts.beta), overhead)
    ret_grid = action_returns(credits, opts.gamma)                             # (B, N, L)

    # flat actions, by layer then row then step (the order of boolean indexing of each layer's (B, N) mask)
    where = [decided[..., l].nonzero() for l in layers]                       # (A_l, 2): row, step
    row = torch.cat([w[:, 0] for w in where]) if where else torch.zeros(0, dtype=torch.long, device=dev)
    step = torch.cat([w[:, 1] for w in where]) if where else torch.zeros_like(row)
    layer = torch.cat([torch.full((len(w),), l, device=dev) for w, l in zip(where, layers)]) if where \
        else torch.zeros_like(row)
    act_skip = skip[row, step, layer]
    probs = action_probs(model.gates, inputs) if layers else torch.zeros(0, device=dev)
    ref = action_probs(ref_gates, inputs) if (ref_gates is not None and layers) else probs
    engine_p = tr.gate_p.to(dev)[row, step, layer]
    mismatch = float((probs - engine_p).abs().max()) if len(row) else 0.0
    returns = ret_grid.to(dev)[row, step, layer]
    executed = (tr.executed & tr.valid.unsqueeze(-1)).sum((1, 2)).double()
    pairs = (tr.valid.sum(1) * L).double()
    return Trajectory(
        inputs=inputs, row=row, step=step, layer=layer, skip=act_skip,
        old_logprob=action_logprobs(probs, act_skip), ref_prob=ref.float(), returns=returns,
        advantages=normalize_advantages(returns).float(), credits=credits, divergence=div.cpu(),
        valid=tr.valid.clone(), c_rel=c_rel,
        skip_ratio=torch.where(pairs > 0, 1 - executed / pairs.clamp_min(1), torch.zeros_like(pairs)),
        num_new=torch.tensor([len(x) for x in res.new_tokens]), gate_p_mismatch=mismatch)
