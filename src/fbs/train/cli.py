"""``fbs train stage1``: the Stage-1 recipe from a YAML config plus ``--set key=value`` overrides.

``fbs train flexidepth``: the FlexiDepth baseline on the same data and budget (:mod:`fbs.train.flexidepth`).

``fbs train segatron``: the Segatron-style baseline (Group D) at CH's Stage-1 budget (:mod:`fbs.train.segatron`).

``fbs train ablations``: the module ablations of paper §4.3 (:mod:`fbs.train.ablations`).

``fbs train kangaroo`` / ``fbs train draft-search``: the drafts of lossless speculative decoding (Kangaroo's adapter,
Draft&Verify's static skip set; :mod:`fbs.train.speculative`).

``fbs train draft-model`` / ``fbs train medusa``: a distilled draft model and Medusa heads (:mod:`fbs.train.draft_model`).

``fbs train eagle``: EAGLE's draft layer over the frozen model's features (:mod:`fbs.train.eagle`).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .common import config_from_args


def run_resumable(train_fn, cfg, args):
    """``train_fn(cfg, resume=...)``'s summary, or exit code 130 after Ctrl-C (its checkpoint is on disk)."""
    try:
        return train_fn(cfg, resume=not args.no_resume)
    except KeyboardInterrupt:
        print(f"interrupted; checkpoint saved under {cfg.out_dir}/checkpoints (rerun the command to resume)",
              file=sys.stderr)
        return 130


def run_recipe(args: argparse.Namespace, config_cls, flags: tuple[str, ...], train_fn):
    """The config from ``args``, then ``train_fn`` (resumable); prints the summary. Returns (config, summary), or
    an exit code when there is nothing more to report (bad config, ``--print-config``, interrupted)."""
    from .config import TrainConfigError

    cfg = config_from_args(args, config_cls, TrainConfigError, flags)
    if isinstance(cfg, int):
        return cfg
    summary = run_resumable(train_fn, cfg, args)
    if isinstance(summary, int):
        return summary
    print(json.dumps(summary, indent=1))
    return cfg, summary


def cmd_stage1(args: argparse.Namespace) -> int:
    from .config import TrainConfig
    from .stage1 import train

    done = run_recipe(args, TrainConfig, ("out_dir", "max_steps", "trainable", "data", "model"), train)
    if isinstance(done, int):
        return done
    cfg, summary = done
    for r in summary["eval"]:
        print(f"tau {r['tau']:.2f}: skip {100 * r['skip_ratio']:5.1f}% | PPL no-skip {r['ppl_full']:.2f} | "
              f"gate {r['ppl_skip']:.2f} | random {r['ppl_random']:.2f} | oracle {r['ppl_oracle']:.2f} | "
              f"spearman(p, oracle) {r['gate_oracle_spearman']:.3f}")
    print(f"exported to {cfg.out_dir}/final")
    return 0


def cmd_flexidepth(args: argparse.Namespace) -> int:
    from .flexidepth import FlexiDepthTrainConfig, train

    done = run_recipe(args, FlexiDepthTrainConfig, ("out_dir", "max_steps", "data", "model"), train)
    if isinstance(done, int):
        return done
    cfg, summary = done
    ev = summary["eval"]
    print(f"tau {cfg.flexidepth_config().tau:.2f}: skip {100 * ev['skip_ratio']:5.1f}% | PPL {ev['ppl']:.2f} | "
          f"base {ev['ppl_base']:.2f}")
    print(f"exported to {summary['final']}")
    return 0


def cmd_segatron(args: argparse.Namespace) -> int:
    from .segatron import SegatronTrainConfig, train

    done = run_recipe(args, SegatronTrainConfig, ("out_dir", "max_steps", "data", "model"), train)
    if isinstance(done, int):
        return done
    _cfg, summary = done
    ev = summary["eval"]
    print(f"segatron: {summary['steps']} steps / {summary['tokens']:,} tokens, "
          f"{summary['trainable']['total']:,} trainable | PPL {ev['ppl']:.2f} | base {ev['ppl_base']:.2f}")
    print(f"exported to {summary['final']}")
    return 0


