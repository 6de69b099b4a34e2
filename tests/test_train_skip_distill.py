"""Skip distillation (recipe: skip_distill): the KL term, the loss-aware gate targets and their budget,
the layer-dropout curve, the chat/corpus mix, and a tiny end-to-end run with resume."""

from __future__ import annotations

import math

import pytest
import torch

from fbs.model.causal_lm import SkipTraining
from fbs.train.losses import HarmTargets, kl_loss
from fbs.train.stage1 import Trainer, adapters_disabled, chat_before, drop_depth_curve, is_chat, is_full_depth

from conftest import fbs_tiny, tiny_hf
from test_train_stage1 import tiny_data, tiny_train_config


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest's fixture: tiny models run fastest on one thread


def test_kl_matches_hand_computation_and_its_gradient_points_to_the_teacher():
    t = torch.tensor([[[2.0, 0.0, -1.0]]])
    s = torch.tensor([[[0.0, 1.0, 0.0]]], requires_grad=True)
    pt, ps = t.softmax(-1)[0, 0], s.detach().softmax(-1)[0, 0]
    want = sum(float(pt[i] * (pt[i].log() - ps[i].log())) for i in range(3))
    kl = kl_loss(s, t)
    assert float(kl) == pytest.approx(want, rel=1e-6)
    kl.backward()
    # d KL / d s = p_s - p_t: gradient descent raises the logits the teacher prefers
    assert torch.allclose(s.grad[0, 0], ps - pt, atol=1e-6)
    assert float(kl_loss(t, t)) == pytest.approx(0.0, abs=1e-7)


def _harm_step(ht: HarmTargets, logits: torch.Tensor, harm: torch.Tensor) -> torch.Tensor:
    """Feed ``harm`` as dL/dp into the hook's backward, as the straight-through mixture does."""
    z = logits.clone().requires_grad_(True)
    p = torch.sigmoid(ht(0, z))
    (p * harm).sum().backward()
    return z.grad


def test_harm_targets_give_bce_gradients_towards_the_cheapest_pairs():
    ht = HarmTargets(rate=0.25, weight=1.0)
    ht.threshold = 0.0
    ht.n_pairs = 4
    logits = torch.zeros(1, 4)
    harm = torch.tensor([[-2.0, 3.0, 0.5, -0.1]])  # skipping pairs 0 and 3 lowers the loss
    grad = _harm_step(ht, logits, harm)
    # BCE gradient w.r.t. the logit is (p - y) / n with p = 0.5: targets y = [1, 0, 0, 1]
    assert torch.allclose(grad, torch.tensor([[-0.125, 0.125, 0.125, -0.125]]), atol=1e-6)
    # gradient descent raises the skip logit where skipping is cheap, lowers it where it is harmful
    assert grad[0, 0] < 0 and grad[0, 1] > 0


def test_harm_threshold_tracks_the_budget_quantile():
    ht = HarmTargets(rate=0.3, weight=1.0, momentum=0.0)
    ht.n_pairs = 1000
    g = torch.Generator().manual_seed(0)
    harm = torch.randn(1, 1000, generator=g)
    _harm_step(ht, torch.zeros(1, 1000), harm)
    ht.update()
    assert ht.threshold == pytest.approx(float(torch.quantile(harm, 0.3)), abs=1e-4)
    grad = _harm_step(ht, torch.zeros(1, 1000), harm)
    assert float((grad < 0).float().mean()) == pytest.approx(0.3, abs=0.01)  # 30% are targets
    # pairs that took no part (zero incoming gradient, e.g. before gate_from) are not trained
    harm[0, :10] = 0.0
    assert torch.all(_harm_step(ht, torch.zeros(1, 1000), harm)[0, :10] == 0)


