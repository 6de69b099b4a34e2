"""``fbs eval group-b``: the paper's compact Group B table (adaptive-depth baselines against FBS) from measured files.

Inputs, each produced by its own command (nothing here runs a model):

* an ``fbs bench`` JSON (schema ``fbs.bench/1``): per system the decode latency, speed-up against ``hf-greedy``,
  TFLOPs(rel), the share it skipped and, for the speculative systems, acceptance, verified/advance ratio and tokens
  per verification pass;
* ``fbs eval sweep`` JSONs (the FBS sweep and the ``--baseline`` sweeps): decode-faithful held-out perplexity with
  its 95% CI per operating point;
* ``fbs eval run`` records: accuracy with its 95% CI on the multiple-choice tasks (MMLU subset first).

**Rows** are the bench's systems at one batch size: ``hf-greedy`` (the reference), ``fbs-full-compute``, every
``fbs-tau<t>``, ``ffn-skipllm-t<c>`` and ``flexidepth-tau<t>`` (family *skip*), and the engine's lossless systems
``fbs-lossless[-tau<t>]``, ``draft-verify`` and ``kangaroo-exit<n>`` (family *speculative*); ``systems=`` picks
others or another order. Weight-format (``-int8`` ...) and batch-policy suffixes are variants of the same system.

**Matching** (never estimated): a skip row takes the perplexity of the sweep row of the same method at the same
knob (FBS and FlexiDepth tau, FFN-SkipLLM threshold; FlexiDepth preferably with the same prompt routing as the
bench row) and the accuracy of the run record of the same method and knob. What is missing is "not measured". Two
exceptions, both stated in the table: a run record whose task had no position where skipping could act (one-token
answers such as MMLU's are predicted from the prefilled context: ``details.cost`` counts no scored and no decoded
pair) holds the full-depth value, so it stands for that method at any knob; and the lossless speculative systems
emit the full-depth model's tokens, so they take the full-depth quality (the FBS sweep's "nothing skipped" row, an
FBS run at ``--gate-mode off`` or a run that skipped nothing on the task) instead of being re-run. Skip rows that
decode with bf16 / int8 weights get no perplexity: the sweep scores fp32 weights.

**Fronts**: per baseline, its (decode ms/token, PPL) points; its front is the lower-left Pareto set joined by
straight lines (flat after its slowest point). An FBS point (``fbs-full-compute``, ``fbs-tau<t>``) is *on or below*
the front when its PPL is at most the front's at its latency, *above* otherwise, and *outside* when it is faster
than every point of the baseline (the baseline has no operating point that fast).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Sequence

SCHEMA = "fbs.group-b/1"
#: suffixes the bench adds to a system's name: weight format, then batch policy
_VARIANT = re.compile(r"^(?P<base>.+?)(?:-(?P<weights>bf16|int8|q8|q4|hf))?(?:-(?P<policy>all|majority))?$")
_NUM = r"(?P<v>-?[0-9]+(?:\.[0-9]+)?(?:e-?[0-9]+)?)"
#: stripped bench name -> (method, family, knob name, quality reference); knob value from the name's number
_PATTERNS = [
    (re.compile(r"^hf-greedy$"), ("base", "reference", None, "base")),
    (re.compile(r"^fbs-full-compute$"), ("fbs", "skip", None, "self")),
    (re.compile(rf"^fbs-tau{_NUM}$"), ("fbs", "skip", "tau", "self")),
    (re.compile(rf"^ffn-skipllm-t{_NUM}$"), ("ffn-skipllm", "skip", "threshold", "self")),
    (re.compile(rf"^flexidepth-tau{_NUM}$"), ("flexidepth", "skip", "tau", "self")),
    (re.compile(rf"^fbs-lossless(?:-tau{_NUM})?$"), ("fbs-lossless", "speculative", "tau", "fbs-full")),
    (re.compile(r"^draft-verify$"), ("draft-verify", "speculative", None, "fbs-full")),
    (re.compile(r"^kangaroo-exit(?P<v>[0-9]+)$"), ("kangaroo", "speculative", "exit_layer", "fbs-full")),
    (re.compile(r"^hf-(?:prompt-lookup|early-exit-[0-9]+|assisted|universal-assisted)$"),
     ("hf-speculative", "speculative", None, "base")),
]
#: rows shown by default (the HF speculative systems are the paper's Group A)
DEFAULT_METHODS = ("base", "fbs", "ffn-skipllm", "flexidepth", "fbs-lossless", "draft-verify", "kangaroo")
#: the baselines whose fronts FBS is held against
FRONT_METHODS = ("ffn-skipllm", "flexidepth")
LABELS = {"base": "base model (HF greedy)", "fbs": "FBS", "ffn-skipllm": "FFN-SkipLLM", "flexidepth": "FlexiDepth",
          "fbs-lossless": "FBS lossless", "draft-verify": "Draft&Verify", "kangaroo": "Kangaroo",
          "hf-speculative": "HF speculative"}
NOT_MEASURED = "not measured"
_EPS = 1e-9


# ---------------------------------------------------------------------------- what a bench row is
def classify(row: dict) -> dict | None:
    """{method, family, knob, value, quality, weights, route_prompt} of a bench result row, None if it is no Group B
    system (e.g. ``fbs-plan50``, ``fbs-tau0.3-hole``, ``llama-cpp``)."""
    m = _VARIANT.match(row["system"])
    params = row.get("params") or {}
    for pattern, (method, family, knob, quality) in _PATTERNS:
        hit = pattern.match(m["base"]) if m else None
        if hit is None:
            continue
        v = hit.groupdict().get("v")
        value = params.get(knob, float(v) if v is not None else None) if knob else None
        if method == "fbs-lossless" and v is None:
            value = None  # the checkpoint's own tau (the row's params do not say it)
        return {"method": method, "family": family, "knob": knob, "value": value, "quality": quality,
                "weights": params.get("weights") or m["weights"] or "fp32",
                "route_prompt": params.get("route_prompt", True) if method == "flexidepth" else None}
    return None


# ---------------------------------------------------------------------------- sweep rows
def _row_method(row: dict) -> str:
    if row.get("method"):
        return row["method"]
    return "base" if row.get("kind", "") == "base" or row.get("system") == "base" else "fbs"


def _row_kind(row: dict) -> str:
    if "kind" in row:
        return row["kind"]
    return "base" if row.get("system") == "base" else ("full" if row.get("tau") is None else "tau")


def _same(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and abs(float(a) - float(b)) < _EPS)


class SweepIndex:
    """The held-out PPL rows of several sweep JSONs on one text."""

    def __init__(self, sweeps: Sequence[tuple[str, dict]], text: str):
        self.rows: list[tuple[str, dict]] = []  # (file, row)
        self.texts: list[tuple[str, dict]] = []
        self.warnings: list[str] = []
        for path, doc in sweeps:
            texts = doc["texts"] if "texts" in doc else {"in": doc}
            if text not in texts:
                self.warnings.append(f"{path}: no {text!r} text (has {', '.join(texts)}); not used")
                continue
            t = texts[text]
            self.texts.append((path, t))
            self.rows += [(path, r) for r in t["rows"] if _row_kind(r) in ("base", "full", "tau")]
        if len({json.dumps([d["id"] for d in t.get("documents", [])]) for _, t in self.texts}) > 1 \
                or len({t.get("gate_from") for _, t in self.texts}) > 1:
            self.warnings.append("the sweeps scored different blocks or gate_from: their perplexities do not compare")

    def find(self, method: str, value=None, full: bool = False,
             route_prompt: bool | None = None) -> tuple[dict | None, str]:
        """The row of ``method`` (``base``: the base model) at knob ``value`` (``full``: nothing skipped) and a note."""
        kind = "base" if method == "base" else ("full" if full else "tau")
        hits = [(p, r) for p, r in self.rows if _row_kind(r) == kind and (kind == "base" or _row_method(r) == method)
                and (kind != "tau" or _same(r.get("tau"), value))]
        if not hits:
            return None, ""
        if kind == "base":
            return hits[0][1], ""
        if method == "flexidepth" and route_prompt is not None:
            same = [h for h in hits if bool(h[1].get("route_prompt", False)) == route_prompt]
            if not same:
                r = hits[0][1]
                return r, ("PPL with the prompt " + ("routed" if r.get("route_prompt") else "at full depth")
                           + "; the bench row " + ("routes" if route_prompt else "does not route") + " its prompt")
            hits = same
        ppls = {round(r["ppl"], 9) for _, r in hits}
        if len(ppls) > 1:
            raise ValueError(f"several sweeps give {method} at {value}: {sorted({p for p, _ in hits})}; pass one sweep "
                             "per method")
        return hits[0][1], ""

    def describe(self) -> dict:
        if not self.texts:
            return {}
        _, t = self.texts[0]
        return {"blocks": len(t.get("documents", [])), "gate_from": t.get("gate_from"), "base_ppl": t.get("base_ppl")}


# ---------------------------------------------------------------------------- run records
def record_key(system: dict) -> tuple[str, object, bool | None]:
    """(method, knob value or None for full depth, route_prompt) of an ``fbs eval run`` record's system."""
    kind = system.get("kind")
    if kind == "hf":
        return "base", None, None
    if kind == "fbs":
        if system.get("gate_mode") == "off":
            return "fbs", None, None
        tau = system.get("tau")
        if tau is None:
            tau = (system.get("config") or {}).get("tau") if isinstance(system.get("config"), dict) else None
        return "fbs", tau, None
    if kind == "adaptive":
        method = system.get("method")
        value = system.get("threshold") if method == "ffn-skipllm" else system.get("tau")
        return method, value, system.get("route_prompt") if method == "flexidepth" else None
    return str(kind), None, None


