"""Fitting the drafts of lossless speculative decoding (:mod:`fbs.engine.speculative`) on corpus text.

* :func:`train_kangaroo_adapter` — Kangaroo (Liu et al. 2024): distil the full model's next-token distribution
  into the adapter on top of its first N layers (soft cross-entropy against the full model's probabilities, as
  Kangaroo's training script does); the base model and LM head stay frozen.
* :func:`search_draft_layers` — Draft&Verify (Zhang et al. 2024): greedy forward selection of the static set of
  skipped layers that maximises the expected speed-up of self-speculative decoding, acceptance measured by
  lossless decoding of held-out prompts and speed from the byte cost model (:func:`fbs.engine.drafts.expected_speedup`;
  no timings, so the result does not depend on the machine's load).

``fbs train kangaroo`` and ``fbs train draft-search`` (:mod:`fbs.train.cli`) run them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from ..engine.flops import LayerCost
from ..baselines.kangaroo import KangarooAdapter
from ..engine.drafts import acceptance_mle, best_gamma, expected_speedup
from ..engine.speculative import draft_step_cost

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- Kangaroo
@dataclasses.dataclass
class AdapterEval:
    """Teacher-forced agreement of the adapter's draft with the full model on held-out blocks."""

    top1: float         # argmax equal: the greedy acceptance rate of a one-token draft
    overlap: float      # sum_v min(p, q): the acceptance probability of a one-token draft under sampling
    loss: float         # soft cross-entropy against the full model's distribution (nats)


def _teacher(model, ids: torch.Tensor, exit_layer: int):
    """The full model's hidden states after ``exit_layer`` layers, its log-probabilities and rotary tables."""
    with torch.no_grad():
        out = model(ids, gate_mode="off", output_hidden_states=True)
        h = out.hidden_states[exit_layer]
        pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        cos, sin = model.base.rope(h, pos)
    return h, out.logits.float().log_softmax(-1), cos, sin


def _student(adapter: KangarooAdapter, model, h, cos, sin) -> torch.Tensor:
    head = model.base.lm_head.weight.detach()  # shared and frozen
    return adapter.logits(adapter(h, cos, sin), lambda x: F.linear(x, head)).float().log_softmax(-1)


