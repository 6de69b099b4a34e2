"""One benchmark run: load the model once, build every system, measure them side by side, assemble the document.

Public entry points:
    RunSpec                 what to run (systems, sweeps, batch sizes, long-context lengths)
    build_systems(...)      the system objects for a spec
    run(spec, bench, argv)  -> the result document (see report.py for its schema)
    write_outputs(doc, dir) -> paths of bench.json, bench.md and bench.png
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from fbs.bench import report
from fbs.bench.harness import (PROMPT_SOURCE, BenchConfig, SystemResult, build_prompts, environment, match_rates,
                               measure, measure_interleaved, paired_decode, prompts_digest)
from fbs.bench.prompt_sets import SOURCES, build_prompt_set
from fbs import native
from fbs.bench.llama_cpp import FORMATS as LLAMA_CPP_FORMATS
from fbs.bench.llama_cpp import KV_TYPES as LLAMA_CPP_KV_TYPES
from fbs.bench.llama_cpp import LlamaBenchSystem, system_name
from fbs.bench.llama_cpp import formats_for as llama_cpp_formats_for
from fbs.bench.roofline import MachinePeaks, decode_roofline, measure_machine, system_format
from fbs.bench.systems import (GROUP_A, FBSSystem, SpeculativeSystem, ffn_skip_systems, flexidepth_systems,
                               forced_plan, group_a_systems, hf_assisted, hf_early_exit, hf_greedy, hf_prompt_lookup,
                               lossless_systems)
from fbs.engine.defaults import AUTO, PREFILL_CHOICES, resolve_kv_dtype, resolve_prefill
from fbs.engine.flops import LayerCost
from fbs.engine.fused import WEIGHTS
from fbs.engine.cache import kv_storage_dtype
from fbs.engine.kvpolicy import make_policy, prefill_chunk_size

logger = logging.getLogger(__name__)

#: llama.cpp's formats, one group each (llama-bench on the GGUF of that format).
LLAMA_CPP_GROUPS = tuple(system_name(f) for f in LLAMA_CPP_FORMATS)
#: System groups accepted by ``RunSpec.systems`` (``all`` = every group).
GROUPS = ("hf-greedy", "prompt-lookup", "early-exit", "assisted", *LLAMA_CPP_GROUPS, "fbs-bare", "fbs-full",
          "fbs-tau", "fbs-hole", "fbs-protect", "fbs-plan", "ffn-skipllm", "flexidepth", "fbs-lossless",
          "draft-verify", "kangaroo", *GROUP_A)
#: Names that stand for several groups.
ALIASES = {"llama-cpp": LLAMA_CPP_GROUPS, "group-a": tuple(GROUP_A)}
#: The lossless speculative groups (fbs.engine.speculative), run on the FBS model.
LOSSLESS_GROUPS = ("fbs-lossless", "draft-verify", "kangaroo")


@dataclasses.dataclass
class RunSpec:
    """What one ``fbs bench`` run measures. Defaults: every system at batch 1, no long-context pass."""

    base: str = "smollm2-135m"
    """Bundled base model name or HF directory."""
    checkpoint: str | None = None
    """FBS checkpoint directory; None = the weights shipped for ``base``, else untrained FBS modules."""
    fresh: bool = False
    """Ignore shipped FBS weights (untrained gates: nothing is skipped at any tau above ~0.02)."""
    systems: tuple[str, ...] = ("all",)
    taus: tuple[float, ...] = (0.5, 0.7, 0.9)
    """Skip thresholds of the FBS tau sweep (the checkpoint's own tau is the `fbs-hole` / `fbs-protect` one)."""
    plans: tuple[float, ...] = (0.25, 0.5)
    """Forced static plans: fraction of all layers skipped (spread over the skippable layers), `project` KV."""
    early_exit_layer: int | None = None
    """Draft depth of HF self-speculative early exit; None = half the layers."""
    num_assistant_tokens: int = 5
    prompt_lookup_tokens: int = 10
    draft: str | None = None
    """Draft model (name or HF directory) for assisted generation; None = report that none is available."""
    draft_runs: int | None = None
    """Reduced budget for assisted generation (no warm-up, this many runs and matched prompts); None = protocol."""
    batch_sizes: tuple[int, ...] = (1,)
    long_context: tuple[int, ...] = ()
    """Long-context prompt lengths (paper: 8192, 16384), clipped to the model's positions minus new tokens."""
    long_warmup: int = 1
    long_runs: int = 3
    machine_mb: int = 256
    """Buffer size of the bandwidth measurement (well above the last-level cache)."""
    matmul_n: int = 2048
    """Side of the square fp32 matmul that measures peak throughput."""
    device: str = "cpu"
    """Where the models run (``cuda`` works through the same code path but has not been measured here)."""
    weights: tuple[str, ...] = ("fp32",)
    """Decode weight formats of the FBS systems (``fp32``, ``bf16``, ``int8``, ``hf`` = the HF modules): each FBS
    system runs once per format; formats other than fp32 add ``-<format>`` to its name."""
    compile: bool | tuple[bool, ...] = False
    """``torch.compile`` the engine's one-token layer step (the probe run absorbs the first compile); a tuple runs
    every FBS system once per mode (``(False, True)``: eager and compiled side by side, interleaved like the
    rest). Compiled variants add ``-compiled`` to their names."""
    batch_policies: tuple[str, ...] = ("gather",)
    """Engine batch policies of the FBS systems (gather, all, majority); others than gather add ``-<policy>``."""
    ffn_skip_thresholds: tuple[float, ...] = (0.984, 0.988)
    """FFN-SkipLLM's cosine-saturation thresholds, one system each (:mod:`fbs.baselines.ffn_skip`): a lower
    threshold skips more FFN blocks (:class:`fbs.baselines.FFNSkipLLM`)."""
    flexidepth: str | None = None
    """FlexiDepth checkpoint (``fbs train flexidepth`` output); None = the row says how to make one."""
    flexidepth_taus: tuple[float, ...] = ()
    """FlexiDepth's router thresholds, one system each (``flexidepth-tau<t>``); empty = the checkpoint's tau."""
    draft_tokens: int | None = None
    """Most tokens drafted per verification pass of the lossless systems; None = the engine's default."""
    llama_kv_types: tuple[str, ...] = ("f16",)
    """llama.cpp systems: each once per KV cache type (``fbs.bench.llama_cpp.KV_TYPES``; q8_0 with flash attention,
    named ``<system>-kvq8_0``)."""
    native_trees: bool = False
    """Group A: each system also once with ``native_trees`` (``<name>-trees``: whole token trees verified in the
    native multi-token steps; the plain rows verify their chains there)."""
    draft_layers: str | None = None
    """Draft&Verify's static skip set (``fbs train draft-search`` JSON, or a comma list); None = the row says how."""
    kangaroo: str | None = None
    """Kangaroo adapter directory (``fbs train kangaroo``); None = the row says how to make one."""
    lossless_taus: tuple[float, ...] = ()
    group_a_paths: dict | None = None
    """Group A's trained drafts by draft name (specdec, medusa, eagle); medusa / eagle default to the shipped ones."""
    """More ``fbs-lossless`` rows, one per draft tau (``fbs-lossless-tau<t>``), besides the checkpoint's tau."""
    kv_caches: tuple[str, ...] = ("full",)
    """KV cache policies of the FBS systems (full, streaming, h2o, snapkv; :mod:`fbs.engine.kvpolicy`): each
    non-lossless FBS system runs once per policy; policies other than full add ``-<policy><budget>``."""
    kv_budget: int | None = None
    """Entries a KV cache policy keeps per layer and KV head (required when ``kv_caches`` names one)."""
    prefill_chunk: int | None = None
    """Prompt tokens per prefill chunk of the non-lossless FBS systems (None: the engine's default; 0: the whole
    prompt); a value adds ``-prefill<N>`` to their names."""
    kv_dtypes: tuple[str, ...] = ("auto",)
    """KV cache storage dtypes of the FBS systems (auto, fp32, fp16, bf16; :data:`fbs.engine.cache.KV_DTYPES`; auto:
    each format's default, :func:`fbs.engine.defaults.default_kv_dtype`): each FBS system runs once per dtype;
    dtypes other than fp32 add ``-kv<dtype>``."""
    prefills: tuple[str, ...] = ("auto",)
    """How the FBS systems run a prompt's products (auto, fp32, bf16, int8, blocks; :mod:`fbs.engine.prefill`; auto: each
    format's default, :func:`fbs.engine.defaults.default_prefill`): each FBS system runs once per choice; a choice
    other than fp32 adds ``-<choice>prefill`` (``-bf16prefill``, ``-int8prefill``, ...)."""

    def __post_init__(self) -> None:
        unknown = set(self.systems) - set(GROUPS) - set(ALIASES) - {"all"}
        if unknown:
            aliases = "; ".join(f"{a} = {','.join(g)}" for a, g in ALIASES.items())
            raise ValueError(f"unknown systems {sorted(unknown)}; choose from all, {', '.join(GROUPS)} "
                             f"(aliases: {aliases})")
        if any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch sizes must be >= 1, got {self.batch_sizes}")
        if set(self.weights) - set(WEIGHTS) or not self.weights:
            raise ValueError(f"weights must be a non-empty list from {', '.join(WEIGHTS)}, got {self.weights}")
        if set(self.batch_policies) - {"gather", "all", "majority"} or not self.batch_policies:
            raise ValueError(f"batch policies must be from gather, all, majority, got {self.batch_policies}")
        modes = self.compile if isinstance(self.compile, tuple) else (self.compile,)
        if not modes or any(not isinstance(m, bool) for m in modes) or len(set(modes)) != len(modes):
            raise ValueError(f"compile must be a bool or a tuple of distinct bools, got {self.compile!r}")
        if not self.kv_caches:
            raise ValueError("kv_caches must name at least one policy (full for the full cache)")
        if not self.llama_kv_types or set(self.llama_kv_types) - set(LLAMA_CPP_KV_TYPES) \
                or len(set(self.llama_kv_types)) != len(self.llama_kv_types):
            raise ValueError(f"llama_kv_types must be distinct names from {', '.join(LLAMA_CPP_KV_TYPES)}, "
                             f"got {self.llama_kv_types}")
        for kv in self.kv_caches:
            prefill_chunk_size(self.prefill_chunk, make_policy(kv, None if kv == "full" else self.kv_budget))
        if not self.kv_dtypes or len(set(self.kv_dtypes)) != len(self.kv_dtypes):
            raise ValueError(f"kv_dtypes must name distinct storage dtypes (auto for the default), got {self.kv_dtypes}")
        for kvd in self.kv_dtypes:
            if kvd != AUTO:
                kv_storage_dtype(kvd, torch.float32)
        if not self.prefills or set(self.prefills) - set(PREFILL_CHOICES) or len(set(self.prefills)) != len(self.prefills):
            raise ValueError(f"prefills must name distinct choices from {', '.join(PREFILL_CHOICES)}, got {self.prefills}")
        if self.draft_runs is not None and self.draft_runs < 1:
            raise ValueError(f"draft_runs must be >= 1, got {self.draft_runs}")

    def wants(self, group: str) -> bool:
        return ("all" in self.systems or group in self.systems
                or any(group in ALIASES.get(name, ()) for name in self.systems))


# ----------------------------------------------------------------------------------------------- loading


def load_fbs(model, tok, spec: RunSpec):
    """The FBS model over the already-loaded base, and a note on where its modules came from.

    Untrained modules share the base's weights. A trained checkpoint with Stage-1 adapters gets a private,
    merged copy of the base (:func:`fbs.model.loading.load_checkpoint`), so the HF systems keep running the base model
    and the FBS systems pay no adapter overhead; the FBS rows' peak RSS includes that copy."""
    from fbs.model import loading

    ckpt = loading.choose_checkpoint(spec.base, spec.checkpoint, shipped=not spec.fresh)
    model = loading.load_fbs(model, ckpt, shipped=False, tokenizer=tok)
    return model, (f"checkpoint {ckpt}" if ckpt is not None else "untrained FBS modules (no checkpoint)")


def build_systems(model, tok, fbs_model, spec: RunSpec, draft=None, draft_tok=None) -> list:
    L = model.config.num_hidden_layers
    systems: list = []
    if spec.wants("hf-greedy"):
        systems.append(hf_greedy(model))
    if spec.wants("prompt-lookup"):
        systems.append(hf_prompt_lookup(model, spec.prompt_lookup_tokens))
    if spec.wants("early-exit"):
        systems.append(hf_early_exit(model, spec.early_exit_layer or L // 2, spec.num_assistant_tokens))
    if spec.wants("assisted"):
        systems.append(hf_assisted(model, draft, tok, draft_tok, spec.num_assistant_tokens, spec.draft_runs))
    systems += [LlamaBenchSystem(fmt, spec.base, kv_type=kv) for fmt, group in zip(LLAMA_CPP_FORMATS, LLAMA_CPP_GROUPS)
                if spec.wants(group) and fmt in llama_cpp_formats_for(spec.base) for kv in spec.llama_kv_types]
    if spec.wants("ffn-skipllm"):
        systems += ffn_skip_systems(model, tok, spec.ffn_skip_thresholds)
    if spec.wants("flexidepth"):
        systems += flexidepth_systems(model, tok, spec.flexidepth, spec.flexidepth_taus)
    if fbs_model is None:
        return _decode_variants(systems, spec)
    tau0 = fbs_model.config.tau
    if spec.wants("fbs-bare"):
        from fbs import FBSForCausalLM

        # the engine alone: same backbone, no PAW / CH layers, no gates evaluated (the overhead reference)
        bare = FBSForCausalLM.from_base(model, config=fbs_model.config.replace(paw_layers=(), ch_layers=()),
                                        tokenizer=tok).eval()
        systems.append(FBSSystem("fbs-bare-engine", bare, {"force_compute": True}))
    if spec.wants("fbs-full"):
        systems.append(FBSSystem("fbs-full-compute", fbs_model, {"force_compute": True}))
    if spec.wants("fbs-tau"):
        systems += [FBSSystem(f"fbs-tau{t:g}", fbs_model, {"tau": t, "kv_policy": "project"}) for t in spec.taus]
    if spec.wants("fbs-hole"):
        systems.append(FBSSystem(f"fbs-tau{tau0:g}-hole", fbs_model, {"tau": tau0, "kv_policy": "hole"}))
    if spec.wants("fbs-protect"):
        systems.append(FBSSystem(f"fbs-tau{tau0:g}-protect", fbs_model, {"tau": tau0, "protect_structure": True}))
    if spec.wants("fbs-plan"):
        never = set(fbs_model.layers_cfg.never_skip)
        for frac in spec.plans:
            plan = forced_plan(L, frac, never)
            pct = round(100 * plan.float().mean().item())
            systems.append(FBSSystem(f"fbs-plan{pct}", fbs_model, {"skip_plan": plan, "kv_policy": "project"}))
            systems.append(FBSSystem(f"fbs-plan{pct}-hole", fbs_model, {"skip_plan": plan, "kv_policy": "hole"}))
    wanted = [g for g in LOSSLESS_GROUPS if spec.wants(g)]
    if wanted:
        systems += lossless_systems(fbs_model, spec.draft_tokens, spec.draft_layers, spec.kangaroo, wanted,
                                    spec.lossless_taus)
    group_a = [g for g in GROUP_A if spec.wants(g)]
    if group_a:
        systems += group_a_systems(fbs_model, group_a, spec.group_a_paths, spec.draft_tokens, spec.native_trees)
    return _decode_variants(systems, spec)


#: knobs :func:`_decode_variants` adds to every FBS system
ENGINE_VARIANT_KNOBS = frozenset({"weights", "compile", "batch_policy", "kv_cache", "kv_budget", "prefill_chunk",
                                  "kv_dtype", "prefill"})


def _decode_variants(systems: list, spec: RunSpec) -> list:
    """Every FBS system once per decode weight format (``spec.weights``), compile mode (``spec.compile``) and batch
    policy (``spec.batch_policies``); the defaults (fp32, eager, gather) keep the system's name, others add a
    suffix. ``hf`` weights are never compiled (one eager variant)."""
    modes = spec.compile if isinstance(spec.compile, tuple) else (spec.compile,)
    out = []
    for s in systems:
        if not isinstance(s, FBSSystem):
            out.append(s)
            continue
        for w in spec.weights:
            for comp in (False,) if w == "hf" else modes:
                for policy in spec.batch_policies:
                    # lossless systems roll drafts back, which an evicting cache cannot: full cache only
                    for kv in ("full",) if isinstance(s, SpeculativeSystem) else spec.kv_caches:
                        for kvd in dict.fromkeys(resolve_kv_dtype(k, w) for k in spec.kv_dtypes):
                            for pre in dict.fromkeys(resolve_prefill(p, w) for p in spec.prefills):
                                name = (s.name + ("" if w == "fp32" else f"-{w}") + ("-compiled" if comp else "")
                                        + ("" if policy == "gather" else f"-{policy}")
                                        + ("" if kv == "full" else f"-{kv}{spec.kv_budget}")
                                        + ("" if kvd == "fp32" else f"-kv{kvd}")
                                        + ("" if pre == "fp32" else f"-{pre}prefill"))
                                knobs = {**s.knobs, "weights": w, "compile": comp, "batch_policy": policy}
                                if kv != "full":
                                    knobs.update(kv_cache=kv, kv_budget=spec.kv_budget)
                                if kvd != "fp32":
                                    knobs.update(kv_dtype=kvd)
                                if pre != "fp32":
                                    knobs.update(prefill=pre)
                                if spec.prefill_chunk is not None and not isinstance(s, SpeculativeSystem):
                                    name += f"-prefill{spec.prefill_chunk}"
                                    knobs["prefill_chunk"] = spec.prefill_chunk
                                out.append(dataclasses.replace(s, name=name, knobs=knobs))
    return out


# ----------------------------------------------------------------------------------------------- running


def _roofline(res: SystemResult, cost: LayerCost, peaks: MachinePeaks, bench: BenchConfig,
              extra_bytes: float) -> dict[str, Any] | None:
    if res.status != "ok":
        return None
    B = res.batch_size
    base = decode_roofline(cost, peaks, bench.prompt_len, bench.new_tokens, B)
    tok_s = B * (bench.new_tokens - 1) / res.decode_s.median
    out = {"baseline_tok_s": base["tok_s"], "bound": base["bound"], "fraction_of_baseline": tok_s / base["tok_s"],
           "system_tok_s": None, "fraction_of_system": None}
    skip = (res.probe or {}).get("layer_skip_ratio")
    if res.family == "external":
        skip = 0.0
    fmt = system_format(res.params)
    if res.family in ("baseline", "fbs", "external") and skip is not None and fmt is not None:
        policy = res.params.get("kv_policy", "project")
        own = decode_roofline(cost, peaks, bench.prompt_len, bench.new_tokens, B, 1.0 - skip, policy, weights=fmt,
                              kv_dtype=res.params.get("kv_dtype"))
        if res.family == "fbs":  # the added modules' weights are read every step too
            own_bytes = own["bytes_per_step"] + extra_bytes
            own["step_s"] = max(own_bytes / (peaks.bandwidth_gbs * 1e9), own["step_s"])
            own["tok_s"] = B / own["step_s"]
        out["system_tok_s"] = own["tok_s"]
        out["fraction_of_system"] = tok_s / own["tok_s"]
    return out


#: Keys ``skip_saving`` adds for the paired estimate (null when the two systems' runs do not pair).
PAIRED_SAVING_KEYS = ("paired_saving_mean", "paired_saving_median", "paired_ci_low", "paired_ci_high",
                      "paired_p_value", "paired_n", "captured_paired")


def skip_saving(res: SystemResult, results: list[SystemResult]) -> dict[str, Any] | None:
    """Decode-time saving of a layer-skipping FBS system over the same engine at full depth (``fbs-full-compute``
    with the same weights, batch policy and compilation), against the saving its skipped bytes predict
    (decoding is bandwidth-bound): ``captured`` = measured / predicted, from the two medians.

    When both ran in the same interleaved rounds, the paired estimate too: per round r, saving_r =
    1 - decode[r] / decode_full[r]; ``paired_saving_mean`` / ``_median`` over the rounds, ``paired_ci_low`` /
    ``_high`` the 95 % bootstrap CI of the mean (rounds resampled), ``paired_p_value`` the one-sided sign test of
    saving > 0, ``paired_n`` the rounds and ``captured_paired`` = mean saving / predicted. The two medians come
    from runs spread over the whole measurement and keep the machine's drift; a round's pair does not, which
    is what resolves a saving of a few percent. The paired keys are null otherwise.

    A gated system that skips nothing (``--taus 1.0``: every gate evaluated, none fires) is included too: its
    "saving" is minus the gates' cost over the engine without gates (predicted ~0, ``captured`` null)."""
    if (res.status != "ok" or res.family != "fbs" or res.name.startswith("fbs-full-compute")
            or (res.probe or {}).get("layer_skip_ratio") is None):
        return None
    same = ("weights", "batch_policy", "compile", "kv_cache", "kv_budget", "kv_dtype", "prefill")
    full = next((r for r in results if r.name.startswith("fbs-full-compute") and r.status == "ok"
                 and all(r.params.get(k) == res.params.get(k) for k in same)), None)
    mine, ref = (res.probe or {}).get("bytes_rel"), ((full.probe or {}) if full else {}).get("bytes_rel")
    if not mine or not ref:
        return None
    predicted = 1.0 - mine / ref
    measured = 1.0 - res.decode_s.median / full.decode_s.median
    out: dict[str, Any] = {"reference": full.name, "predicted": predicted, "measured": measured,
                           "captured": measured / predicted if predicted > 1e-9 else None,
                           **dict.fromkeys(PAIRED_SAVING_KEYS)}
    pr = paired_decode(res, full)
    if pr is not None:  # saving_r = 1 - q_r: the mean, median and CI map through 1 - x (the CI's ends swap)
        mean = 1.0 - pr.ratio_mean
        out.update(paired_saving_mean=mean, paired_saving_median=1.0 - pr.ratio_median,
                   paired_ci_low=1.0 - pr.ci_high, paired_ci_high=1.0 - pr.ci_low, paired_p_value=pr.p_below_one,
                   paired_n=pr.n, captured_paired=mean / predicted if predicted > 1e-9 else None)
    return out


def decode_vs_ref(res: SystemResult, ref: SystemResult | None) -> dict[str, Any] | None:
    """This system's decode time over the reference row's (the first measured system of the batch size),
    paired by interleaved round: ``{reference, ratio_mean, ratio_median, ci_low, ci_high, n}``, the CI being the
    95 % bootstrap CI of ``ratio_mean`` over rounds; None when the two do not pair (not interleaved, a
    different number of runs, not ok)."""
    pr = paired_decode(res, ref) if ref is not None else None
    if pr is None:
        return None
    return {"reference": ref.name, "ratio_mean": pr.ratio_mean, "ratio_median": pr.ratio_median,
            "ci_low": pr.ci_low, "ci_high": pr.ci_high, "n": pr.n}


def recompute_comparisons(doc: dict[str, Any]) -> dict[str, Any]:
    """A copy of a saved benchmark document whose comparisons between rows (``skip_saving``,
    ``decode_vs_ref_paired``, the speed-up in ``full_depth``, ``draft``) are computed again from the saved runs, by
    this version's code (named in the document's ``recomputed``: commit and time): rows measured
    together (one batch size) are compared with each other, as :func:`run` does. Timings, probes and everything
    else stay as measured. Documents from before per-run times were kept get the median estimates only."""
    doc = json.loads(json.dumps(doc))
    report.validate(doc)
    results = report.results_from_doc(doc)
    for B in dict.fromkeys(r.batch_size for r in results):
        idx = [i for i, r in enumerate(results) if r.batch_size == B]
        same = [results[i] for i in idx]
        ref = next((r for r in same if r.status == "ok"), None)
        for i, r in zip(idx, same):
            rec = doc["results"][i]
            rec["skip_saving"] = skip_saving(r, same)
            rec["decode_vs_ref_paired"] = decode_vs_ref(r, ref)
            if rec.get("full_depth"):  # the match stays as measured (outputs are not saved); the speed-up is redone
                rec["full_depth"].update(speedups(full_depth_row(r, same), r))
            if "draft" in rec:
                rec["draft"] = draft_time(r)
    from fbs.provenance import provenance

    prov = provenance()  # which code computed the comparisons (the timings keep the measuring code's environment)
    doc["recomputed"] = {"created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                         "git_commit": prov.get("git_commit"), "git_dirty": prov.get("git_dirty")}
    return doc


#: Engine knobs that must agree for two FBS rows to be the same engine variant (format, compilation, batching, cache).
SAME_VARIANT = ("weights", "batch_policy", "compile", "kv_cache", "kv_budget")


def full_depth_row(res: SystemResult, results: list[SystemResult]) -> SystemResult | None:
    """The ``fbs-full-compute`` row of ``res``'s engine variant (same weights format, compilation, batch policy and
    cache), or None when it was not measured (or failed)."""
    return next((r for r in results if r.name.startswith("fbs-full-compute") and r.status == "ok"
                 and all(r.params.get(k) == res.params.get(k) for k in SAME_VARIANT)), None)


def _full_compute_match(res: SystemResult, results: list[SystemResult]) -> dict[str, Any] | None:
    """Lossless systems reproduce the FBS model at full depth in their weights format, which differs from the HF
    baseline when the checkpoint changed the backbone (the shipped Stage-1 LoRA) or the format rounds weights: their
    quality column is the match against the ``fbs-full-compute`` row of the same engine variant. Returns the record's
    ``full_depth``: {reference, token_match_pct, exact_match_pct, exact_by_prompt, and the paired decode speed-up over
    that row (full-depth decode time / this system's, per interleaved round: speedup_mean, speedup_median,
    speedup_ci_low, speedup_ci_high (95 % bootstrap CI of the mean), speedup_n, and with a prompt set
    speedup_by_prompt (each prompt's mean, in prompt order); null when not paired)}; the probe
    keeps ``full_compute_token_match_pct`` / ``full_compute_exact_match_pct`` as before. None for other systems or
    without a full-depth row."""
    if res.family != "speculative" or res.outputs is None or not res.name.startswith(("fbs-lossless", "draft-verify",
                                                                                    "kangaroo", *GROUP_A)):
        return None
    full = full_depth_row(res, results)
    if full is None or full.outputs is None:
        return None
    ref = full.outputs[: res.outputs.shape[0]]
    tok, exact = match_rates(res.outputs, ref)
    res.probe.update(full_compute_token_match_pct=tok, full_compute_exact_match_pct=exact)
    out: dict[str, Any] = {"reference": full.name, "token_match_pct": tok, "exact_match_pct": exact,
                           "exact_by_prompt": (res.outputs == ref).all(dim=1).tolist(),
                           **dict.fromkeys(SPEEDUP_KEYS)}
    out.update(speedups(full, res))
    return out


#: The paired speed-up keys of a lossless system's ``full_depth`` record (:func:`speedups`).
SPEEDUP_KEYS = ("speedup_mean", "speedup_median", "speedup_ci_low", "speedup_ci_high", "speedup_n",
                "speedup_by_prompt")


def speedups(full: SystemResult | None, res: SystemResult) -> dict[str, Any]:
    """The paired decode speed-up of ``res`` over its full-depth row (full / this per interleaved round: > 1 when
    ``res`` decodes faster), as :data:`SPEEDUP_KEYS`; every value None when the two do not pair."""
    pr = paired_decode(full, res) if full is not None else None
    if pr is None:
        return dict.fromkeys(SPEEDUP_KEYS)
    return {"speedup_mean": pr.ratio_mean, "speedup_median": pr.ratio_median, "speedup_ci_low": pr.ci_low,
            "speedup_ci_high": pr.ci_high, "speedup_n": pr.n,
            "speedup_by_prompt": list(pr.by_cluster) if pr.by_cluster is not None else None}


def draft_time(res: SystemResult) -> dict[str, Any] | None:
    """Where a speculative system's decode time goes: the record's ``draft`` = {ms (median per run of the time in
    the draft source), share_median (median over runs of draft / decode time), rounds (verify rounds per prompt:
    passes after the prompt's), draft_ms_per_round, verify_ms_per_round (median decode time minus median draft time,
    per round: the verifier's pass, acceptance and bookkeeping), accepted_per_round (drafted tokens kept per
    round), proposed_per_round}; None for systems that do not draft (or did not run)."""
    if res.status != "ok" or res.draft_s is None:
        return None
    pr = res.probe or {}
    rounds = (pr.get("passes") or 0) - 1  # the prompt's pass commits one token without a draft
    shares = [d / t for d, t in zip(res.draft_s.runs, res.decode_s.runs) if t > 0]
    per = (lambda x: 1e3 * x / rounds) if rounds > 0 else (lambda x: None)
    return {"ms": 1e3 * res.draft_s.median,
            "share_median": statistics.median(shares) if shares else None,
            "rounds": rounds if rounds > 0 else None,
            "draft_ms_per_round": per(res.draft_s.median),
            "verify_ms_per_round": per(res.decode_s.median - res.draft_s.median),
            "accepted_per_round": pr["accepted"] / rounds if rounds > 0 and pr.get("accepted") is not None else None,
            "proposed_per_round": pr["proposed"] / rounds if rounds > 0 and pr.get("proposed") is not None else None}


def per_prompt(res: SystemResult, lengths: list[int], base: SystemResult | None,
               full: SystemResult | None) -> list[dict[str, Any]] | None:
    """Batch size 1: one entry per prompt {prompt_len, runs (measured runs on it), prefill_ms, decode_ms (medians
    over those runs), exact_vs_baseline, exact_vs_full_depth (the whole generation equal; null without that row or
    outside a reduced budget's prompts)}. None at larger batch sizes or when the system did not run."""
    if res.status != "ok" or res.batch_size != 1 or not res.run_batches:
        return None

    def exact(other: SystemResult | None, i: int) -> bool | None:
        if other is None or other.outputs is None or res.outputs is None or i >= res.outputs.shape[0] \
                or i >= other.outputs.shape[0]:
            return None
        return bool(torch.equal(res.outputs[i], other.outputs[i]))

    out = []
    for i, n in enumerate(lengths):
        runs = [k for k, b in enumerate(res.run_batches) if b == i]
        pre = [res.prefill_s.runs[k] for k in runs]
        dec = [res.decode_s.runs[k] for k in runs]
        out.append({"prompt_len": n, "runs": len(runs),
                    "prefill_ms": 1e3 * statistics.median(pre) if pre else None,
                    "decode_ms": 1e3 * statistics.median(dec) if dec else None,
                    "exact_vs_baseline": exact(base, i),
                    "exact_vs_full_depth": exact(full, i) if full is not res else True})
    return out


def _measure_all(systems, prompts, bench: BenchConfig, progress: bool = False) -> list[SystemResult]:
    """Measure the systems one after another (or interleaved round by round with ``bench.interleave``);
    ``progress`` shows a bar on stderr, updated between generate calls only (outside every timed region)."""
    from tqdm.auto import tqdm

    if bench.interleave:
        # one step per system's probe, then per round (each round runs every system once)
        bar = tqdm(total=len(systems) + bench.warmup + bench.runs, desc=f"bench B={bench.batch_size} (interleaved)",
                   unit="step", file=sys.stderr, dynamic_ncols=True, disable=not progress)

        def on_round(kind: str, i: int, n: int) -> None:
            bar.set_postfix_str(f"{kind} ({i + 1}/{n})")
            bar.update(1)  # counted at the start of a step: the bar is at 100% during the last one

        results = measure_interleaved(systems, prompts, bench, on_round)
        bar.close()
        for res in results:
            _report_line(res, progress)
        return results
    results = []
    bar = tqdm(systems, desc=f"bench B={bench.batch_size}", unit="system", file=sys.stderr, dynamic_ncols=True,
               disable=not progress)
    for system in bar:
        bar.set_postfix_str(system.name)
        logger.info("measuring %s at batch %d", system.name, bench.batch_size)
        res = measure(system, prompts, bench)
        _report_line(res, progress)
        results.append(res)
    return results


def _report_line(res: SystemResult, progress: bool) -> None:
    """One line per measured system on stderr (``tqdm.write`` keeps an open progress bar intact)."""
    from tqdm.auto import tqdm

    if progress and res.status == "ok":
        tqdm.write(f"{res.name} B={res.batch_size}: total {res.total_s.median:.2f} s, decode "
                   f"{res.decode_s.median:.2f} s (median of {res.budget['runs']})", file=sys.stderr)


@dataclasses.dataclass
class UnavailableSystem:
    """A system that cannot run this benchmark: its row says why."""

    name: str
    family: str
    params: dict[str, Any]
    reason: str
    ratio_kind: str | None = None

    def unavailable(self, batch_size: int) -> str:
        return self.reason

    def generate(self, input_ids: torch.Tensor, new_tokens: int, probe: bool = False):
        raise RuntimeError(self.reason)


#: Why llama.cpp's rows do not run a prompt set.
LLAMA_CPP_PROMPT_SET = ("llama-bench times synthetic prompts of one length, not a prompt set's prompts: run the "
                        "llama.cpp rows with --prompt-set text")


def for_prompt_set(systems: list, prompt_set: str) -> list:
    """The systems that can run ``prompt_set``: with a set other than ``text``, llama.cpp's rows (llama-bench makes
    its own prompts) become rows that say why they did not run."""
    if prompt_set == "text":
        return systems
    return [UnavailableSystem(s.name, s.family, s.params, LLAMA_CPP_PROMPT_SET)
            if isinstance(s, LlamaBenchSystem) else s for s in systems]


def check_prompt_set(bench: BenchConfig, spec: RunSpec) -> None:
    """A prompt set other than ``text`` has prompts of different lengths: batch size 1 only, and a number of runs
    that times every prompt equally often. A measured run times one prompt (runs cycle through the set), and the
    set's prompts decode at very different speeds under a draft (a code edit copies its input, a question does
    not): ``--runs 4`` over 8 prompts would time 4 of them and report the set's name over it."""
    if bench.prompt_set == "text":
        return
    if tuple(spec.batch_sizes) != (1,):
        raise ValueError(f"--prompt-set {bench.prompt_set} has prompts of different lengths and runs at batch size 1 "
                         f"only, got --batch-sizes {','.join(map(str, spec.batch_sizes))}; pass --batch-sizes 1 (or "
                         "--prompt-set text for fixed-length prompts at any batch size)")
    n, runs = bench.num_prompts, bench.runs
    if runs % n:
        raise ValueError(f"--prompt-set {bench.prompt_set} times one prompt per run, cycling through the set: --runs "
                         f"{runs} over --num-prompts {n} would time some prompts more often than others"
                         f"{' and some never' if runs < n else ''}; pass --runs a multiple of --num-prompts (e.g. "
                         f"--runs {n * max(1, round(runs / n))})")


def run(spec: RunSpec, bench: BenchConfig, command: str = "", model=None, tok=None,
        fbs_model=None, progress: bool = False) -> dict[str, Any]:
    """Measure every requested system at every batch size (and long-context lengths); return the document.

    ``model``/``tok`` (and ``fbs_model``, built over ``model``) may be passed preloaded; by default they are
    loaded from ``spec``. ``progress`` shows a progress bar per batch size on stderr.
    """
    from fbs.model.bases import load_base

    check_prompt_set(bench, spec)
    if bench.threads:
        torch.set_num_threads(bench.threads)
    if model is None:
        model, tok = load_base(spec.base)
    fbs_note = "preloaded" if fbs_model is not None else "not requested"
    if fbs_model is None and any(spec.wants(g) for g in GROUPS if g.startswith("fbs")):
        fbs_model, fbs_note = load_fbs(model, tok, spec)
    draft = draft_tok = None
    if spec.draft and spec.wants("assisted"):
        draft, draft_tok = load_base(spec.draft)
    device = torch.device(spec.device)
    for m in (model, fbs_model, draft):
        if m is not None:
            m.to(device)
    env = environment(device)
    peaks = measure_machine(spec.machine_mb, matmul_n=spec.matmul_n, device=device)
    cost = LayerCost.from_config(model.config)
    extra_bytes = 0.0 if fbs_model is None else 4.0 * sum(p.numel() for p in fbs_model.fbs_parameters())
    systems = for_prompt_set(build_systems(model, tok, fbs_model, spec, draft, draft_tok), bench.prompt_set)

    records, digests, sets = [], {}, {}
    for B in spec.batch_sizes:
        cfg = dataclasses.replace(bench, batch_size=B, num_prompts=max(bench.num_prompts, B))
        pset = build_prompt_set(bench.prompt_set, tok, cfg.num_prompts, cfg.prompt_len, bench.prompt_seed)
        prompts = pset.tensors()
        digests[B] = prompts_digest(prompts)
        sets[B] = pset.record(digests[B])
        prompts = prompts.to(device) if isinstance(prompts, torch.Tensor) else [p.to(device) for p in prompts]
        results = _measure_all(systems, prompts, cfg, progress)
        if bench.prompt_set != "text":  # paired CIs resample the set's prompts (harness.paired_ratio)
            for r in results:
                r.clusters = list(r.run_batches) or None
        base = next((r for r in results if r.family == "baseline" and r.status == "ok"), None)
        ref = next((r for r in results if r.status == "ok"), None)  # the reference row of the paired ratios
        # a set's prompts differ in length: the roofline at their mean, prefill rates per run from each run's prompt
        eff = dataclasses.replace(cfg, prompt_len=round(sum(pset.lengths) / len(pset.lengths)))
        lengths = pset.lengths if bench.prompt_set != "text" else None
        for r in results:
            match = None
            if base is not None and r.outputs is not None:  # a reduced budget probes the first prompts only
                match = match_rates(r.outputs, base.outputs[: r.outputs.shape[0]])
            full = _full_compute_match(r, results)
            rec = report.result_record(r, cfg.new_tokens, base.total_s.median if base else None, match,
                                       _roofline(r, cost, peaks, eff, extra_bytes), skip_saving(r, results),
                                       decode_vs_ref(r, ref), eff.prompt_len, run_prompt_lens=(
                                           [lengths[b] for b in r.run_batches] if lengths and r.run_batches else None))
            rec["full_depth"] = full
            rec["draft"] = draft_time(r)
            rec["per_prompt"] = per_prompt(r, pset.lengths if B == 1 else [], base,
                                           full_depth_row(r, results) if r.family in ("fbs", "speculative") else None)
            records.append(rec)

    long_records = _long_context(spec, bench, model, tok, systems, progress)
    env["load_avg_1m_end"] = environment(device)["load_avg_1m"]
    env["native"] = native.status()  # after the runs: which native kernels the engine ran with
    counts = fbs_model.param_counts() if fbs_model is not None else None
    return {
        "schema": report.SCHEMA_VERSION,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "model": {"name": getattr(model, "fbs_base_name", spec.base),
                  "fingerprint": getattr(model, "fbs_base_fingerprint", None),
                  "num_layers": cost.num_layers,
                  "params": sum(p.numel() for p in model.parameters()),
                  "max_position_embeddings": model.config.max_position_embeddings,
                  "fbs_modules": fbs_note, "fbs_params": counts["added"] if counts else None,
                  "fbs_tau": fbs_model.config.tau if fbs_model is not None else None,
                  "fbs_kv_policy": fbs_model.config.kv_policy if fbs_model is not None else None,
                  "draft": spec.draft},
        "protocol": {**dataclasses.asdict(bench), "batch_sizes": list(spec.batch_sizes), "greedy": True,
                     "eos_ignored": True,
                     "prompt_source": PROMPT_SOURCE if bench.prompt_set == "text" else SOURCES[bench.prompt_set],
                     "prompts_sha256": {str(b): d for b, d in digests.items()},
                     "prompt_set": sets[spec.batch_sizes[0]] if spec.batch_sizes else None,
                     "timing": "perf_counter around each generate call; HF prefill = start to first streamed "
                               "token, FBS prefill/decode timed by the engine; median over measured runs, every "
                               "run kept (latency_ms.*.runs)"},
        "environment": env,
        "machine": dataclasses.asdict(peaks),
        "results": records,
        "long_context": long_records,
    }


def _long_context(spec: RunSpec, bench: BenchConfig, model, tok, systems,
                  progress: bool = False) -> list[dict[str, Any]]:
    """TTFT, decode tok/s over the N-1 later tokens and peak memory at long prompts (appendix F.2), batch 1."""
    if not spec.long_context:
        return []
    limit = model.config.max_position_embeddings - bench.new_tokens
    full = next((s.name for s in systems if s.name.startswith("fbs-full-compute")), None)
    wanted = {"hf-greedy", full, first_tau_system(systems)}
    chosen = [s for s in systems if s.name in wanted]
    records = []
    done: set[int] = set()
    for requested in spec.long_context:
        used = min(requested, limit)
        cfg = dataclasses.replace(bench, prompt_len=used, batch_size=1, num_prompts=1,
                                  warmup=spec.long_warmup, runs=spec.long_runs)
        prompts = build_prompts(tok, 1, used).to(model.device)
        for system in chosen:
            if used in done:
                res = SystemResult(system.name, system.family, 1, system.params, status="unavailable",
                                   note=f"same as the {used}-token run: the model allows {limit + bench.new_tokens} "
                                        "positions")
            else:
                logger.info("long context: %s at %d tokens", system.name, used)
                if progress:
                    print(f"long context: {system.name} at {used} tokens ...", file=sys.stderr, flush=True)
                res = measure(system, prompts, cfg)
            records.append(report.long_context_record(res, requested, used, bench.new_tokens))
        done.add(used)
    return records


def first_tau_system(systems) -> str | None:
    """Name of the first tau-sweep system (of its first engine variant): the FBS representative of the
    long-context pass."""
    for s in systems:
        if s.family == "fbs" and set(getattr(s, "knobs", {})) - ENGINE_VARIANT_KNOBS == {"tau", "kv_policy"}:
            return s.name
    return None


def write_outputs(doc: dict[str, Any], out_dir: Path) -> dict[str, Path | None]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path | None] = {"json": out_dir / "bench.json", "markdown": out_dir / "bench.md",
                                     "plot": out_dir / "bench.png"}
    report.save_json(doc, paths["json"])
    paths["markdown"].write_text(report.markdown(doc))
    if not report.plot(doc, paths["plot"]):
        paths["plot"] = None
    return paths
