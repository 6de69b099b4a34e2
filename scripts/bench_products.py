"""Cost of the native block-quantized products over M rows against one row, in isolation, DRAM-cold.

What a multi-token step (a verified draft, a batch) pays in its products: for each weight shape of the default model
and format (``--shapes``, ``kind:n:k``), ``fbs.native.quant.linear`` over M rows (``--rows``), cycling through
enough distinct weight copies (``--mb`` MB) that each call reads its weights from DRAM. Each round times every
(shape, rows) once, in a shuffled order (a cell's place in a fixed order moved its time by up to 1.7x); per cell the
best and the median over rounds, and the median of the paired ratio to one row. Prints a table and writes JSON (with
the provenance of the code and machine).

    python scripts/bench_products.py --threads 2 --out results/bench_products_s27.json

Run it on an idle machine: it measures speed.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from fbs.engine.quant import quantize_blocks
from fbs.native import quant as native_quant
from fbs.provenance import provenance

#: SmolLM2-135M's products in the default format: K/V, gate + up and down in q4_1, the LM head in q8_0
SHAPES = "q4_1:384:576,q4_1:3072:576,q4_1:576:1536,q8_0:49152:576"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=SHAPES, help="kind:n:k, comma-separated")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--mb", type=float, default=40.0, help="MB of distinct weight copies per shape")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if native_quant.isa() is None:
        raise SystemExit("the native block kernels are not available on this CPU (fbs info says why)")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    rows = [int(m) for m in args.rows.split(",")]
    cells = {}
    for spec in args.shapes.split(","):
        kind, n, k = spec.split(":")
        n, k = int(n), int(k)
        per = n * k * (0.625 if kind == "q4_1" else 1.0625)
        w = torch.randn(n, k, generator=g) * 0.05
        packs = [native_quant.pack(kind, *quantize_blocks(w + 1e-3 * i, kind))
                 for i in range(max(1, int(args.mb * 2**20 // per)))]
        for m in rows:
            cells[(kind, n, k, m)] = (packs, torch.randn(m, k, generator=g))
    times = {key: [] for key in cells}
    order = list(cells)
    for key in order:  # one untimed pass each
        packs, x = cells[key]
        for p in packs:
            native_quant.linear(x, p, key[0], key[1])
    rng = random.Random(0)
    for r in range(args.rounds):
        rng.shuffle(order)
        for key in order:
            packs, x = cells[key]
            t0 = time.perf_counter()
            for p in packs:
                native_quant.linear(x, p, key[0], key[1])
            times[key].append((time.perf_counter() - t0) / len(packs))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    out = []
    for (kind, n, k, m), ts in times.items():
        one = times[(kind, n, k, rows[0])]
        out.append({"kind": kind, "n": n, "k": k, "rows": m, "us_best": 1e6 * min(ts),
                    "us_median": 1e6 * statistics.median(ts),
                    "ratio_to_first": statistics.median(t / o for t, o in zip(ts, one))})
    print(f"\n{args.threads} threads, {args.rounds} rounds, DRAM-cold weights ({args.mb:g} MB a shape)")
    print(f"| product | rows | best us | median us | paired ratio to {rows[0]} row(s) |\n|---|---|---|---|---|")
    for c in out:
        print(f"| {c['kind']} {c['n']} x {c['k']} | {c['rows']} | {c['us_best']:.0f} | {c['us_median']:.0f} | "
              f"{c['ratio_to_first']:.2f} |")
    if args.out:
        doc = {"command": "python scripts/bench_products.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
            "threads": args.threads, "rounds": args.rounds, "cells": out, "provenance": provenance()}
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
