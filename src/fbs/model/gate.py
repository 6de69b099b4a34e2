"""SG, the skip gates (paper §2.4, appendix E.1-E.2, E.5-E.6).

For every layer l that may be skipped, p_t^(l) = sigmoid(MLP_l([r_t^(l); z_t])) is the probability of
*skipping* layer l for token t, computed before the layer runs, from:

* r_t^(l), the residual signal: ``P_r · RMSNorm_l(h_t^(l))`` (the layer's own input norm, projected to
  ``gate_rank`` by a projection shared across layers) and ``log(u + 1e-3)`` with
  u = ||h^(l) - h^(l-1)|| / ||h^(l-1)||, the relative update the previous layer made to this token
  (0 when it was skipped). Small updates upstream predict small updates here (DESIGN.md §7's oracle).
* optionally (``gate_prev_skip``) s_t^(l-1), 1.0 when layer l-1 was skipped for this token, else 0.0.
* z_t, the PAW preview summary (``zlow`` of the most recent PAW layer at or below l; zeros before it).

``gate_input`` selects residual, preview or both (appendix E.5). The last linear layer starts at zero
with bias ``gate_init_bias`` so fresh gates compute (p ~= 0.018).

Training (appendix E.2): g = g_hard + p - stopgrad(p) with g_hard ~ Bernoulli(p) and the soft mixture
h' = g h + (1 - g) f(h). Inference: g = 1[p > tau] (threshold) or g ~ Bernoulli(p) (sampling).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .config import FBSConfig


class SkipGates(nn.Module):
    def __init__(self, cfg: FBSConfig, hidden_size: int, gated_layers: tuple[int, ...]):
        super().__init__()
        self.use_residual = cfg.gate_input in ("residual", "both")
        self.use_preview = cfg.gate_input in ("preview", "both")
        self.use_prev_skip = cfg.gate_prev_skip
        in_dim = (cfg.gate_rank + 1 if self.use_residual else 0) + (cfg.preview_rank if self.use_preview else 0)
        in_dim += int(self.use_prev_skip)
        self.resid_proj = nn.Linear(hidden_size, cfg.gate_rank, bias=False) if self.use_residual else None
        self.layer_ids = tuple(gated_layers)
        self.hidden = nn.ModuleDict({str(l): nn.Linear(in_dim, cfg.gate_width) for l in gated_layers})
        self.out = nn.ModuleDict({str(l): nn.Linear(cfg.gate_width, 1) for l in gated_layers})
        for lin in self.out.values():
            nn.init.zeros_(lin.weight)
            nn.init.constant_(lin.bias, cfg.gate_init_bias)

    def __contains__(self, layer: int) -> bool:
        return str(layer) in self.hidden

    def constant_logits(self) -> dict[int, float]:
        """The gates whose logit is a constant, whatever their inputs (a zero output layer: a fresh gate), with
        that constant, their bias."""
        return {l: float(self.out[str(l)].bias.detach()) for l in self.layer_ids
                if not bool(self.out[str(l)].weight.detach().any())}

    def logits(self, layer: int, xn: torch.Tensor, rel_update: torch.Tensor, zlow: torch.Tensor,
               prev_skip: torch.Tensor | None = None) -> torch.Tensor:
        """xn: (B, T, d) normalized layer input; rel_update: (B, T); zlow: (B, T, R); prev_skip: (B, T) 1.0 where
        the previous layer was skipped (used with ``gate_prev_skip``; None = nothing skipped) -> (B, T) skip logits."""
        parts = []
        if self.use_residual:
            parts += [self.resid_proj(xn), torch.log(rel_update + 1e-3).unsqueeze(-1)]
        if self.use_preview:
            parts.append(zlow)
        if self.use_prev_skip:
            parts.append((prev_skip if prev_skip is not None else xn.new_zeros(xn.shape[:-1])).unsqueeze(-1))
        feats = torch.cat(parts, dim=-1)
        return self.out[str(layer)](F.silu(self.hidden[str(layer)](feats))).squeeze(-1)

    def prob(self, layer: int, xn: torch.Tensor, rel_update: torch.Tensor, zlow: torch.Tensor,
             prev_skip: torch.Tensor | None = None) -> torch.Tensor:
        z = self.logits(layer, xn, rel_update, zlow, prev_skip)
        if self._logit_hook is not None:
            z = self._logit_hook(layer, z)
        return torch.sigmoid(z)

    _logit_hook = None

    @contextlib.contextmanager
    def logit_hook(self, fn):
        """Within the block, ``prob`` maps each layer's logits (B, T) through ``fn(layer, logits)`` first.
        Training uses it to insert an identity whose backward rewrites the gates' gradient
        (:class:`fbs.train.losses.HarmTargets`); the value of p is unchanged."""
        self._logit_hook = fn
        try:
            yield
        finally:
            self._logit_hook = None

    @torch.no_grad()
    def fused(self) -> "FusedGates":
        """Inference-time algebraic fusion of all gates (weights frozen): fewer, larger ops per layer."""
        return FusedGates(self)

    def macs(self, hidden_size: int) -> int:
        """Decode-time multiply-accumulates of one layer's gate."""
        some = next(iter(self.hidden.values()))
        m = some.in_features * some.out_features + some.out_features
        if self.resid_proj is not None:
            m += hidden_size * self.resid_proj.out_features
        return m


