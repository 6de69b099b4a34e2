"""A decode does not run FBS modules that add nothing (``FBSForCausalLM.inert`` / ``decode_view``).

Oracles: the HF model's own greedy tokens and logits (a fresh FBS is the base model), the same decode with the
modules run (``elide_inert=False``), and whether the PAW / CH modules' forward is called at all.
"""

from __future__ import annotations

import pytest
import torch

from conftest import fbs_tiny

PROMPT = [[5, 17, 33, 2, 90, 41, 7, 12, 60, 3, 18, 77]]


def _calls(model):
    """Counts of the PAW and CH modules' forward calls, by patching each module instance."""
    seen = {"paw": 0, "ch": 0}
    for kind in ("paw", "ch"):
        for mod in getattr(model, kind).values():
            real = mod.forward

            def spy(*a, _real=real, _kind=kind, **kw):
                seen[_kind] += 1
                return _real(*a, **kw)

            mod.forward = spy
    return seen


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("weights", ["fp32", "q4"])
def test_a_fresh_fbs_decodes_the_base_without_running_its_modules(family, weights, one_thread):
    """Fresh PAW / CH / gates are inert: the decode runs neither PAW nor CH, and gives the tokens of the same decode
    with them run, with logits equal to rounding; in fp32 those are the HF model's greedy tokens and logits."""
    model = fbs_tiny(family)
    assert model.inert() and len(model.paw) and len(model.ch)
    view = model.decode_view()
    assert view is not model and not len(view.paw) and not len(view.ch) and view.gates is model.gates
    assert model.decode_view() is view  # made once per state of the FBS weights
    seen = _calls(model)
    kw = dict(max_new_tokens=12, ignore_eos=True, output_scores=True, weights=weights)
    fast = model.generate(PROMPT, **kw)
    assert seen == {"paw": 0, "ch": 0}
    full = model.generate(PROMPT, elide_inert=False, **kw)
    assert seen["paw"] > 0 and seen["ch"] > 0  # the modules ran there
    assert fast.new_tokens == full.new_tokens
    assert (fast.scores[0] - full.scores[0]).abs().max() <= 1e-4 * full.scores[0].abs().max()
    if weights == "fp32":
        hf = model.base.hf
        with torch.no_grad():
            ref = hf.generate(torch.tensor(PROMPT), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                              output_scores=True, return_dict_in_generate=True)
        assert fast.new_tokens[0] == ref.sequences[0, len(PROMPT[0]):].tolist()
        got, want = fast.scores[0], torch.stack(ref.scores)[:, 0]
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()


@pytest.mark.parametrize("part", ["paw", "ch", "gate"])
def test_a_trained_module_is_run(part):
    """One non-zero output weight (PAW's up projection, CH's output, a gate's output layer) makes the model not
    inert: the decode view is the model itself again (the memo follows the weights' state), and the module runs."""
    model = fbs_tiny()
    assert model.decode_view() is not model
    with torch.no_grad():
        if part == "paw":
            next(iter(model.paw.values())).up.weight[0, 0] = 1e-3
        elif part == "ch":
            next(iter(model.ch.values())).out.weight[0, 0] = 1e-3
        else:
            next(iter(model.gates.out.values())).weight[0, 0] = 1e-3
    assert not model.inert() and model.decode_view() is model
    seen = _calls(model)
    model.generate(PROMPT, max_new_tokens=4, ignore_eos=True)
    assert seen["paw"] > 0 and seen["ch"] > 0


@pytest.mark.parametrize("weights", ["fp32", "q4"])
def test_a_gate_whose_constant_logit_never_reaches_tau_is_not_evaluated(weights, one_thread):
    """A fresh gate's logit is its bias (-4, p = 0.018) whatever its inputs: at tau 0.3 it never skips, so the decode
    does not evaluate it (no gate probability in the trace) and gives the tokens and logits of the decode that does
    (where every gated layer's p is sigmoid(-4)). At tau 0.01 the same constant skips: the gates are evaluated and
    skip every layer they may. Under gate sampling (Bernoulli draws) they always are."""
    import math

    model = fbs_tiny()
    bias = model.config.gate_init_bias
    assert set(model.gates.constant_logits().values()) == {bias}
    kw = dict(max_new_tokens=10, ignore_eos=True, output_scores=True, weights=weights)
    fast = model.generate(PROMPT, tau=0.3, **kw)
    slow = model.generate(PROMPT, tau=0.3, elide_inert=False, **kw)
    assert torch.isnan(fast.trace.gate_p).all()
    gated = sorted(model.gates.layer_ids)
    p = slow.trace.gate_p[0, :-1, gated]  # trace step s consumed token s: the last one never is
    assert torch.allclose(p, torch.full_like(p, 1 / (1 + math.exp(-bias))))
    assert fast.new_tokens == slow.new_tokens and fast.trace.skip_ratio == slow.trace.skip_ratio == 0.0
    assert (fast.scores[0] - slow.scores[0]).abs().max() <= 1e-5 * slow.scores[0].abs().max()
    low = model.generate(PROMPT, tau=0.01, **kw)
    assert not torch.isnan(low.trace.gate_p[0, :-1, gated]).any() and low.trace.skip_ratio > 0.0
    sampled = model.generate(PROMPT, tau=0.3, gate_sampling=True, seed=0, **kw)
    assert not torch.isnan(sampled.trace.gate_p[0, :-1, gated]).any()


def test_a_trained_gate_is_evaluated():
    """One non-zero weight in a gate's output layer makes its logit depend on its inputs: it is evaluated."""
    model = fbs_tiny()
    layer = model.gates.layer_ids[0]
    with torch.no_grad():
        model.gates.out[str(layer)].weight[0, 0] = 1e-3
    assert layer not in model.gates.constant_logits()
    res = model.generate(PROMPT, max_new_tokens=4, ignore_eos=True, tau=0.3)
    assert not torch.isnan(res.trace.gate_p[0, :-1, layer]).any()
    assert torch.isnan(res.trace.gate_p[0, :, [l for l in model.gates.layer_ids if l != layer]]).all()
