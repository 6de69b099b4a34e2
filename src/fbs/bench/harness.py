"""The paper's fixed-length timing protocol (appendix B.3) for any system that generates tokens.

Protocol, per system and batch size:
    1. one untimed *probe* run per prompt batch: outputs (for token/exact match against the baseline), executed
       compute and method-specific ratios; hooks used for counting never run inside a timed region;
    2. ``warmup`` timed-but-discarded runs, then ``runs`` measured runs, cycling through the prompt batches;
    3. median (with mean and std) of prefill, decode and total wall-clock, from ``time.perf_counter`` with a
       device synchronization before the start and after the end of each run (a no-op on CPU);
    4. peak resident memory over the measured runs (Linux VmHWM, reset before the runs; psutil sampling
       elsewhere) and, on CUDA, ``torch.cuda.max_memory_allocated``.

Prompts are token ids prepared before timing (tokenization and I/O stay outside the timed region): an (n, T)
matrix, or a list of prompts of different lengths (the prompt sets of :mod:`fbs.bench.prompt_sets`), which run at
batch size 1. Measured run r of every system uses prompt batch r mod n, so every system sees the same prompts in
the same order (``SystemResult.run_batches``). Each system reports its own prefill/decode split (see
``systems.py``); total is the wall-clock around the call.

Public entry points:
    BenchConfig                       the protocol's knobs (defaults = the paper's, except warm-up/runs on CPU)
    build_prompts(tokenizer, n, len)  deterministic prompts from text shipped with Python (pydoc_data)
    measure(system, prompts, cfg)     -> SystemResult with timings, memory and probe statistics
    measure_interleaved(systems, ...) -> the same for several systems, round by round (pairable runs)
    paired_ratio(a_runs, b_runs)      per-round ratio of two interleaved systems' times, with a bootstrap CI
    paired_decode(a, b)               the same for two SystemResults' decode times, or None if not pairable
    environment()                     provenance (commit, CPU, threads, versions), GPU, load average
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import platform
import statistics
import threading
import time
from typing import Any, Sequence

import numpy as np
import torch

from fbs.bench.accounting import speculative_ratios_from_counts
from fbs.provenance import provenance

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class BenchConfig:
    """Fixed-length protocol knobs. Defaults follow appendix B.3."""

    prompt_len: int = 512
    """Prompt tokens per row."""
    new_tokens: int = 128
    """Generated tokens per row, exactly (EOS ignored)."""
    batch_size: int = 1
    warmup: int = 20
    """Discarded runs before measuring (paper: 20; lower it on a CPU budget)."""
    runs: int = 50
    """Measured runs (paper: 50; lower it on a CPU budget)."""
    num_prompts: int = 4
    """Distinct prompts; runs cycle through them and match rates are computed over all of them."""
    threads: int | None = None
    """torch intra-op threads; None keeps torch's default."""
    interleave: bool = False
    """Interleave the systems' runs round by round (see ``measure_interleaved``) instead of one system after
    another (the paper's order)."""
    prompt_set: str = "text"
    """Which prompts (:mod:`fbs.bench.prompt_sets`): ``text`` = windows of exactly ``prompt_len`` tokens (the
    paper's); ``chat``, ``code``, ``summarise`` = templated prompts of at most ``prompt_len`` tokens, batch 1."""
    prompt_seed: int = 0
    """Seed of a prompt set's item order (not used by ``text``)."""

    def __post_init__(self) -> None:
        for name in ("prompt_len", "new_tokens", "batch_size", "runs", "num_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.prompt_set not in PROMPT_SETS:
            raise ValueError(f"unknown prompt set {self.prompt_set!r}; choose from {', '.join(PROMPT_SETS)}")


# ----------------------------------------------------------------------------------------------- prompts

#: Names of ``--prompt-set`` (:mod:`fbs.bench.prompt_sets`; ``text``: the paper's fixed-length windows).
PROMPT_SETS = ("text", "chat", "code", "summarise")

PROMPT_SOURCE = "pydoc_data.topics (Python Language Reference text shipped with CPython), topics in sorted order"


def prompt_text() -> str:
    """~0.46 M characters of English technical prose that every CPython install carries."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def build_prompts(tokenizer, num_prompts: int, prompt_len: int, text: str | None = None) -> torch.Tensor:
    """(num_prompts, prompt_len) token ids: consecutive windows of the tokenized text, no special tokens.

    Windows are taken at a stride of ``len(ids) // num_prompts`` so that prompts come from different parts of
    the text; the text is repeated when it is shorter than needed (long-context runs on a short text).
    """
    text = prompt_text() if text is None else text
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError("prompt text tokenized to nothing")
    need = num_prompts * prompt_len
    while len(ids) < need:
        ids = ids + ids
    stride = max((len(ids) - prompt_len) // max(num_prompts, 1), 1)
    rows = [ids[i * stride: i * stride + prompt_len] for i in range(num_prompts)]
    return torch.tensor(rows, dtype=torch.long)


def prompts_digest(prompts: torch.Tensor | Sequence[torch.Tensor]) -> str:
    """Short hash of the prompt token ids, recorded so that two result files can be checked for comparability.
    Prompts of one length hash as their (n, T) matrix (as always); prompts of different lengths hash each
    prompt's length followed by its ids."""
    if isinstance(prompts, torch.Tensor):
        return hashlib.sha256(prompts.cpu().numpy().tobytes()).hexdigest()[:16]
    if len({int(p.shape[-1]) for p in prompts}) <= 1:
        return prompts_digest(torch.stack([p.reshape(-1) for p in prompts]))
    h = hashlib.sha256()
    for p in prompts:
        ids = p.reshape(-1).cpu().to(torch.int64)
        h.update(np.int64(ids.numel()).tobytes())
        h.update(ids.numpy().tobytes())
    return h.hexdigest()[:16]


def batches(prompts: torch.Tensor | Sequence[torch.Tensor], batch_size: int) -> list[torch.Tensor]:
    """Prompt batches of ``batch_size`` rows, wrapping around the prompt set. ``prompts``: an (n, T) matrix, or a
    list of (T_i,) prompts; prompts of different lengths run at batch size 1, one batch each."""
    if not isinstance(prompts, torch.Tensor):
        if len({int(p.shape[-1]) for p in prompts}) <= 1:
            prompts = torch.stack([p.reshape(-1) for p in prompts])
        elif batch_size != 1:
            raise ValueError(f"prompts of different lengths run at batch size 1 only, got batch size {batch_size}; "
                             "pass --batch-sizes 1 (or --prompt-set text for fixed-length prompts)")
        else:
            return [p.reshape(1, -1) for p in prompts]
    n = prompts.shape[0]
    count = max(n // batch_size, 1) if n >= batch_size else 1
    idx = [[(i * batch_size + j) % n for j in range(batch_size)] for i in range(count)]
    return [prompts[i] for i in idx]


# ----------------------------------------------------------------------------------------------- results


@dataclasses.dataclass
class GenOutput:
    """What a system returns from one generate call."""

    sequences: torch.Tensor | None  # (B, T + N); None: the system produces no ids (an external timing tool)
    prefill_s: float
    decode_s: float
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)  # probe statistics (see systems.py)
    total_s: float | None = None
    """The system's own total time; None: the wall-clock around the call (a subprocess's start-up and model
    loading are not the generation's)."""
    peak_rss_mb: float | None = None
    """Peak RSS of the process that generated, when that is not this one (a subprocess)."""
    draft_s: float | None = None
    """Of ``decode_s``, the time a speculative system spent in its draft source (proposing, rolling back,
    learning from the verified pass); None for systems that do not draft."""


@dataclasses.dataclass
class Summary:
    """One timing over the measured runs. ``runs`` keeps every run's value in run order: in an interleaved
    measurement run r of every system is round r, so two systems' runs pair up and the machine's drift cancels
    (``paired_ratio``). Empty for results loaded from documents written before it existed."""

    median: float
    mean: float
    std: float
    min: float
    max: float
    runs: list[float] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, xs: list[float]) -> "Summary":
        return cls(
            median=statistics.median(xs),
            mean=statistics.fmean(xs),
            std=statistics.stdev(xs) if len(xs) > 1 else 0.0,
            min=min(xs),
            max=max(xs),
            runs=list(xs),
        )


