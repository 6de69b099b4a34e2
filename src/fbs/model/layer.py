"""One FBS decoder-layer step, shared by the parallel forward (:mod:`fbs.model.causal_lm`) and the engine (:mod:`fbs.engine`).

For the rows ``x`` (B, T, d) given to it, a step computes

    xn  = RMSNorm_1(x)
    h   = x + Attn(xn)                  K/V of every token come from xn; the context stores and masks them
    h  += PAW(xn).z ;  h += CH(xn).c     on the layers that carry them
    out = mix(x, h)                     see :class:`Mix`: compute, hard skip or soft mixture, of the whole layer
                                        or of the FFN alone, with FFN(h) = h + MLP(RMSNorm_2(h))

Two things vary and are passed in, so the step exists once:

* ``ops``, the linear algebra: :class:`HFOps` calls the HF modules (the parallel forward, training, and the
  engine's ``weights="hf"`` reference, where forward hooks see every call); :class:`fbs.engine.fused.FusedOps` runs
  fused, optionally bf16/int8 and compiled copies of the same weights (the engine's default).
* ``ctx``, where K/V go: :class:`SequenceContext` attends over the given positions at once (causal, padding
  and ``hole`` masks); the engine's :class:`fbs.engine.cache.CacheContext` writes them into its KV cache and reads it.

Gate inputs for the next layer (relative update, previous skip) come from :func:`next_gate_inputs`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import torch

from .chunk import ChunkOut
from .gate import relative_update
from .preview import PreviewOut

Granularity = str  # "layer" | "ffn"


@dataclasses.dataclass(frozen=True)
class Mix:
    """How a layer's output combines with its input for the given rows.

    ``granularity="layer"``: a skipped token keeps x (nothing of the layer); ``"ffn"``: attention, PAW and CH
    run exactly and only the FFN is skipped. ``skip`` (B, T) bool is a hard decision, ``g`` (B, T) a soft
    mixture weight (training: out = g x + (1 - g) f for a layer, h + (1 - g) MLP(h) for an FFN).
    ``ffn_rows`` (decoding, FFN granularity): indices of the rows whose FFN runs; the others do no FFN work.
    Two hooks for routed baselines (:mod:`fbs.baselines.flexidepth`), layer granularity only: ``ffn_scale``
    (B, T) scales the FFN's update of the tokens that compute (out = h + s MLP(h)); ``bypass(l, x)`` is the
    output of the tokens a hard ``skip`` skips (default: x unchanged).
    """

    granularity: Granularity = "layer"
    skip: torch.Tensor | None = None
    g: torch.Tensor | None = None
    ffn_rows: torch.Tensor | None = None
    ffn_scale: torch.Tensor | None = None
    bypass: Callable[[int, torch.Tensor], torch.Tensor] | None = None

    @property
    def plain(self) -> bool:
        return (self.skip is None and self.g is None and self.ffn_rows is None and self.ffn_scale is None
                and self.bypass is None)

    def hole(self, policy: str) -> torch.Tensor | None:
        """Tokens whose K/V (and chunk update) later tokens must not see at this layer (``hole`` policy)."""
        return self.skip if self.granularity == "layer" and policy == "hole" else None

    def output(self, ops, l: int, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return self.output_and_update(ops, l, x, h)[0]

    def output_and_update(self, ops, l: int, x: torch.Tensor,
                          h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer output and, for a soft mixture (training), the relative update (B, T) the skippable unit
        makes to every token, run or not (detached): ||f(x) - x|| / ||x|| for a layer, ||MLP(h)|| / ||h|| for
        an FFN. None otherwise."""
        if self.granularity == "layer":
            f = ops.ffn(l, h) if self.ffn_scale is None else h + self.ffn_scale.unsqueeze(-1) * ops.ffn_delta(l, h)
            if self.skip is not None:
                kept = x if self.bypass is None else self.bypass(l, x)
                return torch.where(self.skip.unsqueeze(-1), kept, f), None
            if self.g is not None:
                update = relative_update(f.detach(), x.detach())
                return self.g.unsqueeze(-1) * x + (1 - self.g).unsqueeze(-1) * f, update
            return f, None
        if self.g is not None and self.ffn_rows is None and self.skip is None:
            delta = ops.ffn_delta(l, h)
            update = delta.detach().norm(dim=-1) / h.detach().norm(dim=-1).clamp_min(1e-6)
            return h + (1 - self.g).unsqueeze(-1) * delta, update
        return self._ffn_output(ops, l, h), None

    def _ffn_output(self, ops, l: int, h: torch.Tensor) -> torch.Tensor:
        if self.ffn_rows is not None:
            if self.ffn_rows.numel() == 0:
                return h
            return h.index_copy(0, self.ffn_rows, ops.ffn(l, h.index_select(0, self.ffn_rows)))
        if self.skip is not None:
            return torch.where(self.skip.unsqueeze(-1), h, ops.ffn(l, h))
        return ops.ffn(l, h)


