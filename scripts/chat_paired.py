"""Paired difference of a chat metric between two systems of `fbs eval chat` records (the same prompts): the mean
difference with a 95 % paired bootstrap CI over prompts and its p-value (fbs.eval.stats.paired_bootstrap).

    python scripts/chat_paired.py results/chat_prefill_blocks.json "base, q4 weights, fp16 KV cache, blocks prefill" \
        results/chat_kv_fp16.json "base, q4 weights, fp16 KV cache" --metric rouge_l
"""

from __future__ import annotations

import argparse
import json

from fbs.eval.stats import paired_bootstrap


def items(path: str, name: str) -> dict:
    for s in json.load(open(path))["systems"]:
        if s["name"] == name:
            return {i["id"]: i for i in s["items"]}
    raise SystemExit(f"{path}: no system named {name!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a_path")
    ap.add_argument("a_name")
    ap.add_argument("b_path")
    ap.add_argument("b_name")
    ap.add_argument("--metric", default="rouge_l")
    args = ap.parse_args()
    a, b = items(args.a_path, args.a_name), items(args.b_path, args.b_name)
    ids = sorted(set(a) & set(b))
    if len(ids) != len(a) or len(ids) != len(b):
        raise SystemExit(f"the two systems answered different prompts ({len(a)}, {len(b)}, {len(ids)} shared)")
    r = paired_bootstrap([float(a[i][args.metric]) for i in ids], [float(b[i][args.metric]) for i in ids])
    print(json.dumps({"metric": args.metric, "n": r.n, "a": args.a_name, "b": args.b_name, "delta": r.delta,
                      "ci95": [r.ci_low, r.ci_high], "p_value": r.p_value, "n_resamples": r.n_resamples}, indent=1))


if __name__ == "__main__":
    main()