def _blocks(args: argparse.Namespace, tokenizer):
    """(train, held-out) token blocks of ``--data`` (wiki_demo, a corpus directory, or the on-policy sequences of
    ``fbs data drafts``)."""
    from ..data.onpolicy import is_sequence_dir, sequence_blocks
    from .data import corpus_blocks, wiki_demo_blocks

    if args.data != "wiki_demo" and is_sequence_dir(args.data):
        sep = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        return sequence_blocks(args.data, args.block_size, args.eval_blocks, sep, args.max_train_blocks)
    if args.data == "wiki_demo":
        data = wiki_demo_blocks(tokenizer, args.block_size, args.eval_blocks)
    else:
        data = corpus_blocks(args.data, tokenizer, args.block_size, args.eval_blocks, args.max_train_blocks)
    return data.train_ids, data.eval_ids


def cmd_kangaroo(args: argparse.Namespace) -> int:
    import torch

    from ..cli_args import load_from_args
    from ..provenance import provenance
    from .speculative import train_kangaroo_adapter

    torch.manual_seed(args.seed)
    model = load_from_args(args).eval()
    train_ids, eval_ids = _blocks(args, model.tokenizer)
    adapter, summary = train_kangaroo_adapter(model, train_ids, args.exit_layer, steps=args.steps, lr=args.lr,
                                              batch_size=args.batch_size, eval_blocks=eval_ids, seed=args.seed,
                                              progress=not args.no_progress)
    meta = {"training": {k: v for k, v in summary.items() if k != "curve"}, "data": args.data,
            "fbs_checkpoint": args.checkpoint or ("fresh" if args.fresh else "shipped"), "provenance": provenance()}
    path = adapter.save(args.out_dir, model.config.base_fingerprint, meta)
    (path / "curve.json").write_text(json.dumps(summary["curve"]))
    print(json.dumps(meta["training"], indent=1))
    print(f"adapter saved to {path}; decode with: fbs generate --kangaroo {path} --draft-stop 0.6 \"PROMPT\"")
    return 0


def cmd_draft_search(args: argparse.Namespace) -> int:
    from ..cli_args import load_from_args
    from ..provenance import provenance
    from .speculative import save_skip_set, search_draft_layers

    model = load_from_args(args).eval()
    _, eval_ids = _blocks(args, model.tokenizer)
    prompts = [row[: args.prompt_len].tolist() for row in eval_ids[: args.prompts]]
    best, history = search_draft_layers(model, prompts, new_tokens=args.new_tokens, gamma=args.draft_tokens,
                                        max_layers=args.max_layers, kv_policy=args.kv_policy or "hole",
                                        progress=not args.no_progress)
    meta = {"prompts": len(prompts), "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
            "data": args.data, "evaluated": len(history)}
    path = save_skip_set(best, args.out, {**meta, "provenance": provenance()})
    print(json.dumps({**meta, "best": best.__dict__}, indent=1))
    print(f"skip set saved to {path}; decode with: fbs generate --draft-layers {path} --draft-stop 0.5 \"PROMPT\"")
    return 0


def _distil(args: argparse.Namespace, what: str) -> int:
    """``fbs train draft-model`` / ``medusa`` / ``eagle``: the resumable distillation of :mod:`fbs.train.draft_model`
    (and :mod:`fbs.train.eagle`)."""
    import torch

    from ..cli_args import load_from_args
    from .draft_model import DistilRecipe, train_draft_model, train_medusa_heads

    torch.manual_seed(args.seed)
    model = load_from_args(args).eval()
    train_ids, eval_ids = _blocks(args, model.tokenizer)
    recipe = DistilRecipe(steps=args.steps, lr=args.lr, warmup=args.warmup, batch_size=args.batch_size,
                          seed=args.seed, checkpoint_every=args.checkpoint_every, max_minutes=args.max_minutes,
                          feature_cache=getattr(args, "feature_cache", False), bf16=args.bf16,
                          shortlist=getattr(args, "shortlist", 0),
                          **({"layers": args.layers} if what == "draft-model" else
                             {"heads": args.heads} if what == "medusa" else {}))
    meta = {"data": args.data, "block_size": args.block_size, "train_blocks": len(train_ids),
            "fbs_checkpoint": args.checkpoint or ("fresh" if args.fresh else "shipped"),
            "command": "fbs train " + what}
    if what == "eagle":
        import functools

        from .eagle import train_eagle

        fn = functools.partial(train_eagle, regression=args.regression)
        meta["regression"] = args.regression
    else:
        fn = train_draft_model if what == "draft-model" else train_medusa_heads
    try:
        summary = fn(model, train_ids, args.out_dir, recipe, eval_blocks=eval_ids, resume=not args.no_resume,
                     progress=not args.no_progress, meta=meta)
    except KeyboardInterrupt:
        print(f"interrupted; checkpoint saved under {args.out_dir}/checkpoints (rerun the command to resume)",
              file=sys.stderr)
        return 130
    print(json.dumps({k: v for k, v in summary.items() if k != "curve"}, indent=1))
    name = {"draft-model": "specdec"}.get(what, what)
    print(f"{what} saved to {args.out_dir}; decode with: fbs generate --draft {name} --draft-path {args.out_dir} "
          "\"PROMPT\"")
    return 0


