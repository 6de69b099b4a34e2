"""Perplexity with the prompt's products in fp32 against bf16, int8 and blocks (``prefill``), per weight format.

The text, chunks and scored tokens are scripts/llama_cpp_ppl.py's (llama-perplexity's protocol): the held-out OOD
blocks joined into one text, cut into chunks of CTX tokens; the first CTX/2 + 1 tokens of a chunk are prefilled
(their K/V are what the prefill's products computed) and the rest teacher-forced through the engine's one-token
step, every layer run; the first scored token is the prefill's own prediction. Per format (KV cache: that format's
default): the PPL with each prefill, the change against the fp32 prefill and the per-chunk NLL (paired).

    python scripts/prefill_ppl.py --formats q4,q8,int8 --prefills fp32,bf16,blocks --out results/prefill_ppl_bf16.json

blocks runs only under the block formats (q4, q8).
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
from fbs.engine.defaults import default_kv_dtype  # noqa: E402
from fbs.model.loading import load_fbs  # noqa: E402
from fbs.provenance import provenance  # noqa: E402

from fbs.engine.defaults import PREFILL  # noqa: E402
from fbs.engine.quant import BLOCK_FORMATS  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--formats", default="q4,q8")
    ap.add_argument("--per-kind", type=int, default=2, help="OOD blocks per kind (en, zh, code), as weights_ppl.py")
    ap.add_argument("--prefills", default=",".join(PREFILL), help="the first is the reference of the changes")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_fbs(args.model).eval()
    tok = model.tokenizer
    text, source, ids, chunks = held_out_chunks(tok, args.per_kind, args.ctx)
    formats = [f for f in args.formats.split(",") if f]
    prefills = [p for p in args.prefills.split(",") if p]
    bad = [p for p in prefills if p not in PREFILL]
    if bad:
        ap.error(f"--prefills: {bad} not among {', '.join(PREFILL)}")
    wanted = {f: [p for p in prefills if p != "blocks" or f in BLOCK_FORMATS] for f in formats}
    rows: dict[str, dict] = {}
    for fmt in formats:
        rows[fmt] = {}
        for pre in wanted[fmt]:
            t0 = time.perf_counter()
            nll = [block_nll(model, c, fmt, args.ctx // 2 + 1, default_kv_dtype(fmt), pre) for c in chunks]
            r = rows[fmt][pre] = {"ppl": math.exp(sum(nll) / len(nll)), "chunk_nll": nll,
                                  "kv_dtype": default_kv_dtype(fmt), "seconds_under_load": time.perf_counter() - t0}
            ref = rows[fmt][wanted[fmt][0]]
            r["ppl_change_pct"] = 100 * (r["ppl"] / ref["ppl"] - 1)
            r["chunk_nll_diff_max_abs"] = max(abs(a - b) for a, b in zip(nll, ref["chunk_nll"]))
            r["reference"] = wanted[fmt][0]
            print(f"| {fmt} | prefill {pre} | PPL {r['ppl']:.4f} | {r['ppl_change_pct']:+.4f} % | "
                  f"max |chunk NLL diff| {r['chunk_nll_diff_max_abs']:.2e} |", flush=True)
            if args.out:  # after every row: a partial record survives a stop
                write(args, source, text, ids, chunks, rows, complete=len(rows) == len(formats)
                      and all(len(v) == len(wanted[f]) for f, v in rows.items()))


def write(args, source, text, ids, chunks, rows, complete: bool) -> None:
    doc = {"command": "python scripts/prefill_ppl.py " + " ".join(sys.argv[1:]), "model": args.model,
           "ctx": args.ctx, "threads": args.threads,
           "protocol": "llama-perplexity's chunks: first ctx/2+1 tokens prefilled (fp32, bf16, int8 or block products), the rest "
                       "teacher-forced through one-token decode steps (every layer run) that read the KV cache",
           "text": {"source": source, "chars": len(text), "sha256": hashlib.sha256(text.encode()).hexdigest()},
           "tokens": {"total": len(ids), "chunks": len(chunks), "scored": len(chunks) * (args.ctx - args.ctx // 2 - 1)},
           "native": native.status(), "native_build": native.build_key(), "rows": rows, "complete": complete,
           "provenance": provenance()}
    tmp = Path(args.out).with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(args.out)


if __name__ == "__main__":
    main()
