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


#: Column order of the per-sequence counts of :func:`sequence_counts` (and of the ``block_counts`` of
#: ``fbs probe`` / ``fbs eval ch`` records): tp/fp/fn of each BIOS class, the boundary tp/fp/fn, and the
#: number of labelled (not ignored) tokens. Every metric of :class:`F1Report` is a function of their sums.
COUNT_COLUMNS: tuple[str, ...] = (
    *(f"{c}_{k}" for c in LABELS for k in ("tp", "fp", "fn")), "boundary_tp", "boundary_fp", "boundary_fn", "n_tokens")


def _counts(pred: Sequence[int], gold: Sequence[int], repair: bool = True) -> list[int]:
    """The :data:`COUNT_COLUMNS` of one sequence; the single place where predictions meet gold labels.

    Class counts (D.1.3) see the predictions after the fallback rule when ``repair`` (an invalid ``I`` counts as
    the ``O`` chunk parsing makes of it); a prediction outside the label space is a miss but no false positive.
    Boundary counts (positions labelled ``B`` or ``S``) always see repaired predictions. Positions whose gold is
    ``IGNORE_INDEX`` count nowhere.
    """
    if len(pred) != len(gold):
        raise ValueError(f"prediction length {len(pred)} != gold length {len(gold)}")
    fixed = repair_labels(pred)
    scored = fixed if repair else [int(p) for p in pred]
    tp = [0] * len(LABELS)
    fp = [0] * len(LABELS)
    fn = [0] * len(LABELS)
    btp = bfp = bfn = n = 0
    for p, q, g in zip(scored, fixed, gold):
        g = int(g)
        if g == IGNORE_INDEX:
            continue
        n += 1
        if p == g:
            tp[g] += 1
        else:
            fn[g] += 1
            if 0 <= p < len(LABELS):
                fp[p] += 1
        pb, gb = q in (B, S), g in (B, S)
        btp += pb and gb
        bfp += pb and not gb
        bfn += gb and not pb
    return [x for k in range(len(LABELS)) for x in (tp[k], fp[k], fn[k])] + [btp, bfp, bfn, n]


def sequence_counts(preds: Sequence[Sequence[int]], golds: Sequence[Sequence[int]]) -> list[list[int]]:
    """Per sequence, the integer counts of :data:`COUNT_COLUMNS` (BIOS classes scored after the fallback rule).

    The metrics of a set of sequences are :func:`report_from_counts` of the column sums, so a bootstrap over
    sequences needs only these rows, not the predictions.
    """
    return [_counts(pred, gold) for pred, gold in zip(preds, golds, strict=True)]


def sum_counts(rows: Sequence[Sequence[int]]) -> list[int]:
    """Column sums of :func:`sequence_counts` rows (all zeros for no rows): the pooled counts."""
    total = [0] * len(COUNT_COLUMNS)
    for row in rows:
        if len(row) != len(COUNT_COLUMNS):
            raise ValueError(f"a count row has {len(row)} columns, expected {len(COUNT_COLUMNS)} ({COUNT_COLUMNS})")
        total = [a + int(b) for a, b in zip(total, row)]
    return total


def _per_class(counts: Sequence[int]) -> dict[str, float]:
    return {c: _f1(counts[3 * k], counts[3 * k + 1], counts[3 * k + 2])[2] for k, c in enumerate(LABELS)}


def report_from_counts(counts: Sequence[int]) -> F1Report:
    """The :class:`F1Report` of pooled :data:`COUNT_COLUMNS` counts (e.g. :func:`sum_counts` of a resample)."""
    if len(counts) != len(COUNT_COLUMNS):
        raise ValueError(f"{len(counts)} counts, expected {len(COUNT_COLUMNS)} ({COUNT_COLUMNS})")
    per_class = _per_class(counts)
    bp, br, bf = _f1(*counts[12:15])
    return F1Report(sum(per_class.values()) / len(LABELS), per_class, bp, br, bf, int(counts[15]))


def macro_f1(
    preds: Sequence[Sequence[int]], golds: Sequence[Sequence[int]], repair: bool = True
) -> tuple[float, dict[str, float]]:
    """Token-level macro-F1 over the four classes (D.1.3), pooled over all sequences.

    Predictions are passed through the fallback rule first (``repair=True``) so that an invalid
    ``I`` counts as the ``O`` that chunk parsing turns it into. A class that occurs in neither
    predictions nor gold gets F1 = 0, exactly as the formula with epsilon gives.
    """
    per_class = _per_class(sum_counts([_counts(p, g, repair) for p, g in zip(preds, golds, strict=True)]))
    return sum(per_class.values()) / len(LABELS), per_class


def boundary_f1(
    preds: Sequence[Sequence[int]], golds: Sequence[Sequence[int]]
) -> tuple[float, float, float]:
    """Set-level precision/recall/F1 of boundary positions (labels B or S), pooled over sequences."""
    return _f1(*sum_counts(sequence_counts(preds, golds))[12:15])


def bios_report(preds: Sequence[Sequence[int]], golds: Sequence[Sequence[int]]) -> F1Report:
    """BIOS-F1 and boundary-F1 of predicted against pseudo-labelled sequences (pooled per-sequence counts)."""
    return report_from_counts(sum_counts(sequence_counts(preds, golds)))
