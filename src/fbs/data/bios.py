"""Weak BIOS supervision for Chinese text (paper appendix D.2).

Pipeline, one document at a time:

1. :func:`segment_spans` runs a word segmenter (pkuseg by default) on each Chinese span and keeps
   segments of 2-6 characters that contain no punctuation and are mostly Han (D.2.1).
2. :func:`idiom_spans` finds idiom-lexicon matches and resolves overlaps: the longer idiom wins,
   a tie keeps the earlier one (D.2.2).
3. :func:`resolve_chunks` lets accepted idioms discard every overlapping segment (D.2.2).
4. :func:`align_chunks` maps the character chunks to tokens through the tokenizer's offset mapping:
   only fully contained tokens belong to a chunk, partially overlapping ones stay ``O``, a chunk
   with no token is dropped, and a chunk of one token is ``S``, else ``B I ... I`` (D.2.3).

It also provides the two noise scores of D.2.4 and the CE / CTC objectives with the switch between them.
"""

from __future__ import annotations

import logging
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from fbs.data.metrics import B, I, IGNORE_INDEX, LABELS, O, S

logger = logging.getLogger(__name__)

#: A segmenter maps a string to its words, in order; their concatenation must equal the string
#: up to whitespace (pkuseg drops spaces). Injected so rule tests need no pkuseg.
Segmenter = Callable[[str], list[str]]

Q0 = 0.90  # D.2.4 threshold on the noise score


class Span(NamedTuple):
    """Half-open character interval ``[start, end)`` of a candidate chunk and where it came from."""

    start: int
    end: int
    kind: str  # "seg" (segmenter) or "idiom" (lexicon)


@dataclass(frozen=True)
class SegmentFilter:
    """Which segmenter outputs become candidate chunks (D.2.1)."""

    min_chars: int = 2
    max_chars: int = 6
    #: "predominantly Chinese": strictly more than this share of the characters are Han.
    min_han_ratio: float = 0.5


def is_han(ch: str) -> bool:
    """True for CJK unified ideographs (basic block, extension A, compatibility ideographs)."""
    cp = ord(ch)
    return 0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0xF900 <= cp <= 0xFAFF or 0x20000 <= cp <= 0x2FA1F


def is_punct(ch: str) -> bool:
    """Unicode punctuation (categories P*), which covers both ASCII and full-width CJK marks."""
    return unicodedata.category(ch).startswith("P")


def chinese_spans(text: str) -> list[tuple[int, int]]:
    """Maximal newline-free runs of ``text`` that contain at least one Han character."""
    spans: list[tuple[int, int]] = []
    start = 0
    for line in text.split("\n"):
        if any(is_han(c) for c in line):
            spans.append((start, start + len(line)))
        start += len(line) + 1
    return spans


def word_offsets(text: str, words: Iterable[str]) -> list[tuple[int, int]]:
    """Recover character offsets of ``words`` in ``text`` by left-to-right search.

    Raises ``ValueError`` if a word cannot be found after the previous one, i.e. the segmenter
    changed the text (normalisation) instead of only splitting it.
    """
    out: list[tuple[int, int]] = []
    pos = 0
    for w in words:
        if not w or w.isspace():
            continue
        k = text.find(w, pos)
        if k < 0 or text[pos:k].strip():
            raise ValueError(f"segmenter output {w!r} does not continue the text at offset {pos}")
        out.append((k, k + len(w)))
        pos = k + len(w)
    return out


def keep_segment(word: str, flt: SegmentFilter = SegmentFilter()) -> bool:
    """D.2.1 filter: length in [min, max], no punctuation (or space) inside, mostly Han."""
    if not flt.min_chars <= len(word) <= flt.max_chars:
        return False
    if any(is_punct(c) or c.isspace() for c in word):
        return False
    return sum(is_han(c) for c in word) / len(word) > flt.min_han_ratio


