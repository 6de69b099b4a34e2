"""Mechanism statistics from decode traces (``fbs eval mechanism``; paper §4.3 and appendix G).

Held-out chat prompts (:mod:`fbs.data.chat`, rendered with the chat template) are decoded greedily through the
engine at the model's tau (``model.generate(..., output_scores=True)``). Per analysed token, from the trace, the
step's logits and one teacher-forced full-depth forward:

**Alignment.** The engine's trace step i is the decode step that *consumed* generated token y_i (the last
generated token is never consumed, so it has no trace entry and is not analysed). For token i:

* ``executed[i, l]``, ``gate_p[i, l]``: which layers ran for y_i and what its gates said (skipped = not executed;
  under ``skip_granularity="ffn"`` that is the FFN only);
* k(i): the PAW span predicted while reading y_i (``trace.window_k``; -1 where the PAW layer was skipped: no k);
* s(i) = -log p(y_i | y_<i) and H(i) = -sum_v p(v | y_<i) log p(v | y_<i) in nats, from the logits that chose
  y_i (``res.scores[i]``), the paper's definitions with the same index; also H_next(i), the entropy of
  p(. | y_<=i) that the step reading y_i produced (the uncertainty about the tokens PAW previews);
* the class of y_i (:func:`classify_token`), whether y_i has a character inside a 4-character idiom of the
  lexicon in the decoded answer (:func:`idiom_flags`; Chinese), and its CH state: ``B`` (started a chunk at the
  first CH layer), ``inside``, or unknown where that CH layer did not run for y_i (the trace records boundaries
  only where CH ran);
* the residual-energy proxy E(i, l) = ||h_(l+1) - h_l|| / ||h_l|| of layer l at y_i's position, from ONE
  teacher-forced forward of prompt + answer with every layer running (``gate_mode="off"``, the relative-update
  oracle of training and ``fbs eval sweep``): what the layer would change, also where the decode skipped it.

**Statistics** (every CI: 1000 bootstrap resamples of EXAMPLES (prompts), seeded, percentile 95% CI; p-values
two-sided, p = 2 min(P(d <= 0), P(d >= 0)) over the resamples as in :mod:`fbs.eval.stats`, so the smallest
non-zero p is 2/1000; Benjamini-Hochberg over every test in the report, q = 0.05, the paper's):

1. Spearman rho and Kendall tau-b of k(i) with s(i), H(i) and H_next(i), pooled and per language; mean k per
   surprisal decile. Tokens without k are left out; a constant k (PAW disabled or not trained) is reported
   as such, not as NaN.
2. Skip rate per layer; heatmaps generation position (binned) x layer and token class x layer.
3. Spearman of skipped (0/1) with E per gated layer and pooled over gated (token, layer) pairs; pooled gate
   probability with E; skip rate per within-layer quintile of E (the paper's bucket test).
4. Odds ratio of skipping, pooled over (token, gated layer) pairs, for each token class against all other
   tokens, for idiom tokens against other tokens of the Chinese answers, and for chunk-boundary tokens against
   inside tokens (CH layers left out: a known state implies CH ran). CI and p from the bootstrap over
   examples; Woolf's log-OR CI (it treats pairs as independent, so it can be too narrow) is given alongside.
5. Skip rate (gated layers except CH layers) at chunk-boundary tokens and at offsets -2..+3 from them.

Spearman is computed as Pearson of average ranks; a bootstrap resample weighs each token by its example's
multiplicity, with ranks from those weights (exactly the statistic of the resampled data, no re-sorting).
Kendall tau-b uses per-(x level, y value) weight tables, fast when x (here k) has few distinct values.

**The trace** ``mechanism_tokens.jsonl`` holds everything the statistics read: a header line (``format``,
``version``, the run's ``config``: tau, layers, gated and CH layers, resamples, seed, ...) and one line per
prompt with its answer and, per analysed token, k, s, H, H_next, class, idiom, CH state, skipped layers, gate
probabilities and relative updates, written so that they read back to the very arrays the decode analysed.
:func:`analyze_trace` (``fbs analyze``) recomputes the report from it without a model: the decode run and the
trace run both go through :func:`summarize`, so with the same resamples and seed they give the same statistics.
Traces of format 1 (before the header) need the ``mechanism.json`` of their run next to them (for the config
and for the two gate-probability statistics, which they do not hold) and have s, H, H_next and E rounded to
5 decimals.
"""

from __future__ import annotations

import dataclasses
import json
import keyword
import logging
import math
import time
import unicodedata
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from ..jsonl import iter_records
from ..model.gate import relative_updates
from .stats import N_RESAMPLES, RankPair, bh_adjusted, bootstrap_indices, kendall_tau_b, spearman  # noqa: F401

logger = logging.getLogger(__name__)

MAX_NEW_TOKENS = 128
BATCH_SIZE = 8
#: Benjamini-Hochberg FDR level (appendix G)
FDR_Q = 0.05
CLASSES = ("punctuation", "function_word", "digit", "code_keyword", "whitespace", "other")
#: a token's CH state in the trace by TokenTable.boundary
CH_STATES = {1: "B", 0: "inside", -1: None}
OFFSETS = (-2, -1, 0, 1, 2, 3)
POSITION_BINS = 16
#: the per-token trace of a run, and what its header line says
TRACE_NAME = "mechanism_tokens.jsonl"
TRACE_FORMAT = "fbs-mechanism-trace"
TRACE_VERSION = 2
#: config fields the statistics and the report need from a trace's header (or from its run's mechanism.json)
TRACE_CONFIG = ("tau", "layers", "gated", "ch_layers")

FUNCTION_WORDS_EN = frozenset("""
a an the and or but nor so yet if then else of in on at to for from by with about as into onto over under than
that this these those there here it its is are was were be been being am do does did have has had will would
shall should can could may might must not no i me my we us our you your he him his she her they them their who
whom whose which what when where why how all any each some such very also just only up out off down while
because until after before through between both either neither too more most
""".split())
FUNCTION_WORDS_ZH = frozenset("""
的 地 得 了 着 过 是 在 和 与 及 或 也 就 都 而 又 把 被 让 给 对 从 向 于 以 之 其 这 那 这个 那个 这些 那些 一个
我 你 他 她 它 我们 你们 他们 它们 自己 不 没 没有 很 更 最 还 但 但是 因为 所以 如果 虽然 可以 会 能 吗 呢 吧 啊 等
""".split())
#: Python keywords; words on both lists (and, if, for, in, is, not, or, with, as, from, else, while) are function words
CODE_KEYWORDS = frozenset(keyword.kwlist)


# ---------------------------------------------------------------------------- token properties
def classify_token(text: str) -> str:
    """Class of a token's text (first match): ``whitespace`` (only whitespace, newlines included),
    ``punctuation`` (punctuation or symbol characters, Unicode P* / S*, after stripping whitespace),
    ``digit`` (digits only), ``function_word`` (English, case-insensitive, or Chinese list), ``code_keyword``
    (Python's ``keyword.kwlist``, case-sensitive), else ``other`` (empty text included)."""
    if not text:
        return "other"
    word = text.strip()
    if not word:
        return "whitespace"
    if all(unicodedata.category(c)[0] in "PS" for c in word if not c.isspace()):
        return "punctuation"
    if all(c.isdigit() for c in word):
        return "digit"
    if word.lower() in FUNCTION_WORDS_EN or word in FUNCTION_WORDS_ZH:
        return "function_word"
    if word in CODE_KEYWORDS:
        return "code_keyword"
    return "other"


def token_spans(tokenizer, ids: Sequence[int]) -> tuple[str, list[tuple[int, int]]]:
    """(decoded text, per token its character span in it). Token j ends where the decoded prefix ``ids[:j+1]``
    ends, a trailing U+FFFD (an incomplete UTF-8 sequence) not counted; a byte fragment that completes no character
    gets the span of the character it begins. A token that decodes to nothing (a special token skipped by the
    tokenizer) has an empty span."""
    ids = list(ids)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    ends, pending, last = [], [], 0
    for j in range(len(ids)):
        raw = tokenizer.decode(ids[:j + 1], skip_special_tokens=False)
        prefix = raw.rstrip("\ufffd")
        pending.append(len(prefix) < len(raw))
        last = max(last, min(len(prefix), len(text)))
        ends.append(last)
    spans = [(ends[j - 1] if j else 0, ends[j]) for j in range(len(ids))]
    for j in range(len(spans) - 2, -1, -1):
        if spans[j][0] == spans[j][1] and pending[j]:
            spans[j] = (spans[j][0], spans[j + 1][1])
    return text, spans