def relative_update(new: torch.Tensor, old: torch.Tensor, old_norm: torch.Tensor | None = None) -> torch.Tensor:
    """||new - old|| / ||old|| over the last dim; ``old_norm`` is ||old|| when the caller already has it."""
    return (new - old).norm(dim=-1) / (old.norm(dim=-1) if old_norm is None else old_norm).clamp_min(1e-6)


def relative_updates(hidden_states: Sequence[torch.Tensor]) -> torch.Tensor:
    """Every layer's :func:`relative_update` from the L + 1 hidden states of a full-compute pass: (..., L)."""
    return torch.stack([relative_update(b, a) for a, b in zip(hidden_states[:-1], hidden_states[1:])], dim=-1)


def straight_through(p: torch.Tensor, generator: torch.Generator | None = None,
                     tau: float | None = None, force: torch.Tensor | None = None,
                     gradient: bool = True) -> torch.Tensor:
    """g = hard + p - stopgrad(p): a hard gate forward, d g / d p = 1 backward (appendix E.2).

    hard = Bernoulli(p) by default, or 1[p > tau] when ``tau`` is given (the thresholded estimator).
    ``force`` (bool, like p) marks pairs that skip regardless (hard = 1; p still gets dL/dg there);
    ``gradient=False`` returns the hard decision alone."""
    hard = torch.bernoulli(p.detach(), generator=generator) if tau is None else (p.detach() > tau).to(p.dtype)
    if force is not None:
        hard = torch.maximum(hard, force.to(p.dtype))
    if not gradient:
        return hard
    return hard + p - p.detach()


class FusedGates:
    """The same gate logits with the shared residual projection folded into each layer's first linear and
    the preview term of every layer computed in one matmul per token. Build once per decode call."""

    def __init__(self, gates: SkipGates):
        self.use_residual, self.use_preview = gates.use_residual, gates.use_preview
        self.use_prev_skip = gates.use_prev_skip
        self.a, self.w_rel, self.w_prev, self.out_w, self.out_b = {}, {}, {}, {}, {}
        z_blocks, self.z_slice = [], {}
        for i, l in enumerate(gates.layer_ids):
            hid, out = gates.hidden[str(l)], gates.out[str(l)]
            w, col = hid.weight, 0
            self.a[l] = (None, hid.bias)
            if self.use_residual:
                r = gates.resid_proj.out_features
                self.a[l] = (w[:, :r] @ gates.resid_proj.weight, hid.bias)  # (width, d)
                self.w_rel[l] = w[:, r]
                col = r + 1
            if self.use_preview:
                z_blocks.append(w[:, col:w.shape[1] - int(self.use_prev_skip)])
                self.z_slice[l] = slice(i * w.shape[0], (i + 1) * w.shape[0])
            if self.use_prev_skip:
                self.w_prev[l] = w[:, -1]
            self.out_w[l], self.out_b[l] = out.weight, out.bias
        self.z_all = torch.cat(z_blocks) if z_blocks else None  # (n_gated * width, R)

    def preview_terms(self, zlow: torch.Tensor) -> torch.Tensor | None:
        """All layers' preview contributions for a token: (b, 1, n_gated * width)."""
        return None if self.z_all is None else F.linear(zlow, self.z_all)

    def logits(self, layer: int, xn: torch.Tensor, rel_update: torch.Tensor, zterms: torch.Tensor | None,
               prev_skip: torch.Tensor | None = None):
        """prev_skip: (b, T) 1.0 where the previous layer was skipped, or None when none was."""
        a, bias = self.a[layer]
        pre = F.linear(xn, a, bias) if a is not None else bias.expand(*xn.shape[:-1], -1)
        if self.use_residual:
            pre = pre + torch.log(rel_update + 1e-3).unsqueeze(-1) * self.w_rel[layer]
        if zterms is not None:
            pre = pre + zterms[..., self.z_slice[layer]]
        if self.use_prev_skip and prev_skip is not None:
            pre = pre + prev_skip.unsqueeze(-1) * self.w_prev[layer]
        return F.linear(F.silu(pre), self.out_w[layer], self.out_b[layer]).squeeze(-1)
