"""The Segatron-style baseline (Group D) scored next to CH (RESULTS.md §4; ``fbs eval segatron``).

Segatron has no BIOS head, so it is scored on the boundary metrics the way RESULTS.md §4 scores every model without
one: **a linear probe on its hidden states**, with exactly ``fbs probe``'s budget and data
(:func:`fbs.data.probe.run_probe`: AdamW lr 1e-3, 3 epochs, batches of 64 sequences, inverse-frequency class
weights, trained on the validation split; the same seeded test blocks and idiom items; ``hidden_states[layer]``,
layer 15 of 30 by default, as the base's probe). The features are Segatron's own forward (segment embeddings and
LoRA included), stopped after decoder layer ``layer - 1``. The record has ``fbs probe``'s fields (per-block counts,
idiom hits, evaluation fingerprint), so ``fbs eval ch-table`` pairs it with the base's probe and the trained CH.

**PPL** (``--ppl-out``): per evaluation block, the summed next-token NLL and the number of predicted tokens of each
model on the same blocks the probe scores (teacher-forced, every position after the first): the Segatron model,
the base (HF, untouched) and the CH model (the FBS checkpoint's forward with nothing skipped, ``gate_mode="off"``,
the forward that scores its CH). PPL = exp(total NLL / total tokens); 95% percentile CIs over 1,000 resamples of the
blocks (:func:`fbs.eval.stats.bootstrap_indices`, seed 0) and, against the base, paired differences on the same
resamples with two-sided p-values and Benjamini-Hochberg q-values. Rows of an earlier ``--ppl-out`` on the same
blocks (same fingerprint) join the table with ``--ppl-rows``, so the models can be run at different times.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

from fbs.cli_args import add_probe_arguments
from fbs.data.probe import StopForward, eval_fingerprint

logger = logging.getLogger(__name__)

PREDICTOR = "linear probe (Segatron)"


@torch.no_grad()
def segatron_hidden_features(model, sequences: Sequence[Sequence[int]], layer: int, batch_size: int = 8,
                             progress: Callable[..., Iterable] = lambda it, **_: it) -> list[torch.Tensor]:
    """``hidden_states[layer]`` of a :class:`fbs.baselines.segatron.Segatron` for each sequence, (len_i, d) float32.

    The forward stops after decoder layer ``layer - 1``. Right-padded batches need no mask: the model is causal and
    so are its segment indices, so padding after a sequence cannot change its states."""
    blocks = model.hf.model.layers
    if not 0 < layer <= len(blocks):
        raise ValueError(f"probe layer {layer} is outside 1..{len(blocks)} (hidden_states[0] is the embedding)")
    model.eval()
    captured: list[torch.Tensor] = []

    def capture(_module, _args, output):
        captured.append(output[0] if isinstance(output, tuple) else output)
        raise StopForward

    out: list[torch.Tensor] = []
    handle = blocks[layer - 1].register_forward_hook(capture)
    try:
        for i in progress(range(0, len(sequences), batch_size), desc=f"Segatron hidden states (layer {layer})",
                          unit="batch"):
            batch = sequences[i:i + batch_size]
            ids = torch.zeros(len(batch), max(len(s) for s in batch), dtype=torch.long)  # (B, T)
            for b, s in enumerate(batch):
                ids[b, :len(s)] = torch.as_tensor(list(s), dtype=torch.long)
            captured.clear()
            try:
                model(ids, logits_to_keep=1)
            except StopForward:
                pass
            out.extend(captured[0][b, :len(s)].float().cpu() for b, s in enumerate(batch))
    finally:
        handle.remove()
    return out


# --------------------------------------------------------------------------- PPL


@torch.no_grad()
def block_nll(logits_of: Callable[[torch.Tensor], torch.Tensor], sequences: Sequence[Sequence[int]],
              batch_size: int = 2, progress: Callable[..., Iterable] = lambda it, **_: it, desc: str = ""
              ) -> tuple[list[float], list[int]]:
    """Per sequence: the summed next-token NLL (float64) of ``logits_of(ids)`` (B, T, V) and the tokens predicted.
    Right-padded batches; only each sequence's own positions are scored (a causal model ignores the padding)."""
    nll, count = [], []
    for i in progress(range(0, len(sequences), batch_size), desc=desc, unit="batch"):
        batch = sequences[i:i + batch_size]
        ids = torch.zeros(len(batch), max(len(s) for s in batch), dtype=torch.long)
        for b, s in enumerate(batch):
            ids[b, :len(s)] = torch.as_tensor(list(s), dtype=torch.long)
        logp = torch.log_softmax(logits_of(ids).float(), dim=-1)  # (B, T, V)
        for b, s in enumerate(batch):
            n = len(s) - 1
            got = logp[b, :n].gather(-1, ids[b, 1:n + 1].unsqueeze(-1)).squeeze(-1)  # (n,)
            nll.append(float(-got.double().sum()))
            count.append(n)
    return nll, count


