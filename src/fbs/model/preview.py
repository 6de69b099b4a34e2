"""PAW, the parafovea-attention window (paper §2.2, appendix C.1-C.2, C.5).

From the layer state h_t alone (so the preview is causal by construction) PAW

1. predicts a span k(t) = floor(k_max * sigmoid(s_t)) (training uses soft weights
   w_r = sigmoid(gamma (k~ - r + 0.5)) instead of the hard window),
2. predicts a distribution over the r-th next token for r = 1..k(t) with low-rank horizon heads whose
   output layer is the tied embedding restricted to a preview vocabulary of N frequent tokens (+1 class
   'other' for every token outside it),
3. embeds each distribution by expectation under the tied embedding, restricted to its top-K support,
4. compresses the window of embeddings (grouped conv over horizons + pooling, or an ablation variant)
   into a low-rank summary ``zlow`` and injects z_t = Up(zlow) additively into the token state.

Up is zero at initialisation, so a fresh PAW changes nothing. ``zlow`` is also the preview signal the
skip gates read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .config import FBSConfig

Linear = Callable[..., torch.Tensor]  # (x, w, b=None) -> x w^T + b, as F.linear


def _apply(module: nn.Linear, x: torch.Tensor, linear: Linear | None) -> torch.Tensor:
    """``module(x)``, or the same product through ``linear`` (the engine's row-independent one)."""
    return module(x) if linear is None else linear(x, module.weight, module.bias)


class PreviewOut(NamedTuple):
    z: torch.Tensor             # (B, T, d) additive contribution to the token state
    zlow: torch.Tensor          # (B, T, R) low-rank preview summary read by the gates
    logits: torch.Tensor | None  # (B, T, k_max, N+1) horizon logits over the preview vocabulary (parallel form)
    k_soft: torch.Tensor        # (B, T) k~ = k_max * sigmoid(s) (equals fixed_k in fixed-k mode)
    k_hard: torch.Tensor        # (B, T) long, floor(k~)
    weights: torch.Tensor       # (B, T, k_max) window weights actually applied (soft or hard)


class ParafoveaWindow(nn.Module):
    def __init__(self, cfg: FBSConfig, hidden_size: int):
        super().__init__()
        d, r, n = hidden_size, cfg.preview_rank, cfg.preview_vocab_size
        self.k_max, self.top_k, self.gamma = cfg.k_max, cfg.preview_top_k, cfg.window_gamma
        self.fixed_k, self.compression = cfg.fixed_k, cfg.paw_compression
        self.window = nn.Linear(d, 1)
        nn.init.zeros_(self.window.weight)
        nn.init.constant_(self.window.bias, cfg.window_init_bias)
        # horizon heads: q_r = c + A_r c + e_r with c = C h; logits_r = (E_V P) q_r + [0..0, b_other_r]
        self.query = nn.Linear(d, r, bias=False)
        self.vocab_proj = nn.Linear(d, r, bias=False)  # P: maps preview-vocab embeddings into the head space
        self.horizon_mix = nn.Parameter(torch.zeros(cfg.k_max, r, r))
        self.horizon_bias = nn.Parameter(torch.randn(cfg.k_max, r) * r ** -0.5)
        self.other_logit = nn.Parameter(torch.zeros(cfg.k_max))
        self.head_scale = r ** -0.5
        # compression
        groups = cfg.paw_conv_groups or d
        if d % groups:
            raise ValueError(f"paw_conv_groups={groups} does not divide hidden size {d}")
        if self.compression == "conv":
            self.conv = nn.Conv1d(d, d, kernel_size=3, padding=1, groups=groups)
            with torch.no_grad():  # start as identity so pooling sees the embeddings themselves
                self.conv.weight.zero_()
                self.conv.weight[:, :, 1] = 1.0
                self.conv.bias.zero_()
        if self.compression == "linear":
            self.down = nn.Linear(d, r, bias=False)
        elif self.compression == "none":
            self.down = nn.Linear(cfg.k_max * d, r, bias=False)
        else:
            self.down = nn.Linear(d, r, bias=False)
        self.up = nn.Linear(r, d, bias=False)
        nn.init.zeros_(self.up.weight)
        self.n_classes = n + 1

    # ------------------------------------------------------------------
    def window_size(self, xn: torch.Tensor, linear: Linear | None = None) -> torch.Tensor:
        """k~ (B, T) in [0, k_max]."""
        if self.fixed_k is not None:
            return xn.new_full(xn.shape[:-1], float(self.fixed_k))
        s = _apply(self.window, xn, linear)
        return self.k_max * torch.sigmoid(s.squeeze(-1))

    def window_weights(self, k_soft: torch.Tensor, soft: bool) -> tuple[torch.Tensor, torch.Tensor]:
        # k_hard = floor(k~); the hard window includes horizons r <= k_hard
        k_hard = torch.floor(k_soft).long()
        if soft and self.fixed_k is None:
            return soft_window_weights(k_soft, self.k_max, self.gamma), k_hard
        r = torch.arange(1, self.k_max + 1, device=k_soft.device)
        return (r <= k_hard.unsqueeze(-1)).to(k_soft.dtype), k_hard

    def horizon_logits(self, xn: torch.Tensor, vocab_keys: torch.Tensor, horizons: int,
                       linear: Linear | None = None) -> torch.Tensor:
        """(B, T, horizons, N+1) logits for horizons 1..horizons. vocab_keys: (N, R) = P(E_V)."""
        mix = self.horizon_mix[:horizons]  # (h, R, R)
        if linear is None:
            c = self.query(xn)  # (B, T, R)
            q = c.unsqueeze(-2) + torch.einsum("btr,hrs->bths", c, mix) + self.horizon_bias[:horizons]  # (B, T, h, R)
            logits = (q @ vocab_keys.t()) * self.head_scale  # (B, T, h, N)
        else:  # the same products, each row on its own: c A_r for every r at once, as linear(c, [A_1^T; A_2^T; ...])
            c = _apply(self.query, xn, linear)
            stacked = mix.transpose(1, 2).reshape(horizons * mix.shape[1], mix.shape[2])
            mixed = linear(c, stacked).unflatten(-1, (horizons, mix.shape[2]))  # (B, T, h, R)
            q = c.unsqueeze(-2) + mixed + self.horizon_bias[:horizons]
            logits = linear(q, vocab_keys) * self.head_scale
        other = self.other_logit[:horizons].view(1, 1, -1, 1).expand(*logits.shape[:-1], 1)
        return torch.cat([logits, other], dim=-1)  # (B, T, h, N+1)

    def expected_embeddings(self, logits: torch.Tensor, vocab_emb: torch.Tensor, rowwise: bool = False) -> torch.Tensor:
        """E^T p restricted to the top-K support of p. logits (..., N+1), vocab_emb (N, d) -> (..., d).

        The 'other' class embeds to zero. Small inputs (decoding), ``rowwise`` calls and anything without autograd (a
        prompt's prefill: K rows read instead of N + 1, ~30x fewer multiply-adds) gather K rows, each row's sum on its
        own; large inputs under autograd (training) use a dense masked product, which computes the same sum.
        """
        top_val, top_idx = logits.topk(self.top_k, dim=-1)  # (..., K)
        p = torch.softmax(top_val, dim=-1)
        n = vocab_emb.shape[0]
        if rowwise or top_idx.numel() // self.top_k <= 64 or not torch.is_grad_enabled():  # one weighted bag of K rows
            other = top_idx == n                 # 'other' embeds to zero: weight 0 on any real row
            bags = F.embedding_bag(top_idx.masked_fill(other, 0).reshape(-1, self.top_k), vocab_emb, mode="sum",
                                   per_sample_weights=p.masked_fill(other, 0.0).reshape(-1, self.top_k))
            return bags.view(*top_idx.shape[:-1], vocab_emb.shape[1])
        emb = torch.cat([vocab_emb, vocab_emb.new_zeros(1, vocab_emb.shape[1])], dim=0)  # (N+1, d)
        dense = torch.zeros_like(logits).scatter(-1, top_idx, p)
        return dense @ emb

    def compress(self, u: torch.Tensor, w: torch.Tensor, linear: Linear | None = None) -> torch.Tensor:
        """u (B, T, h, d) horizon embeddings, w (B, T, h) window weights -> zlow (B, T, R)."""
        b, t, h, d = u.shape
        down = lambda v: _apply(self.down, v, linear)  # noqa: E731
        u = u * w.unsqueeze(-1)
        denom = w.sum(-1, keepdim=True).clamp_min(1.0)  # k = 0 gives zero preview
        if self.compression == "conv":
            by_hand = (linear is not None or b * t <= 64) and self.conv.groups == d and not torch.is_grad_enabled()
            if by_hand:  # decoding: depthwise, by hand (mkldnn's conv has a fixed cost per call)
                y = _depthwise3(u, self.conv.weight, self.conv.bias)
            else:
                y = self.conv(u.reshape(b * t, h, d).transpose(1, 2)).transpose(1, 2).reshape(b, t, h, d)
            pooled = (y * w.unsqueeze(-1)).sum(-2) / denom
            return down(pooled)
        if self.compression == "mean":
            return down(u.sum(-2) / denom)
        if self.compression == "linear":
            return (down(u) * w.unsqueeze(-1)).sum(-2) / denom
        # none: the whole (masked) window, padded to k_max, flattened
        if h < self.k_max:
            u = F.pad(u, (0, 0, 0, self.k_max - h))
        return down(u.reshape(b, t, self.k_max * d))

    def forward(self, xn: torch.Tensor, vocab_emb: torch.Tensor, vocab_keys: torch.Tensor,
                soft: bool, truncate: bool = False, linear: Linear | None = None) -> PreviewOut:
        """xn: normalized layer input (B, T, d). With ``truncate`` only horizons up to max k(t) are
        computed (decoding); the result equals the full computation because the hard window masks the rest.
        ``linear`` (the engine's :func:`fbs.native.linear_rows`) computes every product row by row, so that a
        position's preview does not depend on the other positions of the call (one decoded token and the same
        token among T verified ones get the same bits); None: torch's products (training)."""
        up = lambda v: _apply(self.up, v, linear)  # noqa: E731
        k_soft = self.window_size(xn, linear)
        w, k_hard = self.window_weights(k_soft, soft)
        horizons = self.k_max
        if truncate and not soft:
            horizons = int(k_hard.max())
            if horizons == 0:
                zlow = xn.new_zeros(*xn.shape[:-1], self.up.in_features)
                return PreviewOut(up(zlow), zlow, None, k_soft, k_hard, w)
        logits = self.horizon_logits(xn, vocab_keys, horizons, linear)
        u = self.expected_embeddings(logits, vocab_emb, rowwise=linear is not None)  # (B, T, h, d)
        zlow = self.compress(u, w[..., :horizons], linear)
        return PreviewOut(up(zlow), zlow, logits if horizons == self.k_max else None, k_soft, k_hard, w)

    def macs(self, k: int, hidden_size: int, n_vocab: int, rank: int) -> int:
        """Multiply-accumulates of one decode-time call with window k (for honest accounting)."""
        d = hidden_size
        m = d  # window predictor
        if k == 0:
            return m
        m += d * rank                       # query
        m += k * (rank * rank + n_vocab * rank)  # horizon heads
        m += k * self.top_k * d             # expectation over top-K
        if self.compression == "conv":
            m += k * d * 3 + d * rank
        elif self.compression == "mean":
            m += d * rank
        elif self.compression == "linear":
            m += k * d * rank
        else:
            m += self.k_max * d * rank
        m += rank * d                       # up
        return m


def _depthwise3(u: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The depthwise kernel-3, padding-1 conv over horizons of ``u`` (..., h, d), weight (d, 1, 3): what
    ``nn.Conv1d(d, d, 3, padding=1, groups=d)`` computes, as three shifted products (for a handful of rows)."""
    pad = F.pad(u, (0, 0, 1, 1))                                                   # (..., h + 2, d)
    y = pad[..., :-2, :] * w[:, 0, 0] + pad[..., 1:-1, :] * w[:, 0, 1] + pad[..., 2:, :] * w[:, 0, 2]
    return y if bias is None else y + bias


def soft_window_weights(k_soft: torch.Tensor, k_max: int, gamma: float) -> torch.Tensor:
    """w_{i,r} = sigmoid(gamma (k~_i - r + 0.5)) for r = 1..k_max (appendix C.2). (B, T) -> (B, T, k_max)."""
    r = torch.arange(1, k_max + 1, device=k_soft.device, dtype=k_soft.dtype)
    return torch.sigmoid(gamma * (k_soft.unsqueeze(-1) - r + 0.5))


def default_preview_ids(vocab_size: int, n: int, special_ids: set[int] | None = None) -> torch.Tensor:
    """A frequency proxy used before corpus counts exist: BPE vocabularies are ordered by merge rank, so
    low ids (after special tokens) are the most frequent. Stage-1 training replaces these with counts."""
    special = special_ids or set()
    ids = [i for i in range(vocab_size) if i not in special][:n]
    if len(ids) < n:
        raise ValueError(f"preview_vocab_size={n} exceeds the usable vocabulary ({len(ids)} tokens)")
    return torch.tensor(ids, dtype=torch.long)