@dataclasses.dataclass
class SystemResult:
    name: str
    family: str
    batch_size: int
    params: dict[str, Any]
    ratio_kind: str | None = None  # layer_skip | acceptance | verified_advance | None (baseline)
    status: str = "ok"  # ok | unavailable | failed
    note: str = ""
    prefill_s: Summary | None = None
    decode_s: Summary | None = None
    total_s: Summary | None = None
    peak_rss_mb: float | None = None
    rss_before_mb: float | None = None
    peak_device_mb: float | None = None
    probe: dict[str, Any] = dataclasses.field(default_factory=dict)
    outputs: torch.Tensor | None = None  # generated ids of the probe runs, (P, N); not serialized
    budget: dict[str, int] = dataclasses.field(default_factory=dict)  # warmup, runs, probe_prompts used
    interleaved: bool = False  # measured by measure_interleaved: runs[r] of the timings is round r
    draft_s: Summary | None = None  # time in the draft source per measured run (GenOutput.draft_s); None: no draft
    run_batches: list[int] = dataclasses.field(default_factory=list)  # prompt batch of each measured run, in order
    #: per measured run, the prompt it timed, when paired CIs resample prompts instead of rounds (a prompt set: its
    #: prompts differ more than rounds do, and each is timed in several rounds); None: rounds are resampled
    clusters: list[int] | None = None


