"""Probe-on-hidden-states BIOS-F1 for any causal LM (paper appendix D.1.2).

The backbone is frozen; a linear probe on the hidden states of one fixed layer is trained to predict
the weak BIOS labels (AdamW, lr 1e-3, weight decay 0, 3 epochs, batches of 64 sequences,
inverse-frequency class weights), then scored with token-level macro-F1 (BIOS-F1), boundary-F1 and
idiom-recognition accuracy.

Idiom recognition task: sentences from the idiom database's usage examples, each containing one idiom
at a known character span. The idiom's gold chunk is its aligned token span (fully contained tokens).
An item counts as recognised when the chunks parsed from the probe's predictions on the sentence
include exactly that token span as one chunk (``B I ... I``, or ``S`` for one token).

Besides the pooled scores, a result keeps what a bootstrap over evaluation blocks and idiom items needs
(``fbs eval ch-table``): the per-block counts of :data:`fbs.data.metrics.COUNT_COLUMNS`, the 0/1 hit of each
idiom item, and a fingerprint of the evaluation data (:func:`eval_fingerprint`).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from fbs.data.bios import Span, align_chunks
from fbs.data.metrics import (COUNT_COLUMNS, IGNORE_INDEX, LABELS, F1Report, parse_chunks, report_from_counts,
                              sequence_counts, sum_counts)

logger = logging.getLogger(__name__)


@dataclass
class ProbeConfig:
    """Probe hyper-parameters; defaults are the paper's."""

    layer: int | None = None  # index into hidden_states; None -> num_hidden_layers // 2
    epochs: int = 3
    batch_size: int = 64  # sequences per optimizer step
    lr: float = 1e-3
    weight_decay: float = 0.0
    class_weights: bool = True  # inverse frequency
    seed: int = 0
    forward_batch_size: int = 8  # sequences per backbone forward (memory only)

    def __post_init__(self):
        if self.epochs < 1 or self.batch_size < 1:
            raise ValueError("epochs and batch_size must be >= 1")


@dataclass
class IdiomItem:
    """One idiom-recognition item: token ids of a sentence and the idiom's gold token span."""

    ids: list[int]
    span: tuple[int, int]
    idiom: str


@dataclass
class ProbeResult:
    """Scores of the probe, and what a bootstrap over evaluation blocks and idiom items needs.

    ``block_counts``: one row per evaluation block, in the order of the evaluation data, of the integer counts
    named by ``block_count_columns`` (:data:`fbs.data.metrics.COUNT_COLUMNS`: tp/fp/fn of B, I, O, S, boundary
    tp/fp/fn, labelled tokens); ``bios`` is :func:`fbs.data.metrics.report_from_counts` of their column sums.
    ``idiom_hits``: 1 if idiom item i was recognised, else 0; ``idiom_accuracy`` is their mean.
    ``eval_fingerprint``: :func:`eval_fingerprint` of the evaluation blocks and idiom items, equal for two
    records exactly when they were scored on the same data (so they can be paired).
    """

    layer: int
    n_train_sequences: int
    n_train_tokens: int
    n_eval_sequences: int
    bios: dict  # F1Report.to_dict()
    idiom_accuracy: float | None
    n_idiom_items: int
    train_loss: list[float] = field(default_factory=list)  # mean loss per epoch
    class_weights: list[float] = field(default_factory=list)
    block_counts: list[list[int]] = field(default_factory=list)
    block_count_columns: list[str] = field(default_factory=lambda: list(COUNT_COLUMNS))
    idiom_hits: list[int] = field(default_factory=list)
    eval_fingerprint: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def resolve_layer(model: torch.nn.Module, layer: int | None) -> int:
    if layer is not None:
        return layer
    n = getattr(getattr(model, "config", None), "num_hidden_layers", None) or getattr(model, "num_layers", None)
    if n is None:
        raise ValueError("model has no config.num_hidden_layers; pass the probe layer explicitly")
    return n // 2