def segment_spans(text: str, segmenter: Segmenter, flt: SegmentFilter = SegmentFilter()) -> list[Span]:
    """Candidate chunks from the segmenter, run separately on each Chinese span of ``text``."""
    spans: list[Span] = []
    for s, e in chinese_spans(text):
        piece = text[s:e]
        for a, b in word_offsets(piece, segmenter(piece)):
            if keep_segment(piece[a:b], flt):
                spans.append(Span(s + a, s + b, "seg"))
    return spans


def pkuseg_segmenter() -> Segmenter:
    """pkuseg's bundled default model as a :data:`Segmenter` (offline)."""
    try:
        import pkuseg
    except ImportError as exc:
        raise ImportError(
            "pkuseg is not installed; run `scripts/install_data_deps.sh .venv/bin/python` "
            "(it needs `pip install --no-build-isolation pkuseg==0.0.25` after numpy and cython)"
        ) from exc
    return pkuseg.pkuseg().cut


class IdiomLexicon:
    """Set of idioms indexed by length for longest-match-first scanning."""

    def __init__(self, idioms: Iterable[str], min_len: int = 4, max_len: int = 4):
        words = {w.strip() for w in idioms}
        self.words = frozenset(w for w in words if min_len <= len(w) <= max_len and all(map(is_han, w)))
        self.lengths = tuple(sorted({len(w) for w in self.words}, reverse=True))

    def __len__(self) -> int:
        return len(self.words)

    def __contains__(self, word: str) -> bool:
        return word in self.words

    def matches(self, text: str) -> list[Span]:
        """Every occurrence of every idiom, longest first at each start position."""
        found = []
        for i in range(len(text)):
            if not is_han(text[i]):
                continue
            for n in self.lengths:
                if text[i:i + n] in self.words:
                    found.append(Span(i, i + n, "idiom"))
        return found


