"""The trained chunk head (CH) scored like the linear probe (``fbs eval ch``; paper appendix D, table 4).

``fbs probe`` (:mod:`fbs.data.probe`) trains a linear read-out of a frozen backbone's hidden state against the
weak BIOS labels and scores it with BIOS-F1, boundary-F1 and idiom accuracy. This module scores the BIOS head
of an FBS checkpoint's *trained* CH on exactly the same evaluation data with exactly the same metric functions,
so the two compare row for row:

* **Data.** The probe's own loaders: :func:`fbs.data.probe.corpus_sequences` (labelled Chinese blocks of
  ``seq_len`` tokens of one split; ``n`` of them chosen with ``seed + 1``, the convention of ``fbs probe`` for
  its evaluation split) and :func:`fbs.data.probe.idiom_items` over
  :func:`fbs.data.sources.load_idiom_examples` (``seed``). Same options, same sequences.
* **Predictions.** The argmax of the CH's BIOS logits at its layer, teacher-forced on the gold tokens with
  nothing skipped (``gate_mode="off"``: every layer up to and including the CH layer runs). The CH reads
  RMSNorm_1 of the input of its decoder layer l, i.e. of ``hidden_states[l]``. The layers above the CH layer
  and the LM head cannot change those logits, so the forward stops after the CH layer (as the probe's stops
  after the probed block); ``tests/test_eval_ch.py`` checks the logits against the full forward. Chunk
  boundaries inside the forward are the CH's own predictions (``bios_labels=None``, as at decoding); with a
  single CH layer they cannot affect the scored logits.
* **Metrics.** :func:`fbs.data.metrics.bios_report` (token macro-F1 over B/I/O/S after the D.1.1 fallback,
  boundary-F1 over B/S positions) and :func:`fbs.data.probe.idiom_accuracy` (an item counts when the chunks
  parsed from the predictions on the idiom's sentence include its gold token span as one chunk). The idiom
  test applies to the CH as it is: it needs nothing but a BIOS label per token, which the CH's head gives.
  Both commands score through :func:`fbs.data.probe.score` (per-block counts, pooled: the same numbers).

Nothing is trained here: the probe's ``train_split``/``train_loss``/``class_weights`` have no counterpart.
The record keeps the probe's per-block counts, per-item idiom hits and evaluation fingerprint, so
``fbs eval ch-table`` (:mod:`fbs.eval.ch_table`) can put bootstrap CIs on both and pair them.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from fbs.data.metrics import COUNT_COLUMNS
from fbs.data.probe import (IdiomItem, StopForward, corpus_sequences, dumps_record, fbs_teacher_forced, idiom_items,
                            score)

logger = logging.getLogger(__name__)

PREDICTOR = "trained CH"


@dataclass
class CHResult:
    """The probe's scores (:class:`fbs.data.probe.ProbeResult`'s evaluation fields) for the trained CH.

    ``block_counts`` (one row of ``block_count_columns`` = :data:`fbs.data.metrics.COUNT_COLUMNS` per evaluation
    block), ``idiom_hits`` (0/1 per idiom item) and ``eval_fingerprint`` mean what they mean in ``ProbeResult``.
    """

    layer: int  # decoder layer carrying the CH; it reads RMSNorm_1(hidden_states[layer])
    n_eval_sequences: int
    bios: dict  # F1Report.to_dict()
    idiom_accuracy: float | None
    n_idiom_items: int
    block_counts: list[list[int]] = field(default_factory=list)
    block_count_columns: list[str] = field(default_factory=lambda: list(COUNT_COLUMNS))
    idiom_hits: list[int] = field(default_factory=list)
    eval_fingerprint: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def resolve_ch_layer(model, layer: int | None = None) -> int:
    """The CH layer to score: ``layer`` (negative counts from the top) if it carries a CH, else the first one."""
    layers = tuple(model.layers_cfg.ch)
    if not layers:
        raise ValueError("the model has no CH layers (config ch_layers is empty): there is no trained chunk head "
                         "to score; use `fbs probe` for the backbone alone")
    if layer is None:
        return layers[0]
    absolute = layer + model.num_layers if layer < 0 else layer
    if absolute not in layers:
        raise ValueError(f"layer {layer} carries no CH; the CH layers are {list(layers)}")
    return absolute


class _CaptureCH:
    """A ``mixer`` for :meth:`FBSForCausalLM.forward` that routes nothing and keeps the BIOS logits of ``layer``."""

    def __init__(self, layer: int):
        self.layer, self.logits = layer, None

    def route(self, l, x, xn, gated_pos):
        return None  # the gate mode decides: "off", every layer runs

    def observe(self, l, x, out):
        if l == self.layer:
            self.logits = out.ch.bios_logits  # (B, T, 4)
            raise StopForward  # the layers above cannot change the CH's BIOS logits


@torch.no_grad()
def ch_bios_logits(
    model, sequences: Sequence[Sequence[int]], layer: int, batch_size: int = 8,
    progress: Callable[..., Iterable] = lambda it, **_: it,
) -> list[torch.Tensor]:
    """BIOS logits of the CH at ``layer`` for each sequence, a list of (len_i, 4) float32 tensors.

    Teacher-forced, nothing skipped; right-padded batches carry an attention mask (padding takes no part in
    attention or in the chunk cache)."""
    try:
        return fbs_teacher_forced(model, sequences, lambda: _CaptureCH(layer), lambda c: c.logits, batch_size, progress,
                                  f"CH BIOS logits (layer {layer})")
    except RuntimeError as exc:
        raise RuntimeError(f"layer {layer} produced no BIOS logits: it carries no CH") from exc


def ch_predictions(model, sequences: Sequence[Sequence[int]], layer: int, batch_size: int = 8,
                   progress: Callable[..., Iterable] = lambda it, **_: it) -> list[list[int]]:
    """The CH's BIOS label per token (argmax of its logits; ids into :data:`fbs.data.metrics.LABELS`)."""
    return [x.argmax(-1).tolist() for x in ch_bios_logits(model, sequences, layer, batch_size, progress)]


