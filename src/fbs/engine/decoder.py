"""Decoding engine: prefill with every layer, then one token per step with true layer skipping.

For the newest token of each row, before layer l runs, the skip gate gives p; the layer is skipped when
p > tau (or by a forced plan, or by Bernoulli sampling). A skipped layer runs none of its attention,
FFN, PAW or CH for that token; under the ``project`` KV policy it still writes the token's K/V (and chunk
cache entry), computed from the unchanged state, so later tokens see what training showed them.

Batches: rows disagree about skipping. ``batch_policy="gather"`` runs a layer only for the rows that
compute; ``"all"`` runs it for every row unless all rows skip; ``"majority"`` skips it for every row when
more than half the rows skip it, else runs it for every row. The trace records intended skips (what the
gates said) and executed ones (what ran).

Each layer is one :func:`fbs.model.layer.layer_step`, the same step the parallel forward runs, over the engine's
KV-cache context. The linear algebra (``weights=``) is either the HF modules themselves (``"hf"``, the
reference: forward hooks see every call) or fused inference copies of the same weights built once per model
and weight format (:mod:`fbs.engine.fused`: fp32, bf16 or int8 weight-only), optionally compiled (``compile=True``:
one compiled artifact for all layers, the skip loop stays in Python).

A decode step hands its layers to the ops in one call, ``ops.run_layers(layers, step)`` over a
:class:`DecodeStep` (the state carried from layer to layer and the decoder's decisions). Layer by layer
(:class:`fbs.engine.fused.LayerByLayer`) is the definition: per layer the gate, the decision, the batch policy,
``layer_step`` and the trace record. The eager int8 step on a CPU with AVX2 / AVX-512 implements the same call
natively (:meth:`fbs.engine.fused.FusedOps.run_layers`, :mod:`fbs.native`): each run of consecutive layers
without PAW or CH is one native call that computes, per layer, what ``layer_step`` computes over the fused int8
weights, makes the threshold decision under the batch policy, and runs attention and FFN only for the rows that
compute; the decisions come back once per run for the trace. That kernel is tested against the layer-by-layer
step (same tokens, decisions and trace; logits to float rounding).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .cache import CacheContext, KVCache, kv_storage_dtype
from .defaults import PREFILL_CHOICES, resolve_kv_dtype, resolve_prefill
from .drafts import default_draft_tokens
from .flops import FlopCounter
from .fused import WEIGHTS, source_stamp, decode_ops
from .greedy import greedy_ids
from .kvpolicy import make_policy, prefill_chunk_size, prefill_chunks
from .prefill import prefill_ops
from .calibration import calibration_ids
from .quant import BLOCK_FORMATS, key_factors
from ..model.chunk import ChunkState
from ..model.layer import COMPUTE, Mix, layer_step
from .. import native
from ..model.skip import BATCH_POLICIES, batch_run, gated_layers, logit_threshold, planned_skip, skips

logger = logging.getLogger(__name__)

CAPACITY_STEP = 128  # KV cache capacity granularity of compiled decoding (the extra slots are masked out)
STRUCTURE_CHARS = "\n{}[]():,\"'`"
_OPEN, _CLOSE = "([{", ")]}"
#: per model, per (format, compile): the state of its weights and its int8 caches' key factors (Decoder.key_factors)
_KEY_FACTORS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@dataclasses.dataclass
class DecodeOptions:
    """All decoding knobs; defaults live here only."""

    max_new_tokens: int = 64
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    eos_token_id: int | list[int] | None = None
    ignore_eos: bool = False
    stop_strings: list[str] | None = None
    pad_token_id: int | None = None
    tau: float | None = None                 # None: the model's config.tau
    kv_policy: str | None = None             # None: the model's config.kv_policy
    kv_cache: str = "full"                   # full | streaming | h2o | snapkv (fbs.engine.kvpolicy)
    kv_budget: int | None = None             # entries a cache policy keeps per layer, row and KV head
    prefill_chunk: int | None = None         # prompt tokens per prefill chunk (None: 512 under a cache policy, the
                                             # whole prompt under the full cache; 0: the whole prompt)
    kv_dtype: str = "fp32"                   # fp32 | fp16 | bf16 | int8: the KV cache's storage (fbs.engine.cache.KV_DTYPES);
                                             # auto: int8 for the quantized weights, else fp32 (fbs.engine.defaults)
    kv_smooth_keys: bool = True              # int8 KV cache: keys stored divided by per-channel powers of two
                                             # calibrated once per model and weights (fbs.engine.quant.key_factors)
    prefill: str = "fp32"                    # a prompt's products: fp32 (the HF modules' GEMMs) | bf16 (bf16 GEMMs)
                                             # | int8 (int8 weights per channel x int8 activations per token) |
                                             # blocks (q4 / q8: the decode kernels), fbs.engine.prefill; auto: the
                                             # default
                                             # (fbs.engine.defaults.default_prefill)
    elide_inert: bool = True                 # PAW / CH that add exactly nothing (a fresh FBS) are not run
                                             # (FBSForCausalLM.decode_view), nor gates whose constant logit never
                                             # reaches tau; False runs them (to time them)
    gate_sampling: bool = False              # Bernoulli gates instead of the threshold (appendix E.6)
    force_compute: bool = False              # every layer runs (equivalence / baselines)
    skip_plan: torch.Tensor | None = None    # bool (L,) or (N, L): forced skips, overrides the gates
    never_skip: tuple[int, ...] = ()         # extra never-skip layers for this call
    protect_structure: bool = False          # appendix E.9: raise tau on structure tokens / open brackets
    structure_tau: float = 1.0               # tau while protected (1.0 = protected tokens skip nothing)
    validator: str | Callable[[str], bool] | None = None  # json | brackets | python | callable
    fallback_tau: float = 0.9                # tau of the fallback rerun
    batch_policy: str = "gather"             # gather | all | majority
    output_scores: bool = False              # keep each step's next-token logits in the result
    weights: str = "fp32"                    # hf (the HF modules) | fp32 | bf16 | int8 (fused inference copies)
    compile: bool | str = False              # torch.compile the fused one-token step (True: inductor; or a backend)
    record_gate_p: bool = True               # keep gate probabilities in the trace (else NaN where not kept)
    lossless: bool = False                   # speculative self-drafting (fbs.engine.speculative): the skipping model
                                             # drafts, full depth verifies: force_compute's output (greedy) or
                                             # its distribution (sampling)
    draft_tokens: int | None = None          # lossless: most tokens drafted per verify pass (gamma); None: the
                                             # draft source's own default (fbs.engine.drafts.default_draft_tokens)
    adapt_draft: bool = True                 # lossless: adapt gamma to the acceptance rate (draft_stop set: adapt it)
    draft_stop: float = 0.0                  # lossless: stop drafting once the draft's top-1 probability is below it
    draft_adapter: Any = None                # lossless: a fbs.baselines.kangaroo.KangarooAdapter drafts instead (Kangaroo)
    draft: Any = None                        # lossless with this draft source: a name of fbs.engine.drafts' registry
                                             # (fbs, plan, kangaroo, prompt-lookup, lookahead, specdec, medusa, ...)
                                             # or a factory(session, **draft_options); implies lossless
    draft_options: dict | None = None        # the draft source's options (e.g. {"ngram": 3}, {"path": DIR})
    native_trees: bool = False               # lossless, native formats: verify a draft's whole token tree in the
                                             # native multi-token steps (else its chain of first children: a tree's
                                             # extra nodes cost more than they gain on this engine, BENCHMARKS §7)
    skip_policy: object | None = None        # a baseline's skip policy (fbs.baselines) decides instead of the gates

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError("min_new_tokens must be in [0, max_new_tokens]")
        if self.do_sample and self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.batch_policy not in BATCH_POLICIES:
            raise ValueError(f"batch_policy must be one of {', '.join(map(repr, BATCH_POLICIES))}, "
                             f"got {self.batch_policy!r}")
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {self.weights!r}")
        if self.compile and self.weights == "hf":
            raise ValueError("compile=True runs the fused weights; use weights='fp32', 'bf16' or 'int8'")
        if self.kv_policy not in (None, "hole", "project"):
            raise ValueError(f"kv_policy must be 'hole' or 'project', got {self.kv_policy!r}")
        if isinstance(self.validator, str) and self.validator not in VALIDATORS:
            raise ValueError(f"validator must be one of {sorted(VALIDATORS)} or a callable")
        if self.draft is not None:
            self.lossless = True  # a draft source is verified: the output is full depth's
        elif self.draft_options:
            raise ValueError("draft_options configure a draft source: pass draft= (a name such as 'lookahead')")
        if self.draft_tokens is None:
            self.draft_tokens = default_draft_tokens(self.draft)
        if self.draft_tokens < 1 or not 0.0 <= self.draft_stop < 1.0:
            raise ValueError("draft_tokens must be >= 1 and draft_stop in [0, 1)")
        if self.lossless and self.validator is not None:
            raise ValueError("lossless output is the full-depth output: a validator fallback would regenerate it")
        if self.draft_adapter is not None and self.draft not in (None, "kangaroo"):
            raise ValueError(f"draft_adapter is Kangaroo's adapter, but draft={self.draft!r}; pass one of them")
        if self.draft_adapter is not None and not self.lossless:
            raise ValueError("draft_adapter drafts for lossless decoding: pass lossless=True")
        if self.skip_policy is not None and self.skip_plan is not None:
            raise ValueError("skip_policy and skip_plan both decide the skips; pass one")
        self.kv_dtype = resolve_kv_dtype(self.kv_dtype, self.weights)
        if self.prefill not in PREFILL_CHOICES:
            raise ValueError(f"prefill must be one of {', '.join(PREFILL_CHOICES)}, got {self.prefill!r}")
        self.prefill = resolve_prefill(self.prefill, self.weights)
        if self.prefill == "blocks" and self.weights not in BLOCK_FORMATS:
            raise ValueError(f"prefill='blocks' runs a prompt through the block weights of the decode format, and "
                             f"weights={self.weights!r} has none: pass weights='q4' or 'q8', or prefill='fp32'")
        kv_storage_dtype(self.kv_dtype, torch.float32)  # checks the name
        policy = make_policy(self.kv_cache, self.kv_budget)  # checks the name and the budget
        if policy is not None and self.lossless:
            raise ValueError(f"lossless decoding rolls rejected drafts back, which kv_cache={self.kv_cache!r} cannot "
                             "(evicted entries are gone): use kv_cache='full' with lossless=True")
        chunk = prefill_chunk_size(self.prefill_chunk, policy)  # checks it against the policy
        if chunk and self.lossless:
            raise ValueError("lossless decoding's drafters read the whole prompt's prefill: pass prefill_chunk=None "
                             "or 0 with lossless=True")
        if policy is not None and policy.scores and self.compile:
            raise ValueError("kv_cache='h2o' accumulates attention weights in an eager step: pass compile=False")


@dataclasses.dataclass
class StepOutput:
    """One decode step: the token each active row produced."""

    step: int
    rows: list[int]
    tokens: list[int]


@dataclasses.dataclass
class DecodeTrace:
    """What ran, per (row, generated token, layer). N = generated tokens (rows that stopped are padded)."""

    executed: torch.Tensor        # (B, N, L) bool: the layer (its FFN under skip_granularity="ffn") ran for that token
    intended_skip: torch.Tensor   # (B, N, L) bool: the gate (or plan) said skip
    kv_written: torch.Tensor      # (B, N, L) bool: a K/V entry was written
    gate_p: torch.Tensor          # (B, N, L) float, NaN where no gate was evaluated
    window_k: torch.Tensor        # (B, N) long, k(t) at the first PAW layer (-1: PAW did not run)
    chunk_boundary: torch.Tensor  # (B, N) bool, the token started a chunk at the first CH layer
    context_len: torch.Tensor     # (B, N) long, tokens before this one (its position)
    valid: torch.Tensor           # (B, N) bool, a token was generated at this step
    tflops_rel: float             # paper's Eq.: executed layer invocations / all (decode tokens)
    tflops_rel_exact: float       # executed MACs incl. attention, K/V projections, LM head, FBS overhead
    fallback: list[bool]          # per row: the validator failed and the row was regenerated
    skip_granularity: str = "layer"  # "ffn": a pair not executed still ran its attention (and wrote K/V)

    @property
    def skip_ratio(self) -> float:
        """Share of (token, layer) pairs not executed, over all layers of generated tokens."""
        n = self.valid.sum().item() * self.executed.shape[-1]
        return 0.0 if n == 0 else 1.0 - (self.executed & self.valid.unsqueeze(-1)).sum().item() / n

    @property
    def intended_skip_ratio(self) -> float:
        n = self.valid.sum().item() * self.executed.shape[-1]
        return 0.0 if n == 0 else (self.intended_skip & self.valid.unsqueeze(-1)).sum().item() / n

    def to_dict(self) -> dict:
        return {
            "executed": self.executed.int().tolist(), "intended_skip": self.intended_skip.int().tolist(),
            "gate_p": torch.nan_to_num(self.gate_p, nan=-1.0).tolist(), "window_k": self.window_k.tolist(),
            "chunk_boundary": self.chunk_boundary.int().tolist(), "context_len": self.context_len.tolist(),
            "skip_ratio": self.skip_ratio, "intended_skip_ratio": self.intended_skip_ratio,
            "tflops_rel": self.tflops_rel, "tflops_rel_exact": self.tflops_rel_exact, "fallback": self.fallback,
        }


@dataclasses.dataclass
class GenerationResult:
    sequences: torch.Tensor       # (B, T_prompt_max + N) prompt (left-aligned as given) + new tokens, padded
    new_tokens: list[list[int]]   # per row, the generated ids
    trace: DecodeTrace
    timings: dict[str, float]     # prefill_s, decode_s, total_s
    scores: list[torch.Tensor] | None = None  # per row (n_new, V) logits that chose each new token
    speculative: Any = None       # lossless decoding: fbs.engine.speculative.SpecStats (passes, acceptance, draft work)


# --------------------------------------------------------------------------- validators (appendix E.9)
def _valid_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def _balanced(text: str) -> bool:
    stack = []
    for ch in text:
        if ch in _OPEN:
            stack.append(_CLOSE[_OPEN.index(ch)])
        elif ch in _CLOSE:
            if not stack or stack.pop() != ch:
                return False
    return not stack


def _valid_python(text: str) -> bool:
    try:
        ast.parse(text)
        return True
    except (SyntaxError, ValueError):
        return False


VALIDATORS: dict[str, Callable[[str], bool]] = {"json": _valid_json, "brackets": _balanced, "python": _valid_python}


# --------------------------------------------------------------------------- input handling
def rows_from_input(input_ids, attention_mask) -> list[list[int]]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
        if attention_mask is None:
            rows = input_ids.tolist()
        else:
            rows = [ids[m.bool()].tolist() for ids, m in zip(input_ids, attention_mask)]
    else:
        rows = [list(map(int, r)) for r in input_ids]
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError("empty prompt: every row needs at least one token")
    return rows


class _Structure:
    """Per-token structure facts for structure-token protection."""

    def __init__(self, tokenizer, vocab_size: int):
        if tokenizer is None:
            raise ValueError("protect_structure needs a tokenizer (pass tokenizer= or load the model by name)")
        texts = tokenizer.convert_ids_to_tokens(list(range(min(vocab_size, len(tokenizer)))))
        texts = [tokenizer.convert_tokens_to_string([t]) if t is not None else "" for t in texts]
        self.is_structure = [any(c in STRUCTURE_CHARS for c in t) for t in texts] + [False] * (vocab_size - len(texts))
        self.depth_delta = [sum(t.count(c) for c in _OPEN) - sum(t.count(c) for c in _CLOSE) for t in texts]
        self.depth_delta += [0] * (vocab_size - len(texts))


# --------------------------------------------------------------------------- the engine
#: dtype of each per-(row, step[, layer]) field of :class:`DecodeTrace`.
TRACE_DTYPES = {"executed": torch.bool, "intended_skip": torch.bool, "kv_written": torch.bool, "gate_p": torch.float32,
                "window_k": torch.long, "chunk_boundary": torch.bool, "context_len": torch.long, "valid": torch.bool}


class TraceRecorder:
    """Per-step records in plain Python lists (cheap on the hot path), turned into tensors once (:func:`finish`).

    Fields, each indexed [row][step] (and [layer] for the first four): ``executed``, ``intended``, ``kv``, ``p``
    (gate logits), ``k``, ``bound``, ``ctx``, ``valid``; :data:`TRACE_DTYPES` gives each :class:`DecodeTrace`
    field's dtype."""

    def __init__(self, batch: int, steps: int, layers: int):
        grid = lambda v: [[[v] * layers for _ in range(steps)] for _ in range(batch)]  # noqa: E731
        self.executed, self.intended, self.kv, self.p = grid(False), grid(False), grid(False), grid(float("nan"))
        self.k = [[-1] * steps for _ in range(batch)]
        self.bound = [[False] * steps for _ in range(batch)]
        self.ctx = [[0] * steps for _ in range(batch)]
        self.valid = [[False] * steps for _ in range(batch)]

    def rows(self, keep: int) -> dict[str, list]:
        """Field name of :class:`DecodeTrace` -> nested lists truncated to ``keep`` steps."""
        cut = lambda rows: [r[:keep] for r in rows]  # noqa: E731
        return {"executed": cut(self.executed), "intended_skip": cut(self.intended), "kv_written": cut(self.kv),
                "gate_p": cut(self.p), "window_k": cut(self.k), "chunk_boundary": cut(self.bound),
                "context_len": cut(self.ctx), "valid": cut(self.valid)}

    #: the per-step record fields
    FIELDS = ("executed", "intended", "kv", "p", "k", "bound", "ctx", "valid")

    def replace_row(self, row: int, other: "TraceRecorder", other_row: int) -> None:
        for name in self.FIELDS:
            getattr(self, name)[row] = getattr(other, name)[other_row]