def kangaroo_loss(student_logp: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """Soft cross-entropy -sum_v p(v) log q(v), averaged over positions (KL(p || q) plus p's entropy)."""
    return -(teacher_logp.exp() * student_logp).sum(-1).mean()


@torch.no_grad()
def evaluate_adapter(adapter: KangarooAdapter, model, blocks: torch.Tensor, batch_size: int = 4) -> AdapterEval:
    top1 = overlap = loss = 0.0
    n = 0
    for i in range(0, len(blocks), batch_size):
        ids = blocks[i:i + batch_size]
        h, t_logp, cos, sin = _teacher(model, ids, adapter.exit_layer)
        s_logp = _student(adapter, model, h, cos, sin)
        k = ids.numel()
        top1 += (s_logp.argmax(-1) == t_logp.argmax(-1)).float().sum().item()
        overlap += torch.minimum(s_logp.exp(), t_logp.exp()).sum(-1).sum().item()
        loss += kangaroo_loss(s_logp, t_logp).item() * k
        n += k
    return AdapterEval(top1 / n, overlap / n, loss / n)


def _bar(total_or_items, desc: str, unit: str, enabled: bool):
    """A progress bar over ``total_or_items`` steps (an int) or items (an iterable to wrap)."""
    from tqdm.auto import tqdm

    kw = dict(desc=desc, unit=unit, dynamic_ncols=True, disable=not enabled, leave=False)
    return tqdm(total=total_or_items, **kw) if isinstance(total_or_items, int) else tqdm(total_or_items, **kw)


def train_kangaroo_adapter(model, train_blocks: torch.Tensor, exit_layer: int, *, steps: int = 300,
                           lr: float = 1e-3, batch_size: int = 4, eval_blocks: torch.Tensor | None = None,
                           weight_decay: float = 0.0, seed: int = 0, log_every: int = 50,
                           adapter: KangarooAdapter | None = None,
                           progress: bool = False) -> tuple[KangarooAdapter, dict]:
    """Train a Kangaroo adapter for the FBS ``model`` (full depth, gates off) on ``train_blocks`` (N, T).

    Each step distils the full model's distribution at every position of ``batch_size`` blocks (cycled in a
    seeded random order) into the adapter; AdamW with a cosine schedule. Returns the adapter and a summary with
    the held-out :class:`AdapterEval` before and after (``eval_blocks``) and the loss curve.
    """
    model.eval()
    adapter = adapter if adapter is not None else KangarooAdapter.for_model(model, exit_layer)
    adapter.train()
    opt = torch.optim.AdamW(adapter.parameters(), lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(train_blocks), generator=gen)
    before = evaluate_adapter(adapter, model, eval_blocks, batch_size) if eval_blocks is not None else None
    curve = []
    bar = _bar(steps, "kangaroo", "step", progress)
    for step in range(steps):
        idx = [order[(step * batch_size + j) % len(order)] for j in range(batch_size)]
        ids = train_blocks[torch.stack(idx)]
        h, t_logp, cos, sin = _teacher(model, ids, exit_layer)
        loss = kangaroo_loss(_student(adapter, model, h, cos, sin), t_logp)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        curve.append(loss.item())
        bar.update(1)
        bar.set_postfix(loss=f"{curve[-1]:.3f}", refresh=False)
        if log_every and (step + 1) % log_every == 0:
            logger.info("kangaroo step %d/%d: loss %.4f", step + 1, steps, sum(curve[-log_every:]) / log_every)
    bar.close()
    adapter.eval()
    after = evaluate_adapter(adapter, model, eval_blocks, batch_size) if eval_blocks is not None else None
    summary = {"exit_layer": exit_layer, "steps": steps, "lr": lr, "batch_size": batch_size,
               "tokens": steps * batch_size * train_blocks.shape[1], "loss_first": curve[0] if curve else None,
               "loss_last": curve[-1] if curve else None, "curve": curve,
               "eval_before": dataclasses.asdict(before) if before else None,
               "eval_after": dataclasses.asdict(after) if after else None}
    return adapter, summary


# --------------------------------------------------------------------------- Draft&Verify
@dataclasses.dataclass
class DraftCandidate:
    """One static skip set, measured."""

    layers: list[int]
    alpha: float          # per-draft acceptance rate (geometric MLE over rounds)
    acceptance: float     # accepted / proposed over the held-out prompts
    draft_cost: float     # a draft step's bytes over a full-depth step's
    gamma: int            # the best draft length at (alpha, draft_cost)
    speedup: float        # expected speed-up over plain decoding at that gamma (cost model)


def measure_skip_set(model, prompts: list[list[int]], layers: list[int], *, new_tokens: int = 32, gamma: int = 4,
                     kv_policy: str = "hole", weights: str = "fp32") -> DraftCandidate:
    """Decode the prompts losslessly with ``layers`` skipped in the draft (fixed gamma, no adaptation) and price it."""
    plan = torch.zeros(model.num_layers, dtype=torch.bool)
    plan[list(layers)] = True
    res = model.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True, lossless=True, skip_plan=plan,
                         draft_tokens=gamma, adapt_draft=False, kv_policy=kv_policy, weights=weights,
                         record_gate_p=False)
    st = res.speculative
    alpha = acceptance_mle(st.accepted, st.rejections) if st.proposed else 0.0
    context = sum(len(p) for p in prompts) / len(prompts) + new_tokens / 2
    cost = draft_step_cost(LayerCost.of(model.base.spec), context, model.num_layers - len(layers), kv_policy, weights)
    g = best_gamma(alpha, cost, gamma)
    return DraftCandidate(sorted(layers), alpha, st.acceptance_rate or 0.0, cost, g,
                          expected_speedup(alpha, g, cost))


def search_draft_layers(model, prompts: list[list[int]], *, new_tokens: int = 32, gamma: int = 4,
                        candidates: list[int] | None = None, max_layers: int | None = None,
                        kv_policy: str = "hole", progress: bool = False) -> tuple[DraftCandidate, list[DraftCandidate]]:
    """Greedy forward selection: start from no skipped layer; each round adds the candidate layer whose skip set
    has the highest expected speed-up; stop when no addition improves it, or, with ``max_layers``, after that many
    rounds (keeping the best set seen: skipping one layer saves ~1/L of a step, rarely enough to pay for
    verification, so the first rounds may not improve on no skipping at all). Candidates
    default to the model's skippable (gated) layers. Returns the best set and every set measured."""
    pool = list(candidates if candidates is not None else model.layers_cfg.gated)
    chosen: list[int] = []
    best = measure_skip_set(model, prompts, chosen, new_tokens=new_tokens, gamma=gamma, kv_policy=kv_policy)
    history = [best]
    while pool and (max_layers is None or len(chosen) < max_layers):
        trials = []
        for l in _bar(pool, f"draft search, round {len(chosen) + 1}", "set", progress):
            trials.append(measure_skip_set(model, prompts, chosen + [l], new_tokens=new_tokens, gamma=gamma,
                                           kv_policy=kv_policy))
        history += trials
        top = max(trials, key=lambda c: c.speedup)
        logger.info("draft search: %s -> expected speed-up %.3f (alpha %.3f, cost %.3f)", top.layers, top.speedup,
                    top.alpha, top.draft_cost)
        if top.speedup <= best.speedup and max_layers is None:
            break  # no addition pays; with max_layers the search goes on (one layer rarely pays for the verifier)
        best = top if top.speedup > best.speedup else best
        added = [l for l in top.layers if l not in chosen][0]
        chosen.append(added)
        pool.remove(added)
    return best, history


def save_skip_set(best: DraftCandidate, path: str | Path, meta: dict | None = None) -> Path:
    """The chosen set as JSON (``fbs generate --draft-layers FILE``, ``fbs bench --draft-layers FILE``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**dataclasses.asdict(best), **(meta or {})}, indent=1))
    return path
