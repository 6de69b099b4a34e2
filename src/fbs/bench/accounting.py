"""Decode-work statistics of the benchmark's systems, priced with the one cost model of :mod:`fbs.engine.flops`.

Every figure counts the **decode** (tokens at positions ``>= prompt_len``; the prompt's forward is excluded,
as in the paper's Eq. (tflops-rel), where T counts decode steps) relative to plain greedy decoding of the
same tokens (DESIGN.md §5, paper appendix B.3; the definitions are in :mod:`fbs.engine.flops`):

* HF systems: :class:`fbs.model.hf_adapter.DecodeCallCounter` counts what the model's layers and LM head processed
  during one untimed ``generate``; :meth:`fbs.engine.flops.LayerCost.counted_macs` prices it.
* FBS systems: the engine's trace, priced by :class:`fbs.engine.flops.FlopCounter` (TFLOPs and bytes).

Public entry points:
    hf_decode_stats(counter, model, ...)          tflops_rel(_exact) of an HF generate (draft model included)
    fbs_decode_stats(trace, model, ...)           skip ratios, tflops_rel(_exact), bytes_rel of an engine run
    speculative_ratios(candidates, new_tokens)    appendix B.4 ratios of one generate
    speculative_ratios_from_counts(passes, proposed, new_tokens)   the same, pooled over prompts
    lossless_decode_stats(result)                 the engine's speculative systems (fbs.engine.speculative): counts, ratios
    policy_overhead(policy, trace, model, ...)    a baseline policy's own work added to tflops_rel_exact, bytes_rel
"""

from __future__ import annotations

from typing import Any

from fbs.engine.flops import FlopCounter, LayerCost, baseline_decode_macs, step_bytes


def hf_decode_stats(counter, model, prompt_len: int, new_tokens: int, batch: int,
                    draft_counter=None, draft=None) -> dict[str, Any]:
    """TFLOPs(rel) of an HF ``generate`` from its call counts; a separate draft model's work is added to the
    exact figure (``draft_macs_rel`` is its share alone)."""
    cost = LayerCost.from_config(model.config)
    base_inv, base_macs = baseline_decode_macs(cost, prompt_len, new_tokens, batch)
    draft_macs = 0
    if draft_counter is not None:
        draft_macs = LayerCost.from_config(draft.config).counted_macs(
            draft_counter.dec_tokens, draft_counter.dec_keys, draft_counter.lm_rows)
    macs = cost.counted_macs(counter.dec_tokens, counter.dec_keys, counter.lm_rows)
    stats: dict[str, Any] = {
        "tflops_rel": counter.invocations / base_inv if base_inv else None,
        "tflops_rel_exact": (macs + draft_macs) / base_macs if base_macs else None,
    }
    if draft_counter is not None:
        stats["draft_macs_rel"] = draft_macs / base_macs if base_macs else None
    return stats


def fbs_decode_stats(trace, model, prompt_len: int, new_tokens: int, weights: str = "fp32") -> dict[str, Any]:
    """Skip ratios, both TFLOPs(rel) and bytes(rel) of one engine run.

    The TFLOPs figures are the engine's own (``trace.tflops_rel*``, computed by :class:`fbs.engine.flops.FlopCounter`).
    ``bench_tflops_rel`` recounts the executed layer invocations from the trace's mask against plain decoding
    of ``new_tokens`` (a check of the trace's bookkeeping: it must equal ``tflops_rel``). Trace entry s is the
    decode step that consumed generated token s (position ``trace.context_len``); the last entry never runs
    (``trace.valid`` is False there), so N new tokens take N-1 decode steps.
    """
    valid = trace.valid.bool().cpu()
    executed = trace.executed.bool().cpu() & valid.unsqueeze(-1)
    cost = LayerCost.of(model.base.spec)
    base_inv, _ = baseline_decode_macs(cost, prompt_len, new_tokens, batch=executed.shape[0])
    stats = {
        "layer_skip_ratio": float(trace.skip_ratio),
        "intended_skip_ratio": float(trace.intended_skip_ratio),
        "tflops_rel": float(trace.tflops_rel),
        "tflops_rel_exact": float(trace.tflops_rel_exact),
        "bench_tflops_rel": int(executed.sum()) / base_inv if base_inv else None,
        "bytes_rel": FlopCounter(model).bytes_relative(trace, weights),
        "weights": weights,
        "fbs_params": float(sum(p.numel() for p in model.fbs_parameters())),
        "fallback_rows": float(sum(trace.fallback)),
    }
    stats["method_ratio"] = stats["layer_skip_ratio"]
    return stats


