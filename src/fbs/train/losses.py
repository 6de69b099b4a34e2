"""Stage-1 losses (paper §3.1.3, Eq. stage1_loss; appendix C.1-C.2, E.2).

    L = L_lm + λ_bios L_bios + λ_align L_align + λ_paw L_preview + λ_gate L_gate
        (+ λ_compute L_compute + λ_distill L_distill: the gate-learning terms of this recipe, docs/train.md)

Every function takes tensors and returns a tensor; :class:`Stage1Loss` combines them and returns a
:class:`LossParts` NamedTuple whose ``total`` carries the graph and whose other fields are detached.
Shapes: B batch, T tokens, V vocabulary, L decoder layers, P PAW layers, C CH layers, k = k_max.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100


class LossParts(NamedTuple):
    """One micro-batch's loss: ``total`` to back-propagate, every other field detached (for logging)."""

    total: torch.Tensor     # scalar, with graph
    lm: torch.Tensor        # next-token CE (nats)
    bios: torch.Tensor      # BIOS token CE (0 when the batch has no labels)
    align: torch.Tensor     # chunk/token alignment loss
    preview: torch.Tensor   # window-weighted preview CE minus the window credit
    preview_ce: torch.Tensor  # mean preview CE per included horizon (diagnostic)
    window_k: torch.Tensor  # mean soft window k~ (diagnostic)
    gate: torch.Tensor      # conservative gate regularizer
    compute: torch.Tensor   # mean skip probability over gated (token, layer) pairs
    distill: torch.Tensor   # BCE of gate probabilities against the oracle targets (0 when unused)
    skip_rate: torch.Tensor  # fraction of gated (token, layer) pairs actually skipped in this forward

    def scalars(self) -> dict[str, float]:
        return {k: float(v.detach()) for k, v in self._asdict().items()}


# ---------------------------------------------------------------------------- individual terms
def lm_loss(logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """L_lm: mean next-token cross entropy. logits (B, T, V), input_ids (B, T), attention_mask (B, T) 1 = token."""
    targets = input_ids[:, 1:].clone()  # (B, T-1)
    if attention_mask is not None:
        targets[~attention_mask[:, 1:].bool()] = IGNORE_INDEX
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX)


def bios_loss(bios_logits: torch.Tensor | None, labels: torch.Tensor | None) -> torch.Tensor | None:
    """L_bios: token CE of every CH layer's BIOS logits (C, B, T, 4) on weak labels (B, T), -100 ignored.

    Returns None when there is nothing to supervise (no CH layer, no labels, or every label ignored:
    English text has no weak labels), so the caller adds nothing instead of a NaN.
    """
    if bios_logits is None or labels is None or not bool((labels != IGNORE_INDEX).any()):
        return None
    c = bios_logits.shape[0]
    return F.cross_entropy(bios_logits.flatten(0, 2).float(), labels.expand(c, *labels.shape).flatten(),
                           ignore_index=IGNORE_INDEX)


def chunk_ids(boundary: torch.Tensor) -> torch.Tensor:
    """(..., T) bool chunk starts -> (..., T) chunk index (0-based; the first token always opens a chunk)."""
    start = boundary.clone()
    start[..., 0] = True
    return start.long().cumsum(-1) - 1


