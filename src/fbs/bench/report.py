"""Benchmark results as a versioned JSON document, a markdown table and a PNG plot.

The JSON layout is ``SCHEMA_VERSION``; every key is listed in ``RESULT_KEYS`` / ``TOP_KEYS`` (and described
in docs/bench.md). Adding keys is allowed within a version; renaming or removing one bumps the version.

Public entry points:
    result_record(res, ...)        one system x batch size as a JSON-ready dict
    long_context_record(res, ...)  one long-context measurement
    validate(doc)                  raise ValueError if a document lacks a documented key
    results_from_doc(doc)          the records back as SystemResults (older documents too: no runs, not paired)
    markdown(doc)                  the efficiency table (paper main-table columns + consistency + memory)
    plot(doc, path)                decode latency vs layer-skip ratio (PNG; needs matplotlib)
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from fbs.bench.harness import SystemResult, Summary

logger = logging.getLogger(__name__)

SCHEMA_VERSION = "fbs.bench/1"

#: Top-level keys of a result document and their meaning.
TOP_KEYS: dict[str, str] = {
    "schema": "schema version string, 'fbs.bench/1'",
    "created": "UTC time the run finished, ISO 8601",
    "command": "the command line that produced the document",
    "model": "base model: name, fingerprint, layers, parameters",
    "protocol": "prompt_len (the prompts' length; a cap for prompt sets other than text), new_tokens, warmup, runs, "
                "num_prompts, batch_sizes, greedy, eos_ignored, prompt_set (its name) and prompt_seed, prompt_source, "
                "prompts_sha256, timing notes; documents since prompt sets also prompt_set: {name, seed, cap, "
                "source, ids, lengths, mean_length, prompts_sha256} (fbs.bench.prompt_sets)",
    "environment": "fbs.provenance.provenance() (git commit and dirty flag, cpu and its ISA flags, threads, "
                   "python/torch/transformers versions, native kernels' build key and use), load average at start "
                   "and end",
    "machine": "measured read/copy/GEMV bandwidth (GB/s) and fp32 matmul throughput (GFLOP/s)",
    "results": "list of per-system records (RESULT_KEYS)",
    "long_context": "list of long-context records (LONG_KEYS); empty when not run",
}

#: Keys of every record in ``results``.
RESULT_KEYS: dict[str, str] = {
    "system": "system name (hf-greedy, hf-prompt-lookup, hf-early-exit-<k>, hf-assisted, fbs-...)",
    "family": "baseline | speculative | external (llama.cpp) | fbs | adaptive (fbs.baselines on the FBS engine)",
    "batch_size": "rows per generate call",
    "status": "ok | unavailable | failed",
    "note": "why a system is unavailable or failed; empty otherwise",
    "params": "the system's knobs",
    "latency_ms": "{prefill, decode, total}: each {median, mean, std, min, max} in ms over the measured runs, and "
                  "runs: every measured run's value in ms, in run order (round order when interleaved; run r used "
                  "prompt batch r mod num_prompts); speculative systems on the engine also draft: the part of decode "
                  "spent in the draft source, same layout",
    "decode_tok_s": "batch x (N-1) / median decode time: tokens after the first, per second (llama.cpp rows: "
                    "llama-bench's tg rate after prompt_len tokens of context)",
    "prefill_tok_s": "batch x prompt_len / median prefill time (prompt sets: median over runs of the run's prompt "
                     "length / its prefill time; prefill includes the first token's logits; llama.cpp "
                     "rows: llama-bench's pp rate from an empty context)",
    "throughput_tok_s": "batch x N / median total time",
    "speedup": "baseline median total latency / this system's, same batch size (ratio measured in one run)",
    "tflops_rel": "paper Eq. (tflops-rel): executed decode layer invocations / plain decoding's",
    "tflops_rel_exact": "executed decode MACs / plain decoding's, incl. attention over context, LM head, "
                        "K/V projections of project-skipped layers, drafts and verification, PAW/CH/SG",
    "bytes_rel": "bytes read while decoding / plain decoding's (weights of the layers that ran, once per step; "
                 "K/V cache; LM head; FBS modules), by the system's weight format; FBS and the baseline only",
    "skip_saving": "FBS systems other than fbs-full-compute (gated at tau 1 too: the gates cost): {reference, predicted, measured, captured}: decode-time saving over "
                   "fbs-full-compute predicted from the skipped bytes, measured (medians), and measured / predicted; "
                   "interleaved runs add the paired estimate over rounds: paired_saving_mean, paired_saving_median, "
                   "paired_ci_low, paired_ci_high (95% bootstrap CI of the mean), paired_p_value (one-sided sign "
                   "test of saving > 0), paired_n, captured_paired (null when not paired)",
    "decode_vs_ref_paired": "{reference, ratio_mean, ratio_median, ci_low, ci_high, n}: decode time / the first "
                            "measured system's, per interleaved round, with a 95% bootstrap CI of the mean; null "
                            "when not interleaved or the run counts differ",
    "layer_skip_ratio": "fraction of (token, layer) decode invocations skipped (FBS); 0 for the baseline",
    "method_ratio": "the paper's method-specific ratio in [0, 1]: layer-skip (FBS, FlexiDepth), FFN blocks skipped "
                    "(FFN-SkipLLM), acceptance rate (draft models, early exit), verified/advance ratio (prompt "
                    "lookup); 0 for the baseline",
    "method_ratio_kind": "layer_skip | ffn_skip | acceptance | verified_advance | none",
    "token_match_pct": "generated tokens equal to the baseline's at the same position, % (appendix E.8)",
    "exact_match_pct": "prompts whose whole generation equals the baseline's, %",
    "peak_rss_mb": "peak resident memory of the process during the measured runs (weights included)",
    "rss_before_mb": "resident memory right before the measured runs",
    "peak_device_mb": "torch.cuda.max_memory_allocated during the measured runs; null on CPU",
    "roofline": "{baseline_tok_s, system_tok_s, fraction_of_baseline, fraction_of_system, bound}",
    "probe": "raw statistics of the untimed probe run (passes, proposed, accepted, engine cross-checks, ...)",
    "budget": "{warmup, runs, probe_prompts} this system actually used: the protocol's, or the reduced budget "
              "of a slow system (--draft-runs: no warm-up, N runs, match rates over the first N prompts)",
    "full_depth": "speculative systems on the engine: {reference (the fbs-full-compute row of the same weights "
                  "format, compilation, batch policy and cache), token_match_pct, exact_match_pct (the greedy quality "
                  "column: 100 means lossless), exact_by_prompt, speedup_mean, speedup_median, speedup_ci_low, "
                  "speedup_ci_high, speedup_n (full-depth decode time / this system's per interleaved round, 95% "
                  "bootstrap CI of the mean, a prompt set's prompts resampled; null when not paired), "
                  "speedup_by_prompt (a prompt set: each prompt's mean speed-up, in prompt order; else null)}; null "
                  "otherwise",
    "draft": "speculative systems on the engine: {ms (median draft-source time per run), share_median (median over runs "
             "of draft / decode time), rounds (verify rounds per prompt), draft_ms_per_round, verify_ms_per_round, "
             "accepted_per_round, proposed_per_round}; null otherwise",
    "per_prompt": "batch size 1: per prompt {prompt_len, runs, prefill_ms, decode_ms (medians over its runs), "
                  "exact_vs_baseline, exact_vs_full_depth}; null otherwise",
    "llama_cpp": "llama.cpp rows: {source, version, build_flags, model_file, model_sha256, model_bytes, pp_avg_ts, "
                 "pp_stddev_ts, tg_avg_ts, tg_stddev_ts, samples} (build facts, and llama-bench's mean and std of the "
                 "per-run rates over the measured runs); null for other systems",
}

#: Result keys added after documents were first written: validate() accepts documents without them.
LATER_RESULT_KEYS = frozenset({"prefill_tok_s", "llama_cpp", "full_depth", "draft", "per_prompt"})

#: Keys of every record in ``long_context``.
LONG_KEYS: dict[str, str] = {
    "system": "system name",
    "requested_prompt_len": "prompt length asked for (8192 or 16384)",
    "prompt_len": "prompt length used: min(requested, max_position_embeddings - new_tokens)",
    "new_tokens": "generated tokens",
    "status": "ok | unavailable | failed",
    "note": "reason when not ok, or that the length was clipped",
    "ttft_ms": "median time to first token (prefill) in ms",
    "decode_tok_s": "(N-1) / median decode time",
    "total_ms": "median total latency in ms",
    "peak_rss_mb": "peak resident memory during the measured runs",
    "peak_device_mb": "torch.cuda.max_memory_allocated; null on CPU",
    "layer_skip_ratio": "as in results",
}


_STATS = ("median", "mean", "std", "min", "max")


def _summary_ms(s: Summary | None) -> dict[str, Any] | None:
    if s is None:
        return None
    return {**{k: 1e3 * getattr(s, k) for k in _STATS}, "runs": [1e3 * x for x in s.runs]}


def summary_from_ms(d: dict[str, Any] | None) -> Summary | None:
    """A ``latency_ms`` entry back in seconds; documents written before per-run values were kept give no runs."""
    if d is None:
        return None
    return Summary(**{k: d[k] / 1e3 for k in _STATS}, runs=[x / 1e3 for x in d.get("runs") or []])


def result_record(res: SystemResult, new_tokens: int, baseline_total_s: float | None,
                  match: tuple[float, float] | None, roofline: dict[str, Any] | None,
                  skip_saving: dict[str, Any] | None = None,
                  decode_vs_ref_paired: dict[str, Any] | None = None,
                  prompt_len: int | None = None, run_prompt_lens: list[int] | None = None) -> dict[str, Any]:
    """One system x batch size as a JSON-ready dict. ``run_prompt_lens``: each measured run's prompt length when the
    prompts differ in length (prefill tok/s is then the median over runs of length / prefill time)."""
    ok = res.status == "ok"
    B = res.batch_size
    probe = dict(res.probe or {})
    llama = probe.pop("llama_cpp", None)
    if llama is not None and ok and prompt_len:
        from fbs.bench.llama_cpp import rates

        llama = {**llama, **rates(res.prefill_s.runs, res.decode_s.runs, prompt_len, new_tokens)}
    kind = res.ratio_kind or "none"
    return {
        "system": res.name,
        "family": res.family,
        "batch_size": B,
        "status": res.status,
        "note": res.note,
        "params": res.params,
        "latency_ms": {"prefill": _summary_ms(res.prefill_s), "decode": _summary_ms(res.decode_s),
                       "total": _summary_ms(res.total_s),
                       **({"draft": _summary_ms(res.draft_s)} if res.draft_s is not None else {})},
        "decode_tok_s": B * (new_tokens - 1) / res.decode_s.median if ok and res.decode_s.median > 0 else None,
        "prefill_tok_s": _prefill_rate(res, B, prompt_len, run_prompt_lens) if ok else None,
        "throughput_tok_s": B * new_tokens / res.total_s.median if ok else None,
        "speedup": baseline_total_s / res.total_s.median if ok and baseline_total_s else None,
        "tflops_rel": probe.get("tflops_rel"),
        "tflops_rel_exact": probe.get("tflops_rel_exact"),
        "bytes_rel": probe.get("bytes_rel"),
        "skip_saving": skip_saving,
        "decode_vs_ref_paired": decode_vs_ref_paired,
        "layer_skip_ratio": probe.get("layer_skip_ratio"),
        "method_ratio": probe.get("method_ratio"),
        "method_ratio_kind": kind,
        "token_match_pct": match[0] if match else None,
        "exact_match_pct": match[1] if match else None,
        "peak_rss_mb": res.peak_rss_mb,
        "rss_before_mb": res.rss_before_mb,
        "peak_device_mb": res.peak_device_mb,
        "roofline": roofline,
        "probe": probe,
        "budget": res.budget,
        "llama_cpp": llama,
        "full_depth": None,  # set by the runner, which sees every row (fbs.bench.runner)
        "draft": None,
        "per_prompt": None,
    }


def _prefill_rate(res: SystemResult, B: int, prompt_len: int | None, run_lens: list[int] | None) -> float | None:
    if run_lens and len(run_lens) == len(res.prefill_s.runs) and all(t > 0 for t in res.prefill_s.runs):
        rates = sorted(B * n / t for n, t in zip(run_lens, res.prefill_s.runs))
        mid = len(rates) // 2
        return rates[mid] if len(rates) % 2 else (rates[mid - 1] + rates[mid]) / 2
    return B * prompt_len / res.prefill_s.median if prompt_len and res.prefill_s.median > 0 else None


def long_context_record(res: SystemResult, requested: int, used: int, new_tokens: int) -> dict[str, Any]:
    ok = res.status == "ok"
    note = res.note
    if ok and used != requested:
        note = f"clipped from {requested}: the model allows {used + new_tokens} positions"
    return {
        "system": res.name,
        "requested_prompt_len": requested,
        "prompt_len": used,
        "new_tokens": new_tokens,
        "status": res.status,
        "note": note,
        "ttft_ms": 1e3 * res.prefill_s.median if ok else None,
        "decode_tok_s": res.batch_size * (new_tokens - 1) / res.decode_s.median if ok else None,
        "total_ms": 1e3 * res.total_s.median if ok else None,
        "peak_rss_mb": res.peak_rss_mb,
        "peak_device_mb": res.peak_device_mb,
        "layer_skip_ratio": (res.probe or {}).get("layer_skip_ratio"),
    }


def validate(doc: dict[str, Any]) -> None:
    """Raise ValueError naming every documented key a document lacks (or an unknown schema version)."""
    problems = []
    if doc.get("schema") != SCHEMA_VERSION:
        problems.append(f"schema is {doc.get('schema')!r}, expected {SCHEMA_VERSION!r}")
    problems += [f"missing top-level key {k!r}" for k in TOP_KEYS if k not in doc]
    for i, rec in enumerate(doc.get("results", [])):
        problems += [f"results[{i}] lacks {k!r}" for k in RESULT_KEYS if k not in rec and k not in LATER_RESULT_KEYS]
    for i, rec in enumerate(doc.get("long_context", [])):
        problems += [f"long_context[{i}] lacks {k!r}" for k in LONG_KEYS if k not in rec]
    if problems:
        raise ValueError("invalid benchmark document: " + "; ".join(problems))


def results_from_doc(doc: dict[str, Any]) -> list[SystemResult]:
    """The ``results`` records of a document as SystemResults (timings in seconds, probe, budget; no outputs), to
    recompute comparisons such as ``runner.skip_saving`` from a saved file (pass it the results of one batch size:
    only those were measured together). ``interleaved`` is the document's ``protocol.interleave``. Documents from
    before per-run values were kept load with empty ``runs``, so nothing pairs."""
    interleaved = bool((doc.get("protocol") or {}).get("interleave"))
    pset = (doc.get("protocol") or {}).get("prompt_set")
    # a prompt set's measured run r timed prompt r mod n (runner.check_prompt_set): its paired CIs resample prompts
    n_set = len(pset["ids"]) if isinstance(pset, dict) and pset.get("name", "text") != "text" else 0
    out = []
    for r in doc["results"]:
        lat = r.get("latency_ms") or {}
        kind = r.get("method_ratio_kind")
        decode = summary_from_ms(lat.get("decode"))
        runs = len(decode.runs) if decode is not None else 0
        out.append(SystemResult(
            name=r["system"], family=r["family"], batch_size=r["batch_size"], params=r.get("params") or {},
            ratio_kind=None if kind in (None, "none") else kind, status=r.get("status", "ok"),
            note=r.get("note", ""), prefill_s=summary_from_ms(lat.get("prefill")),
            decode_s=decode, total_s=summary_from_ms(lat.get("total")),
            draft_s=summary_from_ms(lat.get("draft")),
            peak_rss_mb=r.get("peak_rss_mb"), rss_before_mb=r.get("rss_before_mb"),
            peak_device_mb=r.get("peak_device_mb"), probe=r.get("probe") or {}, budget=r.get("budget") or {},
            interleaved=interleaved,
            clusters=[i % n_set for i in range(runs)] if n_set and runs and (runs % n_set == 0 or runs <= n_set)
            else None))  # before s31 runs could time some prompts more often: rounds resampled then
    return out


def save_json(doc: dict[str, Any], path: Path) -> None:
    validate(doc)
    path.write_text(json.dumps(doc, indent=2, sort_keys=False, default=_jsonable) + "\n")


def _jsonable(x):
    if hasattr(x, "tolist"):
        return x.tolist()
    if dataclasses.is_dataclass(x):
        return dataclasses.asdict(x)
    return str(x)


# ----------------------------------------------------------------------------------------------- markdown


def _f(x, fmt: str, scale: float = 1.0) -> str:
    return "–" if x is None else format(x * scale, fmt)


def _paired_cell(sv: dict[str, Any]) -> str:
    """``mean [low, high]`` of the paired saving in % (its rounds are the header's measured runs: only equal run
    counts pair); – for documents without it or runs that were not interleaved."""
    if sv.get("paired_saving_mean") is None:
        return "–"
    return f"{100 * sv['paired_saving_mean']:.1f} [{100 * sv['paired_ci_low']:.1f}, {100 * sv['paired_ci_high']:.1f}]"


def _p(p: float | None) -> str:
    return "–" if p is None else "<0.001" if p < 1e-3 else f"{p:.3f}"


def markdown(doc: dict[str, Any]) -> str:
    """Efficiency table shaped like the paper's main table (latency, TFLOPs(rel), method ratio) plus the
    prefill/decode split, consistency with the baseline (appendix E.8), memory and roofline fraction."""
    p = doc["protocol"]
    ps = p.get("prompt_set")
    prompts = (f"prompt {p['prompt_len']}" if not ps or ps["name"] == "text" else
               f"prompt set {ps['name']} ({len(ps['lengths'])} prompts of {min(ps['lengths'])}-{max(ps['lengths'])} "
               f"tokens, mean {ps['mean_length']:.0f}, cap {ps['cap']}, seed {ps['seed']})")
    head = (f"{prompts} -> {p['new_tokens']} new tokens, greedy, EOS ignored; median of "
            f"{p['runs']} runs after {p['warmup']} warm-up"
            f"{' (systems interleaved round by round)' if p.get('interleave') else ''}; {doc['environment']['cpu']}, "
            f"{doc['environment']['torch_threads']} threads, torch {doc['environment']['torch']}")
    cols = ["System", "B", "Latency (ms)", "± std", "Prefill (ms)", "Decode (ms)", "Prefill tok/s", "Decode tok/s",
            "Speed-up",
            "TFLOPs (rel)", "TFLOPs (rel, exact)", "Bytes (rel)", "Ratio (%)", "Ratio kind", "Token-match (%)",
            "Exact-match (%)", "Peak RSS (MB)", "Roofline (%)"]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in doc["results"]:
        if r["status"] != "ok":
            lines.append(f"| {r['system']} | {r['batch_size']} | {r['status']}: {r['note']} |"
                         + " |" * (len(cols) - 3))
            continue
        lat = r["latency_ms"]
        roof = r.get("roofline") or {}
        b = r.get("budget") or {}
        name = r["system"]
        if b and (b["runs"], b["warmup"]) != (p["runs"], p["warmup"]):
            name += f" ({b['runs']} run{'s' if b['runs'] != 1 else ''}, {b['warmup']} warm-up, " \
                    f"{b['probe_prompts']} prompt{'s' if b['probe_prompts'] != 1 else ''} matched)"
        lines.append("| " + " | ".join([
            name, str(r["batch_size"]), _f(lat["total"]["median"], ".0f"), _f(lat["total"]["std"], ".0f"),
            _f(lat["prefill"]["median"], ".0f"), _f(lat["decode"]["median"], ".0f"), _f(r.get("prefill_tok_s"), ".0f"),
            _f(r["decode_tok_s"], ".1f"),
            _f(r["speedup"], ".2f"), _f(r["tflops_rel"], ".2f"), _f(r["tflops_rel_exact"], ".2f"),
            _f(r.get("bytes_rel"), ".2f"), _f(r["method_ratio"], ".1f", 100), r["method_ratio_kind"], _f(r["token_match_pct"], ".1f"),
            _f(r["exact_match_pct"], ".1f"), _f(r["peak_rss_mb"], ".0f"),
            _f(roof.get("fraction_of_baseline"), ".0f", 100),
        ]) + " |")
    savings = [r for r in doc["results"] if r.get("skip_saving")]
    if savings:
        lines += ["", "Skipping vs the same engine at full depth (`fbs-full-compute`): decode-time saving predicted "
                      "from the skipped bytes, measured (medians), and the share of the prediction captured. Paired "
                      "(interleaved runs only): mean over rounds of 1 − decode / decode(full) of the same round, "
                      "[95% bootstrap CI], one-sided sign-test p of saving > 0, and mean / predicted; quote these "
                      "for small savings. A row that skips 0 % (gates evaluated at tau 1) shows the gates' cost as a "
                      "negative saving.", "",
                  "| System | B | Skip (%) | Predicted saving (%) | Measured saving (%) | Captured (%) | "
                  "Paired saving (%) [95% CI] | p | Captured, paired (%) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in savings:
            sv = r["skip_saving"]
            lines.append(f"| {r['system']} | {r['batch_size']} | {_f(r['layer_skip_ratio'], '.1f', 100)} | "
                         f"{_f(sv['predicted'], '.1f', 100)} | {_f(sv['measured'], '.1f', 100)} | "
                         f"{_f(sv['captured'], '.0f', 100)} | {_paired_cell(sv)} | {_p(sv.get('paired_p_value'))} | "
                         f"{_f(sv.get('captured_paired'), '.0f', 100)} |")
    lines += _speculative_table(doc)
    m = doc.get("machine") or {}
    if m:
        lines += ["", f"Machine: read {m['read_gbs']:.1f} GB/s, GEMV {m['gemv_gbs']:.1f} GB/s, fp32 matmul "
                      f"{m['matmul_gflops']:.0f} GFLOP/s. Roofline (%) = decode tok/s over the plain-decoding "
                      f"bound of this machine."]
    if doc.get("long_context"):
        lines += ["", "| System | Prompt | TTFT (ms) | Decode tok/s | Total (ms) | Peak RSS (MB) | Note |",
                  "|---|---|---|---|---|---|---|"]
        for r in doc["long_context"]:
            lines.append(f"| {r['system']} | {r['prompt_len']} | {_f(r['ttft_ms'], '.0f')} | "
                         f"{_f(r['decode_tok_s'], '.1f')} | {_f(r['total_ms'], '.0f')} | "
                         f"{_f(r['peak_rss_mb'], '.0f')} | {r['note'] or r['status']} |")
    return "\n".join(lines) + "\n"


def _speculative_table(doc: dict[str, Any]) -> list[str]:
    """Speculative decoding on the engine's verifier (Group A, the lossless FBS drafts): the greedy quality column
    (exact match against full depth in the same format), the paired decode speed-up over it, and why: acceptance,
    tokens kept per round, verify rounds, and the share of decode time spent drafting."""
    rows = [r for r in doc["results"] if r["status"] == "ok" and (r.get("full_depth") or r.get("draft"))]
    if not rows:
        return []
    out = ["", "Speculative decoding on the engine's verifier, against full depth in the same format (`full_depth`): "
               "exact match (greedy: 100 = lossless), decode speed-up (full-depth decode time / this one's, per "
               "interleaved round, mean [95% bootstrap CI; a prompt set's resamples its prompts]), acceptance "
               "(drafted tokens kept / proposed), drafted "
               "tokens kept and proposed per verify round, verify rounds per prompt, and the decode time spent in the "
               "draft source (median share over runs; ms per round) against the rest (the verifier's pass and "
               "bookkeeping, ms per round); with a prompt set, the range of the prompts' own speed-ups.", "",
           "| System | B | Exact vs full (%) | Speed-up vs full [95% CI] | Acceptance (%) | Kept / round | "
           "Proposed / round | Rounds | Draft share (%) | Draft ms / round | Verify ms / round | "
           "Per prompt (min-max) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fd, dr, pr = r.get("full_depth") or {}, r.get("draft") or {}, r.get("probe") or {}
        speed = "–" if fd.get("speedup_mean") is None else \
            f"{fd['speedup_mean']:.2f} [{fd['speedup_ci_low']:.2f}, {fd['speedup_ci_high']:.2f}]"
        out.append(f"| {r['system']} | {r['batch_size']} | {_f(fd.get('exact_match_pct'), '.1f')} | {speed} | "
                   f"{_f(pr.get('acceptance_rate'), '.1f', 100)} | {_f(dr.get('accepted_per_round'), '.2f')} | "
                   f"{_f(dr.get('proposed_per_round'), '.2f')} | {_f(dr.get('rounds'), '.1f')} | "
                   f"{_f(dr.get('share_median'), '.1f', 100)} | {_f(dr.get('draft_ms_per_round'), '.2f')} | "
                   f"{_f(dr.get('verify_ms_per_round'), '.2f')} | {_spread(fd.get('speedup_by_prompt'))} |")
    return out


def _spread(values: list[float] | None) -> str:
    """'min-max' of per-prompt values (two decimals), '–' without them."""
    return "–" if not values else f"{min(values):.2f}-{max(values):.2f}"


# ----------------------------------------------------------------------------------------------- plot


def plot(doc: dict[str, Any], path: Path) -> bool:
    """Decode latency (median ± std) vs layer-skip ratio, batch size 1; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plot (scripts/install_bench_deps.sh installs it)")
        return False
    rows = [r for r in doc["results"] if r["status"] == "ok" and r["batch_size"] == 1]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    base = [r for r in rows if r["family"] == "baseline"]
    if base:
        ax.axhline(base[0]["latency_ms"]["decode"]["median"], color="grey", ls="--", lw=1,
                   label=f"{base[0]['system']} (no skip)")
    markers = {"fbs": "o", "speculative": "s", "baseline": "D", "external": "^", "adaptive": "v"}
    core = [r["latency_ms"]["decode"]["median"] for r in rows if r["family"] != "speculative"]
    top = 1.5 * max(core) if core else None  # speculative rows far above the rest are drawn at the edge
    labels: list[tuple[float, float, str]] = []
    for fam in ("fbs", "adaptive", "speculative", "external", "baseline"):
        pts = [r for r in rows if r["family"] == fam]
        if not pts:
            continue
        xs = [100 * (r["layer_skip_ratio"] or 0.0) for r in pts]
        ys = [r["latency_ms"]["decode"]["median"] for r in pts]
        es = [r["latency_ms"]["decode"]["std"] for r in pts]
        clipped = [top is not None and y > top for y in ys]
        ys_drawn = [top if c else y for y, c in zip(ys, clipped)]
        es_drawn = [0.0 if c else e for e, c in zip(es, clipped)]
        ax.errorbar(xs, ys_drawn, yerr=es_drawn, fmt=markers[fam], capsize=3, label=fam)
        for x, y, r, c in zip(xs, ys_drawn, pts, clipped):
            label = r["system"] + (f" (off scale: {r['latency_ms']['decode']['median']:.0f} ms)" if c else "")
            labels.append((x, y, label))
    # labels of points close together are stacked downwards instead of printed over each other
    span = top if top is not None else max((y for _, y, _ in labels), default=1.0)
    placed: list[tuple[float, float]] = []
    for x, y, label in sorted(labels, key=lambda t: (t[0], -t[1])):
        k = sum(1 for px, py in placed if abs(px - x) < 2.0 and abs(py - y) < 0.06 * span)
        placed.append((x, y))
        ax.annotate(label, (x, y), fontsize=6, xytext=(4, 3 - 8 * k), textcoords="offset points")
    if top is not None:
        ax.set_ylim(0, top * 1.05)
    p = doc["protocol"]
    ax.set_xlabel("layer-skip ratio (%)  [speculative methods and llama.cpp skip no layers: at 0]")
    ax.set_ylabel(f"decode latency, {p['new_tokens'] - 1} tokens (ms)")
    ps = p.get("prompt_set")
    what = f"prompt {p['prompt_len']}" if not ps or ps["name"] == "text" else f"prompt set {ps['name']}"
    ax.set_title(f"{doc['model']['name']}: {what}, batch 1, {doc['environment']['cpu']}",
                 fontsize=8)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
