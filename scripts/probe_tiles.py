"""A probe: the compute cost of the native q4 decode tiles per 16-channel x 32-input block, for 1 to 8 rows, one
thread, weights held in L2 (a few tiles timed over and over: no memory time in it).

Builds ``scripts/probe_tiles.cpp`` (which includes the library's ``quant_vnni512.cpp`` as it is) with
``torch.utils.cpp_extension`` and times ``tile_vnni512`` (the engine's path for 1-4 rows) and ``tile_rows8_vnni512``
(5-15 rows), the best of ``--reps`` passes over ``--tiles`` tiles of ``--k`` inputs. Compare with a pass's product
time in place to see how much of a multi-token step's extra cost is compute. Prints a table and writes JSON (with
the provenance of the code and machine); the build takes about a minute.

    python scripts/probe_tiles.py --out results/probe_tiles_s34.json

Run it on an idle machine: it measures speed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fbs import native
from fbs.native import quant as native_quant
from fbs.provenance import provenance

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=576, help="inputs (a multiple of 32)")
    ap.add_argument("--tiles", type=int, default=64, help="16-channel tiles per pass (64 x 576 inputs: 370 KB)")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if native_quant.isa() != "avx512-vnni":
        raise SystemExit(f"this probe times the AVX-512 VNNI kernels; this CPU runs {native_quant.isa()}")
    probe = native.build_probe("fbs_probe_tiles", ROOT / "scripts" / "probe_tiles.cpp", ["-O3"])
    res = probe.probe_tiles(args.k, args.tiles, args.reps).tolist()
    rows = [{"rows": int(r[0]), "ns_per_block_tile": r[1], "ns_per_block_rows8": r[2] or None} for r in res]
    one = rows[0]["ns_per_block_tile"]
    print(f"q4 decode tiles, k = {args.k}, {args.tiles} tiles held in L2, one thread, best of {args.reps}")
    print("| rows | tile(): ns per block | / 1 row | Rows8: ns per block |\n|---|---|---|---|")
    for r in rows:
        r8 = "" if r["ns_per_block_rows8"] is None else f"{r['ns_per_block_rows8']:.1f}"
        print(f"| {r['rows']} | {r['ns_per_block_tile']:.1f} | {r['ns_per_block_tile'] / one:.2f} | {r8} |")
    if args.out:
        doc = {"command": "python scripts/probe_tiles.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items()
                                                                      if v is not None),
               "k": args.k, "tiles": args.tiles, "reps": args.reps, "threads": 1, "rows": rows,
               "provenance": provenance()}
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