def align_loss(chunk_states: torch.Tensor | None, token_states: torch.Tensor | None,
               boundary: torch.Tensor | None = None, kind: str = "infonce", temperature: float = 0.1,
               mask: torch.Tensor | None = None) -> torch.Tensor | None:
    """L_align: consistency between the chunk channel and the token channel of CH (paper §3.1.3, app. D).

    chunk_states, token_states: (C, B, T, Rc) — the token's open-chunk state and its own projection.
    ``cosine``: mean (1 - cos(token_t, chunk_t)). ``infonce``: token t must pick its own chunk state among
    the chunk states of every position of its sequence that lies in *another* chunk (positions in the same
    chunk are neither positive nor negative), which keeps the alignment from collapsing every projection
    onto one vector. ``boundary`` (C, B, T) is needed for ``infonce``; ``mask`` (B, T) drops padding.
    """
    if chunk_states is None or token_states is None:
        return None
    tok = F.normalize(token_states.float(), dim=-1)   # (C, B, T, Rc)
    chk = F.normalize(chunk_states.float(), dim=-1)   # (C, B, T, Rc)
    valid = torch.ones(tok.shape[:-1], dtype=torch.bool, device=tok.device) if mask is None \
        else mask.bool().expand(tok.shape[:-1])       # (C, B, T)
    if kind == "cosine":
        cos = (tok * chk).sum(-1)                     # (C, B, T)
        return (1 - cos)[valid].mean()
    if kind != "infonce":
        raise ValueError(f"align kind must be 'cosine' or 'infonce', got {kind!r}")
    if boundary is None:
        raise ValueError("infonce alignment needs the chunk boundaries")
    cid = chunk_ids(boundary)                         # (C, B, T)
    sim = tok @ chk.transpose(-1, -2) / temperature   # (C, B, T, T): token t vs chunk state at s
    same = cid.unsqueeze(-1) == cid.unsqueeze(-2)     # (C, B, T, T)
    eye = torch.eye(sim.shape[-1], dtype=torch.bool, device=sim.device)
    keep = (~same | eye) & valid.unsqueeze(-2)        # own state + other chunks' states
    sim = sim.masked_fill(~keep, float("-inf"))
    logp = torch.diagonal(sim, dim1=-2, dim2=-1) - torch.logsumexp(sim, dim=-1)  # (C, B, T)
    return -logp[valid].mean()


class PreviewLoss(NamedTuple):
    total: torch.Tensor   # weighted CE minus window credit (graph)
    ce: torch.Tensor      # Σ w CE / Σ w (detached)
    window_k: torch.Tensor  # mean k~ (detached)


def preview_loss(preview_logits: torch.Tensor | None, targets: torch.Tensor, weights: torch.Tensor | None,
                 credit: float = 0.0, window_k: torch.Tensor | None = None, floor: float = 0.0) -> PreviewLoss | None:
    """L_preview = Σ_i Σ_r w_{i,r} CE(p_{i,r}, x_{i+r}) (appendix C.1) plus a per-horizon window credit.

    preview_logits (P, B, T, k, N+1); targets (B, T, k) preview-vocabulary classes, -100 past the end;
    weights (P, B, T, k) soft window weights w_{i,r} (appendix C.2), gradient flowing to the window
    predictor. Normalized by the number of (i, r) pairs with a target.

    The CE sum alone is minimized by an empty window (w -> 0). The credit term ``- credit * w_{i,r}``
    pays ``credit`` nats for every included horizon, so the window predictor includes horizon r exactly
    when the head's CE there is below ``credit``: k(t) grows where the continuation is predictable and
    shrinks where it is not, and neither 0 nor k_max is a trivial optimum.

    ``floor`` adds ``floor * CE_{i,r}`` for every horizon (no gradient to w): the heads of horizons outside
    the current window keep learning, so a window that shrank while the heads were still untrained
    (CE above the credit everywhere) can grow again once they improve.
    """
    if preview_logits is None or weights is None:
        return None
    p, b, t, k, n = preview_logits.shape
    tgt = targets.expand(p, b, t, k)                          # (P, B, T, k)
    valid = tgt != IGNORE_INDEX
    ce = F.cross_entropy(preview_logits.flatten(0, 3).float(), tgt.flatten(), ignore_index=IGNORE_INDEX,
                         reduction="none").view(p, b, t, k)   # (P, B, T, k), 0 where ignored
    w = weights.float() * valid
    denom = valid.sum().clamp_min(1)
    total = ((w * ce).sum() + floor * (ce * valid).sum() - credit * w.sum()) / denom
    mean_ce = (w * ce).sum().detach() / w.sum().detach().clamp_min(1e-6)
    wk = window_k.float().mean().detach() if window_k is not None else w.sum(-1).mean().detach()
    return PreviewLoss(total, mean_ce, wk)


def gate_regularizer(probs: torch.Tensor, mask: torch.Tensor, max_rate: float = 0.5,
                     entropy_weight: float = 0.0) -> torch.Tensor:
    """L_gate: the conservative regularizer on skip probabilities (paper §3.1.3 "entropy/mean constraints").

    Mean constraint: a squared hinge on each gated layer's mean skip probability above ``max_rate``
    (no layer may drift towards always-skip). Entropy term: ``entropy_weight`` * mean binary entropy,
    which makes decisions crisp so threshold inference agrees with the sampled training gates.
    probs (B, T, L); mask (B, T, L) bool, the gated (token, layer) pairs.
    """
    m = mask.float()
    per_layer = (probs * m).sum((0, 1)) / m.sum((0, 1)).clamp_min(1)  # (L,)
    used = m.sum((0, 1)) > 0
    hinge = F.relu(per_layer[used] - max_rate).pow(2).sum()
    if entropy_weight == 0.0:
        return hinge
    pc = probs.clamp(1e-6, 1 - 1e-6)
    ent = -(pc * pc.log() + (1 - pc) * (1 - pc).log())
    return hinge + entropy_weight * (ent * m).sum() / m.sum().clamp_min(1)


