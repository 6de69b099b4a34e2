"""The systems compared side by side: HF greedy decoding, HF's speculative variants, and the FBS engine.

Every system has the same small interface (the lm-evaluation-harness style: a name, a family, and one method):

    system.name, system.family, system.params
    system.unavailable(batch_size) -> ""  or the reason it cannot run
    system.generate(input_ids, new_tokens, probe) -> GenOutput(sequences, prefill_s, decode_s, stats)

``probe=True`` is the untimed statistics run (hooks and traces on); timed runs pass ``probe=False``.

Prefill/decode split for HF ``generate``: a streamer records the time ``generate`` hands over the first new
token(s) (the streamer's second ``put``; the first is the prompt). Prefill = call start -> first token (input
preparation, the prompt forward and, for speculative methods, the first draft + verification), decode = first
token -> end. No extra run and no subtraction of a separate ``max_new_tokens=1`` run is needed. Exactly N new
tokens: ``min_new_tokens = max_new_tokens = N`` (HF masks EOS until N tokens exist).

The FBS engine times prefill and decode itself (``res.timings``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any

import torch

from fbs.bench.accounting import InvocationCounter, LayerCost, baseline_decode_macs, skip_trace_macs, \
    speculative_ratios
from fbs.bench.harness import GenOutput

logger = logging.getLogger(__name__)

NO_DRAFT_REASON = (
    "no draft model smaller than the target ships offline: the bundled alternatives (Qwen2.5-Coder-0.5B, "
    "Gemma-3-270m) are larger than SmolLM2-135M; pass --draft NAME_OR_PATH to run assisted generation "
    "(HF universal assisted generation when the tokenizers differ)"
)


class _FirstTokenClock:
    """HF streamer that timestamps the first generated token(s) and the end of generation."""

    def __init__(self) -> None:
        self.puts = 0
        self.first: float | None = None
        self.end_t: float | None = None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        self.end_t = time.perf_counter()


@dataclasses.dataclass
class HFSystem:
    """``model.generate`` with greedy, fixed-length settings plus method-specific generation kwargs."""

    name: str
    model: Any
    family: str = "baseline"  # baseline | speculative
    gen_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    ratio_kind: str | None = None  # acceptance | verified_advance | None
    batch1_only: bool = False
    missing: str = ""  # non-empty: the system cannot run, and why
    max_runs: int | None = None
    """A reduced budget for a slow system: no warm-up, this many measured runs, probe over as many prompts."""

    @property
    def params(self) -> dict[str, Any]:
        return {k: (v if isinstance(v, (int, float, str, bool)) or v is None else type(v).__name__)
                for k, v in self.gen_kwargs.items()}

    def unavailable(self, batch_size: int) -> str:
        if self.missing:
            return self.missing
        if self.batch1_only and batch_size != 1:
            return "transformers runs assisted/speculative generation at batch size 1 only"
        return ""

    def _call(self, input_ids: torch.Tensor, new_tokens: int, clock: _FirstTokenClock | None):
        cfg = self.model.generation_config
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else cfg.eos_token_id
        return self.model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad,
            streamer=clock,
            **self.gen_kwargs,
        )

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, new_tokens: int, probe: bool = False) -> GenOutput:
        clock = _FirstTokenClock()
        if not probe:
            t0 = time.perf_counter()
            seqs = self._call(input_ids, new_tokens, clock)
            first = clock.first if clock.first is not None else t0
            end = clock.end_t if clock.end_t is not None else time.perf_counter()
            return GenOutput(seqs, prefill_s=first - t0, decode_s=end - first)
        T = input_ids.shape[1]
        draft = self.gen_kwargs.get("assistant_model")
        # a separate draft model's decode work is counted too (its prompt length is learned: it may be re-encoded)
        with InvocationCounter(self.model, T) as counter, \
                (InvocationCounter(draft, None) if draft is not None else contextlib.nullcontext()) as drafted:
            seqs = self._call(input_ids, new_tokens, clock)
        cost = LayerCost.from_config(self.model.config)
        base_inv, base_macs = baseline_decode_macs(cost, T, new_tokens, batch=input_ids.shape[0])
        draft_macs = drafted.decode_macs(LayerCost.from_config(draft.config)) if draft is not None else 0
        stats: dict[str, Any] = {
            "tflops_rel": counter.invocations / base_inv if base_inv else None,
            "tflops_rel_exact": (counter.decode_macs(cost) + draft_macs) / base_macs if base_macs else None,
            "layer_skip_ratio": 0.0 if self.family == "baseline" else None,
        }
        if draft is not None:
            stats["draft_macs_rel"] = draft_macs / base_macs if base_macs else None
        if self.family == "speculative":
            stats.update(speculative_ratios(counter.candidates, new_tokens))
        stats["method_ratio"] = _method_ratio(stats, self.ratio_kind)
        return GenOutput(seqs, 0.0, 0.0, stats)


def _method_ratio(stats: dict[str, Any], kind: str | None) -> float | None:
    if kind == "acceptance":
        return stats.get("acceptance_rate")
    if kind == "verified_advance":
        return stats.get("verified_advance_ratio")
    if kind == "layer_skip":
        return stats.get("layer_skip_ratio")
    return 0.0


# ------------------------------------------------------------------------------------------ HF systems


def hf_greedy(model) -> HFSystem:
    """The baseline: plain greedy ``generate`` with a dynamic KV cache."""
    return HFSystem("hf-greedy", model, "baseline")


def hf_prompt_lookup(model, num_tokens: int = 10, max_ngram: int = 2) -> HFSystem:
    """Prompt-lookup decoding: n-gram matches in the context propose ``num_tokens`` candidates (Lookahead-like,
    so its ratio is the verified/advance ratio, Eq. verify-advance)."""
    return HFSystem("hf-prompt-lookup", model, "speculative",
                    {"prompt_lookup_num_tokens": num_tokens, "max_matching_ngram_size": max_ngram},
                    ratio_kind="verified_advance", batch1_only=True)


def hf_early_exit(model, exit_layer: int, num_assistant_tokens: int = 5) -> HFSystem:
    """Self-speculative decoding: the first ``exit_layer`` layers + LM head draft, the full model verifies
    (transformers' ``assistant_early_exit``; the draft keeps its own KV cache). Ratio: acceptance rate."""
    return HFSystem(f"hf-early-exit-{exit_layer}", model, "speculative",
                    {"assistant_early_exit": exit_layer, "num_assistant_tokens": num_assistant_tokens,
                     "num_assistant_tokens_schedule": "heuristic"},
                    ratio_kind="acceptance", batch1_only=True)


def hf_assisted(model, draft=None, tokenizer=None, draft_tokenizer=None, num_assistant_tokens: int = 5,
                max_runs: int | None = None) -> HFSystem:
    """Assisted generation with a separate draft model; universal assisted generation (token re-encoding) when
    the draft's tokenizer differs from the target's. Without a draft the system reports why it cannot run.
    ``max_runs`` gives it the reduced budget of ``HFSystem.max_runs`` (a draft larger than the target is slow)."""
    if draft is None:
        return HFSystem("hf-assisted", model, "speculative", ratio_kind="acceptance", batch1_only=True,
                        missing=NO_DRAFT_REASON)
    kwargs: dict[str, Any] = {"assistant_model": draft, "num_assistant_tokens": num_assistant_tokens}
    name = "hf-assisted"
    if draft_tokenizer is not None and tokenizer is not None and \
            draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        kwargs.update(tokenizer=tokenizer, assistant_tokenizer=draft_tokenizer)
        name = "hf-universal-assisted"
    return HFSystem(name, model, "speculative", kwargs, ratio_kind="acceptance", batch1_only=True, max_runs=max_runs)


# ------------------------------------------------------------------------------------------ FBS engine


@dataclasses.dataclass
class FBSSystem:
    """The FBS engine (``FBSForCausalLM.generate``) with one set of knobs (tau, KV policy, forced plan, ...)."""

    name: str
    model: Any  # FBSForCausalLM
    knobs: dict[str, Any] = dataclasses.field(default_factory=dict)
    family: str = "fbs"
    ratio_kind: str = "layer_skip"

    @property
    def params(self) -> dict[str, Any]:
        out = {}
        for k, v in self.knobs.items():
            if isinstance(v, torch.Tensor):
                v = v.int().tolist()
            out[k] = v
        return out

    def unavailable(self, batch_size: int) -> str:
        return ""

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, new_tokens: int, probe: bool = False) -> GenOutput:
        res = self.model.generate(input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  ignore_eos=True, do_sample=False, **self.knobs)
        out = GenOutput(res.sequences, float(res.timings["prefill_s"]), float(res.timings["decode_s"]))
        if probe:
            out.stats = fbs_trace_stats(res.trace, self.model, input_ids.shape[1], new_tokens,
                                        self.knobs.get("kv_policy", _config_policy(self.model)))
        return out


