"""The Stage-2 acceptance experiment: at equal held-out PPL, does SG+RL skip more than SG no-RL?

One command, resumable, on a Stage-1 export (paper appendix E.3 and E.7.2)::

    fbs train stage2-accept --init-from runs/stage1/final --corpus /work/data/corpus --ood \\
        --out-dir runs/stage2_accept

1. **Grid.** One Stage-2 run per (alpha, beta) point (default: the paper's five, appendix E.7.2), each
   ``steps`` PPO steps (>= 30) from the same Stage-1 export on one prompt pool, with every other setting
   from ``--config`` / ``--set``. Runs resume from their checkpoints.
2. **Held-out sweeps.** SG no-RL (the Stage-1 export) and every SG+RL export score the same held-out blocks
   (the corpus' test split and/or the out-of-distribution set of :mod:`fbs.eval.ood`) with
   :func:`fbs.eval.sweep.score`: teacher-forced, the first ``gate_from`` tokens never gated (a decode's
   prefilled prompt), at full depth and at every tau. Per system and set one JSON under ``sweeps/``.
3. **Equal-PPL comparison.** A system's front is its (PPL, skip) points over tau plus full depth; the skip it
   reaches at a PPL level is the front's upper envelope, linearly interpolated (flat beyond its last point).
   The levels are SG no-RL's PPL at each of its taus; Delta skip = SG+RL's skip there - SG no-RL's. The 95%
   CI is a paired bootstrap over blocks (the level moves with the resample). The primary level is SG no-RL's
   configured tau; the pre-registered test is the paper's alpha = beta = 0.1 point, the other grid points are
   exploratory (no multiple-comparison correction).
4. **Report**: ``acceptance.md`` and ``acceptance.json`` in ``out_dir`` (verdict, Delta skip with CI per
   run, set and level, every front, the grid's reward decomposition).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ..eval.sweep import HeldoutDoc, heldout_documents, score
from ..provenance import provenance
from .report import grid_table
from .stage2 import Stage2Config, build_model, prepare_pool, train_stage2

logger = logging.getLogger(__name__)

PAPER_GRID = ((0.1, 0.1), (0.05, 0.1), (0.2, 0.1), (0.1, 0.05), (0.1, 0.2))
DEFAULT_TAUS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)


@dataclasses.dataclass
class AcceptConfig:
    init_from: str
    """The Stage-1 export (SG no-RL, and the start of every Stage-2 run)."""
    out_dir: str = "runs/stage2_accept"
    config: str | None = None
    """Stage2Config YAML for the runs (e.g. configs/stage2_smollm2.yaml)."""
    overrides: tuple[str, ...] = ()
    """``key=value`` Stage2Config overrides for every run."""
    grid: tuple[tuple[float, float], ...] = PAPER_GRID
    steps: int = 30
    corpus: str | None = None
    """Corpus directory (``fbs data build``): its ``split`` documents are the in-domain held-out set."""
    split: str = "test"
    per_lang: int = 16
    max_tokens: int = 512
    ood: bool = False
    """Also the out-of-distribution blocks of :mod:`fbs.eval.ood`."""
    ood_limit: int | None = 16
    """OOD blocks per kind (None = all)."""
    taus: tuple[float, ...] = DEFAULT_TAUS
    gate_from: int = 128
    batch_size: int = 4
    resamples: int = 1000
    seed: int = 0
    threads: int = 0
    """torch threads for the sweeps (the runs take ``threads`` from their Stage2Config); 0 = torch's default."""

    def __post_init__(self):
        if self.steps < 1 or not self.grid:
            raise ValueError("steps must be >= 1 and the grid non-empty")
        if self.corpus is None and not self.ood:
            raise ValueError("give a held-out set: --corpus DIR and/or --ood")
        if not self.taus:
            raise ValueError("give at least one tau")


def run_name(alpha: float, beta: float) -> str:
    return f"a{alpha:g}_b{beta:g}"