class DecodeStep:
    """One decode step as its layers see it: the state carried from layer to layer, and the decoder's decisions.

    The decoder runs the step's layers as one ``ops.run_layers(layers, step)`` (every ops object has it):
    layer by layer, each layer is :meth:`layer` (gate, decision, batch policy, :func:`fbs.model.layer.layer_step`,
    trace record); a kernel that runs several layers in one call and decides inside it
    (:meth:`fbs.engine.fused.FusedOps.run_layers`) may do so when :attr:`hard_decisions` holds, reads its inputs
    here (:meth:`gated_in`, :meth:`gate_inputs`, :meth:`forced_runs`, ``policy``, ``write_skipped``) and hands its
    results back with :meth:`ran`, which records them as :meth:`layer` would have.

    State: ``x`` (b, 1, d) the next layer's input, ``x_prev`` the previous layer's input (None: none ran yet),
    ``prev_skip`` (b, 1) 1.0 where a row skipped the previous layer (None: no row did), ``zlow`` the preview
    summary (``zero_z``: still zero), ``zterms`` the gates' preview terms of ``zlow`` (None: not made yet),
    ``thresholds`` per row the logit threshold of its tau (None: not made yet; fixed within a step)."""

    __slots__ = ("dec", "step", "rows", "steps", "ctx", "x", "x_prev", "prev_skip", "zlow", "zero_z", "zterms",
                 "thresholds")

    def __init__(self, dec: "Decoder", step: int | list[int], rows: list[int], steps: list[int], ctx: CacheContext,
                 x: torch.Tensor):
        self.dec, self.step, self.rows, self.steps, self.ctx, self.x = dec, step, rows, steps, ctx, x
        self.zlow = x.new_zeros(len(rows), 1, dec.m.config.preview_rank)
        self.zero_z, self.zterms = True, None
        self.x_prev, self.prev_skip, self.thresholds = None, None, None

    @property
    def hard_decisions(self) -> bool:
        return self.dec.hard_decisions

    @property
    def policy(self) -> int:
        """The batch policy's code (:data:`fbs.model.skip.BATCH_POLICIES`)."""
        return BATCH_POLICIES[self.dec.opts.batch_policy]

    @property
    def write_skipped(self) -> bool:
        """Rows that skip a layer still write its K/V (the ``project`` KV policy)."""
        return self.dec.policy == "project"

    def layer(self, l: int) -> None:
        """Layer l in PyTorch, for every row of the step (the per-layer implementation of ``run_layers``)."""
        self.dec._layer(l, self)

    def gated_in(self, layers: range) -> list[bool]:
        """Per layer of ``layers``, whether this call decides it by its gate."""
        return self.dec._gated_in(layers)

    def gate_inputs(self) -> None:
        """Make the gates' per-step inputs (``zterms``, ``thresholds``) if a gated layer is the first to need them."""
        if self.zterms is None:
            self.zterms = self.dec.ops.preview_terms(None if self.zero_z else self.zlow, len(self.rows))
        if self.thresholds is None:
            self.thresholds = [self.dec._row_threshold(r) for r in self.rows]

    def forced_runs(self, layers: range, gated: list[bool]) -> list[bool]:
        """The rows that run each ungated layer of ``layers`` under a skip plan (layer-major, b per layer, True for
        gated layers), or [] when every row runs every ungated layer (no plan)."""
        return self.dec._forced_runs(layers, gated, self.step, self.rows)

    def ran(self, layers: range, gated: list[bool], x: torch.Tensor, x_in: torch.Tensor, logits: list[float],
            skip: list[bool], run: list[bool], preview: tuple | None = None) -> None:
        """Record ``layers`` run in one call: ``x`` the output, ``x_in`` the last layer's input; ``logits``, ``skip``
        and ``run`` flat lists, b per layer (``logits`` read where ``gated``). ``preview``: where the call ran PAW /
        CH layers too (:attr:`fbs.engine.fused.FusedOps.native_decode`), (the gate terms after its last PAW layer or
        None, PAW's k and CH's boundary flag per layer and row, -1 where none); ``zlow`` it wrote in place."""
        dec, rows, b = self.dec, self.rows, len(self.rows)
        dec._record(self.steps, layers, rows, skip, run, logits if any(gated) else None, None, None, None)
        if preview is not None:
            self._ran_extras(layers, *preview)
        if dec.m.gates.use_prev_skip:
            last = run[-b:]
            self.prev_skip = None if all(last) else dec._skip_indicator(last)
        self.x, self.x_prev = x, x_in

    def _ran_extras(self, layers: range, terms, ks: list[int], bounds: list[int]) -> None:
        """The trace's window k (first PAW layer) and chunk boundary (first CH layer) of the rows that ran them, and
        the preview state after a PAW layer, as :meth:`Decoder._layer` leaves them."""
        dec, rows, b = self.dec, self.rows, len(self.rows)
        cfg, rec = dec.m.layers_cfg, dec.rec
        for first, field, vals in ((cfg.paw[0] if cfg.paw else -1, rec.k, ks), (cfg.ch[0] if cfg.ch else -1, rec.bound,
                                                                               bounds)):
            if first in layers:
                at = (first - layers.start) * b
                for i, r in enumerate(rows):
                    v = vals[at + i]
                    if v >= 0:
                        field[r][self.steps[i]] = v if field is rec.k else bool(v)
        paw_ran = any(k >= 0 for l in layers if str(l) in dec.m.paw
                      for k in ks[(l - layers.start) * b:(l - layers.start + 1) * b])
        if paw_ran:  # zlow is new: the gates' terms follow it (made here by the call, else on first use)
            self.zero_z = False
            self.zterms = None if terms is None else dec.ops.terms_of(terms)


