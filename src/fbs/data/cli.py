"""``fbs data build``, ``fbs data label``, ``fbs data stats`` and ``fbs probe``.

:func:`register` adds the commands to the top-level ``fbs`` parser; each handler is a plain function
of the parsed arguments returning an exit code. Run standalone with ``python -m fbs.data.cli``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..cli_args import add_probe_arguments

logger = logging.getLogger(__name__)


def progress_bar(it, desc: str = "", total: int | None = None, unit: str = "it"):
    return tqdm(it, desc=desc, total=total, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=False)


def _load_tokenizer(name: str):
    from fbs.model.bases import load_tokenizer

    return load_tokenizer(name)


def _error(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


# --- handlers --------------------------------------------------------------------------------


def cmd_build(args: argparse.Namespace) -> int:
    from fbs.data.corpus import CorpusConfig, build_corpus
    from fbs.data.sources import SourceError

    try:
        config = CorpusConfig(
            sources=tuple(args.sources.split(",")) if args.sources else CorpusConfig.sources,
            min_tokens=args.min_tokens, near_dup_threshold=args.near_dup, seed=args.seed,
            val_fraction=args.val_fraction, test_fraction=args.test_fraction,
            bundle_chars=args.bundle_chars, max_docs_per_source=args.max_docs_per_source,
        )
        tok = _load_tokenizer(args.tokenizer)
        manifest = build_corpus(args.out, tok, args.tokenizer, config, progress=progress_bar)
    except (SourceError, ValueError, ImportError) as exc:
        return _error(str(exc))
    print(f"corpus written to {args.out}")
    print(f"{'source':<15}{'read':>8}{'short':>8}{'exact':>8}{'near':>8}{'kept':>8}{'tokens':>13}")
    for name, st in manifest["sources"].items():
        print(f"{name:<15}{st['documents_read']:>8}{st['too_short']:>8}{st['exact_duplicates']:>8}"
              f"{st['near_duplicates']:>8}{st['kept']:>8}{st['tokens_kept']:>13,}")
    for split, info in manifest["splits"].items():
        print(f"{split:<11} documents {info['documents']}  tokens {info['tokens']}")
    return 0


def cmd_label(args: argparse.Namespace) -> int:
    from fbs.data.bios import IdiomLexicon, pkuseg_segmenter
    from fbs.data.corpus import SPLITS, label_corpus
    from fbs.data.sources import SourceError, load_idioms

    try:
        lo, _, hi = args.idiom_lengths.partition("-")
        segmenter = None if args.no_pkuseg else pkuseg_segmenter()
        lexicon = None if args.no_idioms else IdiomLexicon(load_idioms(), int(lo), int(hi or lo))
        tok = None if args.tokenizer == "none" else _load_tokenizer(args.tokenizer)
        splits = tuple(args.splits.split(",")) if args.splits else SPLITS
        report = label_corpus(args.corpus, segmenter, lexicon, tok, splits=splits, progress=progress_bar)
    except (SourceError, ValueError, ImportError) as exc:
        return _error(str(exc))
    print(json.dumps(report, indent=2, sort_keys=True))
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    from fbs.data.corpus import SPLITS, label_statistics
    from fbs.data.sources import SourceError

    try:
        tok = _load_tokenizer(args.tokenizer)
        splits = tuple(args.splits.split(",")) if args.splits else SPLITS
        report = {"tokenizer": args.tokenizer, "splits": {
            split: label_statistics(args.corpus, tok, split, args.block_size, progress=progress_bar) for split in splits}}
    except (SourceError, ValueError, ImportError) as exc:
        return _error(str(exc))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    print(f"{'split':<11}{'tokens':>11}{'B':>8}{'I':>8}{'O':>8}{'S':>8}{'dropped':>9}{'q':>8}"
          f"{'blocks':>8}{'q<q0':>8}")
    for split, r in report["splits"].items():
        sh, pb = r["label_share"], r["per_block"]
        below = "-" if pb["below_q0"] is None else f"{pb['below_q0']:.1%}"
        print(f"{split:<11}{r['tokens']:>11,}" + "".join(f"{sh[c]:>8.1%}" for c in "BIOS")
              + f"{r['chunks_dropped']:>9,}{r['coverage_q']:>8.4f}{pb['blocks']:>8}{below:>8}")
    return 0


def cmd_probe(args: argparse.Namespace) -> int:
    import torch

    from fbs.data.probe import (ProbeConfig, corpus_sequences, dumps_record, fbs_hidden_features, hidden_features,
                                idiom_items, run_probe)
    from fbs.data.sources import SourceError, load_idiom_examples

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        if args.checkpoint:  # the backbone of a trained FBS model, its modules and adapters included
            from fbs.model.loading import load_fbs

            model = load_fbs(args.model, args.checkpoint)
            tok, features = model.tokenizer, fbs_hidden_features
        else:
            from fbs.model.bases import load_base

            model, tok = load_base(args.model)
            features = hidden_features
        config = ProbeConfig(layer=args.layer, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                             seed=args.seed)
        train = corpus_sequences(args.corpus, args.train_split, tok, args.seq_len, args.train_seqs or None, args.seed)
        evaluation = corpus_sequences(args.corpus, args.eval_split, tok, args.seq_len, args.eval_seqs or None,
                                      args.seed + 1)
        items = idiom_items(load_idiom_examples(), tok, args.idiom_items, args.seed) if args.idiom_items else []
        result = run_probe(model, train, evaluation, items, config, progress=progress_bar, features=features)
    except (SourceError, ValueError, ImportError, FileNotFoundError) as exc:
        return _error(str(exc))
    out = {"model": args.model, "corpus": str(args.corpus), "train_split": args.train_split,
           "eval_split": args.eval_split, "seq_len": args.seq_len, **result.to_dict()}
    if args.checkpoint:
        out |= {"checkpoint": str(args.checkpoint),
                "features": "hidden_states[layer] of the FBS model's own forward (adapters, PAW and CH included), "
                            "teacher-forced, nothing skipped"}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(dumps_record(out))
    b = result.bios
    print(f"layer {result.layer}: BIOS-F1 {b['bios_f1']:.4f}  boundary-F1 {b['boundary_f1']:.4f}  "
          f"idiom acc {result.idiom_accuracy if result.idiom_accuracy is None else round(result.idiom_accuracy, 4)}"
          f"  (train {result.n_train_sequences} seqs / {result.n_train_tokens} tokens, "
          f"eval {result.n_eval_sequences} seqs, {result.n_idiom_items} idiom items)")
    print("per-class F1: " + "  ".join(f"{c} {v:.4f}" for c, v in b["per_class_f1"].items()))
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from fbs.data import chat
    from fbs.data.sources import SourceError

    try:
        items = chat.load_items(args.langs.split(","))
    except (SourceError, ValueError) as exc:
        return _error(str(exc))
    train, held = chat.split(items, seed=args.seed)
    if args.answers:
        from fbs import FBSForCausalLM

        model = FBSForCausalLM.from_base(args.model).eval()
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        # the first --answers training items of each language, in hash order (a seeded, language-stratified sample)
        per_lang = {lang: sorted((it for it in train if it.lang == lang), key=lambda it: chat._rank(it.id, args.seed + 1))
                    for lang in {it.lang for it in train}}
        share = {lang: round(args.answers * len(v) / len(train)) for lang, v in per_lang.items()}
        pick = [it for lang, v in per_lang.items() for it in v[:share[lang]]]
        answers = chat.base_answers(model, model.tokenizer, pick, args.max_new_tokens, args.batch_size, progress_bar)
        for it, a in zip(pick, answers):
            it.base_answer = a
    chat.write_items(args.out / "train.jsonl", train)
    chat.write_items(args.out / "heldout.jsonl", held)
    n_ans = sum(it.base_answer is not None for it in train)
    print(f"chat data written to {args.out}: {len(train)} training items ({n_ans} with the base model's answer), "
          f"{len(held)} held-out prompts ({', '.join(f'{l} {sum(it.lang == l for it in held)}' for l in sorted({it.lang for it in held}))})")
    return 0


def cmd_drafts(args: argparse.Namespace) -> int:
    import torch

    from fbs.cli_args import load_from_args
    from fbs.data import onpolicy
    from fbs.data.sources import SourceError

    if args.threads:
        torch.set_num_threads(args.threads)
    langs = tuple(x for x in args.langs.split(",") if x)
    try:
        model = load_from_args(args).eval()
        items = onpolicy.prompts(model.tokenizer, langs, args.code_items, args.seed, args.chat_items,
                                 args.max_prompt_tokens)
    except (SourceError, ValueError, FileNotFoundError) as exc:
        return _error(str(exc))
    from fbs.model.loading import choose_checkpoint

    ckpt = choose_checkpoint(args.model, args.checkpoint, shipped=not args.fresh)
    meta = {"model": args.model, "fbs_checkpoint": str(ckpt) if ckpt else "none: a fresh FBS (the base model's outputs)",
            "langs": list(langs), "chat_items": args.chat_items, "code_items": args.code_items, "seed": args.seed,
            "max_prompt_tokens": args.max_prompt_tokens, "decode": "greedy, full depth, weights=auto",
            "command": (f"fbs data drafts --out {args.out} --langs {args.langs} --code-items {args.code_items} "
                        + (f"--chat-items {args.chat_items} " if args.chat_items is not None else "")
                        + f"--max-new-tokens {args.max_new_tokens} --max-prompt-tokens {args.max_prompt_tokens} "
                        f"--batch-size {args.batch_size} --seed {args.seed}"
                        + (f" --checkpoint {args.checkpoint}" if args.checkpoint else ""))}
    try:
        info = onpolicy.build(model, args.out, items, args.max_new_tokens, args.batch_size, progress_bar, meta)
    except KeyboardInterrupt:
        print(f"interrupted; the finished batches are in {args.out / onpolicy.SEQUENCES} (rerun to resume)",
              file=sys.stderr)
        return 130
    print(f"{info['sequences']} sequences ({info['by_kind']['chat']} chat, {info['by_kind']['code']} code), "
          f"{info['answer_tokens']:,} answer tokens, written to {args.out}; train a draft on them with "
          f"`fbs train eagle --data {args.out}` (or medusa, draft-model)")
    return 0


# --- parser ----------------------------------------------------------------------------------


def register(subparsers: Any) -> None:
    """Add ``data {build,label,stats,chat}`` and ``probe`` to the top-level ``fbs`` sub-parsers."""
    from fbs.data.corpus import CorpusConfig

    d = CorpusConfig()
    data = subparsers.add_parser("data", help="build training corpora and weak BIOS labels")
    sub = data.add_subparsers(dest="data_command", required=True)

    b = sub.add_parser("build", help="build the deduplicated, split corpus from the offline sources")
    b.add_argument("--out", required=True, type=Path, help="output directory")
    b.add_argument("--tokenizer", default="smollm2-135m", help="tokenizer for the length filter (fbs.model.bases name or path)")
    b.add_argument("--sources", default=None, help=f"comma-separated subset of: {','.join(d.sources)}")
    b.add_argument("--min-tokens", type=int, default=d.min_tokens)
    b.add_argument("--near-dup", type=float, default=d.near_dup_threshold, help="drop above this MinHash similarity")
    b.add_argument("--seed", type=int, default=d.seed, help="seed of the document split")
    b.add_argument("--val-fraction", type=float, default=d.val_fraction)
    b.add_argument("--test-fraction", type=float, default=d.test_fraction)
    b.add_argument("--bundle-chars", type=int, default=d.bundle_chars, help="size of bundled short-record documents")
    b.add_argument("--max-docs-per-source", type=int, default=None, help="cap per source, for quick builds")
    b.set_defaults(func=cmd_build)

    lab = sub.add_parser("label", help="weak BIOS labels (pkuseg + idiom lexicon) for the Chinese documents")
    lab.add_argument("--corpus", required=True, type=Path, help="directory written by `fbs data build`")
    lab.add_argument("--tokenizer", default="smollm2-135m", help="tokenizer for label statistics, or 'none'")
    lab.add_argument("--splits", default=None, help="comma-separated splits (default: all)")
    lab.add_argument("--idiom-lengths", default="4-4", help="idiom lengths to match, e.g. 4-4 or 3-5")
    lab.add_argument("--no-pkuseg", action="store_true", help="idiom-only supervision (ablation)")
    lab.add_argument("--no-idioms", action="store_true", help="pkuseg-only supervision (ablation)")
    lab.set_defaults(func=cmd_label)

    st = sub.add_parser("stats", help="label statistics of a labelled corpus under any tokenizer (B/I/O/S, q, CE/CTC)")
    st.add_argument("--corpus", required=True, type=Path, help="directory labelled by `fbs data label`")
    st.add_argument("--tokenizer", default="smollm2-135m", help="fbs.model.bases name or HF directory")
    st.add_argument("--splits", default=None, help="comma-separated splits (default: all)")
    st.add_argument("--block-size", type=int, default=512, help="training block length for per-block coverage")
    st.add_argument("--out", type=Path, default=None, help="write the statistics as JSON")
    st.set_defaults(func=cmd_stats)

    c = sub.add_parser("chat", help="chat instruction data (Alpaca demos): training items with the base model's "
                                     "greedy answers, and the held-out prompts of `fbs eval chat`")
    c.add_argument("--out", required=True, type=Path, help="output directory (train.jsonl, heldout.jsonl)")
    c.add_argument("--model", default="smollm2-135m", help="base model whose greedy answers are recorded")
    c.add_argument("--langs", default="en,zh", help="comma-separated languages")
    c.add_argument("--answers", type=int, default=256, help="training items that get the base model's answer (0: none)")
    c.add_argument("--max-new-tokens", type=int, default=160, help="length cap of the base model's answers")
    c.add_argument("--batch-size", type=int, default=8, help="prompts decoded together")
    c.add_argument("--seed", type=int, default=0, help="seed of the held-out split")
    c.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    c.set_defaults(func=cmd_chat)

    from fbs.cli_args import add_model_arguments

    dr = sub.add_parser("drafts", help="on-policy draft data: the model's own greedy answers (full depth) to the "
                                       "Alpaca training prompts and to code edits of standard-library functions "
                                       "(fbs.data.onpolicy), for `fbs train eagle / medusa / draft-model --data`")
    add_model_arguments(dr)
    dr.add_argument("--out", required=True, type=Path, help="output directory (sequences.jsonl, meta.json); resumes")
    dr.add_argument("--langs", default="en,zh", help="chat languages, comma-separated ('' for none)")
    dr.add_argument("--chat-items", type=int, help="at most this many chat prompts (a seeded sample; default: all "
                                                    "training items of --langs)")
    dr.add_argument("--code-items", type=int, default=800, help="code-edit prompts (0 for none)")
    dr.add_argument("--max-new-tokens", type=int, default=256, help="length cap of an answer")
    dr.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts are left out")
    dr.add_argument("--batch-size", type=int, default=8, help="prompts decoded together")
    dr.add_argument("--seed", type=int, default=0, help="seed of the code prompts' choice")
    dr.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    dr.set_defaults(func=cmd_drafts)

    p = subparsers.add_parser("probe", help="BIOS-F1 of a frozen causal LM with a linear probe on hidden states")
    p.add_argument("--model", default="smollm2-135m", help="fbs.model.bases name or HF directory")
    p.add_argument("--corpus", required=True, type=Path, help="labelled corpus directory")
    p.add_argument("--checkpoint", default=None,
                   help="probe a trained FBS checkpoint's hidden states instead of the frozen base's (e.g. a model "
                        "fine-tuned without CH: the paper's 'w/o CH' row; its base is --model)")
    add_probe_arguments(p)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON")
    p.set_defaults(func=cmd_probe)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fbs")
    parser.add_argument("-v", "--verbose", action="store_true")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
