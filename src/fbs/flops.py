"""Executed-compute accounting (DESIGN.md §5), from what actually ran, never from intended decisions.

Two ratios over the generated tokens of a decode (prefill excluded: it is identical for every system):

* ``tflops_rel`` — the paper's estimate: executed layer invocations x per-layer FLOPs, normalized by the
  full model (all per-layer FLOPs equal, so it is the share of (token, layer) pairs executed).
* ``tflops_rel_exact`` — multiply-accumulates of everything that ran: per executed layer its projections,
  FFN and the attention term over the keys actually in its cache (holes shrink it); the K/V projections
  written for skipped layers under ``project``; the LM head; PAW, CH and SG overhead. Normalized by the
  base model computing every layer for the same tokens with no FBS modules.
"""

from __future__ import annotations

import dataclasses

import torch

from .hf_adapter import DecoderSpec


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """Per-token multiply-accumulates of one decoder layer of ``spec``."""

    attn_proj: int   # q, k, v, o projections
    kv_proj: int     # k, v projections only
    ffn: int         # gate, up, down
    ctx_per_key: int  # QK^T and AV per cached key

    @classmethod
    def of(cls, spec: DecoderSpec) -> "LayerCost":
        d, hd, h, hkv = spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads
        return cls(attn_proj=2 * d * h * hd + 2 * d * hkv * hd, kv_proj=2 * d * hkv * hd,
                   ffn=3 * d * spec.intermediate_size, ctx_per_key=2 * h * hd)

    def full(self, keys: int) -> int:
        return self.attn_proj + self.ffn + self.ctx_per_key * keys


def lm_head_macs(spec: DecoderSpec) -> int:
    return spec.hidden_size * spec.vocab_size


class FlopCounter:
    """Computes both TFLOPs(rel) ratios of a :class:`fbs.engine.DecodeTrace` for one FBS model."""

    def __init__(self, model):
        spec = model.base.spec
        self.spec, self.cost, self.head = spec, LayerCost.of(spec), lm_head_macs(spec)
        cfg = model.config
        self.gate_macs = model.gates.macs(spec.hidden_size) if model.layers_cfg.gated else 0
        self.paw_layers = model.layers_cfg.paw
        self.ch_layers = model.layers_cfg.ch
        self._paw = {l: model.paw[str(l)] for l in self.paw_layers}
        self._ch_macs = {l: model.ch[str(l)].macs(spec.hidden_size, cfg.chunk_rank) for l in self.ch_layers}
        self._paw_args = (spec.hidden_size, cfg.preview_vocab_size + 1, cfg.preview_rank)

    def relative(self, trace) -> tuple[float, float]:
        valid = trace.valid                                        # (B, N)
        n_tok = int(valid.sum())
        if n_tok == 0:
            return 0.0, 0.0
        L = self.spec.num_layers
        ex = trace.executed & valid.unsqueeze(-1)                  # (B, N, L)
        paper = ex.sum().item() / (n_tok * L)
        # keys visible to the token at layer l: prompt entries + entries written by earlier generated tokens + itself
        prompt = trace.context_len[:, :1]                          # (B, 1): position of the first decoded token
        written_before = torch.cumsum(trace.kv_written.long(), dim=1) - trace.kv_written.long()  # (B, N, L)
        keys = prompt.unsqueeze(-1) + written_before + 1
        c = self.cost
        layer_macs = (ex * (c.attn_proj + c.ffn + c.ctx_per_key * keys)).sum().item()
        kv_only = (trace.kv_written & ~trace.executed & valid.unsqueeze(-1)).sum().item() * c.kv_proj
        gates = (~torch.isnan(trace.gate_p) & valid.unsqueeze(-1)).sum().item() * self.gate_macs
        overhead = gates
        for l in self.paw_layers:
            k = trace.window_k.clamp_min(0)
            for kv, cnt in zip(*torch.unique(k[ex[..., l]], return_counts=True)):
                overhead += cnt.item() * self._paw[l].macs(int(kv), *self._paw_args)
        for l in self.ch_layers:
            overhead += ex[..., l].sum().item() * self._ch_macs[l]
        executed = layer_macs + kv_only + overhead + n_tok * self.head
        full_keys = (trace.context_len + 1) * valid                # base model: every earlier token is a key
        baseline = n_tok * (L * (c.attn_proj + c.ffn) + self.head) + (c.ctx_per_key * L * full_keys).sum().item()
        return paper, executed / baseline
