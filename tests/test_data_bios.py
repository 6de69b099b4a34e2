"""Weak BIOS labels, alignment, noise scores and the CE/CTC objectives (paper appendix D.2)."""

import importlib.util

import pytest
import torch

from fbs.data.bios import (IdiomLexicon, SegmentFilter, Span, align_chunks, bios_ce_loss, bios_ctc_loss, bios_loss,
                           confidence_score, ctc_targets, idiom_spans, keep_segment, resolve_chunks, segment_spans,
                           weak_chunks, word_offsets)
from fbs.data.metrics import B, I, IGNORE_INDEX, O, S


def fixed_segmenter(words):
    """A segmenter that returns a fixed segmentation for the text it was built for."""
    def seg(text):
        assert "".join(words) == text.replace(" ", "")
        return list(words)
    return seg


def test_idiom_overrides_segmentation():
    text = "他一丝不苟地工作"
    seg = fixed_segmenter(["他", "一丝", "不苟", "地", "工作"])
    chunks = weak_chunks(text, seg, IdiomLexicon(["一丝不苟"]))
    assert chunks == [Span(1, 5, "idiom"), Span(6, 8, "seg")]


def test_accepted_idiom_discards_partially_overlapping_segments():
    segs = [Span(0, 2, "seg"), Span(2, 4, "seg"), Span(4, 6, "seg")]
    assert resolve_chunks(segs, [Span(3, 7, "idiom")]) == [Span(0, 2, "seg"), Span(3, 7, "idiom")]


def test_idiom_tie_keeps_earlier_span():
    lex = IdiomLexicon(["甲乙丙丁", "乙丙丁戊"])
    assert idiom_spans("甲乙丙丁戊", lex) == [Span(0, 4, "idiom")]


def test_longer_idiom_wins():
    lex = IdiomLexicon(["甲乙丙丁", "丙丁戊己庚"], min_len=3, max_len=5)
    assert idiom_spans("甲乙丙丁戊己庚", lex) == [Span(2, 7, "idiom")]
    # non-overlapping matches are all kept, and a chain resolves left to right among equals
    lex4 = IdiomLexicon(["甲乙丙丁", "丁戊己庚", "庚辛壬癸"])
    assert idiom_spans("甲乙丙丁戊己庚辛壬癸", lex4) == [Span(0, 4, "idiom"), Span(6, 10, "idiom")]


def test_lexicon_length_range_and_han_only():
    lex = IdiomLexicon(["一举两得", "三心", "ABCD", "醉翁之意不在酒"])
    assert "一举两得" in lex and len(lex) == 1


def test_segment_filter_rules():
    assert keep_segment("工作")
    assert not keep_segment("我")  # too short
    assert not keep_segment("中华人民共和国")  # 7 > 6
    assert not keep_segment("你好，")  # punctuation inside
    assert not keep_segment("AB公司")  # half Han is not "mostly"
    assert keep_segment("X光片")  # 2/3 Han
    assert not keep_segment("2023年")
    assert keep_segment("中国共产党", SegmentFilter(max_chars=6))


def test_segment_spans_offsets_across_lines_and_spaces():
    text = "hello world\n我们 工作。\n解放思想"
    segs = {"我们 工作。": ["我们", "工作", "。"], "解放思想": ["解放思想"]}
    spans = segment_spans(text, lambda piece: segs[piece])
    assert [(text[s:e], k) for s, e, k in spans] == [("我们", "seg"), ("工作", "seg"), ("解放思想", "seg")]
    with pytest.raises(ValueError, match="does not continue"):
        word_offsets("甲乙", ["丙"])


def test_alignment_partial_token_becomes_o():
    # chunk [0, 4): tokens [0,2) and [2,3) are inside, [3,5) crosses the end -> O
    al = align_chunks([Span(0, 4, "seg")], [(0, 2), (2, 3), (3, 5), (5, 6)])
    assert al.labels == [B, I, O, O]
    assert (al.n_touching, al.n_covered, al.n_dropped) == (3, 2, 0)
    assert al.coverage == pytest.approx(2 / 3)


