"""Reports of Stage-2 runs: the reward decomposition over PPO steps (appendix E.7.1) and the operating
points of several runs side by side, e.g. an (alpha, beta) grid (appendix E.7.2).

Both read only a run directory's ``stage2_config.json`` and ``log.jsonl`` (one record per PPO step,
written by :meth:`fbs.rl.stage2.Stage2Trainer.log_metrics`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Sequence

from ..jsonl import iter_records

logger = logging.getLogger(__name__)

#: Columns of the decomposition table, in order: (log key, header, format).
DECOMPOSITION = (
    ("compute_term", "compute term α(1 - c/c0)", "{:+.4f}"),
    ("quality_penalty", "quality penalty β·Δℓ", "{:.4f}"),
    ("reward", "reward R", "{:+.4f}"),
    ("delta_nll", "Δℓ (nats/token)", "{:+.4f}"),
    ("skip_ratio", "Skip %", "{:.1%}"),
    ("tflops_rel", "c / c0", "{:.3f}"),
)


def read_log(run_dir: str | Path, upto: int | None = None) -> list[dict]:
    """The per-step records of a Stage-2 run (the last record of a step wins if a resumed run rewrote it),
    steps <= ``upto`` only when given (the learning rate is constant and episodes are a function of the step,
    so the first N steps of a longer run are the run of N steps)."""
    path = Path(run_dir) / "log.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a Stage-2 run directory (fbs train stage2 --out-dir)?")
    by_step: dict[int, dict] = {}
    for _, rec in iter_records(path.read_text().splitlines(), str(path)):
        if "reward" in rec and "step" in rec and (upto is None or int(rec["step"]) <= upto):
            by_step[int(rec["step"])] = rec
    if not by_step:
        raise ValueError(f"{path} has no PPO step records yet")
    return [by_step[s] for s in sorted(by_step)]


def read_config(run_dir: str | Path) -> dict:
    path = Path(run_dir) / "stage2_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def windows(records: Sequence[dict], n_windows: int) -> list[tuple[int, int, dict]]:
    """Split the steps into ``n_windows`` consecutive windows; mean of every decomposition key per window."""
    n = len(records)
    n_windows = max(1, min(n_windows, n))
    out = []
    for w in range(n_windows):
        lo, hi = (w * n) // n_windows, ((w + 1) * n) // n_windows
        part = records[lo:hi]
        means = {k: sum(r[k] for r in part) / len(part) for k, _, _ in DECOMPOSITION if all(k in r for r in part)}
        out.append((part[0]["step"], part[-1]["step"], means))
    return out


def decomposition_table(records: Sequence[dict], n_windows: int = 6) -> str:
    head = "| steps | " + " | ".join(h for _, h, _ in DECOMPOSITION) + " |"
    rows = [head, "|" + "---|" * (1 + len(DECOMPOSITION))]
    for first, last, m in windows(records, n_windows):
        cells = [fmt.format(m[k]) if k in m else "–" for k, _, fmt in DECOMPOSITION]
        rows.append(f"| {first}-{last} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot_decomposition(records: Sequence[dict], path: str | Path, title: str = "") -> bool:
    """Reward, compute term, quality penalty (left axis) and skip ratio (right axis) per PPO step (PNG).
    False when matplotlib is missing (``scripts/install_bench_deps.sh`` installs it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plot")
        return False
    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("reward", "reward R"), ("compute_term", "compute term"),
                       ("quality_penalty", "quality penalty")):
        ax.plot(steps, [r[key] for r in records], label=label)
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xlabel("PPO step")
    ax.set_ylabel("per-episode mean")
    ax2 = ax.twinx()
    ax2.plot(steps, [100 * r["skip_ratio"] for r in records], "k--", lw=1, label="Skip % (right)")
    ax2.set_ylabel("Skip %")
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    labels = ax.get_legend_handles_labels()[1] + ax2.get_legend_handles_labels()[1]
    ax.legend(lines, labels, loc="best", fontsize=8)
    ax.set_title(title or "Stage-2 reward decomposition")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def read_sweep(path: str | Path) -> tuple[Path, dict]:
    """A ``fbs eval sweep`` JSON: (the run directory of its checkpoint, held-out figures).

    Figures: ``no_skip`` (PPL with every layer), ``base`` (base-model PPL) and ``taus`` {tau: (skip ratio,
    TFLOPs(rel), PPL)}. The run is the parent of the swept checkpoint (``runs/X/final`` -> ``runs/X``).
    """
    data = json.loads(Path(path).read_text())
    if "rows" not in data or not data.get("checkpoint"):
        raise ValueError(f"{path} is not an `fbs eval sweep --checkpoint RUN/final` result (no rows or checkpoint)")
    out: dict = {"taus": {}}
    for row in data["rows"]:
        if row["system"] == "base":
            out["base"] = row["ppl"]
        elif row["tau"] is None:
            out["no_skip"] = row["ppl"]
        else:
            out["taus"][float(row["tau"])] = (row["skip_ratio"], row["tflops_rel"], row["ppl"])
    return Path(data["checkpoint"]).resolve().parent, out


def grid_table(run_dirs: Sequence[str | Path], last: int = 5, upto: int | None = None,
               sweeps: Sequence[str | Path] = ()) -> str:
    """One row per run: alpha, beta and the mean over its last ``last`` steps of every decomposition key.

    With ``sweeps`` (``fbs eval sweep`` JSONs of the runs' exports), each row also gets the held-out
    operating point: PPL with nothing skipped, and skip %, PPL at every swept tau. That is where a run's
    gates end up on text, while the decomposition columns describe its training episodes.
    """
    held = dict(read_sweep(p) for p in sweeps)
    taus = sorted({t for h in held.values() for t in h["taus"]}, reverse=True)
    extra = (["held-out PPL, no skip"] + [f"held-out {h} @ τ={t:g}" for t in taus for h in ("Skip %", "PPL")]
             if held else [])
    head = "| run | α | β | steps | " + " | ".join([h for _, h, _ in DECOMPOSITION] + extra) + " |"
    rows = [head, "|" + "---|" * (4 + len(DECOMPOSITION) + len(extra))]
    for d in run_dirs:
        recs, cfg = read_log(d, upto), read_config(d)
        tail = recs[-last:]
        m = {k: sum(r[k] for r in tail) / len(tail) for k, _, _ in DECOMPOSITION}
        cells = [fmt.format(m[k]) for k, _, fmt in DECOMPOSITION]
        if held:
            h = held.get(Path(d).resolve())
            cells.append("–" if h is None or "no_skip" not in h else f"{h['no_skip']:.2f}")
            for t in taus:
                point = None if h is None else h["taus"].get(t)
                cells += ["–", "–"] if point is None else [f"{point[0]:.1%}", f"{point[2]:.2f}"]
        rows.append(f"| {Path(d).name} | {cfg.get('alpha', '?')} | {cfg.get('beta', '?')} | {len(recs)} | "
                    + " | ".join(cells) + " |")
    note = f"\n\n(decomposition: means over each run's last {last} PPO steps"
    if held:
        bases = sorted({round(h["base"], 2) for h in held.values() if "base" in h})
        note += f"; held-out: `fbs eval sweep` of each run's export, base-model PPL {', '.join(map(str, bases))}"
    return "\n".join(rows) + note + ")"