# ----------------------------------------------------------------------------------------------- memory


class PeakRSS:
    """Peak resident set size of this process over a region, in MB.

    Linux: reset the kernel's high-water mark (``/proc/self/clear_refs`` = 5) and read ``VmHWM``; exact.
    Elsewhere: sample RSS with psutil every 5 ms from a thread (may miss short peaks).
    """

    def __init__(self) -> None:
        self.before_mb = _rss_mb()
        self.peak_mb = self.before_mb
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._kernel = False

    def __enter__(self) -> "PeakRSS":
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._kernel = True
        except OSError:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak_mb = max(self.peak_mb, _rss_mb())

    def __exit__(self, *exc) -> None:
        if self._kernel:
            self.peak_mb = max(self.peak_mb, _status_kb("VmHWM") / 1024)
        else:
            self._stop.set()
            self._thread.join()
            self.peak_mb = max(self.peak_mb, _rss_mb())


def _status_kb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return float(line.split()[1])
    raise KeyError(field)


def _rss_mb() -> float:
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**20
    except ImportError:
        return _status_kb("VmRSS") / 1024


# ----------------------------------------------------------------------------------------------- timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_call(system, input_ids: torch.Tensor, new_tokens: int) -> tuple[GenOutput, float]:
    """One generate call with device syncs around it; returns (output, wall-clock seconds)."""
    _sync(input_ids.device)
    t0 = time.perf_counter()
    out = system.generate(input_ids, new_tokens, probe=False)
    _sync(input_ids.device)
    return out, time.perf_counter() - t0


def probe(system, prompt_batches: list[torch.Tensor], new_tokens: int) -> tuple[torch.Tensor, dict[str, Any]]:
    """Untimed runs over every prompt batch with the system's counters on: outputs and averaged statistics."""
    outs, stats = [], []
    for ids in prompt_batches:
        out = system.generate(ids, new_tokens, probe=True)
        stats.append(out.stats)
        if out.sequences is None:  # no ids to match (an external timing tool)
            continue
        gen = out.sequences[:, ids.shape[1]:]
        if gen.shape[1] != new_tokens:
            raise RuntimeError(f"{system.name}: generated {gen.shape[1]} tokens, expected exactly {new_tokens}")
        outs.append(gen)
    avg = _average_stats(stats)
    if avg.get("passes"):  # speculative: pool the counts over prompts (Eqs. accept / verify-advance are sums)
        pooled = speculative_ratios_from_counts(avg["passes"], avg["proposed"], new_tokens)
        kind = getattr(system, "ratio_kind", None)
        avg.update(pooled)
        avg["method_ratio"] = pooled.get({"acceptance": "acceptance_rate",
                                          "verified_advance": "verified_advance_ratio"}.get(kind, ""), None)
    return (torch.cat(outs) if outs else None), avg


def _average_stats(stats: list[dict[str, Any]]) -> dict[str, Any]:
    keys = {k for s in stats for k in s}
    avg: dict[str, Any] = {}
    for k in sorted(keys):
        vals = [s[k] for s in stats if s.get(k) is not None]
        if vals and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            avg[k] = statistics.fmean(vals)
        elif vals:
            avg[k] = vals[0]
        else:
            avg[k] = None
    return avg