def _overlaps(a: Span | tuple[int, int], b: Span | tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def idiom_spans(text: str, lexicon: IdiomLexicon) -> list[Span]:
    """Non-overlapping idiom spans: greedily accept candidates by (longer first, earlier first).

    This is the fixed rule of D.2.2: among overlapping idioms the longer wins and a tie keeps the
    earlier span. Accepting in that order is what "longest-match-first" scanning means here.
    """
    accepted: list[Span] = []
    for cand in sorted(lexicon.matches(text), key=lambda s: (-(s.end - s.start), s.start)):
        if not any(_overlaps(cand, a) for a in accepted):
            accepted.append(cand)
    return sorted(accepted)


def resolve_chunks(segments: Sequence[Span], idioms: Sequence[Span]) -> list[Span]:
    """Idioms override segments: accepted idioms discard every segment that overlaps them."""
    kept = [s for s in segments if not any(_overlaps(s, i) for i in idioms)]
    return sorted([*kept, *idioms])


def weak_chunks(
    text: str, segmenter: Segmenter | None, lexicon: IdiomLexicon | None, flt: SegmentFilter = SegmentFilter()
) -> list[Span]:
    """Character-level chunks of one document from both weak sources (either may be disabled)."""
    segs = segment_spans(text, segmenter, flt) if segmenter is not None else []
    idioms = idiom_spans(text, lexicon) if lexicon is not None else []
    return resolve_chunks(segs, idioms)


class Alignment(NamedTuple):
    """Token labels of one sequence and the counts behind the coverage score."""

    labels: list[int]  # one id of LABELS per token
    n_chunks: int  # chunks given
    n_dropped: int  # chunks with no fully contained token
    n_touching: int  # tokens intersecting some chunk: the "Chinese-aligned spans" of D.2.4
    n_covered: int  # of those, tokens fully inside a retained chunk
    touched: list[bool]  # per token: intersects some chunk (for per-block coverage)

    @property
    def coverage(self) -> float:
        """Alignment coverage q of D.2.4 (1.0 when no token touches a chunk: nothing to misalign)."""
        return self.n_covered / self.n_touching if self.n_touching else 1.0


def align_chunks(chunks: Sequence[Span | tuple[int, int]], offsets: Sequence[tuple[int, int]]) -> Alignment:
    """Map character chunks onto tokens with offsets ``[a_i, b_i)`` (D.2.3).

    Tokens with an empty span (special tokens, offsets ``(0, 0)``) never belong to a chunk.
    """
    labels = [O] * len(offsets)
    dropped = touching = covered = 0
    touched = [False] * len(offsets)
    starts = [a for a, _ in offsets]
    j0 = 0
    for chunk in sorted(chunks, key=lambda c: (c[0], c[1])):
        s, e = chunk[0], chunk[1]
        while j0 < len(offsets) and offsets[j0][1] <= s and offsets[j0][0] < s:
            j0 += 1  # tokens ending before the chunk can be skipped for all later chunks too
        inside = []
        j = j0
        while j < len(offsets) and starts[j] < e:
            a, b = offsets[j]
            if a < b and a < e and s < b:
                touched[j] = True
                if s <= a and b <= e:
                    inside.append(j)
            j += 1
        if not inside:
            dropped += 1
            continue
        if len(inside) == 1:
            labels[inside[0]] = S
        else:
            labels[inside[0]] = B
            for k in inside[1:]:
                labels[k] = I
        covered += len(inside)
    touching = sum(touched)
    return Alignment(labels, len(chunks), dropped, touching, covered, touched)


def han_token_share(labels: Sequence[int], offsets: Sequence[tuple[int, int]], text: str) -> float:
    """Share of tokens containing a Han character that are inside a chunk (label density, not noise)."""
    han = [i for i, (a, b) in enumerate(offsets) if any(is_han(c) for c in text[a:b])]
    return sum(labels[i] != O for i in han) / len(han) if han else 0.0


# ---------------------------------------------------------------------------------------------
# Objectives (D.2.4): token-level CE, CTC over BIOS sequences, and the switch between them.


def bios_ce_loss(logits: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Token-level cross-entropy of ``logits`` (B, T, 4) against ``labels`` (B, T), -100 ignored."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                           weight=weight, ignore_index=IGNORE_INDEX)


def ctc_targets(labels: Sequence[int]) -> list[int]:
    """CTC target of one labelled sequence: ``O`` is the blank, runs of equal labels collapse.

    ``O O B I I O S S`` -> ``B I S S``. The target keeps the order and kind of chunk events but not
    their exact positions, which is what makes the objective tolerant of boundary shifts.
    """
    out: list[int] = []
    prev = None
    for y in labels:
        y = int(y)
        if y == IGNORE_INDEX:
            continue
        if y != O and y != prev:
            out.append(y)
        prev = y
    return out


def bios_ctc_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """CTC objective over BIOS sequences, ``logits`` (B, T, 4), ``labels`` (B, T) with -100 ignored.

    The 4-way classifier is read as a CTC model whose blank is ``O``: a frame-level path explains the
    pseudo-labels when collapsing repeats and removing ``O`` gives :func:`ctc_targets` of them. Ignored
    positions are removed from the input before the loss. Returns the mean over sequences of the
    negative log-likelihood divided by the sequence's number of labelled tokens; an infeasible
    sequence (e.g. two adjacent ``S`` with no room for a blank) contributes 0 (``zero_infinity``).
    """
    bsz, _, c = logits.shape
    logp = logits.float().log_softmax(-1)  # (B, T, 4)
    valid = labels != IGNORE_INDEX  # (B, T)
    lengths = valid.sum(1)  # (B,)
    t_max = max(int(lengths.max()), 1)
    packed = logp.new_zeros(t_max, bsz, c)  # (T', B, 4), time-major as F.ctc_loss wants
    targets, target_lengths = [], []
    for b in range(bsz):
        n = int(lengths[b])
        packed[:n, b] = logp[b][valid[b]]
        tgt = ctc_targets(labels[b][valid[b]].tolist())
        targets.extend(tgt)
        target_lengths.append(len(tgt))
    keep = lengths > 0
    if not bool(keep.any()):
        return logits.sum() * 0.0
    nll = F.ctc_loss(packed, torch.tensor(targets, dtype=torch.long), lengths.clamp(min=1),
                     torch.tensor(target_lengths, dtype=torch.long), blank=O,
                     reduction="none", zero_infinity=True)  # (B,)
    return (nll[keep] / lengths[keep]).mean()


def confidence_score(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Second q of D.2.4: mean max-class probability over each sequence's labelled tokens, (B,)."""
    conf = logits.detach().float().softmax(-1).amax(-1)  # (B, T)
    valid = (labels != IGNORE_INDEX).float()
    return (conf * valid).sum(1) / valid.sum(1).clamp(min=1.0)


class BIOSLossOutput(NamedTuple):
    total: torch.Tensor  # scalar to back-propagate
    ce: torch.Tensor  # detached CE over the rows that used CE (0 if none)
    ctc: torch.Tensor  # detached CTC over the rows that used CTC (0 if none)
    ctc_fraction: float  # share of rows switched to CTC


def bios_loss(logits: torch.Tensor, labels: torch.Tensor, q: torch.Tensor, q0: float = Q0) -> BIOSLossOutput:
    """The CE/CTC switch of D.2.4: rows with ``q >= q0`` use CE, the others CTC.

    ``q`` (B,) is the per-sequence noise score. The library's default is the alignment coverage
    (:attr:`Alignment.coverage`, stored with each packed block); pass :func:`confidence_score` of the
    same logits for the confidence reading of the paper. The total is the row-count-weighted mean
    of the two parts.
    """
    use_ce = q >= q0  # (B,)
    zero = logits.sum() * 0.0
    ce = bios_ce_loss(logits[use_ce], labels[use_ce]) if bool(use_ce.any()) else zero
    if bool(use_ce.any()) and not bool((labels[use_ce] != IGNORE_INDEX).any()):
        ce = zero  # CE over no labelled token is NaN; such rows carry no signal
    ctc = bios_ctc_loss(logits[~use_ce], labels[~use_ce]) if bool((~use_ce).any()) else zero
    frac = float((~use_ce).float().mean()) if len(q) else 0.0
    total = (1.0 - frac) * ce + frac * ctc
    return BIOSLossOutput(total, ce.detach(), ctc.detach(), frac)


class BIOSLoss(torch.nn.Module):
    """Module wrapper of :func:`bios_loss` (noise score from the batch, or confidence if asked)."""

    def __init__(self, q0: float = Q0, score: str = "coverage"):
        super().__init__()
        if score not in ("coverage", "confidence"):
            raise ValueError(f"score must be 'coverage' or 'confidence', got {score!r}")
        self.q0, self.score = q0, score

    def forward(self, logits: torch.Tensor, labels: torch.Tensor, coverage: torch.Tensor | None = None) -> BIOSLossOutput:
        if self.score == "confidence":
            q = confidence_score(logits, labels)
        elif coverage is None:
            raise ValueError("score='coverage' needs the per-sequence coverage from the data pipeline")
        else:
            q = coverage.to(logits.device)
        return bios_loss(logits, labels, q, self.q0)


__all__ = [
    "LABELS", "B", "I", "O", "S", "Q0", "Span", "SegmentFilter", "Segmenter", "IdiomLexicon", "Alignment",
    "is_han", "is_punct", "chinese_spans", "word_offsets", "keep_segment", "segment_spans", "idiom_spans",
    "resolve_chunks", "weak_chunks", "pkuseg_segmenter", "align_chunks", "han_token_share", "bios_ce_loss", "ctc_targets",
    "bios_ctc_loss", "confidence_score", "bios_loss", "BIOSLoss", "BIOSLossOutput",
]
