"""Perplexity with the KV cache in fp32 against half precision (``kv_dtype`` fp16 / bf16), per weight format.

The text, chunks and scored tokens are scripts/llama_cpp_ppl.py's (llama-perplexity's protocol): the held-out OOD
blocks joined into one text, cut into chunks of CTX tokens; the first CTX/2 + 1 tokens of a chunk are prefilled
and the rest teacher-forced through the engine's one-token step, every layer run. Every scored token is predicted
by a decode step that reads the cache, so the cache's storage is what changes between the rows. Per format and
cache dtype: the PPL, its change against the fp32 cache of the same format, and the per-chunk NLL (paired).

    python scripts/kv_half_ppl.py --formats q4,q8,int8 --kv-dtypes fp32,fp16,bf16 --out results/kv_half_ppl.json

A cache dtype ``int8-raw`` is the int8 cache without its key factors (``kv_smooth_keys=False``); ``int8-fp32scores``
the int8 cache with its scores as fp32 products of the decoded keys (:func:`fbs.native.int8_scores` off; ``int8``
scores in integers where the CPU has VNNI).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_cpp_ppl import held_out_chunks  # noqa: E402  (the same held-out text and chunks)
from weights_ppl import block_nll  # noqa: E402  (the teacher-forced scoring, one token per step)

from fbs import native  # noqa: E402
from fbs.model.loading import load_fbs  # noqa: E402
from fbs.provenance import provenance  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--formats", default="q4,q8,int8")
    ap.add_argument("--kv-dtypes", default="fp32,fp16,bf16")
    ap.add_argument("--per-kind", type=int, default=2, help="OOD blocks per kind (en, zh, code), as weights_ppl.py")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--shipped", action="store_true", help="the shipped FBS checkpoint instead of the base")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_fbs(args.model, shipped=args.shipped).eval()
    tok = model.tokenizer
    text, source, ids, chunks = held_out_chunks(tok, args.per_kind, args.ctx)
    kv_dtypes = [d for d in args.kv_dtypes.split(",") if d]
    if "fp32" not in kv_dtypes:
        kv_dtypes.insert(0, "fp32")
    rows: dict[str, dict] = {}
    for fmt in [f for f in args.formats.split(",") if f]:
        rows[fmt] = {}
        for kvd in kv_dtypes:
            t0 = time.perf_counter()
            # "int8-raw": the int8 cache without its key factors (DecodeOptions.kv_smooth_keys=False);
            # "int8-fp32scores": its scores as fp32 products (native.int8_scores off for this row)
            integer = native.int8_scores()
            native.int8_scores(integer and not kvd.endswith("-fp32scores"))
            try:
                nll = [block_nll(model, c, fmt, args.ctx // 2 + 1, kvd.removesuffix("-raw").removesuffix("-fp32scores"),
                                 smooth_keys=not kvd.endswith("-raw")) for c in chunks]
            finally:
                native.int8_scores(integer)
            r = rows[fmt][kvd] = {"ppl": math.exp(sum(nll) / len(nll)), "chunk_nll": nll,
                                  "seconds_under_load": time.perf_counter() - t0}
            ref = rows[fmt]["fp32"]
            r["ppl_change_pct"] = 100 * (r["ppl"] / ref["ppl"] - 1)
            r["chunk_nll_diff_max_abs"] = max(abs(a - b) for a, b in zip(nll, ref["chunk_nll"]))
            print(f"| {fmt} | kv {kvd} | PPL {r['ppl']:.4f} | {r['ppl_change_pct']:+.4f} % | "
                  f"max |chunk NLL diff| {r['chunk_nll_diff_max_abs']:.2e} |", flush=True)
            write(args, source, text, ids, chunks, rows)  # after every row: a partial record survives a stop


def write(args, source, text, ids, chunks, rows) -> None:
    if args.out:
        doc = {"command": "python scripts/kv_half_ppl.py " + " ".join(sys.argv[1:]), "model": args.model,
               "shipped_checkpoint": args.shipped, "ctx": args.ctx, "threads": args.threads,
               "protocol": "llama-perplexity's chunks: first ctx/2+1 tokens prefilled, the rest teacher-forced "
                           "through one-token decode steps (every layer run) that read the KV cache",
               "text": {"source": source, "chars": len(text), "sha256": hashlib.sha256(text.encode()).hexdigest()},
               "tokens": {"total": len(ids), "chunks": len(chunks),
                          "scored": len(chunks) * (args.ctx - args.ctx // 2 - 1)},
               "native": native.status(), "native_build": native.build_key(), "rows": rows,
               "complete": all(len(r) == len(args.kv_dtypes.split(",")) for r in rows.values())
               and len(rows) == len(args.formats.split(",")), "provenance": provenance()}
        tmp = Path(args.out).with_suffix(".json.tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(args.out)


if __name__ == "__main__":
    main()
