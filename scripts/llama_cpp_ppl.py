"""Perplexity of llama.cpp's formats (``llama-perplexity``) next to ours, on the same text, chunks and scored tokens.

``llama-perplexity -f TEXT -c CTX`` tokenizes the whole text with the GGUF's tokenizer, cuts it into
floor(tokens / CTX) chunks of CTX tokens, evaluates each chunk from an empty cache and scores the tokens
CTX/2 + 1 .. CTX - 1 of each (CTX/2 - 1 per chunk) by the logits of the previous position. Ours replays exactly
that: the same text tokenized by the HF tokenizer (the GGUF's vocabulary), the same chunks, the first CTX/2 + 1
tokens of a chunk prefilled and the rest teacher-forced through the engine's one-token step with each weight
format (``block_nll`` of scripts/weights_ppl.py, every layer run). The GGUF of SmolLM2 adds no BOS
(``tokenizer.ggml.add_bos_token`` false), so neither side inserts one.

Whether both sides scored the same tokens is checked, not assumed: the first llama.cpp format also writes its
chunks' token ids (``--kl-divergence-base``, a temporary file of ~25 MB per chunk) and they are compared with ours.

The default text is the OOD held-out blocks of scripts/weights_ppl.py (``fbs.eval.ood``: en, zh, code), decoded
and joined with blank lines and written to a file both tools read; ``--text FILE`` scores any other text.

    python scripts/llama_cpp_ppl.py --per-kind 2 --out results/llama_cpp_ppl.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from weights_ppl import block_nll  # noqa: E402  (the sibling script's teacher-forced scoring)

from fbs.bench.llama_cpp import (formats_for, install_dir, model_path, parse_perplexity, perplexity_command,  # noqa: E402
                                 read_token_dump, run_tool)
from fbs.eval.ood import ood_blocks  # noqa: E402
from fbs.model.loading import load_fbs  # noqa: E402
from fbs.model.lora import merged_lowrank  # noqa: E402
from fbs.provenance import provenance  # noqa: E402


def held_out_text(tokenizer, per_kind: int) -> tuple[str, list[str]]:
    """The OOD blocks of weights_ppl.py as one text (each block decoded, blocks joined by a blank line)."""
    blocks = ood_blocks(tokenizer, limit=per_kind)
    return "\n\n".join(tokenizer.decode(b.input_ids.tolist()) for b in blocks), [b.id for b in blocks]


def held_out_chunks(tokenizer, per_kind: int, ctx: int) -> tuple[str, list[str], list[int], list[list[int]]]:
    """:func:`held_out_text`, its token ids and their chunks of ``ctx`` tokens (llama-perplexity's); exits with a
    message when the text is shorter than one chunk."""
    text, source = held_out_text(tokenizer, per_kind)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    chunks = [ids[i * ctx:(i + 1) * ctx] for i in range(len(ids) // ctx)]
    if not chunks:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than one chunk of {ctx}: raise --per-kind")
    return text, source, ids, chunks


def llama_rows(root: Path, base: str, formats: list[str], text_file: Path, ctx: int, threads: int,
               check_tokens: bool) -> tuple[dict, list[int] | None]:
    """Each format's llama-perplexity result; the scored chunks' token ids from the first format (or None)."""
    rows, dumped = {}, None
    for i, fmt in enumerate(formats):
        model = model_path(root, base, fmt)
        with tempfile.TemporaryDirectory() as tmp:
            dump = Path(tmp) / "chunks.bin" if check_tokens and i == 0 else None
            t0 = time.perf_counter()
            run = run_tool(perplexity_command(root, model, text_file, ctx, threads, dump))
            if run.returncode != 0:
                raise SystemExit(f"llama-perplexity failed on {model}: {run.stderr.strip().splitlines()[-1:]}")
            res = parse_perplexity(run.stdout + "\n" + run.stderr)
            if dump is not None:
                dumped = read_token_dump(dump)[1]
        rows[fmt] = {"ppl": res.ppl, "ppl_err": res.ppl_err, "chunks": res.n_chunks, "scored_tokens": res.scored_tokens,
                     "chunk_nll": res.chunk_nll(), "seconds": time.perf_counter() - t0, "model_file": model.name}
    return rows, dumped


def our_rows(model, ids: list[int], formats: list[str], ctx: int) -> dict:
    """Each weight format's PPL over the chunks llama-perplexity scores (see the module docstring)."""
    chunks = [ids[i * ctx:(i + 1) * ctx] for i in range(len(ids) // ctx)]
    rows = {}
    for fmt in formats:
        t0 = time.perf_counter()
        nll = [block_nll(model, c, fmt, ctx // 2 + 1) for c in chunks]
        rows[fmt] = {"ppl": math.exp(sum(nll) / len(nll)), "chunks": len(chunks),
                     "scored_tokens": len(chunks) * (ctx - ctx // 2 - 1), "chunk_nll": nll,
                     "seconds": time.perf_counter() - t0}
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--llama-formats", default=None,
                    help="llama.cpp formats, comma list (default: the formats the build script makes for --model)")
    ap.add_argument("--formats", default="fp32,bf16,int8", help="our decode weight formats")
    ap.add_argument("--per-kind", type=int, default=2, help="OOD blocks per kind (en, zh, code), as weights_ppl.py")
    ap.add_argument("--text", help="score this UTF-8 text file instead of the OOD blocks")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-token-check", action="store_true", help="skip the comparison of the scored token ids")
    ap.add_argument("--checkpoint", help="score this FBS checkpoint (a directory or a shipped variant, e.g. stage1: "
                                         "its LoRA merged into the backbone) instead of the base; every layer runs")
    ap.add_argument("--shipped", action="store_true",
                    help="score the shipped default FBS checkpoint instead of the base; "
                         "every layer runs either way")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    root = install_dir()
    spec = ",".join(formats_for(args.model)) if args.llama_formats is None else args.llama_formats
    llama_formats = [f for f in spec.split(",") if f]
    missing = [str(model_path(root, args.model, f)) for f in llama_formats if not model_path(root, args.model, f).exists()]
    if not (root / "bin" / "llama-perplexity").exists() or missing:
        raise SystemExit(f"llama.cpp's llama-perplexity or formats are missing in {root} ({', '.join(missing)}): "
                         "run `bash scripts/build_llama_cpp.sh` or set FBS_LLAMA_CPP_DIR")
    torch.set_num_threads(args.threads)
    model = load_fbs(args.model, args.checkpoint, shipped=args.shipped).eval()
    # merged LoRA adapters (a block format keeps their deltas apart where the rows they move are its exact blocks:
    # q4 over SmolLM2's Q4_1 layers)
    lora_apart = sum(merged_lowrank(m) is not None for m in model.base.layers.modules())
    tok = model.tokenizer
    if args.text:
        text, source = Path(args.text).read_text(encoding="utf-8"), [args.text]
    else:
        text, source = held_out_text(tok, args.per_kind)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if len(ids) < 2 * args.ctx:
        raise SystemExit(f"the text has {len(ids)} tokens; llama-perplexity needs at least {2 * args.ctx}: raise "
                         "--per-kind or pass a longer --text")
    with tempfile.TemporaryDirectory() as tmp:
        text_file = Path(tmp) / "heldout.txt"
        text_file.write_text(text, encoding="utf-8")
        llama, dumped = llama_rows(root, args.model, llama_formats, text_file, args.ctx, args.threads,
                                   not args.no_token_check)
    ours = our_rows(model, ids, [f for f in args.formats.split(",") if f], args.ctx)
    n_chunks = len(ids) // args.ctx
    scored = ids[: n_chunks * args.ctx]
    tokens = {"ours_total": len(ids), "ours_chunks": n_chunks,
              "llama_chunks": sorted({r["chunks"] for r in llama.values()}),
              "checked": dumped is not None,
              "chunk_ids_equal": None if dumped is None else dumped == scored,
              "mismatched_ids": None if dumped is None or len(dumped) != len(scored)
              else sum(a != b for a, b in zip(dumped, scored))}

    ref_ours = ours.get("fp32", next(iter(ours.values())))["ppl"]
    ref_llama = llama.get("F16", next(iter(llama.values())))["ppl"] if llama else None
    print(f"{len(ids)} tokens ({'; '.join(source) if args.text else f'{len(source)} OOD blocks'}), ctx {args.ctx}: "
          f"{n_chunks} chunks, {n_chunks * (args.ctx - args.ctx // 2 - 1)} tokens scored; llama.cpp chunks "
          f"{tokens['llama_chunks']}; scored token ids identical: {tokens['chunk_ids_equal']}")
    print("| engine | format | PPL | vs fp32 (ours) / F16 (llama.cpp) | chunks |\n|---|---|---|---|---|")
    for fmt, r in ours.items():
        print(f"| fbs | {fmt} | {r['ppl']:.3f} | {100 * (r['ppl'] / ref_ours - 1):+.2f} % | {r['chunks']} |")
    for fmt, r in llama.items():
        print(f"| llama.cpp | {fmt} | {r['ppl']:.3f} ± {r['ppl_err']:.3f} | {100 * (r['ppl'] / ref_llama - 1):+.2f} % | "
              f"{r['chunks']} |")
    if args.out:
        doc = {"command": "python scripts/llama_cpp_ppl.py " + " ".join(sys.argv[1:]), "ctx": args.ctx,
               "model": args.model, "shipped_checkpoint": args.shipped, "checkpoint": args.checkpoint,
               "lora_deltas_apart_in_block_formats": lora_apart,
               "text": {"source": source, "chars": len(text), "sha256": hashlib.sha256(text.encode()).hexdigest()},
               "tokens": tokens, "ours": ours, "llama_cpp": llama, "llama_cpp_dir": str(root),
               "provenance": provenance()}
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
