"""The ``fbs`` command line. Only this module (and the subcommand modules' cli.py files) print."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys

from .engine.defaults import AUTO, resolve_weights
from .engine.fused import WEIGHTS
from .cli_args import add_model_arguments, load_from_args
from .engine.kvpolicy import add_kv_cache_arguments, kv_cache_options

#: Modules that add their own subcommands through ``register(subparsers)`` (fbs.eval.mechanism: ``fbs analyze``).
SUBCOMMAND_MODULES = ("fbs.data.cli", "fbs.eval.cli", "fbs.eval.mechanism", "fbs.bench.cli", "fbs.train.cli",
                      "fbs.rl.cli", "fbs.serve.cli")


def cmd_info(args) -> int:
    model = load_from_args(args)
    counts = model.param_counts()
    cfg = model.config
    spec = model.base.spec
    rows = [
        ("base model", f"{cfg.base_model} ({spec.model_type}, {spec.num_layers} layers, d={spec.hidden_size})"),
        ("base parameters", f"{counts['base']:,}"),
        ("added parameters", f"{counts['added']:,}  (PAW {counts['added_paw']:,}, CH {counts['added_ch']:,}, "
                             f"SG {counts['added_sg']:,})"),
        ("added fraction", f"{100 * counts['added_fraction']:.3f}%  (budget 1%)"),
        ("PAW layers", str(model.layers_cfg.paw)), ("CH layers", str(model.layers_cfg.ch)),
        ("never-skip layers", str(model.layers_cfg.never_skip)),
        ("tau / KV policy", f"{cfg.tau} / {cfg.kv_policy}"),
    ]
    from .engine.quant import native_kernels

    from .engine.defaults import default_kv_dtype, default_prefill, default_weights

    kernels = native_kernels()
    rows += [(f"weights {fmt}", kernel or "PyTorch ops") for fmt, kernel in kernels.items() if fmt != "fp32-onednn"]
    default = default_weights(kernels)
    rows.append(("default weights", f"{default} (fbs generate / fbs serve without --weights)"))
    rows.append(("default KV cache", f"{default_kv_dtype(default)} (without --kv-dtype)"))
    rows.append(("default prefill", f"{default_prefill(default)} products (without --prefill)"))
    from . import native

    scores = "integer (avx512-vnni)" if native.int8_scores() else "fp32"
    rows.append(("int8 KV scores", f"{scores} (FBS_INT8_SCORES=0: fp32)"))
    if args.json:
        print(json.dumps({**counts, "config": cfg.to_dict(), "native_kernels": kernels, "default_weights": default,
                          "default_kv_dtype": default_kv_dtype(default), "default_prefill": default_prefill(default),
                          "int8_kv_scores": scores}, indent=2))
    else:
        width = max(len(k) for k, _ in rows)
        for k, v in rows:
            print(f"{k:<{width}}  {v}")
    return 0


def _prompt_ids(model, tok, text: str, chat: bool):
    if tok is None:
        raise SystemExit("this model has no tokenizer; pass an HF directory that contains one")
    if chat and getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
    else:
        ids = tok(text)["input_ids"]
    return list(ids)


def cmd_generate(args) -> int:
    import time

    text = args.prompt if args.prompt is not None else sys.stdin.read()
    if not text.strip():
        print("error: empty prompt (pass it as an argument or on stdin)", file=sys.stderr)
        return 2
    model = load_from_args(args)
    tok = model.tokenizer
    ids = _prompt_ids(model, tok, text, not args.no_chat_template)
    weights = resolve_weights(args.weights)
    opts = dict(
        max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens, do_sample=args.do_sample,
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
        stop_strings=args.stop or None, protect_structure=args.protect_structure, validator=args.validator,
        force_compute=args.force_compute, never_skip=tuple(args.never_skip or ()), tokenizer=tok,
        **{k: v for k, v in (("weights", weights), ("compile", args.compile)) if v is not None},
        **kv_cache_options(args, weights or "fp32"),
        **_lossless_options(args, model),
    )
    if args.stream and not args.json:
        from .engine import stream

        printed = ""
        new: list[int] = []
        t0 = time.perf_counter()
        for step in stream(model, [ids], **opts):
            new.extend(step.tokens)
            full = tok.decode(new, skip_special_tokens=True)
            print(full[len(printed):], end="", flush=True)
            printed = full
        print(f"\n[{len(new)} tokens in {time.perf_counter() - t0:.2f} s]")
        return 0
    res = model.generate([ids], **opts)
    new = res.new_tokens[0]
    out_text = tok.decode(new, skip_special_tokens=True)
    decode_tokens = max(len(new) - 1, 0)
    tps = decode_tokens / res.timings["decode_s"] if res.timings["decode_s"] > 0 else float("nan")
    summary = {
        "text": out_text, "new_tokens": len(new), "tokens_per_s": tps, "skip_ratio": res.trace.skip_ratio,
        "tflops_rel": res.trace.tflops_rel, "tflops_rel_exact": res.trace.tflops_rel_exact,
        "prefill_s": res.timings["prefill_s"], "decode_s": res.timings["decode_s"],
        "tau": model.config.tau, "kv_policy": model.config.kv_policy, "fallback": res.trace.fallback[0],
        "weights": opts.get("weights"),
        "kv_cache": args.kv_cache, "kv_budget": args.kv_budget, "kv_dtype": opts.get("kv_dtype", "fp32"),
        "prefill": opts.get("prefill", "fp32"),
    }
    if res.speculative is not None:
        st = res.speculative
        rounds = st.passes - 1  # the prompt's pass verifies nothing
        summary.update(draft=st.drafter, acceptance_rate=st.acceptance_rate, verify_passes=st.passes,
                       mean_accepted_tokens=st.accepted / rounds if rounds > 0 else 0.0,
                       speculative=st.to_dict())
    if args.json:
        if args.trace:
            summary["trace"] = res.trace.to_dict()
        print(json.dumps(summary))
    else:
        print(out_text)
        print(f"[{len(new)} tokens | decode {tps:.1f} tok/s | skip {100 * res.trace.skip_ratio:.1f}% | "
              f"TFLOPs(rel) {res.trace.tflops_rel:.3f} (exact {res.trace.tflops_rel_exact:.3f}) | "
              f"tau {model.config.tau} | kv {model.config.kv_policy} | weights {opts.get('weights')} | "
              f"KV cache {summary['kv_dtype']} | prefill {summary['prefill']}]")
        if res.speculative is not None:
            st = res.speculative
            print(f"[lossless ({st.drafter} draft): acceptance {st.acceptance_rate or 0:.3f} | "
                  f"{st.tokens_per_pass:.2f} tokens per verify pass | draft skip {100 * st.draft_skip_ratio:.1f}%]")
    return 0


def _option_value(text: str):
    """A --draft-option value: an int, a float, true / false, else the text."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _lossless_options(args, model) -> dict:
    """Decode options of ``--draft NAME`` / ``--lossless`` (= ``--draft fbs``) and of the drafts' own options
    (``--draft-path``, ``--draft-option``, ``--draft-layers``, ``--kangaroo``)."""
    if not (args.lossless or args.draft or args.draft_layers or args.kangaroo):
        if args.draft_path or args.draft_option:
            raise ValueError("--draft-path / --draft-option configure a draft: pass --draft NAME")
        return {}
    from . import baselines  # noqa: F401  (registers the drafts that load files: kangaroo, specdec, medusa)
    from .engine.speculative import draft_plan

    opts = {"lossless": True, **{k: v for k, v in (("draft_tokens", args.draft_tokens),
                                                   ("draft_stop", args.draft_stop)) if v is not None}}
    if args.draft:
        options = {}
        for item in args.draft_option or ():
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise ValueError(f"--draft-option takes KEY=VALUE (e.g. ngram=3), got {item!r}")
            options[key.replace("-", "_")] = _option_value(value)
        if args.draft_path:
            options["path"] = args.draft_path
            if args.no_base_check:
                options["check_base"] = False
        opts.update(draft=args.draft, draft_options=options or None)
    if args.draft_layers:
        opts["skip_plan"] = draft_plan(args.draft_layers, model.num_layers)
    if args.kangaroo:
        from .baselines.kangaroo import KangarooAdapter

        opts["draft_adapter"] = KangarooAdapter.load(args.kangaroo, model, check_base=not args.no_base_check)
    return opts


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fbs", description="Fovea-Block-Skip Transformer tools")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress (INFO)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="parameter counts and layer layout of an FBS model")
    add_model_arguments(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("generate", help="generate text with layer skipping")
    p.add_argument("prompt", nargs="?", help="prompt text (default: read stdin)")
    add_model_arguments(p)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--min-new-tokens", type=int, default=0)
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    p.add_argument("--never-skip", type=int, action="append", help="extra layer never skipped (repeatable)")
    p.add_argument("--protect-structure", action="store_true", help="no skipping on structure tokens / open brackets")
    p.add_argument("--validator", choices=("json", "brackets", "python"), help="fallback rerun at tau 0.9 if invalid")
    p.add_argument("--force-compute", action="store_true", help="run every layer (no skipping)")
    p.add_argument("--weights", choices=(AUTO,) + WEIGHTS, default=AUTO,
                   help="decode weights: auto (default: the fastest format within 0.5 %% of fp32's held-out PPL whose "
                        "native kernels run here, else fp32; fbs.engine.defaults), fused fp32 (bit-faithful to HF), bf16, int8 weight-only (native kernels on AVX2 / AVX-512 "
                        "CPUs, built once on first use; FBS_NATIVE=0 uses torch's op), q8 / q4 (GGUF Q8_0 / Q4_1 "
                        "blocks, int8 activations per 32 values; SmolLM2's own Q4_1 weights in q4), fp32 packed for "
                        "oneDNN (CPU; not bit-identical to fp32), or the HF modules as they are; `fbs info` lists "
                        "the kernels each format runs here")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction,
                   help="torch.compile the one-token layer step (default off; the first run compiles for a minute "
                        "or more, later runs reuse the kernels cached under $FBS_CACHE_DIR/inductor)")
    add_kv_cache_arguments(p)
    p.add_argument("--lossless", action="store_true",
                   help="speculative self-drafting: the skipping model drafts, full depth verifies (output = "
                        "--force-compute's; sampling keeps its distribution)")
    p.add_argument("--draft-tokens", type=int,
                   help="lossless: most tokens drafted per verify pass (default: the draft's own: prompt-lookup 12, "
                        "the others 4)")
    p.add_argument("--draft-stop", type=float,
                   help="lossless: stop drafting when the draft's top-1 probability falls below this (default: "
                        "never; the draft length then adapts to the acceptance rate)")
    p.add_argument("--draft-layers", help="lossless with a static draft (Draft&Verify): layers the draft skips, "
                                          "a comma list or the JSON of `fbs train draft-search`")
    p.add_argument("--kangaroo", help="lossless with a Kangaroo draft: adapter directory (`fbs train kangaroo`)")
    p.add_argument("--draft", help="lossless decoding with this draft source: fbs (= --lossless), plan (with "
                                   "--draft-layers), kangaroo, prompt-lookup, lookahead, specdec, medusa "
                                   "(docs/speculative.md)")
    p.add_argument("--draft-path", help="the draft's trained files: `fbs train draft-model` (specdec), `fbs train "
                                        "medusa` (medusa) or `fbs train kangaroo` (kangaroo)")
    p.add_argument("--draft-option", action="append", metavar="KEY=VALUE",
                   help="a draft source's option, repeatable (prompt-lookup: max_ngram, min_ngram, adapt=true|false; "
                        "lookahead: window, ngram, pool)")
    p.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--trace", action="store_true", help="with --json: include the per-step trace")
    p.set_defaults(func=cmd_generate)

    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is None or not name.startswith(e.name):
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
