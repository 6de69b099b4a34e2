"""Where a decode step's time goes: the native layer run, the LM head, the layers outside it, and the Python.

One decoder (one row, a prompt of ``--prompt-len`` tokens, prefilled), then ``--steps`` one-token decode steps
(after ``--warmup``), each followed by the greedy pick, as ``fbs.engine.run`` does. The wall time of every call of
:func:`fbs.native.run_layers` and of the LM head (``FusedOps.head``) is summed, and per layer that runs outside the
native call (an FBS checkpoint's PAW and CH layers: ``Decoder._layer``) its own; the rest of the step is Python
(embedding, RoPE tables, the cache's booking, the trace, the pick). The prompt is seeded random ids, or with
``--prompt-set text`` held-out text (PAW's window then opens: on random ids it predicts k = 0 and skips its
heads). Prints one line per run and writes JSON (with the provenance of the code and machine). Run it from another
tree with ``PYTHONPATH=<tree>/src`` to compare two commits of the engine in one sitting:

    python scripts/step_split.py --prompt-len 2048 --kv-cache streaming --kv-budget 1024 --out split.json
    python scripts/step_split.py --checkpoint stage1 --prompt-set text --prompt-len 512 --steps 300

Run it on an idle machine: it measures speed.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import fbs.engine.fused as fused
from fbs import native
from fbs.bench.prompt_sets import build_prompt_set
from fbs.engine import start
from fbs.engine.decoder import Decoder
from fbs.model.loading import load_fbs
from fbs.provenance import provenance


def split(dec, steps: int, warmup: int) -> dict[str, float]:
    """Milliseconds per step: total, native layer run, LM head, each layer run outside the native call
    (``layer<l>``), and the remaining Python."""
    spent = {"native": 0.0, "head": 0.0}
    real_run, real_head, real_layer = native.run_layers, fused.FusedOps.head, Decoder._layer

    def run_layers(*a, **k):
        t0 = time.perf_counter()
        out = real_run(*a, **k)
        spent["native"] += time.perf_counter() - t0
        return out

    def head(self, x):
        t0 = time.perf_counter()
        out = real_head(self, x)
        spent["head"] += time.perf_counter() - t0
        return out

    def layer(self, l, st):
        t0 = time.perf_counter()
        out = real_layer(self, l, st)
        spent[f"layer{l}"] = spent.get(f"layer{l}", 0.0) + time.perf_counter() - t0
        return out

    native.run_layers, fused.FusedOps.head, Decoder._layer = run_layers, head, layer
    try:
        with torch.inference_mode():
            token, t0 = 1000, 0.0
            for i in range(warmup + steps):
                if i == warmup:
                    spent.clear()
                    spent.update(native=0.0, head=0.0)
                    t0 = time.perf_counter()
                logits = dec.decode_step(i, [token])
                token = dec.pick(logits, [0])[0]
            total = time.perf_counter() - t0
    finally:
        native.run_layers, fused.FusedOps.head, Decoder._layer = real_run, real_head, real_layer
    ms = {k: 1000 * v / steps for k, v in spent.items()}
    ms["step"] = 1000 * total / steps
    ms["python"] = ms["step"] - sum(v for k, v in ms.items() if k != "step")
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--checkpoint", default=None, help="an FBS checkpoint (stage1, frozen-kl or a directory); "
                    "default: the base model through the engine")
    ap.add_argument("--prompt-set", default="random", choices=("random", "text"),
                    help="seeded random ids, or held-out text (fbs.bench's 'text' prompt set)")
    ap.add_argument("--weights", default="q4")
    ap.add_argument("--kv-dtype", default="int8")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--kv-cache", default="full", help="full, streaming, h2o or snapkv")
    ap.add_argument("--kv-budget", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_fbs(args.model, checkpoint=args.checkpoint).eval()
    if args.prompt_set == "text":
        prompt = build_prompt_set("text", model.tokenizer, 1, args.prompt_len).prompts[0]
    else:
        prompt = torch.randint(100, 20000, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    opts = dict(max_new_tokens=args.warmup + args.steps + 1, weights=args.weights, kv_dtype=args.kv_dtype,
                force_compute=True, ignore_eos=True)
    if args.kv_cache != "full":
        opts.update(kv_cache=args.kv_cache, kv_budget=args.kv_budget)
    dec = start(model, [prompt], None, None, opts)
    dec.prefill()
    ms = split(dec, args.steps, args.warmup)
    layers = "".join(f" + {k} {v:.3f}" for k, v in ms.items() if k.startswith("layer"))
    print(f"{args.kv_cache} {args.prompt_len}: step {ms['step']:.3f} ms = native {ms['native']:.3f} + head "
          f"{ms['head']:.3f}{layers} + python {ms['python']:.3f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "ms_per_step": ms, "provenance": provenance()}, f, indent=1)


if __name__ == "__main__":
    main()
