"""The engine's linear algebra: the HF modules (``weights="hf"``) or fused inference copies of the same weights.

:func:`decode_ops` returns the ops object a :func:`fbs.model.layer.layer_step` runs with during decoding. Besides the
layer pieces it has ``pre``: RMSNorm_1, the layer's K/V and, for a gated layer, the gate logit.

Fused copies (:class:`FusedOps`) are an inference-time view built once per model and weight format and
rebuilt when any source parameter changes (the HF modules stay the source of truth, e.g. for training):

* per layer, W_kvg = [W_k; W_v; A_l] where A_l is the gate's input projection folded through the shared
  residual projection (the gate reads RMSNorm_1(h), the same input as K/V), so one matmul gives K, V and the
  gate's hidden pre-activation; then W_q, W_o, [W_gate; W_up] and W_down;
* the gates' terms that do not depend on a layer's input (hidden bias + preview term, all gated layers in one
  matmul per preview summary) and their constant relative-update terms (first layer, skipped previous layer),
  so that a gated layer adds few small ops to its ``pre`` (see :func:`_gate_logit`) and one host read;
* the LM head (tied or not) in the same format;
* weights in fp32, bf16, int8 per output channel or the block formats q8 / q4 (:mod:`fbs.engine.quant`); fp32
  computes what the HF modules do.

One-token steps run two fixed-shape functions per layer, ``pre`` (norm, K/V, gate) and ``block`` (Q, cache
write, attention over the static cache, O, FFN), optionally ``torch.compile``d: one artifact serves every
layer because weights and cache buffers are arguments, and the skip loop stays in Python, so changing skip
patterns never recompiles. Prefill (many tokens) runs the HF modules themselves: GEMMs on the fp32 source
weights, exactly HF's arithmetic, whatever the decode format (for long inputs the BLAS GEMMs are the faster
kernels). A speculative verifier's few tokens per row (``CacheContext.native_many``) run, in the native formats
(int8, q8, q4 on a CPU with their kernels), through the same native layers as a one-token step, every position a
row of the call (:meth:`FusedOps.native_span`, :func:`full_depth`): each weight is read once for all positions,
and the verifier computes what decoding in that format computes.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .. import native
from .cache import CacheContext
from .kvpolicy import attend_scored
from ..model.layer import HFOps, LayerOut, layer_step
from ..model.preview import PreviewOut
from ..model.chunk import LABEL_I, ChunkOut, ChunkState
from ..model.gate import relative_update
from ..model.lora import merged_lowrank
from ..native import quant as native_quant
from .quant import BLOCK_FORMATS, FORMATS, Weight, kv_load, kv_store, matmul

logger = logging.getLogger(__name__)

WEIGHTS = ("hf",) + FORMATS


class Pre(NamedTuple):
    """What a layer computes before its skip decision, for the rows of a step."""

    xn: torch.Tensor                                   # (b, T, d) RMSNorm_1(x)
    kv: tuple[torch.Tensor, torch.Tensor] | None       # (b, Hkv, T, hd) rotated K and V, when already projected
    logit: torch.Tensor | list[float] | None           # (b,) gate logits (skip when > logit(tau)), gated layers;
                                                       # Python floats when the native kernel computed them


def decode_ops(model, weights: str = "fp32", compile: bool = False):
    """The ops of one generate call: HF modules (``"hf"``) or the model's cached fused copies."""
    if weights == "hf":
        return HFDecodeOps(model)
    if weights not in FORMATS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    per_model = _FUSED.setdefault(model, {})
    stamp = source_stamp(model)
    key = (weights, compile, native.enabled())
    cached = per_model.get(key)
    if cached is None or cached[0] != stamp:
        if cached is not None:
            logger.info("model weights changed since the %s copies were built: rebuilding them", weights)
        per_model[key] = (stamp, FusedOps(model, weights, compile))
    return per_model[key][1]


_FUSED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def source_stamp(model) -> tuple:
    """Identity and version counter of every parameter the fused copies are built from."""
    params = list(model.base.parameters()) + list(model.gates.parameters())
    return tuple((p.data_ptr(), p._version) for p in params)


def full_depth(model, ops, x: torch.Tensor, ctx, layers: range, on_layer=None) -> torch.Tensor:
    """Layers ``layers`` at full depth over x (b, T, d) in the cache context ``ctx``: with ``ctx.native_many``, each
    run of the ops' native layers in one native call (:meth:`FusedOps.native_span`); the other layers (PAW / CH,
    or every layer otherwise) through :func:`fbs.model.layer.layer_step`, whose output ``on_layer(l, out)`` sees.
    Returns x'."""
    # a token tree's pass runs layer by layer (its attention masks reach the native layers' attention halves)
    native_runs = getattr(ops, "native_layers", None) is not None and ctx.native_many \
        and getattr(ctx, "tree_bits", None) is None
    table = ops.span_table(ctx) if native_runs else None
    for seg, whole in ops._native_runs(layers, table) if native_runs else ((layers, False),):
        if whole:
            x = ops.native_span(seg, x, ctx, table, on_layer)
            continue
        for l in seg:
            out = layer_step(model, ops, l, x, ctx)
            if on_layer is not None:
                on_layer(l, out)
            x = out.x
    return x


class LayerByLayer:
    """The PyTorch implementation of ``run_layers``, the one call a decode step makes for its layers."""

    native_chunk = False  # the one-token chunk head of a CH layer runs natively (:class:`CacheContext`)

    def run_layers(self, layers: range, step) -> None:
        """Run ``layers`` (consecutive) of a one-token step over ``step`` (:class:`fbs.engine.decoder.DecodeStep`):
        each layer on its own, :func:`fbs.model.layer.layer_step` with the decoder's decision and record."""
        for l in layers:
            step.layer(l)


# --------------------------------------------------------------------------- HF modules
class HFDecodeOps(LayerByLayer, HFOps):
    """The HF modules plus the algebraically fused gates (:class:`fbs.model.gate.FusedGates`)."""

    def __init__(self, model):
        super().__init__(model.base)
        self.gates = model.gates.fused()

    def preview_terms(self, zlow: torch.Tensor | None, rows: int):
        """The gates' preview terms of a step's ``rows`` rows; ``zlow`` None: no PAW layer ran yet (zero terms)."""
        return None if zlow is None else self.gates.preview_terms(zlow)

    def attends_natively(self, l: int) -> bool:
        return False

    def pre(self, l: int, x, ctx, x_prev, zterms, prev_skip, gated: bool) -> Pre:
        xn = self.norm1(l, x)
        if not gated:
            return Pre(xn, None, None)
        rel = x.new_ones(x.shape[:-1]) if x_prev is None else relative_update(x, x_prev)
        return Pre(xn, None, self.gates.logits(l, xn, rel, zterms, prev_skip)[:, 0])