class StopForward(Exception):
    """Raised by the capture hook once the probed layer has run: the layers above it are not needed."""


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The model's decoder-layer list (the ModuleList of ``config.num_hidden_layers`` blocks), if unambiguous."""
    n = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n]
    return lists[0] if len(lists) == 1 else None


@torch.no_grad()
def hidden_features(
    model: torch.nn.Module, sequences: Sequence[Sequence[int]], layer: int, batch_size: int = 8,
    progress: Callable[..., Iterable] = lambda it, **_: it,
) -> list[torch.Tensor]:
    """Hidden states of ``layer`` for each sequence, a list of (len_i, d) float32 tensors.

    ``layer`` indexes HF's ``hidden_states`` (0 = embeddings, i = output of decoder block i). For
    0 < layer < num_hidden_layers the forward stops after block ``layer - 1`` (a hook captures its output
    and aborts the call), so the probe pays for the layers it reads and no more: half the backbone at
    the default middle layer. The last entry of ``hidden_states`` is post-norm in HF models, so it and
    models without a recognisable layer list take the full ``output_hidden_states`` path.

    Sequences are right-padded; a causal model's states at real positions do not depend on the
    padding after them, so no attention mask is needed.
    """
    model.eval()
    device = next(model.parameters()).device
    # HF causal LMs can skip most of the LM head; the states are the same either way.
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    blocks = _decoder_layers(model)
    early = blocks is not None and 0 < layer < len(blocks)
    captured: list[torch.Tensor] = []

    def capture(_module, _args, output):
        captured.append(output[0] if isinstance(output, tuple) else output)
        raise StopForward

    out: list[torch.Tensor] = []
    handle = blocks[layer - 1].register_forward_hook(capture) if early else None
    try:
        for i in progress(range(0, len(sequences), batch_size), desc=f"hidden states (layer {layer})", unit="batch"):
            batch = sequences[i:i + batch_size]
            t = max(len(s) for s in batch)
            ids = torch.zeros(len(batch), t, dtype=torch.long)  # (B, T)
            for b, s in enumerate(batch):
                ids[b, :len(s)] = torch.as_tensor(list(s), dtype=torch.long)
            if early:
                captured.clear()
                try:
                    model(ids.to(device), **extra)
                except StopForward:
                    pass
                hs = captured[0]  # (B, T, d)
            else:
                hs = model(ids.to(device), output_hidden_states=True, **extra).hidden_states[layer]  # (B, T, d)
            out.extend(hs[b, :len(s)].float().cpu() for b, s in enumerate(batch))
    finally:
        if handle is not None:
            handle.remove()
    return out


class _CaptureFBS:
    """A ``mixer`` for :meth:`fbs.model.causal_lm.FBSForCausalLM.forward` that routes nothing (``gate_mode="off"``: every
    layer runs) and keeps ``hidden_states[layer]``, the output of decoder layer ``layer - 1``."""

    def __init__(self, layer: int):
        self.layer, self.state = layer, None

    def route(self, l, x, xn, gated_pos):
        return None

    def observe(self, l, x, out):
        if l == self.layer - 1:
            self.state = out.x  # (B, T, d)
            raise StopForward


@torch.no_grad()
def fbs_hidden_features(
    model: torch.nn.Module, sequences: Sequence[Sequence[int]], layer: int, batch_size: int = 8,
    progress: Callable[..., Iterable] = lambda it, **_: it,
) -> list[torch.Tensor]:
    """:func:`hidden_features` of an FBS model (``fbs probe --checkpoint``): ``hidden_states[layer]`` of its own
    forward, teacher-forced with nothing skipped, so the state carries what PAW and CH add below ``layer``
    and the fine-tuned adapters. The forward stops after decoder layer ``layer - 1``. Right-padded batches
    carry an attention mask (padding takes no part in attention or in the chunk cache)."""
    n = model.num_layers
    if not 0 < layer <= n:
        raise ValueError(f"probe layer {layer} is outside 1..{n} for this FBS model (hidden_states[0] is the embedding)")
    return fbs_teacher_forced(model, sequences, lambda: _CaptureFBS(layer), lambda c: c.state, batch_size,
                              progress, f"FBS hidden states (layer {layer})")