def run_ch(
    model, evaluation: Sequence[tuple[Sequence[int], Sequence[int]]], idioms: Sequence[IdiomItem] = (),
    layer: int | None = None, batch_size: int = 8, progress: Callable[..., Iterable] = lambda it, **_: it,
) -> CHResult:
    """BIOS-F1, boundary-F1 (on ``evaluation`` (ids, labels) pairs) and idiom accuracy of the trained CH."""
    layer = resolve_ch_layer(model, layer)
    preds = ch_predictions(model, [s for s, _ in evaluation], layer, batch_size, progress)
    id_preds = ch_predictions(model, [it.ids for it in idioms], layer, batch_size, progress) if idioms else []
    sc = score(preds, evaluation, id_preds, idioms)
    logger.info("CH layer %d: BIOS-F1 %.4f, boundary-F1 %.4f, idiom acc %s",
                layer, sc.report.bios_f1, sc.report.boundary_f1, sc.idiom_accuracy)
    return CHResult(layer, len(evaluation), sc.report.to_dict(), sc.idiom_accuracy, len(idioms), sc.block_counts,
                    list(COUNT_COLUMNS), sc.idiom_hits, sc.eval_fingerprint)


def probe_eval_data(corpus_dir, split: str, tokenizer, seq_len: int, n: int | None, n_idioms: int, seed: int = 0):
    """The evaluation data ``fbs probe`` scores with the same options: (blocks, idiom items)."""
    from fbs.data import sources

    blocks = corpus_sequences(corpus_dir, split, tokenizer, seq_len, n, seed + 1)  # `fbs probe`: eval uses seed + 1
    items = idiom_items(sources.load_idiom_examples(), tokenizer, n_idioms, seed) if n_idioms else []
    return blocks, items


# --------------------------------------------------------------------------- CLI


def cmd_ch(args) -> int:
    from fbs.data.cli import progress_bar
    from fbs.data.sources import SourceError
    from fbs.model.loading import choose_checkpoint, load_fbs, shipped_variants

    if args.threads:
        torch.set_num_threads(args.threads)
    progress = (lambda it, **_: it) if args.no_progress else progress_bar
    try:
        ckpt = choose_checkpoint(args.model, args.checkpoint)
        if ckpt is None:
            names = shipped_variants(args.model)
            raise ValueError(f"no trained FBS checkpoint for --model {args.model}: no default weights are shipped for "
                             "it; pass --checkpoint DIR" + (f" or a shipped variant: {', '.join(names)}" if names else ""))
        model = load_fbs(args.model, ckpt)
        layer = resolve_ch_layer(model, args.layer)
        evaluation, items = probe_eval_data(args.corpus, args.eval_split, model.tokenizer, args.seq_len,
                                            args.eval_seqs or None, args.idiom_items, args.seed)
        result = run_ch(model, evaluation, items, layer, args.batch_size, progress)
    except (SourceError, ValueError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = {"model": args.model, "corpus": str(args.corpus), "eval_split": args.eval_split, "seq_len": args.seq_len,
           **result.to_dict(), "predictor": PREDICTOR, "checkpoint": str(ckpt),
           "shipped_checkpoint": args.checkpoint is None,
           "ch_layers": list(model.layers_cfg.ch), "num_layers": model.num_layers,
           "layer_reads": f"RMSNorm_1(hidden_states[{result.layer}]) (the probe's `layer` indexes hidden_states too)",
           "forward": "teacher-forced, gate_mode off (no layer skipped; stops after the CH layer, whose BIOS "
                      "logits the layers above cannot change); chunk boundaries from the CH's own predictions",
           "eval_seqs": args.eval_seqs, "idiom_items": args.idiom_items, "seed": args.seed}
    if args.note:
        out["note"] = args.note
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(dumps_record(out))
    b = result.bios
    acc = result.idiom_accuracy
    print(f"trained CH, layer {result.layer}: BIOS-F1 {b['bios_f1']:.4f}  boundary-F1 {b['boundary_f1']:.4f}  "
          f"idiom acc {acc if acc is None else round(acc, 4)}  (eval {result.n_eval_sequences} seqs / "
          f"{b['n_tokens']} tokens, {result.n_idiom_items} idiom items; {ckpt})")
    return 0


def add_parser(sub) -> None:
    """``fbs eval ch`` (registered by :func:`fbs.eval.cli.register`); data options as ``fbs probe``'s."""
    from fbs.model.bases import DEFAULT_BASE

    p = sub.add_parser("ch", help="BIOS-F1 / boundary-F1 / idiom accuracy of a checkpoint's trained chunk head, "
                                  "on the data and metrics of `fbs probe`")
    p.add_argument("--model", default=DEFAULT_BASE, help="base model: a bundled name or an HF directory")
    p.add_argument("--checkpoint", help="FBS checkpoint directory (default: the weights shipped for --model)")
    p.add_argument("--layer", type=int, default=None, help="CH layer to score (default: the first CH layer)")
    p.add_argument("--corpus", required=True, type=Path, help="labelled corpus directory (`fbs data label`)")
    p.add_argument("--eval-split", default="test")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--eval-seqs", type=int, default=64, help="evaluation sequences (0 = all)")
    p.add_argument("--idiom-items", type=int, default=200, help="idiom-recognition items (0 to skip)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per forward (memory only)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--note", default=None, help="free text stored in the record (e.g. why a subset)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON")
    p.set_defaults(func=cmd_ch)
