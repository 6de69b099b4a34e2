"""Each Stage-1 loss term on a tiny case checked by hand."""

from __future__ import annotations

import math

import pytest
import torch

from fbs.train.losses import (LossWeights, Stage1Loss, align_loss, bios_loss, chunk_ids, compute_loss, distill_loss,
                              gate_regularizer, lm_loss, oracle_targets, preview_loss)


def test_lm_loss_is_next_token_ce():
    # V = 3, one sequence [0, 2, 1]: position 0 predicts 2, position 1 predicts 1; the last logit row is unused
    logits = torch.tensor([[[0.0, 0.0, math.log(2.0)], [math.log(3.0), 0.0, 0.0], [9.0, 9.0, 9.0]]])
    ids = torch.tensor([[0, 2, 1]])
    expected = (-math.log(2 / 4) - math.log(1 / 5)) / 2
    assert lm_loss(logits, ids).item() == pytest.approx(expected, rel=1e-6)
    # padding: a masked target is ignored
    mask = torch.tensor([[1, 1, 0]])
    assert lm_loss(logits, ids, mask).item() == pytest.approx(-math.log(2 / 4), rel=1e-6)


def test_bios_loss_ignores_unlabelled_tokens():
    logits = torch.zeros(1, 1, 3, 4)
    logits[0, 0, 1, 2] = math.log(5.0)  # token 1: class O has weight 5 among 1 + 1 + 5 + 1
    labels = torch.tensor([[-100, 2, 0]])
    expected = (-math.log(5 / 8) - math.log(1 / 4)) / 2
    assert bios_loss(logits, labels).item() == pytest.approx(expected, rel=1e-6)
    assert bios_loss(logits, torch.full((1, 3), -100)) is None  # English: nothing to supervise
    assert bios_loss(None, labels) is None


def test_align_cosine_and_infonce():
    tok = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])  # (C=1, B=1, T=2, 2)
    assert align_loss(tok, tok, kind="cosine").item() == pytest.approx(0.0, abs=1e-6)
    chk = torch.tensor([[[[0.0, 1.0], [1.0, 0.0]]]])
    assert align_loss(chk, tok, kind="cosine").item() == pytest.approx(1.0, abs=1e-6)
    # two chunks of one token each: token t scores its own chunk (cos 1) against the other (cos 0)
    boundary = torch.tensor([[[True, True]]])
    tau = 0.5
    expected = -math.log(math.exp(1 / tau) / (math.exp(1 / tau) + math.exp(0.0)))
    assert align_loss(tok, tok, boundary, "infonce", tau).item() == pytest.approx(expected, rel=1e-6)
    # one chunk: no negatives, the only candidate is the own state -> loss 0
    one = torch.tensor([[[True, False]]])
    assert align_loss(tok, tok, one, "infonce", tau).item() == pytest.approx(0.0, abs=1e-6)
    assert chunk_ids(torch.tensor([False, False, True, False])).tolist() == [0, 0, 1, 1]


def test_preview_loss_weights_and_window_credit():
    # one PAW layer, one position, k = 2 horizons, 2 classes; horizon 1 is confident, horizon 2 uniform
    logits = torch.zeros(1, 1, 1, 2, 2)
    logits[0, 0, 0, 0] = torch.tensor([math.log(3.0), 0.0])
    targets = torch.tensor([[[0, 1]]])
    w = torch.tensor([[[[1.0, 0.5]]]], requires_grad=True)
    ce1, ce2 = -math.log(3 / 4), math.log(2.0)
    out = preview_loss(logits, targets, w, credit=0.5)
    assert out.total.item() == pytest.approx((ce1 + 0.5 * ce2 - 0.5 * 1.5) / 2, rel=1e-6)
    assert out.ce.item() == pytest.approx((ce1 + 0.5 * ce2) / 1.5, rel=1e-6)
    out.total.backward()
    # d/dw_r = (CE_r - credit) / #pairs: include the confident horizon (negative), drop the uniform one (positive)
    assert w.grad[0, 0, 0].tolist() == pytest.approx([(ce1 - 0.5) / 2, (ce2 - 0.5) / 2], rel=1e-6)
    # ignored targets contribute neither CE nor credit
    out2 = preview_loss(logits, torch.tensor([[[0, -100]]]), w.detach(), credit=0.5)
    assert out2.total.item() == pytest.approx(ce1 - 0.5, rel=1e-6)
    # the floor adds every horizon's CE with a fixed weight and leaves the window gradient unchanged
    w3 = w.detach().clone().requires_grad_(True)
    out3 = preview_loss(logits, targets, w3, credit=0.5, floor=0.1)
    assert out3.total.item() == pytest.approx(out.total.item() + 0.1 * (ce1 + ce2) / 2, abs=1e-6)
    out3.total.backward()
    torch.testing.assert_close(w3.grad, w.grad)


