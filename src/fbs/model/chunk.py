"""CH, the chunk head (paper §2.3, appendix D).

At a layer that carries CH, for token t:

1. a 4-class head predicts its BIOS label (classes ``B, I, O, S``);
2. the token starts a new chunk unless its label is ``I`` (the first token always starts one), so the
   previous open chunk closes and is appended to the chunk cache;
3. the open chunk's state is the mean of the low-rank projections of its tokens, itself included;
4. the token attends (one head, low rank) over the most recent ``chunk_cache_size`` closed chunks plus
   its open chunk, and the result is projected back to the hidden size (zero at initialisation) and added
   to the token state.

Boundaries come from the predicted labels (detached argmax) in training and decoding alike, so the chunk
structure a token sees is the one it will see at inference. Everything depends only on tokens <= t.

The parallel form (:meth:`ChunkHead.forward`) and the online form (:class:`ChunkState` +
:meth:`ChunkHead.step`) compute the same values; tests check it. ``write`` masks let a token take no part
(a layer skipped under the ``hole`` KV policy).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from .config import FBSConfig

BIOS = ("B", "I", "O", "S")
LABEL_I = BIOS.index("I")


class ChunkOut(NamedTuple):
    c: torch.Tensor             # (B, T, d) additive contribution
    bios_logits: torch.Tensor   # (B, T, 4)
    boundary: torch.Tensor      # (B, T) bool: token starts a new chunk
    chunk_state: torch.Tensor   # (B, T, Rc) state of the token's open chunk (for L_align)
    token_state: torch.Tensor   # (B, T, Rc) the token's own projection (for L_align)


class ChunkState:
    """Online chunk cache of one CH layer for a batch: a ring of closed chunks plus the open chunk."""

    def __init__(self, batch: int, cache_size: int, rank: int, device, dtype):
        self.closed = torch.zeros(batch, cache_size, rank, device=device, dtype=dtype)
        self.n_closed = torch.zeros(batch, dtype=torch.long, device=device)  # total closed so far
        self.open_sum = torch.zeros(batch, rank, device=device, dtype=dtype)
        self.open_count = torch.zeros(batch, dtype=torch.long, device=device)

    def select(self, rows: torch.Tensor) -> "ChunkState":
        view = ChunkState.__new__(ChunkState)
        view.closed, view.n_closed = self.closed[rows], self.n_closed[rows]
        view.open_sum, view.open_count = self.open_sum[rows], self.open_count[rows]
        return view

    def clone(self) -> "ChunkState":
        view = ChunkState.__new__(ChunkState)
        view.closed, view.n_closed = self.closed.clone(), self.n_closed.clone()
        view.open_sum, view.open_count = self.open_sum.clone(), self.open_count.clone()
        return view

    def assign(self, rows: torch.Tensor, other: "ChunkState") -> None:
        self.closed[rows], self.n_closed[rows] = other.closed, other.n_closed
        self.open_sum[rows], self.open_count[rows] = other.open_sum, other.open_count


class ChunkHead(nn.Module):
    def __init__(self, cfg: FBSConfig, hidden_size: int):
        super().__init__()
        rc = cfg.chunk_rank
        self.cache_size = cfg.chunk_cache_size
        self.bios = nn.Linear(hidden_size, len(BIOS))
        self.key = nn.Linear(hidden_size, rc, bias=False)
        self.query = nn.Linear(hidden_size, rc, bias=False)
        self.out = nn.Linear(rc, hidden_size, bias=False)
        nn.init.zeros_(self.out.weight)
        self.scale = rc ** -0.5

    def boundaries(self, bios_logits: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        lab = labels if labels is not None else bios_logits.detach().argmax(-1)
        return lab != LABEL_I

    # ---- parallel form ------------------------------------------------------
    def forward(self, xn: torch.Tensor, write: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, return_state: bool = False):
        """xn: (B, T, d) normalized layer input; write: (B, T) bool, tokens that update the chunk cache
        (default all); labels: optional (B, T) teacher-forced BIOS labels for the boundaries.
        With ``return_state`` also returns the :class:`ChunkState` after the last token (prefill)."""
        b, t, _ = xn.shape
        logits = self.bios(xn)  # (B, T, 4)
        kt = self.key(xn)       # (B, T, Rc)
        q = self.query(xn)      # (B, T, Rc)
        w = torch.ones(b, t, dtype=torch.bool, device=xn.device) if write is None else write
        start = self.boundaries(logits, labels) & w
        # a written token before any chunk exists opens the first one
        first = w & (w.long().cumsum(1) == 1)
        start = start | first
        cid = start.long().cumsum(1) - 1                         # (B, T) chunk index, -1 before the first
        wf = w.to(xn.dtype).unsqueeze(-1)
        # open chunk at t: written tokens s <= t with cid_s == cid_t
        csum = (kt * wf).cumsum(1)                                # (B, T, Rc)
        ccount = w.long().cumsum(1)                               # (B, T)
        start_pos = torch.where(start, torch.arange(t, device=xn.device), torch.zeros_like(cid))
        start_pos = start_pos.cummax(1).values                    # position where the open chunk began
        before = (start_pos - 1).clamp_min(0)
        has_before = (start_pos > 0).unsqueeze(-1)
        prev_sum = torch.where(has_before, csum.gather(1, before.unsqueeze(-1).expand_as(csum)), 0.0)
        prev_cnt = torch.where(start_pos > 0, ccount.gather(1, before), 0)
        open_cnt = (ccount - prev_cnt).clamp_min(1)
        open_state = (csum - prev_sum) / open_cnt.unsqueeze(-1).to(xn.dtype)  # (B, T, Rc)
        # closed chunks: final mean of each chunk id
        n_chunks = t
        idx = cid.clamp_min(0)
        sums = xn.new_zeros(b, n_chunks, kt.shape[-1]).scatter_add(1, idx.unsqueeze(-1).expand_as(kt), kt * wf)
        cnts = xn.new_zeros(b, n_chunks).scatter_add(1, idx, w.to(xn.dtype))
        chunks = sums / cnts.clamp_min(1).unsqueeze(-1)           # (B, Tc, Rc)
        j = torch.arange(n_chunks, device=xn.device)
        visible = (j < cid.unsqueeze(-1)) & (j >= cid.unsqueeze(-1) - self.cache_size)  # (B, T, Tc)
        s_closed = (q @ chunks.transpose(1, 2)) * self.scale      # (B, T, Tc)
        s_closed = s_closed.masked_fill(~visible, float("-inf"))
        s_open = (q * open_state).sum(-1, keepdim=True) * self.scale
        att = torch.softmax(torch.cat([s_closed, s_open], -1), -1)
        mixed = att[..., :-1] @ chunks + att[..., -1:] * open_state
        valid = (cid >= 0).unsqueeze(-1)
        c = torch.where(valid, self.out(mixed), 0.0)
        out = ChunkOut(c, logits, start, torch.where(valid, open_state, 0.0), kt)
        if not return_state:
            return out
        state = ChunkState(b, self.cache_size, kt.shape[-1], xn.device, xn.dtype)
        n_closed = cid[:, -1].clamp_min(0)                       # chunks 0..cid-1 are closed
        for i in range(b):
            n = int(n_closed[i])
            for j in range(max(0, n - self.cache_size), n):
                state.closed[i, j % self.cache_size] = chunks[i, j]
        state.n_closed = n_closed
        state.open_sum = csum[:, -1] - prev_sum[:, -1]
        state.open_count = ccount[:, -1] - prev_cnt[:, -1]
        return out, state

    # ---- online form --------------------------------------------------------
    def step(self, xn: torch.Tensor, state: ChunkState, attend: bool = True):
        """One new token per row. xn: (b, 1, d). Updates ``state`` in place; returns (c (b,1,d) or None,
        bios_logits (b,1,4), boundary (b,) bool). With ``attend=False`` only the cache is written (a layer
        skipped under the ``project`` policy)."""
        logits = self.bios(xn)                                    # (b, 1, 4)
        kt = self.key(xn)[:, 0]                                   # (b, Rc)
        start = self.boundaries(logits)[:, 0] | (state.open_count == 0)
        # close the open chunk where a new one starts
        close = start & (state.open_count > 0)
        if bool(close.any()):
            rows = close.nonzero().squeeze(-1)
            slot = state.n_closed[rows] % self.cache_size
            state.closed[rows, slot] = state.open_sum[rows] / state.open_count[rows].unsqueeze(-1).to(xn.dtype)
            state.n_closed[rows] += 1
        state.open_sum = torch.where(start.unsqueeze(-1), kt, state.open_sum + kt)
        state.open_count = torch.where(start, torch.ones_like(state.open_count), state.open_count + 1)
        if not attend:
            return None, logits, start
        q = self.query(xn)[:, 0]                                  # (b, Rc)
        open_state = state.open_sum / state.open_count.unsqueeze(-1).to(xn.dtype)
        n_vis = state.n_closed.clamp_max(self.cache_size)         # (b,)
        slots = torch.arange(self.cache_size, device=xn.device)
        visible = slots < n_vis.unsqueeze(-1)                     # ring: the first n_vis slots are filled
        s_closed = (state.closed @ q.unsqueeze(-1)).squeeze(-1) * self.scale  # (b, C)
        s_closed = s_closed.masked_fill(~visible, float("-inf"))
        s_open = (q * open_state).sum(-1, keepdim=True) * self.scale
        att = torch.softmax(torch.cat([s_closed, s_open], -1), -1)
        mixed = (att[:, :-1].unsqueeze(1) @ state.closed).squeeze(1) + att[:, -1:] * open_state
        return self.out(mixed).unsqueeze(1), logits, start

    def macs(self, hidden_size: int, rank: int) -> int:
        """Decode-time multiply-accumulates of one step (cache full)."""
        d = hidden_size
        return d * 4 + 2 * d * rank + 2 * (self.cache_size + 1) * rank + rank * d
