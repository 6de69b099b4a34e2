"""``fbs eval``: quality evaluation of a base model or an FBS model, reports and comparisons.

    fbs eval run --system base --tasks ppl_c4,mmlu --limit 100 --out results/base.json
    fbs eval run --system fbs --tau 0.7 --kv-policy project --out results/fbs.json
    fbs eval compare results/fbs.json results/base.json [--bh]
    fbs eval table results/base.json results/fbs.json
    fbs eval make-tasks --out-dir ~/.cache/fbs/eval/lm_eval_tasks
    fbs eval list

Only this module prints; the handlers are plain functions returning an exit code.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

logger = logging.getLogger(__name__)


def build_system(args):
    """The System named by ``--system``: ``base`` (HF model) or ``fbs`` (FBSForCausalLM)."""
    from fbs.eval.systems import FBSSystem, HFSystem

    kw = {"max_length": args.max_length, "max_batch_tokens": args.max_batch_tokens}
    if args.system == "base":
        from fbs.models import load_base

        model, tok = load_base(args.model)
        return HFSystem(model, tok, name=args.name or f"{args.model} (base)", **kw)
    from fbs.loading import load_from_args
    from fbs.models import load_tokenizer

    model = load_from_args(args)
    tok = getattr(model, "tokenizer", None) or load_tokenizer(args.model)
    name = args.name or f"FBS {args.model} (tau={args.tau if args.tau is not None else model.config.tau}, "\
                        f"kv={args.kv_policy or model.config.kv_policy}, gates={args.gate_mode})"
    return FBSSystem(model, tok, tau=args.tau, kv_policy=args.kv_policy, gate_mode=args.gate_mode, name=name, **kw)


def cmd_run(args) -> int:
    from fbs.eval.report import (load_record, make_record, markdown_table, runtime_info, save_record,
                                 seed_everything)
    from fbs.eval.tasks import DEFAULT_TASKS, TASKS, run_task

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    seed_everything(args.seed)
    tasks = args.tasks.split(",") if args.tasks else list(DEFAULT_TASKS)
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown tasks {unknown}; run `fbs eval list`")
    system = build_system(args)
    limits = _parse_limits(args.limit, tasks)
    start = time.perf_counter()
    results = {}
    out = Path(args.out)
    if args.append and out.is_file():
        previous = load_record(out)
        if previous["system"].get("name") != system.name:
            raise ValueError(f"--append: {out} holds results of {previous['system'].get('name')!r}, not {system.name!r}")
        results = {k: v for k, v in previous["tasks"].items() if k not in tasks}
    for name in tasks:
        res = run_task(system, name, limit=limits.get(name), seed=args.seed, progress=not args.no_progress)
        results[name] = res
        m = res.metrics[res.primary]
        print(f"{name:>14}  {res.primary}={m.value:.4f}  CI95=[{m.ci95[0]:.4f}, {m.ci95[1]:.4f}]  "
              f"n={res.n}/{res.n_total}  {res.seconds:.0f}s", flush=True)
        record = make_record(system.describe(), results, args.seed, args.limit, time.perf_counter() - start,
                             runtime_info(args.seed))
        save_record(record, out)  # after every task, so a long run keeps what it has
    md = out.with_suffix(".md")
    md.write_text(f"# {system.name}\n\n" + markdown_table([load_record(out)], [system.name]))
    print(f"wrote {out} and {md} ({time.perf_counter() - start:.0f}s)")
    return 0


def _parse_limits(spec: str | None, tasks: list[str]) -> dict[str, int]:
    """``--limit 50`` (every task) or ``--limit mmlu=200,gsm8k=20,default=50``."""
    if not spec:
        return {}
    if "=" not in spec:
        return {t: int(spec) for t in tasks}
    pairs = dict(kv.split("=") for kv in spec.split(","))
    default = pairs.pop("default", None)
    return {t: int(pairs.get(t, default)) for t in tasks if pairs.get(t, default) is not None}


def cmd_compare(args) -> int:
    from fbs.eval.report import compare_records, comparison_table, load_record

    a, b = load_record(args.a), load_record(args.b)
    comps = compare_records(a, b, metrics="all" if args.all_metrics else "primary", seed=args.seed, bh=args.bh,
                            n_resamples=args.resamples)
    la, lb = a["system"].get("name", "A"), b["system"].get("name", "B")
    if args.json:
        print(json.dumps([{"task": c.task, "metric": c.metric, "a": c.a, "b": c.b, "n": c.n, "q_value": c.q_value,
                           **c.result.to_dict()} for c in comps], indent=1))
    else:
        print(f"A = {la}\nB = {lb}\n")
        print(comparison_table(comps, "A", "B"))
    return 0


def cmd_table(args) -> int:
    from fbs.eval.report import load_record, markdown_table

    records = [load_record(p) for p in args.records]
    print(markdown_table(records))
    return 0


def cmd_make_tasks(args) -> int:
    from fbs.eval.lm_eval_backend import write_task_files

    paths = write_task_files(Path(args.out_dir).expanduser(), tasks=args.tasks.split(",") if args.tasks else None,
                             limit=args.limit, seed=args.seed)
    for p in paths:
        print(p)
    print(f"use: python -m fbs.eval.lm_eval_backend --model fbs --include_path {Path(args.out_dir).expanduser()} --tasks "
          + ",".join(sorted({p.stem for p in paths if p.suffix == '.yaml'})))
    return 0


def cmd_sweep(args) -> int:
    import torch

    from fbs import FBSForCausalLM
    from fbs.eval.report import runtime_info, seed_everything
    from fbs.eval.sweep import heldout_documents, markdown, run_sweep
    from fbs.loading import load_from_args
    from fbs.models import load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    seed_everything(args.seed)
    taus = [float(t) for t in args.taus.split(",") if t.strip()]
    model = load_from_args(args)
    base = FBSForCausalLM.from_base(model.config.base_model or args.model)
    tok = getattr(model, "tokenizer", None) or load_tokenizer(args.model)
    docs = heldout_documents(args.corpus, tok, args.split, args.per_lang, args.max_tokens, args.seed)
    start = time.perf_counter()
    res = run_sweep(model, base, docs, taus, args.batch_size, args.seed, not args.no_progress, args.tolerance,
                    args.gate_from)
    langs = sorted({d.lang for d in docs})
    res.update(corpus=str(args.corpus), split=args.split, per_lang=args.per_lang, max_tokens=args.max_tokens,
               checkpoint=args.checkpoint, wall_s=time.perf_counter() - start, runtime=runtime_info(args.seed))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    table = markdown(res["rows"], langs)
    op = res["operating_point"]
    note = (f"operating point (most efficient tau with PPL within {100 * args.tolerance:.0f}% of base "
            f"{res['base_ppl']:.3f}): " + ("none" if op is None else f"tau={op}"))
    out.with_suffix(".md").write_text(table + "\n\n" + note + "\n")
    print(table)
    print(note)
    print(f"wrote {out} and {out.with_suffix('.md')} ({len(docs)} documents, {res['wall_s']:.0f} s)")
    return 0


def cmd_list(args) -> int:
    from fbs.eval.tasks import DEFAULT_TASKS, TASKS

    for name, spec in TASKS.items():
        print(f"{name:<14} {spec.kind:<4} {'default' if name in DEFAULT_TASKS else '       '}  {spec.description}")
    return 0


def register(subparsers) -> None:
    from fbs.loading import add_model_arguments

    p = subparsers.add_parser("eval", help="quality evaluation (perplexity, MMLU, ARC, GSM8K, HumanEval, MBPP ...)")
    sub = p.add_subparsers(dest="eval_command", required=True)

    r = sub.add_parser("run", help="evaluate one system on tasks and write a JSON record + markdown table")
    r.add_argument("--system", choices=("base", "fbs"), default="base")
    add_model_arguments(r)
    r.add_argument("--gate-mode", choices=("threshold", "off"), default="threshold",
                   help="fbs: 'off' runs every layer (the nothing-skipped reference)")
    r.add_argument("--tasks", help="comma-separated task names (default: the main-table set; see `fbs eval list`)")
    r.add_argument("--limit", help="seeded subset size: N for every task, or task=N,...,default=N")
    r.add_argument("--seed", type=int, default=42, help="global seed and subset seed (appendix B.1 default 42)")
    r.add_argument("--out", default="results/eval.json", help="JSON record path (markdown next to it)")
    r.add_argument("--name", help="system label in reports")
    r.add_argument("--append", action="store_true",
                   help="keep the other tasks already in --out (same system name) and add/replace these")
    r.add_argument("--max-length", type=int, default=2048, help="context length cap (left-truncation)")
    r.add_argument("--max-batch-tokens", type=int, default=2048, help="padded tokens per scoring batch")
    r.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    r.add_argument("--no-progress", action="store_true")
    r.set_defaults(func=cmd_run)

    c = sub.add_parser("compare", help="paired bootstrap of A minus B per task (CI, p-value, * at p<0.01)")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--bh", action="store_true", help="also Benjamini-Hochberg q-values over the tasks")
    c.add_argument("--all-metrics", action="store_true", help="every metric, not only the primary one")
    c.add_argument("--resamples", type=int, default=1000)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_compare)

    t = sub.add_parser("table", help="main-table markdown for one or more run records")
    t.add_argument("records", nargs="+")
    t.set_defaults(func=cmd_table)

    m = sub.add_parser("make-tasks", help="write offline lm-eval task YAMLs + JSONL data for the local datasets")
    m.add_argument("--out-dir", default="~/.cache/fbs/eval/lm_eval_tasks")
    m.add_argument("--tasks", help="comma-separated (default: all multiple-choice tasks)")
    m.add_argument("--limit", type=int, help="seeded subset per task (same selection as `fbs eval run`)")
    m.add_argument("--seed", type=int, default=42)
    m.set_defaults(func=cmd_make_tasks)

    w = sub.add_parser("sweep", help="tau sweep of an FBS checkpoint on held-out corpus documents: "
                                     "skip %%, TFLOPs(rel), PPL with bootstrap CIs vs the base model")
    add_model_arguments(w)
    w.add_argument("--corpus", required=True, help="corpus directory from `fbs data build`")
    w.add_argument("--split", default="test")
    w.add_argument("--per-lang", type=int, default=24, help="documents per language (seeded sample)")
    w.add_argument("--max-tokens", type=int, default=512, help="tokens scored per document (its first ones)")
    w.add_argument("--taus", default=",".join(str(t) for t in (0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65)))
    w.add_argument("--tolerance", type=float, default=0.02,
                   help="operating point: the most efficient tau with PPL <= (1 + tolerance) x base PPL")
    w.add_argument("--batch-size", type=int, default=4)
    w.add_argument("--gate-from", type=int, default=1,
                   help="never skip positions before this (decode prefills the prompt; 1 = all but the first token)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    w.add_argument("--out", default="results/sweep.json", help="JSON path (markdown next to it)")
    w.add_argument("--no-progress", action="store_true")
    w.set_defaults(func=cmd_sweep)

    ls = sub.add_parser("list", help="known tasks")
    ls.set_defaults(func=cmd_list)
