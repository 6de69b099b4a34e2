"""``fbs eval``: quality evaluation of a base model or an FBS model, reports and comparisons.

    fbs eval run --system base --tasks ppl_c4,mmlu --limit 100 --out results/base.json
    fbs eval run --system fbs --tau 0.7 --kv-policy project --out results/fbs.json
    fbs eval run --protocol cpu --system base --out results/protocol_cpu/base.json     # the CPU protocol
    fbs eval run --protocol cpu --dry-run                                              # sizes + subset ids only
    fbs eval merge results/ctrl_a.json results/ctrl_b.json --out results/ctrl.json      # pieces run side by side
    fbs eval compare results/fbs.json results/base.json [--bh]
    fbs eval table results/base.json results/fbs.json --base results/base.json --bench bench.json \
        --bench-rows hf-greedy,fbs-tau0.3
    fbs eval make-tasks --out-dir ~/.cache/fbs/eval/lm_eval_tasks
    fbs eval sweep --checkpoint CKPT --text in,ood --corpus corpus --control CTRL --out results/sweep.json
    fbs eval sweep --checkpoint CKPT --text in --corpus corpus --target-skip 0.3 --write-tau CKPT
    fbs eval sweep --baseline ffn-skipllm --ffn-skip-thresholds 0.99,0.988,0.984 --text ood --out results/ffn.json
    fbs eval sweep --baseline flexidepth --flexidepth RUN/final --taus 0.3,0.5,0.7 --text ood --out results/fd.json
    fbs eval pareto results/old.json results/new.json --labels old,new --out-prefix results/pareto
    fbs eval run --system flexidepth --flexidepth RUN/final --tau 0.5 --tasks mmlu --out results/fd_mmlu.json
    fbs eval group-b --bench bench.json --sweeps results/*.json --runs results/*_mmlu.json --out results/group_b.json
    fbs eval chat --checkpoint CKPT --taus 0.3,0.5 --control CTRL --out results/chat.json
    fbs eval safety --checkpoint CKPT --out results/safety.json
    fbs eval operating-point --checkpoint CKPT --weights q8 --out-dir results/operating_point
    fbs eval mechanism --checkpoint CKPT --items heldout.jsonl --out results/mechanism
    fbs eval ch --corpus corpus --seq-len 512 --eval-seqs 0 --idiom-items 500 --out results/probe/ch.json
    fbs eval ch-table results/probe/probe.json results/probe/ch.json --base results/probe/probe.json
    fbs eval tolerance --model qwen2.5-coder-0.5b --out results/tolerance_qwen2.5-coder-0.5b.json
    fbs eval long-context --lengths 2048,4096 --kv-budget 1024 --out results/longctx_smollm2.json
    fbs eval list

Only this module prints; the handlers are plain functions returning an exit code.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from ..engine.kvpolicy import add_kv_cache_arguments, kv_cache_options
from .runtime import chat_items, checkpoint_path, setup_runtime

logger = logging.getLogger(__name__)

#: FFN-SkipLLM thresholds `fbs eval sweep --baseline ffn-skipllm` scores by default, from few to many skipped FFN
#: blocks (fbs.baselines.FFNSkipLLM); the bench's default thresholds (0.984, 0.988) are among them
DEFAULT_FFN_SKIP_THRESHOLDS = (0.99, 0.988, 0.986, 0.984, 0.98)


def build_system(args):
    """The System named by ``--system``: ``base`` (HF model), ``fbs`` (FBSForCausalLM), or an adaptive-depth
    baseline, ``ffn-skipllm`` / ``flexidepth`` (:mod:`fbs.eval.adaptive`)."""
    from fbs.eval.systems import FBSSystem, HFSystem

    kw = {"max_length": args.max_length, "max_batch_tokens": args.max_batch_tokens}
    _check_baseline_args(args, args.system)
    if args.system != "fbs" and getattr(args, "kv_cache", "full") != "full":
        raise ValueError(f"--kv-cache is a policy of the FBS engine's cache: use it with --system fbs, not "
                         f"--system {args.system}")
    if args.system != "fbs" and getattr(args, "kv_dtype", "fp32") not in ("fp32", "auto"):
        raise ValueError(f"--kv-dtype is the storage of the FBS engine's cache: use it with --system fbs, not "
                         f"--system {args.system}")
    if args.system == "base":
        from fbs.model.bases import load_base

        model, tok = load_base(args.model)
        return HFSystem(model, tok, name=args.name or f"{args.model} (base)", **kw)
    if args.system in ("ffn-skipllm", "flexidepth"):
        from fbs.eval.adaptive import AdaptiveSystem, build_scorer
        from fbs.model.bases import load_base

        model, tok = load_base(args.model)
        scorer = build_scorer(args.system, model, tok, threshold=args.ffn_skip_threshold, checkpoint=args.flexidepth,
                              tau=args.tau, route_prompt=args.flexidepth_prompt == "routed")
        return AdaptiveSystem(scorer, tok, name=args.name or f"{scorer.label} over {args.model}", **kw)
    from fbs.cli_args import load_from_args
    from fbs.model.bases import load_tokenizer

    model = load_from_args(args)
    tok = getattr(model, "tokenizer", None) or load_tokenizer(args.model)
    gen = kv_cache_options(args)  # generation tasks decode through the engine's cache (scoring runs no cache)
    cache = (f", kv-cache={args.kv_cache}:{args.kv_budget}" if "kv_cache" in gen else "") + (
        f", kv-dtype={gen['kv_dtype']}" if "kv_dtype" in gen else "")
    name = args.name or f"FBS {args.model} (tau={args.tau if args.tau is not None else model.config.tau}, "\
                        f"kv={args.kv_policy or model.config.kv_policy}, gates={args.gate_mode}{cache})"
    return FBSSystem(model, tok, tau=args.tau, kv_policy=args.kv_policy, gate_mode=args.gate_mode, name=name,
                     generate_kwargs=gen, **kw)


def _check_baseline_args(args, method: str | None) -> None:
    """Refuse options that do not apply to ``method`` (None or ``fbs``/``base``: the FBS and base model options)."""
    given = lambda name: getattr(args, name, None) not in (None, False)  # noqa: E731
    if method in ("ffn-skipllm", "flexidepth"):
        bad = [flag for flag, name in (("--checkpoint", "checkpoint"), ("--fresh", "fresh"),
                                       ("--kv-policy", "kv_policy")) if given(name)]
        if getattr(args, "gate_mode", "threshold") != "threshold":
            bad.append("--gate-mode")
        if method == "ffn-skipllm" and given("tau"):
            bad.append("--tau (FFN-SkipLLM's knob is its cosine threshold)")
        if bad:
            raise SystemExit(f"{', '.join(bad)}: not an option of the {method} baseline")
    for flag, name, owner in (("--ffn-skip-threshold", "ffn_skip_threshold", "ffn-skipllm"),
                              ("--ffn-skip-thresholds", "ffn_skip_thresholds", "ffn-skipllm"),
                              ("--flexidepth", "flexidepth", "flexidepth")):
        if given(name) and method != owner:
            raise SystemExit(f"{flag} goes with the {owner} baseline")
    if getattr(args, "flexidepth_prompt", "full") != "full" and method != "flexidepth":
        raise SystemExit("--flexidepth-prompt goes with the flexidepth baseline")


def cmd_run(args) -> int:
    from fbs.eval.report import (load_record, make_record, markdown_table, merge_records, runtime_info, save_record,
                                 seed_everything)
    from fbs.eval.tasks import DEFAULT_TASKS, TASKS, run_task

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    seed_everything(args.seed)
    plan, protocol = {}, None
    if args.protocol:
        if args.limit:
            raise SystemExit("--limit and --protocol exclude each other: the protocol fixes the subsets")
        plan, protocol = _protocol_plan(args)
        tasks = list(plan)
        if args.dry_run:
            return 0
    else:
        if args.dry_run:
            raise SystemExit("--dry-run goes with --protocol")
        tasks = args.tasks.split(",") if args.tasks else list(DEFAULT_TASKS)
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown tasks {unknown}; run `fbs eval list`")
    system = build_system(args)
    limits = _parse_limits(args.limit, tasks)
    start = time.perf_counter()
    results = {}
    out = Path(args.out)
    previous = None
    if args.append and out.is_file():
        loaded = load_record(out)
        previous = {**loaded, "tasks": {k: v.to_dict() for k, v in loaded["tasks"].items() if k not in tasks}}
        # same system and protocol, or stop before any task runs
        merge_records(previous, make_record(system.describe(), {}, args.seed, args.limit, 0.0, {}, protocol),
                      f"--append: {out}")
    for k, name in enumerate(tasks, 1):
        items, n_total = plan.get(name, (None, None))
        if items is not None:
            print(f"[{k}/{len(tasks)}] {name}: {len(items)} of {n_total} examples", flush=True)
        res = run_task(system, name, limit=limits.get(name), seed=args.seed, progress=not args.no_progress,
                       items=items, n_total=n_total)
        results[name] = res
        m = res.metrics[res.primary]
        cost = res.details.get("cost", {})
        kind = "scored" if cost.get("scored_pairs") else "decoded"
        skip = (f"  skip={100 * cost[f'{kind}_skipped'] / cost[f'{kind}_pairs']:.1f}% ({kind})"
                if cost.get(f"{kind}_pairs") else "")
        print(f"{name:>14}  {res.primary}={m.value:.4f}  CI95=[{m.ci95[0]:.4f}, {m.ci95[1]:.4f}]  "
              f"n={res.n}/{res.n_total}  {res.seconds:.0f}s{skip}", flush=True)
        record = make_record(system.describe(), results, args.seed, args.limit, time.perf_counter() - start,
                             runtime_info(args.seed), protocol=protocol)
        if previous is not None:
            record = merge_records(previous, record, f"--append: {out}")
        save_record(record, out)  # after every task, so a long run keeps what it has
    md = out.with_suffix(".md")
    md.write_text(f"# {system.name}\n\n" + markdown_table([load_record(out)], [system.name]))
    print(f"wrote {out} and {md} ({time.perf_counter() - start:.0f}s)")
    return 0


def _protocol_plan(args) -> tuple[dict[str, tuple[list, int]], dict]:
    """{task: (items, full-set size)} of ``--protocol`` (restricted to ``--tasks``) and the record's protocol entry;
    prints every benchmark with its count, or why it is not run, and writes / reads the subset ids in ``--ids-dir``."""
    from fbs.eval.datasets import EvalDataError
    from fbs.eval.tasks import PROTOCOLS, TASKS, protocol_items

    entries = PROTOCOLS[args.protocol]
    wanted = args.tasks.split(",") if args.tasks else None
    unknown = sorted(set(wanted or ()) - {e.task for e in entries})
    if unknown:
        raise SystemExit(f"--tasks {unknown} are not in protocol {args.protocol!r}: {', '.join(e.task for e in entries)}")
    ids_dir = Path(args.ids_dir or f"results/protocol_{args.protocol}")
    print(f"protocol {args.protocol}: seed {args.seed}, subset ids in {ids_dir}/<task>.ids.json", flush=True)
    plan, info = {}, {"name": args.protocol, "ids_dir": str(ids_dir), "seed": args.seed, "tasks": {}, "not_run": {}}
    for e in entries:
        if wanted is not None and e.task not in wanted:
            continue
        if not e.run:
            if e.task == "chat":
                _chat_protocol_ids(args.protocol, e, args.seed, ids_dir, info)
            else:
                info["not_run"][e.task] = e.note
            print(f"  {e.task:<14} not run: {info['not_run'][e.task]}", flush=True)
            continue
        try:
            full = TASKS[e.task].load()
        except EvalDataError as exc:  # said, never silently dropped
            info["not_run"][e.task] = f"data not available: {exc}"
            print(f"  {e.task:<14} NOT AVAILABLE: {exc}", flush=True)
            continue
        items, rec = protocol_items(args.protocol, e, full, args.seed, ids_dir)
        plan[e.task] = (items, len(full))
        info["tasks"][e.task] = {k: rec[k] for k in ("n", "n_total", "selection", "note")}
        print(f"  {e.task:<14} {len(items):>6} of {len(full):>6}  {rec['selection']}; {e.note}", flush=True)
    print(f"  {sum(len(v[0]) for v in plan.values())} examples in {len(plan)} tasks", flush=True)
    return plan, info


def _chat_protocol_ids(protocol: str, entry, seed: int, ids_dir: Path, info: dict) -> None:
    """The held-out chat prompts of `fbs eval chat` (all of them) into ``chat.ids.json``, for the record."""
    from fbs.data.chat import load_items, split
    from fbs.data.sources import SourceError
    from fbs.eval.tasks import protocol_items

    try:
        items = split(load_items())[1]
    except (SourceError, OSError) as exc:
        info["not_run"]["chat"] = f"{entry.note}; its prompts are not available here: {exc}"
        return
    _, rec = protocol_items(protocol, entry, items, seed, ids_dir)
    info["not_run"]["chat"] = f"{entry.note} ({rec['n']} prompts)"


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
    from fbs.eval.report import bench_latency, load_record, markdown_table

    base = load_record(args.base) if args.base else None
    records = [base if base is not None and Path(p).resolve() == Path(args.base).resolve() else load_record(p)
               for p in args.records]
    latency = None
    if args.bench:
        rows = (args.bench_rows or "").split(",")
        if len(rows) != len(records):
            raise SystemExit(f"--bench-rows needs one `fbs bench` system per record ({len(records)}; '-' for none)")
        latency = [None if r in ("", "-") else bench_latency(args.bench, r, args.bench_batch) for r in rows]
    labels = args.labels.split(",") if args.labels else None
    if labels is not None and len(labels) != len(records):
        raise SystemExit(f"{len(labels)} labels for {len(records)} records")
    print(markdown_table(records, labels, base=base, latency_ms=latency, seed=args.seed))
    return 0



def cmd_merge(args) -> int:
    from fbs.eval.report import FORMAT, load_record, markdown_table, merge_records, save_record

    merged = None
    for path in args.records:
        rec = json.loads(Path(path).read_text())
        if rec.get("format") != FORMAT:
            raise SystemExit(f"{path} is not an fbs eval record (format {rec.get('format')!r})")
        overlap = sorted(set(merged["tasks"]) & set(rec["tasks"])) if merged is not None else []
        if overlap:
            raise SystemExit(f"{path} repeats task(s) {overlap} of an earlier record: merge pieces with disjoint tasks")
        merged = rec if merged is None else merge_records(merged, rec, f"the records before {path}")
    out = Path(args.out)
    save_record(merged, out)
    name = merged["system"].get("name")
    out.with_suffix(".md").write_text(f"# {name}\n\n" + markdown_table([load_record(out)], [name]))
    print(f"wrote {out} ({len(merged['tasks'])} tasks: {', '.join(merged['tasks'])}) and {out.with_suffix('.md')}")
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


def _floats(spec: str | None) -> list[float]:
    return [float(t) for t in (spec or "").split(",") if t.strip()]


def _sweep_texts(args, tok) -> dict:
    """{text name: held-out blocks} for ``--text`` (:func:`fbs.eval.sweep.sweep_texts`)."""
    from fbs.eval.sweep import sweep_texts

    try:
        return sweep_texts(tok, args.text.split(","), args.corpus, args.split, args.per_lang, args.max_tokens,
                           args.seed, args.gate_from, args.ood_per_kind)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def cmd_sweep(args) -> int:
    from fbs import FBSForCausalLM
    from fbs.eval.sweep import DEFAULT_TAUS, run_sweep
    from fbs.cli_args import load_from_args
    from fbs.model.loading import load_checkpoint
    from fbs.model.bases import load_tokenizer

    _check_baseline_args(args, args.baseline)
    if args.baseline:
        return _baseline_sweep(args)
    setup_runtime(args)
    model = load_from_args(args)
    tok = getattr(model, "tokenizer", None) or load_tokenizer(args.model)
    texts = _sweep_texts(args, tok)
    if args.target_skip is not None:
        return _calibrate(args, model, texts)
    taus = _floats(args.taus) if args.taus is not None else list(DEFAULT_TAUS)
    spec = (args.matched_taus or "config").strip().lower()
    matched = ([] if spec == "none" else list(taus) if spec == "all"
               else [float(model.config.tau)] if spec == "config" else _floats(spec))
    taus += [t for t in matched if t not in taus]
    base = FBSForCausalLM.from_base(model.config.base_model or args.model)
    control = load_checkpoint(args.control) if args.control else None
    start = time.perf_counter()
    res: dict = {"texts": {}}
    for name, docs in texts.items():
        print(f"{name}: {len(docs)} blocks", flush=True)
        res["texts"][name] = run_sweep(model, base, docs, taus, args.batch_size, args.seed, not args.no_progress,
                                       args.tolerance, args.gate_from, control=control, matched_taus=matched)
    label = Path(args.checkpoint).name if args.checkpoint else "FBS"
    return _write_sweep(args, res, start, label, checkpoint=args.checkpoint, control=args.control)


def _baseline_sweep(args) -> int:
    """``fbs eval sweep --baseline``: the decode-faithful PPL front of an adaptive-depth baseline."""
    from fbs.eval.adaptive import build_scorer, run_baseline_sweep
    from fbs.model.bases import load_base

    refused = [flag for flag, given in (("--target-skip", args.target_skip is not None),
                                        ("--write-tau", args.write_tau), ("--control", args.control),
                                        ("--matched-taus", args.matched_taus),
                                        ("--tau (use --taus)", args.tau is not None)) if given]
    if refused:
        raise SystemExit(f"{', '.join(refused)}: FBS sweep options, not for --baseline")
    if args.baseline == "ffn-skipllm" and args.taus is not None:
        raise SystemExit("FFN-SkipLLM sweeps its cosine threshold: use --ffn-skip-thresholds, not --taus")
    setup_runtime(args)
    hf, tok = load_base(args.model)
    scorer = build_scorer(args.baseline, hf, tok, checkpoint=args.flexidepth,
                          route_prompt=args.flexidepth_prompt == "routed")
    if args.baseline == "ffn-skipllm":
        values = _floats(args.ffn_skip_thresholds) if args.ffn_skip_thresholds else list(DEFAULT_FFN_SKIP_THRESHOLDS)
    else:
        values = _floats(args.taus) if args.taus is not None else [scorer.value]
    texts = _sweep_texts(args, tok)
    start = time.perf_counter()
    res: dict = {"texts": {}}
    for name, docs in texts.items():
        print(f"{name}: {len(docs)} blocks, {scorer.method} at {', '.join(f'{v:g}' for v in values)}", flush=True)
        res["texts"][name] = run_baseline_sweep(scorer, docs, values, args.batch_size, args.seed,
                                                not args.no_progress, args.tolerance, args.gate_from)
    label = {"ffn-skipllm": "FFN-SkipLLM", "flexidepth": "FlexiDepth"}[args.baseline]
    return _write_sweep(args, res, start, label, checkpoint=args.flexidepth, baseline=args.baseline,
                        baseline_config=scorer.describe())


def _write_sweep(args, res: dict, start: float, label: str, **meta) -> int:
    """Top-level keys, the JSON, the markdown and the Pareto plots of a sweep (FBS or a baseline)."""
    from fbs.eval.plots import pareto_plots
    from fbs.eval.report import runtime_info
    from fbs.eval.sweep import markdown

    texts = list(res["texts"])
    first = res["texts"][texts[0]]
    # top level: the first text's base / full-depth / threshold rows, the shape older readers expect
    res.update(rows=[r for r in first["rows"] if r["kind"] in ("base", "full", "tau")], base_ppl=first["base_ppl"],
               operating_point=first["operating_point"], gate_from=args.gate_from, text=texts,
               corpus=str(args.corpus) if args.corpus else None, split=args.split, per_lang=args.per_lang,
               max_tokens=args.max_tokens, ood_per_kind=args.ood_per_kind, **meta,
               wall_s=time.perf_counter() - start, runtime=runtime_info(args.seed))
    out = Path(args.out or "results/sweep.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    parts = []
    for name, r in res["texts"].items():
        langs = sorted({d["lang"] for d in r["documents"]})
        op = r["operating_point"]
        knob = r.get("knob", "tau")
        note = (f"operating point (most efficient {knob} with PPL within {100 * args.tolerance:.0f}% of base "
                f"{r['base_ppl']:.3f}): " + ("none" if op is None else f"{knob}={op}"))
        what = f", {r['method']} (skip % of {r['skip_unit']})" if r.get("method") else ""
        parts.append(f"## {name} held-out text ({len(r['documents'])} blocks, gates from token {args.gate_from}{what})"
                     f"\n\n{markdown(r['rows'], langs)}\n\n{note}\n")
    md = "\n".join(parts)
    out.with_suffix(".md").write_text(md)
    print(md)
    if not args.no_plot:
        for p in pareto_plots([(label, res)], out.with_name(out.stem + "_pareto")):
            print(f"wrote {p}")
    print(f"wrote {out} and {out.with_suffix('.md')} ({time.perf_counter() - start:.0f} s)")
    return 0


def _calibrate(args, model, texts: dict) -> int:
    from fbs.eval.sweep import calibrate_tau, write_tau
    from fbs.provenance import provenance

    name = next(iter(texts))
    docs = texts[name]
    print(f"calibrating tau to {100 * args.target_skip:.2f}% skipped pairs on {name} text ({len(docs)} blocks, "
          f"gates from token {args.gate_from})", flush=True)
    res = calibrate_tau(model, docs, args.target_skip, args.gate_from, args.batch_size, tol=args.calib_tol,
                        progress=lambda t, r: print(f"  tau={t:.6f}  skip={100 * r:.2f}%", flush=True))
    res.update(text=name, checkpoint=args.checkpoint, provenance=provenance())
    print(f"tau={res['tau']:.6f} skips {100 * res['skip_ratio']:.2f}% (target {100 * args.target_skip:.2f}%)")
    out = Path(args.out or "results/tau_calibration.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    if args.write_tau:
        info = {k: res[k] for k in ("target", "skip_ratio", "gate_from", "blocks", "text")}
        print(f"wrote tau={res['tau']:.6f} into {write_tau(args.write_tau, res['tau'], info)}")
    print(f"wrote {out}")
    return 0


def _add_baseline_arguments(p, sweep: bool) -> None:
    from fbs.baselines import FFNSkipLLM

    if sweep:
        p.add_argument("--ffn-skip-thresholds",
                       help="--baseline ffn-skipllm: cosine-saturation thresholds, comma list (default "
                            + ",".join(f"{t:g}" for t in DEFAULT_FFN_SKIP_THRESHOLDS) + ")")
    else:
        p.add_argument("--ffn-skip-threshold", type=float,
                       help=f"--system ffn-skipllm: cosine-saturation threshold (default {FFNSkipLLM.threshold:g})")
    p.add_argument("--flexidepth", metavar="DIR", help="FlexiDepth checkpoint (output of `fbs train flexidepth`)")
    p.add_argument("--flexidepth-prompt", choices=("full", "routed"), default="full",
                   help="FlexiDepth: 'full' = the prompt (context) runs every layer, as FBS prefills it (the sweep's "
                        "protocol: nothing before --gate-from skips); 'routed' = the routers decide from position 1, "
                        "prompt included, as FlexiDepth's own decoding and `fbs bench` do")


def cmd_group_b(args) -> int:
    from fbs.eval.groupb import assemble, load_inputs, markdown
    from fbs.provenance import provenance

    bench, sweeps, runs = load_inputs(args.bench, args.sweeps, args.runs)
    systems = [x.strip() for x in args.systems.split(",") if x.strip()] if args.systems else None
    doc = assemble(bench, sweeps, runs, text=args.text, batch_size=args.batch_size, systems=systems,
                   tasks=[t.strip() for t in args.tasks.split(",") if t.strip()], bench_path=args.bench)
    doc["provenance"] = provenance()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    md = markdown(doc)
    out.with_suffix(".md").write_text(md)
    print(md)
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


def cmd_pareto(args) -> int:
    from fbs.eval.plots import pareto_plots

    labels = args.labels.split(",") if args.labels else [Path(p).stem for p in args.sweeps]
    if len(labels) != len(args.sweeps):
        raise SystemExit(f"{len(labels)} labels for {len(args.sweeps)} sweep files")
    results = [(lab, json.loads(Path(p).read_text())) for lab, p in zip(labels, args.sweeps)]
    for p in pareto_plots(results, args.out_prefix, x=args.x):
        print(f"wrote {p}")
    return 0


def _load_chat_models(args):
    """(base model: a fresh FBS, tokenizer, {model key: loader}, the checkpoint's tau)."""
    from fbs import FBSConfig, FBSForCausalLM
    from fbs.cli_args import load_from_args
    from fbs.model.loading import load_checkpoint
    from fbs.model.causal_lm import CONFIG_NAME

    base = FBSForCausalLM.from_base(args.model)
    ckpt = checkpoint_path(args)
    tau = json.loads((ckpt / CONFIG_NAME).read_text())["tau"] if ckpt else FBSConfig().tau
    loaders = {"checkpoint": lambda: load_from_args(args)}
    if args.control:
        loaders["control"] = lambda: load_checkpoint(args.control)
    return base, base.tokenizer, loaders, tau


def reference_systems(spec: str | None) -> list:
    """The ``--reference-weights`` systems: the base model in each listed engine format, ``W``, ``W:KV`` with a KV
    cache storage dtype (``q4:fp16``) or ``W:KV:P`` with the prompt's products too (``q4:fp16:int8``)."""
    from fbs.engine.cache import KV_DTYPES
    from fbs.engine.defaults import PREFILL
    from fbs.engine.quant import FORMATS
    from fbs.eval.chat import ChatSystem

    out = []
    for entry in (e for e in (spec or "").split(",") if e):
        w, kv, pre = (entry.split(":") + ["", ""])[:3]
        if w not in FORMATS or (kv and kv not in KV_DTYPES) or (pre and pre not in PREFILL) \
                or entry.count(":") > 2:
            raise SystemExit(f"--reference-weights: {entry!r} is not W, W:KV or W:KV:P with W one of "
                             f"{', '.join(FORMATS)}, KV one of {', '.join(KV_DTYPES)} and P one of {', '.join(PREFILL)}")
        name = f"base, {w} weights" + (f", {kv} KV cache" if kv else "") + (f", {pre} prefill" if pre else "")
        out.append(ChatSystem(name, "reference", "base", None, "base", w, kv or None, pre or None))
    return out


def cmd_chat(args) -> int:
    from fbs.eval.chat import ChatSystem, markdown, run_chat_eval
    from fbs.eval.report import runtime_info

    setup_runtime(args)
    items = chat_items(args)
    base, tok, loaders, ckpt_tau = _load_chat_models(args)
    taus = _floats(args.taus) or [args.tau if args.tau is not None else ckpt_tau]
    ckpt = str(checkpoint_path(args) or "fresh FBS")
    systems = [ChatSystem("base", "base", "base")]
    if not args.no_full:
        systems.append(ChatSystem("fbs full depth", "full", "checkpoint", None, ckpt))
    systems += [ChatSystem(f"fbs tau {t:g}", "tau", "checkpoint", t, ckpt) for t in taus]
    if args.control:
        systems.append(ChatSystem("control full depth", "control", "control", None, args.control))
    systems += reference_systems(args.reference_weights)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"checkpoint": ckpt, "control": args.control, "items": args.items or "fbs.data.chat.split()",
            "limit": args.limit, "runtime": runtime_info(args.seed)}
    done: list[dict] = []

    def partial(rec):
        done.append(rec)
        m = rec["metrics"]
        print(f"{rec['name']:>20}: EOS {100 * m['eos']['value']:.1f}%  loop {100 * m['loop']['value']:.1f}%  "
              f"stuck {100 * m['stuck']['value']:.1f}%  "
              f"len {m['length']['value']:.0f}  ROUGE-L {m['rouge_l']['value']:.3f}  base NLL "
              f"{m['base_nll']['value']:.3f}  skip {100 * rec['skip_ratio']:.1f}%", flush=True)
        out.write_text(json.dumps({"systems": done, "partial": True, **meta}, ensure_ascii=False))

    start = time.perf_counter()
    res = run_chat_eval(base, tok, items, systems, loaders, max_new_tokens=args.max_new_tokens,
                        batch_size=args.batch_size, base_cache=args.base_cache, seed=args.seed,
                        progress=not args.no_progress, on_system=partial)
    res.update(meta, wall_s=time.perf_counter() - start)
    out.write_text(json.dumps(res, indent=1, ensure_ascii=False))
    md = out.with_suffix(".md")
    md.write_text(f"# Free-running chat answers: {len(items)} held-out prompts\n\n"
                  + markdown(res, samples=args.samples))
    print(f"wrote {out} and {md} ({res['wall_s']:.0f} s)")
    return 0