# ---------------------------------------------------------------------------- equal-PPL comparison
def front_skip(ppl: np.ndarray, skip: np.ndarray, level: float) -> float:
    """The skip a front reaches at PPL <= ``level``: the upper envelope of its (ppl, skip) points, linearly
    interpolated between points and flat beyond the last; 0 below the lowest-PPL point."""
    order = np.argsort(ppl, kind="stable")
    x, y = ppl[order], np.maximum.accumulate(skip[order])
    if level < x[0]:
        return 0.0
    return float(np.interp(level, x, y))


@dataclasses.dataclass
class Sweep:
    """Per-block scores of one system on one held-out set: full depth (tau None) and each tau."""

    name: str
    nll: dict[float | None, np.ndarray]      # tau -> (docs,) mean NLL per block
    skipped: dict[float | None, np.ndarray]  # tau -> (docs,) skipped pairs per block
    pairs: np.ndarray                        # (docs,) (token, layer) pairs per block

    def front(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(PPL, skip) of full depth and every tau over the blocks ``idx`` (a resample)."""
        keys = list(self.nll)
        ppl = np.array([math.exp(float(self.nll[k][idx].mean())) for k in keys])
        tot = self.pairs[idx].sum()
        skip = np.array([0.0 if k is None else float(self.skipped[k][idx].sum() / max(tot, 1)) for k in keys])
        return ppl, skip

    def to_dict(self) -> dict:
        return {"name": self.name, "taus": [k for k in self.nll], "nll": [self.nll[k].tolist() for k in self.nll],
                "skipped": [self.skipped[k].tolist() for k in self.nll], "pairs": self.pairs.tolist()}

    @classmethod
    def from_dict(cls, d: dict) -> "Sweep":
        taus = [None if t is None else float(t) for t in d["taus"]]
        return cls(d["name"], {t: np.asarray(v) for t, v in zip(taus, d["nll"])},
                   {t: np.asarray(v) for t, v in zip(taus, d["skipped"])}, np.asarray(d["pairs"]))


def compare(norl: Sweep, rl: Sweep, resamples: int = 1000, seed: int = 0) -> list[dict]:
    """Delta skip (SG+RL - SG no-RL) at SG no-RL's PPL of each of its taus, with a paired bootstrap CI."""
    n = len(norl.pairs)
    taus = [t for t in norl.nll if t is not None]
    rng = np.random.default_rng(seed)
    draws = [np.arange(n)] + [rng.integers(0, n, n) for _ in range(resamples)]
    deltas = np.zeros((len(draws), len(taus)))
    levels = np.zeros_like(deltas)
    for i, idx in enumerate(draws):
        p0, s0 = norl.front(idx)
        p1, s1 = rl.front(idx)
        for j, t in enumerate(taus):
            level = p0[list(norl.nll).index(t)]
            levels[i, j] = level
            deltas[i, j] = front_skip(p1, s1, level) - front_skip(p0, s0, level)
    out = []
    (p0, s0), (p1, s1) = norl.front(draws[0]), rl.front(draws[0])
    for j, t in enumerate(taus):
        boot = deltas[1:, j]
        out.append({"tau": t, "ppl_level": float(levels[0, j]), "skip_norl": front_skip(p0, s0, levels[0, j]),
                    "skip_rl": front_skip(p1, s1, levels[0, j]), "delta_skip": float(deltas[0, j]),
                    "ci": [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))] if resamples else None,
                    "p_not_more": float((boot <= 0).mean()) if resamples else None})
    return out


# ---------------------------------------------------------------------------- the steps
def heldout_sets(cfg: AcceptConfig, tokenizer) -> dict[str, list[HeldoutDoc]]:
    sets: dict[str, list[HeldoutDoc]] = {}
    if cfg.corpus:
        sets["in-domain"] = [d for d in heldout_documents(cfg.corpus, tokenizer, cfg.split, cfg.per_lang,
                                                          cfg.max_tokens, cfg.seed)
                             if len(d.input_ids) >= cfg.gate_from + 2]
    if cfg.ood:
        from ..eval.ood import ood_blocks  # optional: the OOD sources need the eval extras

        sets["ood"] = [d for d in ood_blocks(tokenizer, seed=cfg.seed, limit=cfg.ood_limit)
                       if len(d.input_ids) >= cfg.gate_from + 2]
    for name, docs in sets.items():
        if not docs:
            raise ValueError(f"held-out set {name!r} has no block of at least gate_from + 2 = {cfg.gate_from + 2} tokens")
    return sets


