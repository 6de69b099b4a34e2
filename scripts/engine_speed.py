"""Engine speed check for the issue-2 acceptance numbers, with systems interleaved run by run.

The paper-protocol harness (`fbs bench`) times systems one after another; on a shared or drifting
machine that confounds systems with time. Here every repetition runs each system once, in turn, so
drift hits all systems alike; the medians over repetitions are compared.

    .venv/bin/python scripts/engine_speed.py --reps 5 --out bench-results/engine_interleaved.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from fbs import FBSForCausalLM
from fbs.bench.harness import build_prompts
from fbs.provenance import provenance
from fbs.bench.systems import forced_plan
from fbs.model.bases import load_base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", default="bench-results/engine_interleaved.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    hf, tok = load_base("smollm2-135m")
    full = FBSForCausalLM.from_base(hf, tokenizer=tok).eval()
    bare = FBSForCausalLM.from_base(hf, config=full.config.replace(paw_layers=(), ch_layers=()), tokenizer=tok).eval()
    ids = build_prompts(tok, 1, args.prompt_len)  # (1, prompt_len), Python Language Reference text
    n = args.new_tokens
    never = set(full.layers_cfg.never_skip)

    def hf_run():
        t0 = time.perf_counter()
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - t0, None

    def fbs_run(model, **kw):
        def run():
            r = model.generate(ids, max_new_tokens=n, ignore_eos=True, **kw)
            return r.timings["total_s"], r
        return run

    systems = {"hf-generate": hf_run, "engine-bare": fbs_run(bare, force_compute=True),
               "fbs-force-compute": fbs_run(full, force_compute=True), "fbs-gates-tau0.5": fbs_run(full, tau=0.5)}
    for frac in (0.25, 0.5):
        plan = forced_plan(full.num_layers, frac, never)
        pct = round(100 * plan.float().mean().item())
        for pol in ("hole", "project"):
            systems[f"plan{pct}-{pol}"] = fbs_run(full, skip_plan=plan, kv_policy=pol)
    for fn in systems.values():  # warm-up
        fn()
    times = {k: [] for k in systems}
    extra = {}
    for _ in range(args.reps):
        for k, fn in systems.items():
            t, r = fn()
            times[k].append(t)
            if r is not None:
                extra[k] = {"skip_ratio": r.trace.skip_ratio, "tflops_rel": r.trace.tflops_rel,
                            "tflops_rel_exact": r.trace.tflops_rel_exact, "decode_s": r.timings["decode_s"],
                            "prefill_s": r.timings["prefill_s"]}
    base = statistics.median(times["hf-generate"])
    rows = []
    print("| system | median total (s) | speed-up vs HF | skip | TFLOPs(rel) | exact |")
    print("|---|---|---|---|---|---|")
    for k, v in times.items():
        med = statistics.median(v)
        e = extra.get(k, {})
        rows.append({"system": k, "median_total_s": med, "runs": v, **e})
        print(f"| {k} | {med:.2f} | {base / med:.2f} | {100 * e.get('skip_ratio', 0):.0f}% | "
              f"{e.get('tflops_rel', 1.0):.2f} | {e.get('tflops_rel_exact', 1.0):.3f} |")
    with open(args.out, "w") as f:
        json.dump({"threads": torch.get_num_threads(), "prompt_len": args.prompt_len, "new_tokens": n,
                   "reps": args.reps, "rows": rows, "provenance": provenance()}, f, indent=1)


if __name__ == "__main__":
    main()
