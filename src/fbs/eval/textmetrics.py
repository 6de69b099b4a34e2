"""Token-level text metrics of free-running answers: ROUGE-L against a reference answer, and repetition loops.

Both work on token ids (any hashable items), so English and Chinese answers are measured the same way and
no word segmenter is involved.

* **ROUGE-L** (Lin 2004, the F-measure with beta = 1): with ``lcs`` the length of the longest common
  subsequence of candidate ``c`` and reference ``r``, ``P = lcs/|c|``, ``R = lcs/|r|``,
  ``F = 2PR/(P + R)`` (0 when ``lcs = 0``). Two empty sequences score 1, one empty sequence scores 0.
* **Repeated n-gram** (the loop detector, n = 8 by default): an answer "loops" when some n consecutive
  tokens occur at two different start positions ``i < j`` (the occurrences may overlap, so a run of n + 1
  equal tokens counts). Answers with at most n tokens never loop.
* **Cycle at the end** (the strict loop: greedy decoding stuck in a cycle): the last ``window`` (96) tokens are
  periodic with a period ``p <= window // 2``, i.e. ``t[k] == t[k + p]`` for every k of the window but its last
  p. Sequences shorter than ``window`` never end in a cycle.
"""

from __future__ import annotations

from typing import Hashable, Sequence

LOOP_N = 8
CYCLE_WINDOW = 96


def lcs_length(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    """Length of the longest common subsequence (dynamic programming over two rows, O(|a| |b|))."""
    if len(a) < len(b):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(candidate: Sequence[Hashable], reference: Sequence[Hashable]) -> float:
    """ROUGE-L F-measure (beta = 1) of ``candidate`` against ``reference``."""
    if not candidate and not reference:
        return 1.0
    if not candidate or not reference:
        return 0.0
    lcs = lcs_length(candidate, reference)
    if lcs == 0:
        return 0.0
    p, r = lcs / len(candidate), lcs / len(reference)
    return 2 * p * r / (p + r)


def first_repeated_ngram(tokens: Sequence[Hashable], n: int = LOOP_N) -> tuple[int, int] | None:
    """(i, j), i < j, the first pair of start positions with ``tokens[i:i+n] == tokens[j:j+n]`` (smallest j),
    or None."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    seen: dict[tuple, int] = {}
    for j in range(len(tokens) - n + 1):
        gram = tuple(tokens[j:j + n])
        if gram in seen:
            return seen[gram], j
        seen[gram] = j
    return None


def has_repeated_ngram(tokens: Sequence[Hashable], n: int = LOOP_N) -> bool:
    """True when some n-gram of ``tokens`` occurs at two start positions (see the module docstring)."""
    return first_repeated_ngram(tokens, n) is not None


def tail_period(tokens: Sequence[Hashable], window: int = CYCLE_WINDOW) -> int | None:
    """The smallest period p <= window // 2 of the last ``window`` tokens, or None (see the module docstring)."""
    if len(tokens) < window:
        return None
    tail = list(tokens[-window:])
    for p in range(1, window // 2 + 1):
        if tail[p:] == tail[:-p]:
            return p
    return None
