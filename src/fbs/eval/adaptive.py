"""The adaptive-depth baselines of :mod:`fbs.baselines` (FFN-SkipLLM, the FlexiDepth-style router) in ``fbs eval``:
decode-faithful perplexity fronts (``fbs eval sweep --baseline``) and task scoring (``fbs eval run --system``).

Each baseline is a *scorer* over its host model (the engine's model over the base weights, no FBS module) that
scores teacher-forced token sequences with the parallel form of its own cached decoding, which the baselines'
tests check against the engine (``tests/test_baselines.py``; ``tests/test_eval_adaptive.py`` does it again
through this module's sweep and scoring): ``parallel(ids, mask, gate_from)`` reads positions before ``gate_from``
(an int or a (B, 1) tensor) as the prefilled prompt and later positions as fed-back decoded tokens, and returns the
logits and the (B, T, L) bool mask of what it skipped.

* :class:`FFNSkipScorer` — :class:`fbs.baselines.FFNSkipLLM`'s ``mixer`` with ``gate_from + warmup`` (the rule's
  first ``warmup`` generated tokens run every FFN block). The prompt always runs in full (its prefill runs every
  FFN). A skip is an FFN block: attention and K/V still run.
* :class:`FlexiDepthScorer` — :meth:`fbs.baselines.FlexiDepth.forward` at ``tau``. ``route_prompt=False`` (the
  default, the same protocol as FBS's: the first ``gate_from`` tokens are never skipped) routes from ``gate_from``,
  which is what the engine decodes with ``FlexiDepth.policy(tau, route_prompt=False)``; ``route_prompt=True`` routes
  every position from the checkpoint's ``route_from`` (1), prompt included, which is FlexiDepth's own decoding
  (``FlexiDepth.generate``, the ``fbs bench`` rows). A skip is a whole layer whose K/V are still computed and whose
  adapter runs.

What a skipped pair saves (:class:`fbs.eval.sweep.PairSaving`, fp32 weights, the :mod:`fbs.engine.flops` cost model):
FFN-SkipLLM saves the FFN's MACs and bytes only (its cosine test, 2d MACs per tested block, is not priced, as in
``fbs bench``); FlexiDepth saves the layer less its K/V projection and its adapter, and every decoded token runs the
routers of the routed layers (an overhead added whether or not it skips).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from ..baselines import FFNSkipLLM, FlexiDepth, ffn_skip_model
from ..engine.flops import LayerCost
from .sweep import (DEFAULT_GATE_FROM, HeldoutDoc, PairSaving, SystemScores, _check_lengths, score,
                    select_operating_point, summarize)
from .systems import FBSSystem, System

#: the baselines ``fbs eval`` knows, with the knob each is swept over
METHODS = {"ffn-skipllm": "threshold", "flexidepth": "tau"}
#: what a skipped pair is, per method (the unit of the skip share)
SKIP_UNITS = {"fbs": "layers", "ffn-skipllm": "FFN blocks", "flexidepth": "layers"}
#: FlexiDepth's tau for "nothing skipped": the full path is taken where g > tau, and g = sigmoid(.) > 0 > -1
NEVER = -1.0


def _nbytes(*modules) -> float:
    """fp32 bytes of the modules' parameters (the baselines' routers and adapters are fp32 modules)."""
    return 4.0 * sum(p.numel() for m in modules for p in m.parameters())


def _full_step_bytes(cost: LayerCost) -> float:
    return cost.num_layers * cost.layer_bytes() + cost.lm_head_bytes()


class FFNSkipScorer:
    """FFN-SkipLLM at one cosine threshold (the rule's other knobs as given) over ``host``, an FFN-granularity host
    model (:func:`fbs.baselines.ffn_skip_model`)."""

    method = "ffn-skipllm"

    def __init__(self, host, rule: FFNSkipLLM):
        if host.config.skip_granularity != "ffn":
            raise ValueError("FFN-SkipLLM needs an FFN-granularity host model: fbs.baselines.ffn_skip_model(base)")
        self.model, self.rule = host, rule

    @classmethod
    def from_base(cls, base, tokenizer=None, threshold: float = FFNSkipLLM.threshold, **rule) -> "FFNSkipScorer":
        return cls(ffn_skip_model(base, tokenizer), FFNSkipLLM(threshold=threshold, **rule))

    def at(self, value: float) -> "FFNSkipScorer":
        """The same rule at another threshold, on the same host."""
        return FFNSkipScorer(self.model, dataclasses.replace(self.rule, threshold=value))

    @property
    def value(self) -> float:
        return self.rule.threshold

    @property
    def label(self) -> str:
        return f"ffn-skipllm t={self.value:g}"

    def parallel(self, ids: torch.Tensor, mask: torch.Tensor | None, gate_from) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model(ids, mask, gate_mode="off", gate_from=gate_from + self.rule.warmup,
                         mixer=self.rule.mixer(self.model.num_layers))
        return out.logits, out.skips > 0.5

    def policy(self):
        """The engine's ``skip_policy`` of the same decoding."""
        return self.rule

    def saving(self) -> PairSaving:
        return PairSaving.of(self.model)  # FFN granularity: the FFN's MACs and bytes, attention kept

    def describe(self) -> dict:
        return {"method": self.method, "threshold": self.value, "rule": self.rule.to_dict(), "skip_unit": "FFN blocks"}


class FlexiDepthScorer:
    """A FlexiDepth checkpoint (:class:`fbs.baselines.FlexiDepth`) at ``tau``; ``route_prompt``: see the module doc."""

    method = "flexidepth"

    def __init__(self, fd: FlexiDepth, tau: float | None = None, route_prompt: bool = False,
                 checkpoint: str | None = None):
        self.fd, self.route_prompt, self.checkpoint = fd.eval(), bool(route_prompt), checkpoint
        self.tau = fd.config.tau if tau is None else float(tau)
        self.model = fd.host

    @classmethod
    def from_pretrained(cls, path, base=None, tokenizer=None, tau: float | None = None,
                        route_prompt: bool = False) -> "FlexiDepthScorer":
        return cls(FlexiDepth.from_pretrained(path, base=base, tokenizer=tokenizer), tau, route_prompt, str(path))

    def at(self, value: float) -> "FlexiDepthScorer":
        return FlexiDepthScorer(self.fd, value, self.route_prompt, self.checkpoint)

    @property
    def value(self) -> float:
        return self.tau

    @property
    def label(self) -> str:
        return f"flexidepth tau={self.tau:g}" + (" (prompt routed)" if self.route_prompt else "")

    def parallel(self, ids: torch.Tensor, mask: torch.Tensor | None, gate_from) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.fd.config.route_from if self.route_prompt else gate_from
        out = self.fd(ids, mask, tau=self.tau, route_from=start)
        skips = torch.zeros(*ids.shape, self.model.num_layers, dtype=torch.bool, device=ids.device)
        skips[..., list(self.fd.layer_ids)] = out.skips
        return out.logits, skips

    def policy(self):
        return self.fd.policy(self.tau, route_prompt=self.route_prompt)

    def saving(self) -> PairSaving:
        cost = LayerCost.of(self.model.base.spec)
        routed = list(self.fd.layer_ids)
        router, adapter = self.fd.routers[str(routed[0])], self.fd.adapters[str(routed[0])]  # all the same size
        full = _full_step_bytes(cost)
        return PairSaving(
            macs=(cost.dense - cost.kv_proj - adapter.macs()) / cost.dense,
            bytes=cost.num_layers * (cost.layer_bytes() - cost.kv_proj_bytes() - _nbytes(adapter)) / full,
            overhead_macs=len(routed) * router.macs() / (cost.num_layers * cost.dense),
            overhead_bytes=len(routed) * _nbytes(router) / full)

    def describe(self) -> dict:
        return {"method": self.method, "tau": self.tau, "route_prompt": self.route_prompt,
                "checkpoint": self.checkpoint, "layers": list(self.fd.layer_ids), "skip_unit": "layers"}


# ---------------------------------------------------------------------------- the sweep
def run_baseline_sweep(scorer, docs: Sequence[HeldoutDoc], values: Sequence[float], batch_size: int = 4,
                       seed: int = 0, progress: bool = True, tolerance: float = 0.02,
                       gate_from: int = DEFAULT_GATE_FROM) -> dict:
    """``fbs eval sweep --baseline``: the base model (the scorer's host at full depth, every layer), the method with
    nothing skipped, and the method at each of ``values`` (thresholds or taus), decode-faithfully scored as
    :func:`fbs.eval.sweep.score` scores FBS; rows in the schema of :func:`fbs.eval.sweep.run_sweep` (kinds ``base``,
    ``full``, ``tau``; ``tau`` holds the method's knob, also under ``threshold`` / ``tau``), each with ``method``."""
    from tqdm.auto import tqdm

    _check_lengths(docs, gate_from)
    method, knob = scorer.method, METHODS[scorer.method]
    values = [float(v) for v in values]
    computes_full = method == "flexidepth"  # FFN-SkipLLM with nothing skipped is the base model itself
    bar = tqdm(total=(1 + computes_full + len(values)) * len(docs), desc=f"{method} sweep", unit="block",
               disable=not progress)

    def run(name, **kw):
        bar.set_postfix_str(name)
        return score(scorer.model, docs, name=name, batch_size=batch_size, progress=bar.update, gate_from=gate_from,
                     **kw)

    base = run("base", kind="base")
    if computes_full:
        full = run(f"{method} (nothing skipped)", method=scorer.at(NEVER), kind="full")
    else:  # the host with no FFN skipped runs exactly the base model's layers
        full = SystemScores(f"{method} (nothing skipped) = base", None, list(base.nll), list(base.skipped),
                            list(base.pairs), "full")
    scores = [base, full]
    for v in values:
        s = run(scorer.at(v).label, method=scorer.at(v), kind="tau")
        s.tau = v
        scores.append(s)
    bar.close()
    saving = scorer.saving()
    rows = []
    for s in scores:
        row = summarize(s, base, docs, seed, PairSaving() if s.kind == "base" else saving)
        if s.kind != "base":
            row.update(method=method, knob=knob, **{knob: s.tau})
            if method == "flexidepth":
                row["route_prompt"] = scorer.route_prompt
        else:
            row["method"] = "base"
        rows.append(row)
    best = select_operating_point(rows, base.ppl, tolerance)
    return {"rows": rows, "base_ppl": base.ppl, "tolerance": tolerance, "gate_from": gate_from,
            "operating_point": None if best is None else best["tau"], "matched_taus": [], "method": method,
            "knob": knob, "skip_unit": SKIP_UNITS[method], "baseline": scorer.describe(),
            "front_label": f"{method} {knob}s (nothing skipped at 0%)",
            "saving": dataclasses.asdict(saving),
            "documents": [{"id": d.id, "lang": d.lang, "tokens": len(d.input_ids)} for d in docs],
            "per_document": {f"{s.name}@{s.tau}": {"nll": s.nll, "skipped": s.skipped, "pairs": s.pairs}
                             for s in scores}}


# ---------------------------------------------------------------------------- tasks (fbs eval run)
class AdaptiveSystem(FBSSystem):
    """A baseline as an ``fbs eval`` :class:`~fbs.eval.systems.System`: scoring is the scorer's parallel form with
    the continuation tokens decoded (positions from the context's end), as :class:`~fbs.eval.systems.FBSSystem`
    scores FBS; generation runs the engine with the baseline's ``skip_policy``. The counters are FBSSystem's
    (for FFN-SkipLLM a skipped pair is an FFN block); ``describe()["kind"]`` is ``"adaptive"``."""

    def __init__(self, scorer, tokenizer, name: str | None = None, **kw):
        super().__init__(scorer.model, tokenizer, generate_kwargs={"skip_policy": scorer.policy()},
                         name=name or scorer.label, **kw)
        self.scorer = scorer

    def forward_logits(self, input_ids, attention_mask):
        return self.scorer.parallel(input_ids, attention_mask, 1)[0]  # every position after the first is decoded

    def context_logits(self, input_ids, attention_mask, gate_from):
        b, t = input_ids.shape
        start = gate_from.view(b, 1)
        logits, skips = self.scorer.parallel(input_ids, attention_mask, start)
        decoded = (torch.arange(t) >= start) & attention_mask.bool()
        c = self._counters
        c["scored_pairs"] += int(decoded.sum()) * skips.shape[-1]
        c["scored_skipped"] += int(skips[decoded].sum())
        return logits

    def describe(self):
        d = System.describe(self) | {"kind": "adaptive", **self.scorer.describe()}
        if self.skip_ratios:
            d["decode_skip_ratio_mean"] = sum(self.skip_ratios) / len(self.skip_ratios)
        if self.tflops_rel:
            d["decode_tflops_rel_mean"] = sum(self.tflops_rel) / len(self.tflops_rel)
        return d


def build_scorer(method: str, base, tokenizer=None, threshold: float | None = None, checkpoint: str | None = None,
                 tau: float | None = None, route_prompt: bool = False):
    """The scorer ``fbs eval`` builds for ``--system`` / ``--baseline`` ``method`` over ``base`` (an HF model)."""
    if method == "ffn-skipllm":
        return FFNSkipScorer.from_base(base, tokenizer, FFNSkipLLM.threshold if threshold is None else threshold)
    if method == "flexidepth":
        if checkpoint is None:
            raise ValueError("flexidepth needs --flexidepth DIR (a checkpoint of `fbs train flexidepth`)")
        return FlexiDepthScorer.from_pretrained(checkpoint, base, tokenizer, tau, route_prompt)
    raise ValueError(f"unknown baseline {method!r}; known: {', '.join(METHODS)}")