COMPUTE = Mix()


class LayerOut(NamedTuple):
    x: torch.Tensor                 # (B, T, d) layer output
    zlow: torch.Tensor | None       # (B, T, R) preview summary after this layer (PAW layers; else passed through)
    paw: PreviewOut | None          # what PAW produced (PAW layers only)
    ch: ChunkOut | None             # what CH produced (CH layers only)
    update: torch.Tensor | None = None  # (B, T) soft mixture only: relative update of the skippable unit
    h: torch.Tensor | None = None       # (B, T, d) state after attention (+PAW, CH), before the FFN; None on the
                                        # whole-block path (plain mix, no PAW/CH)


class Route(NamedTuple):
    """A baseline router's decision for one layer of the parallel forward (``FBSForCausalLM.forward(mixer=...)``)."""

    mix: Mix               # hard ``skip`` (B, T) of the routed tokens and the router's hooks
    p: torch.Tensor        # (B, T) skip probability (0 where nothing is routed), in the autograd graph


def layer_step(model, ops, l: int, x: torch.Tensor, ctx, mix: Mix = COMPUTE, *, xn: torch.Tensor | None = None,
               kv: tuple[torch.Tensor, torch.Tensor] | None = None, zlow: torch.Tensor | None = None) -> LayerOut:
    """Run decoder layer ``l`` of the FBS ``model`` on ``x`` (B, T, d).

    ``xn`` is RMSNorm_1(x) when the caller already has it (it fed the gate); ``kv`` the layer's K/V of ``xn``
    when already projected (the fused gate shares their matmul); ``zlow`` the current preview summary.
    """
    key = str(l)
    xn = ops.norm1(l, x) if xn is None else xn
    hole = mix.hole(ctx.policy)
    if mix.plain and key not in model.paw and key not in model.ch:
        return LayerOut(ops.block(l, x, xn, ctx, kv), zlow, None, None)
    h = ops.attention(l, x, xn, ctx, hole, kv)
    paw = ch = None
    if key in model.paw:
        paw = ctx.preview(l, model.paw[key], xn)
        h = h + paw.z
        hard = mix.skip if mix.granularity == "layer" else None
        zlow = paw.zlow if hard is None or zlow is None else torch.where(hard.unsqueeze(-1), zlow, paw.zlow)
    if key in model.ch:
        ch = ctx.chunk(l, model.ch[key], xn, hole)
        h = h + ch.c
    out, update = mix.output_and_update(ops, l, x, h)
    return LayerOut(out, zlow, paw, ch, update, h)


