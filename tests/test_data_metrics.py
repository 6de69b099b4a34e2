"""BIOS chunk parsing and F1 metrics (paper appendix D.1)."""

import pytest

from fbs.data.metrics import B, I, IGNORE_INDEX, O, S, bios_report, boundary_f1, macro_f1, parse_chunks, repair_labels


def test_parse_chunks_rules():
    #          0  1  2  3  4  5  6
    labels = [B, I, I, O, S, B, O]
    assert parse_chunks(labels) == [(0, 3, "chunk"), (3, 4, "O"), (4, 5, "chunk"), (5, 6, "chunk"), (6, 7, "O")]


def test_invalid_i_falls_back_to_o():
    # leading I, I after O, I after S: all invalid; the I after the repaired I is invalid too
    assert repair_labels([I, O, I, I, S, I, B, I]) == [O, O, O, O, S, O, B, I]
    assert parse_chunks([I, I]) == [(0, 1, "O"), (1, 2, "O")]
    # an ignored position breaks a chunk
    assert repair_labels([B, IGNORE_INDEX, I]) == [B, IGNORE_INDEX, O]


def test_macro_f1_hand_computed():
    gold = [[B, I, O, S]]
    pred = [[B, O, O, S]]
    f1, per = macro_f1(pred, gold)
    # B: 1; I: 0 (missed); O: P=1/2, R=1 -> 2/3; S: 1
    assert per["B"] == pytest.approx(1.0)
    assert per["I"] == pytest.approx(0.0)
    assert per["O"] == pytest.approx(2 / 3)
    assert per["S"] == pytest.approx(1.0)
    assert f1 == pytest.approx((1 + 0 + 2 / 3 + 1) / 4)


def test_macro_f1_repairs_predictions_and_ignores_unlabelled():
    gold = [[O, O, IGNORE_INDEX]]
    pred = [[O, I, B]]  # the I is invalid -> O; the last position is ignored
    _, per = macro_f1(pred, gold)
    assert per["O"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="length"):
        macro_f1([[O]], [[O, O]])


def test_boundary_f1():
    gold = [[B, I, S, O, B, I]]  # boundaries {0, 2, 4}
    pred = [[B, I, O, S, B, I]]  # boundaries {0, 3, 4}
    p, r, f = boundary_f1(pred, gold)
    assert (p, r) == (pytest.approx(2 / 3), pytest.approx(2 / 3))
    assert f == pytest.approx(2 / 3)
    rep = bios_report(pred, gold)
    assert rep.n_tokens == 6 and rep.boundary_f1 == pytest.approx(2 / 3)