def test_straight_through_gate_gradient_is_the_first_order_harm():
    """With the probe, dL/dg is <dL/dh', h - f(h)>; with straight-through gates the same value reaches p."""
    model = fbs_tiny()
    ids = torch.randint(0, 200, (1, 12))
    b, t, n = 1, 12, model.num_layers
    probe = torch.zeros(b, t, n, requires_grad=True)
    captured = {}

    def hook(layer, z):
        z.retain_grad()
        captured[layer] = z
        return z

    with model.gates.logit_hook(hook):
        out = model(ids, gate_mode="soft", soft_sample="threshold", tau=0.5,
                    skip_training=SkipTraining(probe=probe, detach_gate_inputs=True))
    out.logits.logsumexp(-1).sum().backward()
    for l, z in captured.items():
        p = torch.sigmoid(z.detach())
        assert torch.allclose(z.grad, probe.grad[..., l] * p * (1 - p), atol=1e-7), l


def test_drop_curve_rises_with_depth_on_gated_layers_only():
    model = fbs_tiny(layers=6)  # gated: layers 1..4
    d = drop_depth_curve(model)
    gated = model.layers_cfg.gated
    assert d[0] == 0 and d[5] == 0
    assert float(d[gated[0]]) == 0.0 and float(d[gated[-1]]) == pytest.approx(1.0)
    assert all(d[a] < d[b] for a, b in zip(gated, gated[1:]))
    assert float(d[gated[1]]) == pytest.approx(math.exp(math.log(2) / 3) - 1)


def test_chat_share_is_spread_evenly_and_indices_are_dense():
    share = 0.4
    flags = [is_chat(m, share) for m in range(10)]
    assert sum(flags) == 4
    chat_idx = [chat_before(m, share) for m in range(10) if flags[m]]
    corpus_idx = [m - chat_before(m, share) for m in range(10) if not flags[m]]
    assert chat_idx == list(range(4)) and corpus_idx == list(range(6))


def test_adapters_disabled_computes_the_base_model():
    from fbs.train.adapters import add_adapters

    hf = tiny_hf()
    ids = torch.randint(0, 200, (1, 8))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        add_adapters(hf.model.layers, rank=2)
        for name, p in hf.named_parameters():
            if "lora_b" in name:
                p.normal_()
        assert not torch.allclose(hf(input_ids=ids).logits, ref)
        with adapters_disabled(hf.model.layers):
            assert torch.allclose(hf(input_ids=ids).logits, ref, atol=1e-6)
        assert not torch.allclose(hf(input_ids=ids).logits, ref)


def _distill_cfg(tmp_path, **kw):
    base = dict(recipe="skip_distill", skip_every=0, lambda_lm=0.1, target_skip=0.3, drop_max=0.3, drop_ramp=0.25,
                gate_start=0.25, max_steps=8, batch_tokens=64, eval_every=0, save_every=2, fbs_lr=0.1,
                fbs={**tiny_train_config(tmp_path).fbs, "gate_prev_skip": True, "gate_init_bias": -1.0})
    base.update(kw)
    return tiny_train_config(tmp_path, **base)


def test_skip_distillation_learns_the_budget_and_resumes_exactly(tmp_path):
    data = tiny_data(n=8)
    cfg = _distill_cfg(tmp_path / "a", gate_targets="harm")
    tr = Trainer(cfg, data, base=tiny_hf())
    teacher_before = tr.teacher_logits(data.train_ids[:1])
    hist = tr.run()
    # the teacher stays the base model while the adapters train
    assert torch.allclose(tr.teacher_logits(data.train_ids[:1]), teacher_before, atol=1e-5)
    assert tiny_hf()(input_ids=data.train_ids[:1]).logits.allclose(teacher_before, atol=1e-5)
    gated_share = 0.3 * 6 / 4
    assert hist[-1]["target_rate"] == pytest.approx(gated_share, abs=0.15)
    assert hist[-1]["gate_rate"] > 0.1, "the gates learned to skip towards the budget"
    assert hist[-1]["skip_rate"] >= hist[-1]["gate_rate"] - 1e-6  # gates plus random dropout

    # crash after 4 steps, resume: same parameters as the uninterrupted run
    cfg_b = _distill_cfg(tmp_path / "b", gate_targets="harm")
    crashed = Trainer(cfg_b, data, base=tiny_hf())
    crashed.run(stop_after=4)
    resumed = Trainer(cfg_b, data, base=tiny_hf())
    assert resumed.resume() and resumed.step == 4
    assert resumed.harm.threshold == pytest.approx(crashed.harm.threshold)
    resumed.run()
    for name, p in tr.named.items():
        assert torch.allclose(p, resumed.named[name], atol=1e-6), name


