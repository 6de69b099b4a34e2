"""A/B speed of two source trees of fbs: the same ``fbs bench`` invocation, the trees alternating round by round.

A refactor claims "decode speed unchanged"; this measures it. Each round runs the benchmark once from tree A and
once from tree B (the order alternates between rounds, so drift and warm caches hit both alike), each in a fresh
process with ``PYTHONPATH=<tree>/src``. Per system it reports the paired ratio of median decode latencies
(B / A) with a seeded bootstrap CI over rounds, prints a table and writes JSON.

    .venv/bin/python scripts/bench_ab.py --a /path/to/old-checkout --b . --rounds 8 \
        --bench-args "--systems fbs-full,fbs-tau --weights int8 --runs 5 --warmup 2" --out results/ab.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def git_commit(tree: Path) -> str:
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return out.stdout.strip() + ("-dirty" if dirty else "")


def run_once(tree: Path, bench_args: list[str], out_dir: Path, provenance: dict | None = None) -> dict[str, float]:
    """Median decode latency (ms) per (system, batch size) of one ``fbs bench`` run from ``tree``; ``provenance``
    (a dict) receives that run's record environment (``fbs.provenance`` fields of the tree's own code)."""
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    cmd = [sys.executable, "-m", "fbs.bench", *bench_args, "--out-dir", str(out_dir)]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    doc = json.loads((out_dir / "bench.json").read_text())
    if provenance is not None:
        provenance.update(doc.get("environment", {}))
    return {f"{r['system']}@B{r['batch_size']}": r["latency_ms"]["decode"]["median"]
            for r in doc["results"] if r["status"] == "ok"}


def bootstrap_ratio(a: list[float], b: list[float], reps: int = 10000, seed: int = 0) -> tuple[float, float, float]:
    """Geometric mean of the paired ratios b/a and its 95 % percentile-bootstrap interval over rounds."""
    logs = [math.log(y / x) for x, y in zip(a, b)]
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(reps))
    return math.exp(statistics.fmean(logs)), math.exp(means[int(0.025 * reps)]), math.exp(means[int(0.975 * reps)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", type=Path, required=True, help="tree A (the reference, e.g. the old commit's checkout)")
    ap.add_argument("--b", type=Path, required=True, help="tree B (the change)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--bench-args", default="--systems fbs-full --weights int8 --runs 5 --warmup 2",
                    help="arguments of `fbs bench`, one string")
    ap.add_argument("--out", type=Path, default=Path("results/bench_ab.json"))
    args = ap.parse_args()
    bench_args = shlex.split(args.bench_args)
    trees = {"a": args.a.resolve(), "b": args.b.resolve()}
    runs: dict[str, dict[str, list[float]]] = {"a": {}, "b": {}}
    prov: dict[str, dict] = {"a": {}, "b": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for side in ("a", "b") if r % 2 == 0 else ("b", "a"):
                res = run_once(trees[side], bench_args, Path(tmp, f"{side}{r}"), prov[side])
                for key, ms in res.items():
                    runs[side].setdefault(key, []).append(ms)
                print(f"round {r + 1}/{args.rounds} {side}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in res.items()),
                      file=sys.stderr)
    rows = []
    for key in sorted(set(runs["a"]) & set(runs["b"])):
        a, b = runs["a"][key], runs["b"][key]
        ratio, lo, hi = bootstrap_ratio(a, b)
        rows.append({"system": key, "a_median_ms": statistics.median(a), "b_median_ms": statistics.median(b),
                     "latency_ratio_b_over_a": ratio, "ci95": [lo, hi], "rounds": len(a), "a_runs_ms": a, "b_runs_ms": b})
    doc = {"bench_args": args.bench_args,
           "a": {"tree": str(trees["a"]), "commit": git_commit(trees["a"]), "provenance": prov["a"]},
           "b": {"tree": str(trees["b"]), "commit": git_commit(trees["b"]), "provenance": prov["b"]}, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"| system | A decode ms | B decode ms | B/A latency [95 % CI] | rounds |\n|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['system']} | {row['a_median_ms']:.1f} | {row['b_median_ms']:.1f} | "
              f"{row['latency_ratio_b_over_a']:.3f} [{row['ci95'][0]:.3f}, {row['ci95'][1]:.3f}] | {row['rounds']} |")


if __name__ == "__main__":
    main()