# --------------------------------------------------------------------------- fused copies
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float, native_step: bool = False) -> torch.Tensor:
    """HF's Llama/Qwen RMSNorm: statistics in fp32, weight applied in the input dtype (the casts are skipped when
    they would be no-ops: each is a dispatch of its own in a one-token step). ``native_step``: one native call
    (fp32 rows, :func:`fbs.native.rms_norm`)."""
    if native_step:
        return native.rms_norm(x, w, eps)
    xf = x if x.dtype == torch.float32 else x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * (y if y.dtype == x.dtype else y.to(x.dtype))


def _linear(x, w, s, b):
    y = matmul(x, w, s)
    return y if b is None else y + b


def _heads(y: torch.Tensor, n: int, hd: int, norm, eps: float) -> torch.Tensor:
    """(b, T, n*hd) -> (b, n, T, hd), with the per-head RMSNorm of Qwen3 when ``norm`` is given."""
    b, t, _ = y.shape
    y = y.view(b, t, n, hd)
    if norm is not None:
        y = _rms(y, norm, eps)
    return y.transpose(1, 2)


def _rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's rotary tables (b, 1, hd) of a one-token step as :func:`_rope` reads them: (b, 1, 1, hd) cos and sin
    with its first half negated, made once per step instead of once per layer and projection."""
    half = sin.shape[-1] // 2
    return cos.unsqueeze(1), torch.cat((-sin[..., :half], sin[..., half:]), -1).unsqueeze(1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """HF's ``x * cos + rotate_half(x) * sin`` in fewer ops and bit for bit: rotate_half(x) = cat(-x2, x1) and
    roll(x) = cat(x2, x1), so rotate_half(x) * sin = roll(x) * cat(-sin1, sin2) exactly (a sign flip is exact)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


def _pre_step(x, x_prev, terms, rel_term, prev_skip, cos, sin, ln1, kvg, kvg_s, kvg_b, kn, gate, *, nkv: int,
              hd: int, eps: float, native_step: bool = False):
    """RMSNorm_1, K/V (rotated) and, with ``gate`` (see :func:`_gate_logit`), the gate logit (b,). ``cos`` /
    ``sin``: :func:`_rope_tables`. ``native_step``: the norm in a native kernel (see :class:`FusedOps`)."""
    xn = _rms(x, ln1, eps, native_step)
    y = _linear(xn, kvg, kvg_s, kvg_b)                               # (b, 1, 2*nkv*hd [+ G])
    width = nkv * hd
    if gate is None:
        k, v, g = y[..., :width], y[..., width:2 * width], None
    else:  # one op for the three parts; the gate's width G (0 without the residual input) is fixed per layer
        k, v, g = y.split_with_sizes([width, width, y.shape[-1] - 2 * width], -1)
    k = _rope(_heads(k, nkv, hd, kn, eps), cos, sin)
    v = _heads(v, nkv, hd, None, eps)
    if torch.compiler.is_compiling():  # a view of y has y's row stride, which the gate's columns change: the compiled
        v = v.clone(memory_format=torch.contiguous_format)  # block step would go shape-generic (sizes read per call)
    if gate is None:  # y too: the gate's columns for the native kernel (fbs.native) when the layer has a gate
        return xn, k, v, y
    return xn, k, v, _gate_logit(g, x, x_prev, terms, rel_term, prev_skip, gate)


def _gate_logit(g, x, x_prev, terms, rel_term, prev_skip, gate):
    """A skip gate's logit (b,) for one token per row: out(silu(hidden)) with hidden = the gate's columns of the
    fused K/V matmul ``g`` (b, 1, G; width 0 without the residual input) + ``terms`` (its bias and preview term,
    :meth:`FusedOps.preview_terms`) + w_rel log(||x - x_prev|| / ||x_prev|| + 1e-3) [+ w_prev prev_skip].
    ``x_prev`` None: the relative-update term is the constant ``rel_term`` (or absent when None).
    ``gate`` = (w_rel, w_prev, out_w (G,), out_b (1,), 1e-3 as a tensor). Written in few ops, each of which is a
    dispatch in eager mode (e.g. addmv rather than a linear over (b, 1, G), which dispatches a dozen)."""
    w_rel, w_prev, out_w, out_b, eps = gate
    h = terms if g.shape[-1] == 0 else g + terms
    if x_prev is not None:
        u = torch.linalg.vector_norm(x - x_prev, dim=-1, keepdim=True)                      # (b, 1, 1)
        u_prev = torch.linalg.vector_norm(x_prev, dim=-1, keepdim=True).clamp_min_(1e-6)
        h = torch.addcmul(h, torch.addcdiv(eps, u, u_prev).log_(), w_rel)
    elif rel_term is not None:
        h = h + rel_term
    if prev_skip is not None:
        h = torch.addcmul(h, prev_skip.unsqueeze(-1), w_prev)
    return torch.addmv(out_b, F.silu(h).view(-1, h.shape[-1]), out_w)


def _ffn_step(h, ln2, gu, gu_s, dn, dn_s, *, eps: float, inter: int, native_step: bool = False):
    """h + down(silu(gate(hn)) * up(hn)), hn = RMSNorm_2(h), with gate and up as one matmul."""
    y = matmul(_rms(h, ln2, eps, native_step), gu, gu_s)
    return h + matmul(F.silu(y[..., :inter]) * y[..., inter:], dn, dn_s)


