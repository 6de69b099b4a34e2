"""Tau sweep of a trained FBS on held-out text: skip %, TFLOPs(rel) and decode-faithful perplexity per system.

The paper's threshold sweep (appendix E.6.1) and its "FBS-S1 with nothing skipped" perplexity (§4), with the
the baselines it is compared with, on held-out blocks of token ids (:class:`HeldoutDoc`): the test split of a corpus
built by ``fbs data build`` (:func:`heldout_documents`) or out-of-distribution text (:mod:`fbs.eval.ood`).

**Decode-faithful scoring.** A block of T tokens is read as a prompt of ``gate_from`` tokens (default 128)
followed by T - ``gate_from`` decoded tokens. Each system scores it in one teacher-forced parallel forward in
which positions before ``gate_from`` run every layer (the prefilled prompt) and later positions skip the
(token, layer) pairs their gate (or plan) skips, with the K/V of a skipped pair computed from its layer input:
exactly what cached decoding under the ``project`` KV policy computes (``tests/test_model_equivalence.py``).

* NLL of a block: the mean NLL of its tokens ``gate_from .. T-1`` (the tokens a decoder would produce: the
  first from the prefill's last position, the others from gated positions ``gate_from .. T-2``).
* Skipped pairs of a block: skipped (token, layer) pairs at positions ``gate_from .. T-2`` (the decoded
  tokens whose layers decide a scored prediction: the engine's trace counts the same tokens) over all
  (token, layer) pairs there, never-skip layers included (the paper's Skip %).
* PPL = exp(mean over blocks of the block NLL), a 95% bootstrap CI over blocks, the paired bootstrap of the
  difference against the base model (appendix B.6); Skip % pooled over blocks.
* TFLOPs(rel) is the paper's estimate, executed pairs / all pairs = 1 - skip ratio; under
  ``skip_granularity="ffn"`` a skipped pair still runs attention, so it saves only the FFN's share of the
  layer's MACs (as :class:`fbs.engine.flops.FlopCounter` counts it). The exact variant needs a decode trace
  (``fbs bench --taus``, ``fbs eval chat``).
* Bytes(rel): the fp32 weight bytes a decode step reads (every layer, final norm and LM head; the K/V cache
  is not counted) relative to full depth, with the cost model of :mod:`fbs.engine.flops`: a skipped pair saves the
  layer less its K/V projection (``project`` policy) or, under FFN granularity, the layer less its attention.
  This is the x axis on which whole-layer and FFN-only skipping compare (``fbs eval pareto --x bytes``).

**Systems** (:func:`run_sweep`): ``base`` (the base model), ``control`` (a second checkpoint at full depth:
the same recipe without skipping, which isolates domain adaptation), ``full`` (the checkpoint with every
layer), ``tau`` (threshold gates at each tau), and at each *matched* tau three plans that skip exactly as many
pairs as the gates did: ``random`` (per block, uniformly among the gated pairs of positions
``gate_from .. T-2``), ``oracle`` (per block, the pairs with the smallest relative update
||h_(l+1) - h_l|| / ||h_l|| of the checkpoint's full-depth pass) and ``static`` (the same layers for every
token: the gated layers ranked by their mean relative update on the text, the smallest first; m layers for
every block and one more layer for the first blocks, m and the number of blocks chosen so that the pooled
count matches).

:func:`calibrate_tau` finds the tau whose skip ratio on the blocks is a target (bisection on tau).
:func:`select_operating_point` picks the most efficient tau whose perplexity is within ``tolerance`` of the
base model's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from ..model.gate import relative_updates as layer_updates
from .heldout import HeldoutDoc
from .stats import bootstrap_ci, paired_bootstrap, ppl_metric

DEFAULT_TAUS = (0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65)
#: prompt tokens that are never gated (the prefilled prompt of a decode)
DEFAULT_GATE_FROM = 128
#: the kinds of system rows, in report order
KINDS = ("base", "control", "full", "tau", "random", "static", "oracle")


@dataclasses.dataclass
class SystemScores:
    """Per-block results of one system, in the order of the blocks."""

    name: str
    tau: float | None         # threshold (kind tau) or the tau whose skip count a plan matches
    nll: list[float]          # mean NLL of the scored tokens per block
    skipped: list[int]        # skipped (token, layer) pairs per block (decoded positions)
    pairs: list[int]          # all (token, layer) pairs per block (decoded positions)
    kind: str = "tau"

    @property
    def skip_ratio(self) -> float:
        return sum(self.skipped) / max(1, sum(self.pairs))

    @property
    def ppl(self) -> float:
        return ppl_metric(np.asarray(self.nll))


def heldout_documents(corpus_dir: str | Path, tokenizer, split: str = "test", per_lang: int = 24,
                      max_tokens: int = 512, seed: int = 0, langs: Sequence[str] | None = None,
                      min_tokens: int = 2) -> list[HeldoutDoc]:
    """A seeded sample of ``per_lang`` documents per language of ``split``, each cut to ``max_tokens`` tokens.

    The sample is a pure function of the split file, ``per_lang`` and ``seed`` (ids sorted, then shuffled
    by ``random.Random(f"{seed}-{lang}")``); documents shorter than ``min_tokens`` tokens are skipped."""
    from ..data.corpus import read_split

    by_lang: dict[str, list[dict]] = {}
    for rec in read_split(corpus_dir, split):
        by_lang.setdefault(rec["lang"], []).append(rec)
    if not by_lang:
        raise ValueError(f"{corpus_dir}: split {split!r} has no documents")
    chosen: list[dict] = []
    for lang in sorted(by_lang):
        if langs is not None and lang not in langs:
            continue
        recs = sorted(by_lang[lang], key=lambda r: r["id"])
        random.Random(f"{seed}-{lang}").shuffle(recs)
        chosen.extend(recs[:per_lang])
    docs = []
    for rec in chosen:
        ids = tokenizer(rec["text"], add_special_tokens=False)["input_ids"][:max_tokens]
        if len(ids) >= max(2, min_tokens):
            docs.append(HeldoutDoc(rec["id"], rec["lang"], torch.tensor(ids, dtype=torch.long)))
    return docs


def sweep_texts(tokenizer, texts: Sequence[str], corpus: str | Path | None = None, split: str = "test",
                per_lang: int = 24, max_tokens: int = 512, seed: int = 0, gate_from: int = 128,
                ood_per_kind: int | None = None) -> dict[str, list[HeldoutDoc]]:
    """{text name: held-out blocks} for the text names ``in`` (the corpus' ``split``, :func:`heldout_documents`)
    and ``ood`` (:func:`fbs.eval.ood.ood_blocks`, ``ood_per_kind`` blocks per kind); the held-out text of
    ``fbs eval sweep --text`` and of ``fbs train ablations``. In-domain documents shorter than ``gate_from + 2``
    tokens are left out: they would have nothing to score."""
    from .ood import ood_blocks

    texts = [t.strip() for t in texts if t.strip()]
    unknown = set(texts) - {"in", "ood"}
    if unknown or not texts:
        raise ValueError(f"held-out text must be 'in', 'ood' or 'in,ood', got {','.join(texts)!r}")
    docs = {}
    for t in texts:
        if t == "in":
            if not corpus:
                raise ValueError("in-domain held-out text needs a corpus directory (from `fbs data build`): "
                                 "pass --corpus DIR")
            docs[t] = heldout_documents(corpus, tokenizer, split, per_lang, max_tokens, seed, min_tokens=gate_from + 2)
        else:
            docs[t] = ood_blocks(tokenizer, seed=seed, limit=ood_per_kind)
    return docs


def _batches(docs: Sequence[HeldoutDoc], batch_size: int) -> Iterable[list[int]]:
    """Indices of documents grouped into equal-length batches (no padding needed)."""
    by_len: dict[int, list[int]] = {}
    for i, d in enumerate(docs):
        by_len.setdefault(len(d.input_ids), []).append(i)
    for idx in by_len.values():
        for s in range(0, len(idx), batch_size):
            yield idx[s:s + batch_size]


def _check_lengths(docs: Sequence[HeldoutDoc], gate_from: int) -> None:
    if gate_from < 1:
        raise ValueError(f"gate_from must be >= 1 (the first token is always prefilled), got {gate_from}")
    short = [d.id for d in docs if len(d.input_ids) < gate_from + 2]
    if short:
        raise ValueError(f"{len(short)} blocks are shorter than gate_from + 2 = {gate_from + 2} tokens "
                         f"(e.g. {short[0]}); lower --gate-from or use longer blocks")


@torch.no_grad()
def score(model, docs: Sequence[HeldoutDoc], tau: float | None = None, name: str = "fbs", batch_size: int = 4,
          progress: Callable[[int], None] | None = None, gate_from: int = DEFAULT_GATE_FROM,
          plans: Sequence[torch.Tensor] | None = None, kind: str | None = None,
          relative_updates: list | None = None, method=None) -> SystemScores:
    """Per-block NLL and skips of ``model`` (an FBSForCausalLM): every layer (``tau=None``, no ``plans``),
    threshold gates at ``tau``, or the skip ``plans`` (one (T, L) bool tensor per block). Positions before
    ``gate_from`` are never skipped. ``relative_updates``, a list, receives each block's (T, L) relative
    updates of the pass (full-depth passes only: the oracle's signal). ``method``: a skip baseline of
    :mod:`fbs.eval.adaptive` (``method.parallel(ids, mask, gate_from) -> (logits, (B, T, L) skips)``, the parallel
    form of its cached decoding with the first ``gate_from`` tokens prefilled) decides instead of the gates;
    ``model`` is then its host model."""
    _check_lengths(docs, gate_from)
    model.eval()
    dev = next(model.parameters()).device
    n = len(docs)
    nll, skipped, pairs = [0.0] * n, [0] * n, [0] * n
    rels: list = [None] * n
    n_layers = model.num_layers
    want_rel = relative_updates is not None
    for idx in _batches(docs, batch_size):
        ids = torch.stack([docs[i].input_ids for i in idx]).to(dev)  # (B, T)
        t = ids.shape[1]
        out = None
        if method is not None:
            logits, skips = method.parallel(ids, None, gate_from)
        else:
            if plans is not None:
                plan = torch.stack([plans[i] for i in idx]).to(dev)  # (B, T, L)
                out = model(ids, gate_mode="plan", skip_plan=plan, gate_from=gate_from)
            elif tau is None:
                out = model(ids, gate_mode="off", output_hidden_states=want_rel)
            else:
                out = model(ids, gate_mode="threshold", tau=tau, gate_from=gate_from)
            logits = out.logits
            skips = out.skips if (tau is not None or plans is not None) else None
        logp = torch.log_softmax(logits[:, gate_from - 1:-1].float(), dim=-1)  # (B, T - gate_from, V)
        tok_nll = -logp.gather(-1, ids[:, gate_from:, None]).squeeze(-1)  # (B, T - gate_from)
        if want_rel:
            rel = layer_updates(out.hidden_states)  # (B, T, L)
        for j, i in enumerate(idx):
            nll[i] = float(tok_nll[j].mean())
            if skips is not None:
                skipped[i] = int(skips[j, gate_from:t - 1].sum())
            pairs[i] = (t - 1 - gate_from) * n_layers
            if want_rel:
                rels[i] = rel[j].float().cpu()
        if progress is not None:
            progress(len(idx))
    if want_rel:
        relative_updates.extend(rels)
    kind = kind or ("full" if tau is None and plans is None else "tau")
    return SystemScores(name, tau, nll, skipped, pairs, kind)


# ---------------------------------------------------------------------------- baseline plans
def _gated_window(model, t: int, gate_from: int) -> torch.Tensor:
    """(T, L) bool: the pairs a plan may skip (gated layers, decoded positions gate_from .. T-2)."""
    m = torch.zeros(t, model.num_layers, dtype=torch.bool)
    m[gate_from:t - 1, list(model.layers_cfg.gated)] = True
    return m


def random_plans(model, docs: Sequence[HeldoutDoc], counts: Sequence[int], gate_from: int,
                 seed: int = 0) -> list[torch.Tensor]:
    """Per block, ``counts[i]`` pairs drawn uniformly (seeded) among the gated pairs of the decoded positions."""
    g = torch.Generator().manual_seed(seed)
    plans = []
    for d, k in zip(docs, counts):
        window = _gated_window(model, len(d.input_ids), gate_from)
        flat = window.flatten().nonzero().squeeze(-1)
        plan = torch.zeros(window.numel(), dtype=torch.bool)
        plan[flat[torch.randperm(len(flat), generator=g)[:k]]] = True
        plans.append(plan.view_as(window))
    return plans


def oracle_plans(model, docs: Sequence[HeldoutDoc], counts: Sequence[int], rels: Sequence[torch.Tensor],
                 gate_from: int) -> list[torch.Tensor]:
    """Per block, the ``counts[i]`` gated pairs of the decoded positions with the smallest relative update."""
    plans = []
    for d, k, u in zip(docs, counts, rels):
        window = _gated_window(model, len(d.input_ids), gate_from)
        plan = torch.zeros(window.numel(), dtype=torch.bool)
        if k:
            plan[u.masked_fill(~window, float("inf")).flatten().topk(k, largest=False).indices] = True
        plans.append(plan.view_as(window))
    return plans


def static_plans(model, docs: Sequence[HeldoutDoc], total: int, rels: Sequence[torch.Tensor],
                 gate_from: int) -> tuple[list[torch.Tensor], list[int]]:
    """Input-independent plans skipping ``total`` pairs in all: the gated layers ordered by mean relative update
    over the blocks' decoded positions (smallest first); m layers for every block, m + 1 for the first j blocks.
    Returns the plans and the layer order."""
    gated = list(model.layers_cfg.gated)
    mean_u = torch.stack([u[gate_from:len(d.input_ids) - 1, gated].mean(0) for d, u in zip(docs, rels)]).mean(0)
    order = [gated[i] for i in mean_u.argsort().tolist()]
    positions = [len(d.input_ids) - 1 - gate_from for d in docs]
    m = min(total // max(1, sum(positions)), len(order))
    rest, j = total - m * sum(positions), 0
    if m < len(order):  # j blocks get one more layer: the j whose pooled count is closest to the total
        acc = np.concatenate([[0], np.cumsum(positions)])
        j = int(np.abs(acc - rest).argmin())
    plans = []
    for i, d in enumerate(docs):
        t = len(d.input_ids)
        plan = torch.zeros(t, model.num_layers, dtype=torch.bool)
        plan[gate_from:t - 1, order[:m + (1 if i < j else 0)]] = True
        plans.append(plan)
    return plans, order


# ---------------------------------------------------------------------------- rows and the sweep
@dataclasses.dataclass(frozen=True)
class PairSaving:
    """What one skipped (token, layer) pair saves, as shares of a full-depth decode step (see the module doc), and
    what a method adds per decoded token whether it skips or not (FlexiDepth's routers; :mod:`fbs.eval.adaptive`)."""

    macs: float = 1.0    # of one layer's dense MACs
    bytes: float = 0.0   # of a full-depth step's weight bytes, per (layer) pair: summed over L pairs
    overhead_macs: float = 0.0   # added per decoded token, a share of the L layers' dense MACs
    overhead_bytes: float = 0.0  # added per decoded token, a share of a full-depth step's weight bytes

    @classmethod
    def of(cls, model) -> "PairSaving":
        """For an FBS model: its granularity, the ``project`` policy, fp32 weights."""
        from ..engine.flops import LayerCost

        cost = LayerCost.of(model.base.spec)
        ffn = model.config.skip_granularity == "ffn"
        kept = cost.attn_bytes() if ffn else cost.kv_proj_bytes()
        full = cost.num_layers * cost.layer_bytes() + cost.lm_head_bytes()
        return cls(macs=cost.ffn / cost.dense if ffn else 1.0,
                   bytes=cost.num_layers * (cost.layer_bytes() - kept) / full)


def summarize(scores: SystemScores, base: SystemScores, docs: Sequence[HeldoutDoc], seed: int = 0,
              saving: PairSaving = PairSaving()) -> dict:
    """One row: skip %, TFLOPs(rel) (paper estimate), bytes(rel), PPL with CI, per-language PPL, delta vs base
    with CI/p."""
    nll = np.asarray(scores.nll)
    lo, hi = bootstrap_ci(nll, ppl_metric, seed=seed)
    cmp = paired_bootstrap(scores.nll, base.nll, ppl_metric, higher_is_better=False, seed=seed)
    per_lang = {}
    for lang in sorted({d.lang for d in docs}):
        m = np.array([d.lang == lang for d in docs])
        sk = sum(s for s, keep in zip(scores.skipped, m) if keep)
        pr = sum(p for p, keep in zip(scores.pairs, m) if keep)
        per_lang[lang] = {"ppl": ppl_metric(nll[m]), "skip_ratio": sk / max(1, pr)}
    return {
        "system": scores.name, "kind": scores.kind, "tau": scores.tau, "skip_ratio": scores.skip_ratio,
        "tflops_rel": 1.0 - saving.macs * scores.skip_ratio + saving.overhead_macs,
        "bytes_rel": 1.0 - saving.bytes * scores.skip_ratio + saving.overhead_bytes, "ppl": scores.ppl,
        "ppl_ci": [lo, hi],
        "ppl_rel_to_base": scores.ppl / base.ppl - 1.0, "per_lang_ppl": {k: v["ppl"] for k, v in per_lang.items()},
        "per_lang_skip": {k: v["skip_ratio"] for k, v in per_lang.items()}, "vs_base": cmp.to_dict(),
    }


def select_operating_point(rows: Sequence[dict], base_ppl: float, tolerance: float = 0.02) -> dict | None:
    """The threshold row with the lowest TFLOPs(rel) whose PPL is at most (1 + tolerance) x the base PPL."""
    ok = [r for r in rows if r["tau"] is not None and r.get("kind", "tau") == "tau"
          and r["ppl"] <= base_ppl * (1 + tolerance)]
    return min(ok, key=lambda r: (r["tflops_rel"], -r["tau"])) if ok else None


def markdown(rows: Sequence[dict], langs: Sequence[str]) -> str:
    head = ("| system | tau | Skip % | TFLOPs(rel) | Bytes(rel) | PPL [95% CI] | vs base: Δ PPL [95% CI], p | "
            + " | ".join(f"PPL {l}" for l in langs) + " | " + " | ".join(f"Skip % {l}" for l in langs) + " |")
    sep = "|" + "---|" * (7 + 2 * len(langs))
    out = [head, sep]
    for r in rows:
        v = r["vs_base"]
        delta = "–" if r.get("kind", r["system"]) == "base" else (
            f"{v['delta']:+.3f} [{v['ci_low']:+.3f}, {v['ci_high']:+.3f}], p={v['p_value']:.3f}"
            + (" *" if v["significant"] else ""))
        tau = "–" if r["tau"] is None else f"{r['tau']:.2f}"
        skip_lang = r.get("per_lang_skip", {})
        out.append(f"| {r['system']} | {tau} | {100 * r['skip_ratio']:.1f} | {r['tflops_rel']:.3f} | "
                   f"{r.get('bytes_rel', float('nan')):.3f} | "
                   f"{r['ppl']:.3f} [{r['ppl_ci'][0]:.2f}, {r['ppl_ci'][1]:.2f}] | {delta} | "
                   + " | ".join(f"{r['per_lang_ppl'][l]:.3f}" for l in langs) + " | "
                   + " | ".join(f"{100 * skip_lang.get(l, 0.0):.1f}" for l in langs) + " |")
    return "\n".join(out)


def run_sweep(model, base_model, docs: Sequence[HeldoutDoc], taus: Sequence[float], batch_size: int = 4,
              seed: int = 0, progress: bool = True, tolerance: float = 0.02, gate_from: int = DEFAULT_GATE_FROM,
              control=None, matched_taus: Sequence[float] = ()) -> dict:
    """Score the base model, the control (if given), the checkpoint at full depth and at every tau, and the
    random / static / oracle plans at each of ``matched_taus`` (a subset of ``taus``); rows + the chosen tau."""
    from tqdm.auto import tqdm

    _check_lengths(docs, gate_from)
    taus = [float(t) for t in taus]
    matched = [float(t) for t in matched_taus]
    missing = [t for t in matched if t not in taus]
    if missing:
        raise ValueError(f"matched taus {missing} are not among the swept taus {taus}")
    n_sys = 2 + (control is not None) + len(taus) + 3 * len(matched)
    bar = tqdm(total=n_sys * len(docs), desc="tau sweep", unit="block", disable=not progress)

    def run(name, m, **kw):
        bar.set_postfix_str(name)
        return score(m, docs, name=name, batch_size=batch_size, progress=bar.update, gate_from=gate_from, **kw)

    scores = [run("base", base_model, kind="base")]
    if control is not None:
        scores.append(run("control (nothing skipped)", control, kind="control"))
    rels: list[torch.Tensor] = []
    scores.append(run("fbs (nothing skipped)", model, kind="full", relative_updates=rels if matched else None))
    at_tau = {}
    for t in taus:
        at_tau[t] = run("fbs", model, tau=t, kind="tau")
        scores.append(at_tau[t])
    for t in matched:
        counts = at_tau[t].skipped
        for kind, plans in (("random", random_plans(model, docs, counts, gate_from, seed)),
                            ("static", static_plans(model, docs, sum(counts), rels, gate_from)[0]),
                            ("oracle", oracle_plans(model, docs, counts, rels, gate_from))):
            s = run(f"{kind} @ tau {t:g}", model, plans=plans, kind=kind)
            s.tau = t
            scores.append(s)
    bar.close()
    base = scores[0]
    saving = PairSaving.of(model)
    rows = [summarize(s, base, docs, seed, saving if s.kind != "base" else PairSaving()) for s in scores]
    best = select_operating_point(rows, base.ppl, tolerance)
    return {"rows": rows, "base_ppl": base.ppl, "tolerance": tolerance, "gate_from": gate_from,
            "operating_point": None if best is None else best["tau"], "matched_taus": matched,
            "documents": [{"id": d.id, "lang": d.lang, "tokens": len(d.input_ids)} for d in docs],
            "per_document": {f"{s.name}@{s.tau}": {"nll": s.nll, "skipped": s.skipped, "pairs": s.pairs}
                             for s in scores}}


# ---------------------------------------------------------------------------- tau calibration
def calibrate_tau(model, docs: Sequence[HeldoutDoc], target: float, gate_from: int = DEFAULT_GATE_FROM,
                  batch_size: int = 4, tol: float = 0.002, max_iter: int = 30,
                  progress: Callable[[float, float], None] | None = None) -> dict:
    """The tau whose threshold skip ratio on ``docs`` (skipped / all (token, layer) pairs of the decoded
    positions, as :func:`score` counts it) is ``target``, by bisection on tau in [0, 1].

    The ratio falls as tau rises (a pair skips when p > tau). Stops when the ratio is within ``tol`` of the
    target, the bracket is narrower than 1e-7 or after ``max_iter`` passes; returns the evaluated tau closest to the target and the
    history. ``progress(tau, ratio)`` is called after every evaluation."""
    if not 0 <= target < 1:
        raise ValueError(f"target skip ratio must be in [0, 1), got {target}")
    history = []

    def ratio(tau: float) -> float:
        r = score(model, docs, tau=tau, name="calibration", batch_size=batch_size, gate_from=gate_from).skip_ratio
        history.append({"tau": tau, "skip_ratio": r})
        if progress is not None:
            progress(tau, r)
        return r

    top = len(model.layers_cfg.gated) / model.num_layers  # tau 0 skips every gated pair
    if top < target - tol:
        raise ValueError(f"even tau 0 skips at most {100 * top:.2f}% of pairs (< target {100 * target:.2f}%): "
                         "the gated layers cannot reach the target")
    lo, hi = 0.0, 1.0
    while len(history) < max_iter and hi - lo >= 1e-7 and not any(abs(h["skip_ratio"] - target) <= tol
                                                                   for h in history):
        mid = (lo + hi) / 2
        if ratio(mid) > target:
            lo = mid
        else:
            hi = mid
    best = min(history, key=lambda h: abs(h["skip_ratio"] - target))
    return {"tau": best["tau"], "skip_ratio": best["skip_ratio"], "target": target, "gate_from": gate_from,
            "blocks": len(docs), "history": history}


def write_tau(checkpoint: str | Path, tau: float, info: dict) -> Path:
    """Set ``tau`` in a checkpoint's config (``fbs_config.json``), recording ``info`` under
    ``extra["tau_calibration"]``; the file is replaced atomically."""
    from ..model.config import FBSConfig
    from ..model.causal_lm import CONFIG_NAME

    path = Path(checkpoint) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{checkpoint} is not an FBS checkpoint (no {CONFIG_NAME})")
    cfg = json.loads(path.read_text())
    cfg["tau"] = float(tau)
    cfg.setdefault("extra", {})["tau_calibration"] = info
    FBSConfig.from_dict(cfg)  # validate before writing
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(cfg, indent=1, sort_keys=True))
    os.replace(tmp, path)
    return path