class _Session:
    """One system's measurement in progress: its effective budget, prompt batches and timings so far."""

    def __init__(self, system, prompts: torch.Tensor | Sequence[torch.Tensor], cfg: BenchConfig) -> None:
        self.system = system
        self.res = SystemResult(name=system.name, family=system.family, batch_size=cfg.batch_size,
                                params=system.params, ratio_kind=getattr(system, "ratio_kind", None))
        self.pbs = batches(prompts, cfg.batch_size)
        max_runs = getattr(system, "max_runs", None)
        if max_runs is not None:  # a slow system's reduced budget: the probe run is its warm-up
            cfg = dataclasses.replace(cfg, warmup=0, runs=max_runs)
            self.pbs = self.pbs[:max_runs]
        self.cfg = cfg
        self.res.budget = {"warmup": cfg.warmup, "runs": cfg.runs, "probe_prompts": sum(b.shape[0] for b in self.pbs)}
        self.pre: list[float] = []
        self.dec: list[float] = []
        self.tot: list[float] = []
        self.drf: list[float] = []
        self.run_batches: list[int] = []
        self.before_mb: float | None = None
        self.peak_mb = 0.0
        self.peak_device_mb: float | None = None
        reason = system.unavailable(cfg.batch_size)
        if reason:
            self.res.status, self.res.note = "unavailable", reason
            logger.info("%s: unavailable (%s)", system.name, reason)

    @property
    def active(self) -> bool:
        return self.res.status == "ok"

    def guarded(self, step, *args) -> None:
        """Run one phase; a failure is recorded on the result (one broken system must not lose the others')."""
        if not self.active:
            return
        try:
            step(*args)
        except Exception as e:
            logger.exception("%s failed", self.system.name)
            self.res.status, self.res.note = "failed", f"{type(e).__name__}: {e}"

    def probe(self) -> None:
        self.res.outputs, self.res.probe = probe(self.system, self.pbs, self.cfg.new_tokens)

    def warm(self, i: int) -> None:
        timed_call(self.system, self.pbs[i % len(self.pbs)], self.cfg.new_tokens)

    def timed(self, i: int) -> None:
        device = self.pbs[0].device
        if device.type == "cuda":  # per run, so that interleaved systems do not see each other's peaks
            torch.cuda.reset_peak_memory_stats(device)
        with PeakRSS() as mem:
            out, wall = timed_call(self.system, self.pbs[i % len(self.pbs)], self.cfg.new_tokens)
        if device.type == "cuda":
            self.peak_device_mb = max(self.peak_device_mb or 0.0, torch.cuda.max_memory_allocated(device) / 2**20)
        if out.peak_rss_mb is None and self.before_mb is None:
            self.before_mb = mem.before_mb
        self.run_batches.append(i % len(self.pbs))
        self._record(out, wall, mem.peak_mb)

    def timed_many(self) -> None:
        """All measured runs in one ``system.generate_runs`` call (a tool that repeats and warms up itself)."""
        for out in self.system.generate_runs(self.pbs[0], self.cfg.new_tokens, self.cfg.runs):
            self._record(out, None, 0.0)

    def _record(self, out: GenOutput, wall: float | None, peak_mb: float) -> None:
        """One measured run: the system's own total and peak RSS where it reports them (a subprocess's)."""
        self.peak_mb = max(self.peak_mb, out.peak_rss_mb if out.peak_rss_mb is not None else peak_mb)
        self.pre.append(out.prefill_s)
        self.dec.append(out.decode_s)
        self.tot.append(out.total_s if out.total_s is not None else wall)
        if out.draft_s is not None:
            self.drf.append(out.draft_s)

    def finish(self) -> SystemResult:
        res = self.res
        if res.status == "ok":
            res.rss_before_mb, res.peak_rss_mb = self.before_mb, self.peak_mb
            res.peak_device_mb = self.peak_device_mb
            res.prefill_s, res.decode_s, res.total_s = Summary.of(self.pre), Summary.of(self.dec), Summary.of(self.tot)
            if self.drf and len(self.drf) == len(self.dec):
                res.draft_s = Summary.of(self.drf)
            res.run_batches = list(self.run_batches)
            logger.info("%s B=%d: total %.1f ms (median of %d), decode %.1f ms", res.name, res.batch_size,
                        1e3 * res.total_s.median, len(self.tot), 1e3 * res.decode_s.median)
        return res