def test_control_never_skips_and_leaves_the_gates_alone(tmp_path):
    data = tiny_data(n=8)
    tr = Trainer(_distill_cfg(tmp_path, control=True, max_steps=3), data, base=tiny_hf())
    gates_before = {n: p.detach().clone() for n, p in tr.model.gates.named_parameters()}
    hist = tr.run()
    assert all(h["skip_rate"] == 0 for h in hist)
    for n, p in tr.model.gates.named_parameters():
        assert torch.equal(p, gates_before[n]), n


def test_full_share_micro_batches_run_every_layer_and_the_others_skip(tmp_path):
    data = tiny_data(n=8)
    cfg = _distill_cfg(tmp_path, full_share=0.5, drop_max=1.0, drop_ramp=0.0, gate_start=0.0, budget_ramp=0.0)
    tr = Trainer(cfg, data, base=tiny_hf())
    kinds = [is_full_depth(m, cfg) for m in range(8)]
    assert sum(kinds) == 4, "half of the micro-batches, spread evenly"
    for m, full in enumerate(kinds):
        rate = float(tr.micro_step(m).skip_rate)
        assert (rate == 0.0) if full else (rate > 0.2), (m, full, rate)


def test_budget_threshold_skips_the_budget_share():
    from fbs.train.losses import BudgetThreshold

    bt = BudgetThreshold(momentum=0.0)
    assert bt.current() == 1.0  # nothing seen yet: the gates do not skip
    p = torch.rand(10_000, generator=torch.Generator().manual_seed(0))
    bt.update(p, 0.3)
    assert float((p > bt.current()).float().mean()) == pytest.approx(0.3, abs=0.002)
    bt.update(p, 0.0)
    assert bt.current() == 1.0


def test_gate_share_ramps_from_gate_start_to_the_budget(tmp_path):
    tr = Trainer(_distill_cfg(tmp_path, gate_start=0.2, budget_ramp=0.4), tiny_data(n=8), base=tiny_hf())
    full = 0.3 * 6 / 4
    assert tr.gate_share(0.1) == 0.0 and tr.gate_share(0.2) == 0.0
    assert tr.gate_share(0.4) == pytest.approx(full / 2) and tr.gate_share(0.9) == pytest.approx(full)


def test_update_targets_teach_the_gates_to_skip_the_smallest_updates(tmp_path):
    """gate_targets=update: BCE towards the pairs with the smallest relative update of the student's own pass."""
    data = tiny_data(n=8)
    tr = Trainer(_distill_cfg(tmp_path, gate_targets="update"), data, base=tiny_hf())
    hist = tr.run()
    assert hist[-1]["gate_rate"] > 0.1
    model = tr.model.eval()
    with torch.no_grad():
        out = model(data.eval_ids, gate_mode="soft", soft_sample="threshold", tau=1.0, gate_from=1)
    mask = torch.zeros_like(out.gate_probs, dtype=torch.bool)
    mask[:, 1:, list(model.layers_cfg.gated)] = True
    p, u = out.gate_probs[mask], out.layer_updates[mask]
    small = u < u.quantile(0.45)
    assert float(p[small].mean()) > float(p[~small].mean())  # higher skip probability where the update is small