def idiom_flags(text: str, spans: Sequence[tuple[int, int]], lexicon) -> list[bool]:
    """Per token: a character of its span lies inside an occurrence of an idiom of ``lexicon``
    (:class:`fbs.data.bios.IdiomLexicon`) in ``text`` (every occurrence, overlapping ones included)."""
    inside = np.zeros(len(text) + 1, dtype=bool)
    for sp in lexicon.matches(text):
        inside[sp.start:sp.end] = True
    return [bool(inside[a:b].any()) for a, b in spans]


# ---------------------------------------------------------------------------- bootstrap over examples
def multiplicities(example: np.ndarray, n_resamples: int = N_RESAMPLES, seed: int = 0) -> np.ndarray:
    """(n_resamples, E) how often each example is drawn in each bootstrap resample of the E examples
    (:func:`fbs.eval.stats.bootstrap_indices`); ``example`` holds example indices 0..E-1 (only E is used)."""
    e = int(np.max(example)) + 1 if len(example) else 0
    idx = bootstrap_indices(e, n_resamples, seed)
    flat = (idx + e * np.arange(n_resamples)[:, None]).ravel()
    return np.bincount(flat, minlength=n_resamples * e).reshape(n_resamples, e).astype(np.float64)


def _p_two_sided(boot: np.ndarray, null: float = 0.0) -> float:
    """Two-sided bootstrap p-value of the statistic against ``null`` (the rule of :mod:`fbs.eval.stats`)."""
    return min(1.0, 2.0 * min(float(np.mean(boot <= null)), float(np.mean(boot >= null))))


def _ci(boot: np.ndarray) -> list[float]:
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return [float(lo), float(hi)]


def _reindex(example: np.ndarray) -> np.ndarray:
    """Example indices renumbered 0..E-1 in order of first appearance."""
    _, first, inv = np.unique(example, return_index=True, return_inverse=True)
    return np.argsort(np.argsort(first))[inv]


def correlation_test(x, y, example, method: str = "spearman", n_resamples: int = N_RESAMPLES,
                     seed: int = 0) -> dict:
    """Rank correlation of x and y over tokens with the bootstrap over examples (``example``: each token's
    example). ``value`` None and ``status`` "constant" when one variable has a single value."""
    x, y, example = np.asarray(x, float), np.asarray(y, float), np.asarray(example)
    keep = np.isfinite(x) & np.isfinite(y)
    x, y, example = x[keep], y[keep], _reindex(example[keep])
    base = {"method": method, "n_tokens": int(len(x)), "n_examples": int(len(np.unique(example)))}
    if len(x) < 2:
        return base | {"value": None, "status": "too few tokens"}
    pair = RankPair(x, y)
    stat = pair.spearman if method == "spearman" else pair.kendall
    value = stat()
    if math.isnan(value):
        const = "x" if pair.nx < 2 else "y"
        return base | {"value": None, "status": "constant", "constant": const}
    m = multiplicities(example, n_resamples, seed)
    boot = np.array([stat(row[example]) for row in m])
    ok = boot[np.isfinite(boot)]
    return base | {"value": value, "status": "ok", "ci": _ci(ok) if len(ok) else [None, None],
                   "p_value": _p_two_sided(ok) if len(ok) else None, "undefined_resamples": int(len(boot) - len(ok))}


# ---------------------------------------------------------------------------- odds ratios and rates
def odds_ratio(a: float, b: float, c: float, d: float) -> dict:
    """2x2 table [[a, b], [c, d]] (rows: property / not; columns: skipped / computed). OR = ad / bc with Woolf's
    95% CI exp(log OR +- 1.96 sqrt(1/a + 1/b + 1/c + 1/d)) and its z-test p; 0.5 is added to every cell when one
    is zero (Haldane-Anscombe)."""
    cells = np.array([a, b, c, d], dtype=np.float64)
    corrected = bool((cells == 0).any())
    if corrected:
        cells = cells + 0.5
    a, b, c, d = cells
    log_or = math.log(a * d / (b * c))
    se = math.sqrt((1 / cells).sum())
    p = math.erfc(abs(log_or) / se / math.sqrt(2))
    return {"odds_ratio": math.exp(log_or), "ci_woolf": [math.exp(log_or - 1.959964 * se),
                                                         math.exp(log_or + 1.959964 * se)],
            "p_woolf": p, "haldane": corrected}


def _log_or_rows(t: np.ndarray) -> np.ndarray:
    """log OR of each row (a, b, c, d) of ``t``, Haldane-Anscombe corrected where a cell is zero."""
    t = t + 0.5 * (t == 0).any(axis=1, keepdims=True)
    return np.log(t[:, 0] * t[:, 3] / (t[:, 1] * t[:, 2]))


def odds_ratio_test(prop: np.ndarray, skipped: np.ndarray, pairs: np.ndarray, example: np.ndarray,
                    n_resamples: int = N_RESAMPLES, seed: int = 0) -> dict:
    """Odds ratio of skipping for tokens with ``prop`` against the others, pooled over the (token, layer) pairs
    in ``pairs`` (n, L); bootstrap CI and p over examples, Woolf's CI alongside."""
    example = _reindex(np.asarray(example))
    e = int(example.max()) + 1 if len(example) else 0
    sk = (skipped & pairs).sum(axis=1).astype(np.float64)
    co = (~skipped & pairs).sum(axis=1).astype(np.float64)
    prop = np.asarray(prop, dtype=bool)
    per_ex = np.stack([np.bincount(example, weights=v, minlength=e)
                       for v in (sk * prop, co * prop, sk * ~prop, co * ~prop)], axis=1)  # (E, 4)
    a, b, c, d = per_ex.sum(axis=0)
    out = {"n_tokens": int(prop.sum()), "n_other_tokens": int((~prop).sum()), "n_examples": e,
           "table": [[int(a), int(b)], [int(c), int(d)]],
           "skip_rate": float(a / (a + b)) if a + b else None,
           "skip_rate_other": float(c / (c + d)) if c + d else None}
    if min(a + b, c + d, a + c, b + d) == 0:  # no token with (or without) the property, or no variation in skipping
        return out | {"odds_ratio": None, "status": "undefined (an empty row or column)"}
    boot = _log_or_rows(multiplicities(example, n_resamples, seed) @ per_ex)
    ok = boot[np.isfinite(boot)]
    return out | odds_ratio(a, b, c, d) | {"status": "ok", "ci": [float(v) for v in np.exp(_ci(ok))],
                                           "p_value": _p_two_sided(ok), "ci_method": "bootstrap over examples"}


def ratio_with_ci(num: np.ndarray, den: np.ndarray, example: np.ndarray, m: np.ndarray) -> dict:
    """sum(num) / sum(den) over tokens with a bootstrap CI over examples (``m``: multiplicities (R, E))."""
    e = m.shape[1]
    pn, pd = np.bincount(example, weights=num, minlength=e), np.bincount(example, weights=den, minlength=e)
    total = float(pd.sum())
    if total == 0:
        return {"value": None, "n": 0}
    bn, bd = m @ pn, m @ pd
    ok = bd > 0
    return {"value": float(pn.sum() / total), "ci": _ci(bn[ok] / bd[ok]) if ok.any() else None, "n": total}


def boundary_offsets(example: np.ndarray, position: np.ndarray, boundary: np.ndarray, skipped: np.ndarray,
                     pairs: np.ndarray, m: np.ndarray, offsets: Sequence[int] = OFFSETS) -> list[dict]:
    """Skip rate (skipped / counted (token, layer) pairs, ``pairs`` (n, L)) of the tokens at each offset from a
    chunk-boundary token (``boundary == 1``) of the same example; a token near two boundaries counts at both.
    Tokens of an example are consecutive rows of the arrays, in order of ``position``."""
    n = len(example)
    sk = (skipped & pairs).sum(axis=1).astype(np.float64)
    cnt = pairs.sum(axis=1).astype(np.float64)
    anchors = np.nonzero(boundary == 1)[0]
    out = []
    for off in offsets:
        tgt = anchors + off
        inside = np.nonzero((tgt >= 0) & (tgt < n))[0]
        same = (example[tgt[inside]] == example[anchors[inside]]) & \
            (position[tgt[inside]] == position[anchors[inside]] + off)
        tgt = tgt[inside[same]]
        r = ratio_with_ci(sk[tgt], cnt[tgt], example[tgt], m)
        out.append({"offset": off, "tokens": int(len(tgt)), "pairs": int(cnt[tgt].sum()),
                    "skipped": int(sk[tgt].sum()), "skip_rate": r["value"], "ci": r.get("ci")})
    return out