def sweep_system(name: str, checkpoint: str | Path, sets: dict[str, list[HeldoutDoc]], cfg: AcceptConfig,
                 cache_dir: Path) -> dict[str, Sweep]:
    """Score one checkpoint on every held-out set (cached per system and set)."""
    out, todo = {}, {}
    for set_name, docs in sets.items():
        path = cache_dir / f"{name}__{set_name}.json"
        key = {"checkpoint": str(checkpoint), "docs": [d.id for d in docs], "taus": list(cfg.taus),
               "gate_from": cfg.gate_from, "max_tokens": cfg.max_tokens}
        if path.is_file():
            rec = json.loads(path.read_text())
            if rec.get("key") == key:
                out[set_name] = Sweep.from_dict(rec["sweep"])
                continue
        todo[set_name] = (docs, path, key)
    if not todo:
        return out
    model = build_model(Stage2Config(init_from=str(checkpoint)))
    for set_name, (docs, path, key) in todo.items():
        nll, skipped, pairs = {}, {}, None
        for tau in (None, *cfg.taus):
            s = score(model, docs, tau=tau, name=name, batch_size=cfg.batch_size, gate_from=cfg.gate_from)
            nll[tau], skipped[tau], pairs = np.asarray(s.nll), np.asarray(s.skipped), np.asarray(s.pairs)
            logger.info("%s on %s, tau %s: PPL %.3f, skip %.1f%%", name, set_name, tau, s.ppl, 100 * s.skip_ratio)
        out[set_name] = Sweep(name, nll, skipped, pairs)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": key, "sweep": out[set_name].to_dict()}))
    del model
    return out


