"""The operating point by the paper's rule (``fbs eval operating-point``): the most efficient threshold of a
checkpoint that incurs no statistically significant quality drop relative to the base model.

**Systems.** The base model and the checkpoint at every threshold of a grid (:data:`DEFAULT_TAUS`; ``None`` is
full depth, every layer runs). Every decoding system, the base included, runs with the same engine weight format
(``weights``), so a difference between a system and the base is the checkpoint's and its skipping's, not rounding's.

**Metrics** (:data:`METRICS`), each a per-example value of every system on the same examples, reusing the
existing evaluations:

* ``ood_ppl``: perplexity on the out-of-distribution blocks of :mod:`fbs.eval.ood` (en, zh, code), scored
  decode-faithfully by :func:`fbs.eval.sweep.score` (the parallel fp32 forward, gates at tau after ``gate_from``
  prompt tokens); per-block mean NLL, PPL = exp(mean);
* ``chat_eos``, ``chat_loop``, ``chat_stuck``, ``chat_rouge_l``, ``chat_base_nll``: the free-running answers of
  :mod:`fbs.eval.chat` to held-out chat prompts (English and Chinese). ROUGE-L is measured against the base
  model's fp32 answer (the cached answers of ``fbs eval chat``); the base model decoded with ``weights`` is the
  system every checkpoint is compared with, so its own ROUGE-L is the rounding floor. (With ``weights`` fp32 the
  two coincide, ROUGE-L is 1 for the base, and the metric is reported but not tested.);
* ``safety_valid``: structured-output validity of :mod:`fbs.eval.safety` (JSON, Python, brackets), greedy.

**Tests.** Per (system, metric) the paired bootstrap against the base model (:func:`fbs.eval.stats.paired_bootstrap`,
two-sided p), Benjamini-Hochberg q-values over *all* (system, metric) pairs of the grid
(:func:`fbs.eval.stats.bh_adjusted`). A pair is a **significant drop** when q < :data:`fbs.eval.stats.ALPHA` and the
difference is in the metric's worse direction (a significant improvement never disqualifies).

**Selection** (:func:`select`): among the systems with no significant drop on any metric, the most efficient
(lowest TFLOPs(rel) of the chat decode traces, then the highest skip share; an exact tie goes to the higher tau).
A tau that skips less than :data:`MIN_SKIP` of its decisions is full depth in effect: it is not a skipping operating
point (its saving does not pay for the gates), and it is selected only as full depth's stand-in. The verdict says which of three cases holds: a skipping tau qualifies; only full depth qualifies (the default
should skip nothing); nothing qualifies, not even full depth (the checkpoint itself loses to the base).

**Resumable.** Each (system, family) part is written to ``<out>/parts/`` as soon as it is done, keyed by
everything that decides it (checkpoint, weights, tau, prompt sets, lengths); a rerun reuses matching parts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from .stats import ALPHA, bh_adjusted, paired_bootstrap, ppl_metric

logger = logging.getLogger(__name__)

#: the default grid: full depth (None) and thresholds from conservative to aggressive
DEFAULT_TAUS: tuple[float | None, ...] = (None, 0.9, 0.7, 0.5, 0.3)
#: metric -> (family, higher is better, aggregate); the aggregate of a PPL is exp(mean NLL)
METRICS: dict[str, tuple[str, bool, str]] = {
    "ood_ppl": ("ood", False, "exp_mean"),
    "chat_eos": ("chat", True, "mean"),
    "chat_loop": ("chat", False, "mean"),
    "chat_stuck": ("chat", False, "mean"),
    "chat_rouge_l": ("chat", True, "mean"),
    "chat_base_nll": ("chat", False, "mean"),
    "safety_valid": ("safety", True, "mean"),
}
FAMILIES = ("ood", "chat", "safety")
FORMAT = 1
#: the least share of gated layer-token decisions a tau must skip to count as a skipping operating point: below it
#: the skipped work does not pay for the gates' and previews' own cost, so such a tau is full depth in effect
MIN_SKIP = 0.005


# ---------------------------------------------------------------------------- the rule
def system_name(tau: float | None) -> str:
    return "full depth" if tau is None else f"tau {tau:g}"


def paired_tests(values: dict[str, Sequence[float]], base: dict[str, Sequence[float]], seed: int = 0,
                 skip: Sequence[str] = ()) -> dict[str, dict]:
    """Paired bootstrap of every metric of :data:`METRICS` present in both ``values`` and ``base`` (per-example
    lists on the same examples), system minus base; ``skip``: metrics reported without a test."""
    out = {}
    for m, (_, higher, agg) in METRICS.items():
        if m not in values or m not in base:
            continue
        metric = ppl_metric if agg == "exp_mean" else (lambda x: float(np.mean(x)))
        a, b = np.asarray(values[m], dtype=np.float64), np.asarray(base[m], dtype=np.float64)
        row = {"value": metric(a), "base": metric(b), "higher_is_better": higher}
        if m not in skip:
            r = paired_bootstrap(a, b, metric, higher_is_better=higher, seed=seed)
            row |= {"delta": r.delta, "ci": [r.ci_low, r.ci_high], "p_value": r.p_value}
        out[m] = row
    return out


def worse(delta: float, higher_is_better: bool) -> bool:
    return delta < 0 if higher_is_better else delta > 0


def select(rows: Sequence[dict], alpha: float = ALPHA, min_skip: float = MIN_SKIP) -> dict:
    """The paper's rule on a metric table.

    ``rows``: one per checkpoint system, ``{"system", "tau" (None = full depth), "tflops_rel", "skip_ratio",
    "tests": {metric: {"delta", "p_value", "higher_is_better", ...}}}`` (a metric without ``p_value`` is not
    tested). BH q-values are computed over every tested (system, metric) pair; each test gets ``q_value`` and
    ``drop`` (q < ``alpha`` and the delta in the worse direction) and each row ``qualifies``. Returns
    ``{"rows", "selected" (system name or None), "selected_tau", "verdict", "alpha", "tests"}`` where verdict is
    ``skipping`` (a tau that skips at least ``min_skip`` of its decisions qualifies), ``full-depth-only`` or
    ``none``. A qualifying tau that skips less than ``min_skip`` counts as full depth (row field ``skips``)."""
    rows = [dict(r, tests={m: dict(t) for m, t in r["tests"].items()}) for r in rows]
    keys = [(i, m) for i, r in enumerate(rows) for m, t in r["tests"].items() if "p_value" in t]
    qs = bh_adjusted([rows[i]["tests"][m]["p_value"] for i, m in keys])
    for (i, m), q in zip(keys, qs):
        t = rows[i]["tests"][m]
        t["q_value"] = q
        t["drop"] = bool(q < alpha and worse(t["delta"], t["higher_is_better"]))
    for r in rows:
        r["drops"] = [m for m, t in r["tests"].items() if t.get("drop")]
        r["qualifies"] = not r["drops"]
    for r in rows:
        r["skips"] = r["tau"] is not None and r["skip_ratio"] >= min_skip
    ok = [r for r in rows if r["qualifies"]]
    best = min((r for r in ok if r["skips"]), key=lambda r: (r["tflops_rel"], -r["skip_ratio"], -r["tau"]),
               default=None)
    if best is None:  # no qualifying tau skips measurably: full depth, or a tau that is full depth in effect
        best = next((r for r in ok if r["tau"] is None), None)
        if best is None:
            best = max((r for r in ok), key=lambda r: (-r["skip_ratio"], r["tau"]), default=None)
    if best is None:
        verdict = "none"
    elif best["skips"]:
        verdict = "skipping"
    else:
        verdict = "full-depth-only"
    return {"rows": rows, "selected": best["system"] if best else None, "selected_tau": best["tau"] if best else None,
            "verdict": verdict, "alpha": alpha, "tests": len(keys)}


VERDICTS = {
    "skipping": "the selected tau skips and shows no significant drop against the base on any metric",
    "full-depth-only": "no tau that skips qualifies: every one evaluated either shows a significant drop on some "
                       "metric or skips less than the minimum share; full depth does not drop, so the default should "
                       "skip nothing",
    "none": "not even full depth qualifies: the checkpoint itself shows a significant drop against the base, so "
            "the honest default is the base model",
}


# ---------------------------------------------------------------------------- parts (resumable)
def _key(d: dict) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _slug(name: str) -> str:
    return name.replace(" ", "_").replace(".", "p")


class Parts:
    """``<dir>/<system>__<family>.json`` holding {"key", "data"}; a part is reused only under the same key."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, system: str, family: str) -> Path:
        return self.root / f"{_slug(system)}__{family}.json"

    def get(self, system: str, family: str, key: dict) -> dict | None:
        p = self.path(system, family)
        if not p.is_file():
            return None
        doc = json.loads(p.read_text())
        return doc["data"] if doc.get("key") == _key(key) else None

    def put(self, system: str, family: str, key: dict, data: dict) -> None:
        p = self.path(system, family)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": _key(key), "spec": key, "data": data}, ensure_ascii=False, default=str))
        os.replace(tmp, p)