def _load_safety_model(args):
    """(model, tokenizer) of ``fbs eval safety``."""
    from fbs.cli_args import load_from_args
    from fbs.model.bases import load_tokenizer

    model = load_from_args(args)
    return model, getattr(model, "tokenizer", None) or load_tokenizer(args.model)


def cmd_safety(args) -> int:
    from fbs.eval.chat import eos_ids
    from fbs.eval.report import runtime_info
    from fbs.eval.safety import SETTINGS, default_never_skip, load_prompts, markdown, run_safety, settings

    setup_runtime(args)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    prompts = load_prompts(args.prompts, kinds, args.limit)
    model, tok = _load_safety_model(args)
    tau = model.config.tau
    never = (default_never_skip(model) if args.never_skip == "auto"
             else tuple(int(x) for x in args.never_skip.split(",") if x.strip()))
    options = settings(tau, never, args.structure_tau, args.fallback_tau)
    names = [n.strip() for n in args.settings.split(",")] if args.settings else list(SETTINGS)
    unknown = sorted(set(names) - set(options))
    if unknown:
        raise SystemExit(f"unknown settings {unknown}; known: {', '.join(SETTINGS)}")
    if "default" not in names:
        names.insert(0, "default")  # the reference of every comparison and of the fallback's cost
    options = {n: options[n] for n in SETTINGS if n in names}
    chat = not args.no_chat_template and bool(getattr(tok, "chat_template", None))
    print(f"{len(prompts)} prompts ({', '.join(f'{sum(p.kind == k for p in prompts)} {k}' for k in kinds)}) x "
          f"{len(options)} settings at tau {tau:g}; never-skip adds layers {list(never)}; chat template "
          f"{'on' if chat else 'off'}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"checkpoint": str(checkpoint_path(args) or "fresh FBS"), "tau": tau, "never_skip": list(never),
            "structure_tau": args.structure_tau, "fallback_tau": args.fallback_tau, "runtime": runtime_info(args.seed)}
    bars: dict = {}

    def progress(name: str, k: int) -> None:
        if args.no_progress:
            return
        from tqdm.auto import tqdm

        bar = bars.get(name) or bars.setdefault(name, tqdm(total=len(prompts), desc=name, leave=False))
        bar.update(k)

    def done(rec: dict) -> None:
        fb = rec.get("fallback")
        print(f"{rec['name']:>24}: valid {100 * rec['valid']['value']:.1f}%  skip {100 * rec['skip_ratio']:.1f}%  "
              f"latency {rec['latency_ms_mean']:.0f} ms" + (f"  fallback fired {fb['fired']}" if fb else ""), flush=True)

    start = time.perf_counter()
    res = run_safety(model, tok, prompts, options, eos_ids(model, tok), max_new_tokens=args.max_new_tokens,
                     chat_template=chat, seed=args.seed, progress=progress, on_setting=done)
    for bar in bars.values():
        bar.close()
    res.update(meta, wall_s=time.perf_counter() - start)
    out.write_text(json.dumps(res, indent=1, ensure_ascii=False, default=str))
    md = out.with_suffix(".md")
    md.write_text(f"# Safety knobs (appendix E.9): {len(prompts)} structured-output prompts, tau {tau:g}\n\n"
                  + markdown(res))
    print(markdown(res))
    print(f"wrote {out} and {md} ({res['wall_s']:.0f} s)")
    return 0