def speculative_ratios(candidates: list[int], new_tokens: int) -> dict[str, float | int | None]:
    """Paper appendix B.4 ratios from the candidate counts m_t of every target pass, given N new tokens.

    Each target pass (the prompt pass included) commits its accepted candidates plus one token of its own, so
    with K passes the accepted total is sum a_t = N - K. Plain decoding has m_t = 0 everywhere and no ratio.
    """
    return speculative_ratios_from_counts(len(candidates), sum(candidates), new_tokens)


def speculative_ratios_from_counts(passes: float, proposed: float, new_tokens: int) -> dict[str, float | None]:
    """The same ratios from (mean) pass and proposal counts; pooled over prompts when given means."""
    accepted = max(new_tokens - passes, 0)
    return {
        "passes": passes,
        "proposed": proposed,
        "accepted": accepted,
        "acceptance_rate": accepted / proposed if proposed else None,  # Eq. (accept)
        # Eq. (verify-advance) with v_t = a_t + 1 committed and m_t + 1 attempted per pass
        "verified_advance_ratio": new_tokens / (proposed + passes) if proposed else None,
        "tokens_per_pass": new_tokens / passes if passes else None,
    }


def policy_overhead(policy, trace, model, prompt_len: int, new_tokens: int, stats: dict[str, Any],
                    weights: str = "fp32") -> dict[str, Any]:
    """A baseline policy's own decode work (``policy.overhead(trace) -> (MACs, parameters read)``, e.g.
    FlexiDepth's routers and adapters, fp32 modules) added to ``stats``' tflops_rel_exact and bytes_rel; the
    shares alone are ``overhead_macs_rel`` / ``overhead_bytes_rel``. Empty for a policy without overhead."""
    if not hasattr(policy, "overhead"):
        return {}
    macs, params = policy.overhead(trace)
    cost = LayerCost.of(model.base.spec)
    batch = trace.valid.shape[0]
    _, base_macs = baseline_decode_macs(cost, prompt_len, new_tokens, batch)
    base_bytes = sum(step_bytes(cost, prompt_len + s + 1, batch=batch, weights=weights)
                     for s in range(max(new_tokens - 1, 0)))
    m, b = (macs / base_macs if base_macs else 0.0), (4.0 * params / base_bytes if base_bytes else 0.0)
    return {"overhead_macs_rel": m, "overhead_bytes_rel": b, "tflops_rel_exact": stats["tflops_rel_exact"] + m,
            "bytes_rel": stats["bytes_rel"] + b}


def lossless_decode_stats(result) -> dict[str, Any]:
    """Probe statistics of the engine's lossless decoding (``result.speculative``, per-row means): appendix B.4's
    counts and ratios, the draft's own skip share, and TFLOPs(rel) of everything that ran (drafts, rejected
    candidates, verification) against plain decoding (the engine's accounting, :meth:`fbs.engine.speculative`)."""
    st = result.speculative
    return {
        "passes": st.passes, "proposed": st.proposed, "accepted": st.accepted, "rejections": st.rejections,
        "acceptance_rate": st.acceptance_rate, "verified_advance_ratio": st.verified_advance_ratio,
        "tokens_per_pass": st.tokens_per_pass, "draft_steps": st.draft_steps, "draft_skip_ratio": st.draft_skip_ratio,
        "drafter": st.drafter, "tflops_rel": float(result.trace.tflops_rel),
        "tflops_rel_exact": float(result.trace.tflops_rel_exact), "layer_skip_ratio": None,
        "method_ratio": st.acceptance_rate,
    }
