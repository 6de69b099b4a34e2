"""A prompt's products in other arithmetic than the HF modules' fp32 GEMMs: ``prefill="bf16"`` (bf16 GEMMs),
``prefill="blocks"`` (the decode weights' own blocks) and ``prefill="int8"`` (int8 weights per channel, int8
activations per token).

The decode step streams each weight once per token, so its formats (q4, q8, int8 in fbs.engine.quant) are chosen
for bytes. A prompt of T tokens reads each weight once for T rows: it is bound by arithmetic. fp32 GEMMs
(``prefill="fp32"``, the HF modules themselves) reach the fp32 peak; integer dot products (VNNI's u8 x s8) do four
times the multiply-accumulates per instruction.

``blocks`` runs a prompt's products through the decode format's own packed weights (q4 / q8 blocks) and its own
native kernels, the activations quantized per 32-value block as in a decode step (:mod:`fbs.native.quant`; a prompt's
rows take the kernel's many-row path, which unpacks a q4 / q8 tile once for all rows and gives each row the bits of
its one-row product). A prompt's products are then exactly the products its tokens would get one by one, at integer
GEMM speed, with no second copy of the weights.

``int8``: one scale per weight row and one per activation row, so a product is an int8 GEMM with int32 sums
(``torch._int_mm``: oneDNN's VNNI kernels on x86) and one scaling of the result:

    y[t, n] = (sum_k xq[t, k] wq[n, k]) * sx[t] * sw[n] (+ bias[n]),
    xq = round(x / sx), sx[t] = max_k |x[t, k]| / 127;   wq = round(w / sw), sw[n] = max_k |w[n, k]| / 127

Each row's result depends on that row alone (the int32 sums are exact whatever the GEMM's blocking). The weights
are quantized once per model from its fp32 source weights (adapters merged), 1 byte a weight, kept with the decode
ops. One scale per token is coarser than the decode formats' one per 32 activations: perplexity through decode
steps barely moves, but free-running answers move far more than q4's own rounding moves them (docs/eval.md,
"Default prefill", has the perplexity and chat checks), so it is never a default.

``bf16``: bf16 copies of the fp32 source weights (2 bytes a weight, kept with the decode ops), the activations
rounded to bf16, one bf16 GEMM per product (oneDNN: AMX tiles where the CPU has them, which do 16 x 32 x 16
multiply-accumulates per instruction; AVX-512 BF16 dot products otherwise), its bf16 result widened to fp32. Every
value is rounded once to 8 significant bits instead of the 32-value block's one scale: the prompt's keys lie about 3x
closer to the fp32 prefill's than the blocks prefill's do (docs/eval.md, "Default prefill").

Between the products everything stays fp32: HF's norms, RoPE, attention, activation and residual adds under bf16 and
int8; under blocks the same, except that the FFN is the decode step's own native half (RMSNorm_2, products, SiLU,
residual; row by row) where the layer has one. Under int8 and blocks the prompt's last token, whose state predicts
the first new token, runs as a one-token step in the decode format (:meth:`fbs.engine.decoder.Decoder.prefill`);
under bf16 it runs with the rest of the prompt, as under fp32.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from .. import native
from ..model.hf_adapter import apply_rope
from ..model.layer import HFOps
from .quant import BLOCK_FORMATS, matmul, quantize_rows


class Int8Weight(NamedTuple):
    """An int8 product's weight: ``wt`` (K, N) int8 (the transposed view of the (N, K) rows ``torch._int_mm``
    reads), ``scale`` (N,) fp32 per output channel, ``bias`` (N,) or None."""

    wt: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None


def quantize_weight(w: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Weight:
    """(N, K) float weight rows -> :class:`Int8Weight`: the activations' rule (:func:`quantize_rows`) per weight row."""
    q, scale = quantize_rows(w.detach().float())
    return Int8Weight(q.t(), scale[:, 0], None if bias is None else bias.detach().float())


