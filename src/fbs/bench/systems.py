"""The systems compared side by side: HF greedy decoding, HF's speculative variants and the FBS engine (llama.cpp's
rows are :class:`fbs.bench.llama_cpp.LlamaBenchSystem`).

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

The FBS engine times prefill and decode itself (``res.timings``); llama.cpp's ``llama-bench`` times itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any

import torch

from fbs.baselines.ffn_skip import FFNSkipLLM, ffn_skip_model
from fbs.baselines.flexidepth import FlexiDepth
from fbs.bench.accounting import (fbs_decode_stats, hf_decode_stats, lossless_decode_stats, policy_overhead,
                                  speculative_ratios)
from fbs.bench.harness import GenOutput
from fbs.model.hf_adapter import DecodeCallCounter

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
        with DecodeCallCounter(self.model, T) as counter, \
                (DecodeCallCounter(draft, None) if draft is not None else contextlib.nullcontext()) as drafted:
            seqs = self._call(input_ids, new_tokens, clock)
        stats = hf_decode_stats(counter, self.model, T, new_tokens, input_ids.shape[0], drafted, draft)
        stats["layer_skip_ratio"] = 0.0 if self.family == "baseline" else None
        if self.family == "baseline":  # the base model at full depth in fp32: the bytes(rel) reference
            stats["bytes_rel"] = 1.0
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
        out = GenOutput(res.sequences, float(res.timings["prefill_s"]), float(res.timings["decode_s"]),
                        draft_s=res.timings.get("draft_s"))
        if probe:
            out.stats = self.probe_stats(res, input_ids.shape[1], new_tokens)
        return out

    def probe_stats(self, res, prompt_len: int, new_tokens: int) -> dict[str, Any]:
        weights = self.knobs.get("weights", "fp32")  # "hf": the HF modules themselves, fp32 here
        return fbs_decode_stats(res.trace, self.model, prompt_len, new_tokens, "fp32" if weights == "hf" else weights)


# ------------------------------------------------------------------------------------------ lossless self-drafting

#: Initial draft-stop thresholds of the papers: Draft&Verify's (adapted to the match rate while decoding) and
#: Kangaroo's (fixed).
DRAFT_VERIFY_STOP, KANGAROO_STOP = 0.8, 0.6


@dataclasses.dataclass
class SpeculativeSystem(FBSSystem):
    """The FBS engine's lossless decoding (:mod:`fbs.engine.speculative`): a draft (the gated FBS, a static skip set or a
    Kangaroo adapter) proposes, full depth verifies. ``knobs`` are decode options; ``draft`` names the draft's
    file in ``params`` (the adapter object itself is a knob). ``missing``: why it cannot run."""

    family: str = "speculative"
    ratio_kind: str = "acceptance"
    draft: str | None = None
    missing: str = ""

    @property
    def params(self) -> dict[str, Any]:
        out = {k: v for k, v in super().params.items() if k != "draft_adapter"}
        return {**out, "draft": self.draft} if self.draft else out

    def unavailable(self, batch_size: int) -> str:
        return self.missing

    def probe_stats(self, res, prompt_len: int, new_tokens: int) -> dict[str, Any]:
        return lossless_decode_stats(res)


def lossless_systems(fbs_model, draft_tokens: int | None = None, draft_layers: str | None = None,
                     kangaroo: str | None = None, groups=("fbs-lossless", "draft-verify", "kangaroo"),
                     taus: tuple[float, ...] = ()) -> list:
    """``fbs-lossless`` (gates at the checkpoint's tau draft; ``fbs-lossless-tau<t>`` at each of ``taus``: acceptance
    against the draft's skip share), ``draft-verify`` (the static skip set of ``fbs train draft-search``) and
    ``kangaroo`` (an adapter of ``fbs train kangaroo``); without their files the last two say how to make them."""
    from fbs.baselines.kangaroo import KangarooAdapter
    from fbs.engine.speculative import draft_plan

    gamma = {} if draft_tokens is None else {"draft_tokens": draft_tokens}
    out = []
    if "fbs-lossless" in groups:
        out.append(SpeculativeSystem("fbs-lossless", fbs_model, {"lossless": True, **gamma}))
        out += [SpeculativeSystem(f"fbs-lossless-tau{t:g}", fbs_model, {"lossless": True, "tau": t, **gamma})
                for t in taus]
    if "draft-verify" in groups:
        if draft_layers is None:
            out.append(SpeculativeSystem("draft-verify", fbs_model, missing=(
                "no Draft&Verify skip set: search one with `fbs train draft-search --out runs/draft_layers.json` "
                "and pass --draft-layers runs/draft_layers.json")))
        else:
            plan = draft_plan(draft_layers, fbs_model.num_layers)
            out.append(SpeculativeSystem("draft-verify", fbs_model, {
                "lossless": True, "skip_plan": plan, "kv_policy": "hole", "draft_stop": DRAFT_VERIFY_STOP, **gamma},
                draft=draft_layers))
    if "kangaroo" in groups:
        if kangaroo is None:
            out.append(SpeculativeSystem("kangaroo", fbs_model, missing=(
                "no Kangaroo adapter: train one with `fbs train kangaroo --exit-layer N --out-dir runs/kangaroo` "
                "and pass --kangaroo runs/kangaroo")))
        else:
            adapter = KangarooAdapter.load(kangaroo, fbs_model)
            out.append(SpeculativeSystem(f"kangaroo-exit{adapter.exit_layer}", fbs_model, {
                "lossless": True, "draft_adapter": adapter, "draft_stop": KANGAROO_STOP, "adapt_draft": False,
                **gamma}, draft=kangaroo))
    return out


#: Group A's draft sources on the engine's verifier, as bench systems: system name -> draft name (the engine's
#: prompt lookup is ``draft-prompt-lookup``: ``prompt-lookup`` is HF's).
GROUP_A = {"draft-prompt-lookup": "prompt-lookup", "lookahead": "lookahead", "specdec": "specdec",
           "medusa": "medusa", "eagle": "eagle"}
#: The commands that make each trained draft (a missing one's row names it).
GROUP_A_TRAIN = {"specdec": "fbs train draft-model --out-dir runs/draft_model",
                 "medusa": "fbs train medusa --out-dir runs/medusa", "eagle": "fbs train eagle --out-dir runs/eagle"}


def group_a_systems(fbs_model, names, paths: dict[str, str | None] | None = None,
                    draft_tokens: int | None = None, native_trees: bool = False) -> list:
    """Group A on the engine's one verifier (:mod:`fbs.engine.drafts`), one system per name of :data:`GROUP_A`:
    prompt lookup and lookahead (training-free), the distilled draft model (``paths["specdec"]``), Medusa heads and
    the EAGLE layer (``paths[name]``, else the ones shipped for the model's base). A trained draft that is missing
    gives a row naming the command that makes it. ``native_trees``: each also as ``<name>-trees`` with
    ``native_trees=True`` (whole token trees in the native multi-token steps)."""
    from fbs.baselines import shipped_draft

    paths = paths or {}
    gamma = {} if draft_tokens is None else {"draft_tokens": draft_tokens}
    out = []
    for system in names:
        draft = GROUP_A[system]
        path = paths.get(draft)
        if path is None and draft in ("medusa", "eagle"):
            found = shipped_draft(draft, fbs_model)
            path = str(found) if found is not None else None
        if draft in GROUP_A_TRAIN and path is None:
            out.append(SpeculativeSystem(system, fbs_model, missing=(
                f"no trained {draft} draft for this base model: train one with `{GROUP_A_TRAIN[draft]}` and pass "
                f"--{draft} runs/{draft if draft != 'specdec' else 'draft_model'}")))
            continue
        options = {"path": path} if path is not None else None
        knobs = {"lossless": True, "draft": draft, "draft_options": options, **gamma}
        out.append(SpeculativeSystem(system, fbs_model, knobs, draft=path or draft))
        if native_trees:
            out.append(SpeculativeSystem(f"{system}-trees", fbs_model, {**knobs, "native_trees": True},
                                         draft=path or draft))
    return out


# ------------------------------------------------------------------------------------------ adaptive-depth baselines


@dataclasses.dataclass
class BaselineSystem(FBSSystem):
    """An adaptive-depth baseline of :mod:`fbs.baselines` on the FBS engine: the engine's model over the same
    backbone with no FBS module, skipping by the baseline's policy (``knobs["skip_policy"]``). Its ratio is the
    share skipped: FFN blocks for FFN-SkipLLM (the engine runs at FFN granularity), layers for FlexiDepth. The
    probe adds the policy's own work (FlexiDepth's routers and adapters) to tflops_rel_exact and bytes_rel.
    ``missing``: why it cannot run."""

    family: str = "adaptive"
    missing: str = ""

    @property
    def params(self) -> dict[str, Any]:
        policy = self.knobs.get("skip_policy")
        rest = {k: v for k, v in self.knobs.items() if k != "skip_policy"}
        return {**(policy.to_dict() if policy is not None else {}), **rest}

    def unavailable(self, batch_size: int) -> str:
        return self.missing

    def probe_stats(self, res, prompt_len: int, new_tokens: int) -> dict[str, Any]:
        stats = super().probe_stats(res, prompt_len, new_tokens)
        weights = stats["weights"]
        stats.update(policy_overhead(self.knobs["skip_policy"], res.trace, self.model, prompt_len, new_tokens, stats,
                                     weights))
        if res.trace.skip_granularity == "ffn":  # no layer is skipped: the share is of FFN blocks
            stats.update(ffn_skip_ratio=stats["layer_skip_ratio"], layer_skip_ratio=0.0)
        return stats


def ffn_skip_systems(model, tokenizer, thresholds) -> list[BaselineSystem]:
    """FFN-SkipLLM at each cosine threshold (the rule's other knobs at their defaults), on one shared model."""
    host = ffn_skip_model(model, tokenizer)
    return [BaselineSystem(f"ffn-skipllm-t{t:g}", host, {"skip_policy": FFNSkipLLM(threshold=t)}, ratio_kind="ffn_skip")
            for t in thresholds]


def flexidepth_systems(model, tokenizer, checkpoint: str | None, taus=()) -> list[BaselineSystem]:
    """FlexiDepth from a ``fbs train flexidepth`` checkpoint at each of ``taus`` (default: its own tau), the prompt
    routed as FlexiDepth decodes; without a checkpoint, one row saying why it cannot run."""
    if checkpoint is None:
        return [BaselineSystem("flexidepth", None, missing=(
            "no FlexiDepth checkpoint: train one with `fbs train flexidepth --config configs/flexidepth_smollm2.yaml "
            "--data corpus` and pass --flexidepth runs/flexidepth_smollm2/final"))]
    fd = FlexiDepth.from_pretrained(checkpoint, base=model, tokenizer=tokenizer)
    return [BaselineSystem(f"flexidepth-tau{t:g}", fd.host, {"skip_policy": fd.policy(t)})
            for t in (tuple(taus) or (fd.config.tau,))]


def forced_plan(num_layers: int, fraction: float, never_skip: set[int] | frozenset[int] = frozenset()) -> torch.Tensor:
    """(L,) bool static plan skipping round(fraction * L) layers, spread evenly over the skippable ones."""
    plan = torch.zeros(num_layers, dtype=torch.bool)
    skippable = [l for l in range(num_layers) if l not in never_skip]
    k = min(round(fraction * num_layers), len(skippable))
    if k > 0:
        idx = torch.linspace(0, len(skippable) - 1, k).round().long()
        plan[torch.tensor(skippable)[idx]] = True
    return plan