def compute_loss(probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """L_compute: mean skip probability over gated pairs. Weighted by -λ_compute it rewards skipping
    (the compute side of the SG surrogate; the LM loss under straight-through gates is the quality side)."""
    m = mask.float()
    return (probs * m).sum() / m.sum().clamp_min(1)


def oracle_targets(rel_update: torch.Tensor, mask: torch.Tensor, rate: float = 0.3,
                   temperature: float = 0.25) -> torch.Tensor:
    """Soft skip targets from the relative-update oracle (DESIGN.md §7).

    Over the gated (token, layer) pairs of the batch, q is the ``rate``-quantile of log u; the target is
    sigmoid((q - log u) / temperature): close to 1 for the pairs whose layer barely changes the token
    (the ``rate`` smallest updates), close to 0 for the rest. rel_update, mask: (B, T, L) -> (B, T, L).
    """
    logu = rel_update.float().clamp_min(1e-8).log()
    q = torch.quantile(logu[mask], rate) if bool(mask.any()) else logu.new_zeros(())
    return torch.sigmoid((q - logu) / temperature) * mask


def distill_loss(probs: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """BCE(p, y) over the gated pairs: regress skip probabilities towards the oracle targets."""
    bce = F.binary_cross_entropy(probs.float().clamp(1e-6, 1 - 1e-6), targets.float(), reduction="none")
    m = mask.float()
    return (bce * m).sum() / m.sum().clamp_min(1)


# ---------------------------------------------------------------------------- the combination
@dataclass
class LossWeights:
    lm: float = 1.0
    bios: float = 0.1
    align: float = 0.05
    paw: float = 0.1
    gate: float = 1.0
    compute: float = 0.0
    distill: float = 0.0


class Stage1Loss(nn.Module):
    """Eq. (stage1_loss) plus the gate-learning terms. Call with one FBSOutput and its batch."""

    def __init__(self, weights: LossWeights, window_credit: float = 5.0, align_kind: str = "infonce",
                 align_temperature: float = 0.1, gate_max_rate: float = 0.5, gate_entropy: float = 0.0,
                 preview_floor: float = 0.0):
        super().__init__()
        self.w = weights
        self.preview_floor = preview_floor
        self.window_credit, self.align_kind, self.align_temperature = window_credit, align_kind, align_temperature
        self.gate_max_rate, self.gate_entropy = gate_max_rate, gate_entropy

    def forward(self, out, input_ids: torch.Tensor, preview_targets: torch.Tensor, gate_mask: torch.Tensor,
                bios_labels: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                skip_targets: torch.Tensor | None = None) -> LossParts:
        """out: FBSOutput; gate_mask (B, T, L) bool gated pairs; skip_targets (B, T, L) oracle targets or None."""
        zero = out.logits.new_zeros(())
        lm = lm_loss(out.logits, input_ids, attention_mask)
        total = self.w.lm * lm
        bios = bios_loss(out.bios_logits, bios_labels)
        if bios is not None and self.w.bios:
            total = total + self.w.bios * bios
        align = None
        if self.w.align:
            align = align_loss(out.chunk_states, out.token_chunk_states, out.chunk_boundary, self.align_kind,
                               self.align_temperature, attention_mask)
            if align is not None:
                total = total + self.w.align * align
        prev = None
        if self.w.paw:
            prev = preview_loss(out.preview_logits, preview_targets, out.window_weights, self.window_credit,
                                out.window_k, self.preview_floor)
            if prev is not None:
                total = total + self.w.paw * prev.total
        gate = gate_regularizer(out.gate_probs, gate_mask, self.gate_max_rate, self.gate_entropy)
        total = total + self.w.gate * gate
        comp = compute_loss(out.gate_probs, gate_mask)
        if self.w.compute:
            total = total - self.w.compute * comp
        dist = None
        if skip_targets is not None and self.w.distill:
            dist = distill_loss(out.gate_probs, skip_targets, gate_mask)
            total = total + self.w.distill * dist
        m = gate_mask.float()
        skip_rate = (out.skips.detach() * m).sum() / m.sum().clamp_min(1)
        d = lambda x: zero if x is None else x.detach()  # noqa: E731
        return LossParts(total, lm.detach(), d(bios), d(align), d(prev.total if prev else None),
                         d(prev.ce if prev else None), d(prev.window_k if prev else None), gate.detach(),
                         comp.detach(), d(dist), skip_rate)


# ---------------------------------------------------------------------------- skip distillation (docs/train.md)
def kl_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
            attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """KL(teacher || student) of the next-token distributions, mean over positions (nats).

    student_logits, teacher_logits (B, T, V); attention_mask (B, T) 1 = token. Forward KL at temperature 1:
    the student is pulled to cover every continuation the teacher would give (Kangaroo's -Σ p_T log p_S up to
    the teacher's entropy, which is constant)."""
    logp_s = F.log_softmax(student_logits.float(), dim=-1)
    logp_t = F.log_softmax(teacher_logits.float(), dim=-1)
    kl = (logp_t.exp() * (logp_t - logp_s)).sum(-1)  # (B, T)
    if attention_mask is None:
        return kl.mean()
    m = attention_mask.float()
    return (kl * m).sum() / m.sum().clamp_min(1)


class HarmTargets:
    """Loss-aware skip targets for the gates, applied inside the backward pass.

    Under straight-through gates (h' = h + (1 - g)(f(h) - h), g = hard + p - stopgrad(p)) the gradient that
    reaches p is dL/dg = <dL/dh', h - f(h)>: the first-order change of the distillation loss if that
    (token, layer) pair were skipped (for a pair that is skipped: if it were computed, with the sign turned).
    Call it the pair's *harm*. This object is an identity on the gate logits z whose backward replaces
    that gradient by the gradient of ``weight * BCE(sigmoid(z), y)`` with y = 1[harm < c]: the gates
    are trained to flag the pairs whose skipping costs least, whatever the raw gradient's scale.

    ``c`` is a global threshold over all gated layers: after each backward it moves towards the
    ``rate``-quantile of the harms just seen (exponential average), so about ``rate`` of the gated pairs
    are targets. That quantile is the compute budget: a global budget, which leaves it to the gates to
    decide which layers give up their share.
    Positions with zero incoming gradient (before ``gate_from``, or ungated) are not trained.
    """

    def __init__(self, rate: float, weight: float = 1.0, momentum: float = 0.5):
        if not 0 < rate < 1:
            raise ValueError(f"rate must be in (0, 1), got {rate}")
        self.rate, self.weight, self.momentum = rate, weight, momentum
        self.threshold: float | None = None
        self._harms: list[torch.Tensor] = []
        self.n_pairs = 1          # gated pairs of the current micro-batch (BCE normalisation)
        self.last_target_rate = 0.0

    def __call__(self, layer: int, logits: torch.Tensor) -> torch.Tensor:
        return _HarmToTarget.apply(logits, self)

    def update(self) -> None:
        """Move the threshold towards the quantile of the harms collected since the last call."""
        if not self._harms:
            return
        harms = torch.cat(self._harms)
        self._harms = []
        q = float(torch.quantile(harms, self.rate)) if harms.numel() <= 16_000_000 else float(
            harms.kthvalue(max(1, int(self.rate * harms.numel()))).values)
        self.threshold = q if self.threshold is None else self.momentum * self.threshold + (1 - self.momentum) * q
        self.last_target_rate = float((harms < self.threshold).float().mean())

    def state_dict(self) -> dict:
        return {"threshold": self.threshold}

    def load_state_dict(self, state: dict) -> None:
        self.threshold = state.get("threshold")


class BudgetThreshold:
    """The training threshold tau of the gates: p > tau skips, as at inference, with tau the quantile of the
    gate probabilities that skips ``rate`` of the gated pairs. Estimated from the micro-batches already seen
    (the previous micro-batch's quantile by default: p changes only at optimizer steps), since a forward
    needs tau before its own probabilities exist. Without it, gates
    whose mean p sits near the budget can put most pairs above a fixed 0.5 at once (most pairs skipped
    right after the gates were switched on)."""

    def __init__(self, momentum: float = 0.0):
        self.momentum = momentum
        self.tau: float | None = None

    def current(self) -> float:
        return 1.0 if self.tau is None else self.tau

    def update(self, probs: torch.Tensor, rate: float) -> None:
        """probs: gate probabilities of the gated pairs just seen; rate: share of them to skip."""
        if probs.numel() == 0:
            return
        q = 1.0 if rate <= 0 else float(torch.quantile(probs.detach().float().flatten()[:16_000_000], 1 - rate))
        self.tau = q if self.tau is None else self.momentum * self.tau + (1 - self.momentum) * q


class _HarmToTarget(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets: HarmTargets):
        ctx.targets = targets
        p = torch.sigmoid(logits.detach())
        ctx.save_for_backward(p)
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx, grad):
        (p,) = ctx.saved_tensors
        ht: HarmTargets = ctx.targets
        live = grad != 0                                  # (B, T) pairs that took part
        harm = grad / (p * (1 - p)).clamp_min(1e-12)      # dL/dp = dL/dg: undo the sigmoid's derivative
        ht._harms.append(harm[live].detach().float().flatten())
        c = ht.threshold if ht.threshold is not None else 0.0
        y = (harm < c).to(p.dtype)
        return ht.weight * (p - y) * live / ht.n_pairs, None


class DistillParts(NamedTuple):
    """One skip-distillation micro-batch: ``total`` to back-propagate, the rest detached."""

    total: torch.Tensor
    kl: torch.Tensor         # KL(teacher || student) under the micro-batch's skips
    lm: torch.Tensor         # next-token CE of the student
    bios: torch.Tensor
    align: torch.Tensor
    preview: torch.Tensor
    preview_ce: torch.Tensor
    window_k: torch.Tensor
    skip_rate: torch.Tensor  # fraction of gated pairs skipped (gates and random drops)
    gate_rate: torch.Tensor  # fraction of gated pairs the gates alone would skip (p > tau)
    mean_p: torch.Tensor

    def scalars(self) -> dict[str, float]:
        return {k: float(v.detach()) for k, v in self._asdict().items()}


class SkipDistillLoss(nn.Module):
    """L = λ_kl KL(base || student) + λ_lm L_lm + λ_bios L_bios + λ_align L_align + λ_paw L_preview.

    The gates are trained by :class:`HarmTargets` inside the same backward (no term here)."""

    def __init__(self, kl: float = 1.0, lm: float = 0.1, bios: float = 0.1, align: float = 0.05, paw: float = 0.1,
                 window_credit: float = 5.0, align_kind: str = "infonce", align_temperature: float = 0.1,
                 preview_floor: float = 0.0):
        super().__init__()
        self.w = dict(kl=kl, lm=lm, bios=bios, align=align, paw=paw)
        self.window_credit, self.align_kind, self.align_temperature = window_credit, align_kind, align_temperature
        self.preview_floor = preview_floor

    def forward(self, out, teacher_logits: torch.Tensor, input_ids: torch.Tensor, preview_targets: torch.Tensor,
                gate_mask: torch.Tensor, tau: float, bios_labels: torch.Tensor | None = None) -> DistillParts:
        zero = out.logits.new_zeros(())
        kl = kl_loss(out.logits, teacher_logits)
        lm = lm_loss(out.logits, input_ids)
        total = self.w["kl"] * kl + self.w["lm"] * lm
        bios = bios_loss(out.bios_logits, bios_labels) if self.w["bios"] else None
        if bios is not None:
            total = total + self.w["bios"] * bios
        align = None
        if self.w["align"]:
            align = align_loss(out.chunk_states, out.token_chunk_states, out.chunk_boundary, self.align_kind,
                               self.align_temperature)
            if align is not None:
                total = total + self.w["align"] * align
        prev = None
        if self.w["paw"]:
            prev = preview_loss(out.preview_logits, preview_targets, out.window_weights, self.window_credit,
                                out.window_k, self.preview_floor)
            if prev is not None:
                total = total + self.w["paw"] * prev.total
        m = gate_mask.float()
        n = m.sum().clamp_min(1)
        p = out.gate_probs.detach()
        d = lambda x: zero if x is None else x.detach()  # noqa: E731
        return DistillParts(total, kl.detach(), lm.detach(), d(bios), d(align), d(prev.total if prev else None),
                            d(prev.ce if prev else None), d(prev.window_k if prev else None),
                            (out.skips.detach() * m).sum() / n, ((p > tau).float() * m).sum() / n, (p * m).sum() / n)