def _unskippable(task) -> bool:
    """The task's run had no position where a skip could act (every answer scored from the prefilled context)."""
    cost = task.details.get("cost")
    return cost is not None and not cost.get("scored_pairs") and not cost.get("decoded_pairs")


class RunIndex:
    def __init__(self, records: Sequence[tuple[str, dict]]):
        self.records = [(p, r, record_key(r["system"])) for p, r in records]

    def find(self, task: str, method: str, value=None, full: bool = False,
             route_prompt: bool | None = None) -> tuple[dict | None, str]:
        """The task result of ``method`` at ``value`` (``full``: at full depth) and a note, or (None, "")."""
        def at_knob(m, v):
            return m == method and (_same(v, None) if full else (method == "base" or _same(v, value)))

        hits = [(p, r, rp) for p, r, (m, v, rp) in self.records if at_knob(m, v) and task in r["tasks"]]
        same = [h for h in hits if method != "flexidepth" or route_prompt is None or bool(h[2]) == route_prompt]
        if same:
            return self._cell(same, task), ""
        if hits:  # FlexiDepth scored with the other prompt routing than the bench row's
            rp = bool(hits[0][2])
            return self._cell(hits, task), (f"{task} with the prompt " + ("routed" if rp else "at full depth")
                                            + "; the bench row " + ("routes" if route_prompt else "does not route")
                                            + " its prompt")
        # a record of the method whose task no skip could touch holds the full-depth value: valid at any knob
        free = [(p, r, rp) for p, r, (m, v, rp) in self.records if m == method and task in r["tasks"] and not rp
                and _unskippable(r["tasks"][task])]
        if free:
            cell = self._cell(free, task)
            note = (f"{task} from {cell['system']}: no position of this task could skip (every answer is predicted "
                    "from the prefilled context), so it is the full-depth value at every knob")
            if method == "flexidepth" and route_prompt:
                note += "; the bench row routes its prompt, which this run did not"
            return cell, note
        return None, ""

    @staticmethod
    def _cell(hits, task: str) -> dict:
        p, r = hits[0][:2]
        t = r["tasks"][task]
        m = t.metrics[t.primary]
        return {"task": task, "metric": t.primary, "value": m.value, "ci95": list(m.ci95), "n": t.n,
                "n_total": t.n_total, "record": str(p), "system": r["system"].get("name")}