def test_gate_regularizer_mean_hinge_and_entropy():
    probs = torch.zeros(1, 2, 3)
    probs[..., 1] = 0.7  # layer 1 above the 0.5 budget
    probs[..., 2] = 0.2
    mask = torch.zeros(1, 2, 3, dtype=torch.bool)
    mask[..., 1:] = True
    assert gate_regularizer(probs, mask, 0.5).item() == pytest.approx(0.2 ** 2, rel=1e-5)
    h = lambda p: -(p * math.log(p) + (1 - p) * math.log(1 - p))  # noqa: E731
    got = gate_regularizer(probs, mask, 0.5, entropy_weight=0.1).item()
    assert got == pytest.approx(0.04 + 0.1 * (h(0.7) + h(0.2)) / 2, rel=1e-5)
    assert compute_loss(probs, mask).item() == pytest.approx(0.45, rel=1e-6)


def test_oracle_targets_mark_the_smallest_updates():
    u = torch.tensor([[[0.01, 0.5], [0.02, 0.6], [0.9, 0.03], [0.8, 0.7]]])  # (1, 4, 2)
    mask = torch.ones_like(u, dtype=torch.bool)
    y = oracle_targets(u, mask, rate=0.3, temperature=0.05)
    small = u < 0.04
    assert bool((y[small] > 0.5).all()) and bool((y[~small] < 0.5).all())
    masked = oracle_targets(u, mask & (u < 0.85), rate=0.3)
    assert masked[0, 2, 0].item() == 0.0  # outside the mask -> 0


def test_distill_loss_is_masked_bce():
    p = torch.tensor([[[0.8, 0.3]]])
    y = torch.tensor([[[1.0, 0.0]]])
    m = torch.tensor([[[True, False]]])
    assert distill_loss(p, y, m).item() == pytest.approx(-math.log(0.8), rel=1e-5)


def test_stage1_loss_total_is_the_weighted_sum():
    from fbs.model.causal_lm import FBSOutput

    torch.manual_seed(0)
    b, t, v, l, k, n = 1, 5, 7, 3, 2, 4
    probs = torch.rand(b, t, l) * 0.8 + 0.1
    out = FBSOutput(
        logits=torch.randn(b, t, v), gate_probs=probs, skips=(probs > 0.5).float(),
        preview_logits=torch.randn(1, b, t, k, n + 1), window_k=torch.full((1, b, t), 1.5),
        window_weights=torch.rand(1, b, t, k), bios_logits=torch.randn(1, b, t, 4),
        chunk_boundary=torch.tensor([[[True, False, True, False, False]]]),
        chunk_states=torch.randn(1, b, t, 3), token_chunk_states=torch.randn(1, b, t, 3))
    ids = torch.randint(0, v, (b, t))
    tg = torch.randint(0, n + 1, (b, t, k))
    labels = torch.tensor([[0, 1, -100, 3, 2]])
    mask = torch.ones(b, t, l, dtype=torch.bool)
    y = torch.rand(b, t, l)
    w = LossWeights(bios=0.3, align=0.2, paw=0.4, gate=1.5, compute=0.25, distill=0.7)
    parts = Stage1Loss(w, window_credit=1.0, gate_max_rate=0.3, align_kind="cosine")(
        out, ids, tg, mask, bios_labels=labels, skip_targets=y)
    expected = (parts.lm + 0.3 * parts.bios + 0.2 * parts.align + 0.4 * parts.preview + 1.5 * parts.gate
                - 0.25 * parts.compute + 0.7 * parts.distill)
    assert parts.total.item() == pytest.approx(expected.item(), rel=1e-5)
    assert all(not v.requires_grad for v in parts[1:])
    assert parts.skip_rate.item() == pytest.approx(float((probs > 0.5).float().mean()), rel=1e-6)
