"""``fbs bench``: the paper-protocol speed benchmark (appendix B.3-B.5, E.8, F.2).

:func:`register` adds the command to the top-level ``fbs`` parser; :func:`cmd_bench` is a plain function of
the parsed arguments returning an exit code. Only this module prints. Standalone: ``python -m fbs.bench``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from fbs.bench.prompt_sets import PROMPT_SETS
from fbs.engine.fused import WEIGHTS
from fbs.engine.kvpolicy import add_prefill_chunk_argument

#: ``--compile`` values -> RunSpec.compile
COMPILE_MODES = {"off": False, "on": True, "both": (False, True)}


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _strs(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def cmd_bench(args: argparse.Namespace) -> int:
    from fbs.bench.harness import BenchConfig
    from fbs.bench.runner import RunSpec, check_prompt_set, run, write_outputs

    warmup, runs = (args.warmup, args.runs)
    if args.quick:  # a prompt set: each prompt once (its runs must time every prompt equally often)
        warmup, runs = 1, (3 if args.prompt_set == "text" else args.num_prompts)
    try:
        bench = BenchConfig(prompt_len=args.prompt_len, new_tokens=args.new_tokens, warmup=warmup, runs=runs,
                            num_prompts=args.num_prompts, threads=args.threads, interleave=args.interleave,
                            prompt_set=args.prompt_set, prompt_seed=args.prompt_seed)
        spec = RunSpec(base=args.model, checkpoint=args.checkpoint, fresh=args.fresh, systems=args.systems,
                       taus=args.taus, plans=args.plans, early_exit_layer=args.early_exit_layer,
                       num_assistant_tokens=args.num_assistant_tokens, prompt_lookup_tokens=args.prompt_lookup_tokens,
                       draft=args.draft, draft_runs=args.draft_runs, batch_sizes=args.batch_sizes,
                       long_context=args.long_lengths if args.long_context else (),
                       long_warmup=args.long_warmup, long_runs=args.long_runs, device=args.device,
                       weights=args.weights, compile=COMPILE_MODES[args.compile], batch_policies=args.batch_policies,
                       ffn_skip_thresholds=args.ffn_skip_thresholds, flexidepth=args.flexidepth,
                       flexidepth_taus=args.flexidepth_taus,
                       draft_tokens=args.draft_tokens, native_trees=args.native_trees, draft_layers=args.draft_layers,
                       llama_kv_types=args.llama_kv_types,
                       kangaroo=args.kangaroo,
                       lossless_taus=args.lossless_taus, kv_caches=args.kv_caches, kv_budget=args.kv_budget,
                       prefill_chunk=args.prefill_chunk,
                       kv_dtypes=args.kv_dtypes, prefills=args.prefills,
                       group_a_paths={"specdec": args.specdec, "medusa": args.medusa, "eagle": args.eagle})
        check_prompt_set(bench, spec)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    command = " ".join(shlex.quote(a) for a in sys.argv)
    doc = run(spec, bench, command=command, progress=True)
    paths = write_outputs(doc, Path(args.out_dir))
    print(Path(paths["markdown"]).read_text())
    for kind, path in paths.items():
        print(f"{kind}: {path if path is not None else 'not written (matplotlib missing)'}")
    failed = [r["system"] for r in doc["results"] if r["status"] == "failed"]
    if failed:
        print(f"failed systems: {', '.join(failed)} (see the JSON notes)", file=sys.stderr)
        return 1
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    from fbs.bench.harness import BenchConfig
    from fbs.bench.runner import ALIASES, GROUPS, RunSpec

    d, s = BenchConfig(), RunSpec()
    aliases = "; ".join(f"{a} = {','.join(g)}" for a, g in ALIASES.items())
    p.add_argument("--model", default=s.base, help="base model: bundled name or HF directory")
    p.add_argument("--checkpoint", help="FBS checkpoint directory (default: the weights shipped for --model)")
    p.add_argument("--fresh", action="store_true", help="untrained FBS modules even if weights are shipped")
    p.add_argument("--systems", type=_strs, default=s.systems,
                   help=f"comma list from: all, {', '.join(GROUPS)}, or the aliases {aliases} (default: all)")
    p.add_argument("--prompt-set", choices=PROMPT_SETS, default=d.prompt_set,
                   help="text: windows of exactly --prompt-len tokens of the Python reference text (the paper's "
                        "protocol, default); chat: held-out Alpaca prompts; code: code edits of MBPP/HumanEval "
                        "functions; summarise: a SciQ passage + 'Summarise the text above' (the last three under the "
                        "chat template, of different lengths, batch size 1; docs/bench.md)")
    p.add_argument("--prompt-len", type=int, default=d.prompt_len,
                   help="prompt tokens (text); the most tokens a prompt may have (chat, code, summarise: longer items "
                        "are skipped, never cut; summarise keeps passages of at least half of it)")
    p.add_argument("--prompt-seed", type=int, default=d.prompt_seed,
                   help="seed of the order in which a prompt set's items are chosen (not used by text)")
    p.add_argument("--new-tokens", type=int, default=d.new_tokens, help="exactly this many (EOS ignored)")
    p.add_argument("--batch-sizes", type=_ints, default=s.batch_sizes, help="comma list, e.g. 1,4,8")
    p.add_argument("--warmup", type=int, default=d.warmup, help="discarded runs per system (paper: 20)")
    p.add_argument("--runs", type=int, default=d.runs, help="measured runs per system (paper: 50)")
    p.add_argument("--quick", action="store_true",
                   help="1 warm-up and 3 measured runs, or one per prompt of a --prompt-set (development only)")
    p.add_argument("--interleave", action="store_true",
                   help="run the systems round by round (each warm-up/measured round runs every system once) so "
                        "machine drift hits all alike; default: one system after another, as in the paper")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts,
                   help="distinct prompts (runs cycle; with --prompt-set, --runs must be a multiple of it)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--device", default=s.device, help="cpu or cuda (timing syncs the device around each run)")
    p.add_argument("--taus", type=_floats, default=s.taus, help="FBS tau sweep, comma list")
    p.add_argument("--plans", type=_floats, default=s.plans, help="forced static plans: skipped-layer fractions")
    p.add_argument("--weights", type=_strs, default=s.weights,
                   help=f"decode weight formats of the FBS systems, comma list from {', '.join(WEIGHTS)} (hf: the "
                        "HF modules); each FBS system runs once per format (default: fp32)")
    p.add_argument("--compile", nargs="?", const="on", default="on" if s.compile is True else "off",
                   choices=("off", "on", "both"),
                   help="torch.compile the engine's one-token layer step: on (also plain --compile), off, or both "
                        "(every FBS system eager and compiled, side by side; compiled rows end in -compiled) "
                        "(default: off)")
    p.add_argument("--no-compile", dest="compile", action="store_const", const="off", help="same as --compile off")
    p.add_argument("--batch-policies", type=_strs, default=s.batch_policies,
                   help="engine batch policies of the FBS systems, comma list from gather, all, majority; each "
                        "FBS system runs once per policy (default: gather)")
    p.add_argument("--ffn-skip-thresholds", type=_floats, default=s.ffn_skip_thresholds,
                   help="FFN-SkipLLM cosine-saturation thresholds, comma list: one system each (fbs.baselines)")
    p.add_argument("--flexidepth", help="FlexiDepth checkpoint directory (output of `fbs train flexidepth`)")
    p.add_argument("--flexidepth-taus", type=_floats, default=s.flexidepth_taus,
                   help="FlexiDepth router thresholds, comma list: one system each (default: the checkpoint's tau)")
    p.add_argument("--draft-tokens", type=int,
                   help="lossless and Group A systems: most tokens drafted per verify pass (default: each draft's own: "
                        "draft-prompt-lookup 12, the others 4)")
    p.add_argument("--llama-kv-type", dest="llama_kv_types", type=_strs, default=s.llama_kv_types,
                   help="llama.cpp systems: KV cache types, comma list from f16 (its default), q8_0 (with flash "
                        "attention; -kvq8_0 in the name): each llama.cpp system once per type")
    p.add_argument("--native-trees", action="store_true",
                   help="Group A systems: each also once as <name>-trees, verifying whole token trees in the native "
                        "multi-token steps (the plain rows verify each tree's chain of first children there)")
    p.add_argument("--draft-layers", help="draft-verify: the skip set JSON of `fbs train draft-search` (or 3,5,7)")
    p.add_argument("--kangaroo", help="kangaroo: adapter directory of `fbs train kangaroo`")
    p.add_argument("--specdec", help="specdec (Group A): the draft model of `fbs train draft-model`")
    p.add_argument("--medusa", help="medusa (Group A): heads of `fbs train medusa` (default: the shipped ones)")
    p.add_argument("--eagle", help="eagle (Group A): the layer of `fbs train eagle` (default: the shipped one)")
    p.add_argument("--lossless-taus", type=_floats, default=s.lossless_taus,
                   help="fbs-lossless: one more row per draft tau, comma list (acceptance against skip share)")
    p.add_argument("--early-exit-layer", type=int, help="HF self-speculative draft depth (default: half)")
    p.add_argument("--num-assistant-tokens", type=int, default=s.num_assistant_tokens)
    p.add_argument("--prompt-lookup-tokens", type=int, default=s.prompt_lookup_tokens)
    p.add_argument("--draft", help="draft model for assisted generation (bundled name or HF directory)")
    p.add_argument("--draft-runs", type=int,
                   help="reduced budget for the slow draft-model system: no warm-up (its probe run warms it), "
                        "this many measured runs, match rates over the first this-many prompts "
                        "(default: the same protocol as every system)")
    p.add_argument("--long-context", action="store_true", help="also run the long-context pass (appendix F.2)")
    p.add_argument("--long-lengths", type=_ints, default=(8192, 16384),
                   help="long prompt lengths, clipped to the model's positions (default 8192,16384)")
    p.add_argument("--long-warmup", type=int, default=s.long_warmup)
    p.add_argument("--long-runs", type=int, default=s.long_runs)
    p.add_argument("--kv-cache", dest="kv_caches", type=_strs, default=s.kv_caches,
                   help="KV cache policies of the FBS systems, comma list from full, streaming, h2o, snapkv (each "
                        "system once per policy; lossless systems keep the full cache)")
    p.add_argument("--kv-budget", type=int, default=s.kv_budget,
                   help="entries a --kv-cache policy keeps per layer and KV head")
    add_prefill_chunk_argument(p)
    p.add_argument("--kv-dtype", dest="kv_dtypes", type=_strs, default=s.kv_dtypes,
                   help="KV cache storage of the FBS systems, comma list from auto, fp32, fp16, bf16, int8 (each "
                        "system once per dtype; half precision halves the cache's bytes, int8 (codes and a scale per "
                        "entry) about quarters them; attention accumulates in fp32; "
                        "auto (default): int8 under q4, q8, int8 weights, else fp32)")
    p.add_argument("--prefill", dest="prefills", type=_strs, default=s.prefills,
                   help="how the FBS systems run a prompt's products, comma list from auto, fp32, bf16, int8, blocks (each "
                        "system once per choice; blocks: the q4 / q8 decode kernels, activations per 32 values; int8: "
                        "int8 weights per channel x int8 activations per token, an int8 GEMM; auto (default): each "
                        "weight format's default, fbs.engine.defaults.default_prefill)")
    p.add_argument("--out-dir", default="bench-results", help="where bench.json, bench.md, bench.png go")


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="paper-protocol speed benchmark: HF baselines vs the FBS engine",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=cmd_bench)
    # `fbs bench serve ...`: the load test of `fbs serve` (docs/serve.md); plain `fbs bench` stays the engine benchmark
    from fbs.bench.serve_load import register as register_serve_load

    sub = p.add_subparsers(dest="bench_command", metavar="{serve,recompute}",
                           help="serve: load test of fbs serve; recompute: a saved bench.json's comparisons again "
                                "(their own options follow them)")
    register_serve_load(sub)
    r = sub.add_parser("recompute", help="recompute a saved bench.json's comparisons (paired savings, ratios)",
                       description="Read a bench.json, compute the comparisons between its rows again from the saved "
                                   "runs with this version's code (skip_saving incl. paired CIs, decode_vs_ref_paired), "
                                   "and write bench.{json,md,png} to --out-dir. Timings are never re-measured.")
    r.add_argument("bench_json", help="a bench.json written by `fbs bench`")
    r.add_argument("--out-dir", required=True, help="where the recomputed bench.{json,md,png} go")
    r.set_defaults(func=cmd_bench_recompute)


def cmd_bench_recompute(args: argparse.Namespace) -> int:
    import json

    from fbs.bench.runner import recompute_comparisons, write_outputs

    path = Path(args.bench_json)
    try:
        doc = recompute_comparisons(json.loads(path.read_text()))
    except FileNotFoundError:
        print(f"error: {path} does not exist; pass the bench.json of an `fbs bench --out-dir` directory", file=sys.stderr)
        return 2
    except (json.JSONDecodeError, ValueError, KeyError) as e:
        print(f"error: {path} is not a benchmark document of this version: {e}", file=sys.stderr)
        return 2
    paths = write_outputs(doc, Path(args.out_dir))
    print(Path(paths["markdown"]).read_text())
    print(f"json: {paths['json']}")
    return 0