def _block_step(x, xn, k, v, cos, sin, kc, vc, slots, idx, valid, rows, wq, wq_s, bq, qn, wo, wo_s, ln2, gu, gu_s,
                dn, dn_s, *, heads: int, hd: int, eps: float, scale: float, inter: int, ffn: bool,
                native_step: bool = False, scores: torch.Tensor | None = None, kf: torch.Tensor | None = None):
    """One new token per row: Q, write K/V at each row's slot of the static cache, attend over the slots
    filled so far, O and (with ``ffn``) the FFN. ``idx`` (b,): the rows' cache rows; ``valid`` (b, 1, 1, C): the
    slots each row attends to (both from :meth:`FusedOps._slots`); ``rows`` None: the step's rows are the cache's
    rows (attend over the whole buffers), else ``idx`` (gather them). ``native_step``: the write and the
    attention in one native call over each row's filled prefix only (:func:`fbs.native.attend_one`), the norm
    native too. ``scores`` (B, Hkv, C): a cache policy's accumulated attention (H2O); the attention is then
    computed explicitly, as PyTorch ops, and adds its weights to it (:func:`fbs.engine.kvpolicy.attend_scored`).
    ``kf`` (Hkv, 1, hd): the factors the cache's keys are stored divided by (:attr:`fbs.engine.cache.KVCache.key_factor`)."""
    b = x.shape[0]
    q = _rope(_heads(_linear(xn, wq, wq_s, bq), heads, hd, qn, eps), cos, sin)  # (b, H, 1, hd)
    if native_step and scores is None:
        o = native.attend_one(q, k, v, kc, vc, idx, slots, scale, kf=kf)          # (b, 1, H * hd)
    else:
        kc[idx, :, slots] = kv_store(k, kc.dtype, kf)[:, :, 0]  # a half-precision / int8 cache (kv_dtype) rounds them
        vc[idx, :, slots] = kv_store(v[:, :, 0], vc.dtype)
        keys, vals = (kc, vc) if rows is None else (kc[rows], vc[rows])
        if keys.dtype != q.dtype or kf is not None:  # and attention reads them converted back
            keys, vals = kv_load(keys, q.dtype, kf), kv_load(vals, q.dtype)
        if scores is None:
            o = F.scaled_dot_product_attention(q, keys, vals, attn_mask=valid, scale=scale,
                                               enable_gqa=keys.shape[1] != heads)
        else:
            o = attend_scored(q, keys, vals, valid, scale, scores, idx)
        o = o.transpose(1, 2).reshape(b, 1, heads * hd)
    h = x + matmul(o, wo, wo_s)
    return _ffn_step(h, ln2, gu, gu_s, dn, dn_s, eps=eps, inter=inter, native_step=native_step) if ffn else h


def _head_step(x, norm, w, s, *, eps: float, native_step: bool = False):
    return matmul(_rms(x, norm, eps, native_step), w, s)


class _Terms:
    """The gates' per-token terms of a step: ``flat`` (b, 1, n * G) (what :func:`fbs.native.run_layers` reads) and,
    indexed by a gate's position, its (b, 1, G) view (the per-op step's; split on first use: the split is 3 ATen
    calls per gated layer, which a step that runs its gated layers natively never needs)."""

    def __init__(self, flat: torch.Tensor, width: int):
        self.flat, self.width, self._views = flat, width, None

    def __getitem__(self, i: int) -> torch.Tensor:
        if self._views is None:
            self._views = self.flat.split(self.width, -1)
        return self._views[i]


def _gate_inputs(gate, x, x_prev, zterms, prev_skip) -> tuple:
    """A gated layer's per-token inputs as its step reads them: (terms, x_prev, relative-update constant, previous
    skip). The relative update is computed from ``x_prev``, or a constant when it is 1 (no previous layer) or 0
    (``x_prev is x``: every row skipped the previous layer). All None for an ungated layer (``gate`` None)."""
    if gate is None:
        return None, None, None, None
    xp = rel = None
    if gate.rel_first is not None:
        xp, rel = (None, gate.rel_first) if x_prev is None else (None, gate.rel_zero) if x_prev is x else (x_prev, None)
    return zterms[gate.index], xp, rel, (prev_skip if gate.step[1] is not None else None)


