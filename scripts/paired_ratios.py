"""Paired speed ratios between the systems of one interleaved ``fbs bench`` record, round by round.

In an interleaved run every system runs once per round, so the ratio of two systems' latencies in the same round
cancels the machine's drift. Per (ours, peer) pair and phase (decode, prefill) this prints the median of the
per-round speed ratios (peer latency / ours: > 1 means ours is faster) with a seeded bootstrap 95 % CI, and writes
them as JSON.

    python scripts/paired_ratios.py results/bench_anchor_s13/bench.json --ours fbs-full-compute-q4,fbs-full-compute-int8 \
        --peers llama-cpp-q4_1,llama-cpp-q4_0 --out results/bench_anchor_s13/paired.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

from fbs.provenance import provenance


def bootstrap(values: list[float], seed: int = 0, n: int = 4000) -> tuple[float, float]:
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("record")
    ap.add_argument("--ours", required=True, help="comma list of system names")
    ap.add_argument("--peers", required=True, help="comma list of system names")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    doc = json.load(open(args.record))
    rows = {r["system"]: r for r in doc["results"]}
    out = []
    print("| ours | peer | phase | speed ratio (median of rounds) | 95% CI | per round |\n|---|---|---|---|---|---|")
    for ours in args.ours.split(","):
        for peer in args.peers.split(","):
            for phase in ("decode", "prefill"):
                a, b = rows[ours]["latency_ms"][phase]["runs"], rows[peer]["latency_ms"][phase]["runs"]
                ratio = [p / o for p, o in zip(b, a)]
                lo, hi = bootstrap(ratio)
                med = statistics.median(ratio)
                out.append({"ours": ours, "peer": peer, "phase": phase, "ratio": med, "ci95": [lo, hi],
                            "rounds": ratio})
                print(f"| {ours} | {peer} | {phase} | {med:.2f} | [{lo:.2f}, {hi:.2f}] | "
                      f"{', '.join(f'{r:.2f}' for r in ratio)} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"record": args.record, "command": "python scripts/paired_ratios.py " + " ".join(
                [args.record, "--ours", args.ours, "--peers", args.peers, "--out", args.out]), "pairs": out,
                       "provenance": provenance()}, f,
                indent=1)


if __name__ == "__main__":
    main()
