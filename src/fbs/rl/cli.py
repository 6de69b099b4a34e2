"""``fbs train stage2`` (or ``fbs stage2``): the Stage-2 PPO recipe from a YAML config plus overrides;
``fbs train stage2-report``: reward decomposition of runs; ``fbs train stage2-accept``: the acceptance
experiment (grid of runs, held-out sweeps, Delta skip at equal PPL with a CI, :mod:`fbs.rl.accept`).

``register(subparsers)`` adds them under the ``train`` command when :mod:`fbs.train.cli` has registered it
first, else as top-level commands. ``python -m fbs.rl.cli`` runs them directly.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def cmd_stage2(args: argparse.Namespace) -> int:
    from ..train.cli import run_resumable
    from ..train.common import config_from_args
    from .stage2 import Stage2Config, Stage2ConfigError, train_stage2

    cfg = config_from_args(args, Stage2Config, Stage2ConfigError, STAGE2_FLAGS)
    if isinstance(cfg, int):
        return cfg
    if args.build_pool:
        from .pool import load_default_pool, save_pool

        items, report = load_default_pool(cfg.pool_size, cfg.pool_seed, cfg.pool_zh_fraction, cfg.check_overlap)
        path = Path(cfg.pool or Path(cfg.out_dir) / "pool.jsonl")
        save_pool(path, items, report)
        print(json.dumps(report.to_dict(), indent=1, ensure_ascii=False))
        print(f"wrote {len(items)} prompts to {path}")
        return 0
    summary = run_resumable(train_stage2, cfg, args)
    if isinstance(summary, int):
        return summary
    print(json.dumps(summary, indent=1))
    return 0


#: Stage2Config fields with their own ``fbs train stage2`` option (the rest: ``--set key=value``).
STAGE2_FLAGS = ("out_dir", "max_steps", "init_from", "model", "pool", "pool_size", "alpha", "beta", "gamma",
                "kl_coef", "lr", "batch_size", "max_new_tokens", "quality", "threads")


def cmd_accept(args: argparse.Namespace) -> int:
    from .accept import PAPER_GRID, AcceptConfig, run_acceptance

    grid = PAPER_GRID
    if args.grid:
        try:
            grid = tuple((float(a), float(b)) for a, b in (pt.split(":") for pt in args.grid.split(",")))
        except ValueError:
            print(f"error: --grid takes ALPHA:BETA,ALPHA:BETA,..., got {args.grid!r}", file=sys.stderr)
            return 2
    try:
        cfg = AcceptConfig(init_from=args.init_from, out_dir=args.out_dir, config=args.config,
                           overrides=tuple(args.set or ()), grid=grid, steps=args.steps, corpus=args.corpus,
                           split=args.split, per_lang=args.per_lang, max_tokens=args.max_tokens, ood=args.ood,
                           ood_limit=args.ood_limit, taus=tuple(float(t) for t in args.taus.split(",") if t.strip()),
                           gate_from=args.gate_from, batch_size=args.batch_size, resamples=args.resamples,
                           seed=args.seed, threads=args.threads)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report = run_acceptance(cfg)
    print((Path(cfg.out_dir) / "acceptance.md").read_text())
    print(report["verdict"])
    return 0


def add_accept_parser(sub: Any) -> argparse.ArgumentParser:
    from .accept import DEFAULT_TAUS

    a = sub.add_parser("stage2-accept", help="Stage-2 acceptance: an (alpha, beta) grid of runs from a Stage-1 export, "
                                             "held-out sweeps, Delta skip of SG+RL over SG no-RL at equal PPL (CI)")
    a.add_argument("--init-from", dest="init_from", required=True, help="Stage-1 export directory (SG no-RL)")
    a.add_argument("--out-dir", dest="out_dir", default="runs/stage2_accept")
    a.add_argument("--config", default="configs/stage2_smollm2.yaml", help="Stage2Config YAML of every run")
    a.add_argument("--set", action="append", metavar="KEY=VALUE", help="Stage2Config override for every run")
    a.add_argument("--grid", help="ALPHA:BETA,... (default: the paper's five points 0.1:0.1,0.05:0.1,0.2:0.1,"
                                  "0.1:0.05,0.1:0.2)")
    a.add_argument("--steps", type=int, default=30, help="PPO steps per grid point (>= 30 for a negative result to count)")
    a.add_argument("--corpus", help="corpus directory (fbs data build): in-domain held-out blocks of --split")
    a.add_argument("--split", default="test")
    a.add_argument("--per-lang", dest="per_lang", type=int, default=16)
    a.add_argument("--max-tokens", dest="max_tokens", type=int, default=512)
    a.add_argument("--ood", action="store_true", help="also the out-of-distribution blocks (fbs.eval.ood)")
    a.add_argument("--ood-limit", dest="ood_limit", type=int, default=16, help="OOD blocks per kind")
    a.add_argument("--taus", default=",".join(str(t) for t in DEFAULT_TAUS))
    a.add_argument("--gate-from", dest="gate_from", type=int, default=128,
                   help="prompt tokens never gated in the held-out scoring (decode-faithful)")
    a.add_argument("--batch-size", dest="batch_size", type=int, default=4, help="blocks per scoring forward")
    a.add_argument("--resamples", type=int, default=1000, help="paired bootstrap resamples over blocks")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--threads", type=int, default=0, help="torch threads of the sweeps (0 = default)")
    a.set_defaults(func=cmd_accept)
    return a


def cmd_report(args: argparse.Namespace) -> int:
    from .report import decomposition_table, grid_table, plot_decomposition, read_log

    parts = []
    for d in args.runs:
        recs = read_log(d)
        parts.append(f"## {d}: reward decomposition over {len(recs)} PPO steps\n\n"
                     + decomposition_table(recs, args.windows))
        png = Path(args.out_dir or d) / f"{Path(d).name}_reward.png"
        if plot_decomposition(recs, png, title=f"Stage-2 reward decomposition ({Path(d).name})"):
            parts.append(f"plot: {png}")
    if len(args.runs) > 1:
        parts.append("## operating points\n\n" + grid_table(args.runs, args.last, args.upto, args.sweep or ()))
    text = "\n\n".join(parts) + "\n"
    print(text)
    if args.out_dir:
        Path(args.out_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.out_dir) / "stage2_report.md").write_text(text)
    return 0


def add_report_parser(sub: Any) -> argparse.ArgumentParser:
    r = sub.add_parser("stage2-report", help="reward decomposition table + plot of Stage-2 runs; several runs "
                                             "(e.g. an alpha/beta grid) also get a side-by-side table")
    r.add_argument("runs", nargs="+", help="Stage-2 run directories (--out-dir of fbs train stage2)")
    r.add_argument("--windows", type=int, default=6, help="rows of the decomposition table (step windows)")
    r.add_argument("--last", type=int, default=5, help="grid table: average over each run's last N steps")
    r.add_argument("--upto", type=int, help="grid table: only steps <= N of every run (compare equal lengths)")
    r.add_argument("--sweep", action="append", metavar="JSON",
                   help="grid table: `fbs eval sweep --checkpoint RUN/final` result of a run (held-out skip %% and "
                        "PPL per tau), repeatable")
    r.add_argument("--out-dir", help="write stage2_report.md and the PNGs here (default: PNGs in each run)")
    r.set_defaults(func=cmd_report)
    return r


def add_stage2_parser(sub: Any) -> argparse.ArgumentParser:
    s = sub.add_parser("stage2", help="Stage-2 PPO fine-tuning of the skip gates (paper §3.1.3); resumes")
    s.add_argument("--config", help="YAML file of Stage2Config fields (e.g. configs/stage2_smollm2.yaml)")
    s.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a field (YAML value), repeatable")
    s.add_argument("--init-from", dest="init_from", help="Stage-1 export directory (runs/stage1/final)")
    s.add_argument("--out-dir", dest="out_dir")
    s.add_argument("--max-steps", dest="max_steps", type=int)
    s.add_argument("--model", help="base model name or HF directory")
    s.add_argument("--pool", help="prompt pool JSONL (default: build into out_dir/pool.jsonl)")
    s.add_argument("--pool-size", dest="pool_size", type=int)
    s.add_argument("--alpha", type=float, help="compute-term weight")
    s.add_argument("--beta", type=float, help="quality-penalty weight")
    s.add_argument("--gamma", type=float, help="discount of the per-token quality reward-to-go")
    s.add_argument("--kl-coef", dest="kl_coef", type=float, help="weight of the KL penalty to the Stage-1 gates")
    s.add_argument("--lr", type=float, help="Adam learning rate of the gates")
    s.add_argument("--batch-size", dest="batch_size", type=int, help="episodes per PPO step (one engine call)")
    s.add_argument("--max-new-tokens", dest="max_new_tokens", type=int, help="decoded tokens per episode")
    s.add_argument("--quality", choices=("kl", "nll"), help="per-token quality signal")
    s.add_argument("--threads", type=int, help="torch threads")
    s.add_argument("--build-pool", action="store_true", help="only build the pool (with its overlap report) and exit")
    s.add_argument("--no-resume", action="store_true", help="ignore checkpoints in out_dir")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    s.set_defaults(func=cmd_stage2)
    return s


def register(subparsers: Any) -> None:
    train = subparsers.choices.get("train")
    if train is not None:
        for action in train._actions:  # argparse keeps the sub-command action here; no public accessor
            if isinstance(action, argparse._SubParsersAction):
                add_stage2_parser(action)
                add_report_parser(action)
                add_accept_parser(action)
                return
    add_stage2_parser(subparsers)
    add_report_parser(subparsers)
    add_accept_parser(subparsers)


def main(argv: list[str] | None = None) -> int:
    import logging

    parser = argparse.ArgumentParser(prog="python -m fbs.rl.cli")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    add_stage2_parser(sub)
    add_report_parser(sub)
    add_accept_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