@torch.no_grad()
def fbs_teacher_forced(model, sequences: Sequence[Sequence[int]], make_mixer: Callable, read: Callable,
                       batch_size: int = 8, progress: Callable[..., Iterable] = lambda it, **_: it, desc: str = ""
                       ) -> list[torch.Tensor]:
    """Per sequence, ``read(mixer)[b, :len]`` (float32, CPU) of an FBS model's teacher-forced forward with nothing
    skipped (``gate_mode="off"``), run on right-padded batches with an attention mask and a fresh
    ``make_mixer()`` each; the mixer may stop the forward by raising :class:`StopForward` once it has what
    ``read`` takes. Shared by :func:`fbs_hidden_features` and ``fbs eval ch``."""
    model.eval()
    device = next(model.parameters()).device
    out: list[torch.Tensor] = []
    for i in progress(range(0, len(sequences), batch_size), desc=desc, unit="batch"):
        batch = sequences[i:i + batch_size]
        t = max(len(s) for s in batch)
        ids = torch.zeros(len(batch), t, dtype=torch.long)  # (B, T)
        mask = torch.zeros(len(batch), t, dtype=torch.long)
        for b, s in enumerate(batch):
            ids[b, :len(s)] = torch.as_tensor(list(s), dtype=torch.long)
            mask[b, :len(s)] = 1
        mixer = make_mixer()
        try:
            model(ids.to(device), None if bool(mask.all()) else mask.to(device), gate_mode="off", mixer=mixer)
        except StopForward:
            pass
        got = read(mixer)
        if got is None:
            raise RuntimeError(f"the forward produced nothing to read ({type(mixer).__name__})")
        out.extend(got[b, :len(s)].float().cpu() for b, s in enumerate(batch))
    return out


def inverse_frequency_weights(labels: Sequence[Sequence[int]], num_classes: int = len(LABELS)) -> torch.Tensor:
    """w_c = N / (C * n_c) over labelled tokens; a class absent from training gets weight 0."""
    counts = torch.zeros(num_classes)
    for seq in labels:
        t = torch.as_tensor(list(seq))
        t = t[t != IGNORE_INDEX]
        counts += torch.bincount(t, minlength=num_classes)[:num_classes].float()
    n = counts.sum()
    return torch.where(counts > 0, n / (num_classes * counts.clamp(min=1)), torch.zeros_like(counts))


