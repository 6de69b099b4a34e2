"""The one cost model of the engine and the benchmark: multiply-accumulates and bytes read (DESIGN.md §5).

Everything is counted from what actually ran, never from intended decisions, and over the **decode** only
(tokens at positions >= the prompt length; the prompt's forward is the same for every system). Under
``skip_granularity="ffn"`` a skipped pair still runs its attention (projections, keys, K/V write, PAW, CH):
only the FFN is saved, and the paper's estimate counts such a pair as its attention's share of a layer.

* ``tflops_rel`` — the paper's estimate: executed layer invocations x per-layer FLOPs, normalized by the
  full model (all per-layer FLOPs equal, so it is the share of (token, layer) pairs executed).
* ``tflops_rel_exact`` — multiply-accumulates of everything that ran: per executed layer its projections,
  FFN and the attention term over the keys actually in its cache (holes shrink it); the K/V projections
  written for skipped layers under ``project``; the LM head; PAW, CH and SG overhead. Normalized by the
  base model computing every layer for the same tokens with no FBS modules.
* ``bytes_rel`` — bytes a decode reads, by weight format (:data:`WEIGHT_FORMATS`): the weights of every layer
  that ran (once per step for the whole batch), the K/V projection weights of layers that only projected,
  the LM head, the K/V cache each row attends to, and the FBS modules' parameters. Normalized by the base
  model at full depth. Decoding small models on a CPU is bandwidth-bound, so ``1 - bytes_rel`` of a skipping
  run over a full-depth run is the saving the skipped bytes predict.

Public entry points:
    WeightFormat, WEIGHT_FORMATS          bytes per stored weight: fp32, bf16, int8 (+ per-channel scales)
    LayerCost.of(spec) / .from_config(c)  per-token MACs and weight bytes of one decoder layer and the LM head
    layer_macs(cost, executed, kv_written, start)        MACs of the decoder layers of a decode, from its masks
    skip_trace_macs(cost, executed, prompt_len, policy)  (invocations, MACs) of a layer-skipping decode
    baseline_decode_macs(cost, prompt_len, new_tokens)   (invocations, MACs) of plain greedy decoding
    step_bytes(cost, context, executed_layers, ...)      bytes one decode step reads (roofline, predictions)
    predicted_saving(cost, context, skipped_layers, ...) share of a step's bytes that skipping removes
    FlopCounter(model)                    .relative(trace) -> (tflops_rel, tflops_rel_exact); .counts(trace) -> the
                                          absolute DecodeMacs behind them (speculative decoding sums its passes);
                                          .bytes_relative(trace, weights) -> bytes_rel
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from ..model.hf_adapter import DecoderSpec, decoder_spec
from .quant import KV_SCALE_BYTES


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    """How one decoder's weights are stored, in bytes.

    Matrices cost ``weight`` bytes per element plus ``scale`` bytes per output channel (per-channel
    quantization scales); norm weights, biases, the K/V cache and the FBS modules are kept in the activation
    dtype (``activation`` bytes per element). The engine keeps those in the model's dtype whatever the weight
    format (:mod:`fbs.engine.quant`), fp32 for the shipped models; only the products' inputs are rounded to bf16 for the
    bf16 format and for int8 without the native kernel, which no bytes read depend on.
    """

    name: str
    weight: float
    scale: float
    activation: int
    head: str | None = None  # the LM head's format when it differs (the 4-bit format keeps an 8-bit head)


WEIGHT_FORMATS: dict[str, WeightFormat] = {
    "fp32": WeightFormat("fp32", weight=4, scale=0, activation=4),
    "bf16": WeightFormat("bf16", weight=2, scale=0, activation=4),
    "int8": WeightFormat("int8", weight=1, scale=2, activation=4),
    # block formats: an fp16 scale (and, for q4, an fp16 min) per 32 weights, counted in the weight's bytes
    "q8": WeightFormat("q8", weight=1 + 2 / 32, scale=0, activation=4),
    "q4": WeightFormat("q4", weight=0.5 + 4 / 32, scale=0, activation=4, head="q8"),
    "fp32-onednn": WeightFormat("fp32-onednn", weight=4, scale=0, activation=4),
}


def weight_format(weights: str | WeightFormat) -> WeightFormat:
    if isinstance(weights, WeightFormat):
        return weights
    try:
        return WEIGHT_FORMATS[weights]
    except KeyError:
        raise ValueError(f"unknown weight format {weights!r}; choose from {', '.join(WEIGHT_FORMATS)}") from None


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """Per-token cost of one decoder layer (GQA attention + SwiGLU FFN) and of the LM head.

    A matrix-vector product does one MAC per weight, so the MAC counts are also the matrices' element counts.
    """

    num_layers: int
    hidden_size: int
    attn_proj: int   # q, k, v, o projections (MACs = weights)
    kv_proj: int     # k and v projections only: what ``project`` runs for a skipped layer
    ffn: int         # gate, up, down
    per_key: int     # QK^T and AV per attended key, summed over query heads
    lm_head: int     # hidden -> vocabulary
    layer_rows: int  # output channels of the layer's matrices (one quantization scale each)
    attn_rows: int   # output channels of q, k, v, o
    kv_rows: int     # output channels of k and v
    layer_vectors: int  # norm weights and biases of one layer
    attn_vectors: int   # what attention alone reads besides its matrices: input norm, biases, q/k norms
    kv_vectors: int     # what a K/V-only projection reads besides its matrices: input norm, k/v biases, k-norm
    kv_width: int       # K and V values cached per token and layer: 2 * h_kv * d_head
    vocab_size: int
    kv_entries: int = 0  # K and V entries (one per KV head each) cached per token and layer: 2 * h_kv

    @classmethod
    def of(cls, spec: DecoderSpec) -> "LayerCost":
        d, hd, h, hkv, f = spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads, spec.intermediate_size
        q_o, kv = 2 * d * h * hd, 2 * d * hkv * hd
        bias_kv = 2 * hkv * hd if spec.attn_bias else 0
        bias = h * hd + bias_kv if spec.attn_bias else 0          # q, k, v biases (Qwen2)
        qk_norm = 2 * hd if spec.qk_norm else 0                   # per-head q and k RMSNorm weights (Qwen3)
        return cls(
            num_layers=spec.num_layers, hidden_size=d,
            attn_proj=q_o + kv, kv_proj=kv, ffn=3 * d * f, per_key=2 * h * hd, lm_head=d * spec.vocab_size,
            layer_rows=h * hd + 2 * hkv * hd + d + 2 * f + d,  # q, k, v, o, gate, up, down
            attn_rows=h * hd + 2 * hkv * hd + d,
            kv_rows=2 * hkv * hd,
            layer_vectors=2 * d + bias + qk_norm,
            attn_vectors=d + bias + qk_norm,
            kv_vectors=d + bias_kv + qk_norm // 2,
            kv_width=2 * hkv * hd, vocab_size=spec.vocab_size, kv_entries=2 * hkv,
        )

    @classmethod
    def from_config(cls, hf_config) -> "LayerCost":
        """From an HF config (the benchmark prices HF models and their drafts with it)."""
        return cls.of(decoder_spec(hf_config))

    # ---- MACs ----------------------------------------------------------------
    @property
    def dense(self) -> int:
        """Context-independent MACs of one layer for one token."""
        return self.attn_proj + self.ffn

    def layer_macs(self, ctx_len: int) -> int:
        """MACs of one layer for one token attending ``ctx_len`` keys (itself included)."""
        return self.dense + self.per_key * ctx_len

    def counted_macs(self, tokens_per_layer, keys_per_layer, lm_rows: int) -> int:
        """MACs of counted layer calls: per layer the tokens it processed and the keys they attended, and the
        LM-head rows (e.g. :class:`fbs.model.hf_adapter.DecodeCallCounter` around an HF ``generate``)."""
        layers = sum(t * self.dense + k * self.per_key for t, k in zip(tokens_per_layer, keys_per_layer))
        return layers + lm_rows * self.lm_head

    # ---- bytes ---------------------------------------------------------------
    def layer_bytes(self, weights: str | WeightFormat = "fp32") -> float:
        """Weight bytes one executed layer reads per step (matrices, scales, norms, biases)."""
        return _bytes(weights, self.dense, self.layer_rows, self.layer_vectors)

    def attn_bytes(self, weights: str | WeightFormat = "fp32") -> float:
        """Weight bytes of a layer whose FFN is skipped (``skip_granularity="ffn"``): its attention only."""
        return _bytes(weights, self.attn_proj, self.attn_rows, self.attn_vectors)

    def kv_proj_bytes(self, weights: str | WeightFormat = "fp32") -> float:
        """Weight bytes of a layer that only projects K/V (``project`` policy, layer skipped)."""
        return _bytes(weights, self.kv_proj, self.kv_rows, self.kv_vectors)

    def lm_head_bytes(self, weights: str | WeightFormat = "fp32") -> float:
        """Final norm and LM head."""
        fmt = weight_format(weights)
        return _bytes(fmt.head or fmt, self.lm_head, self.vocab_size, self.hidden_size)

    def kv_bytes_per_key(self, weights: str | WeightFormat = "fp32", kv_dtype: str | None = None) -> int:
        """Bytes of one cached token's K and V in one layer: stored in the activation dtype, in half precision when
        ``kv_dtype`` is fp16 / bf16, or as int8 codes plus one fp32 scale per entry (:func:`fbs.engine.quant.kv_store`)
        when it is int8 (the engine's ``kv_dtype``; fp32 or None: the activation dtype)."""
        if kv_dtype == "int8":
            return self.kv_width + KV_SCALE_BYTES * self.kv_entries
        return self.kv_width * (2 if kv_dtype in ("fp16", "bf16") else weight_format(weights).activation)


# --------------------------------------------------------------------------- MACs of a decode


def _keys_seen(kv_written: torch.Tensor, start: torch.Tensor | int) -> torch.Tensor:
    """(B, S, L) keys a token attends at each layer: the ``start`` cached entries (the prompt), the entries
    earlier decode steps wrote in that layer, and itself."""
    kw = kv_written.long()
    start = torch.as_tensor(start).reshape(-1, 1, 1) if torch.is_tensor(start) else start
    return start + torch.cumsum(kw, dim=1) - kw + 1


def layer_macs(cost: LayerCost, executed: torch.Tensor, kv_written: torch.Tensor,
               start: torch.Tensor | int, attention_only: torch.Tensor | None = None) -> int:
    """MACs of the decoder layers over consecutive decode steps.

    ``executed`` / ``kv_written``: (B, S, L) bool; ``start``: int or (B,), the position of step 0 (the number
    of entries every layer holds before it). An executed layer costs its dense MACs plus ``per_key`` per key
    in its cache (itself included); ``attention_only`` pairs (FFN skipped) cost the attention projections and
    the keys; any other layer that wrote K/V costs its K/V projection.
    """
    ex, kw = executed.bool(), kv_written.bool()
    att = torch.zeros_like(ex) if attention_only is None else attention_only.bool() & ~ex
    keys = _keys_seen(kw, start)
    macs = int(ex.sum()) * cost.dense + int(att.sum()) * cost.attn_proj + int((keys * (ex | att)).sum()) * cost.per_key
    return macs + int((kw & ~ex & ~att).sum()) * cost.kv_proj


def skip_trace_macs(cost: LayerCost, executed: torch.Tensor, prompt_len: int, kv_policy: str = "project",
                    overhead_macs_per_token: float = 0.0) -> tuple[int, int]:
    """(executed layer invocations, MACs) of a layer-skipping decode from its (B, S, L) executed mask.

    Step s of every row is the token at position ``prompt_len + s``. Under ``hole`` a skipped layer writes no
    K/V, so later tokens of that layer attend fewer keys; under ``project`` it still computes and stores K/V.
    Each step also runs the LM head and ``overhead_macs_per_token``.
    """
    if kv_policy not in ("hole", "project"):
        raise ValueError(f"kv_policy must be 'hole' or 'project', got {kv_policy!r}")
    ex = executed.bool()
    B, S, _ = ex.shape
    written = ex if kv_policy == "hole" else torch.ones_like(ex)
    macs = layer_macs(cost, ex, written, prompt_len) + B * S * (cost.lm_head + overhead_macs_per_token)
    return int(ex.sum()), int(macs)


def baseline_decode_macs(cost: LayerCost, prompt_len: int, new_tokens: int, batch: int = 1) -> tuple[int, int]:
    """(layer invocations, MACs) of plain greedy decoding after the prompt's forward.

    Tokens at positions prompt_len .. prompt_len+new_tokens-2 are fed back (the last generated token is never
    fed), each attends position+1 keys in every layer and produces one LM-head row.
    """
    steps = max(new_tokens - 1, 0)
    keys = sum(prompt_len + i + 1 for i in range(steps))
    invocations = steps * cost.num_layers * batch
    macs = batch * (steps * (cost.num_layers * cost.dense + cost.lm_head) + cost.num_layers * cost.per_key * keys)
    return invocations, macs


# --------------------------------------------------------------------------- bytes of a decode step


def step_bytes(cost: LayerCost, context: float, executed_layers: float | None = None, kv_policy: str = "project",
               batch: int = 1, weights: str | WeightFormat = "fp32", kv_dtype: str | None = None) -> float:
    """Bytes one decode step of ``batch`` rows reads at ``context`` cached keys when ``executed_layers`` of the
    layers run (default all; a mean is fine): their weights once for the batch, the LM head, per row their
    K/V cache (in ``kv_dtype``'s storage, :meth:`LayerCost.kv_bytes_per_key`), and under ``project`` the K/V
    projection weights of the skipped layers. The embedding row is negligible and ignored."""
    L = cost.num_layers
    run = L if executed_layers is None else executed_layers
    total = run * cost.layer_bytes(weights) + cost.lm_head_bytes(weights)
    total += batch * run * context * cost.kv_bytes_per_key(weights, kv_dtype)
    if kv_policy == "project":
        total += (L - run) * cost.kv_proj_bytes(weights)
    return total


def predicted_saving(cost: LayerCost, context: float, skipped_layers: float, kv_policy: str = "project",
                     batch: int = 1, weights: str | WeightFormat = "fp32") -> float:
    """Share of a full-depth decode step's bytes that skipping ``skipped_layers`` layers removes: the decode
    time saving a bandwidth-bound step should show."""
    full = step_bytes(cost, context, None, kv_policy, batch, weights)
    run = cost.num_layers - skipped_layers
    return 1.0 - step_bytes(cost, context, run, kv_policy, batch, weights) / full


# --------------------------------------------------------------------------- the engine's counter


def _attention_only(trace, executed: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(B, N, L) pairs whose FFN was skipped while attention (and PAW, CH, K/V) ran: every valid non-executed
    pair under ``skip_granularity="ffn"``, none otherwise."""
    if getattr(trace, "skip_granularity", "layer") == "ffn":
        return valid.expand_as(executed) & ~executed
    return torch.zeros_like(executed)


class DecodeMacs(NamedTuple):
    """Absolute work of a trace's valid (token, layer) pairs (see :meth:`FlopCounter.counts`)."""

    invocations: float  # executed layer invocations (an FFN-only skip counts as its attention's share)
    layers: int         # MACs of the decoder layers: projections, FFN, attention over the cache, K/V projections
    overhead: float     # MACs of PAW, CH and SG
    tokens: int         # valid tokens (one LM-head row each)
    baseline: int       # MACs of the base model computing every layer (and the LM head) for the same tokens


class FlopCounter:
    """TFLOPs(rel) and bytes(rel) of a :class:`fbs.engine.DecodeTrace` for one FBS model."""

    def __init__(self, model):
        spec = model.base.spec
        self.spec, self.cost = spec, LayerCost.of(spec)
        cfg = model.config
        gated = model.layers_cfg.gated
        self.gate_macs = model.gates.macs(spec.hidden_size) if gated else 0
        self.paw_layers = model.layers_cfg.paw
        self.ch_layers = model.layers_cfg.ch
        self._paw = {l: model.paw[str(l)] for l in self.paw_layers}
        self._ch_macs = {l: model.ch[str(l)].macs(spec.hidden_size, cfg.chunk_rank) for l in self.ch_layers}
        self._paw_args = (spec.hidden_size, cfg.preview_vocab_size + 1, cfg.preview_rank)
        # parameters read when a module runs (bytes(rel)); PAW's preview-vocabulary tables are not counted
        count = lambda mod: sum(p.numel() for p in mod.parameters())  # noqa: E731
        g = model.gates
        self._gate_params = {l: count(g.hidden[str(l)]) + count(g.out[str(l)]) for l in gated}
        self._gate_shared = count(g.resid_proj) if getattr(g, "resid_proj", None) is not None else 0
        self._paw_params = {l: count(model.paw[str(l)]) for l in self.paw_layers}
        self._ch_params = {l: count(model.ch[str(l)]) for l in self.ch_layers}

    def relative(self, trace) -> tuple[float, float]:
        """(tflops_rel, tflops_rel_exact) over the trace's generated tokens."""
        n = self.counts(trace)
        if n.tokens == 0:
            return 0.0, 0.0
        executed = n.layers + n.overhead + n.tokens * self.cost.lm_head
        return n.invocations / (n.tokens * self.spec.num_layers), executed / n.baseline

    def counts(self, trace) -> DecodeMacs:
        """The work behind :meth:`relative`. Each row's step s attends the ``context_len[:, 0]`` entries every layer
        held before its first step plus what its earlier steps wrote (``kv_written``)."""
        valid = trace.valid                                        # (B, N)
        n_tok = int(valid.sum())
        if n_tok == 0:
            return DecodeMacs(0.0, 0, 0.0, 0, 0)
        L, c = self.spec.num_layers, self.cost
        v3 = valid.unsqueeze(-1)
        ex = trace.executed & v3                                   # (B, N, L)
        att = _attention_only(trace, ex, v3)                       # FFN skipped, attention ran
        invocations = ex.sum().item() + att.sum().item() * c.attn_proj / c.dense
        start = trace.context_len[:, 0]                            # (B,): position of the first decoded token
        macs = layer_macs(c, ex, trace.kv_written & v3, start, att)
        ex = ex | att                                              # PAW and CH run unless the whole layer is skipped
        gates = (~torch.isnan(trace.gate_p) & v3).sum().item() * self.gate_macs
        overhead = gates
        for l in self.paw_layers:
            k = trace.window_k.clamp_min(0)
            for kv, cnt in zip(*torch.unique(k[ex[..., l]], return_counts=True)):
                overhead += cnt.item() * self._paw[l].macs(int(kv), *self._paw_args)
        for l in self.ch_layers:
            overhead += ex[..., l].sum().item() * self._ch_macs[l]
        full_keys = (trace.context_len + 1) * valid                # base model: every earlier token is a key
        baseline = n_tok * (L * c.dense + c.lm_head) + (c.per_key * L * full_keys).sum().item()
        return DecodeMacs(invocations, macs, overhead, n_tok, baseline)

    def bytes_relative(self, trace, weights: str | WeightFormat = "fp32") -> float:
        """Bytes the decode read over what the base model reads at full depth for the same steps.

        Per step, a layer's weights are read once if any row ran it (its attention weights only if rows
        skipped just the FFN, its K/V projection weights only if rows just projected), the LM head once, each
        row's K/V cache per layer whose attention ran, and the parameters of the FBS modules that ran (gates
        evaluated, PAW and CH layers run)."""
        valid = trace.valid.bool()                                 # (B, N)
        if not bool(valid.any()):
            return 0.0
        c, fmt = self.cost, weight_format(weights)
        v3 = valid.unsqueeze(-1)
        ex = trace.executed.bool() & v3                            # (B, N, L)
        att = _attention_only(trace, ex, v3)
        kw = trace.kv_written.bool() & v3
        ran = ex.any(0)                                            # (N, L): some row ran the layer
        attended = att.any(0) & ~ran                               # some row ran its attention only
        projected = (kw & ~ex & ~att).any(0) & ~ran & ~attended
        steps = int(valid.any(0).sum())
        keys = _keys_seen(kw, trace.context_len[:, 0])
        read = (int(ran.sum()) * c.layer_bytes(fmt) + int(attended.sum()) * c.attn_bytes(fmt)
                + int(projected.sum()) * c.kv_proj_bytes(fmt) + steps * c.lm_head_bytes(fmt)
                + int((keys * (ex | att)).sum()) * c.kv_bytes_per_key(fmt))
        ran = ran | att.any(0)                                     # PAW and CH run unless the whole layer is skipped
        evaluated = (~torch.isnan(trace.gate_p) & v3).any(0)       # (N, L)
        params = sum(int(evaluated[:, l].sum()) * n for l, n in self._gate_params.items())
        params += int(evaluated.any(1).sum()) * self._gate_shared
        params += sum(int(ran[:, l].sum()) * n for l, n in self._paw_params.items())
        params += sum(int(ran[:, l].sum()) * n for l, n in self._ch_params.items())
        read += params * fmt.activation
        full_keys = int(((trace.context_len + 1) * valid).sum())
        baseline = (steps * (self.spec.num_layers * c.layer_bytes(fmt) + c.lm_head_bytes(fmt))
                    + full_keys * self.spec.num_layers * c.kv_bytes_per_key(fmt))
        return read / baseline


def _bytes(weights: str | WeightFormat, matrix: int, rows: int, vectors: int) -> float:
    """Bytes of ``matrix`` weight entries with one scale per output row, plus ``vectors`` unquantized entries."""
    w = weight_format(weights)
    return matrix * w.weight + rows * w.scale + vectors * w.activation