def ppl_table(rows: Sequence[dict], base_label: str | None = "base", n_resamples: int = 1000, seed: int = 0) -> dict:
    """CIs of each row's PPL and paired differences against ``base_label`` over resampled blocks.

    ``rows``: dicts with ``label``, ``nll`` and ``tokens`` per block (the same blocks, in the same order)."""
    from fbs.eval.stats import bh_adjusted, bootstrap_indices

    n = {len(r["nll"]) for r in rows}
    if len(n) != 1 or n == {0}:
        raise ValueError(f"PPL rows must score the same non-empty set of blocks, got block counts {sorted(n)}")
    idx = bootstrap_indices(n.pop(), n_resamples, seed)  # (R, n)

    def samples(r: dict) -> np.ndarray:
        nll, tok = np.asarray(r["nll"], dtype=np.float64), np.asarray(r["tokens"], dtype=np.float64)
        return np.exp(nll[idx].sum(1) / tok[idx].sum(1))  # (R,)

    def point(r: dict) -> float:
        return math.exp(sum(r["nll"]) / sum(r["tokens"]))

    base = next((r for r in rows if r["label"] == base_label), None)
    out_rows, comparisons = [], []
    for r in rows:
        s = samples(r)
        lo, hi = np.percentile(s, [2.5, 97.5])
        row = {k: v for k, v in r.items() if k not in ("nll", "tokens")}
        row |= {"ppl": point(r), "ci_low": float(lo), "ci_high": float(hi), "n_blocks": len(r["nll"]),
                "n_tokens": int(sum(r["tokens"])), "delta_vs_base": None}
        if base is not None and r is not base:
            d = s - samples(base)
            p = min(1.0, 2.0 * min(float(np.mean(d <= 0)), float(np.mean(d >= 0))))
            dlo, dhi = np.percentile(d, [2.5, 97.5])
            row["delta_vs_base"] = {"delta": point(r) - point(base), "ci_low": float(dlo), "ci_high": float(dhi),
                                    "p_value": p}
            comparisons.append(row["delta_vs_base"])
        out_rows.append(row)
    for c, q in zip(comparisons, bh_adjusted([c["p_value"] for c in comparisons])):
        c["q_value"] = q
    return {"n_resamples": n_resamples, "seed": seed, "base": base_label if base is not None else None,
            "rows": out_rows}


