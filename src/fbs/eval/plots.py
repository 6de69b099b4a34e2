"""Pareto plots of ``fbs eval sweep`` results: skip % against decode-faithful perplexity, several models per plot.

Per sweep (one colour each): the threshold front (full depth at 0% and every tau, joined in order of skip %,
each point labelled with its tau; for a ``--baseline`` sweep its own knob: FFN-SkipLLM's threshold, FlexiDepth's tau), the random / static / oracle plans at the matched taus (markers x, square,
triangle), and the control's perplexity as a dashed line. The base model's perplexity is the black line (one
dotted line per sweep in its colour when the sweeps scored different blocks).
Perplexity is on a log axis, so equal ratios look equal.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

logger = logging.getLogger(__name__)

_MARKERS = {"random": "x", "static": "s", "oracle": "^"}


def _kind(row: dict) -> str:
    """Row kind; sweeps written before kinds existed have only base / nothing skipped / tau rows."""
    if "kind" in row:
        return row["kind"]
    return "base" if row["system"] == "base" else ("full" if row["tau"] is None else "tau")


def sweep_texts(result: dict) -> dict[str, dict]:
    """{text name: per-text result with "rows"} of a sweep JSON (older single-text files count as "in")."""
    return result["texts"] if "texts" in result else {"in": result}


#: x axes of the Pareto plots: row -> x value in %, axis label
X_AXES = {
    "skip": (lambda r: 100 * r["skip_ratio"], "Skip % of (token, layer) pairs (decoded positions)"),
    "bytes": (lambda r: 100 * (1 - r["bytes_rel"]), "fp32 weight bytes saved per decode step, %"),
}


def _x_of(x: str):
    if x not in X_AXES:
        raise ValueError(f"unknown x axis {x!r}: use one of {sorted(X_AXES)}")
    get = X_AXES[x][0]

    def value(r: dict) -> float:
        if x == "bytes" and "bytes_rel" not in r:
            raise ValueError("this sweep JSON has no bytes_rel (written before it existed): rerun `fbs eval sweep`")
        return get(r)
    return value


def pareto_plot(sweeps: Sequence[tuple[str, dict]], path: str | Path, title: str = "", x: str = "skip") -> Path:
    """``sweeps``: (label, per-text sweep result) pairs; writes a PNG to ``path``. ``x``: "skip" (Skip % of
    pairs) or "bytes" (weight bytes saved: compares whole-layer with FFN-only skipping)."""
    xv = _x_of(x)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, ax = plt.subplots(figsize=(7.5, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    bases = []  # (colour, label, base PPL) per sweep
    for i, (label, res) in enumerate(sweeps):
        c = colors[i % len(colors)]
        rows = res["rows"]
        front = sorted((r for r in rows if _kind(r) in ("full", "tau")), key=lambda r: (xv(r), r["ppl"]))
        ax.plot([xv(r) for r in front], [r["ppl"] for r in front], "o-", color=c, ms=4,
                label=f"{label}: {res.get('front_label', 'gates (full depth at 0%)')}")
        last_x = None
        for r in front:
            at = xv(r)
            if r["tau"] is not None and (last_x is None or at - last_x > 0.8):
                ax.annotate(f"{r['tau']:g}", (at, r["ppl"]), textcoords="offset points", xytext=(3, -10),
                            fontsize=7, color=c)
                last_x = at
        for kind, marker in _MARKERS.items():
            pts = [r for r in rows if _kind(r) == kind]
            if pts:
                ax.plot([xv(r) for r in pts], [r["ppl"] for r in pts], marker, color=c, ms=7,
                        mfc="none", ls="none", label=f"{label}: {kind} plan, same count")
        for r in rows:
            if _kind(r) == "control":
                ax.axhline(r["ppl"], color=c, ls="--", lw=1, label=f"{label}: control, full depth")
            if _kind(r) == "base":
                bases.append((c, label, r["ppl"]))
    if bases and all(abs(b[2] - bases[0][2]) < 1e-9 for b in bases):
        ax.axhline(bases[0][2], color="black", lw=1, label="base model")
    else:  # scored on different blocks: one base line per sweep
        for c, label, ppl in bases:
            ax.axhline(ppl, color=c, ls=":", lw=1.2, label=f"{label}: base model")
    ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:.3g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.tick_params(axis="y", which="minor", labelsize=7)
    ax.set_xlabel(X_AXES[x][1])
    ax.set_ylabel("perplexity (log scale)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def pareto_plots(results: Sequence[tuple[str, dict]], prefix: str | Path, x: str = "skip") -> list[Path]:
    """One plot per text present in every sweep JSON of ``results`` ((label, JSON) pairs): ``{prefix}_{text}.png``
    (``{prefix}_{text}_bytes.png`` with ``x="bytes"``)."""
    texts = [sweep_texts(r) for _, r in results]
    gates = {t.get("gate_from") for tx in texts for t in tx.values()}
    if len(gates) > 1:
        logger.warning("the sweeps were scored with different gate_from %s: their numbers are not comparable",
                       sorted(map(str, gates)))
    common = [name for name in texts[0] if all(name in t for t in texts[1:])]
    out = []
    for name in common:
        title = f"{name} held-out text: " + " vs ".join(label for label, _ in results)
        out.append(pareto_plot([(label, t[name]) for (label, _), t in zip(results, texts)],
                               f"{prefix}_{name}{'' if x == 'skip' else '_' + x}.png", title, x=x))
    return out