# ---------------------------------------------------------------------------- the table
def _decode_ms(row: dict, new_tokens: int) -> float | None:
    lat = row.get("latency_ms") or {}
    dec = (lat.get("decode") or {}).get("median")
    return None if dec is None or new_tokens < 2 else dec / (new_tokens - 1)


def build_rows(bench: dict, sweeps: SweepIndex, runs: RunIndex, batch_size: int = 1,
               systems: Sequence[str] | None = None, tasks: Sequence[str] = ("mmlu",)) -> list[dict]:
    new_tokens = int(bench["protocol"]["new_tokens"])
    results = [r for r in bench["results"] if r.get("batch_size", 1) == batch_size]
    by_name = {r["system"]: r for r in results}
    if systems:
        missing = [s for s in systems if s not in by_name]
        if missing:
            raise ValueError(f"the bench has no rows {missing} at batch size {batch_size}; it has {sorted(by_name)}")
        chosen = [by_name[s] for s in systems]
    else:
        chosen = [r for r in results if (c := classify(r)) is not None and c["method"] in DEFAULT_METHODS]
    hf = by_name.get("hf-greedy")
    hf_dec = _decode_ms(hf, new_tokens) if hf and hf.get("status", "ok") == "ok" else None
    rows = []
    for r in chosen:
        c = classify(r) or {"method": r["system"], "family": r.get("family"), "knob": None, "value": None,
                            "quality": "self", "weights": (r.get("params") or {}).get("weights", "fp32"),
                            "route_prompt": None}
        ok = r.get("status", "ok") == "ok"
        probe = r.get("probe") or {}
        out = {"system": r["system"], "method": c["method"], "label": LABELS.get(c["method"], c["method"]),
               "family": c["family"], "knob": c["knob"], "value": c["value"], "weights": c["weights"],
               "status": r.get("status", "ok"), "note": r.get("note", ""), "notes": []}
        dec = _decode_ms(r, new_tokens) if ok else None
        out["decode_ms_per_token"] = dec
        out["speedup_decode"] = hf_dec / dec if dec and hf_dec else None
        out["speedup_end_to_end"] = r.get("speedup") if ok else None
        out["tflops_rel_exact"] = r.get("tflops_rel_exact") if ok else None
        out["tflops_rel"] = r.get("tflops_rel") if ok else None
        kind = r.get("method_ratio_kind")
        if c["family"] == "speculative":
            out["skip_share"], out["skip_unit"] = probe.get("draft_skip_ratio"), "layers (draft)"
            out["acceptance"] = probe.get("acceptance_rate")
            out["verified_advance"] = probe.get("verified_advance_ratio")
            out["tokens_per_pass"] = probe.get("tokens_per_pass")
        else:
            out["skip_share"] = r.get("method_ratio") if kind in ("layer_skip", "ffn_skip") else (
                0.0 if c["method"] == "base" else None)
            out["skip_unit"] = {"layer_skip": "layers", "ffn_skip": "FFN blocks"}.get(kind, "layers")
            out["acceptance"] = out["verified_advance"] = out["tokens_per_pass"] = None
        # held-out perplexity
        ppl, ppl_note = None, ""
        if c["quality"] == "base" or c["method"] == "base":
            ppl, _ = sweeps.find("base")
            if c["method"] != "base" and ppl is not None:
                ppl_note = "lossless to the base model: the base model's PPL"
        elif c["quality"] == "fbs-full":
            ppl, _ = sweeps.find("fbs", full=True)
            if ppl is not None:
                ppl_note = "lossless: the full-depth FBS model's PPL (not re-run)"
        elif c["weights"] in ("bf16", "int8", "q8", "q4"):
            ppl_note = f"the sweep scores fp32 weights; this row decodes with {c['weights']}"
        else:
            ppl, ppl_note = sweeps.find(c["method"], c["value"], full=c["value"] is None,
                                        route_prompt=c["route_prompt"])
        out["ppl"] = None if ppl is None else {"value": ppl["ppl"], "ci95": list(ppl["ppl_ci"]),
                                               "sweep_skip_ratio": ppl.get("skip_ratio"), "row": ppl.get("system")}
        if ppl_note:
            out["notes"].append(ppl_note)
        # accuracy
        out["quality"] = {}
        for task in tasks:
            if c["quality"] == "base" or c["method"] == "base":
                cell, note = runs.find(task, "base")
                if c["method"] != "base" and cell is not None:
                    note = "lossless to the base model: the base model's accuracy"
            elif c["quality"] == "fbs-full":
                cell, note = runs.find(task, "fbs", full=True)
                if cell is not None:
                    note = (f"lossless: {task} of the full-depth FBS model, not re-run: "
                            + (f"from {cell['system']}, in which no {task} position could skip" if note
                               else f"from {cell['system']}"))
            else:
                cell, note = runs.find(task, c["method"], c["value"], full=c["value"] is None,
                                       route_prompt=c["route_prompt"])
            out["quality"][task] = cell
            if note:
                out["notes"].append(note)
        rows.append(out)
    return rows


