"""Distilled drafts (fbs.train.draft_model): the draft-model student and Medusa heads, on a tiny random model.

Oracles: the held-out KL to the target before and after a short run (it must fall), an uninterrupted run (a run
stopped after a checkpoint and resumed must end with the same weights), the target's layers (the student's are
copies), and full-depth greedy decoding (the saved artifacts decode losslessly)."""

import pytest
import torch

import fbs.baselines  # noqa: F401  (registers the file loaders of specdec / medusa)
from conftest import fbs_tiny, randomize
from fbs.baselines.medusa import MedusaHeads
from fbs.baselines.specdec import load_draft_model, student_from_target, student_layers
from fbs.model.errors import CheckpointError
from fbs.train.draft_model import DistilRecipe, train_draft_model, train_medusa_heads


def _target():
    return randomize(fbs_tiny("llama", seed=1), seed=3).eval()


def _blocks(model, n=8, t=24):
    return model.generate(torch.randint(0, 255, (n, 4), generator=torch.Generator().manual_seed(0)),
                          max_new_tokens=t - 4, ignore_eos=True, force_compute=True, do_sample=True,
                          seed=0).sequences


def test_student_copies_every_kth_layer_of_the_target():
    assert student_layers(30, 5) == [0, 7, 14, 22, 29] and student_layers(6, 2) == [0, 5]
    target = _target()
    student, layers = student_from_target(target, 3)
    assert layers == [0, 2, 5] and student.config.num_hidden_layers == 3
    src = target.base.hf.model.layers
    for i, l in enumerate(layers):
        for (name, p), (_, q) in zip(student.model.layers[i].named_parameters(), src[l].named_parameters()):
            assert torch.equal(p, q), name
    assert torch.equal(student.lm_head.weight, target.base.hf.lm_head.weight)


def test_draft_model_training_lowers_kl_resumes_and_decodes_losslessly(tmp_path, one_thread):
    target = _target()
    blocks = _blocks(target)
    train, held = blocks[:6], blocks[6:]
    recipe = DistilRecipe(steps=8, lr=3e-3, warmup=2, batch_size=2, checkpoint_every=3, layers=2)
    full = train_draft_model(target, train, tmp_path / "a", recipe, eval_blocks=held, resume=False)
    assert full["eval_after"]["kl"] < full["eval_before"]["kl"] and full["loss_last"] < full["loss_first"]
    assert full["tokens"] == 8 * 2 * 24 and full["layers"] == [0, 5]
    # stopped after the checkpoint of step 6 (an interrupted run), then resumed: the uninterrupted run's weights
    part = train_draft_model(target, train, tmp_path / "b", recipe, eval_blocks=held, stop_at=6)
    assert part["steps_done"] == 6 and not (tmp_path / "b" / "config.json").exists()
    done = train_draft_model(target, train, tmp_path / "b", recipe, eval_blocks=held)
    assert done["steps_done"] == 8 and done["curve"] == pytest.approx(full["curve"], rel=1e-5)
    a, b = load_draft_model(tmp_path / "a", target), load_draft_model(tmp_path / "b", target)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    kw = dict(max_new_tokens=24, ignore_eos=True)
    ids = held[:, :6]
    res = target.generate(ids, draft="specdec", draft_options={"path": str(tmp_path / "a")}, **kw)
    assert res.new_tokens == target.generate(ids, force_compute=True, **kw).new_tokens
    other = fbs_tiny("llama", seed=5)
    with pytest.raises(CheckpointError, match="another base model.*fbs train draft-model"):
        load_draft_model(tmp_path / "a", other)


def test_medusa_training_lowers_kl_and_the_heads_decode_losslessly(tmp_path, one_thread):
    target = _target()
    with torch.no_grad():  # peaked next-token distributions (a random model's are near uniform: nothing to learn)
        target.base.hf.model.norm.weight.mul_(20)
    blocks = _blocks(target)
    recipe = DistilRecipe(steps=10, lr=1e-2, warmup=1, batch_size=2, checkpoint_every=5, heads=3)
    out = train_medusa_heads(target, blocks[:6], tmp_path / "m", recipe, eval_blocks=blocks[6:], resume=False)
    assert out["eval_after"]["kl"] < out["eval_before"]["kl"] and out["loss_last"] < out["loss_first"]
    heads = MedusaHeads.load(tmp_path / "m", target)
    assert heads.num_heads == 3 and out["head_params"] == 3 * (64 * 64 + 64)
    kw = dict(max_new_tokens=24, ignore_eos=True)
    ids = blocks[6:, :6]
    res = target.generate(ids, draft="medusa", draft_options={"path": str(tmp_path / "m")}, **kw)
    assert res.new_tokens == target.generate(ids, force_compute=True, **kw).new_tokens
    assert res.speculative.proposed > 0