# ---------------------------------------------------------------------------- the run
@dataclasses.dataclass
class Setup:
    """What a run evaluates; every field enters the parts' keys."""

    checkpoint: str
    weights: str = "q8"
    taus: tuple[float | None, ...] = DEFAULT_TAUS
    chat_limit: int | None = None          # first N prompts per language (None: all held-out prompts)
    chat_max_new_tokens: int = 256
    chat_batch_size: int = 8
    safety_limit: int | None = None        # first N prompts per kind (None: all)
    safety_max_new_tokens: int = 128
    ood_per_kind: int | None = None        # OOD blocks per kind (None: all)
    gate_from: int = 128
    seed: int = 0

    def key(self, system: str, family: str, tau: float | None) -> dict:
        d = dataclasses.asdict(self)
        d.pop("taus")
        if family != "chat":
            d.pop("chat_limit"), d.pop("chat_max_new_tokens"), d.pop("chat_batch_size")
        if family != "safety":
            d.pop("safety_limit"), d.pop("safety_max_new_tokens")
        if family != "ood":
            d.pop("ood_per_kind"), d.pop("gate_from")
        if family == "ood":
            d.pop("weights")  # scored by the fp32 parallel forward
        if system == "base":
            d.pop("checkpoint")
        return {"format": FORMAT, "system": system, "family": family, "tau": tau, **d}