def next_gate_inputs(new: torch.Tensor, x: torch.Tensor,
                     skip: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gate inputs of layer l+1 from layer l's input ``x`` and output ``new``: the relative update (B, T) and
    the previous-skip indicator (B, T) (None when nothing was skipped)."""
    return relative_update(new, x), (None if skip is None else skip.to(x.dtype))


# --------------------------------------------------------------------------- HF modules as ops
class HFOps:
    """The linear algebra of a layer step through the HF modules of :class:`fbs.model.hf_adapter.BaseDecoder`."""

    def __init__(self, base):
        self.base = base

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.base.embed(ids)

    def rope(self, x: torch.Tensor, positions: torch.Tensor):
        return self.base.rope(x, positions)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.base.head(x)

    def norm1(self, l: int, x: torch.Tensor) -> torch.Tensor:
        return self.base.norm1(l, x)

    def kv(self, l: int, xn: torch.Tensor, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        return self.base.key_value(l, xn, ctx.cos, ctx.sin)

    def attention(self, l: int, x: torch.Tensor, xn: torch.Tensor, ctx, hole=None, kv=None) -> torch.Tensor:
        q = self.base.query(l, xn, ctx.cos, ctx.sin)
        k, v = self.kv(l, xn, ctx) if kv is None else kv
        return x + self.base.attn_out(l, ctx.attend(l, q, k, v, hole))

    def ffn_delta(self, l: int, h: torch.Tensor) -> torch.Tensor:
        return self.base.mlp(l, self.base.norm2(l, h))

    def ffn(self, l: int, h: torch.Tensor) -> torch.Tensor:
        return h + self.ffn_delta(l, h)

    def block(self, l: int, x: torch.Tensor, xn: torch.Tensor, ctx, kv=None) -> torch.Tensor:
        return self.ffn(l, self.attention(l, x, xn, ctx, None, kv))


# --------------------------------------------------------------------------- all positions at once
class SequenceContext:
    """Attention over the positions of one (B, T) batch at once (the parallel forward).

    K/V of every token come from its layer input; ``hole`` (B, T) hides a skipped token's K/V and chunk update
    from later tokens at that layer; ``keymask`` (B, T) marks real tokens (padding is never attended to).
    """

    truncate = False
    linear = None  # PAW's products: torch's

    def __init__(self, base, cos, sin, keymask: torch.Tensor | None, policy: str, soft_window: bool,
                 preview_emb=None, preview_keys=None, bios_labels: torch.Tensor | None = None):
        self.base, self.cos, self.sin, self.keymask, self.policy = base, cos, sin, keymask, policy
        self.soft_window, self.preview_emb, self.preview_keys = soft_window, preview_emb, preview_keys or {}
        self.bios_labels = bios_labels
        t = cos.shape[1]
        self.causal = torch.ones(t, t, dtype=torch.bool, device=cos.device).tril()
        self.eye = torch.eye(t, dtype=torch.bool, device=cos.device)

    def attend(self, l: int, q, k, v, hole: torch.Tensor | None = None) -> torch.Tensor:
        mask = None
        if self.keymask is not None or hole is not None:
            b, t = q.shape[0], q.shape[2]
            mask = self.causal.expand(b, t, t)
            if self.keymask is not None:
                mask = mask & self.keymask[:, None, :]
            if hole is not None:
                mask = mask & (~hole[:, None, :] | self.eye)
            mask = (mask | self.eye).unsqueeze(1)
        return self.base.attend(q, k, v, mask, causal=True)

    def preview(self, l: int, paw, xn: torch.Tensor) -> PreviewOut:
        """What PAW layer l's module ``paw`` adds for the normalized states ``xn`` (B, T, d)."""
        return paw(xn, self.preview_emb, self.preview_keys[str(l)], soft=self.soft_window, truncate=self.truncate,
                   linear=self.linear)

    def chunk(self, l: int, head, xn: torch.Tensor, hole: torch.Tensor | None) -> ChunkOut:
        write = None if hole is None else ~hole
        if self.keymask is not None:
            write = self.keymask if write is None else write & self.keymask
        return head(xn, write=write, labels=self.bios_labels)
