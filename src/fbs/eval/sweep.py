"""Tau sweep of a trained FBS on held-out documents: skip %, TFLOPs(rel) and perplexity per threshold.

The paper's threshold sweep (appendix E.6.1) and its "FBS-S1 with nothing skipped" perplexity (§4),
measured on the held-out (test) split of a corpus built by ``fbs data build``:

* documents: a seeded sample of ``per_lang`` test documents per language, each cut to its first
  ``max_tokens`` tokens (no special tokens, as in training);
* each system scores every document in one teacher-forced parallel forward. FBS at a threshold skips
  the (token, layer) pairs whose gate probability exceeds tau, from position ``gate_from`` on (default 1:
  the first token, the attention sink, is always part of the prefilled prompt when decoding), with the K/V of a skipped pair computed
  from its layer input: exactly what cached decoding under the ``project`` KV policy computes
  (``tests/test_model_equivalence.py``), so the perplexity is that of decoding every token with skips;
* per document: mean NLL, skipped pairs / all (token, layer) pairs. Perplexity = exp(mean over documents
  of the per-document mean NLL) (documents weigh equally, as ``fbs eval``'s ppl tasks), a 95% bootstrap
  CI over documents, and the paired bootstrap of the difference against the base model (appendix B.6);
* TFLOPs(rel) here is the paper's estimate, executed (token, layer) pairs / all pairs = 1 - skip ratio
  (every layer costs the same). The exact variant needs a decode trace: ``fbs bench --taus``.

``select_operating_point`` picks the most efficient tau whose perplexity is within ``tolerance`` of the
base model's.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch

from .stats import bootstrap_ci, paired_bootstrap, ppl_metric

DEFAULT_TAUS = (0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65)


@dataclasses.dataclass(frozen=True)
class HeldoutDoc:
    id: str
    lang: str
    input_ids: torch.Tensor  # (T,)


@dataclasses.dataclass
class SystemScores:
    """Per-document results of one system, in the order of the documents."""

    name: str
    tau: float | None
    nll: list[float]          # mean NLL per document
    skipped: list[int]        # skipped (token, layer) pairs per document
    pairs: list[int]          # all (token, layer) pairs per document

    @property
    def skip_ratio(self) -> float:
        return sum(self.skipped) / max(1, sum(self.pairs))

    @property
    def ppl(self) -> float:
        return ppl_metric(np.asarray(self.nll))


def heldout_documents(corpus_dir: str | Path, tokenizer, split: str = "test", per_lang: int = 24,
                      max_tokens: int = 512, seed: int = 0, langs: Sequence[str] | None = None) -> list[HeldoutDoc]:
    """A seeded sample of ``per_lang`` documents per language of ``split``, each cut to ``max_tokens`` tokens.

    The sample is a pure function of the split file, ``per_lang`` and ``seed`` (ids sorted, then shuffled
    by ``random.Random(seed)``); documents shorter than 2 tokens are skipped."""
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
        if len(ids) >= 2:
            docs.append(HeldoutDoc(rec["id"], rec["lang"], torch.tensor(ids, dtype=torch.long)))
    return docs


def _batches(docs: Sequence[HeldoutDoc], batch_size: int) -> Iterable[list[int]]:
    """Indices of documents grouped into equal-length batches (no padding needed)."""
    by_len: dict[int, list[int]] = {}
    for i, d in enumerate(docs):
        by_len.setdefault(len(d.input_ids), []).append(i)
    for idx in by_len.values():
        for s in range(0, len(idx), batch_size):
            yield idx[s:s + batch_size]


@torch.no_grad()
def score(model, docs: Sequence[HeldoutDoc], tau: float | None, name: str, batch_size: int = 4,
          progress=None, gate_from: int = 1) -> SystemScores:
    """Per-document NLL and skips of ``model`` (an FBSForCausalLM) with gates off (``tau=None``) or at ``tau``;
    positions before ``gate_from`` are never skipped (at decode time they are the prefilled prompt)."""
    model.eval()
    dev = next(model.parameters()).device
    n = len(docs)
    nll, skipped, pairs = [0.0] * n, [0] * n, [0] * n
    n_layers = model.num_layers
    for idx in _batches(docs, batch_size):
        ids = torch.stack([docs[i].input_ids for i in idx]).to(dev)
        if tau is None:
            out = model(ids, gate_mode="off")
        else:
            out = model(ids, gate_mode="threshold", tau=tau, gate_from=gate_from)
        logp = torch.log_softmax(out.logits[:, :-1].float(), dim=-1)
        tok_nll = -logp.gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
        for j, i in enumerate(idx):
            nll[i] = float(tok_nll[j].mean())
            skipped[i] = int(out.skips[j].sum()) if (tau is not None and out.skips is not None) else 0
            pairs[i] = ids.shape[1] * n_layers
        if progress is not None:
            progress(len(idx))
    return SystemScores(name, tau, nll, skipped, pairs)


def summarize(scores: SystemScores, base: SystemScores, docs: Sequence[HeldoutDoc], seed: int = 0) -> dict:
    """One row: skip %, TFLOPs(rel) (paper estimate), PPL with CI, per-language PPL, delta vs base with CI/p."""
    nll = np.asarray(scores.nll)
    lo, hi = bootstrap_ci(nll, ppl_metric, seed=seed)
    cmp = paired_bootstrap(scores.nll, base.nll, ppl_metric, higher_is_better=False, seed=seed)
    langs = sorted({d.lang for d in docs})
    per_lang = {}
    for lang in langs:
        m = np.array([d.lang == lang for d in docs])
        per_lang[lang] = ppl_metric(nll[m])
    return {
        "system": scores.name, "tau": scores.tau, "skip_ratio": scores.skip_ratio,
        "tflops_rel": 1.0 - scores.skip_ratio, "ppl": scores.ppl, "ppl_ci": [lo, hi],
        "ppl_rel_to_base": scores.ppl / base.ppl - 1.0, "per_lang_ppl": per_lang,
        "vs_base": cmp.to_dict(),
    }


def select_operating_point(rows: Sequence[dict], base_ppl: float, tolerance: float = 0.02) -> dict | None:
    """The row with a tau and the lowest TFLOPs(rel) whose PPL is at most (1 + tolerance) x the base PPL."""
    ok = [r for r in rows if r["tau"] is not None and r["ppl"] <= base_ppl * (1 + tolerance)]
    return min(ok, key=lambda r: (r["tflops_rel"], -r["tau"])) if ok else None


def markdown(rows: Sequence[dict], langs: Sequence[str]) -> str:
    head = ("| system | tau | Skip % | TFLOPs(rel) | PPL [95% CI] | vs base: Δ PPL [95% CI], p | "
            + " | ".join(f"PPL {l}" for l in langs) + " |")
    sep = "|" + "---|" * (6 + len(langs))
    out = [head, sep]
    for r in rows:
        v = r["vs_base"]
        delta = "–" if r["system"] == "base" else (
            f"{v['delta']:+.3f} [{v['ci_low']:+.3f}, {v['ci_high']:+.3f}], p={v['p_value']:.3f}"
            + (" *" if v["significant"] else ""))
        tau = "–" if r["tau"] is None else f"{r['tau']:.2f}"
        out.append(f"| {r['system']} | {tau} | {100 * r['skip_ratio']:.1f} | {r['tflops_rel']:.3f} | "
                   f"{r['ppl']:.3f} [{r['ppl_ci'][0]:.2f}, {r['ppl_ci'][1]:.2f}] | {delta} | "
                   + " | ".join(f"{r['per_lang_ppl'][l]:.3f}" for l in langs) + " |")
    return "\n".join(out)


def run_sweep(model, base_model, docs: Sequence[HeldoutDoc], taus: Sequence[float], batch_size: int = 4,
              seed: int = 0, progress: bool = True, tolerance: float = 0.02, gate_from: int = 1) -> dict:
    """Score the base model, the FBS model with nothing skipped and at every tau; rows + the chosen tau."""
    from tqdm.auto import tqdm

    systems = [("base", base_model, None), ("fbs (nothing skipped)", model, None)]
    systems += [("fbs", model, float(t)) for t in taus]
    bar = tqdm(total=len(systems) * len(docs), desc="tau sweep", unit="doc", disable=not progress)
    scores = []
    for name, m, tau in systems:
        bar.set_postfix_str(f"{name} tau={tau}")
        scores.append(score(m, docs, tau, name, batch_size, progress=bar.update, gate_from=gate_from))
    bar.close()
    base = scores[0]
    rows = [summarize(s, base, docs, seed) for s in scores]
    best = select_operating_point(rows, base.ppl, tolerance)
    return {"rows": rows, "base_ppl": base.ppl, "tolerance": tolerance, "gate_from": gate_from,
            "operating_point": None if best is None else best["tau"],
            "documents": [{"id": d.id, "lang": d.lang, "tokens": len(d.input_ids)} for d in docs],
            "per_document": {f"{s.name}@{s.tau}": {"nll": s.nll, "skipped": s.skipped, "pairs": s.pairs}
                             for s in scores}}
