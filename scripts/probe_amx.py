"""A probe: the native kernels' few-row q4 products (tile_r8, one 16-channel tile a call) against an AMX variant
(``tdpbsud``, two tiles a call), one thread, DRAM-cold weights.

Builds ``scripts/probe_amx.cpp`` (which includes the library's ``quant_vnni512.cpp`` as it is) with
``torch.utils.cpp_extension``, times each kernel on an (n, k) q4 product for 1, 2, 4 and 8 rows (best of
``--rounds`` passes over enough weight copies that each product reads its weights from DRAM), checks that the AMX
results equal the library's bit for bit, prints a table and writes JSON (with the provenance of the code
and machine). Needs a CPU with AMX-INT8 and a kernel that grants the tile state; the build takes about a minute.

    python scripts/probe_amx.py --n 3072 --k 576 --out results/probe_amx_s27.json

Run it on an idle machine: it measures speed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fbs import native
from fbs.provenance import provenance

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=3072, help="output channels (a multiple of 32)")
    ap.add_argument("--k", type=int, default=576, help="inputs (a multiple of 32)")
    ap.add_argument("--mb", type=float, default=40.0, help="MB of distinct weight copies cycled through per pass")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    mod = native.build_probe("fbs_probe_amx", ROOT / "scripts" / "probe_amx.cpp", ["-O2"])
    copies = max(1, int(args.mb * 2**20 // (args.n * args.k * 0.625)))
    res = mod.probe_amx(args.n, args.k, copies, args.rounds)
    rows = [{"rows": int(r[0]), "us_one_tile": float(r[1]), "us_amx": float(r[2]), "bit_identical": bool(r[3])}
            for r in res.tolist()]
    print(f"q4 product {args.n} x {args.k}, one thread, {copies} weight copies, best of {args.rounds}")
    print("| rows | library, one tile a call (us) | AMX tdpbsud (us) | results equal |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['rows']} | {r['us_one_tile']:.1f} | {r['us_amx']:.1f} | {r['bit_identical']} |")
    if args.out:
        doc = {"command": "python scripts/probe_amx.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items()
                                                                    if v is not None),
               "n": args.n, "k": args.k, "copies": copies, "rounds": args.rounds, "threads": 1, "rows": rows,
               "provenance": provenance()}
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
