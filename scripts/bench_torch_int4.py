"""PyTorch's own CPU 4-bit product against the engine's block kernels, per weight shape of a model.

What gpt-fast and torchao run on CPU for 4-bit weights is ``aten._weight_int4pack_mm_for_cpu`` (group-wise int4 with
a scale and zero per group, activations in bf16 or fp32). This script times it next to the engine's ``q4_1`` and
``q8_0`` products (:mod:`fbs.native.quant`) and the fp32 ``F.linear``, on the same weights: the Q4_1 blocks of the
model's fp32 weights (for SmolLM2 these are the shipped GGUF's own blocks), written in torch's convention
(w = (q - 8) * scale + zero, so zero = m + 8 d): the two 4-bit products compute with the same weight values.

For each (shape, M rows) it reports the median of ``--rounds`` timings, each the mean of ``--calls`` calls, and the
error of each product against float64 with the fp32 activations (torch's bf16 activations and our int8 activation
blocks both lose precision there). Run it on an idle machine; it prints a table and writes JSON with provenance:

    python scripts/bench_torch_int4.py --model smollm2-135m --threads 2 --out results/bench_torch_int4.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fbs.engine.quant import dequantize_blocks, quantize_blocks
from fbs.native import quant as nq
from fbs.provenance import provenance

GROUP = 32


def shapes(model_name: str) -> dict[str, torch.Tensor]:
    """One weight per distinct (N, K) of the model's first layer, plus the LM head, as fp32 (N, K)."""
    from fbs.model.bases import load_base

    base, _ = load_base(model_name)
    lin = {n: m.weight for n, m in base.model.layers[0].named_modules() if isinstance(m, torch.nn.Linear)}
    lin["lm_head"] = base.get_output_embeddings().weight
    seen, out = set(), {}
    for name, w in lin.items():
        if tuple(w.shape) not in seen:
            seen.add(tuple(w.shape))
            out[name] = w.detach().float().contiguous()
    return out


def torch_int4(w: torch.Tensor, dtype: torch.dtype):
    """(packed, scales_and_zeros) of w's Q4_1 blocks in torch's int4 layout, and the dequantized weight."""
    q, d, m = quantize_blocks(w, "q4_1")
    wq = dequantize_blocks(q, d, m)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    scale = d.float()
    zero = m.float() + 8 * scale
    sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(dtype)  # (K / 32, N, 2)
    return packed, sz, wq


def timed(fn, calls: int, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rows", default="1,4,8", help="activation rows M per product")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, default=Path("results/bench_torch_int4.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if nq.isa() is None:
        raise SystemExit("the engine's block kernels are not available here (fbs.native.status()); nothing to compare")
    rows = []
    g = torch.Generator().manual_seed(0)
    for name, w in shapes(args.model).items():
        n, k = w.shape
        packed, sz, wq = torch_int4(w, torch.bfloat16)
        q4 = nq.pack("q4_1", *quantize_blocks(w, "q4_1"))
        q8 = nq.pack("q8_0", *quantize_blocks(w, "q8_0"))
        for mrows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(mrows, k, generator=g)
            xb = x.to(torch.bfloat16)
            exact = x.double() @ wq.double().T
            systems = {
                "fp32 F.linear": lambda: F.linear(x, wq),
                "torch int4 (bf16 act)": lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, GROUP, sz),
                "fbs q4": lambda: nq.linear(x, q4, "q4_1", n),
                "fbs q8": lambda: nq.linear(x, q8, "q8_0", n),
            }
            rec = {"weight": name, "n": n, "k": k, "rows": mrows}
            for sys_name, fn in systems.items():
                y = fn().double()
                rec[sys_name] = {"us": timed(fn, args.calls, args.rounds) * 1e6,
                                 "rel_err": float((y - exact).norm() / exact.norm()) if sys_name != "fbs q8" else None}
            rows.append(rec)
            print(f"{name:>10} {n:>6}x{k:<5} M={mrows:<2} " + "  ".join(
                f"{s}: {rec[s]['us']:8.1f} us" for s in systems), flush=True)
    record = {"what": "per-product latency, torch's int4 CPU op vs the engine's block kernels", "model": args.model,
              "threads": args.threads, "calls": args.calls, "rounds": args.rounds, "isa": nq.isa(), "rows": rows,
              "provenance": provenance()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