def train_grid(cfg: AcceptConfig) -> list[tuple[float, float, Path]]:
    """Run (or resume) every grid point; returns (alpha, beta, run directory)."""
    out_dir = Path(cfg.out_dir)
    base = Stage2Config.from_yaml(cfg.config, [*cfg.overrides, f"init_from={cfg.init_from}", "progress=false"])
    pool = prepare_pool(dataclasses.replace(base, out_dir=str(out_dir)))
    runs = []
    for alpha, beta in cfg.grid:
        run_dir = out_dir / run_name(alpha, beta)
        # checkpoint at least 6 times per point: a grid point is short (30 steps), and the config's save_every
        # (50) would otherwise save only at the end, losing a whole point to an interrupted session
        run_cfg = dataclasses.replace(base, alpha=alpha, beta=beta, max_steps=cfg.steps, out_dir=str(run_dir),
                                      save_every=min(base.save_every, max(1, cfg.steps // 6)))
        summary = train_stage2(run_cfg, pool=pool)
        logger.info("grid point alpha=%g beta=%g: %s", alpha, beta, json.dumps(summary.get("last", {})))
        runs.append((alpha, beta, run_dir))
    return runs


def run_acceptance(cfg: AcceptConfig) -> dict:
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    runs = train_grid(cfg)
    norl_model = build_model(Stage2Config(init_from=cfg.init_from))
    tokenizer, primary = norl_model.tokenizer, float(norl_model.config.tau)
    del norl_model
    if primary not in cfg.taus:
        primary = sorted(cfg.taus)[len(cfg.taus) // 2]
    sets = heldout_sets(cfg, tokenizer)
    cache = out_dir / "sweeps"
    norl = sweep_system("sg_no_rl", cfg.init_from, sets, cfg, cache)
    results = []
    for alpha, beta, run_dir in runs:
        rl = sweep_system(f"sg_rl_{run_name(alpha, beta)}", run_dir / "final", sets, cfg, cache)
        for set_name in sets:
            cmp = compare(norl[set_name], rl[set_name], cfg.resamples, cfg.seed)
            main = next(c for c in cmp if c["tau"] == primary)
            results.append({"run": str(run_dir), "alpha": alpha, "beta": beta, "set": set_name, "primary": main,
                            "levels": cmp, "front": _front_rows(rl[set_name])})
    fronts = {s: _front_rows(norl[s]) for s in sets}
    paper_point = [r for r in results if (r["alpha"], r["beta"]) == (0.1, 0.1)]
    verdict = _verdict(paper_point or results, cfg.steps)
    report = {"config": {**dataclasses.asdict(cfg)}, "primary_tau": primary, "verdict": verdict,
              "sets": {s: len(d) for s, d in sets.items()}, "norl_front": fronts, "results": results,
              "provenance": provenance()}
    (out_dir / "acceptance.json").write_text(json.dumps(report, indent=1))
    (out_dir / "acceptance.md").write_text(markdown(report, [r for _, _, r in runs]))
    return report


def _front_rows(sw: Sweep) -> list[dict]:
    ppl, skip = sw.front(np.arange(len(sw.pairs)))
    return [{"tau": t, "ppl": float(p), "skip": float(s)} for t, p, s in zip(sw.nll, ppl, skip)]


#: PPO steps per grid point below which a negative result does not count
MIN_STEPS = 30


def _verdict(rows: Sequence[dict], steps: int) -> str:
    wins = [r for r in rows if r["primary"]["ci"] and r["primary"]["ci"][0] > 0]
    if wins:
        return "accepted: " + "; ".join(f"{r['set']}: Delta skip {100 * r['primary']['delta_skip']:+.1f} points, CI "
                                         f"[{100 * r['primary']['ci'][0]:+.1f}, {100 * r['primary']['ci'][1]:+.1f}]"
                                         for r in wins)
    if steps < MIN_STEPS:
        return (f"inconclusive: no Delta skip with a CI above 0, and {steps} steps per grid point are below the "
                f"{MIN_STEPS} a negative result needs")
    return "not accepted: SG+RL does not skip more than SG no-RL at equal PPL with a CI above 0 (negative result)"


def markdown(report: dict, run_dirs: Sequence[Path]) -> str:
    cfg = report["config"]
    lines = [f"# Stage-2 acceptance: {cfg['init_from']}", "",
             f"Grid of {len(cfg['grid'])} (alpha, beta) points x {cfg['steps']} PPO steps; held-out sets "
             + ", ".join(f"{s} ({n} blocks)" for s, n in report["sets"].items())
             + f"; gate_from {cfg['gate_from']}; taus {', '.join(str(t) for t in cfg['taus'])}; "
               f"{cfg['resamples']} paired bootstrap resamples over blocks.", "",
             f"**Verdict (alpha = beta = 0.1, at SG no-RL's PPL at tau {report['primary_tau']}):** {report['verdict']}",
             "", "## Delta skip at equal PPL (SG+RL - SG no-RL, percentage points)", "",
             "| run | alpha | beta | set | PPL level (no-RL tau) | skip no-RL | skip RL | Delta [95% CI] | P(Delta <= 0) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        for c in r["levels"]:
            ci = "–" if c["ci"] is None else f"[{100 * c['ci'][0]:+.1f}, {100 * c['ci'][1]:+.1f}]"
            star = " **" if c["tau"] == report["primary_tau"] else ""
            lines.append(f"| {Path(r['run']).name} | {r['alpha']:g} | {r['beta']:g} | {r['set']} | "
                         f"{c['ppl_level']:.3f} (τ={c['tau']:g}){star} | {100 * c['skip_norl']:.1f}% | "
                         f"{100 * c['skip_rl']:.1f}% | {100 * c['delta_skip']:+.1f} {ci} | "
                         f"{'–' if c['p_not_more'] is None else format(c['p_not_more'], '.3f')} |")
    lines += ["", "## Fronts (PPL, Skip %) per tau; tau – = full depth", ""]
    for s, rows in report["norl_front"].items():
        lines.append(f"- SG no-RL, {s}: " + ", ".join(_pt(x) for x in rows))
    for r in report["results"]:
        lines.append(f"- {Path(r['run']).name}, {r['set']}: " + ", ".join(_pt(x) for x in r["front"]))
    lines += ["", "## Reward decomposition of the grid", "",
              grid_table(list(run_dirs), last=5), ""]
    return "\n".join(lines)


def _pt(x: dict) -> str:
    return f"τ={'–' if x['tau'] is None else format(x['tau'], 'g')}: {x['ppl']:.2f} / {100 * x['skip']:.1f}%"

