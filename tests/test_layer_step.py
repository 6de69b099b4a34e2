"""The one layer step: FFN-only skipping against independent oracles, in the parallel forward and the engine."""

import pytest
import torch

from conftest import fbs_tiny, randomize, recorded_fused_calls
from fbs.model.causal_lm import SkipTraining

PROMPT = torch.randint(0, 255, (1, 12), generator=torch.Generator().manual_seed(5))


def _zero_mlps(hf, layers):
    """The oracle of FFN-only skipping with fresh FBS modules: the HF model with those layers' MLPs removed."""
    originals = {l: hf.model.layers[l].mlp.forward for l in layers}
    for l in layers:
        hf.model.layers[l].mlp.forward = lambda x: torch.zeros_like(x)
    return originals


def test_ffn_plan_equals_hf_without_those_mlps(family):
    model = fbs_tiny(family, skip_granularity="ffn")
    hf = model.base.hf
    ids = torch.randint(0, 255, (2, 20), generator=torch.Generator().manual_seed(0))
    plan = torch.zeros(model.num_layers, dtype=torch.bool)
    plan[[2, 3]] = True
    with torch.no_grad():
        out = model(ids, gate_mode="plan", skip_plan=plan).logits
        originals = _zero_mlps(hf, [2, 3])
        try:
            ref = hf(ids).logits
        finally:
            for l, fwd in originals.items():
                hf.model.layers[l].mlp.forward = fwd
        full = hf(ids).logits
    assert (out - ref).abs().max() < 1e-4
    assert (out - full).abs().max() > 1e-3  # the skipped FFNs mattered


def test_ffn_soft_mixture_ends_are_compute_and_skip():
    """Soft mode, FFN granularity: h' = h + (1 - g) MLP(h); g = 0 is the full layer, g = 1 the attention alone."""
    model = randomize(fbs_tiny(skip_granularity="ffn"))
    with torch.no_grad():
        for lin in model.gates.out.values():  # p = sigmoid(-30): the hard gate computes everywhere
            lin.weight.zero_()
            lin.bias.fill_(-30.0)
    ids = torch.randint(0, 255, (1, 16), generator=torch.Generator().manual_seed(1))
    gated = list(model.layers_cfg.gated)
    plan = torch.zeros(model.num_layers, dtype=torch.bool)
    plan[gated] = True
    force = plan.expand(1, 16, -1).clone()
    with torch.no_grad():
        off = model(ids, gate_mode="off").logits
        skip_all = model(ids, gate_mode="plan", skip_plan=plan).logits
    soft0 = model(ids, gate_mode="soft", soft_sample="threshold", tau=0.5).logits
    with torch.no_grad():
        for lin in model.gates.out.values():
            lin.bias.fill_(0.0)
    soft1 = model(ids, gate_mode="soft", skip_training=SkipTraining(force_skip=force))
    assert (soft0 - off).abs().max() < 1e-5
    assert (soft1.logits - skip_all).abs().max() < 1e-5
    soft1.logits.sum().backward()  # the straight-through gradient reaches the gates through the FFN mixture
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.gates.out.parameters())


@pytest.mark.parametrize("weights", ["hf", "fp32"])
def test_ffn_skip_cached_equals_parallel(weights):
    model = randomize(fbs_tiny("qwen3", seed=1, skip_granularity="ffn"), seed=2)
    res = model.generate(PROMPT, max_new_tokens=12, ignore_eos=True, output_scores=True, weights=weights)
    tr = res.trace
    assert 0.1 < tr.skip_ratio < 0.9 and tr.kv_written[tr.valid].all()
    t0, n = PROMPT.shape[1], tr.valid[0].sum().item()
    plan = torch.zeros(1, res.sequences.shape[1], model.num_layers, dtype=torch.bool)
    plan[0, t0:t0 + n] = ~tr.executed[0, :n]
    with torch.no_grad():
        out = model(res.sequences, gate_mode="plan", skip_plan=plan)
        thr = model(res.sequences[:, :-1], gate_from=t0)  # threshold gates, recomputed from scratch
    assert (out.logits[0, t0 - 1:-1] - res.scores[0]).abs().max() < 1e-4
    assert thr.logits[0, t0 - 1:].argmax(-1).tolist() == res.new_tokens[0]


def test_ffn_skip_does_no_ffn_work():
    model = fbs_tiny(skip_granularity="ffn")
    layer = model.base.layers[2]
    calls = {"q": 0, "o": 0, "mlp": 0}
    hooks = [mod.register_forward_hook(lambda *_, key=key: calls.__setitem__(key, calls[key] + 1))
             for key, mod in (("q", layer.self_attn.q_proj), ("o", layer.self_attn.o_proj), ("mlp", layer.mlp))]
    plan = torch.zeros(model.num_layers, dtype=torch.bool)
    plan[2] = True
    try:
        res = model.generate(PROMPT, max_new_tokens=8, ignore_eos=True, skip_plan=plan, weights="hf")
    finally:
        for h in hooks:
            h.remove()
    assert calls == {"q": 8, "o": 8, "mlp": 1}  # attention for every token, the FFN in the prefill only
    assert not res.trace.executed[0, :7, 2].any() and res.trace.kv_written[0, :7, 2].all()


def test_fused_ffn_skip_does_no_ffn_work():
    """The same through the fused weights: the layer's FFN function is never called for a skipped token."""
    from fbs.engine.fused import decode_ops

    model = fbs_tiny(skip_granularity="ffn")
    ops = decode_ops(model, "fp32")
    plan = torch.zeros(model.num_layers, dtype=torch.bool)
    plan[2] = True
    with recorded_fused_calls(ops) as seen:
        model.generate(PROMPT, max_new_tokens=8, ignore_eos=True, skip_plan=plan, elide_inert=False)  # CH runs
    decode = [(name, l) for name, l, t in seen if t == 1]
    assert decode.count(("attention", 2)) == 7 and ("ffn", 2) not in decode and ("block", 2) not in decode
    assert decode.count(("block", 4)) == 7 and decode.count(("ffn", 3)) == 7  # layer 3 carries CH