def cmd_draft_model(args: argparse.Namespace) -> int:
    return _distil(args, "draft-model")


def cmd_medusa(args: argparse.Namespace) -> int:
    return _distil(args, "medusa")


def cmd_eagle(args: argparse.Namespace) -> int:
    return _distil(args, "eagle")


def _distil_arguments(p: argparse.ArgumentParser, steps: int) -> None:
    _draft_arguments(p)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=50, help="linear warm-up steps, then cosine decay")
    p.add_argument("--batch-size", type=int, default=4, help="blocks per step")
    p.add_argument("--checkpoint-every", type=int, default=100, help="steps between resumable checkpoints")
    p.add_argument("--max-minutes", type=float, help="wall-time bound (resumed runs count their earlier time): stop "
                                                     "after the step that crosses it and save the result as is")
    p.add_argument("--out-dir", required=True, help="where the result goes (checkpoints under OUT/checkpoints)")
    p.add_argument("--no-resume", action="store_true", help="ignore checkpoints in out_dir")
    p.add_argument("--bf16", action="store_true", help="matrix products under bfloat16 autocast (fast on CPUs with "
                                                       "AMX / AVX-512 BF16 and on GPUs; losses stay fp32)")


def _feature_draft_arguments(p: argparse.ArgumentParser) -> None:
    """The options of the drafts that learn from the target's features alone (Medusa, EAGLE)."""
    p.add_argument("--feature-cache", action="store_true",
                   help="compute the target's features of every training block once (OUT/features.safetensors) "
                        "instead of a target forward pass per step")
    p.add_argument("--shortlist", type=int, default=0,
                   help="train and decode over the N most frequent tokens of the training data only (FR-Spec / "
                        "EAGLE-3's reduced draft vocabulary: N / V of the LM head's bytes per proposal; 0: all)")


