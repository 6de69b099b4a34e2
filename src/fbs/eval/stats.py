"""Paired bootstrap statistics (paper appendix B.6).

The unit of resampling is the example (question, problem, document), never the token. For every
resample ``b`` the same index vector is applied to both systems, the metric is recomputed on each,
and ``d[b] = metric(A[idx]) - metric(B[idx])`` with the metric oriented so that higher is better
(perplexity-like metrics are negated first: ``higher_is_better=False``). Then

    CI95 = percentiles 2.5 and 97.5 of d
    p    = 2 * min(mean(d <= 0), mean(d >= 0))      (capped at 1)

and a difference is marked significant when ``p < 0.01``. Benjamini-Hochberg is available as an
optional post-hoc check over a family of comparisons.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import numpy as np

#: Number of bootstrap resamples (paper: B = 1000).
N_RESAMPLES = 1000
#: Significance threshold used for the main-table marker.
ALPHA = 0.01


def mean_metric(x: np.ndarray) -> float:
    return float(np.mean(x))


def ppl_metric(nll: np.ndarray) -> float:
    """Perplexity from per-document mean NLLs: exp of the mean over documents (documents weigh equally)."""
    return float(np.exp(np.mean(nll)))


#: Aggregates by name, as stored in run records.
AGGREGATES_FOR_STATS: dict[str, Callable[[np.ndarray], float]] = {"mean": mean_metric, "exp_mean": ppl_metric}


@dataclasses.dataclass(frozen=True)
class BootstrapResult:
    """Difference ``metric(A) - metric(B)`` with its bootstrap CI and two-sided p-value."""

    delta: float
    """Point estimate on the full sample, in the metric's own orientation (A minus B)."""
    ci_low: float
    ci_high: float
    p_value: float
    n: int
    n_resamples: int

    @property
    def significant(self) -> bool:
        return self.p_value < ALPHA

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"significant": self.significant}


def bootstrap_indices(n: int, n_resamples: int = N_RESAMPLES, seed: int = 0) -> np.ndarray:
    """(n_resamples, n) indices sampled with replacement from a fixed-seed generator."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, n, size=(n_resamples, n))


def paired_bootstrap(
    a: Sequence[float],
    b: Sequence[float],
    metric: Callable[[np.ndarray], float] = mean_metric,
    higher_is_better: bool = True,
    n_resamples: int = N_RESAMPLES,
    seed: int = 0,
    indices: np.ndarray | None = None,
) -> BootstrapResult:
    """Paired bootstrap of ``metric(a) - metric(b)`` over examples (appendix B.6).

    ``a`` and ``b`` are per-example values of the two systems on the same examples, in the same order.
    The p-value is computed on the difference oriented so that higher is better (for a
    lower-is-better metric such as perplexity, ``d = metric(b) - metric(a)``); the reported ``delta``
    and CI are in the metric's own units (A minus B), so a perplexity drop shows as a negative delta.
    ``indices`` overrides the resamples (used by tests with a hand-computed case).
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or len(a) == 0:
        raise ValueError(f"paired bootstrap needs two equal-length 1-D samples, got {a.shape} and {b.shape}")
    idx = bootstrap_indices(len(a), n_resamples, seed) if indices is None else np.asarray(indices)
    d = np.array([metric(a[i]) - metric(b[i]) for i in idx])  # (n_resamples,)
    oriented = d if higher_is_better else -d
    p = min(1.0, 2.0 * min(float(np.mean(oriented <= 0)), float(np.mean(oriented >= 0))))
    lo, hi = np.percentile(d, [2.5, 97.5])
    return BootstrapResult(delta=metric(a) - metric(b), ci_low=float(lo), ci_high=float(hi),
                           p_value=p, n=len(a), n_resamples=len(idx))


def bootstrap_ci(x: Sequence[float], metric: Callable[[np.ndarray], float] = mean_metric,
                 n_resamples: int = N_RESAMPLES, seed: int = 0) -> tuple[float, float]:
    """95% percentile CI of a single system's metric (for the per-run report)."""
    x = np.asarray(x, dtype=np.float64)
    if len(x) == 0:
        return (math.nan, math.nan)
    idx = bootstrap_indices(len(x), n_resamples, seed)
    vals = np.array([metric(x[i]) for i in idx])
    lo, hi = np.percentile(vals, [2.5, 97.5])
    return float(lo), float(hi)


def benjamini_hochberg(p_values: Sequence[float], q: float = ALPHA) -> list[bool]:
    """Benjamini-Hochberg step-up procedure: which hypotheses are rejected at FDR ``q``.

    Sort p ascending, find the largest rank k with p_(k) <= k/m * q, reject ranks 1..k.
    """
    p = np.asarray(p_values, dtype=np.float64)
    m = len(p)
    if m == 0:
        return []
    order = np.argsort(p, kind="stable")
    thresholds = q * np.arange(1, m + 1) / m
    below = p[order] <= thresholds
    reject = np.zeros(m, dtype=bool)
    if below.any():
        k = int(np.nonzero(below)[0].max())
        reject[order[: k + 1]] = True
    return reject.tolist()