def int8_linear(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """(..., K) fp32 -> (..., N) fp32: the activations quantized per row (symmetric, max |x| -> 127), one int8
    GEMM, its int32 sums scaled by the row's and the channel's scales (module doc)."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    fast = native.quantize_rows(x2)  # the same arithmetic in one pass each way (fbs.native)
    if fast is None:
        xq, sx = quantize_rows(x2)
    else:
        xq, sx = fast
    acc = torch._int_mm(xq, w.wt)
    y = native.scale_rows(acc, sx, w.scale, w.bias) if fast is not None else None
    if y is None:
        y = acc.float().mul_(sx).mul_(w.scale)
        if w.bias is not None:
            y.add_(w.bias)
    return y.view(*lead, -1)



class Bf16Weight(NamedTuple):
    """A bf16 product's weight: ``w`` (N, K) bf16 rows, ``bias`` (N,) fp32 or None."""

    w: torch.Tensor
    bias: torch.Tensor | None


def bf16_weight(w: torch.Tensor, bias: torch.Tensor | None = None) -> Bf16Weight:
    """(N, K) float weight rows -> :class:`Bf16Weight` (each value rounded to the nearest bf16)."""
    return Bf16Weight(w.detach().to(torch.bfloat16).contiguous(), None if bias is None else bias.detach().float())


def bf16_linear(x: torch.Tensor, w: Bf16Weight) -> torch.Tensor:
    """(..., K) fp32 -> (..., N) fp32: the activations rounded to bf16, one bf16 GEMM (oneDNN: AMX tiles or
    AVX-512 BF16 dot products where the CPU has them, fp32 sums), its bf16 result widened; the bias added in fp32."""
    y = F.linear(x.to(torch.bfloat16), w.w).float()
    return y if w.bias is None else y.add_(w.bias)

class _Layer(NamedTuple):
    """A layer's four products in a prefill's own weights (:class:`Int8Weight`, :class:`Bf16Weight`)."""

    qkv: NamedTuple   # [W_q; W_k; W_v] with their biases (Qwen2)
    o: NamedTuple
    gu: NamedTuple    # [W_gate; W_up]
    down: NamedTuple


class _ProductPrefill(HFOps):
    """The ops a prompt runs with when its products are not the HF modules': :class:`fbs.model.layer.HFOps`' layer
    pieces with each layer's four products (:meth:`_qkv_flat`, :meth:`_o`, :meth:`_gu`, :meth:`_down`) left to a
    subclass; the rest (embedding, RoPE tables, the LM head of the last position, PAW / CH, the cache) is the decode
    ops' (``ops``), whatever format they decode in."""

    #: whether the prompt's last token, whose state predicts the first new token, runs as a one-token step in the
    #: decode format (:meth:`fbs.engine.decoder.Decoder.prefill`): the integer products' rounding then reaches the
    #: answer only through the prompt's K/V
    decode_last = True

    def __init__(self, ops):
        super().__init__(ops.base)
        self.ops = ops

    def __getattr__(self, name):  # embed, rope, head, norm1, preview_terms, native_chunk, ...: the decode ops'
        return getattr(self.__dict__["ops"], name)

    def embed(self, ids):
        return self.ops.embed(ids)

    def rope(self, x, positions):
        return self.ops.rope(x, positions)

    def head(self, x):
        return self.ops.head(x)

    def _qkv_flat(self, l: int, xn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(b, t, d) -> q, k, v projections (b, t, heads * hd) with their biases, before the heads' norms."""
        raise NotImplementedError

    def _o(self, l: int, o: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _gu(self, l: int, h: torch.Tensor) -> torch.Tensor:
        """(b, t, d) -> [gate | up] (b, t, 2 * inter)"""
        raise NotImplementedError

    def _down(self, l: int, a: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    # ---- a layer over its products ------------------------------------------
    def _heads(self, y: torch.Tensor, norm) -> torch.Tensor:
        b, t, _ = y.shape
        y = y.view(b, t, -1, self.base.spec.head_dim)
        return (y if norm is None else norm(y)).transpose(1, 2)

    def _qkv(self, l: int, xn: torch.Tensor, ctx, need_q: bool):
        attn = self.base.layers[l].self_attn
        q, k, v = self._qkv_flat(l, xn)
        k = apply_rope(self._heads(k, getattr(attn, "k_norm", None)), ctx.cos, ctx.sin)
        v = self._heads(v, None)
        q = apply_rope(self._heads(q, getattr(attn, "q_norm", None)), ctx.cos, ctx.sin) if need_q else None
        return q, k, v

    def kv(self, l, xn, ctx):
        _, k, v = self._qkv(l, xn, ctx, need_q=False)
        return k, v

    def attention(self, l, x, xn, ctx, hole=None, kv=None):
        q, k, v = self._qkv(l, xn, ctx, need_q=True)
        if kv is not None:  # K/V given by the caller (projected already): its own
            k, v = kv
        o = ctx.attend(l, q, k, v, hole)
        b, _, t, _ = o.shape
        return x + self._o(l, o.transpose(1, 2).reshape(b, t, -1))

    def ffn_delta(self, l, h):
        g, u = self._gu(l, self.base.norm2(l, h)).chunk(2, -1)
        return self._down(l, self.base.layers[l].mlp.act_fn(g) * u)
    # ffn and block: HFOps' own, over attention and ffn_delta above


class _StackedPrefill(_ProductPrefill):
    """Products on copies of the fp32 source weights (adapters merged) made once per model, a layer's Q, K, V stacked
    into one product and gate and up into another: ``weight(w, bias)`` makes a copy, ``linear(x, copy)`` runs it.
    RMSNorm_1 is HF's."""

    weight: Callable = None
    linear: Callable = None

    def __init__(self, ops):
        super().__init__(ops)
        self.layers = [self._layer(layer) for layer in self.base.layers]

    def _layer(self, layer) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        projs = (attn.q_proj, attn.k_proj, attn.v_proj)
        bias = None
        if any(p.bias is not None for p in projs):
            bias = torch.cat([p.bias.detach() if p.bias is not None else p.weight.new_zeros(p.weight.shape[0])
                              for p in projs])
        make = type(self).weight
        return _Layer(
            qkv=make(torch.cat([p.weight.detach() for p in projs]), bias),
            o=make(attn.o_proj.weight, attn.o_proj.bias),
            gu=make(torch.cat([mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()])),
            down=make(mlp.down_proj.weight, mlp.down_proj.bias),
        )

    def norm1(self, l, x):
        return self.base.norm1(l, x)

    def _qkv_flat(self, l, xn):
        spec = self.base.spec
        y = type(self).linear(xn, self.layers[l].qkv)
        nq, nk = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        return y[..., :nq], y[..., nq:nq + nk], y[..., nq + nk:]

    def _o(self, l, o):
        return type(self).linear(o, self.layers[l].o)

    def _gu(self, l, h):
        return type(self).linear(h, self.layers[l].gu)

    def _down(self, l, a):
        return type(self).linear(a, self.layers[l].down)


class Int8Prefill(_StackedPrefill):
    """``prefill="int8"``: the products in int8 (:func:`int8_linear`) on int8 copies of the fp32 source weights."""

    weight = staticmethod(quantize_weight)
    linear = staticmethod(int8_linear)


class Bf16Prefill(_StackedPrefill):
    """``prefill="bf16"``: the products in bf16 (:func:`bf16_linear`) on bf16 copies of the fp32 source weights, the
    prompt's last token included (as the fp32 prefill runs it: its logits are then about 3x closer to the fp32
    prefill's than a decode step's, docs/eval.md, "Default prefill")."""

    decode_last = False
    weight = staticmethod(bf16_weight)
    linear = staticmethod(bf16_linear)


class BlockPrefill(_ProductPrefill):
    """``prefill="blocks"``: the products of the decode ops' own fused weights (:class:`fbs.engine.fused.FusedOps`,
    a block format: q4 / q8 packed for the native kernels) through :func:`fbs.engine.quant.matmul`, as a decode
    step computes them; RMSNorm_1 is the decode ops' (row by row, as a decode step normalizes) and the FFN their
    native half (:meth:`fbs.engine.fused.FusedOps.native_ffn`) where the layer has one."""

    def __init__(self, ops):
        super().__init__(ops)
        self.layers = ops.layers

    def _qkv_flat(self, l, xn):
        spec, w = self.base.spec, self.layers[l]
        nk = spec.num_kv_heads * spec.head_dim
        q = matmul(xn, *w.q.tensors)
        kvg = matmul(xn, *w.kvg.tensors)  # [K | V | the gate's input columns, unused here]
        if w.q_b is not None:
            q = q + w.q_b
        if w.kvg_b is not None:
            kvg = kvg + w.kvg_b
        return q, kvg[..., :nk], kvg[..., nk:2 * nk]

    def _o(self, l, o):
        return matmul(o, *self.layers[l].o.tensors)

    def _gu(self, l, h):
        return matmul(h, *self.layers[l].gu.tensors)

    def _down(self, l, a):
        return matmul(a, *self.layers[l].down.tensors)

    def ffn(self, l, h):
        out = self.ops.native_ffn(l, h)  # the decode step's native FFN half (RMSNorm_2, products, SiLU, residual)
        return super().ffn(l, h) if out is None else out


_STACKED = {"int8": Int8Prefill, "bf16": Bf16Prefill}


def prefill_ops(ops, prefill: str):
    """The ops a prompt runs with under ``prefill`` (resolved: fp32, bf16, int8 or blocks) over the decode ops
    ``ops``: ``ops`` itself for fp32; the :class:`Bf16Prefill` / :class:`Int8Prefill` (built on first use and kept
    with ``ops``, rebuilt with them when the model's weights change) for bf16 / int8; a :class:`BlockPrefill` for
    blocks."""
    if prefill in _STACKED:
        attr = f"_{prefill}_prefill"
        pre = getattr(ops, attr, None)
        if pre is None:
            pre = _STACKED[prefill](ops)
            setattr(ops, attr, pre)
        return pre
    if prefill == "blocks":
        if getattr(ops, "fmt", None) not in BLOCK_FORMATS:
            raise ValueError(f"prefill='blocks' runs a prompt through the block weights of the decode format (q4, q8), "
                             f"and weights={getattr(ops, 'fmt', 'fp32')!r} has none: pass prefill='fp32' (or 'int8'), "
                             f"or weights='q4' / 'q8'")
        return BlockPrefill(ops)
    return ops


def int8_available() -> bool:
    """Whether this torch has the int8 GEMM (``torch._int_mm``) on the CPU."""
    try:
        torch._int_mm(torch.ones(2, 8, dtype=torch.int8), torch.ones(8, 8, dtype=torch.int8))
    except (AttributeError, RuntimeError):
        return False
    return True