def cmd_list(args) -> int:
    from fbs.eval.tasks import DEFAULT_TASKS, TASKS

    for name, spec in TASKS.items():
        print(f"{name:<14} {spec.kind:<4} {'default' if name in DEFAULT_TASKS else '       '}  {spec.description}")
    return 0


def register(subparsers) -> None:
    from fbs.eval.safety import SETTINGS as SAFETY_SETTINGS
    from fbs.cli_args import add_model_arguments

    p = subparsers.add_parser("eval", help="quality evaluation (perplexity, MMLU, ARC, GSM8K, HumanEval, MBPP ...)")
    sub = p.add_subparsers(dest="eval_command", required=True)

    r = sub.add_parser("run", help="evaluate one system on tasks and write a JSON record + markdown table")
    r.add_argument("--system", choices=("base", "fbs", "ffn-skipllm", "flexidepth"), default="base",
                   help="base model, FBS, or an adaptive-depth baseline over the base model (decode-faithful "
                        "scoring as for FBS; FlexiDepth's tau is --tau, default its checkpoint's)")
    add_model_arguments(r)
    _add_baseline_arguments(r, sweep=False)
    r.add_argument("--gate-mode", choices=("threshold", "off"), default="threshold",
                   help="fbs: 'off' runs every layer (the nothing-skipped reference)")
    add_kv_cache_arguments(r)  # fbs: the cache policy of generation tasks (log-likelihood scoring has no cache)
    r.add_argument("--tasks", help="comma-separated task names (default: the main-table set, or the protocol's "
                                   "tasks; see `fbs eval list`)")
    r.add_argument("--limit", help="seeded subset size: N for every task, or task=N,...,default=N")
    r.add_argument("--protocol", choices=("cpu", "cpu-small", "full"),
                   help="the fixed subsets (cpu) or the whole sets (full); subset ids in --ids-dir")
    r.add_argument("--ids-dir", help="protocol subset ids, read when present, else written (default "
                                     "results/protocol_<protocol>)")
    r.add_argument("--dry-run", action="store_true", help="with --protocol: print the plan, write the ids, stop")
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

    t = sub.add_parser("table", help="main-table markdown (quality, latency, TFLOPs(rel), Skip %%) for run records")
    t.add_argument("records", nargs="+")
    t.add_argument("--base", help="the base run: paired bootstrap of every record against it, BH over its tasks")
    t.add_argument("--bench", help="`fbs bench` JSON for the latency column")
    t.add_argument("--bench-rows", help="with --bench: one bench system per record, comma-separated ('-': none)")
    t.add_argument("--bench-batch", type=int, default=1, help="batch size of the bench rows")
    t.add_argument("--labels", help="comma-separated row labels (default: the records' system names)")
    t.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    t.set_defaults(func=cmd_table)

    mg = sub.add_parser("merge", help="one record from the pieces of one system's run (disjoint --tasks run as "
                                      "separate processes, e.g. one per core)")
    mg.add_argument("records", nargs="+", help="`fbs eval run` records of the same system (and protocol)")
    mg.add_argument("--out", required=True, help="merged JSON record (markdown next to it)")
    mg.set_defaults(func=cmd_merge)

    m = sub.add_parser("make-tasks", help="write offline lm-eval task YAMLs + JSONL data for the local datasets")
    m.add_argument("--out-dir", default="~/.cache/fbs/eval/lm_eval_tasks")
    m.add_argument("--tasks", help="comma-separated (default: all multiple-choice tasks)")
    m.add_argument("--limit", type=int, help="seeded subset per task (same selection as `fbs eval run`)")
    m.add_argument("--seed", type=int, default=42)
    m.set_defaults(func=cmd_make_tasks)

    w = sub.add_parser("sweep", help="tau sweep of an FBS checkpoint on held-out text (in-domain, OOD): skip %%, "
                                     "decode-faithful PPL with bootstrap CIs vs the base model, baselines, "
                                     "Pareto plots; --target-skip calibrates tau")
    add_model_arguments(w)
    w.add_argument("--baseline", choices=("ffn-skipllm", "flexidepth"),
                   help="sweep an adaptive-depth baseline over the base model instead of an FBS checkpoint: the base "
                        "row, nothing skipped, then each --ffn-skip-thresholds / --taus (FlexiDepth), scored "
                        "decode-faithfully like FBS (fbs.eval.adaptive)")
    _add_baseline_arguments(w, sweep=True)
    w.add_argument("--text", default="in", help="held-out text: in (corpus test split), ood, or in,ood")
    w.add_argument("--corpus", help="corpus directory from `fbs data build` (for --text in)")
    w.add_argument("--split", default="test")
    w.add_argument("--per-lang", type=int, default=24, help="in-domain documents per language (seeded sample)")
    w.add_argument("--max-tokens", type=int, default=512, help="in-domain tokens per document (its first ones)")
    w.add_argument("--ood-per-kind", type=int, help="OOD blocks per kind (en, zh, code; default all 32)")
    w.add_argument("--taus", help="comma list (FBS default 0.95,0.9,0.85,0.8,0.75,0.7,0.65; --baseline flexidepth: "
                                  "the checkpoint's tau)")
    w.add_argument("--matched-taus",
                   help="taus at which random / static / oracle plans skip as many pairs as the gates: 'config' "
                        "(the checkpoint's tau; default), 'all', 'none' or a list; added to --taus")
    w.add_argument("--control", help="control checkpoint (same recipe, never skipping), scored at full depth")
    w.add_argument("--tolerance", type=float, default=0.02,
                   help="operating point: the most efficient tau with PPL <= (1 + tolerance) x base PPL")
    w.add_argument("--batch-size", type=int, default=4)
    w.add_argument("--gate-from", type=int, default=128,
                   help="prompt tokens never gated; only later tokens are scored (decode-faithful)")
    w.add_argument("--target-skip", type=float,
                   help="calibrate instead of sweeping: the tau whose skip ratio on the first --text is this (0-1)")
    w.add_argument("--calib-tol", type=float, default=0.002, help="calibration: accepted |skip ratio - target|")
    w.add_argument("--write-tau", metavar="CKPT", help="calibration: write the tau into this checkpoint's config")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    w.add_argument("--out", help="JSON path, markdown next to it (default results/sweep.json, or "
                                 "results/tau_calibration.json with --target-skip)")
    w.add_argument("--no-plot", action="store_true", help="no Pareto PNGs (<out>_pareto_<text>.png)")
    w.add_argument("--no-progress", action="store_true")
    w.set_defaults(func=cmd_sweep)

    pp = sub.add_parser("pareto", help="Pareto plots (skip %% vs PPL) of several `fbs eval sweep` JSONs, one per text")
    pp.add_argument("sweeps", nargs="+")
    pp.add_argument("--labels", help="comma-separated legend labels (default: the file names)")
    pp.add_argument("--out-prefix", default="results/pareto", help="writes <prefix>_<text>.png")
    pp.add_argument("--x", choices=("skip", "bytes"), default="skip",
                    help="x axis: Skip %% of pairs, or fp32 weight bytes saved per decode step (compares whole-layer "
                         "with FFN-only skipping); writes <prefix>_<text>_bytes.png")
    pp.set_defaults(func=cmd_pareto)

    gb = sub.add_parser("group-b", help="the paper's compact Group B table (adaptive-depth baselines against FBS) "
                                        "from a bench JSON, sweep JSONs and run records; front statements")
    gb.add_argument("--bench", required=True, help="`fbs bench` JSON (latency, TFLOPs(rel), skip share, acceptance)")
    gb.add_argument("--sweeps", nargs="*", default=[], help="`fbs eval sweep` JSONs (FBS and --baseline sweeps)")
    gb.add_argument("--runs", nargs="*", default=[], help="`fbs eval run` records (MMLU subset etc.)")
    gb.add_argument("--text", default="ood", help="the sweeps' held-out text for the PPL column (in or ood)")
    gb.add_argument("--tasks", default="mmlu", help="accuracy columns, comma list of run-record tasks")
    gb.add_argument("--batch-size", type=int, default=1, help="bench rows of this batch size")
    gb.add_argument("--systems", help="bench systems to show, in order (default: hf-greedy, fbs-full-compute, "
                                      "fbs-tau*, ffn-skipllm-t*, flexidepth-tau*, fbs-lossless*, draft-verify, "
                                      "kangaroo-exit*, with their weight-format variants)")
    gb.add_argument("--out", default="results/group_b.json", help="JSON path (markdown next to it)")
    gb.set_defaults(func=cmd_group_b)

    ch = sub.add_parser("chat", help="free-running answers to held-out chat prompts: EOS rate, loops, length, "
                                     "ROUGE-L and base NLL against the base model's answers")
    add_model_arguments(ch)
    ch.add_argument("--taus", help="comma-separated taus of the checkpoint (default: --tau or its config tau)")
    ch.add_argument("--control", help="control checkpoint, decoded at full depth")
    ch.add_argument("--no-full", action="store_true", help="skip the checkpoint at full depth")
    ch.add_argument("--reference-weights", metavar="W[,W]",
                    help="also decode the base model with these engine weights (bf16, int8, q4, ...; W:KV adds a KV "
                         "cache storage, e.g. q4:fp16, W:KV:P the prompt's products, e.g. q4:fp16:int8): how far the "
                         "answers move when only rounding changes, the floor of ROUGE-L / EOS / loop differences")
    ch.add_argument("--items", help="held-out items JSONL from `fbs data chat` (default: computed from the archive)")
    ch.add_argument("--limit", type=int, help="the first N held-out prompts of each language")
    ch.add_argument("--max-new-tokens", type=int, default=256)
    ch.add_argument("--batch-size", type=int, default=8, help="prompts per engine call")
    ch.add_argument("--base-cache", default="results/chat_base_answers.json",
                    help="the base model's answers, reused by later runs")
    ch.add_argument("--samples", type=int, default=4, help="sample prompts per language in the markdown")
    ch.add_argument("--seed", type=int, default=0)
    ch.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    ch.add_argument("--out", default="results/chat.json", help="JSON path (markdown next to it)")
    ch.add_argument("--no-progress", action="store_true")
    ch.set_defaults(func=cmd_chat)

    from fbs.eval.mechanism import add_parser as add_mechanism_parser  # `fbs eval mechanism`: appendix G statistics

    add_mechanism_parser(sub)

    from fbs.eval.chunks import add_parser as add_ch_parser  # `fbs eval ch`: the trained CH scored like `fbs probe`

    add_ch_parser(sub)

    from fbs.eval.ch_table import add_parser as add_ch_table_parser  # `fbs eval ch-table`: CIs of the CH table

    add_ch_table_parser(sub)

    from fbs.eval.segatron import add_parser as add_segatron_parser  # `fbs eval segatron`: Group D next to CH

    add_segatron_parser(sub)

    from fbs.eval.longctx import add_parser as add_longctx_parser  # `fbs eval long-context`: appendix F

    add_longctx_parser(sub)

    from fbs.eval.tolerance import add_parser as add_tolerance_parser  # `fbs eval tolerance`: skip tolerance profile

    add_tolerance_parser(sub)

    from fbs.eval.operating_point import add_parser as add_op_parser  # `fbs eval operating-point`: the paper's rule

    add_op_parser(sub)

    sf = sub.add_parser("safety", help="appendix E.9 safety knobs on structured-output prompts: validity, Skip %%, "
                                       "latency with and without never-skip, structure protection, fallback rerun")
    add_model_arguments(sf)
    sf.add_argument("--prompts", help="JSONL of prompts (id, kind, instruction, prefix; default: the package's set)")
    sf.add_argument("--kinds", default="json,python,brackets")
    sf.add_argument("--limit", type=int, help="the first N prompts of each kind")
    sf.add_argument("--settings", help="comma-separated subset of: " + ", ".join(SAFETY_SETTINGS))
    sf.add_argument("--never-skip", default="auto",
                    help="layers the never-skip knob adds: 'auto' (two more gated layers at each end) or a list")
    sf.add_argument("--structure-tau", type=float, default=1.0, help="tau while structure protection is on")
    sf.add_argument("--fallback-tau", type=float, default=0.9, help="tau of the fallback rerun")
    sf.add_argument("--max-new-tokens", type=int, default=128)
    sf.add_argument("--no-chat-template", action="store_true", help="plain prompts even if the tokenizer has one")
    sf.add_argument("--seed", type=int, default=0)
    sf.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    sf.add_argument("--out", default="results/safety.json", help="JSON path (markdown next to it)")
    sf.add_argument("--no-progress", action="store_true")
    sf.set_defaults(func=cmd_safety)

    ls = sub.add_parser("list", help="known tasks")
    ls.set_defaults(func=cmd_list)