def bh_adjusted(p_values: Sequence[float]) -> list[float]:
    """BH-adjusted p-values (q-values): min over j >= i of p_(j) * m / j, capped at 1."""
    p = np.asarray(p_values, dtype=np.float64)
    m = len(p)
    if m == 0:
        return []
    order = np.argsort(p, kind="stable")
    scaled = p[order] * m / np.arange(1, m + 1)
    adj = np.minimum.accumulate(scaled[::-1])[::-1]
    out = np.empty(m)
    out[order] = np.minimum(adj, 1.0)
    return out.tolist()


#: Kendall's weight table is (distinct x values) x (distinct y values); above this, refuse
KENDALL_MAX_CELLS = 20_000_000


# ---------------------------------------------------------------------------- rank statistics
def _tie_groups(x: np.ndarray) -> tuple[np.ndarray, int]:
    """Per element the index of its value among the sorted distinct values, and the number of distinct values."""
    order = np.argsort(x, kind="stable")
    xs = x[order]
    new = np.ones(len(x), dtype=bool)
    new[1:] = xs[1:] != xs[:-1]
    g = np.empty(len(x), dtype=np.int64)
    g[order] = np.cumsum(new) - 1
    return g, int(new.sum())


class RankPair:
    """Two variables prepared once (tie groups) for rank statistics under many weight vectors (bootstrap
    multiplicities). A weight w_j counts token j w_j times: the statistics equal those of the expanded data."""

    def __init__(self, x, y):
        self.x, self.y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
        if self.x.shape != self.y.shape or self.x.ndim != 1:
            raise ValueError(f"need two equal-length 1-D samples, got {self.x.shape} and {self.y.shape}")
        self.gx, self.nx = _tie_groups(self.x)
        self.gy, self.ny = _tie_groups(self.y)

    @staticmethod
    def _ranks(g: np.ndarray, n: int, w: np.ndarray) -> np.ndarray | None:
        """Average ranks (1-based) of the weighted sample; None when it holds fewer than two distinct values."""
        tot = np.bincount(g, weights=w, minlength=n)
        if np.count_nonzero(tot) < 2:
            return None
        return (np.cumsum(tot) - tot + (tot + 1) / 2)[g]

    def spearman(self, w: np.ndarray | None = None) -> float:
        w = np.ones(len(self.x)) if w is None else np.asarray(w, dtype=np.float64)
        rx, ry = self._ranks(self.gx, self.nx, w), self._ranks(self.gy, self.ny, w)
        if rx is None or ry is None:
            return math.nan
        sw = w.sum()
        dx, dy = rx - (w * rx).sum() / sw, ry - (w * ry).sum() / sw
        return float((w * dx * dy).sum() / math.sqrt((w * dx * dx).sum() * (w * dy * dy).sum()))

    def kendall(self, w: np.ndarray | None = None) -> float:
        """Kendall's tau-b: (concordant - discordant) / sqrt((n0 - n1)(n0 - n2)), over pairs of (weighted) tokens."""
        w = np.ones(len(self.x)) if w is None else np.asarray(w, dtype=np.float64)
        gx, nx, gy, ny = self.gx, self.nx, self.gy, self.ny
        if nx > ny:
            gx, nx, gy, ny = gy, ny, gx, nx
        if nx * ny > KENDALL_MAX_CELLS:
            raise ValueError(f"Kendall's tau here needs one variable with few distinct values ({nx} x {ny})")
        cells = np.bincount(gx * ny + gy, weights=w, minlength=nx * ny).reshape(nx, ny)
        lower = np.cumsum(cells, axis=0) - cells        # weight at strictly smaller x, per y value
        below = np.cumsum(lower, axis=1) - lower         # ... and strictly smaller y
        above = lower.sum(axis=1, keepdims=True) - below - lower
        s = float((cells * (below - above)).sum())
        n = w.sum()
        n0 = n * (n - 1) / 2
        wx, wy = cells.sum(axis=1), cells.sum(axis=0)
        n1, n2 = (wx * (wx - 1) / 2).sum(), (wy * (wy - 1) / 2).sum()
        if n0 - n1 <= 0 or n0 - n2 <= 0:
            return math.nan
        return s / math.sqrt((n0 - n1) * (n0 - n2))


def spearman(x, y, w=None) -> float:
    """Spearman's rho (Pearson of average ranks); NaN when a variable is constant."""
    return RankPair(x, y).spearman(w)


def kendall_tau_b(x, y, w=None) -> float:
    """Kendall's tau-b; NaN when a variable is constant."""
    return RankPair(x, y).kendall(w)
