"""Perplexity of each decode weight format, teacher-forced through the engine's one-token step.

Issue 13 asks for the PPL change of the int8 and bf16 decode weights against fp32 on held-out text. The
engine only decodes, so this drives it token by token: the first ``--gate-from`` tokens of a block are the
prompt (prefilled with the HF modules, as in generation), then each true next token is fed as if it had been
generated and scored by the logits of the previous decode step. Every layer runs (``force_compute``), on the
base model (fresh FBS modules), so the only difference between rows is the weight format.

    python scripts/weights_ppl.py --per-kind 2 --formats fp32,bf16,int8 --out results/weights_ppl.json
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from fbs.engine import start
from fbs.eval.ood import ood_blocks
from fbs.model.loading import load_fbs
from fbs.provenance import provenance


def block_nll(model, ids: list[int], weights: str, gate_from: int, kv_dtype: str = "fp32",
              prefill: str = "fp32", smooth_keys: bool = True) -> float:
    """Mean NLL of ids[gate_from:] under the engine with ``weights`` (the KV cache stored as ``kv_dtype``, the
    prompt's products as ``prefill``; ``smooth_keys``: an int8 cache's key factors, DecodeOptions.kv_smooth_keys)."""
    n = len(ids) - gate_from
    dec = start(model, [ids[:gate_from]], None, None,
                 dict(max_new_tokens=n, weights=weights, force_compute=True, ignore_eos=True, kv_dtype=kv_dtype,
                      prefill=prefill, kv_smooth_keys=smooth_keys))
    total = 0.0
    with torch.inference_mode():
        logits = torch.stack(dec.prefill())  # (1, V): the prediction of token gate_from
        for step, tok in enumerate(ids[gate_from:]):
            total -= float(torch.log_softmax(logits.float(), -1)[0, tok])
            if step + 1 < n:
                logits = dec.decode_step(step, [tok])
    return total / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--formats", default="fp32,bf16,int8")
    ap.add_argument("--per-kind", type=int, default=2, help="OOD blocks per kind (en, zh, code)")
    ap.add_argument("--gate-from", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_fbs(args.model, shipped=False).eval()
    blocks = ood_blocks(model.tokenizer, limit=args.per_kind)
    rows = {}
    for fmt in args.formats.split(","):
        t0 = time.perf_counter()
        nlls = [block_nll(model, b.input_ids.tolist(), fmt, args.gate_from) for b in blocks]
        rows[fmt] = {"ppl": math.exp(sum(nlls) / len(nlls)), "block_nll": nlls, "seconds": time.perf_counter() - t0}
    ref = rows.get("fp32", next(iter(rows.values())))["ppl"]
    print(f"{len(blocks)} OOD blocks ({args.per_kind} per kind), tokens {args.gate_from}.. scored")
    print("| weights | PPL | vs fp32 |\n|---|---|---|")
    for fmt, r in rows.items():
        print(f"| {fmt} | {r['ppl']:.3f} | {100 * (r['ppl'] / ref - 1):+.2f} % |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python scripts/weights_ppl.py " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out" and v is not None),
                "blocks": [b.id for b in blocks], "rows": rows, "provenance": provenance()}, f, indent=1)


if __name__ == "__main__":
    main()