class Decoder:
    """State of one generate call: cache, chunk states, per-row bookkeeping, trace buffers.

    Built by :func:`start`; :func:`run` drives it. Public surface (what the server's batcher and speculative
    decoding use): ``prompts`` / ``out`` (per row, prompt and generated ids), ``active`` (the rows still
    decoding), ``rec`` (:class:`TraceRecorder`), ``opts``, :meth:`prefill`, :meth:`decode_step` (one token per
    active row), :meth:`context` (the KV-cache context of a step), :meth:`pick` and :meth:`finished`.
    Subclasses may override :meth:`decode_step` (the batcher runs several requests' rows in one step)."""

    def __init__(self, model, prompts: list[list[int]], opts: DecodeOptions, tokenizer):
        if opts.elide_inert and hasattr(model, "decode_view"):
            model = model.decode_view()  # inert PAW / CH (a fresh FBS): the base and gates alone, the same outputs
        self.m, self.opts, self.tok = model, opts, tokenizer
        spec, cfg = model.base.spec, model.config
        self.L, self.B = spec.num_layers, len(prompts)
        self.prompts = prompts
        longest = max(len(p) for p in prompts)
        self.kv = make_policy(opts.kv_cache, opts.kv_budget)  # the cache policy (None: the full cache)
        self.prefill_chunk = prefill_chunk_size(opts.prefill_chunk, self.kv)  # 0: the whole prompt at once
        windowed = self.kv is not None and self.kv.name == "streaming"  # decode distances stay within its budget
        if longest > spec.max_positions or (longest + opts.max_new_tokens > spec.max_positions and not windowed):
            raise ValueError(
                f"prompt of {longest} tokens plus max_new_tokens={opts.max_new_tokens} exceeds the model's context "
                f"of {spec.max_positions}; shorten the prompt or lower max_new_tokens"
                + ("" if longest > spec.max_positions else " (or decode past it with kv_cache='streaming')")
            )
        self.dev = model.preview_ids.device
        dtype = model.base.embedding_weight.dtype
        # lossless decoding verifies up to draft_tokens + 1 positions past a row's last committed one
        capacity = longest + opts.max_new_tokens + (opts.draft_tokens + 1 if opts.lossless else 0)
        if self.kv is not None:  # the kept entries and the one a step appends, not the whole context
            capacity = self.kv.capacity(longest, opts.max_new_tokens)
        if opts.compile:  # compiled steps see the cache's full shape: round it so calls share graphs (and the disk cache)
            capacity = min(-(-capacity // CAPACITY_STEP) * CAPACITY_STEP, max(capacity, spec.max_positions))
        self.cache = self.new_cache(capacity)
        self.chunks = {l: ChunkState(self.B, cfg.chunk_cache_size, cfg.chunk_rank, self.dev, dtype)
                       for l in model.layers_cfg.ch}
        self.tau = cfg.tau if opts.tau is None else opts.tau
        self.policy = opts.kv_policy or cfg.kv_policy
        self.gated = gated_layers(self.L, model.layers_cfg.gated, (*model.layers_cfg.never_skip, *opts.never_skip))
        if opts.elide_inert and not opts.gate_sampling:
            # a gate whose logit is a constant at or below tau's threshold never skips (every row's tau is >= tau):
            # it is not evaluated (a fresh FBS's gates: ~2 % of a SmolLM2 q4 decode step); the trace has no logit
            fixed = model.gates.constant_logits() if hasattr(model, "gates") else {}
            never = logit_threshold(self.tau)
            self.gated = [g and not (l in fixed and fixed[l] <= never) for l, g in enumerate(self.gated)]
        self.plan = None
        if opts.skip_plan is not None:
            plan = torch.as_tensor(opts.skip_plan, dtype=torch.bool)
            if plan.dim() not in (1, 2):
                raise ValueError(f"skip_plan must be (L,) or (N, L), one plan for every row, got shape "
                                 f"{tuple(plan.shape)}; run rows with different plans as separate calls")
            if plan.shape[-1] != self.L:
                raise ValueError(f"skip_plan's last dimension must be {self.L} layers, got {tuple(plan.shape)}")
            if plan.dim() == 1:
                plan = plan.expand(opts.max_new_tokens, self.L)
            bad = [l for l in range(self.L) if plan[:, l].any() and l in model.layers_cfg.never_skip]
            if bad and not opts.force_compute:
                raise ValueError(f"skip_plan skips never-skip layers {bad}; change never_skip_first/last in the config")
            self.plan = plan.tolist()
        self.gen = None
        if opts.seed is not None:
            self.gen = torch.Generator(device=self.dev).manual_seed(opts.seed)
        self.structure = _Structure(tokenizer, spec.vocab_size) if opts.protect_structure else None
        self.depth = [0] * self.B  # open-bracket depth of prompt + output, for structure protection
        if self.structure is not None:
            for r, prompt in enumerate(prompts):
                for t in prompt:
                    self.depth[r] = max(0, self.depth[r] + self.structure.depth_delta[t])
        self.emb_v, self.keys_v = model.preview_vocab() if len(model.paw) else (None, {})
        self.ops = decode_ops(model, opts.weights, opts.compile)
        #: what a prompt runs with: the decode ops, or other products (prefill="bf16" / "int8" / "blocks")
        self.prefill_ops = prefill_ops(self.ops, opts.prefill)
        self.granularity = cfg.skip_granularity
        eos = opts.eos_token_id
        if eos is None and not opts.ignore_eos:
            eos = getattr(getattr(model.base.hf, "generation_config", None), "eos_token_id", None)
            if eos is None and tokenizer is not None:
                eos = tokenizer.eos_token_id
        self.eos = set() if opts.ignore_eos or eos is None else set([eos] if isinstance(eos, int) else eos)
        self.rec = TraceRecorder(self.B, opts.max_new_tokens, self.L)
        self.flops = FlopCounter(model)
        self.out: list[list[int]] = [[] for _ in range(self.B)]
        self.scores: list[list[torch.Tensor]] = [[] for _ in range(self.B)]
        self.active = list(range(self.B))
        self.spec = None  # lossless decoding's bookkeeping (fbs.engine.speculative), set by its run
        # a baseline's per-call policy state (fbs.baselines): prefill_mix / decide / mix / bypass / observe
        self.skipper = None if opts.skip_policy is None or opts.force_compute else opts.skip_policy.start(self)
        self._indicators: dict[tuple[bool, ...], torch.Tensor] = {}  # previous-skip inputs by pattern (gate_prev_skip)
        self._seg_gated: dict[range, list[bool]] = {}   # per run of layers, which of them this call gates
        #: every decision is the gate logit against a threshold or forced (plan, force_compute), for the whole
        #: layer, with no baseline policy: what a kernel that decides inside its call can compute (a cache policy
        #: that reads attention weights, H2O, gets them from that kernel's attention too)
        self.hard_decisions = self.skipper is None and not opts.gate_sampling and self.granularity == "layer"

    def new_cache(self, capacity: int) -> KVCache:
        """An empty KV cache of this call's rows, ``capacity`` slots each, under its cache policy."""
        base = self.m.base
        spec, dtype = base.spec, base.embedding_weight.dtype
        rope = lambda pos: base.rope(base.embedding_weight[:1], pos)  # noqa: E731  (rotary tables of positions)
        storage = kv_storage_dtype(self.opts.kv_dtype, dtype)
        factors = self.key_factors() if storage == torch.int8 and self.opts.kv_smooth_keys else None
        return KVCache(self.L, self.B, spec.num_kv_heads, spec.head_dim, capacity, self.dev, storage, self.kv, rope,
                       compute_dtype=dtype, key_factors=factors)

    def key_factors(self) -> list[torch.Tensor]:
        """Per layer the (Hkv, 1, hd) factors an int8 cache stores its keys divided by (:func:`key_factors`): from
        the keys of the calibration prompt (:mod:`fbs.engine.calibration`), prefilled at full depth into an fp32
        cache in this format; computed once per model, format and state of its weights (recomputed after training
        changes them; stale factors would still be exact, only less fitted: q . k does not depend on them)."""
        per_model = _KEY_FACTORS.setdefault(self.m, {})
        key, stamp = (self.opts.weights, bool(self.opts.compile)), source_stamp(self.m)
        got = per_model[key][1] if key in per_model and per_model[key][0] == stamp else None
        if got is None:
            opts = DecodeOptions(max_new_tokens=1, weights=self.opts.weights, compile=self.opts.compile,
                                 kv_dtype="fp32", force_compute=True, ignore_eos=True)
            spec = self.m.base.spec
            ids = calibration_ids(self.tok, spec.vocab_size)[:spec.max_positions - 1]
            cal = Decoder(self.m, [ids], opts, self.tok)
            with torch.no_grad():
                cal.prefill()
            n = len(ids)
            got = [key_factors(k[0, :, :n]) for k in cal.cache.k]
            per_model[key] = (stamp, got)
        return got

    def context(self, rows: list[int], positions: list[list[int]], cos, sin, prefill: bool = False) -> CacheContext:
        """The cache context of a step (or, ``prefill``, of a prompt chunk) of ``rows`` at ``positions``. Where the
        ops run native layers, the chunk head steps natively and PAW computes row by row (decoding and a verifier's
        passes then give a position the same bits, whatever else shares the call); a prefill keeps torch's GEMMs (or
        the integer products of ``prefill``), its attention over an empty cache natively in the native formats."""
        ctx = CacheContext(self.cache, self.chunks, rows, positions, cos, sin, self.policy, self.emb_v, self.keys_v,
                           self.m.base.scaling)
        ctx.native_chunk = self.ops.native_chunk
        if ctx.native_chunk and not prefill:
            ctx.linear, ctx.native_paw = native.linear_rows, getattr(self.ops, "paw_args", None)
        ctx.native_causal = prefill and getattr(self.ops, "native_layers", None) is not None
        return ctx

    # ---- prefill ------------------------------------------------------------
    def prefill(self, tap: Callable[[int, list[int], torch.Tensor], None] | None = None) -> list[torch.Tensor]:
        """Run every layer over each prompt; returns next-token logits per row. ``tap(l, rows, x)`` sees the input
        of every layer (Kangaroo's adapter reads the prompt's hidden states at its exit layer).

        With ``prefill_chunk`` C > 0 a prompt longer than C runs in chunks (:func:`fbs.engine.kvpolicy.prefill_chunks`):
        each chunk runs every layer over its tokens, attending over what the cache holds plus itself (causal), and a
        cache policy then evicts to its budget before the next chunk; CH continues its chunk state token by token.
        Activations, FFN intermediates and attention weights are then bounded by C; under the full cache the K/V
        still grow with the prompt."""
        groups: dict[int, list[int]] = {}
        for r, p in enumerate(self.prompts):
            groups.setdefault(len(p), []).append(r)
        logits = [None] * self.B
        # integer products: the last token runs the decode step (below)
        split = self.prefill_ops is not self.ops and self.prefill_ops.decode_last
        for length, rows in groups.items():
            # rows of equal length run as one batch (rows need not be contiguous for the cache)
            prompt = torch.tensor([self.prompts[r] for r in rows], device=self.dev)
            spans = prefill_chunks(length - 1 if split and length > 1 else length, self.prefill_chunk)
            if split and length > 1:
                # the prompt's last token, whose state predicts the first new token, runs as a one-token step in the
                # decode format: the int8 products' rounding then reaches the answer only through the prompt's K/V
                # (docs/eval.md, "Default prefill")
                spans.append((length - 1, length))
            for s, e in spans:
                ops = self.ops if split and e == length and e - s == 1 else self.prefill_ops
                pos = torch.arange(s, e, device=self.dev).expand(len(rows), e - s)
                x = ops.embed(prompt[:, s:e])
                cos, sin = ops.rope(x, pos)
                ctx = self.context(rows, [list(range(s, e))] * len(rows), cos, sin, prefill=True)
                for l in range(self.L):
                    if tap is not None:
                        tap(l, rows, x)
                    mix = COMPUTE if self.skipper is None else self.skipper.prefill_mix(l, x, pos)
                    x = layer_step(self.m, ops, l, x, ctx, mix).x
            last = ops.head(x[:, -1:])[:, 0]
            for i, r in enumerate(rows):
                logits[r] = last[i]
        return logits

    # ---- decode -------------------------------------------------------------
    def _needs_gate(self, l: int) -> bool:
        return self.gated[l] and self.plan is None and not self.opts.force_compute and self.skipper is None

    def _skip_decision(self, l, step, rows, logit, thresholds=None) -> tuple[list[bool], list[float] | None]:
        """Returns (skip per row, gate logits per row or None). ``logit`` (b,) is read once; ``thresholds``:
        the rows' logit thresholds (:meth:`_row_threshold`)."""
        o = self.opts
        if o.force_compute:
            return [False] * len(rows), None
        if self.plan is not None:
            steps = [step] * len(rows) if isinstance(step, int) else step
            return planned_skip(self.plan, steps, l), None
        if logit is None:
            return [False] * len(rows), None
        if o.gate_sampling:
            if isinstance(logit, list):  # from the native kernel (fbs.native): already on the host
                logit = torch.tensor(logit, device=self.dev)
            p = torch.sigmoid(logit.float())
            both = torch.stack([logit.float(), torch.bernoulli(p, generator=self.gen)]).tolist()
            return [d > 0.5 for d in both[1]], both[0]
        values = logit if isinstance(logit, list) else logit.tolist()  # the layer's one host read
        if thresholds is None:
            thresholds = [self._row_threshold(r) for r in rows]
        return skips(values, thresholds), values

    def _row_threshold(self, row: int) -> float:
        """The logit threshold of this row's tau (p > tau <=> logit > log(tau / (1 - tau)))."""
        return logit_threshold(self._row_tau(row))

    def _row_tau(self, row: int) -> float:
        if self.structure is None:
            return self.tau
        last = self.out[row][-1] if self.out[row] else self.prompts[row][-1]
        if self.depth[row] > 0 or self.structure.is_structure[last]:
            return max(self.tau, self.opts.structure_tau)
        return self.tau

    def _batch_run(self, skip: list[bool]) -> list[bool]:
        """Which rows run the layer (or its FFN) under this call's batch policy (:func:`fbs.model.skip.batch_run`)."""
        return batch_run(skip, self.opts.batch_policy)

    def decode_step(self, step: int | list[int], tokens: list[int]) -> torch.Tensor:
        """One token for every active row; returns next-token logits (b, V) for the active rows. ``step`` is the
        index of the generated token the rows consume: one for all, or one per row (speculative drafts). The layers
        run as one ``ops.run_layers`` over a :class:`DecodeStep`."""
        rows, rec, ops = self.active, self.rec, self.ops
        b = len(rows)
        steps = [step] * b if isinstance(step, int) else list(step)
        pos_list = [len(self.prompts[r]) + s for r, s in zip(rows, steps)]
        x = ops.embed(torch.tensor(tokens, device=self.dev).view(b, 1))
        cos, sin = ops.rope(x, torch.tensor(pos_list, device=self.dev).view(b, 1))
        ctx = self.context(rows, [[p] for p in pos_list], cos, sin)
        for i, r in enumerate(rows):
            rec.ctx[r][steps[i]], rec.valid[r][steps[i]] = pos_list[i], True
        st = DecodeStep(self, step, rows, steps, ctx, x)
        ops.run_layers(range(self.L), st)
        return ops.head(st.x)[:, 0]

    def _layer(self, l: int, st: "DecodeStep") -> None:
        """Layer l of a decode step in PyTorch (:meth:`DecodeStep.layer`): gate, decision, batch policy, one
        :func:`layer_step` for the rows that run (the K/V of the others under ``project``), the trace record."""
        ops, x, ctx = self.ops, st.x, st.ctx
        gated = self._needs_gate(l)
        if gated:
            st.gate_inputs()
            pre = ops.pre(l, x, ctx, st.x_prev, st.zterms, st.prev_skip, True)
        else:
            pre = None
        if self.skipper is not None:  # a baseline's policy decides
            pre = ops.pre(l, x, ctx, None, None, None, False)
            skip, logits = self.skipper.decide(l, st.step, st.rows, x, pre)
        else:
            skip, logits = self._skip_decision(l, st.step, st.rows, pre.logit if gated else None, st.thresholds)
        run = self._batch_run(skip)
        if pre is None and (any(run) or self.policy == "project" or self.granularity == "ffn") and not (
                all(run) and self.granularity == "layer" and ops.attends_natively(l)):
            pre = ops.pre(l, x, ctx, None, None, None, False)  # else: nothing of this layer runs, or all of it
            #                                                    natively (its K/V inside the native call)
        if self.granularity == "ffn":
            new, zlow_new, sel, paw, ch = self._ffn_only(l, x, ctx, pre, run, st.zlow)
        else:
            new, zlow_new, sel, paw, ch = self._whole_layer(l, x, ctx, pre, run, st.zlow)
        self._record(st.steps, range(l, l + 1), st.rows, skip, run, logits, sel, paw, ch)
        if paw is not None:
            st.zlow, st.zero_z, st.zterms = zlow_new, False, None
        if self.m.gates.use_prev_skip:
            st.prev_skip = None if all(run) else self._skip_indicator(run)
        st.x_prev, st.x = x, new

    def _gated_in(self, layers: range) -> list[bool]:
        gated = self._seg_gated.get(layers)
        if gated is None:
            gated = self._seg_gated[layers] = [self._needs_gate(l) for l in layers]
        return gated

    def _forced_runs(self, layers: range, gated: list[bool], step, rows: list[int]) -> list[bool]:
        """The rows that run each ungated layer of ``layers`` under a skip plan (layer-major, True for gated layers),
        or [] when every row runs every ungated layer (no plan)."""
        if self.plan is None:
            return []
        runs = []
        for l, g in zip(layers, gated):
            runs.extend([True] * len(rows) if g else self._batch_run(self._skip_decision(l, step, rows, None)[0]))
        return runs

    def _skip_indicator(self, run: list[bool]) -> torch.Tensor:
        """(b, 1) 1.0 for the rows that skipped, one tensor per pattern (made once per call)."""
        key = tuple(run)
        t = self._indicators.get(key)
        if t is None:
            t = self._indicators[key] = torch.tensor([[0.0 if r else 1.0] for r in run], device=self.dev)
        return t

    def _whole_layer(self, l, x, ctx, pre, run, zlow):
        """Layer granularity: the layer runs for the rows in ``run``; the others keep x (and, under ``project``,
        write their K/V and chunk entry from the unchanged state). Returns (x', zlow', rows that ran, PAW, CH)."""
        b = x.shape[0]
        sel = [i for i in range(b) if run[i]]
        new, out = x, None
        if len(sel) == b:
            out = layer_step(self.m, self.ops, l, x, ctx, self._run_mix(l, sel), xn=None if pre is None else pre.xn,
                             kv=None if pre is None else pre.kv, zlow=zlow)
            new, zlow_new = out.x, out.zlow
        elif sel:
            ti = torch.tensor(sel, device=self.dev)
            kv = None if pre.kv is None else (pre.kv[0][ti], pre.kv[1][ti])
            out = layer_step(self.m, self.ops, l, x[ti], ctx.select(sel), self._run_mix(l, sel), xn=pre.xn[ti], kv=kv,
                             zlow=zlow[ti])
            new = x.index_copy(0, ti, out.x)
            zlow_new = zlow.index_copy(0, ti, out.zlow) if out.paw is not None else zlow
        skipped = [i for i in range(b) if not run[i]]
        if skipped and self.policy == "project":
            sub = ctx if not sel else ctx.select(skipped)
            ti = torch.tensor(skipped, device=self.dev)
            xn = pre.xn if not sel else pre.xn[ti]
            kv = self.ops.kv(l, xn, sub) if pre.kv is None else ((pre.kv[0], pre.kv[1]) if not sel else
                                                                 (pre.kv[0][ti], pre.kv[1][ti]))
            sub.write(l, *kv)
            if str(l) in self.m.ch:
                sub.chunk_write(l, self.m.ch[str(l)], xn)
        if skipped and self.skipper is not None:  # a policy may process the skipped rows (FlexiDepth's adapter)
            new = self.skipper.bypass(l, skipped, x, new)
        if out is None:
            return new, zlow, sel, None, None
        return new, zlow_new, sel, out.paw, out.ch

    def _ffn_only(self, l, x, ctx, pre, run, zlow):
        """FFN granularity: attention, PAW and CH run for every row; the FFN only for the rows in ``run``."""
        b = x.shape[0]
        sel = [i for i in range(b) if run[i]]
        mix = Mix("ffn") if len(sel) == b else Mix("ffn", ffn_rows=torch.tensor(sel, device=self.dev, dtype=torch.long))
        if self.skipper is not None:
            mix = self.skipper.mix(l, sel)
        out = layer_step(self.m, self.ops, l, x, ctx, mix, xn=pre.xn, kv=pre.kv, zlow=zlow)
        if self.skipper is not None:
            self.skipper.observe(l, run, out)
        return out.x, out.zlow, list(range(b)), out.paw, out.ch

    def _run_mix(self, l: int, sel: list[int]) -> Mix:
        """How the rows ``sel`` (indices into the step's rows) that run layer l combine: plain, or the policy's."""
        return COMPUTE if self.skipper is None else self.skipper.mix(l, sel)

    def _record(self, steps, layers: range, rows, skip, run, logits, sel, paw, ch) -> None:
        """The trace of ``layers`` (consecutive) for the step's rows: ``skip``, ``run`` and ``logits`` (None: no gate
        decided) are layer-major flat lists, one entry per row and layer (NaN logits where a layer has no gate)."""
        rec, m, b, a, z = self.rec, self.m, len(rows), layers.start, layers.stop
        kv_always = self.policy == "project" or self.granularity == "ffn"
        keep_p = logits is not None and self.opts.record_gate_p
        for i, r in enumerate(rows):
            s, ran = steps[i], run[i::b]
            rec.executed[r][s][a:z] = ran
            rec.intended[r][s][a:z] = skip[i::b]
            rec.kv[r][s][a:z] = [True] * len(ran) if kv_always else ran
            if keep_p:
                rec.p[r][s][a:z] = logits[i::b]  # logits; finish turns the whole grid into probabilities
        if paw is not None and a == m.layers_cfg.paw[0]:
            for i, k in zip(sel, paw.k_hard[:, 0].tolist()):
                rec.k[rows[i]][steps[i]] = k
        if ch is not None and a == m.layers_cfg.ch[0]:
            for i, bv in zip(sel, ch.boundary.view(-1).tolist()):
                rec.bound[rows[i]][steps[i]] = bv

    # ---- sampling -----------------------------------------------------------
    def pick(self, logits: torch.Tensor, rows: list[int]) -> list[int]:
        o = self.opts
        logits = logits.float()
        if o.output_scores:
            for i, r in enumerate(rows):
                self.scores[r].append(logits[i].clone())
        for i, r in enumerate(rows):
            if len(self.out[r]) < o.min_new_tokens and self.eos:
                logits[i, list(self.eos)] = float("-inf")
        if not o.do_sample:
            return greedy_ids(logits)
        probs = self.warp(logits).softmax(-1)
        return torch.multinomial(probs, 1, generator=self.gen)[:, 0].tolist()

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits sampling draws from (..., V): temperature, then top-k and top-p (-inf outside)."""
        o = self.opts
        logits = logits / o.temperature
        if o.top_k > 0:
            kth = logits.topk(min(o.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if o.top_p < 1.0:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            cum = sorted_logits.softmax(-1).cumsum(-1)
            drop = cum - sorted_logits.softmax(-1) > o.top_p  # keep the smallest prefix reaching top_p
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
        return logits

    def finished(self, row: int, token: int) -> bool:
        o = self.opts
        n = len(self.out[row])
        if n >= o.max_new_tokens:
            return True
        if n < o.min_new_tokens:
            return False
        if token in self.eos:
            return True
        if o.stop_strings and self.tok is not None:
            # a tail long enough for the longest stop string: a character may take up to 4 byte-level tokens,
            # and the string may start inside the tail's first token
            window = max(16, 4 * max(map(len, o.stop_strings)) + 1)
            tail = self.tok.decode(self.out[row][-window:], skip_special_tokens=False)
            return any(s in tail for s in o.stop_strings)
        return False
