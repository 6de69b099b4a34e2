"""How fast can this machine run the matrix-vector products of one decode step, and nothing else?

A decode step of a dense decoder at batch 1 is, to first order, one matrix-vector product per weight matrix.
This script times exactly those products, in a decoder's order, over distinct weight tensors of a model's
shapes (so they stream from memory as in decoding, not from cache), for fp32 (``F.linear``) and int8
weight-only (``torch._weight_int8pack_mm`` with bf16 activations, torch's int8 op). No attention, no
norms, no Python per layer beyond the calls: a floor for any eager engine built on these kernels.

``int8-native`` is the engine's int8 path where :mod:`fbs.native` is available: the same int8 weights repacked
for the native kernel (:func:`fbs.native.int8_linear`, fp32 activations). Two other fp32 kernels a CPU build of
torch ships are timed too, to see whether a faster fp32 GEMV exists:
``fp32-mkl-packed`` (``torch.ops.mkl._mkl_linear`` over weights pre-packed once by
``_mkl_reorder_linear_weight`` for batch 1, what inductor's freezing pass emits) and ``fp32-onednn``
(``torch.ops.mkldnn._linear_pointwise`` over oneDNN-layout weights). Neither is bit-identical to ``F.linear``.

    python scripts/gemv_floor.py --model smollm2-135m --threads 2 --out results/gemv_floor.json

Compare the floor with a decoder's measured ms/token (``fbs bench``): what lies above it is everything else
(attention, norms, dispatch); what lies below a target says the target needs faster kernels, not a leaner loop.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fbs import native
from fbs.provenance import provenance


def shapes(cfg) -> list[tuple[str, int, int]]:
    """(name, out, in) of one layer's fused matrices, as the engine holds them (fbs.engine.fused)."""
    d, hd = cfg.hidden_size, cfg.hidden_size // cfg.num_attention_heads
    kv = cfg.num_key_value_heads * hd
    return [("q", d, d), ("kv", 2 * kv, d), ("o", d, d), ("gate_up", 2 * cfg.intermediate_size, d),
            ("down", d, cfg.intermediate_size)]


def build(cfg, fmt: str):
    """Distinct random weights for every layer plus the LM head, in ``fmt``; returns (mats, bytes)."""
    layers, total = [], 0
    for _ in range(cfg.num_hidden_layers):
        mats = []
        for _, out, inp in shapes(cfg):
            mats.append(_weight(out, inp, fmt))
            total += out * inp * (1 if fmt.startswith("int8") else 4)
        layers.append(mats)
    head = _weight(cfg.vocab_size, cfg.hidden_size, fmt)
    total += cfg.vocab_size * cfg.hidden_size * (1 if fmt.startswith("int8") else 4)
    return layers, head, total


FORMATS = ("fp32", "fp32-mkl-packed", "fp32-onednn", "int8", "int8-native")


def _weight(out: int, inp: int, fmt: str):
    w = torch.randn(out, inp) * inp ** -0.5
    if fmt == "fp32":
        return (w,)
    if fmt == "fp32-mkl-packed":
        return (w, torch.ops.mkl._mkl_reorder_linear_weight(w, 1))
    if fmt == "fp32-onednn":
        return (w, w.to_mkldnn())
    scale = w.abs().amax(1).clamp_min(1e-8) / 127
    q, s = torch.round(w / scale[:, None]).to(torch.int8), scale.to(torch.bfloat16)
    if fmt == "int8-native":
        return (native.int8_pack(q), s, inp)
    return (q, s)


def step(layers, head, xs: dict[int, torch.Tensor], fmt: str) -> torch.Tensor:
    """One decode step's matmuls: every layer's matrices in order, then the LM head (``xs``: input by width)."""
    mm = {"fp32": lambda v, w: F.linear(v, w[0]),
          "fp32-mkl-packed": lambda v, w: torch.ops.mkl._mkl_linear(v, w[1], w[0], None, 1),
          "fp32-onednn": lambda v, w: torch.ops.mkldnn._linear_pointwise(v, w[1], None, "none", [], ""),
          "int8": lambda v, w: torch._weight_int8pack_mm(v, *w),
          "int8-native": lambda v, w: native.int8_linear(v, w[0], w[1])}[fmt]
    width = (lambda w: w[2]) if fmt == "int8-native" else (lambda w: w[0].shape[1])  # noqa: E731
    for mats in layers:
        for w in mats:
            mm(xs[width(w)], w)
    return mm(xs[width(head)], head)



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a model name of fbs.model.bases (shapes only)")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30, help="timed steps per format (median reported)")
    ap.add_argument("--out", help="JSON path")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoConfig

    from fbs.model.bases import resolve_base

    cfg = AutoConfig.from_pretrained(resolve_base(args.model))
    rows = []
    for fmt in args.formats.split(","):
        if fmt not in FORMATS:
            raise SystemExit(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}")
        if fmt == "int8-native":
            if native.int8_isa() is None:
                print("int8-native: no native int8 kernel here (FBS_NATIVE=0, no build, or no AVX2): skipped")
                continue
        layers, head, total = build(cfg, fmt)
        dtype = torch.bfloat16 if fmt == "int8" else torch.float32
        xs = {n: torch.randn(1, n, dtype=dtype) for n in (cfg.hidden_size, cfg.intermediate_size)}
        times = []
        with torch.inference_mode():
            for i in range(args.steps + 3):
                t0 = time.perf_counter()
                step(layers, head, xs, fmt)
                if i >= 3:
                    times.append(time.perf_counter() - t0)
        ms = statistics.median(times) * 1e3
        rows.append({"format": fmt, "ms_per_step": ms, "weight_mb": total / 2**20, "gbs": total / (ms / 1e3) / 1e9,
                     "matmuls_per_step": 5 * cfg.num_hidden_layers + 1})
        print(f"{fmt:15s}  {ms:7.2f} ms/step  {total / 2**20:7.1f} MB  {rows[-1]['gbs']:5.1f} GB/s")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"model": args.model, "threads": args.threads, "rows": rows,
                                                "provenance": provenance()}, indent=1))


if __name__ == "__main__":
    main()