def test_alignment_chunk_with_no_token_dropped():
    al = align_chunks([Span(1, 3, "seg"), Span(3, 5, "seg")], [(0, 2), (2, 4), (4, 5)])
    # [1,3) has no fully contained token: dropped; [3,5) keeps token [4,5) only -> S
    assert al.labels == [O, O, S]
    assert al.n_dropped == 1


def test_s_versus_b_i_and_special_tokens():
    offsets = [(0, 0), (0, 1), (1, 2), (2, 4), (4, 5)]  # a BOS-like empty token first
    al = align_chunks([Span(0, 2, "seg"), Span(2, 4, "idiom")], offsets)
    assert al.labels == [O, B, I, S, O]
    assert al.coverage == 1.0


def test_real_pkuseg_when_installed():
    if importlib.util.find_spec("pkuseg") is None:
        pytest.skip("pkuseg not installed")
    from fbs.data.bios import pkuseg_segmenter

    text = "他做事一丝不苟，我们要坚持解放思想。"
    chunks = weak_chunks(text, pkuseg_segmenter(), IdiomLexicon(["一丝不苟"]))
    got = [(text[s:e], k) for s, e, k in chunks]
    assert ("一丝不苟", "idiom") in got
    assert all(k == "idiom" or 2 <= e - s <= 6 for s, e, k in chunks)


def test_ctc_targets_collapse_and_blank():
    assert ctc_targets([O, O, B, I, I, O, S, S, IGNORE_INDEX, B, I]) == [B, I, S, B, I]


def _onehot_logits(labels, scale=6.0):
    return scale * torch.nn.functional.one_hot(torch.tensor(labels), 4).float()


def test_ctc_loss_finite_and_lower_for_correct_labelling():
    gold = torch.tensor([[O, B, I, I, O, S, O, B, I, O]])
    wrong = [[B, I, O, S, O, B, I, O, O, S]]
    ctc_good = bios_ctc_loss(_onehot_logits(gold.tolist())[None][0], gold)
    ctc_bad = bios_ctc_loss(_onehot_logits(wrong)[None][0], gold)
    assert torch.isfinite(ctc_good) and torch.isfinite(ctc_bad)
    assert ctc_good < ctc_bad
    # shifting a boundary by one token costs CTC little, CE a lot: CTC tolerates misalignment
    shifted = [[O, O, B, I, O, S, O, B, I, O]]
    assert bios_ctc_loss(_onehot_logits(shifted)[None][0], gold) < 0.5 * bios_ce_loss(
        _onehot_logits(shifted)[None][0], gold)
    logits = torch.randn(2, 10, 4, requires_grad=True)
    labels = torch.cat([gold, torch.full((1, 10), IGNORE_INDEX)])
    loss = bios_ctc_loss(logits, labels)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logits.grad).all()


def test_ce_ignores_unlabelled_and_switch_selects_objective():
    gold = torch.tensor([[O, B, I, IGNORE_INDEX]])
    logits = _onehot_logits([[O, B, I, S]])[None][0]
    assert bios_ce_loss(logits, gold) < 0.01
    batch_logits = torch.randn(2, 4, 4)
    labels = torch.tensor([[O, B, I, O], [S, O, B, I]])
    hi = bios_loss(batch_logits, labels, torch.tensor([0.95, 0.9]))
    lo = bios_loss(batch_logits, labels, torch.tensor([0.5, 0.2]))
    mixed = bios_loss(batch_logits, labels, torch.tensor([0.95, 0.2]))
    assert hi.ctc_fraction == 0.0 and torch.allclose(hi.total, bios_ce_loss(batch_logits, labels))
    assert lo.ctc_fraction == 1.0 and torch.allclose(lo.total, bios_ctc_loss(batch_logits, labels))
    assert mixed.ctc_fraction == 0.5
    conf = confidence_score(_onehot_logits([[O, B, I, S]])[None][0], gold)
    assert conf.shape == (1,) and conf.item() > 0.9