def measure(system, prompts: torch.Tensor | Sequence[torch.Tensor], cfg: BenchConfig) -> SystemResult:
    """Run the protocol for one system at ``cfg.batch_size``: probe, warm-up, measured runs.

    Failures are recorded, not raised. Peak RSS is the maximum over the measured runs."""
    s = _Session(system, prompts, cfg)
    s.guarded(s.probe)
    if hasattr(system, "generate_runs"):  # it warms up and repeats itself, in one process (llama-bench -r N)
        s.res.budget["warmup"] = 0
        s.guarded(s.timed_many)
        return s.finish()
    for i in range(s.cfg.warmup):
        s.guarded(s.warm, i)
    for i in range(s.cfg.runs):
        s.guarded(s.timed, i)
    return s.finish()


def measure_interleaved(systems, prompts: torch.Tensor | Sequence[torch.Tensor], cfg: BenchConfig,
                        on_round=None) -> list[SystemResult]:
    """The protocol for several systems with their runs interleaved: every system is probed, then each warm-up
    round and each measured round runs every system once, in turn, so slow drift of the machine (a shared host,
    thermal state) hits all systems alike instead of the ones measured last. ``on_round(kind, i, n)`` is
    called before each system's probe and before each round. Each system keeps its own budget; one that fails drops out of later rounds."""
    sessions = [_Session(system, prompts, cfg) for system in systems]
    for s in sessions:
        s.res.interleaved = True
    for i, s in enumerate(sessions):
        if on_round:
            on_round(f"probe {s.system.name}", i, len(sessions))
        s.guarded(s.probe)
    for kind, count, step in (("warm-up", "warmup", "warm"), ("run", "runs", "timed")):
        n = max((getattr(s.cfg, count) for s in sessions), default=0)
        for i in range(n):
            if on_round:
                on_round(kind, i, n)
            for s in sessions:
                if i < getattr(s.cfg, count):
                    s.guarded(getattr(s, step), i)
    return [s.finish() for s in sessions]


# ----------------------------------------------------------------------------------------------- paired comparison

#: Bootstrap resamples of the paired estimates (fixed seed: the same runs always give the same CI).
PAIRED_RESAMPLES = 1000


@dataclasses.dataclass(frozen=True)
class PairedRatio:
    """Per-round ratio q[r] = a[r] / b[r] of two systems' times measured in the same interleaved rounds.

    The two runs of a round ran back to back, so slow drift of the machine (a shared VM's speed wanders over
    minutes) cancels in q[r]; only the round-to-round noise of the ratio is left, and the CI measures it.
    Unpaired medians keep the drift, which hides small differences."""

    ratio_median: float
    ratio_mean: float
    ci_low: float
    """95 % percentile-bootstrap CI of ``ratio_mean``: rounds resampled with replacement, statistic = mean; with
    clusters (prompts), the clusters resampled, statistic = mean of the resampled clusters' mean ratios."""
    ci_high: float
    p_below_one: float
    """One-sided exact sign test of "a is faster than b": P(X >= #rounds with q < 1), X ~ Bin(#rounds with
    q != 1, 1/2) (with clusters: over the clusters' mean ratios). At least 2^-n, so n rounds (clusters) bound how
    small it can get; 1.0 when every round ties."""
    n: int
    n_resamples: int
    n_clusters: int | None = None
    """Clusters resampled (the prompts of a prompt set), or None: rounds were."""
    by_cluster: tuple[float, ...] | None = None
    """Each cluster's mean ratio, clusters in increasing id (a prompt set: prompt order), or None."""


def sign_test_p(wins: int, n: int) -> float:
    """One-sided exact binomial tail P(X >= wins) for X ~ Bin(n, 1/2); 1.0 when n = 0 (no evidence)."""
    if not 0 <= wins <= n:
        raise ValueError(f"sign test needs 0 <= wins <= n, got wins={wins}, n={n}")
    if n == 0:
        return 1.0
    return sum(math.comb(n, k) for k in range(wins, n + 1)) / 2**n


