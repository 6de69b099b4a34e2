"""BIOS label space, deterministic chunk parsing and the BIOS-F1 metrics (paper appendix D.1).

Labels are integer ids into :data:`LABELS`; ``IGNORE_INDEX`` (-100) marks positions that carry no
label (English/code text, document separators, padding) and is skipped by every metric.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

LABELS: tuple[str, ...] = ("B", "I", "O", "S")
LABEL2ID: dict[str, int] = {name: i for i, name in enumerate(LABELS)}
B, I, O, S = (LABEL2ID[c] for c in LABELS)
IGNORE_INDEX = -100
EPS = 1e-12  # the paper's epsilon in F1_c = 2PR / (P + R + eps)


def repair_labels(labels: Sequence[int]) -> list[int]:
    """Apply the fallback rule of D.1.1: an ``I`` not preceded by ``B`` or ``I`` becomes ``O``.

    "Preceded" is judged on the *repaired* sequence, so ``O I I`` becomes ``O O O`` and
    ``B I I`` is kept. Ignored positions (-100) break a chunk: an ``I`` after one is invalid.
    """
    out: list[int] = []
    prev = IGNORE_INDEX
    for y in labels:
        y = int(y)
        if y == I and prev not in (B, I):
            y = O
        out.append(y)
        prev = y
    return out


def parse_chunks(labels: Sequence[int]) -> list[tuple[int, int, str]]:
    """Deterministic chunk parsing of D.1.1 into half-open index intervals ``(start, end, kind)``.

    ``kind`` is ``"chunk"`` for a ``S`` or a ``B I*`` run and ``"O"`` for the neutral singleton
    chunks that ``O`` (and an invalid ``I``, after the fallback) produce. Ignored positions
    (-100) produce no chunk.
    """
    ys = repair_labels(labels)
    chunks: list[tuple[int, int, str]] = []
    i, m = 0, len(ys)
    while i < m:
        y = ys[i]
        if y == S:
            chunks.append((i, i + 1, "chunk"))
        elif y == B:
            j = i + 1
            while j < m and ys[j] == I:
                j += 1
            chunks.append((i, j, "chunk"))
            i = j
            continue
        elif y == O:
            chunks.append((i, i + 1, "O"))
        i += 1
    return chunks


@dataclass(frozen=True)
class F1Report:
    """Token-level BIOS-F1 (macro over B/I/O/S) with its per-class parts and the boundary-F1."""

    bios_f1: float
    per_class_f1: dict[str, float]
    boundary_precision: float
    boundary_recall: float
    boundary_f1: float
    n_tokens: int

    def to_dict(self) -> dict:
        return asdict(self)


def _f1(tp: int, fp: int, fn: int) -> tuple[float, float, float]:
    p = tp / (tp + fp) if tp + fp else 0.0
    r = tp / (tp + fn) if tp + fn else 0.0
    return p, r, 2 * p * r / (p + r + EPS)


def macro_f1(
    preds: Sequence[Sequence[int]], golds: Sequence[Sequence[int]], repair: bool = True
) -> tuple[float, dict[str, float]]:
    """Token-level macro-F1 over the four classes (D.1.3), pooled over all sequences.

    Predictions are passed through the fallback rule first (``repair=True``) so that an invalid
    ``I`` counts as the ``O`` that chunk parsing turns it into. A class that occurs in neither
    predictions nor gold gets F1 = 0, exactly as the formula with epsilon gives.
    """
    tp = [0] * len(LABELS)
    fp = [0] * len(LABELS)
    fn = [0] * len(LABELS)
    for pred, gold in zip(preds, golds, strict=True):
        if len(pred) != len(gold):
            raise ValueError(f"prediction length {len(pred)} != gold length {len(gold)}")
        pred = repair_labels(pred) if repair else [int(p) for p in pred]
        for p, g in zip(pred, gold):
            g = int(g)
            if g == IGNORE_INDEX:
                continue
            if p == g:
                tp[g] += 1
            else:
                fn[g] += 1
                if 0 <= p < len(LABELS):
                    fp[p] += 1
    per_class = {c: _f1(tp[k], fp[k], fn[k])[2] for k, c in enumerate(LABELS)}
    return sum(per_class.values()) / len(LABELS), per_class


def boundary_f1(
    preds: Sequence[Sequence[int]], golds: Sequence[Sequence[int]]
) -> tuple[float, float, float]:
    """Set-level precision/recall/F1 of boundary positions (labels B or S), pooled over sequences."""
    tp = fp = fn = 0
    for pred, gold in zip(preds, golds, strict=True):
        pred = repair_labels(pred)
        valid = [int(g) != IGNORE_INDEX for g in gold]
        pset = {i for i, p in enumerate(pred) if valid[i] and p in (B, S)}
        gset = {i for i, g in enumerate(gold) if int(g) in (B, S)}
        tp += len(pset & gset)
        fp += len(pset - gset)
        fn += len(gset - pset)
    return _f1(tp, fp, fn)


def bios_report(preds: Sequence[Sequence[int]], golds: Sequence[Sequence[int]]) -> F1Report:
    """BIOS-F1 and boundary-F1 of predicted against pseudo-labelled sequences."""
    f1, per_class = macro_f1(preds, golds)
    bp, br, bf = boundary_f1(preds, golds)
    n = sum(1 for gold in golds for g in gold if int(g) != IGNORE_INDEX)
    return F1Report(f1, per_class, bp, br, bf, n)
