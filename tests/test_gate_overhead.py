"""What evaluating the skip gates costs a decode step, counted rather than timed (:mod:`fbs.bench.opcount`).

A one-token step is dominated by per-op dispatch overhead, so the gates' cost is the number of ATen calls and host
reads a gated layer adds over ``force_compute`` (gates not evaluated), at tau = 1 (gates evaluated, nothing
skipped). The gate's input projection is a column block of the fused K/V matmul, which force_compute runs too.
"""

import pytest
import torch

from conftest import fbs_tiny, randomize, require_native
from fbs.bench.opcount import count_decode_steps, decode_counts

PROMPT = torch.randint(0, 255, (1, 12), generator=torch.Generator().manual_seed(5))

#: ATen calls one gated layer adds in eager mode (top level): hidden = (gate columns) + terms (1); relative update:
#: sub, two norms, clamp, addcdiv, log (6); addcmul (1); silu, view, addmv (3); the host read (tolist: 2); one split
#: of the matmul's output instead of two slices (-1). Before: 18 (a linear over (b, 1, G), separate scalar ops,
#: slices of the terms and of the logit).
EAGER_OPS_PER_GATE = 12
#: per step: the gates' preview terms of the token, one matmul for all gated layers and its split
OPS_PER_STEP = 2
#: the same counts with the ATen calls made inside other calls (torch 2.13; was 39 per gated layer): the layer's
#: piece of the split adds 3, the per-token matmul a dozen
EAGER_ALL_OPS_PER_GATE, ALL_OPS_PER_STEP = 16, 13


def _counts(model, weights, compile=False, new_tokens=4):
    fc, _ = decode_counts(model, PROMPT, new_tokens, force_compute=True, weights=weights, compile=compile)
    gated, res = decode_counts(model, PROMPT, new_tokens, tau=1.0, weights=weights, compile=compile)
    return fc, gated, res


@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_gates_add_few_ops_and_one_host_read_per_gated_layer(weights, monkeypatch):
    """PyTorch ops (``FBS_NATIVE=0``): the dozen ATen calls and the host read of each gated layer."""
    monkeypatch.setenv("FBS_NATIVE", "0")
    model = randomize(fbs_tiny(layers=8), gate_bias=-3.0)
    fc, gated, res = _counts(model, weights)
    n = len(model.layers_cfg.gated)
    assert n == 6 and res.trace.skip_ratio == 0.0
    decoded = res.trace.gate_p[0, :-1, list(model.layers_cfg.gated)]  # the last token is never fed back
    assert not torch.isnan(decoded).any()  # every gate was evaluated
    assert gated.host_reads - fc.host_reads == n
    assert gated.ops - fc.ops <= EAGER_OPS_PER_GATE * n + OPS_PER_STEP
    assert gated.all_ops - fc.all_ops <= EAGER_ALL_OPS_PER_GATE * n + ALL_OPS_PER_STEP
    assert gated.compiled == fc.compiled == 0


@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_native_gates_add_no_aten_call_per_gated_layer(weights):
    """The native kernels (fbs.native): a gated layer adds no ATen call and no tensor host read (its logits come
    back as Python floats; in int8 the whole layer is inside one native call either way); what is left per step is
    the preview terms' matmul and split. PAW and CH layers are ungated here, as in the shipped configuration (the
    never-skip layers): a gated one projects its K/V before its decision with the per-op step (int8: ~14 ATen
    calls), where an ungated one leaves them to its native attention call."""
    require_native()  # skips only without a C++ compiler (the PyTorch ops are tested above)
    model = randomize(fbs_tiny(layers=8, never_skip_layers=(1, 3)), gate_bias=-3.0)  # PAW on 1, CH on 3
    fc, gated, res = _counts(model, weights)
    assert res.trace.skip_ratio == 0.0
    assert not torch.isnan(res.trace.gate_p[0, :-1, list(model.layers_cfg.gated)]).any()
    assert gated.host_reads == fc.host_reads
    assert gated.ops - fc.ops <= OPS_PER_STEP


def test_compiled_gate_is_inside_the_pre_step_graph():
    """Compiled (``eager`` backend: the same graphs as inductor's, cheap to capture), a gated layer adds no compiled
    call and, outside the graphs, only its host read (2 ATen calls) to force_compute's step."""
    torch._dynamo.reset()
    model = randomize(fbs_tiny(layers=8), gate_bias=-3.0)
    for weights in ("fp32", "int8"):
        fc, gated, _ = _counts(model, weights, compile="eager")
        n = len(model.layers_cfg.gated)
        assert gated.compiled == fc.compiled > 0
        assert gated.host_reads - fc.host_reads == n
        assert gated.ops - fc.ops <= 2 * n + OPS_PER_STEP


def test_decode_step_counts_are_deterministic_and_per_step():
    model = randomize(fbs_tiny(), gate_bias=-3.0)
    with count_decode_steps() as steps:
        model.generate(PROMPT, max_new_tokens=5, ignore_eos=True, tau=1.0)
    assert len(steps) == 4  # the first token comes from the prefill
    assert len({s.ops for s in steps[1:]}) == 1 and len({s.host_reads for s in steps}) == 1
