"""GSM8K answer extraction on tricky generations."""

import pytest

from fbs.eval.gsm8k import extract_answer, gold_from_solution, is_correct


@pytest.mark.parametrize("text, expected", [
    ("She makes 9 * 2 = $18 every day. So the answer is 18.", "18"),
    ("So the answer is 1,234.", "1234"),                       # thousands separator, sentence period
    ("The answer is $1,000,000.", "1000000"),
    ("The answer is $ 18.00", "18"),                           # dollar + space + trailing zeros
    ("The temperature fell, so the answer is -5 degrees.", "-5"),
    ("He owes -$3.50 in total", "-3.5"),
    ("The answer is 0.75. Question: next one has 12", "0.75"),  # first "answer is", not the later number
    ("First 3 + 4 = 7, then 7 * 2 = 14 apples", "14"),           # no marker: last number
    ("#### 72", "72"),
    ("The answer is: 25%.", "25"),
    ("Answer is 1,2,3", "1"),                                   # a list is not a thousands group
    ("no digits here", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_is_correct_compares_numerically():
    assert is_correct("So the answer is 18.00.", "18")
    assert is_correct("the answer is 1,080", "1080")
    assert not is_correct("So the answer is 17.", "18")
    assert not is_correct("I don't know", "18")
    assert gold_from_solution("Janet sells 9 eggs.\n#### 18") == "18"