def _dense(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


def _stacked_lowrank(mods: list, weights: list) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The merged LoRA deltas (:func:`fbs.model.lora.merged_lowrank`) of linears whose weights are stacked by rows
    into one matrix (``mods[i]`` None: rows without a delta), as one delta b @ a of the stacked matrix: a the
    factors a_i one under another, b block-diagonal; None when no part has one."""
    found = [None if m is None else merged_lowrank(m) for m in mods]
    if all(f is None for f in found):
        return None
    a = torch.cat([f[0] for f in found if f is not None]).float()
    b = torch.zeros(sum(w.shape[0] for w in weights), a.shape[0])
    row = col = 0
    for f, w in zip(found, weights):
        if f is not None:
            b[row:row + w.shape[0], col:col + f[0].shape[0]] = f[1]
            col += f[0].shape[0]
        row += w.shape[0]
    return a, b


class _Layer(NamedTuple):
    ln1: torch.Tensor
    kvg: Weight
    kvg_b: torch.Tensor | None
    q: Weight
    q_b: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Weight
    ln2: torch.Tensor
    gu: Weight
    down: Weight
    gate: "_Gate | None"      # gated layers


class _Gate(NamedTuple):
    """A gated layer's gate as the one-token step reads it (its input projection is in the layer's W_kvg)."""

    index: int                     # position among the gated layers: which of the per-token terms is its
    step: tuple                    # (w_rel, w_prev, out_w, out_b, eps) for _gate_logit; w_rel / w_prev None if unused
    native: tuple                  # the same for fbs.native.gate_logits (fbs.native.gate_args)
    cols: tuple[int, int]          # (offset, width) of its columns in the layer's W_kvg output (width 0: none)
    rel_first: torch.Tensor | None  # w_rel log(1 + 1e-3): no previous layer (relative update 1)
    rel_zero: torch.Tensor | None   # w_rel log(0 + 1e-3): every row skipped the previous layer (update 0)


def _compile_dir() -> str:
    from ..model.bases import cache_root

    return str(cache_root() / "inductor")


#: inductor options of the compiled step on CPU (cpp_wrapper: the step's kernels are called from C++, which
#: removes most of the per-kernel Python overhead of a one-token step)
CPU_INDUCTOR_OPTIONS = {"cpp_wrapper": True}


#: graphs dynamo may keep per compiled function: (gated or not) x (formats) x (a static and a dynamic shape)
RECOMPILE_LIMIT = 32


def _compiler(backend: bool | str, device: torch.device):
    """``torch.compile`` of one step function, whole-graph; ``True`` = inductor (with :data:`CPU_INDUCTOR_OPTIONS`
    on CPU), a string = that backend (e.g. ``"eager"`` to test graph capture). Shapes start static; a second
    batch size or cache capacity makes dynamo compile one shape-generic graph instead of one per size."""
    # each step function is one code object shared by every layer and weight format; dynamo's default limit of
    # 8 graphs per code object is too tight for formats x gated/ungated layers (a global, only ever raised)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    if backend is True or backend == "inductor":
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", _compile_dir())  # compiled kernels persist across runs
        opts = dict(CPU_INDUCTOR_OPTIONS) if device.type == "cpu" else {}
        return lambda fn: torch.compile(fn, fullgraph=True, options=opts)
    return lambda fn: torch.compile(fn, fullgraph=True, backend=backend)


class FusedOps(LayerByLayer):
    """Fused (and optionally compiled) copies of a model's decoder weights in one format; see the module doc."""

    #: (id of the table, layers) -> (the table, _native_runs(layers, table))
    _runs_memo: dict = {}
    #: per layer the native layer a one-token decode step runs it with, PAW and CH layers included where the
    #: kernels take their modules (:meth:`NativeLayer.set_paw` / ``set_chunk``); None where the per-op step must
    #: run it, or altogether (see :meth:`run_layers`)
    native_decode: list | None = None
    #: per PAW layer the arguments of :func:`fbs.native.paw_step` (its native step; made once here, shared by
    #: :attr:`native_decode` and the decoder's contexts), None without the native step
    paw_args: dict[int, tuple] | None = None
    _ch_native: frozenset = frozenset()   # the CH / PAW layers :attr:`native_decode` runs with their modules
    _paw_native: frozenset = frozenset()

    def __init__(self, model, fmt: str = "fp32", compile: bool = False):
        base, spec = model.base, model.base.spec
        self.base, self.spec, self.fmt = base, spec, fmt
        self.hf = HFOps(base)  # many-token inputs (prefill): the HF modules' own GEMMs on the fp32 source weights
        self.dtype = base.embedding_weight.dtype
        #: int8 and block-format weights in the native kernels' packed layouts (eager CPU steps on a CPU with
        #: their kernels, fbs.native); a compiled int8 step keeps torch._weight_int8pack_mm in its graph, block
        #: formats without their kernels run as dequantized fp32
        self.native_packed = (not compile and base.embedding_weight.device.type == "cpu" and (
            (fmt == "int8" and native.int8_isa() is not None)
            or (fmt in BLOCK_FORMATS and native.int8_isa() is not None and native_quant.isa() is not None)))
        fused_gates = model.gates.fused()
        self.gates = fused_gates
        self.gated = tuple(model.gates.layer_ids)
        self.layers = [self._layer(l, fused_gates) for l in range(spec.num_layers)]
        # all gates' input-independent terms of a token: hidden bias + preview term (one matmul), (b, 1, n * G)
        biases = [fused_gates.a[l][1] for l in self.gated]
        self._term_b = torch.cat([b.detach() for b in biases]) if biases else None
        self._term_w = None if fused_gates.z_all is None else fused_gates.z_all.detach()
        self._gate_width = biases[0].shape[0] if biases else 0
        self._zero_terms: dict[int, tuple] = {}  # rows -> the terms of a zero preview summary
        self.norm_w = base.norm.weight.detach()
        self.eps = float(getattr(base.norm, "variance_epsilon", getattr(base.norm, "eps", 1e-6)))
        self.head_w = self._weight(base.lm_head.weight, head=True)
        self.emb = base.embedding_weight.detach()
        hd, eps, inter = spec.head_dim, self.eps, spec.intermediate_size
        # the native int8 step also attends and normalizes natively (fbs.native; int8 is not bit-faithful anyway,
        # fp32 keeps SDPA and the norm's ATen ops: HF's arithmetic)
        ns = dict(native_step=self.native_packed and self.dtype == torch.float32)
        self._k_pre = dict(nkv=spec.num_kv_heads, hd=hd, eps=eps, **ns)
        self._k_block = dict(heads=spec.num_heads, hd=hd, eps=eps, scale=base.scaling, inter=inter, **ns)
        self._k_ffn, self._k_head = dict(eps=eps, inter=inter, **ns), dict(eps=eps, **ns)
        self._rope_memo: tuple = (None, None)      # (the step's cos, its _rope_tables)
        self._many_attended: int | None = None     # the layer whose attention just ran natively on many tokens
        self._slot_memo: tuple = (None, None, -1)  # (slots, rows, capacity, idx, valid)
        self.compiled = compile
        fns = (_pre_step, _block_step, _ffn_step, _head_step)
        if compile:
            wrap = _compiler(compile, self.emb.device)
            fns = tuple(wrap(f) for f in fns)
            for w in self.layers:  # W_kvg is taller on gated layers (the gate's columns): one static graph per
                for t in (*w.kvg.tensors, w.kvg_b):  # height, not a shape-generic one that reads sizes every call
                    if t is not None:
                        torch._dynamo.mark_static(t)
        self._pre_fn, self._block_fn, self._ffn_fn, self._head_fn = fns
        #: gate logits from the native kernel (eager fp32 CPU steps; a compiled step fuses the gate's ops itself)
        self.native_gates = (not compile and bool(self.gated) and self.dtype == torch.float32
                             and self.emb.device.type == "cpu" and native.module() is not None)
        #: per layer, the whole one-token layer in one native call (fbs.native.NativeLayer), or None where the
        #: layer runs as PyTorch ops around native halves (PAW / CH layers: :attr:`native_decode` has them for a
        #: decode step), or as PyTorch ops (Qwen3's per-head norms, widths not a multiple of 16); None altogether
        #: unless the step is the native int8 one.
        self._native_all = self._native_layers() if ns["native_step"] else None  # every layer it can run
        self.native_layers = None if self._native_all is None else [
            None if str(l) in model.paw or str(l) in model.ch else n for l, n in enumerate(self._native_all)]
        self._runs_memo = {}
        if self._native_all is not None and len(model.paw):
            with torch.no_grad():
                emb, keys = model.preview_vocab()
            self.paw_args = {int(k): native.paw_weights(paw, keys[k], emb.detach()) for k, paw in model.paw.items()}
        if self._native_all is not None and (len(model.paw) or len(model.ch)):
            self.native_decode = self._decode_layers(model)

    def _layer(self, l: int, fg) -> _Layer:
        layer = self.base.layers[l]
        attn, mlp = layer.self_attn, layer.mlp
        rows = [attn.k_proj.weight, attn.v_proj.weight]
        bias = [attn.k_proj.bias, attn.v_proj.bias] if attn.k_proj.bias is not None else None
        gate = self._gate(l, fg) if l in self.gated else None
        a = fg.a[l][0] if gate is not None else None  # its hidden bias is in the per-token terms (preview_terms)
        if a is not None:  # fold the gate's input projection into the K/V matmul
            rows.append(a)
            if bias is not None:
                bias.append(torch.zeros(a.shape[0], dtype=a.dtype, device=a.device))
        kvg_b = torch.cat([b.detach() for b in bias]) if bias is not None else None
        norm = lambda m: None if m is None else m.weight.detach()  # noqa: E731
        kv_parts = [attn.k_proj, attn.v_proj] + ([None] * (a is not None))
        return _Layer(
            ln1=layer.input_layernorm.weight.detach(),
            kvg=self._weight(torch.cat([r.detach() for r in rows]), lowrank=_stacked_lowrank(kv_parts, rows)),
            kvg_b=kvg_b, q=self._weight(attn.q_proj.weight, lowrank=merged_lowrank(attn.q_proj)),
            q_b=None if attn.q_proj.bias is None else attn.q_proj.bias.detach(),
            q_norm=norm(getattr(attn, "q_norm", None)), k_norm=norm(getattr(attn, "k_norm", None)),
            o=self._weight(attn.o_proj.weight, lowrank=merged_lowrank(attn.o_proj)),
            ln2=layer.post_attention_layernorm.weight.detach(),
            gu=self._weight(torch.cat([mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()]),
                            lowrank=_stacked_lowrank([mlp.gate_proj, mlp.up_proj],
                                                     [mlp.gate_proj.weight, mlp.up_proj.weight])),
            down=self._weight(mlp.down_proj.weight, lowrank=merged_lowrank(mlp.down_proj)), gate=gate,
        )

    def _native_layers(self) -> list | None:
        """Per layer its :class:`fbs.native.NativeLayer`, or None where the per-op step must run it (Qwen3's per-head
        norms); None altogether for widths that are not a multiple of 16 or head dims it does not take."""
        spec, mod = self.spec, native.module()
        d, hd, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
        if (self.fmt == "int8" and any(n % native.INT8_CHUNK for n in (d, spec.num_heads * hd, inter))) or hd > 256 \
                or hd % 2:
            return None
        out = []
        for w in self.layers:
            if w.q_norm is not None or w.k_norm is not None:
                out.append(None)
                continue
            layer = mod.NativeLayer(d, spec.num_heads, spec.num_kv_heads, hd, inter, self.eps, self.base.scaling,
                                    w.ln1.contiguous(), w.kvg.native, _dense(w.kvg_b), w.q.native, _dense(w.q_b),
                                    w.o.native, w.ln2.contiguous(), w.gu.native, w.down.native)
            if w.gate is not None:
                w_rel, w_prev, out_w, out_b, eps = w.gate.native
                layer.set_gate(w.gate.index, *w.gate.cols, w_rel, w_prev, _dense(w.gate.rel_first), out_w, out_b, eps)
            out.append(layer)
        return out

    def _decode_layers(self, model) -> list | None:
        """:attr:`native_decode`: the native layers, PAW / CH layers given their modules (PAW where
        :func:`fbs.native.paw_weights` takes it); None when a PAW layer's module is one the kernel does not take."""
        ch_native, paw_native = set(), set()
        self._preview_rank = model.config.preview_rank
        terms = () if self._term_w is None else (self._term_w.contiguous(), self._term_b.contiguous())
        out = list(self.native_layers)
        for l, layer in enumerate(self._native_all):
            key = str(l)
            if layer is None or (key not in model.paw and key not in model.ch):
                continue
            if key in model.paw:
                args = self.paw_args[l]
                if args is None:
                    return None
                layer.set_paw(*args, *(terms or (None, None)))
                paw_native.add(l)
            if key in model.ch:
                head = model.ch[key]
                layer.set_chunk(*(t.detach().contiguous() for t in (head.bios.weight, head.bios.bias, head.key.weight,
                                                                     head.query.weight, head.out.weight)),
                                float(head.scale), LABEL_I)
                ch_native.add(l)
            out[l] = layer
        self._ch_native, self._paw_native = frozenset(ch_native), frozenset(paw_native)
        return out

    @property
    def native_chunk(self) -> bool:
        return self.native_layers is not None

    def run_layers(self, layers: range, step) -> None:
        """:meth:`LayerByLayer.run_layers`, with each run of consecutive layers in :attr:`native_layers` as one
        native call (:meth:`native_run`) when the step's decisions are ones the kernel makes
        (``step.hard_decisions``); the other layers one by one. A decode step's context (row-wise products, no chunk
        log: ``ctx.linear`` set, ``ctx.trail`` None) runs PAW and CH layers natively too (:attr:`native_decode`)."""
        if self.native_layers is None or not step.hard_decisions:
            return super().run_layers(layers, step)
        ctx = step.ctx
        table = self.span_table(ctx) if ctx.trail is None else self.native_layers  # one-token runs log no chunks
        for seg, whole in self._native_runs(layers, table):
            if not whole:
                super().run_layers(seg, step)
                continue
            gated = step.gated_in(seg)
            any_gated = any(gated)
            if any_gated:
                step.gate_inputs()
            out = self.native_run(seg, step.x, ctx, step.x_prev, step.prev_skip,
                                  step.zterms if any_gated else None, gated, step.forced_runs(seg, gated),
                                  step.thresholds, step.policy, step.write_skipped, table, step.zlow)
            step.ran(seg, gated, *out[:5], preview=None if table is self.native_layers else out[5:8])

    def _native_runs(self, layers: range, table: list | None = None) -> tuple[tuple[range, bool], ...]:
        """``layers`` cut into maximal runs of layers with (True) and without a native whole-layer step in ``table``
        (default :attr:`native_layers`), made once per range and table."""
        table = self.native_layers if table is None else table
        key = (id(table), layers.start, layers.stop)
        memo = self._runs_memo.get(key)
        if memo is None or memo[0] is not table:
            runs, l = [], layers.start
            while l < layers.stop:
                whole = table[l] is not None
                end = l + 1
                while end < layers.stop and (table[end] is not None) == whole:
                    end += 1
                runs.append((range(l, end), whole))
                l = end
            memo = self._runs_memo[key] = (table, tuple(runs))
        return memo[1]

    def native_run(self, layers: range, x, ctx, x_prev, prev_skip, zterms, gated: list[bool], runs: list[bool],
                   thresholds, policy: int, write_skipped: bool, table: list | None = None,
                   zlow: torch.Tensor | None = None):
        """Consecutive layers ``layers`` of a one-token step (each in :attr:`native_layers`) in one native call:
        per layer norm, K/V (+ gate), the decision, the cache writes, attention and FFN of the rows that run.
        A layer with ``gated[k]`` decides by the rows' logit ``thresholds`` under the batch ``policy`` (0 gather,
        1 all, 2 majority) with the step's preview terms ``zterms`` (:meth:`preview_terms`); the others run the rows
        flagged in ``runs`` (layer-major, b per layer; empty: every row). ``x_prev`` / ``prev_skip``: the previous
        layer's input (None: none) and (b, 1) skip indicator (None: no row skipped it). ``write_skipped``: rows that
        skip still write K/V (``project``). Books the cache entries written. ``table``: the native layers to run
        (default :attr:`native_layers`; :attr:`native_decode` with PAW / CH layers, which write the step's ``zlow``
        (b, 1, R) in place and advance ``ctx``'s chunk states). Returns (x', input of the last layer, logits, skip,
        run, the gate terms after a PAW layer or None, PAW's k and CH's boundary per layer and row), logits, skip and
        run flat lists (b per layer; logits NaN where no gate ran); x' is that input itself when no row ran the last
        layer."""
        table = self.native_layers if table is None else table
        lens = ctx.cache.lengths
        slots = [lens[l][r] for l in layers for r in ctx.rows]
        ps = [] if prev_skip is None else prev_skip.view(-1).tolist()
        chunks = [ctx.chunks[l] for l in layers if l in self._ch_native] if table is not self.native_layers else None
        out = native.run_layers([table[l] for l in layers], x, x_prev, ps,
                                None if zterms is None else zterms.flat, *self._rope_of(ctx),
                                ctx.cache.k[layers.start:layers.stop], ctx.cache.v[layers.start:layers.stop],
                                ctx.rows_t, slots, gated, runs, thresholds or [], policy, write_skipped,
                                self._scores_of(layers, ctx), ctx.cache.key_factor[layers.start:layers.stop],
                                zlow=None if zlow is None else zlow.view(zlow.shape[0], -1), chunks=chunks)
        ctx.book(layers, None if write_skipped else out[4])
        return out

    @staticmethod
    def _scores_of(layers: range, ctx) -> list | None:
        """The layers' accumulated attention buffers when the cache policy keeps them (H2O), else None."""
        if ctx.attention_scores(layers.start) is None:  # one look per call on the decode path
            return None
        return [ctx.attention_scores(l) for l in layers]

    def span_table(self, ctx) -> list:
        """The native layers a multi-token pass in ``ctx`` runs: :attr:`native_decode` (PAW / CH layers too) for a
        verifier's pass (row-wise context), else :attr:`native_layers` (a prefill keeps PAW / CH outside)."""
        return self.native_decode if self.native_decode is not None and ctx.linear is not None else self.native_layers

    def native_span(self, layers: range, x: torch.Tensor, ctx, table: list | None = None,
                    on_layer=None) -> torch.Tensor:
        """Consecutive layers ``layers`` (each in ``table``, default :attr:`native_layers`) at full depth over T new
        tokens per row, x (b, T, d), in one native call: the b * T positions are the call's rows, each sequence's
        positions consecutive and sharing its cache row, so each position attends over its row's cache and the
        positions before it (the kernel gives them consecutive slots). Writes and books every position's K/V;
        returns x' (b, T, d). What a speculative verifier and a prefill run. With :attr:`native_decode` (a verifier's
        pass) PAW and CH layers run inside the call: CH steps each sequence's positions in order, its state after
        each one appended to ``ctx.trail`` when the pass logs; ``on_layer`` sees the first PAW / CH layer's k and
        boundaries, (b, T) each, as :func:`full_depth` shows them for the per-op layers."""
        table = self.native_layers if table is None else table
        b, t, d = x.shape
        lens = ctx.cache.lengths
        slots = [lens[l][r] for l in layers for r in ctx.rows for _ in range(t)]
        idx = ctx.rows_t.repeat_interleave(t) if t > 1 else ctx.rows_t
        cos, sin = self._rope_of(ctx)
        extras = table is not self.native_layers
        ch = [l for l in layers if l in self._ch_native] if extras else []
        paw = [l for l in layers if l in self._paw_native] if extras else []
        trail = bool(ch) and ctx.trail is not None
        out = native.run_layers([table[l] for l in layers], x.reshape(b * t, 1, d).contiguous(), None,
                                [], None, cos.contiguous(), sin.contiguous(), ctx.cache.k[layers.start:layers.stop],
                                ctx.cache.v[layers.start:layers.stop], idx, slots, [False] * len(layers), [], [], 0,
                                False, kfs=ctx.cache.key_factor[layers.start:layers.stop],
                                zlow=x.new_zeros(b * t, self._preview_rank) if paw else None,
                                chunks=[ctx.chunks[l] for l in ch], trail=trail)
        ctx.book(layers, None)
        if trail:
            for k, l in enumerate(ch):
                after = ChunkState.__new__(ChunkState)  # the state after each of the b * t positions
                after.closed, after.n_closed, after.open_sum, after.open_count = out[8][4 * k:4 * k + 4]
                ctx.trail.setdefault(l, []).extend(after.select(torch.arange(j, b * t, t)) for j in range(t))
        if on_layer is not None and (paw or ch):
            for l in layers:
                if l in paw or l in ch:
                    k = (l - layers.start) * b * t
                    ks = torch.tensor(out[6][k:k + b * t]).view(b, t)
                    bounds = torch.tensor(out[7][k:k + b * t]).view(b, t) > 0
                    on_layer(l, LayerOut(None, None, PreviewOut(None, None, None, None, ks, None) if l in paw else None,
                                         ChunkOut(None, None, bounds, None, None) if l in ch else None))
        return out[0].view(b, t, d)

    def _weight(self, w: torch.Tensor, head: bool = False, lowrank=None) -> Weight:
        kind = BLOCK_FORMATS[self.fmt][1] if head and self.fmt in BLOCK_FORMATS else None
        return Weight(w, self.fmt, packed=self.native_packed, kind=kind, lowrank=lowrank)

    def _gate(self, l: int, fg) -> _Gate:
        detach = lambda t: None if t is None else t.detach()  # noqa: E731
        w_rel, w_prev = detach(fg.w_rel.get(l)), detach(fg.w_prev.get(l))
        one = torch.ones((), dtype=self.dtype, device=self.base.embedding_weight.device)
        rel = lambda u: None if w_rel is None else torch.log(u + 1e-3) * w_rel  # noqa: E731  (the step's arithmetic)
        step = (w_rel, w_prev, fg.out_w[l].detach()[0], fg.out_b[l].detach(), torch.full_like(one, 1e-3))
        a = fg.a[l][0]
        cols = (2 * self.spec.num_kv_heads * self.spec.head_dim, 0 if a is None else a.shape[0])
        return _Gate(self.gated.index(l), step, native.gate_args(step), cols, rel(one), rel(one * 0))

    # ---- whole-model pieces ---------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.emb)

    def rope(self, x: torch.Tensor, positions: torch.Tensor):
        return self.base.rope(x, positions)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] != 1:  # many positions: the decode format's head where the native step runs (a verifier's
            if self.native_packed:  # logits are then decoding's), else the HF modules'
                return self._head_fn(x.contiguous(), self.norm_w, *self.head_w.tensors, **self._k_head)
            return self.hf.head(x)
        x = x.clone(memory_format=torch.contiguous_format)  # a prefill's last position: the decode's strides
        return self._head_fn(x, self.norm_w, *self.head_w.tensors, **self._k_head)

    def lm_head(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head alone over already-normed states x (..., d), in the decode format (its native product where
        the format has one): for a draft that runs the head on states of its own (Medusa's heads, EAGLE's layer) at
        the format's bytes instead of the fp32 head's."""
        return matmul(x.contiguous(), *self.head_w.tensors)

    def lm_head_rows(self, ids: torch.Tensor):
        """:meth:`lm_head` restricted to the tokens ``ids``: their rows of the head in the decode format (made once
        per call of this method; per-row formats give each row the full head's values), as a function of x."""
        w = self._weight(self.base.lm_head.weight.detach()[ids.to(self.emb.device)], head=True)
        return lambda x: matmul(x.contiguous(), *w.tensors)

    def preview_terms(self, zlow: torch.Tensor | None, rows: int) -> tuple[torch.Tensor, ...]:
        """Per gated layer, the (rows, 1, G) part of its gate's hidden pre-activation that does not depend on the
        layer's input: hidden bias + preview term of ``zlow`` (rows, 1, R), all layers in one matmul; ``zlow`` None
        stands for a zero preview summary (no PAW layer ran yet): the biases alone, built once per row count."""
        if self._term_b is None:
            return ()
        if zlow is None or self._term_w is None:
            terms = self._zero_terms.get(rows)
            if terms is None:
                terms = self._zero_terms[rows] = _Terms(self._term_b.expand(rows, 1, -1).contiguous(), self._gate_width)
            return terms
        return _Terms(F.linear(zlow, self._term_w, self._term_b), self._gate_width)

    def terms_of(self, flat: torch.Tensor):
        """The per-gate view of terms (b, 1, n * G) made elsewhere (a native run after a PAW layer)."""
        return _Terms(flat, self._gate_width)

    # ---- one layer ------------------------------------------------------------
    def _one_token(self, x: torch.Tensor, ctx) -> bool:
        return x.shape[1] == 1 and isinstance(ctx, CacheContext)

    def norm1(self, l: int, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm_1 of any number of positions: natively in the native formats (row by row, as the native layers
        and one-token steps compute it, so that a verified position's norm is its decoded one's)."""
        return _rms(x, self.layers[l].ln1, self.eps, self._k_pre["native_step"])

    def attends_natively(self, l: int) -> bool:
        """One-token attention and FFN of layer l run as the two native halves of its :class:`fbs.native.NativeLayer`
        (:meth:`_cached`, with the K/V of :meth:`pre` when it ran): the engine skips ``pre`` for it when nothing
        needs it before the layer (no gate, every row runs)."""
        return self._native_all is not None and self._native_all[l] is not None

    def pre(self, l: int, x, ctx, x_prev, zterms, prev_skip, gated: bool) -> Pre:
        """One-token steps: RMSNorm_1, K/V and (``gated``) the gate logit in one function, from one matmul.
        ``zterms``: :meth:`preview_terms` of the step; ``x_prev``: the previous layer's input (None: none), ``x``
        itself when every row skipped that layer; ``prev_skip`` (b, 1) 1.0 where it was skipped, or None."""
        w = self.layers[l]
        gate = w.gate if gated else None
        terms, xp, rel, ps = _gate_inputs(gate, x, x_prev, zterms, prev_skip)
        fast = gate is not None and self.native_gates  # the gate's ops in one native call (fbs.native)
        xn, k, v, out = self._pre_fn(x, xp, terms, rel, ps, *self._rope_of(ctx), w.ln1, *w.kvg.tensors, w.kvg_b,
                                     w.k_norm, None if gate is None or fast else gate.step, **self._k_pre)
        if fast:
            return Pre(xn, (k, v), native.gate_logits(out, *gate.cols, terms, x, xp, rel, ps, gate.native))
        return Pre(xn, (k, v), None if gate is None else out)

    def kv(self, l: int, xn: torch.Tensor, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        if xn.shape[1] != 1:
            return self.hf.kv(l, xn, ctx)
        w, n, hd = self.layers[l], self.spec.num_kv_heads, self.spec.head_dim
        y = _linear(xn, *w.kvg.tensors, w.kvg_b)
        k = _rope(_heads(y[..., :n * hd], n, hd, w.k_norm, self.eps), *self._rope_of(ctx))
        return k, _heads(y[..., n * hd:2 * n * hd], n, hd, None, self.eps)

    def _cached(self, l, x, xn, ctx, kv, ffn: bool) -> torch.Tensor:
        w = self.layers[l]
        rope = self._rope_of(ctx)
        scores = ctx.attention_scores(l)  # a cache policy that reads the attention weights (H2O) gets them added
        if self.attends_natively(l):  # the native halves (a PAW / CH layer, or a cache policy's per-layer step)
            layer = self._native_all[l]
            xn = self.norm1(l, x) if xn is None else xn
            kc, vc, slots, rows = ctx.decode_slots(l)
            idx, _ = self._slots(slots, rows, kc.shape[2])
            h = native.attend_layer(layer, x, xn.contiguous(), *rope, kc, vc, idx, slots, kv, scores,
                                    kf=ctx.cache.key_factor[l])
            ctx.settle(l)
            return native.ffn_layer(layer, h) if ffn else h
        if kv is None:
            xn2, k, v, _ = self._pre_fn(x, None, None, None, None, *rope, w.ln1, *w.kvg.tensors,
                                        w.kvg_b, w.k_norm, None, **self._k_pre)
            xn = xn2 if xn is None else xn
        else:
            k, v = kv
        kc, vc, slots, rows = ctx.decode_slots(l)
        idx, valid = self._slots(slots, rows, kc.shape[2])
        out = self._block_fn(x, xn, k, v, *rope, kc, vc, slots, idx, valid, rows, *w.q.tensors, w.q_b, w.q_norm,
                             *w.o.tensors, w.ln2, *w.gu.tensors, *w.down.tensors, ffn=ffn, scores=scores,
                             kf=ctx.cache.key_factor[l], **self._k_block)
        ctx.settle(l)  # the cache policy evicts once the step's entry is written and attended
        return out

    def _rope_of(self, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`_rope_tables` of the step's ``ctx.cos`` / ``ctx.sin``, made on its first layer (memo by identity:
        a step's context keeps its tables)."""
        if self._rope_memo[0] is not ctx.cos:
            self._rope_memo = (ctx.cos, _rope_tables(ctx.cos, ctx.sin))
        return self._rope_memo[1]

    def _slots(self, slots: torch.Tensor, rows: torch.Tensor | None, capacity: int):
        """The cache rows (b,) and the attention mask (b, 1, 1, C) of the slots ``slots`` (b,), made once per
        distinct slot tensor (:meth:`fbs.engine.cache.CacheContext.decode_slots` returns one per step and slot list)."""
        key = (slots, rows, capacity)
        memo = self._slot_memo
        if memo[0] is not slots or memo[1] is not rows or memo[2] != capacity:
            idx = torch.arange(slots.shape[0], device=slots.device) if rows is None else rows
            valid = torch.arange(capacity, device=slots.device).unsqueeze(0) <= slots.unsqueeze(1)  # (b, C)
            memo = self._slot_memo = (*key, idx, valid[:, None, None, :])
        return memo[3], memo[4]

    def _many_native(self, l: int, x: torch.Tensor, ctx, hole, kv) -> bool:
        """Several new tokens per row after the cache (a verified draft, a prompt) through layer l's native halves."""
        return x.shape[1] > 1 and hole is None and kv is None and isinstance(ctx, CacheContext) \
            and ctx.native_many and self.attends_natively(l)

    def _cached_many(self, l: int, x: torch.Tensor, xn, ctx, ffn: bool) -> torch.Tensor:
        """Layer l's native halves over x (b, T, d): the b * T positions as rows, each sequence's positions at
        consecutive slots of its cache row, each attending over its row's cache up to itself (a token tree's node:
        up to its ancestors and itself, ``ctx.tree_bits``)."""
        b, t, d = x.shape
        layer = self._native_all[l]
        xn = self.norm1(l, x) if xn is None else xn
        starts = ctx.cache.advance(l, ctx.rows, ctx.positions)
        slots = torch.tensor([s + j for s in starts for j in range(t)], device=x.device)
        cos, sin = self._rope_of(ctx)
        bits = getattr(ctx, "tree_bits", None)
        tree = None if bits is None else (bits, torch.tensor(starts, device=x.device).repeat_interleave(t))
        h = native.attend_layer(layer, x.reshape(b * t, 1, d).contiguous(), xn.reshape(b * t, 1, d).contiguous(),
                                cos.contiguous(), sin.contiguous(), ctx.cache.k[l], ctx.cache.v[l],
                                ctx.rows_t.repeat_interleave(t), slots, tree=tree, kf=ctx.cache.key_factor[l])
        if not ffn:  # the layer's FFN (after PAW / CH) runs natively too, whatever its caller passes
            self._many_attended = l
            return h.view(b, t, d)
        return native.ffn_layer(layer, h).view(b, t, d)

    def attention(self, l: int, x, xn, ctx, hole=None, kv=None) -> torch.Tensor:
        if self._one_token(x, ctx):
            return self._cached(l, x, xn, ctx, kv, ffn=False)
        if self._many_native(l, x, ctx, hole, kv):
            return self._cached_many(l, x, xn, ctx, ffn=False)
        return self.hf.attention(l, x, xn, ctx, hole, kv)

    def ffn(self, l: int, h: torch.Tensor) -> torch.Tensor:
        many, self._many_attended = self._many_attended == l, None
        if self.attends_natively(l) and (h.shape[1] == 1 or many):  # rows of the native FFN half
            return native.ffn_layer(self._native_all[l], h.contiguous())
        if h.shape[1] != 1:
            return self.hf.ffn(l, h)
        w = self.layers[l]
        return self._ffn_fn(h, w.ln2, *w.gu.tensors, *w.down.tensors, **self._k_ffn)

    def ffn_delta(self, l: int, h: torch.Tensor) -> torch.Tensor:
        return self.ffn(l, h) - h

    def native_ffn(self, l: int, h: torch.Tensor) -> torch.Tensor | None:
        """Layer l's FFN over h (b, T, d), any T, through its native half (a decode step's arithmetic, row by row),
        or None where layer l has none (:meth:`attends_natively`)."""
        return native.ffn_layer(self._native_all[l], h.contiguous()) if self.attends_natively(l) else None

    def block(self, l: int, x, xn, ctx, kv=None) -> torch.Tensor:
        if self._one_token(x, ctx):
            return self._cached(l, x, xn, ctx, kv, ffn=True)
        if self._many_native(l, x, ctx, None, kv):
            return self._cached_many(l, x, xn, ctx, ffn=True)
        return self.hf.block(l, x, xn, ctx, kv)