# ---------------------------------------------------------------------------- the token table
@dataclasses.dataclass
class TokenTable:
    """Flat arrays over the analysed tokens (n) of all examples; the tokens of an example are consecutive."""

    example: np.ndarray        # (n,) example index
    position: np.ndarray       # (n,) i: index of the generated token in its answer
    k: np.ndarray              # (n,) PAW span, -1 where PAW did not run
    surprisal: np.ndarray      # (n,) nats
    entropy: np.ndarray        # (n,) nats, of p(. | y_<i)
    entropy_next: np.ndarray   # (n,) nats, of p(. | y_<=i)
    cls: np.ndarray            # (n,) index into CLASSES
    idiom: np.ndarray          # (n,) bool
    boundary: np.ndarray       # (n,) 1 = B, 0 = inside, -1 = unknown (CH did not run)
    executed: np.ndarray       # (n, L) bool
    gate_p: np.ndarray         # (n, L) float, NaN where no gate was evaluated
    rel_update: np.ndarray     # (n, L) float, full-depth teacher-forced relative update
    langs: list[str]           # per example
    gated: tuple[int, ...]
    ch_layers: tuple[int, ...] = ()

    @property
    def n_layers(self) -> int:
        return self.executed.shape[1]

    def gated_mask(self, drop: Sequence[int] = ()) -> np.ndarray:
        """(n, L) bool: the gated layers (except ``drop``) of every token."""
        cols = np.zeros(self.n_layers, dtype=bool)
        cols[[l for l in self.gated if l not in drop]] = True
        return np.broadcast_to(cols, self.executed.shape)


@torch.no_grad()
def teacher_forced_updates(model, prompt: Sequence[int], answer: Sequence[int]) -> torch.Tensor:
    """(len(answer), L) relative update ||h_(l+1) - h_l|| / ||h_l|| of every layer at the answer's positions, from
    one full-depth forward of prompt + answer."""
    ids = torch.tensor([list(prompt) + list(answer)], device=model.preview_ids.device)
    hs = model(ids, gate_mode="off", output_hidden_states=True).hidden_states
    p = len(prompt)
    return relative_updates(hs)[0, p:].float()