def ppl_markdown(table: dict) -> str:
    lines = ["| model | PPL [95% CI] | Δ PPL vs base [95% CI], q |", "|---|---|---|"]
    for r in table["rows"]:
        d = r["delta_vs_base"]
        delta = "–" if d is None else (f"{d['delta']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}], "
                                       f"q {d['q_value']:.3f}")
        lines.append(f"| {r['label']} | {r['ppl']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}] | {delta} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- CLI


def _ppl_rows(args, segatron, evaluation, fingerprint: str, progress) -> list[dict]:
    seqs = [s for s, _ in evaluation]
    rows = []
    for name in [m.strip() for m in args.ppl_models.split(",") if m.strip()]:
        if name == "segatron":
            if segatron is None:
                raise ValueError("--ppl-models segatron needs --segatron DIR")
            fn, source = (lambda ids: segatron(ids).logits), str(args.segatron)
        elif name == "base":
            from fbs.model.bases import load_base

            hf, _ = load_base(args.model)
            fn, source = (lambda ids, hf=hf: hf(ids).logits), str(args.model)
        elif name == "ch":
            from fbs.model.loading import choose_checkpoint, load_fbs

            ckpt = choose_checkpoint(args.model, args.ch_checkpoint)
            if ckpt is None:
                raise ValueError(f"no trained FBS checkpoint for --model {args.model}; pass --ch-checkpoint DIR")
            fbs = load_fbs(args.model, ckpt).eval()
            fn, source = (lambda ids, m=fbs: m(ids, gate_mode="off").logits), str(ckpt)
        else:
            raise ValueError(f"unknown --ppl-models entry {name!r}: use segatron, base and/or ch")
        nll, tok = block_nll(fn, seqs, args.ppl_batch_size, progress, f"PPL ({name})")
        rows.append({"label": name, "source": source, "eval_fingerprint": fingerprint, "nll": nll, "tokens": tok})
        logger.info("%s: PPL %.3f", name, math.exp(sum(nll) / sum(tok)))
    return rows


def cmd_segatron(args) -> int:
    from fbs.baselines.segatron import Segatron, SegatronError
    from fbs.data.cli import progress_bar
    from fbs.data.probe import ProbeConfig, corpus_sequences, dumps_record, idiom_items, run_probe
    from fbs.data.sources import SourceError, load_idiom_examples
    from fbs.model.bases import load_tokenizer
    from fbs.provenance import provenance

    if args.threads:
        torch.set_num_threads(args.threads)
    progress = (lambda it, **_: it) if args.no_progress else progress_bar
    if not args.probe_out and not args.ppl_out:
        print("error: nothing to do: pass --probe-out (the probe) and/or --ppl-out (PPL)", file=sys.stderr)
        return 2
    try:
        segatron = Segatron.from_pretrained(args.segatron, args.model) if args.segatron else None
        tok = segatron.tokenizer if segatron is not None else load_tokenizer(args.model)
        evaluation = corpus_sequences(args.corpus, args.eval_split, tok, args.seq_len, args.eval_seqs or None,
                                      args.seed + 1)  # `fbs probe`'s evaluation blocks
        if args.probe_out:
            if segatron is None:
                raise ValueError("--probe-out needs --segatron DIR (the model whose states are probed)")
            train = corpus_sequences(args.corpus, args.train_split, tok, args.seq_len, args.train_seqs or None,
                                     args.seed)
            items = idiom_items(load_idiom_examples(), tok, args.idiom_items, args.seed) if args.idiom_items else []
            config = ProbeConfig(layer=args.layer if args.layer is not None else segatron.hf.config.num_hidden_layers
                                 // 2, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, seed=args.seed)
            result = run_probe(segatron, train, evaluation, items, config, progress, segatron_hidden_features)
            rec = {"model": args.model, "corpus": str(args.corpus), "train_split": args.train_split,
                   "eval_split": args.eval_split, "seq_len": args.seq_len, **result.to_dict(),
                   "predictor": PREDICTOR, "checkpoint": str(args.segatron),
                   "features": "hidden_states[layer] of the Segatron model's own forward (segment embeddings and "
                               "LoRA included), teacher-forced",
                   "provenance": provenance()}
            if args.note:
                rec["note"] = args.note
            Path(args.probe_out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.probe_out).write_text(dumps_record(rec))
            b = result.bios
            print(f"Segatron probe, layer {result.layer}: BIOS-F1 {b['bios_f1']:.4f}  boundary-F1 "
                  f"{b['boundary_f1']:.4f}  idiom acc {result.idiom_accuracy}  (eval {result.n_eval_sequences} "
                  f"seqs, {result.n_idiom_items} idiom items)")
        if args.ppl_out:
            fingerprint = eval_fingerprint(evaluation, [])
            rows = []
            for path in args.ppl_rows or []:
                earlier = json.loads(Path(path).read_text())
                for r in earlier["per_block"]:
                    if r["eval_fingerprint"] != fingerprint:
                        raise ValueError(f"{path}: row {r['label']!r} was scored on other blocks (fingerprint "
                                         f"{r['eval_fingerprint'][:12]}, these {fingerprint[:12]}); use the same "
                                         "--corpus/--eval-split/--seq-len/--eval-seqs/--seed and tokenizer")
                    rows.append(r)
            rows += _ppl_rows(args, segatron, evaluation, fingerprint, progress)
            labels = [r["label"] for r in rows]
            if len(set(labels)) != len(labels):
                raise ValueError(f"two PPL rows share a label: {labels}")
            table = ppl_table(rows, "base", args.resamples, args.seed)
            rec = {"model": args.model, "corpus": str(args.corpus), "eval_split": args.eval_split,
                   "seq_len": args.seq_len, "eval_seqs": args.eval_seqs, "seed": args.seed,
                   "eval_fingerprint": fingerprint, "ppl": table, "per_block": rows,
                   "scoring": "teacher-forced next-token NLL of every position after the first of each block; "
                              "PPL = exp(total NLL / total tokens); ch = the FBS checkpoint with nothing skipped",
                   "provenance": provenance()}
            if args.note:
                rec["note"] = args.note
            Path(args.ppl_out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.ppl_out).write_text(dumps_record(rec))
            print(ppl_markdown(table), end="")
    except (SourceError, SegatronError, ValueError, ImportError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def add_parser(sub) -> None:
    """``fbs eval segatron`` (registered by :func:`fbs.eval.cli.register`); data options as ``fbs probe``'s."""
    from fbs.model.bases import DEFAULT_BASE

    p = sub.add_parser("segatron", help="the Segatron baseline next to CH: a linear probe on its hidden states "
                                        "(fbs probe's budget and data) and PPL with CIs against the base and the CH "
                                        "model on the same blocks")
    p.add_argument("--segatron", type=Path, default=None, help="checkpoint of `fbs train segatron` (its final/)")
    p.add_argument("--model", default=DEFAULT_BASE, help="base model: a bundled name or an HF directory")
    p.add_argument("--ch-checkpoint", default=None,
                   help="FBS checkpoint of the CH row of the PPL table (default: the weights shipped for --model)")
    p.add_argument("--corpus", required=True, type=Path, help="labelled corpus directory (`fbs data label`)")
    add_probe_arguments(p)
    p.add_argument("--probe-out", type=Path, default=None, help="run the probe and write its record here")
    p.add_argument("--ppl-out", type=Path, default=None, help="score PPL and write the table here")
    p.add_argument("--ppl-models", default="segatron,base,ch", help="comma-separated: segatron, base, ch")
    p.add_argument("--ppl-rows", type=Path, nargs="*", default=None,
                   help="earlier --ppl-out records on the same blocks whose rows join the table")
    p.add_argument("--ppl-batch-size", type=int, default=2, help="blocks per forward in the PPL pass (memory only)")
    p.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples of the PPL CIs")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--note", default=None, help="free text stored in the records")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_segatron)