def test_eagle_training_lowers_kl_stops_at_its_time_bound_and_decodes_losslessly(tmp_path, one_thread):
    """EAGLE's layer on the frozen target: the held-out KL of its first draft token falls; a run bounded by wall
    time stops early, saves what it has and says so; the saved layer decodes losslessly through ``draft="eagle"``
    (its dynamic tree) and a layer for another base is refused with the command that makes a good one."""
    from fbs.baselines.eagle import EagleLayer
    from fbs.train.eagle import train_eagle

    target = _target()
    with torch.no_grad():  # peaked next-token distributions, as for Medusa
        target.base.hf.model.norm.weight.mul_(20)
    blocks = _blocks(target)
    recipe = DistilRecipe(steps=10, lr=3e-3, warmup=1, batch_size=2, checkpoint_every=5)
    out = train_eagle(target, blocks[:6], tmp_path / "e", recipe, eval_blocks=blocks[6:], resume=False)
    assert out["eval_after"]["kl"] < out["eval_before"]["kl"] and out["loss_last"] < out["loss_first"]
    assert out["steps_done"] == 10 and not out["stopped_for_time"]
    bounded = train_eagle(target, blocks[:6], tmp_path / "t", DistilRecipe(steps=10, max_minutes=0.0), resume=False)
    assert bounded["steps_done"] == 0 and bounded["stopped_for_time"] and (tmp_path / "t" / "eagle.json").is_file()
    layer = EagleLayer.load(tmp_path / "e", target)
    kw = dict(max_new_tokens=24, ignore_eos=True)
    ids = blocks[6:, :6]
    res = target.generate(ids, draft="eagle", draft_options={"path": str(tmp_path / "e")}, **kw)
    assert res.new_tokens == target.generate(ids, force_compute=True, **kw).new_tokens
    assert res.speculative.proposed > 0 and layer.fc.weight.shape == (64, 128)
    with pytest.raises(CheckpointError, match="another base model.*fbs train eagle"):
        EagleLayer.load(tmp_path / "e", fbs_tiny("llama", seed=5))


def test_cached_features_are_the_targets_and_train_exactly_like_the_uncached_loop(tmp_path, one_thread):
    """Oracles: the target's own forward pass (its logits are the head of the cached feature) and the uncached loop
    (in fp32 the cached features are the same numbers, so the loss curves agree); a file of other blocks is refused."""
    import itertools

    from fbs.baselines.eagle import EagleLayer
    from fbs.baselines.medusa import frequent_tokens
    from fbs.train.data import BlockOrder
    from fbs.train.draft_model import TeacherFeatures
    from fbs.train.eagle import train_eagle

    target = _target()
    with torch.no_grad():
        target.base.hf.model.norm.weight.mul_(20)
    blocks = _blocks(target)
    feats = TeacherFeatures(target, blocks[:6], tmp_path / "f.safetensors")
    with torch.no_grad():
        out = target(blocks[:6], gate_mode="off")
    torch.testing.assert_close(feats.logp(feats[torch.arange(6)]), out.logits.float().log_softmax(-1),
                               rtol=1e-5, atol=1e-5)
    again = TeacherFeatures(target, blocks[:6], tmp_path / "f.safetensors")  # read back, not recomputed
    assert torch.equal(again.hidden, feats.hidden)
    with pytest.raises(ValueError, match="other training blocks.*delete it"):
        TeacherFeatures(target, blocks[1:7], tmp_path / "f.safetensors")
    for (train, kw), short in itertools.product(((train_medusa_heads, {"heads": 2}), (train_eagle, {})), (0, 40)):
        plain = DistilRecipe(steps=4, lr=1e-2, warmup=1, batch_size=2, checkpoint_every=4, shortlist=short, **kw)
        cached = DistilRecipe(**{**plain.__dict__, "feature_cache": True})
        a = train(target, blocks[:6], tmp_path / f"{train.__name__}_{short}_a", plain, resume=False)
        b = train(target, blocks[:6], tmp_path / f"{train.__name__}_{short}_b", cached, resume=False)
        assert b["curve"] == pytest.approx(a["curve"], rel=1e-5)
        assert (tmp_path / f"{train.__name__}_{short}_b" / "features.safetensors").is_file()
        if short:  # trained over the shortlist (the KL renormalised over it), saved with it
            cls = MedusaHeads if train is train_medusa_heads else EagleLayer
            saved = cls.load(tmp_path / f"{train.__name__}_{short}_b", target)
            assert saved.shortlist.tolist() == frequent_tokens(blocks[:6], 40).tolist()
    # Medusa's first loss over a shortlist, by hand: zero-initialised heads are the model's own head, so head k's
    # KL compares the model's distribution at i + 1 + k with its own at i, both renormalised over the shortlist
    ids = blocks[:6][[BlockOrder(6, 0)(j) for j in range(2)]]
    vocab = frequent_tokens(blocks[:6], 40)
    with torch.no_grad():
        logp = target(ids, gate_mode="off").logits.float()[..., vocab].log_softmax(-1)
    want = torch.stack([(logp[:, 1 + k:].exp() * (logp[:, 1 + k:] - logp[:, :ids.shape[1] - 1 - k])).sum(-1).mean()
                        for k in range(2)]).mean()
    first = train_medusa_heads(target, blocks[:6], tmp_path / "by_hand", DistilRecipe(
        steps=1, lr=1e-2, warmup=1, batch_size=2, checkpoint_every=1, heads=2, shortlist=40), resume=False)
    assert first["curve"][0] == pytest.approx(want.item(), rel=1e-4)
    # bf16: the products under autocast; the loss still falls
    fast = DistilRecipe(steps=10, lr=1e-2, warmup=1, batch_size=2, checkpoint_every=5, heads=2, feature_cache=True,
                        bf16=True)
    c = train_medusa_heads(target, blocks[:6], tmp_path / "c", fast, eval_blocks=blocks[6:], resume=False)
    assert c["eval_after"]["kl"] < c["eval_before"]["kl"]