def _ood_part(model, docs, tau, gate_from: int, base: bool) -> dict:
    from .sweep import score

    s = score(model, docs, None if base else tau, gate_from=gate_from)
    return {"ids": [d.id for d in docs], "nll": s.nll, "skipped": s.skipped, "pairs": s.pairs}


def _chat_part(rec: dict) -> dict:
    items = rec["items"]
    return {"ids": [it["id"] for it in items], "lang": [it["lang"] for it in items],
            "eos": [float(it["eos"]) for it in items], "loop": [float(it["loop"]) for it in items],
            "stuck": [float(it["stuck"]) for it in items], "rouge_l": [float(it["rouge_l"]) for it in items],
            "base_nll": [float(it["base_nll"]) for it in items], "length": [len(it["tokens"]) for it in items],
            "text": [it["text"] for it in items], "skip_ratio": rec["skip_ratio"], "tflops_rel": rec["tflops_rel"],
            "tflops_rel_exact": rec["tflops_rel_exact"], "decoded_tokens": rec["decoded_tokens"],
            "decode_s": rec["decode_s"]}


def _safety_part(outcomes) -> dict:
    tokens = sum(o.tokens for o in outcomes)
    return {"ids": [o.id for o in outcomes], "kind": [o.kind for o in outcomes],
            "valid": [float(o.valid) for o in outcomes], "answer": [o.answer for o in outcomes],
            "skip_ratio": sum(o.skipped for o in outcomes) / max(1, sum(o.pairs for o in outcomes)),
            "tflops_rel": sum(o.tokens * o.tflops_rel for o in outcomes) / tokens if tokens else None}