# ---------------------------------------------------------------------------- fronts
def pareto_front(points: Sequence[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """The lower-left Pareto set of (latency, ppl, name) points, by latency: each point has a lower PPL than every
    faster one."""
    front: list[tuple[float, float, str]] = []
    for p in sorted(points, key=lambda p: (p[0], p[1])):
        if not front or p[1] < front[-1][1] - _EPS:
            front.append(p)
    return front


def front_ppl(front: Sequence[tuple[float, float, str]], latency: float) -> float | None:
    """The front's PPL at ``latency``: straight lines between its points, flat after the slowest; None when
    ``latency`` is below its fastest point."""
    if not front or latency < front[0][0] - _EPS:
        return None
    for (x0, y0, _), (x1, y1, _) in zip(front, front[1:]):
        if x0 - _EPS <= latency <= x1 + _EPS:
            return y0 if x1 - x0 < _EPS else y0 + (y1 - y0) * (latency - x0) / (x1 - x0)
    return front[-1][1]


def _points(rows: Sequence[dict], method: str) -> list[tuple[float, float, str]]:
    return [(r["decode_ms_per_token"], r["ppl"]["value"], r["system"]) for r in rows
            if r["method"] == method and r["family"] == "skip" and r["decode_ms_per_token"] and r["ppl"]]


def front_statements(rows: Sequence[dict]) -> dict:
    """Per baseline of :data:`FRONT_METHODS`: where each FBS point lies against its (decode ms/token, PPL) front."""
    fbs = _points(rows, "fbs")
    out = {}
    for method in FRONT_METHODS:
        pts = _points(rows, method)
        name = LABELS[method]
        if not pts or not fbs:
            missing = "FBS" if not fbs else name
            out[method] = {"front": [], "points": [], "verdict": None,
                           "statement": f"{name}: not measured ({missing} has no point with both a decode latency and "
                                        "a held-out PPL): no front comparison"}
            continue
        front = pareto_front(pts)
        verdicts = []
        for lat, ppl, sys_name in fbs:
            ref = front_ppl(front, lat)
            where = "outside" if ref is None else ("on or below" if ppl <= ref + _EPS else "above")
            verdicts.append({"system": sys_name, "decode_ms_per_token": lat, "ppl": ppl, "front_ppl": ref,
                             "where": where})
        above = [v for v in verdicts if v["where"] == "above"]
        dominated = [p[2] for p in pts if any(f[0] <= p[0] + _EPS and f[1] <= p[1] + _EPS
                                              and (f[0] < p[0] - _EPS or f[1] < p[1] - _EPS) for f in fbs)]
        if not above:
            outside = [v["system"] for v in verdicts if v["where"] == "outside"]
            text = (f"FBS is on or below the {name} front at all {len(verdicts)} of its points"
                    + (f" ({', '.join(outside)} faster than every {name} point)" if outside else ""))
        else:
            text = (f"FBS is NOT on or below the {name} front at {len(above)} of {len(verdicts)} points: "
                    + "; ".join(f"{v['system']} ({v['decode_ms_per_token']:.1f} ms/token, PPL {v['ppl']:.2f} vs the "
                                f"front's {v['front_ppl']:.2f} at that latency)" for v in above))
        if dominated:
            text += f". {name} points dominated by an FBS point (as fast or faster, PPL as low or lower): " + \
                ", ".join(dominated)
        out[method] = {"front": [{"system": s, "decode_ms_per_token": x, "ppl": y} for x, y, s in front],
                       "points": verdicts, "verdict": "above" if above else "on or below", "statement": text + "."}
    return out


# ---------------------------------------------------------------------------- assembly and markdown
def assemble(bench: dict, sweeps: Sequence[tuple[str, dict]] = (), runs: Sequence[tuple[str, dict]] = (),
             text: str = "ood", batch_size: int = 1, systems: Sequence[str] | None = None,
             tasks: Sequence[str] = ("mmlu",), bench_path: str | None = None) -> dict:
    """The Group B document: rows, front statements, notes. ``sweeps``: (path, sweep JSON); ``runs``: (path,
    loaded run record, :func:`fbs.eval.report.load_record`)."""
    sw = SweepIndex(sweeps, text)
    rows = build_rows(bench, sw, RunIndex(runs), batch_size, systems, tasks)
    proto = bench.get("protocol", {})
    return {"schema": SCHEMA, "text": text, "batch_size": batch_size, "tasks": list(tasks),
            "inputs": {"bench": bench_path, "sweeps": [p for p, _ in sweeps], "runs": [p for p, _ in runs]},
            "bench_protocol": {k: proto.get(k) for k in ("prompt_len", "new_tokens", "runs", "warmup", "threads")},
            "sweep": sw.describe(), "rows": rows, "fronts": front_statements(rows), "warnings": sw.warnings}


def _f(x, fmt: str, missing: str = "–") -> str:
    return missing if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def markdown(doc: dict) -> str:
    tasks, text = doc["tasks"], doc["text"]
    proto, sw = doc["bench_protocol"], doc["sweep"]
    head = (["method", "family"] + [f"{t.upper() if t == 'mmlu' else t} acc % [95% CI]" for t in tasks]
            + [f"held-out PPL ({text}) [95% CI]", "decode ms/token", "speed-up vs HF (decode / end-to-end)",
               "TFLOPs(rel)", "skipped share", "acceptance"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    marks: dict[str, str] = {}

    def mark(note: str) -> str:
        if note not in marks:
            marks[note] = f"[{len(marks) + 1}]"
        return marks[note]

    for r in doc["rows"]:
        knob = "" if r["value"] is None else f" {r['knob'] or ''}={r['value']:g}"
        label = f"{r['label']}{knob} (`{r['system']}`)"
        notes = "".join(mark(n) for n in r["notes"])
        cells = [label + notes, r["family"]]
        for t in tasks:
            q = r["quality"].get(t)
            cells.append(NOT_MEASURED if q is None else
                         f"{100 * q['value']:.1f} [{100 * q['ci95'][0]:.1f}, {100 * q['ci95'][1]:.1f}] (n={q['n']})")
        p = r["ppl"]
        cells.append(NOT_MEASURED if p is None else f"{p['value']:.2f} [{p['ci95'][0]:.2f}, {p['ci95'][1]:.2f}]")
        if r["status"] != "ok":
            cells += [f"{r['status']}: {r['note']}"[:80], "–", "–", "–", "–"]
        else:
            cells += [_f(r["decode_ms_per_token"], ".1f"),
                      f"{_f(r['speedup_decode'], '.2f')}x / {_f(r['speedup_end_to_end'], '.2f')}x",
                      _f(r["tflops_rel_exact"], ".3f"),
                      "–" if r["skip_share"] is None else f"{100 * r['skip_share']:.1f}% {r['skip_unit']}",
                      "–" if r["acceptance"] is None else
                      f"{r['acceptance']:.2f} (VA {_f(r['verified_advance'], '.2f')}, "
                      f"{_f(r['tokens_per_pass'], '.2f')} tok/pass)"]
        lines.append("| " + " | ".join(cells) + " |")
    out = ["## Group B: adaptive-depth baselines against FBS", "",
           f"Bench: prompt {proto.get('prompt_len')}, {proto.get('new_tokens')} new tokens, batch {doc['batch_size']}, "
           f"{proto.get('runs')} measured runs (median). Held-out PPL: `fbs eval sweep`, {text} text"
           + (f", {sw['blocks']} blocks, decode-faithful (first {sw['gate_from']} tokens prefilled)" if sw else "")
           + ".", ""] + lines + [""]
    out += [f"{m} {n}" for n, m in marks.items()]
    out += ["", "Decode ms/token: the bench's median decode time over its N-1 decoded tokens; speed-up: hf-greedy's "
            "median decode (end-to-end: total) time over this row's. TFLOPs(rel): executed decode MACs over plain "
            "decoding's (`tflops_rel_exact`: K/V projections of skipped layers, FlexiDepth's routers and adapters, "
            "drafts and verification included). Skipped share: of (token, layer) pairs (layers) or of FFN blocks, in "
            "the bench's decode; for speculative rows the draft's. Acceptance: accepted / proposed drafts; VA: "
            "verified/advance ratio; tok/pass: tokens committed per verification pass. Accuracy and PPL: 95% "
            "bootstrap CIs; the PPL is at the same method and knob as the bench row (the sweep's own skip share on "
            "the held-out text is in the JSON). \"not measured\": no matching sweep row or run record was given.",
            "", "### Fronts (decode ms/token against held-out PPL)", ""]
    out += [f"- {f['statement']}" for f in doc["fronts"].values()]
    out += ["", "Fronts use point estimates; latency is one bench run's median (see its std in the bench JSON). "
            "Training budgets are not in these files: state them next to the table."]
    if doc["warnings"]:
        out += ["", "Warnings:"] + [f"- {w}" for w in doc["warnings"]]
    return "\n".join(out) + "\n"


def load_inputs(bench: str, sweeps: Sequence[str], runs: Sequence[str]):
    """(bench JSON, [(path, sweep JSON)], [(path, run record)]) from files."""
    from .report import load_record

    doc = json.loads(Path(bench).read_text())
    if doc.get("schema") != "fbs.bench/1":
        raise ValueError(f"{bench} is not an `fbs bench` JSON (schema {doc.get('schema')!r})")
    return doc, [(p, json.loads(Path(p).read_text())) for p in sweeps], [(p, load_record(p)) for p in runs]