def train_probe(
    features: Sequence[torch.Tensor], labels: Sequence[Sequence[int]], config: ProbeConfig = ProbeConfig(),
) -> tuple[torch.nn.Linear, list[float], torch.Tensor]:
    """Fit a linear probe on (len_i, d) features; returns (probe, mean loss per epoch, class weights)."""
    if not features:
        raise ValueError("no training sequences for the probe: label the corpus (`fbs data label`) first")
    gen = torch.Generator().manual_seed(config.seed)
    d = features[0].shape[-1]
    probe = torch.nn.Linear(d, len(LABELS))
    with torch.no_grad():  # seeded init, independent of the global RNG
        bound = 1.0 / d ** 0.5
        probe.weight.uniform_(-bound, bound, generator=gen)
        probe.bias.uniform_(-bound, bound, generator=gen)
    weight = inverse_frequency_weights(labels) if config.class_weights else None
    opt = torch.optim.AdamW(probe.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    ys = [torch.as_tensor(list(y), dtype=torch.long) for y in labels]
    losses = []
    for _ in range(config.epochs):
        perm = torch.randperm(len(features), generator=gen).tolist()
        total, steps = 0.0, 0
        for i in range(0, len(perm), config.batch_size):
            idx = perm[i:i + config.batch_size]
            x = torch.cat([features[j] for j in idx])  # (N, d)
            y = torch.cat([ys[j] for j in idx])  # (N,)
            if not bool((y != IGNORE_INDEX).any()):
                continue
            loss = F.cross_entropy(probe(x), y, weight=weight, ignore_index=IGNORE_INDEX)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total, steps = total + float(loss.detach()), steps + 1
        losses.append(total / max(steps, 1))
    return probe, losses, (weight if weight is not None else torch.ones(len(LABELS)))


@torch.no_grad()
def predict(probe: torch.nn.Linear, features: Sequence[torch.Tensor]) -> list[list[int]]:
    return [probe(x).argmax(-1).tolist() for x in features]


def idiom_items(sentences: Iterable[tuple[str, str]], tokenizer: Any, n: int | None = None, seed: int = 0) -> list[IdiomItem]:
    """Idiom-recognition items from ``(sentence, idiom)`` pairs; ``n`` picked by a seeded hash of the pair."""
    from fbs.data.corpus import encode_batch

    pairs = sorted(set(sentences), key=lambda p: hashlib.sha256(f"{seed}:{p[1]}:{p[0]}".encode()).hexdigest())
    items: list[IdiomItem] = []
    for sentence, idiom in pairs:
        k = sentence.find(idiom)
        if k < 0:
            continue
        enc = encode_batch(tokenizer, [sentence])[0]
        al = align_chunks([Span(k, k + len(idiom), "idiom")], enc.offsets)
        inside = [i for i, y in enumerate(al.labels) if y != LABELS.index("O")]
        if not inside:
            continue  # no token fully inside the idiom: the item has no gold chunk
        items.append(IdiomItem(enc.ids, (inside[0], inside[-1] + 1), idiom))
        if n is not None and len(items) >= n:
            break
    return items


def idiom_hits(preds: Sequence[Sequence[int]], items: Sequence[IdiomItem]) -> list[int]:
    """Per item, 1 if its parsed chunks contain the gold idiom span as one chunk, else 0."""
    return [int((it.span[0], it.span[1], "chunk") in set(parse_chunks(p))) for p, it in zip(preds, items, strict=True)]


def idiom_accuracy(preds: Sequence[Sequence[int]], items: Sequence[IdiomItem]) -> float:
    """Share of items whose parsed chunks contain the gold idiom span as one chunk."""
    if not items:
        return float("nan")
    return sum(idiom_hits(preds, items)) / len(items)


def eval_fingerprint(evaluation: Sequence[tuple[Sequence[int], Sequence[int]]], idioms: Sequence[IdiomItem]) -> str:
    """sha256 over the evaluation blocks (token ids and gold labels, in order) and the idiom items (token ids and
    gold span, in order): two records with the same fingerprint were scored on the same blocks and items, so their
    per-block counts and per-item hits can be paired row by row."""
    h = hashlib.sha256(b"fbs-eval-data-v1\n")
    for ids, labels in evaluation:
        h.update(json.dumps([[int(t) for t in ids], [int(y) for y in labels]]).encode() + b"\n")
    h.update(b"idioms\n")
    for it in idioms:
        h.update(json.dumps([[int(t) for t in it.ids], [int(it.span[0]), int(it.span[1])]]).encode() + b"\n")
    return h.hexdigest()


class Scores(NamedTuple):
    """Pooled scores of predictions on evaluation blocks and idiom items, with their per-block/per-item parts."""

    report: F1Report
    idiom_accuracy: float | None  # None without idiom items
    block_counts: list[list[int]]
    idiom_hits: list[int]
    eval_fingerprint: str


def score(preds: Sequence[Sequence[int]], evaluation: Sequence[tuple[Sequence[int], Sequence[int]]],
          idiom_preds: Sequence[Sequence[int]] = (), idioms: Sequence[IdiomItem] = ()) -> Scores:
    """BIOS-F1/boundary-F1 of ``preds`` against the labels of ``evaluation`` and idiom accuracy of ``idiom_preds``
    on ``idioms``, pooled from per-block counts and per-item hits (shared by ``fbs probe`` and ``fbs eval ch``)."""
    counts = sequence_counts(preds, [list(y) for _, y in evaluation])
    hits = idiom_hits(idiom_preds, idioms) if idioms else []
    acc = sum(hits) / len(hits) if idioms else None
    return Scores(report_from_counts(sum_counts(counts)), acc, counts, hits, eval_fingerprint(evaluation, idioms))


_NUMBER_LIST = re.compile(r"\[\n\s*([-+0-9.eE,\s]*?)\n\s*\]")


def dumps_record(record: dict) -> str:
    """JSON text of a result record (indent 2, sorted keys), with every list of plain numbers on one line, so the
    per-block counts take one line per block."""
    text = json.dumps(record, indent=2, sort_keys=True)
    return _NUMBER_LIST.sub(lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text) + "\n"


def run_probe(
    model: torch.nn.Module,
    train: Sequence[tuple[Sequence[int], Sequence[int]]],
    evaluation: Sequence[tuple[Sequence[int], Sequence[int]]],
    idioms: Sequence[IdiomItem] = (),
    config: ProbeConfig = ProbeConfig(),
    progress: Callable[..., Iterable] = lambda it, **_: it,
    features: Callable[..., list[torch.Tensor]] = hidden_features,
) -> ProbeResult:
    """Train the probe on ``train`` (ids, labels) pairs and report BIOS-F1 etc. on ``evaluation``.

    ``features``: :func:`hidden_features` (an HF causal LM) or :func:`fbs_hidden_features` (an FBS model)."""
    layer = resolve_layer(model, config.layer)
    for p in model.parameters():
        p.requires_grad_(False)
    tr_x = features(model, [s for s, _ in train], layer, config.forward_batch_size, progress)
    tr_y = [list(y) for _, y in train]
    probe, losses, weight = train_probe(tr_x, tr_y, config)
    ev_x = features(model, [s for s, _ in evaluation], layer, config.forward_batch_size, progress)
    id_preds: list[list[int]] = []
    if idioms:
        id_x = features(model, [it.ids for it in idioms], layer, config.forward_batch_size, progress)
        id_preds = predict(probe, id_x)
    sc = score(predict(probe, ev_x), evaluation, id_preds, idioms)
    n_tok = sum(int((torch.as_tensor(y) != IGNORE_INDEX).sum()) for y in tr_y)
    logger.info("probe layer %d: BIOS-F1 %.4f, boundary-F1 %.4f, idiom acc %s",
                layer, sc.report.bios_f1, sc.report.boundary_f1, sc.idiom_accuracy)
    return ProbeResult(layer, len(train), n_tok, len(evaluation), sc.report.to_dict(), sc.idiom_accuracy, len(idioms),
                       losses, weight.tolist(), block_counts=sc.block_counts, idiom_hits=sc.idiom_hits,
                       eval_fingerprint=sc.eval_fingerprint)


def corpus_sequences(corpus_dir, split: str, tokenizer: Any, seq_len: int, n: int | None, seed: int = 0
                     ) -> list[tuple[list[int], list[int]]]:
    """``n`` labelled Chinese blocks of ``seq_len`` tokens from a labelled corpus split (seeded choice)."""
    from fbs.data.corpus import PackedBlocks, SourceError

    ds = PackedBlocks(corpus_dir, split, tokenizer, block_size=seq_len, langs=("zh",))
    if ds.chunks is None:
        raise SourceError(f"split {split!r} of {corpus_dir} has no labels: run `fbs data label --corpus {corpus_dir}`")
    blocks = [(b.input_ids.tolist(), b.bios_labels.tolist()) for b in ds]
    if n is not None and n < len(blocks):
        keep = sorted(torch.randperm(len(blocks), generator=torch.Generator().manual_seed(seed))[:n].tolist())
        blocks = [blocks[i] for i in keep]
    return blocks