def values_of(parts: dict[str, dict]) -> dict[str, list[float]]:
    """Per-example values by metric name from one system's parts."""
    out = {}
    if "ood" in parts:
        out["ood_ppl"] = parts["ood"]["nll"]
    if "chat" in parts:
        for m in ("eos", "loop", "stuck", "rouge_l", "base_nll"):
            out[f"chat_{m}"] = parts["chat"][m]
    if "safety" in parts:
        out["safety_valid"] = parts["safety"]["valid"]
    return out


def run_operating_point(setup: Setup, base_model, tokenizer, load_checkpoint: Callable[[], object], *,
                        chat_items, ood_docs, safety_prompts, out_dir: str | Path,
                        base_cache: str | Path | None = None, families: Sequence[str] = FAMILIES,
                        log: Callable[[str], None] = print, compute: bool = True) -> dict:
    """Evaluate the base and every system of ``setup.taus`` on ``families``, part by part (reusing parts on
    disk), then apply :func:`select`. ``base_model`` is a fresh FBS of the base (run with ``force_compute``);
    ``load_checkpoint()`` returns the checkpoint (called once, when a part needs it). ``compute=False`` only reads
    the parts on disk: a system missing one is left out of the selection and listed under ``missing``."""
    from .chat import ChatSystem, eos_ids, run_chat_eval
    from .safety import decode_prompts

    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        raise ValueError(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    parts = Parts(Path(out_dir) / "parts")
    eos = eos_ids(base_model, tokenizer)
    chat_template = bool(getattr(tokenizer, "chat_template", None))
    cache: dict[str, object] = {}

    def checkpoint():
        if "ckpt" not in cache:
            cache["ckpt"] = load_checkpoint()
        return cache["ckpt"]

    systems: list[tuple[str, float | None, bool]] = [("base", None, True)]
    systems += [(system_name(t), t, False) for t in setup.taus]
    got: dict[str, dict[str, dict]] = {}
    demos: dict[str, str] = {}
    missing: dict[str, list[str]] = {}
    for name, tau, is_base in systems:
        got[name] = {}
        for fam in families:
            key = setup.key(name, fam, tau)
            data = parts.get(name, fam, key)
            if data is None and not compute:
                missing.setdefault(name, []).append(fam)
                continue
            if data is None:
                t0 = time.perf_counter()
                model = base_model if is_base else checkpoint()
                if fam == "ood":
                    data = _ood_part(model, ood_docs, tau, setup.gate_from, is_base)
                elif fam == "chat":
                    kind = "reference" if is_base else ("full" if tau is None else "tau")
                    sysm = ChatSystem(f"{'base' if is_base else 'fbs ' + name}, {setup.weights}", kind,
                                      "base" if is_base else "checkpoint", tau,
                                      "base" if is_base else setup.checkpoint, setup.weights)
                    res = run_chat_eval(base_model, tokenizer, chat_items, [ChatSystem("base", "base", "base"), sysm],
                                        {"checkpoint": checkpoint}, max_new_tokens=setup.chat_max_new_tokens,
                                        batch_size=setup.chat_batch_size, base_cache=base_cache, seed=setup.seed,
                                        progress=False)
                    data = _chat_part(res["systems"][1])
                    if res.get("demo"):
                        data["demo"] = {"prompt": res["demo"]["prompt"],
                                        "answer": res["demo"]["answers"][sysm.name],
                                        "base_fp32": res["demo"]["answers"]["base"]}
                else:
                    opts = {"force_compute": True} if tau is None else {"tau": float(tau)}
                    data = _safety_part(decode_prompts(model, tokenizer, safety_prompts,
                                                       {**opts, "weights": setup.weights}, eos,
                                                       setup.safety_max_new_tokens, chat_template))
                data["wall_s"] = time.perf_counter() - t0
                parts.put(name, fam, key, data)
                log(f"{name:>12} {fam:<6} done in {data['wall_s']:.0f} s")
            else:
                log(f"{name:>12} {fam:<6} reused from {parts.path(name, fam)}")
            got[name][fam] = data
            if fam == "chat" and "demo" in data:
                demos[name] = data["demo"]["answer"]
                demos.setdefault("base (fp32)", data["demo"]["base_fp32"])
    if "base" in missing:
        raise ValueError(f"the base model has no {'/'.join(missing['base'])} part in {parts.root}: nothing to "
                         "compare with (run without --report-only first)")
    for name in missing:
        del got[name]
    rec = assemble(setup, got, demos)
    rec["missing"] = missing
    return rec


def assemble(setup: Setup, got: dict[str, dict[str, dict]], demos: dict[str, str] | None = None) -> dict:
    """The record: per system its metric values, paired tests against the base, efficiency; then the rule."""
    base_vals = values_of(got["base"])
    skip = ("chat_rouge_l",) if setup.weights == "fp32" else ()
    rows = []
    for name, p in got.items():
        if name == "base":
            continue
        chat, ood, safety = p.get("chat"), p.get("ood"), p.get("safety")
        tau = next((t for t in setup.taus if system_name(t) == name), None)
        ood_skip = sum(ood["skipped"]) / max(1, sum(ood["pairs"])) if ood else None
        skip_ratio = chat["skip_ratio"] if chat else (ood_skip or 0.0)
        rows.append({"system": name, "tau": tau,
                     "tflops_rel": chat["tflops_rel"] if chat and chat["tflops_rel"] is not None else 1 - skip_ratio,
                     "skip_ratio": skip_ratio, "ood_skip_ratio": ood_skip,
                     "safety_skip_ratio": safety["skip_ratio"] if safety else None,
                     "tests": paired_tests(values_of(p), base_vals, setup.seed, skip)})
    result = select(rows)
    text = VERDICTS[result["verdict"]]
    if result["verdict"] == "full-depth-only" and not any(r["skips"] for r in result["rows"]):
        text = (f"full depth qualifies; no tau evaluated skips at least {100 * MIN_SKIP:g} % of its decisions "
                "(the least share that counts as skipping)")
    base_metrics = {m: paired_tests(base_vals, base_vals, skip=METRICS)[m]["value"] for m in base_vals}
    return {"format": FORMAT, "setup": dataclasses.asdict(setup), "families": sorted({f for p in got.values()
                                                                                       for f in p}),
            "n": {fam: len(got["base"][fam]["ids"]) for fam in got["base"]}, "base": base_metrics,
            **result, "verdict_text": text, "demo": demos or {}}


# ---------------------------------------------------------------------------- report
_LABELS = {"ood_ppl": "OOD PPL", "chat_eos": "EOS %", "chat_loop": "loop %", "chat_stuck": "stuck %",
           "chat_rouge_l": "ROUGE-L", "chat_base_nll": "base NLL", "safety_valid": "valid %"}


def _fmt(m: str, v: float) -> str:
    pct = m in ("chat_eos", "chat_loop", "chat_stuck", "safety_valid")
    return f"{100 * v:.1f}" if pct else f"{v:.3f}"


def markdown(rec: dict) -> str:
    metrics = [m for m in METRICS if m in rec["base"]]
    s = rec["setup"]
    head = ["system", "tau", "Skip %", "TFLOPs(rel)"] + [_LABELS[m] for m in metrics] + ["qualifies"]
    lines = [f"Checkpoint `{s['checkpoint']}`, engine weights **{s['weights']}** for every decoding system (the base "
             f"included). n: " + ", ".join(f"{k} {v}" for k, v in rec["n"].items()) + ".", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines.append("| base | – | 0.0 | 1.000 | " + " | ".join(_fmt(m, rec["base"][m]) for m in metrics) + " | – |")
    for r in rec["rows"]:
        cells = [r["system"], "–" if r["tau"] is None else f"{r['tau']:g}", f"{100 * r['skip_ratio']:.1f}",
                 f"{r['tflops_rel']:.3f}"]
        for m in metrics:
            t = r["tests"].get(m)
            if t is None:
                cells.append("–")
                continue
            c = _fmt(m, t["value"])
            if "q_value" in t:
                c += f" (q {t['q_value']:.3g}{', drop' if t['drop'] else ''})"
            cells.append(c)
        if not r["qualifies"]:
            cells.append("no: " + ", ".join(_LABELS[m] for m in r["drops"]))
        elif r["tau"] is not None and not r.get("skips", True):
            cells.append(f"**yes**, but skips < {100 * MIN_SKIP:g} %: full depth in effect")
        else:
            cells.append("**yes**")
        lines.append("| " + " | ".join(cells) + " |")
    sel = rec["selected"]
    if rec.get("missing"):
        lines += ["", "**Not evaluated yet** (left out of the selection): " + "; ".join(
            f"{name} ({', '.join(fams)})" for name, fams in rec["missing"].items()) + "."]
    lines += ["", f"**Selected:** {sel or 'nothing'} ({rec['verdict']}): {rec['verdict_text']}.", "",
              f"Tests: paired bootstrap (1000 resamples, over examples) of every system against the base, "
              f"two-sided; Benjamini-Hochberg over all {rec['tests']} (system, metric) pairs; a drop is q < "
              f"{rec['alpha']} in the metric's worse direction. Skip % and TFLOPs(rel): the engine's chat decode "
              "traces. OOD PPL: decode-faithful fp32 parallel forward. ROUGE-L: against the base's fp32 answers "
              "(the base row is the rounding floor of the format)."]
    if rec.get("demo"):
        lines += ["", "## The `make demo` prompt", ""]
        for name, text in rec["demo"].items():
            lines += [f"**{name}:**", "", "> " + (text.replace("\n", "\n> ") if text else "(empty)"), ""]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- CLI
def parse_taus(spec: str) -> tuple[float | None, ...]:
    """``full,0.9,0.7`` -> (None, 0.9, 0.7); ``full`` (or ``none``) is full depth."""
    out: list[float | None] = []
    for part in spec.split(","):
        part = part.strip().lower()
        if not part:
            continue
        if part in ("full", "none"):
            out.append(None)
            continue
        try:
            t = float(part)
        except ValueError:
            raise ValueError(f"--taus: {part!r} is neither 'full' nor a number") from None
        if not 0 <= t <= 1:
            raise ValueError(f"--taus: {t} is outside [0, 1]")
        out.append(t)
    if not out:
        raise ValueError("--taus is empty: give e.g. full,0.9,0.7,0.5,0.3")
    return tuple(dict.fromkeys(out))


def add_parser(sub) -> None:
    from fbs.cli_args import add_model_arguments

    p = sub.add_parser("operating-point", help="the most efficient tau with no significant quality drop against the "
                                               "base (OOD PPL, chat, structured validity; paired tests, BH)")
    add_model_arguments(p)
    p.add_argument("--taus", default="full,0.9,0.7,0.5,0.3", help="grid; 'full' = every layer runs")
    p.add_argument("--weights", default="q8", help="engine weight format of every decoding system (base included)")
    p.add_argument("--families", default=",".join(FAMILIES), help="comma list of: " + ", ".join(FAMILIES))
    p.add_argument("--chat-limit", type=int, help="first N held-out chat prompts per language (default: all, 120)")
    p.add_argument("--chat-items", help="held-out items JSONL from `fbs data chat` (default: computed from the archive)")
    p.add_argument("--chat-max-new-tokens", type=int, default=256)
    p.add_argument("--chat-batch-size", type=int, default=8)
    p.add_argument("--base-cache", default="results/chat_base_answers.json",
                   help="the base model's fp32 chat answers (ROUGE-L target), shared with `fbs eval chat`")
    p.add_argument("--safety-prompts", help="structured prompts JSONL (default: the package's set)")
    p.add_argument("--safety-limit", type=int, help="first N structured prompts per kind (default: all)")
    p.add_argument("--safety-max-new-tokens", type=int, default=128)
    p.add_argument("--ood-per-kind", type=int, help="OOD blocks per kind (default: all)")
    p.add_argument("--gate-from", type=int, default=128, help="prompt tokens of an OOD block that are never gated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p.add_argument("--write-tau", metavar="CKPT",
                   help="make the selection the default of this checkpoint: its config's tau becomes the selected tau, "
                        "or 1.0 (skips nothing) when only full depth qualifies; refused when not even full depth does")
    p.add_argument("--report-only", action="store_true",
                   help="write the record from the parts already in --out-dir (systems missing a part are left out "
                        "and listed); computes nothing")
    p.add_argument("--out-dir", default="results/operating_point",
                   help="operating_point.json + .md, and parts/ (reused by a rerun)")
    p.set_defaults(func=cmd_operating_point)


def load_models(args):
    """(base model: a fresh FBS of ``--model``, its tokenizer, a loader of the checkpoint the options ask for)."""
    from fbs import FBSForCausalLM
    from fbs.cli_args import load_from_args

    base = FBSForCausalLM.from_base(args.model)
    return base, base.tokenizer, lambda: load_from_args(args)


def load_ood_docs(tokenizer, args):
    """The OOD blocks of :mod:`fbs.eval.ood` (the first ``--ood-per-kind`` of each kind)."""
    from .ood import ood_blocks

    return ood_blocks(tokenizer, seed=args.seed, limit=args.ood_per_kind)


def cmd_operating_point(args) -> int:
    import argparse

    from fbs.engine.quant import FORMATS
    from fbs.provenance import provenance

    from .report import runtime_info
    from .runtime import chat_items, checkpoint_path, setup_runtime
    from .safety import load_prompts

    if args.weights not in FORMATS:
        raise SystemExit(f"--weights: unknown format {args.weights!r}; use one of {', '.join(FORMATS)}")
    try:
        taus = parse_taus(args.taus)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    bad = sorted(set(families) - set(FAMILIES))
    if bad or not families:
        raise SystemExit(f"--families: unknown {bad}; use a comma list of {', '.join(FAMILIES)}")
    setup_runtime(args)
    ckpt = args.checkpoint or checkpoint_path(args)
    if ckpt is None:
        raise SystemExit("no checkpoint: pass --checkpoint DIR (or drop --fresh to use the shipped weights)")
    setup = Setup(str(ckpt), args.weights, taus, args.chat_limit, args.chat_max_new_tokens, args.chat_batch_size,
                  args.safety_limit, args.safety_max_new_tokens, args.ood_per_kind, args.gate_from, args.seed)
    base, tok, load_checkpoint = load_models(args)
    items = (chat_items(argparse.Namespace(items=args.chat_items, limit=args.chat_limit))
             if "chat" in families else None)
    docs = load_ood_docs(tok, args) if "ood" in families else None
    prompts = load_prompts(args.safety_prompts, limit=args.safety_limit) if "safety" in families else None
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = {"runtime": runtime_info(args.seed), "provenance": provenance()}  # the code and machine at the start
    start = time.perf_counter()
    rec = run_operating_point(setup, base, tok, load_checkpoint, chat_items=items, ood_docs=docs,
                              safety_prompts=prompts, out_dir=out, base_cache=args.base_cache, families=families,
                              compute=not args.report_only)
    rec["wall_s"] = time.perf_counter() - start
    rec.update(started)
    rec["argv"] = list(sys.argv[1:])  # the command line of this process (its program name left out)
    path = out / "operating_point.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(rec, indent=1, ensure_ascii=False, default=str))
    os.replace(tmp, path)
    md = path.with_suffix(".md")
    md.write_text("# Operating point by the paper's rule\n\n" + markdown(rec))
    print(markdown(rec))
    print(f"wrote {path} and {md} ({rec['wall_s']:.0f} s)")
    if args.write_tau:
        tau = default_tau(rec)
        if tau is None:
            print(f"not writing a tau into {args.write_tau}: {rec['verdict_text']} (fbs generate --fresh "
                  "--force-compute runs the base model)", file=sys.stderr)
            return 3
        from .sweep import write_tau

        write_tau(args.write_tau, tau, {"rule": "operating point", "record": str(path), "verdict": rec["verdict"],
                                        "selected": rec["selected"], "git_commit": rec["provenance"]["git_commit"]})
        print(f"wrote tau {tau:g} into {args.write_tau}")
    return 0


def default_tau(rec: dict) -> float | None:
    """The tau a checkpoint should default to under the record's verdict: the selected tau when it skips, 1.0
    (nothing is skipped) when only full depth qualifies, None when not even full depth does."""
    if rec["verdict"] == "skipping":
        return float(rec["selected_tau"])
    return 1.0 if rec["verdict"] == "full-depth-only" else None
