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