def _step_uncertainty(scores: torch.Tensor, tokens: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(surprisal of each chosen token, entropy of each step's distribution) in nats from (n, V) logits."""
    logp = torch.log_softmax(scores.double(), dim=-1)
    s = -logp[torch.arange(len(tokens)), torch.tensor(tokens)]
    h = -torch.where(logp > -math.inf, logp.exp() * logp, torch.zeros_like(logp)).sum(-1)
    return s.numpy(), h.numpy()


@torch.no_grad()
def collect(model, tokenizer, prompts: Sequence[list[int]], langs: Sequence[str], *, tau: float | None = None,
            eos: Sequence[int] = (), max_new_tokens: int = MAX_NEW_TOKENS, batch_size: int = BATCH_SIZE,
            lexicon=None, progress: Callable[[int], None] | None = None) -> tuple[TokenTable, list[dict]]:
    """Decode ``prompts`` greedily (``batch_size`` per engine call) and build the token table; also per example
    its answer (ids, text) for the token file."""
    model.eval()
    tau = float(model.config.tau if tau is None else tau)
    L = model.num_layers
    ch0 = model.layers_cfg.ch[0] if model.layers_cfg.ch else None
    cols: dict[str, list] = {k: [] for k in ("example", "position", "k", "surprisal", "entropy", "entropy_next",
                                             "cls", "idiom", "boundary", "executed", "gate_p", "rel_update")}
    answers = []
    for start in range(0, len(prompts), batch_size):
        chunk = [list(p) for p in prompts[start:start + batch_size]]
        res = model.generate(chunk, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=list(eos) or None,
                             tokenizer=tokenizer, output_scores=True, tau=tau)
        tr = res.trace
        for r, new in enumerate(res.new_tokens):
            e = start + r
            m = int(tr.valid[r].sum())
            if not bool(tr.valid[r, :m].all()):
                raise RuntimeError("trace steps of a row are not consecutive")
            s, h = _step_uncertainty(res.scores[r], new)
            text, spans = token_spans(tokenizer, new)
            answers.append({"example": e, "lang": langs[e], "prompt_tokens": len(chunk[r]), "tokens": list(new),
                            "text": text})
            if m == 0:
                continue
            executed = tr.executed[r, :m].numpy()
            if ch0 is None:  # no CH: no state
                known = np.zeros(m, bool)
            else:  # the trace has a boundary where the CH layer ran (always under FFN granularity)
                known = executed[:, ch0] if tr.skip_granularity == "layer" else np.ones(m, bool)
            flags = idiom_flags(text, spans, lexicon) if lexicon is not None else [False] * len(new)
            cols["example"].append(np.full(m, e))
            cols["position"].append(np.arange(m))
            cols["k"].append(tr.window_k[r, :m].numpy())
            cols["surprisal"].append(s[:m])
            cols["entropy"].append(h[:m])
            cols["entropy_next"].append(h[1:m + 1])
            cols["cls"].append(np.array([CLASSES.index(classify_token(text[a:b])) for a, b in spans[:m]]))
            cols["idiom"].append(np.array(flags[:m], dtype=bool))
            cols["boundary"].append(np.where(known, tr.chunk_boundary[r, :m].numpy().astype(int), -1))
            cols["executed"].append(executed)
            cols["gate_p"].append(tr.gate_p[r, :m].numpy())
            cols["rel_update"].append(teacher_forced_updates(model, chunk[r], new[:m]).cpu().numpy())
        if progress is not None:
            progress(len(chunk))
    empty = {"executed": np.zeros((0, L), bool), "gate_p": np.zeros((0, L)), "rel_update": np.zeros((0, L))}
    arrays = {k: np.concatenate(v) if v else empty.get(k, np.zeros(0, int)) for k, v in cols.items()}
    table = TokenTable(**arrays, langs=list(langs), gated=tuple(model.layers_cfg.gated),
                       ch_layers=tuple(model.layers_cfg.ch))
    return table, answers


# ---------------------------------------------------------------------------- the analyses
def _k_uncertainty(t: TokenTable, n_resamples: int, seed: int) -> dict:
    has_k = t.k >= 0
    hist = {int(v): int(c) for v, c in zip(*np.unique(t.k[has_k], return_counts=True))}
    out = {"tokens_with_k": int(has_k.sum()), "tokens_without_k": int((~has_k).sum()), "k_histogram": hist,
           "mean_k": float(t.k[has_k].mean()) if has_k.any() else None, "tests": [], "deciles": None}
    if not has_k.any():
        return out | {"status": "no_k", "note": "PAW never ran for an analysed token (no PAW layer, or its layer was "
                                                "always skipped): no k(i) to correlate"}
    if len(hist) == 1:
        v = next(iter(hist))
        return out | {"status": "constant", "note": f"k(i) is constant (= {v}) on all {int(has_k.sum())} tokens: "
                                                    "PAW is disabled or untrained, rank correlations are undefined"}
    groups = {"all": has_k}
    langs = np.array(t.langs)[t.example]
    if len(set(t.langs)) > 1:
        groups |= {lang: has_k & (langs == lang) for lang in sorted(set(t.langs))}
    for g, mask in groups.items():
        for measure in ("surprisal", "entropy", "entropy_next"):
            for method in ("spearman", "kendall"):
                r = correlation_test(t.k[mask], getattr(t, measure)[mask], t.example[mask], method, n_resamples, seed)
                out["tests"].append({"group": g, "measure": measure} | r)
    # mean k per surprisal decile (edges from all tokens with k)
    s, k, ex = t.surprisal[has_k], t.k[has_k].astype(float), _reindex(t.example[has_k])
    edges = np.quantile(s, np.linspace(0, 1, 11))
    dec = np.clip(np.searchsorted(edges[1:-1], s, side="right"), 0, 9)
    m = multiplicities(ex, n_resamples, seed)
    rows = []
    for d in range(10):
        sel = dec == d
        r = ratio_with_ci(k[sel], np.ones(int(sel.sum())), ex[sel], m)
        rows.append({"decile": d + 1, "surprisal_range": [float(edges[d]), float(edges[d + 1])],
                     "tokens": int(sel.sum()), "mean_k": r["value"], "ci": r.get("ci")})
    return out | {"status": "ok", "deciles": rows}


def _layers(t: TokenTable) -> list[dict]:
    rows = []
    gated = set(t.gated)
    for l in range(t.n_layers):
        ex = int(t.executed[:, l].sum())
        n = len(t.executed)
        p = t.gate_p[:, l]
        rows.append({"layer": l, "gated": l in gated, "pairs": n, "executed": ex, "skipped": n - ex,
                     "skip_rate": (n - ex) / n if n else None,
                     "mean_gate_p": float(np.nanmean(p)) if np.isfinite(p).any() else None,
                     "mean_rel_update": float(t.rel_update[:, l].mean()) if n else None})
    return rows


def _heatmaps(t: TokenTable) -> dict:
    skipped = ~t.executed
    top = int(t.position.max()) + 1 if len(t.position) else 1
    width = max(1, math.ceil(top / POSITION_BINS))
    pos_bin = t.position // width
    n_bins = int(pos_bin.max()) + 1 if len(pos_bin) else 0

    def grid(labels: np.ndarray, n: int) -> tuple[list, list]:
        counts = np.bincount(labels, minlength=n)
        sums = np.stack([np.bincount(labels, weights=skipped[:, l], minlength=n) for l in range(t.n_layers)], 1)
        rates = [[float(v) for v in row / c] if c else [None] * t.n_layers for row, c in zip(sums, counts)]
        return rates, counts.tolist()

    pr, pc = grid(pos_bin, n_bins)
    cr, cc = grid(t.cls, len(CLASSES))
    return {"position": {"bin_width": width, "bins": [[b * width, (b + 1) * width - 1] for b in range(n_bins)],
                         "tokens": pc, "skip_rate": pr},
            "class": {"classes": list(CLASSES), "tokens": cc, "skip_rate": cr}}


def _skip_energy(t: TokenTable, n_resamples: int, seed: int) -> dict:
    skipped = ~t.executed
    per_layer = []
    for l in t.gated:
        r = correlation_test(skipped[:, l], t.rel_update[:, l], t.example, "spearman", n_resamples, seed)
        per_layer.append({"layer": l} | r)
    cols = list(t.gated)
    ex = np.repeat(t.example, len(cols))
    pooled = correlation_test(skipped[:, cols].ravel(), t.rel_update[:, cols].ravel(), ex, "spearman",
                              n_resamples, seed)
    p = t.gate_p[:, cols].ravel()
    pooled_p = correlation_test(p, t.rel_update[:, cols].ravel(), ex, "spearman", n_resamples, seed)
    # bucket test: quintiles of E within each gated layer, skip rate pooled over layers
    quint = np.zeros((len(t.example), t.n_layers), dtype=int)
    for l in cols:
        edges = np.quantile(t.rel_update[:, l], [0.2, 0.4, 0.6, 0.8]) if len(t.example) else []
        quint[:, l] = np.searchsorted(edges, t.rel_update[:, l], side="right")
    m = multiplicities(_reindex(t.example), n_resamples, seed) if len(t.example) else None
    buckets = []
    for q in range(5):
        sel = (quint == q)[:, cols]
        r = ratio_with_ci((skipped[:, cols] & sel).sum(1).astype(float), sel.sum(1).astype(float),
                          _reindex(t.example), m) if m is not None else {"value": None, "n": 0}
        buckets.append({"quintile": q + 1, "pairs": int(r["n"]), "skip_rate": r["value"], "ci": r.get("ci")})
    return {"proxy": "relative update ||h_(l+1) - h_l|| / ||h_l||, full-depth teacher-forced forward",
            "per_layer": per_layer, "pooled": pooled, "pooled_gate_p": pooled_p, "quintiles": buckets}


def _odds_ratios(t: TokenTable, n_resamples: int, seed: int) -> list[dict]:
    skipped = ~t.executed
    pairs = t.gated_mask()
    out = []
    for c, name in enumerate(CLASSES):
        out.append({"property": name, "against": "all other tokens"}
                   | odds_ratio_test(t.cls == c, skipped, pairs, t.example, n_resamples, seed))
    zh = np.array([lang == "zh" for lang in t.langs], dtype=bool)[t.example] if len(t.example) else np.zeros(0, bool)
    if zh.any():
        out.append({"property": "idiom", "against": "other tokens of Chinese answers"}
                   | odds_ratio_test(t.idiom[zh], skipped[zh], pairs[zh], t.example[zh], n_resamples, seed))
    known = t.boundary >= 0
    if known.any():
        out.append({"property": "chunk_boundary", "against": "inside-chunk tokens (CH layers left out)"}
                   | odds_ratio_test(t.boundary[known] == 1, skipped[known], t.gated_mask(t.ch_layers)[known],
                                     t.example[known], n_resamples, seed))
    return out


def _boundaries(t: TokenTable, n_resamples: int, seed: int) -> dict:
    pairs = t.gated_mask(t.ch_layers)
    skipped = ~t.executed
    n_b, n_known = int((t.boundary == 1).sum()), int((t.boundary >= 0).sum())
    out = {"boundary_tokens": n_b, "known_tokens": n_known, "unknown_tokens": int((t.boundary < 0).sum()),
           "layers": "gated layers except CH layers " + str(list(t.ch_layers))}
    if not t.ch_layers:
        return out | {"status": "no CH layer", "offsets": []}
    if n_b == 0:
        return out | {"status": "no chunk boundary among the analysed tokens", "offsets": []}
    ex = _reindex(t.example)
    m = multiplicities(ex, n_resamples, seed)
    sk = (skipped & pairs).sum(1).astype(float)
    cnt = pairs.sum(1).astype(float)
    ref = {}
    for name, sel in (("inside", t.boundary == 0), ("all", np.ones(len(ex), bool))):
        r = ratio_with_ci(sk[sel], cnt[sel], ex[sel], m)
        ref[name] = {"tokens": int(sel.sum()), "skip_rate": r["value"], "ci": r.get("ci")}
    return out | {"status": "ok", "offsets": boundary_offsets(ex, t.position, t.boundary, skipped, pairs, m),
                  "reference": ref}


def _all_tests(res: dict) -> list[dict]:
    """Every entry of the report that carries a p-value (the BH family)."""
    tests = list(res["k_uncertainty"]["tests"]) + list(res["skip_energy"]["per_layer"])
    tests += [res["skip_energy"]["pooled"], res["skip_energy"]["pooled_gate_p"]] + list(res["odds_ratios"])
    return [t for t in tests if t.get("p_value") is not None]


def _apply_fdr(res: dict, q: float = FDR_Q) -> None:
    """Benjamini-Hochberg q-values (and ``significant``) on every test of ``res`` with a p-value."""
    tests = _all_tests(res)
    for test, qv in zip(tests, bh_adjusted([tt["p_value"] for tt in tests])):
        test["q_value"] = qv
        test["significant"] = qv <= q
    res["fdr"] = {"method": "Benjamini-Hochberg", "q": q, "tests": len(tests),
                  "family": "every test with a p-value in this report"}


def analyse(t: TokenTable, n_resamples: int = N_RESAMPLES, seed: int = 0, q: float = FDR_Q,
            progress: Callable[[str], None] | None = None) -> dict:
    """Every statistic of the report from the token table (see the module docstring); ``progress`` is called
    with the name of each analysis before it runs."""
    skipped = ~t.executed
    gm = t.gated_mask()
    langs = np.array(t.langs)[t.example] if len(t.example) else np.zeros(0, str)
    res = {
        "counts": {"examples": len(t.langs), "examples_with_tokens": int(len(np.unique(t.example))),
                   "tokens": int(len(t.example)), "pairs": int(t.executed.size),
                   "skipped_pairs": int(skipped.sum()),
                   "skip_ratio": float(skipped.mean()) if t.executed.size else None, "gated_pairs": int(gm.sum()),
                   "gated_skip_ratio": float(skipped[gm].mean()) if gm.any() else None,
                   "tokens_per_lang": {lang: int((langs == lang).sum()) for lang in sorted(set(t.langs))},
                   "tokens_per_class": {c: int((t.cls == i).sum()) for i, c in enumerate(CLASSES)},
                   "idiom_tokens": int(t.idiom.sum())}}
    for name, fn in (("k_uncertainty", lambda: _k_uncertainty(t, n_resamples, seed)), ("layers", lambda: _layers(t)),
                     ("heatmaps", lambda: _heatmaps(t)), ("skip_energy", lambda: _skip_energy(t, n_resamples, seed)),
                     ("odds_ratios", lambda: _odds_ratios(t, n_resamples, seed)),
                     ("boundaries", lambda: _boundaries(t, n_resamples, seed))):
        if progress is not None:
            progress(name)
        res[name] = fn()
    _apply_fdr(res, q)
    return res


def summarize(table: TokenTable, config: dict, examples: list[dict], n_resamples: int = N_RESAMPLES, seed: int = 0,
              progress: Callable[[str], None] | None = None) -> dict:
    """The report of a run: its ``config`` (with the resamples and seed used here), its ``examples`` and every
    statistic of :func:`analyse`. The decode (:func:`run_mechanism`) and the trace (:func:`analyze_trace`) both
    come here."""
    res = {"config": dict(config) | {"n_resamples": n_resamples, "seed": seed}, "examples": examples}
    return res | analyse(table, n_resamples, seed, progress=progress)


def write_report(res: dict, out_dir: str | Path, plots: bool = True) -> dict:
    """Write ``mechanism.json``, ``mechanism.md`` and (``plots``) the PNGs of ``res`` into ``out_dir``; returns the
    JSON-safe result (with ``plots``: the PNG names)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    res["plots"] = [p.name for p in write_plots(res, out)] if plots else []
    res = _clean(res)
    (out / "mechanism.json").write_text(json.dumps(res, indent=1, ensure_ascii=False))
    (out / "mechanism.md").write_text(markdown(res))
    return res


# ---------------------------------------------------------------------------- the run
def run_mechanism(model, tokenizer, items, *, tau: float | None = None, eos: Sequence[int] | None = None,
                  max_new_tokens: int = MAX_NEW_TOKENS, batch_size: int = BATCH_SIZE, lexicon=None,
                  n_resamples: int = N_RESAMPLES, seed: int = 0, out_dir: str | Path | None = None,
                  progress: bool = True, plots: bool = True, meta: dict | None = None) -> dict:
    """Decode ``items`` (:class:`fbs.data.chat.ChatItem`, rendered with the chat template), analyse, and with
    ``out_dir`` write ``mechanism.json``, ``mechanism.md``, ``mechanism_tokens.jsonl`` and the PNG plots."""
    from tqdm.auto import tqdm

    from ..data.chat import render_prompt
    from .chat import eos_ids

    start = time.perf_counter()
    eos = eos_ids(model, tokenizer) if eos is None else list(eos)
    tau = float(model.config.tau if tau is None else tau)
    prompts = [render_prompt(tokenizer, it) for it in items]
    bar = tqdm(total=len(items), desc="mechanism", unit="prompt", disable=not progress)
    table, answers = collect(model, tokenizer, prompts, [it.lang for it in items], tau=tau, eos=eos,
                             max_new_tokens=max_new_tokens, batch_size=batch_size, lexicon=lexicon,
                             progress=bar.update)
    bar.close()
    config = {"tau": tau, "kv_policy": model.config.kv_policy, "max_new_tokens": max_new_tokens,
              "batch_size": batch_size, "eos_ids": eos, "n_resamples": n_resamples, "seed": seed,
              "layers": model.num_layers, "gated": list(table.gated), "paw_layers": list(model.layers_cfg.paw),
              "ch_layers": list(table.ch_layers), "k_max": model.config.k_max,
              "skip_granularity": model.config.skip_granularity, "classes": list(CLASSES),
              "idiom_lexicon": len(lexicon) if lexicon is not None else None} | (meta or {})
    examples = [{"id": it.id, "lang": it.lang, "tokens": len(a["tokens"]), "analysed": int((table.example == i).sum())}
                for i, (it, a) in enumerate(zip(items, answers))]
    res = summarize(table, config, examples, n_resamples, seed)
    res["wall_s"] = time.perf_counter() - start
    if out_dir is None:
        return _clean(res)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    write_token_file(Path(out_dir) / TRACE_NAME, res["config"], items, answers, table)
    return write_report(res, out_dir, plots)


def _clean(obj):
    """JSON-safe copy: numpy scalars to Python, NaN / inf to None."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, (np.bool_, bool)):
        return bool(obj)
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(obj) else None
    return obj


def _f32(values) -> list:
    """float32 values as the shortest decimals that read back to the same float32; NaN as null."""
    return [None if math.isnan(v) else float(str(v)) for v in np.asarray(values, dtype=np.float32)]


def write_token_file(path: Path, config: dict, items, answers: list[dict], t: TokenTable) -> None:
    """The trace: a header line (format, version, the run's ``config``), then one JSON line per example: its
    answer and, per analysed token, k, s, H, H_next, class, idiom, CH state, skipped layers, gate probabilities
    and the relative update of every layer. Floats are written exactly (s, H, H_next: float64; gate p and E:
    float32), so :func:`read_trace` gives back the arrays analysed here."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps({"format": TRACE_FORMAT, "version": TRACE_VERSION, "config": _clean(config)},
                           ensure_ascii=False) + "\n")
        for i, (it, a) in enumerate(zip(items, answers)):
            rows = np.nonzero(t.example == i)[0]
            toks = [{"i": int(t.position[j]), "id": a["tokens"][int(t.position[j])], "k": int(t.k[j]),
                     "s": float(t.surprisal[j]), "H": float(t.entropy[j]), "H_next": float(t.entropy_next[j]),
                     "class": CLASSES[int(t.cls[j])], "idiom": bool(t.idiom[j]), "ch": CH_STATES[int(t.boundary[j])],
                     "skipped": np.nonzero(~t.executed[j])[0].tolist(), "gate_p": _f32(t.gate_p[j]),
                     "rel_update": _f32(t.rel_update[j])} for j in rows]
            f.write(json.dumps({"id": it.id, "lang": it.lang, "prompt_tokens": a["prompt_tokens"],
                                "answer": a["tokens"], "text": a["text"], "tokens": toks}, ensure_ascii=False) + "\n")


class TraceError(ValueError):
    """A file that is not a usable mechanism trace (the message names it and what was expected)."""


@dataclasses.dataclass
class Trace:
    """A trace read back: the token table, the run's config and examples, and where they came from."""

    path: Path
    version: int
    config: dict
    examples: list[dict]
    table: TokenTable
    config_from: str            # "the trace header" or the mechanism.json the config was taken from
    previous: dict | None       # that mechanism.json (format-1 traces: the gate statistics come from it)


def _sidecar(path: Path) -> Path:
    """The ``mechanism.json`` of the run that wrote the trace ``path`` (``X_tokens.jsonl``: ``X.json``)."""
    stem = path.name[:-len("_tokens.jsonl")] if path.name.endswith("_tokens.jsonl") else "mechanism"
    return path.with_name(stem + ".json")


def read_trace(path: str | Path) -> Trace:
    """Read a trace of :func:`write_token_file` into the token table the decode analysed. Format 1 (no header
    line) lacks the config and gate probabilities: the run's ``mechanism.json`` next to it must supply the
    config (and its examples must be the trace's); without it a :class:`TraceError` names the missing fields."""
    path = Path(path)
    what = f"a mechanism trace (the {TRACE_NAME} of `fbs eval mechanism --out`)"
    header, lines = None, []
    with open(path, encoding="utf-8") as f:
        for n, obj in iter_records(f, str(path), TraceError, f"expected {what}"):
            if n == 1 and obj.get("format") == TRACE_FORMAT:
                header = obj
            elif {"id", "lang", "answer", "tokens"} <= set(obj):
                lines.append(obj)
            else:
                raise TraceError(f"{path}:{n}: not a line of {what} (a header, or an object with id, lang, answer "
                                 "and tokens)")
    version = int(header.get("version", 0)) if header else 1
    if version > TRACE_VERSION:
        raise TraceError(f"{path}: trace format {version} is newer than this fbs reads ({TRACE_VERSION})")
    examples = [{"id": x["id"], "lang": x["lang"], "tokens": len(x["answer"]), "analysed": len(x["tokens"])}
                for x in lines]
    config, config_from, previous = dict(header.get("config") or {}) if header else {}, "the trace header", None
    side = _sidecar(path)
    if version < 2 or any(k not in config for k in TRACE_CONFIG):
        if side.is_file():
            prev = json.loads(side.read_text(encoding="utf-8"))
            if prev.get("examples") != examples:
                raise TraceError(f"{side} is not the report of the run that wrote {path}: its examples differ")
            previous, config, config_from = prev, dict(prev.get("config") or {}) | config, str(side)
    missing = [k for k in TRACE_CONFIG if k not in config]
    if missing:
        raise TraceError(f"{path} lacks {', '.join(missing)} (" + ("a format-1 trace, written before the header "
                         "line" if header is None else "not in its header") + f") and there is no {side.name} of "
                         f"its run next to it to take them from; rerun `fbs eval mechanism` or put that run's "
                         f"{side.name} next to the trace")
    n_layers = int(config["layers"])
    cols: dict[str, list] = {k: [] for k in ("example", "position", "k", "surprisal", "entropy", "entropy_next",
                                             "cls", "idiom", "boundary", "executed", "gate_p", "rel_update")}
    states = {v: k for k, v in CH_STATES.items()}
    for e, x in enumerate(lines):
        for tok in x["tokens"]:
            try:
                if tok["ch"] not in states:
                    raise ValueError(f"unknown CH state {tok['ch']!r}")
                row = {"example": e, "position": tok["i"], "k": tok["k"], "surprisal": tok["s"], "entropy": tok["H"],
                       "entropy_next": tok["H_next"], "cls": CLASSES.index(tok["class"]), "idiom": tok["idiom"],
                       "boundary": states[tok["ch"]], "rel_update": tok["rel_update"],
                       "gate_p": tok["gate_p"] if version >= 2 else [None] * n_layers}
                executed = np.ones(n_layers, dtype=bool)
                executed[tok["skipped"]] = False
            except KeyError as err:
                raise TraceError(f"{path}: token {tok.get('i')} of {x['id']} has no field {err}") from None
            except (ValueError, IndexError) as err:
                raise TraceError(f"{path}: token {tok.get('i')} of {x['id']}: {err}") from None
            if len(row["rel_update"]) != n_layers or len(row["gate_p"]) != n_layers:
                raise TraceError(f"{path}: token {tok['i']} of {x['id']} has not one value per layer ({n_layers})")
            row["executed"] = executed
            for k, v in row.items():
                cols[k].append(v)

    def floats(rows: list) -> np.ndarray:  # per-layer float32 values, null = NaN
        return np.array([[np.nan if a is None else a for a in r] for r in rows], np.float32).reshape(-1, n_layers)

    table = TokenTable(example=np.array(cols["example"], dtype=np.int64), position=np.array(cols["position"], np.int64),
                       k=np.array(cols["k"], np.int64), surprisal=np.array(cols["surprisal"], np.float64),
                       entropy=np.array(cols["entropy"], np.float64),
                       entropy_next=np.array(cols["entropy_next"], np.float64), cls=np.array(cols["cls"], np.int64),
                       idiom=np.array(cols["idiom"], bool), boundary=np.array(cols["boundary"], np.int64),
                       executed=np.array(cols["executed"], bool).reshape(-1, n_layers),
                       gate_p=floats(cols["gate_p"]), rel_update=floats(cols["rel_update"]),
                       langs=[x["lang"] for x in lines], gated=tuple(config["gated"]),
                       ch_layers=tuple(config["ch_layers"]))
    return Trace(path, version, config, examples, table, config_from, previous)


def _recover_gate_statistics(res: dict, previous: dict) -> str:
    """A format-1 trace holds no gate probabilities: take the mean gate p per layer and, if the bootstrap is the
    same, the pooled gate p test from the run's ``mechanism.json``; BH again over the family. Returns a note."""
    for row, old in zip(res["layers"], previous["layers"]):
        row["mean_gate_p"] = old.get("mean_gate_p")
    old_cfg, cfg = previous.get("config", {}), res["config"]
    same = (old_cfg.get("n_resamples"), old_cfg.get("seed")) == (cfg["n_resamples"], cfg["seed"])
    if same:
        res["skip_energy"]["pooled_gate_p"] = {k: v for k, v in previous["skip_energy"]["pooled_gate_p"].items()
                                               if k not in ("q_value", "significant")}
    else:
        res["skip_energy"]["pooled_gate_p"].update(value=None, status="no gate p in the trace")
    _apply_fdr(res)
    return ("format-1 trace: s, H, H_next and E were rounded to 5 decimals, so the statistics built on them can "
            "differ slightly from the decode run's (new ties among the smallest values move rank statistics and "
            "quantile edges); it has no gate probabilities: the mean gate p per layer "
            + ("and the pooled gate p test are" if same else "is") + " the decode run's (its mechanism.json)"
            + ("" if same else ", the pooled gate p test is left out (another bootstrap than that run's)"))


def analyze_trace(path: str | Path, out_dir: str | Path | None = None, n_resamples: int | None = None,
                  seed: int | None = None, plots: bool = True,
                  progress: Callable[[str], None] | None = None) -> dict:
    """The report of a saved trace, without a model (``fbs analyze``): every statistic recomputed from it by
    :func:`summarize`, the decode run's own path. ``n_resamples`` and ``seed`` default to the run's, so the
    statistics are that run's. With ``out_dir``: ``mechanism.json``, ``mechanism.md`` and the PNGs there."""
    start = time.perf_counter()
    trace = read_trace(path)
    n_resamples = int(trace.config.get("n_resamples", N_RESAMPLES) if n_resamples is None else n_resamples)
    seed = int(trace.config.get("seed", 0) if seed is None else seed)
    if progress is not None:
        progress(f"{trace.path}: {len(trace.examples)} prompts, {len(trace.table.example)} tokens, tau "
                 f"{trace.config['tau']:g}, config from {trace.config_from}; {n_resamples} resamples, seed {seed}")
    res = summarize(trace.table, trace.config, trace.examples, n_resamples, seed,
                    progress=None if progress is None else lambda name: progress(f"analysing: {name}"))
    notes = [_recover_gate_statistics(res, trace.previous)] if trace.version < 2 else []
    res["source"] = {"trace": str(trace.path), "format": trace.version, "config_from": trace.config_from,
                     "notes": notes}
    res["wall_s"] = time.perf_counter() - start
    if out_dir is None:
        return _clean(res)
    if progress is not None:
        progress("plots and report" if plots else "report")
    return write_report(res, out_dir, plots)


# ---------------------------------------------------------------------------- reports
def _f(v, fmt: str = ".3f") -> str:
    return "–" if v is None else format(v, fmt)


def _ci_s(ci, fmt: str = ".3f") -> str:
    return "–" if not ci or ci[0] is None else f"[{format(ci[0], fmt)}, {format(ci[1], fmt)}]"


def _p_s(t: dict, key: str = "p_value", n_resamples: int = N_RESAMPLES) -> str:
    v = t.get(key)
    if v is None:
        return "–"
    return f"< {2 / n_resamples:.0e}" if v == 0 else f"{v:.3g}"


def _test_cells(t: dict, n_res: int) -> list[str]:
    if t.get("value") is None and t.get("odds_ratio") is None:
        return [t.get("status", "–")] + ["–"] * 3
    return [_f(t.get("value", t.get("odds_ratio"))), _ci_s(t.get("ci")), _p_s(t, "p_value", n_res),
            _p_s(t, "q_value", n_res) + (" *" if t.get("significant") else "")]


def _table(header: Sequence[str], rows) -> list[str]:
    """Markdown table lines: header, separator, one line per row of cells."""
    return (["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def markdown(res: dict) -> str:
    cfg, cnt = res["config"], res["counts"]
    n_res = cfg["n_resamples"]
    lines = [f"# Mechanism statistics (appendix G): {cnt['examples']} prompts, tau {cfg['tau']:g}", "",
             f"{cnt['tokens']} analysed tokens (the last generated token of an answer is never read, so has no "
             f"trace entry), {cnt['pairs']} (token, layer) pairs, skip ratio {_f(cnt['skip_ratio'], '.3%')} "
             f"(gated layers {_f(cnt['gated_skip_ratio'], '.3%')}). CIs: {n_res} bootstrap resamples of prompts; "
             f"p two-sided (bootstrap); q: Benjamini-Hochberg over all {res['fdr']['tests']} tests, * q <= "
             f"{res['fdr']['q']}.", ""]
    if res.get("source"):
        src = res["source"]
        lines += [f"Recomputed by `fbs analyze` from the trace `{src['trace']}` (format {src['format']}, config from "
                  f"{src['config_from']})." + "".join(f" Note: {n}." for n in src["notes"]), ""]
    lines += ["## 1. Lookahead k(i) vs uncertainty", ""]
    ku = res["k_uncertainty"]
    lines.append(f"Tokens with k: {ku['tokens_with_k']} (without: {ku['tokens_without_k']}); mean k "
                 f"{_f(ku['mean_k'], '.2f')}; histogram {{"
                 + ", ".join(f"{k}: {v}" for k, v in ku["k_histogram"].items()) + "}.")
    if ku["status"] != "ok":
        lines += ["", f"**{ku['note']}**"]
    else:
        lines += _table(("group", "measure", "method", "#tok", "#ex", "value", "95% CI", "p", "q"),
                        [[t["group"], t["measure"], t["method"], t["n_tokens"], t["n_examples"], *_test_cells(t, n_res)]
                         for t in ku["tests"]])
        lines += ["", "s = surprisal -log p(y_i | y_<i), H = entropy of p(. | y_<i), H_next = entropy of "
                  "p(. | y_<=i) (nats)."]
        lines += _table(("surprisal decile", "range (nats)", "tokens", "mean k", "95% CI"),
                        [[d["decile"], _ci_s(d["surprisal_range"], ".2f"), d["tokens"], _f(d["mean_k"], ".2f"),
                          _ci_s(d["ci"], ".2f")] for d in ku["deciles"]])
    lines += ["", "## 2. Skip rate per layer"]
    lines += _table(("layer", "gated", "skipped / pairs", "skip rate", "mean gate p", "mean rel. update"),
                    [[r["layer"], "yes" if r["gated"] else "no", f"{r['skipped']} / {r['pairs']}", _f(r["skip_rate"]),
                      _f(r["mean_gate_p"]), _f(r["mean_rel_update"])] for r in res["layers"]])
    lines += ["", f"Tokens per class: {cnt['tokens_per_class']} (skip rate per class: section 4; by layer and by "
              "generation position: the heatmap PNGs)."]
    se = res["skip_energy"]
    lines += ["", "## 3. Skip vs residual energy", "", f"Proxy: {se['proxy']}. Spearman of skipped (0/1) with it."]
    rows = se["per_layer"] + [dict(se["pooled"], layer="pooled (gated pairs)"),
                              dict(se["pooled_gate_p"], layer="pooled, gate p instead of skipped")]
    lines += _table(("layer", "#tok", "rho", "95% CI", "p", "q"),
                    [[t["layer"], t["n_tokens"], *_test_cells(t, n_res)] for t in rows])
    lines += ["", "Skip rate per within-layer quintile of the proxy (Q1 = smallest update), gated pairs:"]
    lines += _table(("quintile", "pairs", "skip rate", "95% CI"),
                    [[f"Q{b['quintile']}", b["pairs"], _f(b["skip_rate"]), _ci_s(b["ci"])] for b in se["quintiles"]])
    lines += ["", "## 4. Odds ratio of skipping by token property (pooled over gated layers)"]
    lines += _table(("property", "against", "tokens", "skip rate", "other", "OR", "95% CI (bootstrap)", "Woolf CI",
                     "p", "q"),
                    [[t["property"], t["against"], t["n_tokens"], _f(t["skip_rate"]), _f(t["skip_rate_other"]),
                      *(c := _test_cells(t, n_res))[:2], _ci_s(t.get("ci_woolf")), *c[2:]] for t in res["odds_ratios"]])
    b = res["boundaries"]
    lines += ["", "## 5. Skip rate around chunk boundaries", "",
              f"{b['boundary_tokens']} boundary tokens, {b['known_tokens']} tokens with a known CH state "
              f"({b['unknown_tokens']} unknown: CH did not run); {b['layers']}."]
    if b["status"] != "ok":
        lines += ["", f"**{b['status']}**"]
    else:
        rows = [[f"{o['offset']:+d}", o["tokens"], f"{o['skipped']} / {o['pairs']}", _f(o["skip_rate"]), _ci_s(o["ci"])]
                for o in b["offsets"]]
        rows += [[f"{name} tokens", r["tokens"], "", _f(r["skip_rate"]), _ci_s(r["ci"])]
                 for name, r in b["reference"].items()]
        lines += _table(("offset", "tokens", "skipped / pairs", "skip rate", "95% CI"), rows)
    if res.get("plots"):
        lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in res["plots"]]
    return "\n".join(lines) + "\n"


def write_plots(res: dict, out_dir: Path) -> list[Path]:
    """PNG plots from the result dict: k histogram, mean k per surprisal decile, skip heatmaps (position x layer,
    class x layer), skip rate per energy quintile, skip rate around chunk boundaries."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    paths = []

    def subplots(figsize):  # a figure on an Agg canvas, without pyplot's global state
        fig = Figure(figsize=figsize)
        FigureCanvasAgg(fig)
        return fig, fig.subplots()

    def save(fig, name):
        fig.tight_layout()
        p = out_dir / name
        fig.savefig(p, dpi=110)
        paths.append(p)

    def errbars(ax, xs, rows, key):
        pts = [(x, r) for x, r in zip(xs, rows) if r[key] is not None]
        if pts:
            x = [p[0] for p in pts]
            y = [p[1][key] for p in pts]
            err = [[p[1][key] - p[1]["ci"][0] for p in pts], [p[1]["ci"][1] - p[1][key] for p in pts]]
            ax.errorbar(x, y, yerr=err, fmt="o-", capsize=3)
            ax.set_xticks(x)  # whole numbers: deciles, quintiles, offsets

    ku = res["k_uncertainty"]
    if ku["k_histogram"]:
        fig, ax = subplots(figsize=(6, 3.5))
        ax.bar([int(k) for k in ku["k_histogram"]], list(ku["k_histogram"].values()))
        ax.set_xlabel("PAW lookahead k(i)")
        ax.set_ylabel("tokens")
        ax.set_title(f"k(i): {ku['status']}", fontsize=9)
        save(fig, "k_histogram.png")
    if ku["status"] == "ok":
        fig, ax = subplots(figsize=(6, 3.5))
        errbars(ax, [d["decile"] for d in ku["deciles"]], ku["deciles"], "mean_k")
        ax.set_xlabel("surprisal decile (1 = most predictable)")
        ax.set_ylabel("mean k(i), 95% CI")
        save(fig, "k_by_surprisal_decile.png")
    for kind, labels, xlabel in (("position", None, "generation position (bin)"), ("class", None, "token class")):
        h = res["heatmaps"][kind]
        if not h["skip_rate"]:
            continue
        mat = np.array([[np.nan if v is None else v for v in row] for row in h["skip_rate"]], dtype=float).T
        fig, ax = subplots(figsize=(7, 4.5))
        im = ax.imshow(mat, aspect="auto", origin="lower", cmap="viridis", vmin=0, vmax=1)
        fig.colorbar(im, ax=ax, label="skip rate")
        ticks = h["classes"] if kind == "class" else [f"{a}-{b}" for a, b in h["bins"]]
        ax.set_xticks(range(len(ticks)))
        ax.set_xticklabels(ticks, rotation=45, ha="right", fontsize=7)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("layer")
        save(fig, f"skip_heatmap_{kind}.png")
    q = res["skip_energy"]["quintiles"]
    if any(b["skip_rate"] is not None for b in q):
        fig, ax = subplots(figsize=(5, 3.5))
        errbars(ax, [b["quintile"] for b in q], q, "skip_rate")
        ax.set_xlabel("within-layer quintile of the relative update (1 = smallest)")
        ax.set_ylabel("skip rate, gated pairs")
        save(fig, "skip_by_energy_quintile.png")
    b = res["boundaries"]
    if b["status"] == "ok":
        fig, ax = subplots(figsize=(5, 3.5))
        errbars(ax, [o["offset"] for o in b["offsets"]], b["offsets"], "skip_rate")
        inside = b["reference"]["inside"]["skip_rate"]
        if inside is not None:
            ax.axhline(inside, color="grey", ls="--", lw=1, label="inside-chunk tokens")
            ax.legend(fontsize=8)
        ax.set_xlabel("offset from a chunk-boundary token")
        ax.set_ylabel("skip rate (gated, non-CH layers)")
        save(fig, "skip_around_boundaries.png")
    return paths


# ---------------------------------------------------------------------------- command line
def _load_model(args):
    """(model, tokenizer) of ``fbs eval mechanism``."""
    from fbs.cli_args import load_from_args
    from fbs.model.bases import load_tokenizer

    model = load_from_args(args)
    return model, getattr(model, "tokenizer", None) or load_tokenizer(args.model)


def _load_lexicon(args):
    if args.no_idioms:
        return None
    from fbs.data.bios import IdiomLexicon
    from fbs.data.sources import SourceError, load_idioms

    try:
        return IdiomLexicon(load_idioms(), 4, 4)
    except (SourceError, OSError) as exc:
        logger.warning("no idiom lexicon (%s): idiom tokens are not marked", exc)
        return None


def cmd_mechanism(args) -> int:
    from fbs.eval.runtime import chat_items, checkpoint_path, setup_runtime
    from fbs.eval.report import runtime_info

    setup_runtime(args)
    items = chat_items(args)
    model, tok = _load_model(args)
    lexicon = _load_lexicon(args)
    tau = args.tau if args.tau is not None else float(model.config.tau)
    print(f"{len(items)} prompts, tau {tau:g}, at most {args.max_new_tokens} new tokens, idiom lexicon "
          f"{'off' if lexicon is None else len(lexicon)}", flush=True)
    meta = {"checkpoint": str(checkpoint_path(args) or "fresh FBS"), "items": args.items or "fbs.data.chat.split()",
            "limit": args.limit, "runtime": runtime_info(args.seed)}
    res = run_mechanism(model, tok, items, tau=tau, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                        lexicon=lexicon, n_resamples=args.resamples, seed=args.seed, out_dir=args.out,
                        progress=not args.no_progress, plots=not args.no_plots, meta=meta)
    out = Path(args.out)
    print(markdown(res))
    print(f"wrote {out / 'mechanism.json'}, {out / 'mechanism.md'}, {out / 'mechanism_tokens.jsonl'} and "
          f"{len(res.get('plots', []))} plots ({res['wall_s']:.0f} s)")
    return 0


def _add_run_arguments(p, analyze: bool = False) -> None:
    """The data, decode and analysis options of ``fbs eval mechanism``; ``fbs analyze`` has them too (the decode
    ones apply to a checkpoint PATH only: they default to None there, and resamples and seed to the trace's)."""
    dflt = (lambda v: None) if analyze else (lambda v: v)  # noqa: E731
    p.add_argument("--items", help="held-out items JSONL from `fbs data chat` (default: computed from the archive)")
    p.add_argument("--limit", type=int, help="the first N held-out prompts of each language")
    p.add_argument("--max-new-tokens", type=int, default=dflt(MAX_NEW_TOKENS), help=f"default {MAX_NEW_TOKENS}")
    p.add_argument("--batch-size", type=int, default=dflt(BATCH_SIZE),
                   help=f"prompts per engine call (default {BATCH_SIZE})")
    p.add_argument("--no-idioms", action="store_true", help="do not load the idiom lexicon (no idiom marking)")
    p.add_argument("--resamples", type=int, default=dflt(N_RESAMPLES),
                   help="bootstrap resamples of the prompts (default " + ("a trace's own, else " if analyze else "")
                        + f"{N_RESAMPLES})")
    p.add_argument("--seed", type=int, default=dflt(0),
                   help="global and bootstrap seed (default " + ("a trace's own, else " if analyze else "") + "0)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")


def add_parser(sub) -> None:
    """``fbs eval mechanism`` (registered by :func:`fbs.eval.cli.register`)."""
    from fbs.cli_args import add_model_arguments

    p = sub.add_parser("mechanism", help="appendix G mechanism statistics from decode traces: k(i) vs surprisal / "
                                         "entropy, skip rate by layer, position and token class, skip vs residual "
                                         "energy, odds ratios, skips around chunk boundaries")
    add_model_arguments(p)
    _add_run_arguments(p)
    p.add_argument("--out", default="results/mechanism", help="output directory")
    p.set_defaults(func=cmd_mechanism)


#: ``fbs analyze`` options that only a decode (a checkpoint PATH) uses
DECODE_OPTIONS = {"items": "--items", "limit": "--limit", "max_new_tokens": "--max-new-tokens",
                  "batch_size": "--batch-size", "no_idioms": "--no-idioms", "model": "--model", "tau": "--tau",
                  "kv_policy": "--kv-policy"}


def analyze_input(path: str | Path) -> tuple[str, Path]:
    """What ``fbs analyze PATH`` reads: ("trace", the trace file) for a trace file or a directory holding one
    (``fbs eval mechanism --out``), ("checkpoint", PATH) for an FBS checkpoint directory."""
    from ..model.causal_lm import CONFIG_NAME, WEIGHTS_NAME

    path = Path(path)
    expected = (f"expected a mechanism trace (*_tokens.jsonl: the {TRACE_NAME} of `fbs eval mechanism --out`), a "
                f"directory holding one, or an FBS checkpoint directory ({CONFIG_NAME} + {WEIGHTS_NAME})")
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; {expected}")
    if path.is_file():
        if path.name.endswith(".jsonl"):
            return "trace", path
        raise TraceError(f"{path} is not a trace file; {expected}")
    traces = sorted(path.glob("*_tokens.jsonl"))
    ckpt = (path / CONFIG_NAME).is_file() and (path / WEIGHTS_NAME).is_file()
    if ckpt and traces:
        raise TraceError(f"{path} holds both an FBS checkpoint and a trace ({traces[0].name}): pass the trace file, "
                         "or decode the checkpoint into another directory")
    if ckpt:
        return "checkpoint", path
    if len(traces) > 1:
        raise TraceError(f"{path} holds several traces ({', '.join(t.name for t in traces)}): pass one of them")
    if traces:
        return "trace", traces[0]
    raise TraceError(f"{path} holds neither a trace (*_tokens.jsonl) nor an FBS checkpoint; {expected}")


def cmd_analyze(args) -> int:
    kind, path = analyze_input(args.path)
    if kind == "checkpoint":
        print(f"{path}: an FBS checkpoint; decoding held-out prompts as `fbs eval mechanism` does", flush=True)
        defaults = {"max_new_tokens": MAX_NEW_TOKENS, "batch_size": BATCH_SIZE, "resamples": N_RESAMPLES, "seed": 0}
        for name, value in defaults.items():
            if getattr(args, name) is None:
                setattr(args, name, value)
        args.checkpoint, args.fresh = str(path), False  # --model None: the base the checkpoint names
        return cmd_mechanism(args)
    given = [flag for name, flag in DECODE_OPTIONS.items() if getattr(args, name) not in (None, False)]
    if given:
        raise ValueError(f"{', '.join(given)}: decode options, for a checkpoint PATH; {args.path} is a trace "
                         f"({path}), which is analysed as it was decoded")
    if args.threads:
        torch.set_num_threads(args.threads)
    res = analyze_trace(path, args.out, args.resamples, args.seed, plots=not args.no_plots,
                        progress=None if args.no_progress else lambda msg: print(msg, flush=True))
    out = Path(args.out)
    print(markdown(res))
    print(f"wrote {out / 'mechanism.json'}, {out / 'mechanism.md'} and {len(res['plots'])} plots "
          f"({res['wall_s']:.0f} s)")
    return 0


def register(subparsers) -> None:
    """The top-level ``fbs analyze`` (listed in :data:`fbs.cli.SUBCOMMAND_MODULES`)."""
    p = subparsers.add_parser(
        "analyze", help="appendix G mechanism statistics, PNGs and markdown report from a saved trace "
                        "(`fbs eval mechanism`'s), or from an FBS checkpoint by decoding held-out prompts first",
        description="PATH: a mechanism trace (*_tokens.jsonl), a directory holding one (an `fbs eval mechanism "
                    "--out` directory), or an FBS checkpoint directory (then the held-out prompts are decoded "
                    "exactly as `fbs eval mechanism` does, with the decode options below). A trace is analysed "
                    "without a model, with its run's resamples and seed unless given: the statistics are the run's.")
    p.add_argument("path", metavar="PATH", help="trace file, directory holding one, or FBS checkpoint directory")
    p.add_argument("--out", required=True, help="output directory (mechanism.json, mechanism.md, PNGs)")
    p.add_argument("--model", help="checkpoint PATH: base model (default: the one the checkpoint names)")
    p.add_argument("--tau", type=float, help="checkpoint PATH: skip threshold (default: the checkpoint's)")
    p.add_argument("--kv-policy", choices=("hole", "project"), help="checkpoint PATH: KV cache policy")
    _add_run_arguments(p, analyze=True)
    p.set_defaults(func=cmd_analyze)