def paired_ratio(a_runs: Sequence[float], b_runs: Sequence[float], seed: int = 0,
                 n_resamples: int = PAIRED_RESAMPLES, clusters: Sequence[int] | None = None) -> PairedRatio:
    """Paired ratio a / b over rounds (see ``PairedRatio``). ``a_runs[r]`` and ``b_runs[r]`` must come from the
    same interleaved round. The resampled indices are those of ``fbs.eval.stats.bootstrap_indices`` with the same
    seed (drawn here: the benchmark does not depend on the evaluation package).

    ``clusters[r]``: the cluster of round r (the prompt it timed), each cluster with the same number of rounds: the
    ratio is then the mean of the clusters' mean ratios (the mean over rounds, as every cluster weighs alike), and
    the CI and sign test resample and count clusters, so that they describe the population of prompts the set
    samples rather than the rounds' noise on these prompts (two rounds of one prompt are not independent draws)."""
    a = np.asarray(a_runs, dtype=np.float64)
    b = np.asarray(b_runs, dtype=np.float64)
    if a.ndim != 1 or a.shape != b.shape or len(a) == 0:
        raise ValueError(f"paired ratio needs two equal-length, non-empty run lists, got {a.shape} and {b.shape}")
    if not np.all(b > 0):
        raise ValueError("paired ratio needs positive times in the denominator's runs")
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be >= 1, got {n_resamples}")
    q = a / b
    units, n_clusters = q, None
    if clusters is not None:
        if len(clusters) != len(q):
            raise ValueError(f"paired ratio needs one cluster per round, got {len(clusters)} for {len(q)} rounds")
        ids, which, sizes = np.unique(np.asarray(clusters), return_inverse=True, return_counts=True)
        if len(set(sizes.tolist())) != 1:
            raise ValueError(f"paired ratio's clusters must have equal numbers of rounds, got "
                             f"{dict(zip(ids.tolist(), sizes.tolist()))}")
        units = np.bincount(which, weights=q) / sizes  # each cluster's mean ratio, clusters in increasing id
        n_clusters = len(ids)
    idx = np.random.default_rng(seed).integers(0, len(units), size=(n_resamples, len(units)))
    lo, hi = np.percentile(units[idx].mean(axis=1), [2.5, 97.5])
    return PairedRatio(ratio_median=float(np.median(q)), ratio_mean=float(units.mean()), ci_low=float(lo),
                       ci_high=float(hi), p_below_one=sign_test_p(int(np.sum(units < 1)), int(np.sum(units != 1))),
                       n=len(q), n_resamples=n_resamples, n_clusters=n_clusters,
                       by_cluster=None if n_clusters is None else tuple(float(u) for u in units))


def paired_decode(a: SystemResult, b: SystemResult, seed: int = 0) -> PairedRatio | None:
    """``paired_ratio`` of a's decode times over b's, or None when they do not pair: both must be ok, measured
    by the same ``measure_interleaved`` call (the caller's responsibility; results of one batch size of one run
    are) with the same number of runs (a reduced budget, ``--draft-runs``, is not paired), and b's decode
    times positive. When both carry the same ``clusters`` (a prompt set's prompts), they are resampled."""
    if a.status != "ok" or b.status != "ok" or not (a.interleaved and b.interleaved):
        return None
    ra, rb = a.decode_s.runs, b.decode_s.runs
    if not ra or len(ra) != len(rb) or min(rb) <= 0:
        return None
    clusters = a.clusters if a.clusters and a.clusters == b.clusters and len(a.clusters) == len(ra) else None
    return paired_ratio(ra, rb, seed, clusters=clusters)


# ----------------------------------------------------------------------------------------------- matching


def match_rates(outputs: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(token-level match %, exact-match %) of generated ids against the baseline's (appendix E.8).

    Token-level match compares position by position; exact match counts rows identical end to end.
    """
    if outputs.shape != reference.shape:
        raise ValueError(f"outputs {tuple(outputs.shape)} and reference {tuple(reference.shape)} differ in shape")
    eq = outputs == reference
    return 100.0 * eq.float().mean().item(), 100.0 * eq.all(dim=1).float().mean().item()


# ----------------------------------------------------------------------------------------------- environment


def environment(device: torch.device | str = "cpu") -> dict[str, Any]:
    """Facts that decide the numbers: the record's provenance (commit, CPU and its flags, threads, versions, native
    kernels), the thread environment, the device, and how busy the machine was."""
    env: dict[str, Any] = {
        **provenance(),
        "thread_env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if k in os.environ},
        "platform": platform.platform(),
        "device": str(device),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    try:
        import psutil

        env["memory_total_gb"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    if torch.device(device).type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env
