"""Evaluation tasks: each turns a dataset into per-example scores for one :class:`~fbs.eval.systems.System`.

Every task returns a :class:`TaskResult` holding per-example values (the bootstrap unit of appendix B.6:
a question, a problem or a document) and their aggregates. Tasks:

============== ======================================================== ===============================
name           data (full set)                                          primary metric
============== ======================================================== ===============================
ppl_c4         300 C4 docs (llamafactory c4_demo), first 1024 tokens    ppl = exp(mean over docs of doc NLL)
ppl_wiki       30 Wikipedia articles (wiki_demo), first 1024 tokens     ppl
ppl_zh         2,272 People's Daily paragraphs >= 200 chars             ppl
mmlu           14,042 test questions, 5-shot from dev, letters A-D      acc
arc_easy       2,376 test, OLMES 5-shot, option text continuations      acc (acc_per_char also reported)
arc_challenge  1,172 test, same                                         acc
hellaswag      10,042 validation, OLMES 5-shot                          acc
piqa, winogrande, boolq, csqa, socialiqa, openbookqa, sciq: OLMES 5-shot  acc
idiom_zh       1,000 idioms (seeded sample of 29,502), pick 2nd half    acc
gsm8k          1,319 test, 8-shot CoT, greedy, answer extraction        solve_rate
humaneval      164, OLMES 0-shot context, greedy, sandboxed tests       pass@1
mbpp           500 test, OLMES 3-shot, greedy, sandboxed asserts        pass@1
============== ======================================================== ===============================

Perplexity: each document is scored on its first ``max_tokens`` tokens (the first token is context only);
a document's NLL is its mean over scored tokens, and documents weigh equally (no length-driven bias).
Multiple choice: the prediction is the option with the highest summed log-probability (``acc``); OLMES's
length-normalised variant divides by the continuation's character count (``acc_per_char``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
import zlib
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from fbs.eval import datasets as D
from fbs.eval import gsm8k as G
from fbs.eval.sandbox import run_program
from fbs.eval.stats import AGGREGATES_FOR_STATS as AGGREGATES, bootstrap_ci
from fbs.eval.systems import LoglikRequest, System

logger = logging.getLogger(__name__)

@dataclasses.dataclass
class Metric:
    """An aggregate over one per-example series (``TaskResult.per_example[key]``)."""

    value: float
    ci95: tuple[float, float]
    key: str
    aggregate: str = "mean"
    higher_is_better: bool = True


@dataclasses.dataclass
class TaskResult:
    task: str
    primary: str
    metrics: dict[str, Metric]
    ids: list[str]
    per_example: dict[str, list[float]]
    n_total: int
    """Size of the full set (``len(ids) < n_total`` means a ``--limit`` subset)."""
    seconds: float
    details: dict = dataclasses.field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.ids)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"n": self.n}

    @classmethod
    def from_dict(cls, d: dict) -> "TaskResult":
        d = dict(d)
        d.pop("n", None)
        d["metrics"] = {k: Metric(**{**m, "ci95": tuple(m["ci95"])}) for k, m in d["metrics"].items()}
        return cls(**d)


def select(items: Sequence, limit: int | None, seed: int) -> list:
    """All items, or ``limit`` of them drawn without replacement with a fixed seed (kept in set order)."""
    if limit is None or limit >= len(items):
        return list(items)
    idx = np.sort(np.random.default_rng(seed).choice(len(items), size=limit, replace=False))
    return [items[i] for i in idx]


def select_stratified(items: Sequence, per_stratum: int, seed: int,
                      stratum: Callable[[object], str] | None = None) -> list:
    """``per_stratum`` items of every stratum (all of a smaller one), drawn without replacement, kept in set order.

    The stratum of an item is ``stratum(item)``, by default its id without the last ``/`` component (MMLU's
    ``mmlu/<subject>/<i>`` -> ``mmlu/<subject>``). Each stratum draws from its own generator, seeded by ``seed``
    and the stratum's name (CRC-32), so a stratum's draw does not depend on which other strata exist.
    """
    key = stratum or (lambda ex: ex.id.rsplit("/", 1)[0])
    groups: dict[str, list[int]] = {}
    for i, ex in enumerate(items):
        groups.setdefault(key(ex), []).append(i)
    keep: list[int] = []
    for name, idx in groups.items():
        if len(idx) <= per_stratum:
            keep += idx
        else:
            rng = np.random.default_rng([seed, zlib.crc32(name.encode("utf-8"))])
            keep += [idx[j] for j in rng.choice(len(idx), size=per_stratum, replace=False)]
    return [items[i] for i in sorted(keep)]


def _metric(values: list[float], key: str, aggregate: str = "mean", higher_is_better: bool = True, seed: int = 0) -> Metric:
    fn = AGGREGATES[aggregate]
    arr = np.asarray(values, dtype=np.float64)
    return Metric(value=fn(arr) if len(arr) else math.nan, ci95=bootstrap_ci(arr, fn, seed=seed),
                  key=key, aggregate=aggregate, higher_is_better=higher_is_better)


# --------------------------------------------------------------------------- perplexity

def run_perplexity(system: System, docs: list[D.Document], task: str, n_total: int,
                   max_tokens: int = 1024, progress: bool = False, seed: int = 0) -> TaskResult:
    start = time.perf_counter()
    pairs, kept = [], []
    for doc in docs:
        ids = system.encode(doc.text)[:max_tokens]
        if len(ids) >= 2:
            pairs.append((ids[:1], ids[1:]))
            kept.append(doc.id)
    scores = system.score_tokens(pairs, progress=progress)
    nll = [-s.logprob / s.n_tokens for s in scores]
    n_tok = [s.n_tokens for s in scores]
    tok_ppl = math.exp(-sum(s.logprob for s in scores) / max(1, sum(n_tok)))
    metrics = {"ppl": _metric(nll, "nll", "exp_mean", higher_is_better=False, seed=seed),
               "nll": _metric(nll, "nll", "mean", higher_is_better=False, seed=seed)}
    return TaskResult(task=task, primary="ppl", metrics=metrics, ids=kept,
                      per_example={"nll": nll, "n_tokens": [float(n) for n in n_tok]}, n_total=n_total,
                      seconds=time.perf_counter() - start,
                      details={"max_tokens": max_tokens, "tokens_scored": sum(n_tok), "token_weighted_ppl": tok_ppl})


# --------------------------------------------------------------------------- multiple choice

def run_multiple_choice(system: System, items: list[D.MCExample], task: str, n_total: int,
                        progress: bool = False, seed: int = 0) -> TaskResult:
    start = time.perf_counter()
    reqs, owner = [], []
    for k, ex in enumerate(items):
        for ctx, cont in zip(ex.contexts, ex.continuations):
            reqs.append(LoglikRequest(ctx, cont))
            owner.append(k)
    scores = system.loglikelihood(reqs, progress=progress)
    per_item: list[list[float]] = [[] for _ in items]
    for k, s in zip(owner, scores):
        per_item[k].append(s.logprob)
    acc, acc_char, gold_lp, preds = [], [], [], []
    for ex, lps in zip(items, per_item):
        pred = int(np.argmax(lps))  # first maximum on ties
        norm = [lp / max(1, len(c)) for lp, c in zip(lps, ex.continuations)]
        acc.append(float(pred == ex.gold))
        acc_char.append(float(int(np.argmax(norm)) == ex.gold))
        gold_lp.append(lps[ex.gold])
        preds.append(pred)
    metrics = {"acc": _metric(acc, "acc", seed=seed), "acc_per_char": _metric(acc_char, "acc_per_char", seed=seed)}
    return TaskResult(task=task, primary="acc", metrics=metrics, ids=[ex.id for ex in items],
                      per_example={"acc": acc, "acc_per_char": acc_char, "gold_logprob": gold_lp,
                                   "pred": [float(p) for p in preds]},
                      n_total=n_total, seconds=time.perf_counter() - start,
                      details={"n_requests": len(reqs)})


# --------------------------------------------------------------------------- generation

def _generate_all(system: System, items: list[D.GenExample], max_new_tokens: int, progress: bool, task: str) -> list[str]:
    from tqdm.auto import tqdm

    return [system.generate_until(ex.prompt, ex.stop, max_new_tokens)
            for ex in tqdm(items, desc=f"{system.name}: {task}", disable=not progress, leave=False)]


def run_gsm8k(system: System, items: list[D.GenExample], n_total: int, max_new_tokens: int = 256,
              progress: bool = False, seed: int = 0) -> TaskResult:
    start = time.perf_counter()
    gens = _generate_all(system, items, max_new_tokens, progress, "gsm8k")
    correct = [float(G.is_correct(g, ex.answer)) for g, ex in zip(gens, items)]
    return TaskResult(task="gsm8k", primary="solve_rate",
                      metrics={"solve_rate": _metric(correct, "correct", seed=seed)},
                      ids=[ex.id for ex in items], per_example={"correct": correct}, n_total=n_total,
                      seconds=time.perf_counter() - start,
                      details={"max_new_tokens": max_new_tokens,
                               "generations": {ex.id: g for ex, g in zip(items, gens)},
                               "extracted": {ex.id: G.extract_answer(g) for ex, g in zip(items, gens)}})


def run_code(system: System, items: list[D.GenExample], task: str, n_total: int, max_new_tokens: int = 384,
             timeout: float = 10.0, progress: bool = False, seed: int = 0) -> TaskResult:
    start = time.perf_counter()
    gens = _generate_all(system, items, max_new_tokens, progress, task)
    passed, status = [], {}
    for ex, g in zip(items, gens):
        program = ex.extra.get("code_prefix", "") + g + "\n\n" + ex.answer
        r = run_program(program, timeout=timeout)
        passed.append(float(r.passed))
        status[ex.id] = r.status
    return TaskResult(task=task, primary="pass@1", metrics={"pass@1": _metric(passed, "passed", seed=seed)},
                      ids=[ex.id for ex in items], per_example={"passed": passed}, n_total=n_total,
                      seconds=time.perf_counter() - start,
                      details={"max_new_tokens": max_new_tokens, "timeout_s": timeout, "status": status,
                               "generations": {ex.id: g for ex, g in zip(items, gens)}})


# --------------------------------------------------------------------------- registry

@dataclasses.dataclass(frozen=True)
class TaskSpec:
    name: str
    kind: str  # "ppl" | "mc" | "gen"
    load: Callable[[], list]
    description: str


def _idiom_items() -> list[D.MCExample]:
    return select(D.load_idiom_probe(), 1000, seed=1234)


TASKS: dict[str, TaskSpec] = {
    "ppl_c4": TaskSpec("ppl_c4", "ppl", D.load_c4_docs, "English perplexity, C4 demo docs"),
    "ppl_wiki": TaskSpec("ppl_wiki", "ppl", D.load_wiki_docs, "English perplexity, Wikipedia demo articles"),
    "ppl_zh": TaskSpec("ppl_zh", "ppl", D.load_zh_docs, "Chinese perplexity, People's Daily 1998"),
    "mmlu": TaskSpec("mmlu", "mc", D.load_mmlu, "MMLU 5-shot (dev shots), full test"),
    **{t: TaskSpec(t, "mc", (lambda t=t: D.load_olmes_mc(t)), f"{t} OLMES 5-shot") for t in D.OLMES_MC},
    "idiom_zh": TaskSpec("idiom_zh", "mc", _idiom_items, "Chinese idiom second-half probe (1,000 idioms)"),
    "gsm8k": TaskSpec("gsm8k", "gen", D.load_gsm8k, "GSM8K 8-shot CoT solve rate"),
    "humaneval": TaskSpec("humaneval", "gen", D.load_humaneval, "HumanEval pass@1 (greedy)"),
    "mbpp": TaskSpec("mbpp", "gen", D.load_mbpp, "MBPP pass@1 (greedy, 3-shot)"),
}

#: Tasks run by ``fbs eval`` when none are named (the quality columns of the paper's main table that
#: exist offline, plus the Chinese substitutes).
DEFAULT_TASKS = ("ppl_c4", "mmlu", "arc_easy", "arc_challenge", "hellaswag", "gsm8k", "humaneval", "mbpp",
                 "ppl_zh", "idiom_zh")


def run_task(system: System, name: str, limit: int | None = None, seed: int = 42, progress: bool = False,
             items: list | None = None, n_total: int | None = None, **options) -> TaskResult:
    """Run one registered task on ``system``: on ``items`` (a protocol's subset of a set of ``n_total``), else on
    ``limit`` examples drawn with ``seed`` (all without a limit). ``details["cost"]`` is what the system's
    :meth:`~fbs.eval.systems.System.cost_counters` counted during the task (skipped pairs, decoded tokens)."""
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; known: {', '.join(TASKS)}")
    spec = TASKS[name]
    if items is None:
        full = spec.load()
        items, n_total = select(full, limit, seed), len(full)
    n_total = len(items) if n_total is None else n_total
    logger.info("task %s: %d of %d examples on %s", name, len(items), n_total, system.name)
    before = system.cost_counters()
    if spec.kind == "ppl":
        res = run_perplexity(system, items, name, n_total, progress=progress, seed=seed,
                             **{k: v for k, v in options.items() if k in ("max_tokens",)})
    elif spec.kind == "mc":
        res = run_multiple_choice(system, items, name, n_total, progress=progress, seed=seed)
    elif name == "gsm8k":
        res = run_gsm8k(system, items, n_total, progress=progress, seed=seed,
                        **{k: v for k, v in options.items() if k in ("max_new_tokens",)})
    else:
        res = run_code(system, items, name, n_total, progress=progress, seed=seed,
                       **{k: v for k, v in options.items() if k in ("max_new_tokens", "timeout")})
    after = system.cost_counters()
    if after:
        res.details["cost"] = {k: after[k] - before.get(k, 0.0) for k in after}
    return res


# --------------------------------------------------------------------------- protocols

@dataclasses.dataclass(frozen=True)
class ProtocolTask:
    """One benchmark of a protocol: a registered task on a fixed subset, or a benchmark that is not run here
    (``run=False``) with the reason and where its number comes from instead."""

    task: str
    size: int | None = None
    """Examples drawn with the protocol's seed (None: the whole set)."""
    per_stratum: int | None = None
    """Examples per stratum instead (MMLU: questions per subject)."""
    note: str = ""
    run: bool = True
    within: "ProtocolTask | None" = None
    """Draw from this (larger) entry's subset instead of the whole set: the smaller protocol's ids are then a
    subset of the larger one's, so its examples are rerun, not replaced, when compute allows the larger one."""


#: Benchmarks of the paper's main table that ``fbs eval run`` cannot run offline, and why.
NOT_RUN = (
    ProtocolTask("cmmlu", note="no offline copy (no dataset hub, no package ships it); substitutes: idiom_zh, ppl_zh",
                 run=False),
    ProtocolTask("ceval", note="no offline copy (no dataset hub, no package ships it); substitutes: idiom_zh, ppl_zh",
                 run=False),
    ProtocolTask("cmath", note="no offline copy; no Chinese math substitute", run=False),
    ProtocolTask("humaneval_x", note="no offline copy; humaneval is its Python-only original", run=False),
    ProtocolTask("bbh", note="not wired: the 23 source tasks are in the bigbench==1.0.0 sdist (358 MB, not "
                             "installed), the official 250-item subsets are not shipped", run=False),
    ProtocolTask("chat", note="a separate command: `fbs eval chat` (>= 100 held-out prompts, every system against "
                              "the base's answers); its prompt ids are written with the others", run=False),
)

_CHINESE = "substitute for CMMLU / C-Eval"

_CPU = (
    ProtocolTask("mmlu", per_stratum=20, note="20 questions per subject, 5-shot"),
    ProtocolTask("arc_easy", 500, note="OLMES 5-shot"),
    ProtocolTask("arc_challenge", 500, note="OLMES 5-shot"),
    ProtocolTask("hellaswag", 500, note="OLMES 5-shot"),
    ProtocolTask("gsm8k", 250, note="8-shot CoT, generated"),
    ProtocolTask("humaneval", None, note="all 164, generated"),
    ProtocolTask("mbpp", 200, note="3-shot, generated"),
    ProtocolTask("ppl_c4", 100, note="English PPL, first 1024 tokens per document"),
    ProtocolTask("ppl_zh", 200, note=f"Chinese PPL, {_CHINESE}"),
    ProtocolTask("idiom_zh", None, note=f"all 1,000 idioms of the probe, {_CHINESE}"),
)
_CPU_BY_TASK = {e.task: e for e in _CPU}
#: ``cpu-small``'s sizes: about half of ``cpu`` (half its run time), each drawn from ``cpu``'s subset.
_CPU_SMALL = {"mmlu": (None, 5, "5 questions per subject, 5-shot"), "arc_easy": (250, None, "OLMES 5-shot"),
              "arc_challenge": (250, None, "OLMES 5-shot"), "hellaswag": (200, None, "OLMES 5-shot"),
              "gsm8k": (100, None, "8-shot CoT, generated"), "humaneval": (82, None, "82 of 164, generated"),
              "mbpp": (100, None, "3-shot, generated"),
              "ppl_c4": (50, None, "English PPL, first 1024 tokens per document"),
              "ppl_zh": (100, None, f"Chinese PPL, {_CHINESE}"), "idiom_zh": (500, None, f"500 idioms, {_CHINESE}")}

#: ``fbs eval run --protocol NAME``. ``cpu``: the fixed subsets (sized so that one system's quality run fits a CPU
#: session; docs/eval.md has the cost estimate); ``cpu-small``: half of each ``cpu`` subset, drawn from
#: it (nested ids), for when two systems must fit one session; ``full``: the whole sets.
PROTOCOLS: dict[str, tuple[ProtocolTask, ...]] = {
    "cpu": (*_CPU, *NOT_RUN),
    "cpu-small": (*(ProtocolTask(t, size, per_stratum=k, note=note, within=_CPU_BY_TASK[t])
                    for t, (size, k, note) in _CPU_SMALL.items()), *NOT_RUN),
    "full": (
        ProtocolTask("mmlu", note="5-shot"), ProtocolTask("arc_easy", note="OLMES 5-shot"),
        ProtocolTask("arc_challenge", note="OLMES 5-shot"), ProtocolTask("hellaswag", note="OLMES 5-shot"),
        ProtocolTask("gsm8k", note="8-shot CoT, generated"), ProtocolTask("humaneval", note="generated"),
        ProtocolTask("mbpp", note="3-shot, generated"), ProtocolTask("ppl_c4", note="English PPL"),
        ProtocolTask("ppl_zh", note=f"Chinese PPL, {_CHINESE}"), ProtocolTask("idiom_zh", note=_CHINESE),
        *NOT_RUN,
    ),
}

IDS_FORMAT = "fbs-protocol-ids/1"


def describe_selection(entry: ProtocolTask) -> str:
    if entry.per_stratum is not None:
        text = f"{entry.per_stratum} per stratum"
    else:
        text = "all" if entry.size is None else f"{entry.size} seeded"
    return text + (f" from the {describe_selection(entry.within)} subset" if entry.within is not None else "")


def draw_protocol_items(entry: ProtocolTask, full: Sequence, seed: int) -> list:
    """The subset of ``full`` that ``entry`` asks for (deterministic in ``seed``), drawn from ``entry.within``'s
    subset when it has one."""
    if entry.within is not None:
        full = draw_protocol_items(entry.within, full, seed)
    if entry.per_stratum is not None:
        return select_stratified(full, entry.per_stratum, seed)
    return select(full, entry.size, seed)


def protocol_items(protocol: str, entry: ProtocolTask, full: Sequence, seed: int,
                   ids_dir: str | Path | None) -> tuple[list, dict]:
    """(items, ids record) of one protocol task.

    With ``ids_dir``, ``<ids_dir>/<task>.ids.json`` is the source of truth: when it exists its ids are used (in set
    order; an id missing from ``full`` is an error, as is a file written for another protocol, task or seed), else
    the subset is drawn and the file written. A GPU user therefore reruns exactly the ids committed in results/.
    """
    path = Path(ids_dir) / f"{entry.task}.ids.json" if ids_dir is not None else None
    if path is not None and path.is_file():
        rec = json.loads(path.read_text())
        want = {"format": IDS_FORMAT, "protocol": protocol, "task": entry.task, "seed": seed}
        wrong = {k: rec.get(k) for k, v in want.items() if rec.get(k) != v}
        if wrong:
            raise ValueError(f"{path} was written for {wrong}, not {want}: use another --ids-dir")
        by_id = {ex.id: ex for ex in full}
        if len(by_id) < len(full):
            raise ValueError(f"the {entry.task} data has repeated ids: a subset cannot be named by its ids")
        missing = [i for i in rec["ids"] if i not in by_id]
        if missing:
            raise ValueError(f"{path}: {len(missing)} ids are not in the {entry.task} data, e.g. {missing[:3]}")
        wanted = set(rec["ids"])
        return [ex for ex in full if ex.id in wanted], rec
    items = draw_protocol_items(entry, full, seed)
    rec = ids_record(protocol, entry, items, len(full), seed)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rec, indent=1, ensure_ascii=False) + "\n")
    return items, rec


def ids_record(protocol: str, entry: ProtocolTask, items: Sequence, n_total: int, seed: int) -> dict:
    strata: dict[str, int] = {}
    if entry.per_stratum is not None:
        for ex in items:
            k = ex.id.rsplit("/", 1)[0]
            strata[k] = strata.get(k, 0) + 1
    return {"format": IDS_FORMAT, "protocol": protocol, "task": entry.task, "seed": seed,
            "selection": describe_selection(entry) + (f" ({len(strata)} strata)" if strata else ""), "note": entry.note, "n": len(items), "n_total": n_total,
            **({"strata": strata} if strata else {}), "ids": [ex.id for ex in items]}