def _draft_arguments(p: argparse.ArgumentParser) -> None:
    from ..cli_args import add_model_arguments

    add_model_arguments(p)
    p.add_argument("--data", default="wiki_demo", help="wiki_demo, a corpus directory from `fbs data build`, or the "
                                                       "on-policy sequences of `fbs data drafts`")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--eval-blocks", type=int, default=8, help="held-out blocks")
    p.add_argument("--max-train-blocks", type=int, help="corpus: read at most this many training blocks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _recipe_arguments(p: argparse.ArgumentParser, config_help: str, set_help: str) -> None:
    """The options of a YAML-configured, resumable recipe (stage1, flexidepth)."""
    p.add_argument("--config", help=config_help)
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help=set_help)
    p.add_argument("--out-dir", dest="out_dir")
    p.add_argument("--max-steps", dest="max_steps", type=int)
    p.add_argument("--data", help="wiki_demo or a corpus directory from `fbs data build`")
    p.add_argument("--model", help="base model name or HF directory")
    p.add_argument("--no-resume", action="store_true", help="ignore checkpoints in out_dir")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("train", help="training recipes")
    sub = p.add_subparsers(dest="train_command", required=True)
    s = sub.add_parser("stage1", help="Stage-1 continual pretraining (paper §3.1.3); resumes from out_dir")
    _recipe_arguments(s, "YAML file of TrainConfig fields (e.g. configs/stage1_smollm2.yaml)",
                      "override a field (YAML value; fbs.FIELD for FBSConfig), repeatable")
    s.add_argument("--trainable", choices=("all", "fbs", "adapters"))
    s.set_defaults(func=cmd_stage1)
    f = sub.add_parser("flexidepth", help="the FlexiDepth baseline: routers + adapters on a frozen base, Stage-1 "
                                          "data and budget (fbs.baselines); resumes from out_dir")
    _recipe_arguments(f, "YAML file of FlexiDepthTrainConfig fields (configs/flexidepth_smollm2.yaml)",
                      "override a field (YAML value; flexidepth.FIELD for FlexiDepthConfig), repeatable")
    f.set_defaults(func=cmd_flexidepth)
    g = sub.add_parser("segatron", help="the Segatron-style baseline (Group D): paragraph / sentence / token-in-"
                                        "sentence embeddings + LoRA, CH's Stage-1 data and budget; resumes from out_dir")
    _recipe_arguments(g, "YAML file of SegatronTrainConfig fields (configs/segatron_smollm2.yaml)",
                      "override a field (YAML value; segatron.FIELD for SegatronConfig), repeatable")
    g.set_defaults(func=cmd_segatron)
    from .ablations import add_arguments as ablation_arguments, cmd_ablations

    a = sub.add_parser("ablations", help="the paper's module ablations (§4.3): -PAW, -CH, -SG, k_max, gate inputs, "
                                         "each trained with one recipe and budget into OUT/<variant> (resumes), then "
                                         "scored by the sweep; writes OUT/ablations.{json,md}")
    _recipe_arguments(a, "YAML file of TrainConfig fields, the recipe of every variant (configs/stage1_smollm2.yaml)",
                      "override a recipe field for every variant (YAML value; fbs.FIELD for FBSConfig), repeatable")
    ablation_arguments(a)
    a.set_defaults(func=cmd_ablations)
    k = sub.add_parser("kangaroo", help="Kangaroo's draft adapter: distil the full model's next-token distribution "
                                        "into one attention layer after the first N layers (fbs.baselines.kangaroo)")
    _draft_arguments(k)
    k.add_argument("--exit-layer", type=int, required=True, help="the draft runs layers 0..N-1, then the adapter")
    k.add_argument("--steps", type=int, default=300)
    k.add_argument("--lr", type=float, default=1e-3)
    k.add_argument("--batch-size", type=int, default=4, help="blocks per step")
    k.add_argument("--out-dir", required=True, help="where the adapter goes (kangaroo.safetensors + kangaroo.json)")
    k.set_defaults(func=cmd_kangaroo)
    d = sub.add_parser("draft-search", help="Draft&Verify's static skip set: greedy search maximising acceptance x "
                                            "speed (cost model) by lossless decoding of held-out prompts")
    _draft_arguments(d)
    d.add_argument("--prompts", type=int, default=4, help="held-out prompts decoded per candidate")
    d.add_argument("--prompt-len", type=int, default=128)
    d.add_argument("--new-tokens", type=int, default=32)
    d.add_argument("--draft-tokens", type=int, default=4, help="gamma of the search's decoding")
    d.add_argument("--max-layers", type=int, help="search this many rounds (skipped layers) even when a round does not improve, keep the best set")
    d.add_argument("--out", required=True, help="JSON file of the chosen set")
    d.set_defaults(func=cmd_draft_search)
    m = sub.add_parser("draft-model", help="speculative decoding's separate draft: a student of every k-th layer of "
                                           "the model, distilled by KL to it at full depth (fbs.baselines.specdec); "
                                           "resumes from out_dir")
    _distil_arguments(m, 2000)
    m.add_argument("--layers", type=int, default=5, help="the student's layers (evenly spaced, first and last)")
    m.set_defaults(func=cmd_draft_model)
    h = sub.add_parser("medusa", help="Medusa-1 heads on the frozen model, self-distilled (fbs.baselines.medusa); "
                                      "resumes from out_dir")
    _distil_arguments(h, 1000)
    _feature_draft_arguments(h)
    h.add_argument("--heads", type=int, default=4, help="K: head k predicts the token k + 2 ahead")
    h.set_defaults(func=cmd_medusa)
    e = sub.add_parser("eagle", help="EAGLE's draft layer over the frozen model's features (fbs.baselines.eagle), "
                                     "feature regression + KL; resumes from out_dir")
    _distil_arguments(e, 1000)
    _feature_draft_arguments(e)
    e.add_argument("--regression", choices=("raw", "normed"), default="normed",
                   help="feature regression after the final norm (normed: what the LM head reads) or on the last "
                        "layer's output itself (raw)")
    e.set_defaults(func=cmd_eagle)