def _config_policy(model) -> str:
    return model.config.kv_policy


def fbs_trace_stats(trace, model, prompt_len: int, new_tokens: int, kv_policy: str) -> dict[str, Any]:
    """Skip ratio and both TFLOPs(rel) of one engine run.

    The reported figures are the engine's (``fbs.flops.FlopCounter``: it prices PAW per window size k(t), CH and
    SG exactly). They are recomputed here independently from ``trace.executed`` with this package's cost
    model, against the same plain-decoding denominator as the HF systems, and kept as ``bench_*`` cross-checks
    (the bench's exact variant prices the FBS overhead at one MAC per added parameter per token).
    Trace entry s is the decode step that consumed generated token s (position ``trace.context_len``); the
    last entry never runs (``trace.valid`` is False there), so N new tokens take N-1 decode steps.
    """
    valid = trace.valid.bool().cpu()
    executed = trace.executed.bool().cpu() & valid.unsqueeze(-1)
    B = executed.shape[0]
    hf_config = model.base.hf.config
    cost = LayerCost.from_config(hf_config)
    overhead = float(sum(p.numel() for p in model.fbs_parameters()))
    inv = macs = 0
    for b in range(B):  # rows may have different valid steps in general; here all have N-1
        steps = valid[b]
        i, m = skip_trace_macs(cost, executed[b, steps][None], prompt_len, kv_policy, overhead,
                               trace.context_len[b, steps].cpu())
        inv, macs = inv + i, macs + m
    base_inv, base_macs = baseline_decode_macs(cost, prompt_len, new_tokens, batch=B)
    stats = {
        "layer_skip_ratio": float(trace.skip_ratio),
        "intended_skip_ratio": float(trace.intended_skip_ratio),
        "tflops_rel": float(trace.tflops_rel),
        "tflops_rel_exact": float(trace.tflops_rel_exact),
        "bench_tflops_rel": inv / base_inv if base_inv else None,
        "bench_tflops_rel_exact": macs / base_macs if base_macs else None,
        "fbs_params": overhead,
        "fallback_rows": float(sum(trace.fallback)),
    }
    stats["method_ratio"] = stats["layer_skip_ratio"]
    return stats


def forced_plan(num_layers: int, fraction: float, never_skip: set[int] | frozenset[int] = frozenset()) -> torch.Tensor:
    """(L,) bool static plan skipping round(fraction * L) layers, spread evenly over the skippable ones."""
    plan = torch.zeros(num_layers, dtype=torch.bool)
    skippable = [l for l in range(num_layers) if l not in never_skip]
    k = min(round(fraction * num_layers), len(skippable))
    if k > 0:
        idx = torch.linspace(0, len(skippable) - 1, k).round().long()
        plan[torch.tensor(skippable)[idx]] = True
    return plan
