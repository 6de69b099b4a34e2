"""Cost of the engine's multi-token native steps against its one-token step, per weight format.

Two questions decide whether verification (speculative decoding) and batching can pay on this engine:

* **verification**: a full-depth pass over T new positions of one sequence (what a verifier runs for T - 1
  drafts, :func:`fbs.engine.fused.full_depth` with ``native_many``), against the one-token step;
* **batch**: one full-depth decode step of B rows against B = 1 (tokens per second).

Both at full depth (no skipping), after a prompt of ``--context`` tokens, on the default model. A format may name
its KV cache storage (``q4:int8``; otherwise ``--kv-dtype``), so cache dtypes are compared in one run. Each round times
every (format, shape) once, in a shuffled order, each the median of ``--reps`` calls; the cache is rolled back
after each call, so every call sees the same context. Ratios are per round (paired), reported as the median over
rounds with a seeded bootstrap CI. Prints a table and writes JSON (with the provenance of the code and machine).

``--llama-formats Q4_0,Q4_1,Q8_0`` times llama.cpp's own multi-token pass in the same rounds (one more job of the
shuffled order per format): ``llama-bench -p 1,T.. -n 0 -d <context>``, T new positions of one sequence after
``--context`` of depth, the analog of our verification pass; its ratio is the T-position pass over the 1-position
pass of the same call. ``--llama-batch`` also times its batched decoding, one more job per format:
``llama-batched-bench -npp <context> -ntg <--llama-batch-tokens> -npl 1,B..`` (each sequence its own prompt), seconds
per step of B tokens; its ratio is tokens/s at B over B = 1's in the same call. They need
``scripts/build_llama_cpp.sh``'s build.

    .venv/bin/python scripts/bench_multitoken.py --formats int8,q4 --rounds 5 --out results/bench_multitoken.json
    .venv/bin/python scripts/bench_multitoken.py --formats q4:int8 --verify 1,4,8 --batch 1,8 \
        --llama-formats Q4_0,Q4_1,Q8_0 --llama-batch --out results/bench_multitoken_llama.json

Run it on an idle machine: it measures speed.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from fbs.bench import llama_cpp
from fbs.engine import start
from fbs.engine.fused import full_depth
from fbs.model.loading import load_fbs
from fbs.provenance import provenance


def _decoder(model, fmt: str, rows: int, context: int, kv_dtype: str = "auto"):
    """A prefilled decoder of ``rows`` prompts; ``fmt`` is a weight format, or ``format:kv_dtype``."""
    fmt, _, own = fmt.partition(":")
    kv_dtype = own or kv_dtype
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 20000, (context,), generator=g).tolist() for _ in range(rows)]
    dec = start(model, prompts, None, None, dict(max_new_tokens=64, weights=fmt, force_compute=True,
                                                 ignore_eos=True, kv_dtype=kv_dtype))
    dec.prefill()
    return dec


def _timed(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_verify(dec, t: int, reps: int) -> float:
    """Seconds of one full-depth pass over t new positions of row 0 (the cache rolled back after each)."""
    m, ops = dec.m, dec.ops
    p = len(dec.prompts[0])
    pos = [[p + j for j in range(t)]]
    ids = torch.randint(100, 20000, (1, t), generator=torch.Generator().manual_seed(t))

    def one():
        with torch.inference_mode():
            x = ops.embed(ids)
            cos, sin = ops.rope(x, torch.tensor(pos))
            ctx = dec.context([0], pos, cos, sin)
            ctx.native_many = True
            ops.head(full_depth(m, ops, x, ctx, range(dec.L)))
        dec.cache.crop([0], [p])

    one()
    return _timed(one, reps)


def time_step(dec, reps: int) -> float:
    """Seconds of one full-depth decode step of every row (the cache rolled back after each)."""
    rows = list(range(dec.B))
    keep = [len(dec.prompts[r]) for r in rows]

    def one():
        with torch.inference_mode():
            dec.decode_step(0, [1000 + r for r in rows])
        dec.cache.crop(rows, keep)

    one()
    return _timed(one, reps)


def time_llama(binary, model_file, positions: list[int], context: int, threads: int, reps: int,
               kv_type: str) -> dict[int, float]:
    """Seconds of llama.cpp's pass over n new positions of one sequence after ``context`` (llama-bench's pp n at
    depth ``context``, the median of its ``reps`` samples), for each n in ``positions``."""
    cmd = [str(binary), "-m", str(model_file), "-p", ",".join(map(str, positions)), "-n", "0", "-d", str(context),
           "-t", str(threads), "-r", str(reps), "-o", "json"]
    if kv_type != "f16":
        cmd += ["-ctk", kv_type, "-ctv", kv_type, "-fa", "1"]
    run = llama_cpp.run_tool(cmd)
    if run.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({run.returncode}): {run.stderr.strip()[-500:]}")
    return {t.n_prompt: statistics.median(t.samples_ns) / 1e9 for t in llama_cpp.parse_bench_json(run.stdout)}


def time_llama_batch(binary, model_file, batches: list[int], context: int, tokens: int, threads: int,
                     kv_type: str) -> dict[int, float]:
    """Seconds of one llama.cpp decode step of B sequences (one token each) after ``context`` tokens of their own,
    for each B in ``batches`` (llama-batched-bench over ``tokens`` steps)."""
    run = llama_cpp.run_tool(llama_cpp.batched_command(binary, model_file, context, tokens, sorted(set(batches) | {1}),
                                                       threads, kv_type))
    if run.returncode != 0:
        raise RuntimeError(f"llama-batched-bench failed ({run.returncode}): {run.stderr.strip()[-500:]}")
    return llama_cpp.parse_batched_jsonl(run.stdout + "\n" + run.stderr)


def bootstrap(values: list[float], seed: int = 0, n: int = 2000) -> tuple[float, float]:
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--formats", default="int8,q4", help="weight formats, each optionally with its KV cache storage "
                    "(q4:int8)")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--verify", default="1,2,4,8", help="positions per verification pass (1 = the one-token pass)")
    ap.add_argument("--batch", default="1,4,8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-dtype", default="auto", help="the KV cache storage (auto: each format's default, fp16 for "
                    "the quantized formats; fp32 as in the records before s17)")
    ap.add_argument("--llama-formats", default="", help="llama.cpp formats timed in the same rounds (Q4_0,Q4_1,...; "
                    "empty: none)")
    ap.add_argument("--llama-kv-type", default="f16", choices=llama_cpp.KV_TYPES,
                    help="llama.cpp's KV cache type (q8_0 with flash attention)")
    ap.add_argument("--llama-batch", action="store_true", help="also time llama.cpp's batched decoding of the "
                    "--batch sizes (llama-batched-bench) for each --llama-formats format")
    ap.add_argument("--llama-batch-tokens", type=int, default=32, help="decode steps per llama-batched-bench call")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_fbs(args.model).eval()
    fmts = args.formats.split(",")
    verify = [int(t) for t in args.verify.split(",")]
    batch = [int(b) for b in args.batch.split(",")]
    decs = {(f, b): _decoder(model, f, b, args.context, args.kv_dtype) for f in fmts for b in sorted(set(batch) | {1})}
    jobs = [("verify", f, t) for f in fmts for t in verify] + [("batch", f, b) for f in fmts for b in batch]
    llama = [f.strip() for f in args.llama_formats.split(",") if f.strip()]
    if llama:
        root = llama_cpp.install_dir()
        binary, batched = root / "bin" / "llama-bench", root / "bin" / "llama-batched-bench"
        files = {f: llama_cpp.model_path(root, args.model, f) for f in llama}
        missing = [str(p) for p in [binary, *files.values()] + ([batched] if args.llama_batch else []) if not p.exists()]
        if missing:
            raise SystemExit(f"llama.cpp reference: {', '.join(missing)} not found; {llama_cpp.BUILD_HINT}")
        jobs += [("llama", f, 0) for f in llama] + [("llama-batched", f, 0) for f in llama if args.llama_batch]
    elif args.llama_batch:
        raise SystemExit("--llama-batch times the --llama-formats formats: name at least one (e.g. Q4_0)")
    rounds: list[dict] = []
    rng = random.Random(1)
    for r in range(args.rounds):
        order = jobs[:]
        rng.shuffle(order)
        got = {}
        for kind, f, n in order:
            if kind == "llama":  # one llama-bench call times every n of the format
                for t, sec in time_llama(binary, files[f], verify, args.context, args.threads, args.reps,
                                         args.llama_kv_type).items():
                    got[("llama-verify", f, t)] = sec
                continue
            if kind == "llama-batched":  # one llama-batched-bench call times every B of the format
                for b, sec in time_llama_batch(batched, files[f], batch, args.context, args.llama_batch_tokens,
                                               args.threads, args.llama_kv_type).items():
                    got[("llama-batch", f, b)] = sec
                continue
            got[(kind, f, n)] = (time_verify(decs[(f, 1)], n, args.reps) if kind == "verify"
                                 else time_step(decs[(f, n)], args.reps))
        rounds.append(got)
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    rows = []
    llama_rows = [("llama-verify", f, t) for f in llama for t in verify]
    if args.llama_batch:
        llama_rows += [("llama-batch", f, b) for f in llama for b in batch]
    for kind, f, n in [j for j in jobs if not j[0].startswith("llama")] + llama_rows:
        secs = [rd[(kind, f, n)] for rd in rounds]
        base = [rd[(kind, f, 1)] for rd in rounds] if (kind, f, 1) in rounds[0] else None
        row = {"kind": kind, "format": f, "n": n, "ms": 1000 * statistics.median(secs),
               "ms_rounds": [1000 * s for s in secs]}
        if base is not None:
            # verify: cost of the n-position pass over the 1-position pass; batch: tokens/s over B = 1's
            ratio = ([n * b / s for s, b in zip(secs, base)] if kind in ("batch", "llama-batch")
                     else [s / b for s, b in zip(secs, base)])
            row["ratio"] = statistics.median(ratio)
            row["ratio_ci95"] = bootstrap(ratio)
        rows.append(row)
    print(f"\n{args.model}, context {args.context}, KV cache {args.kv_dtype}, {args.threads} threads, {args.rounds} "
          f"rounds x median of {args.reps}")
    print("| what | format | n | ms | ratio [95% CI] |\n|---|---|---|---|---|")
    for row in rows:
        what = {"verify": "verify pass, n positions (cost / 1-position pass)",
                "batch": "decode step, batch n (tokens/s / B=1)",
                "llama-verify": f"llama.cpp pp n @ d{args.context}, KV {args.llama_kv_type} (cost / pp 1)",
                "llama-batch": f"llama.cpp batch n after {args.context}, KV {args.llama_kv_type} (tokens/s / B=1)",
                }[row["kind"]]
        ci = row.get("ratio_ci95")
        ratio = "" if ci is None else f"{row['ratio']:.2f} [{ci[0]:.2f}, {ci[1]:.2f}]"
        print(f"| {what} | {row['format']} | {row['n']} | {row['ms']:.1f} | {ratio} |")
    if args.out:
        doc = {"command": "python scripts/bench_multitoken.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
            "model": args.model, "context": args.context, "kv_dtype": args.kv_dtype, "threads": args.threads,
            "rounds": args.rounds,
            "reps": args.reps, "rows": rows, "provenance": provenance()}
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
