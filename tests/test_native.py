"""The native gate kernel (:mod:`fbs.native`) against the PyTorch ops it replaces (:func:`fbs.fused._gate_logit`)."""

import logging

import pytest
import torch

import fbs.fused
from conftest import fbs_tiny, randomize
from fbs import native

PROMPT = torch.randint(0, 255, (1, 12), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def kernel():
    if native.gate_module() is None:
        pytest.skip("no C++ toolchain here: the engine uses the PyTorch ops")
    return native.gate_module()


@pytest.mark.parametrize("gy", [0, 16])
@pytest.mark.parametrize("rel", ["x_prev", "constant", None])
@pytest.mark.parametrize("prev_skip", [False, True])
def test_kernel_equals_the_pytorch_gate(kernel, gy, rel, prev_skip):
    """Every gate input combination, 3 rows, strided row views as the engine passes them (the gate's columns
    inside the K/V matmul's output, each gated layer's terms inside one matmul's output)."""
    g = torch.Generator().manual_seed(gy + 7 * prev_skip + (rel is None))
    b, d, G, off = 3, 40, 16, 24
    y = torch.randn(b, 1, off + gy, generator=g)
    terms = torch.randn(b, 1, 4 * G, generator=g)[..., G:2 * G]          # a strided view
    x, x_prev = torch.randn(b, 1, d, generator=g), torch.randn(b, 1, d, generator=g) * 3
    w_in = torch.randn(G, d + 2, generator=g)                             # w_rel / w_prev: columns of a weight
    w_rel, w_prev = w_in[:, d], w_in[:, d + 1]
    gate = (w_rel if rel else None, w_prev if prev_skip else None, torch.randn(G, generator=g),
            torch.randn(1, generator=g), torch.tensor(1e-3))
    rel_term = torch.randn(G, generator=g) if rel == "constant" else None
    xp = x_prev if rel == "x_prev" else None
    ps = torch.tensor([[1.0], [0.0], [1.0]]) if prev_skip else None
    ref = fbs.fused._gate_logit(y[..., off:], x, xp, terms, rel_term, ps, gate)
    got = native.gate_logits(y, off, gy, terms, x, xp, rel_term, ps, native.gate_args(gate))
    assert isinstance(got, list) and len(got) == b
    assert torch.allclose(torch.tensor(got, dtype=torch.float64), ref.double(), rtol=1e-5, atol=1e-5)


def test_kernel_refuses_what_it_cannot_read(kernel):
    x = torch.randn(1, 1, 8)
    with pytest.raises(RuntimeError, match="unit last stride"):
        kernel.gate_logits(x, 0, 4, x.transpose(1, 2), x, None, None, None, None, None, torch.randn(4), 0.0, 1e-3)


@pytest.mark.parametrize("family, policy", [("llama", "project"), ("qwen2", "hole")])
@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_engine_with_native_gates_decides_like_the_pytorch_ops(kernel, family, policy, weights, monkeypatch):
    kw = dict(max_new_tokens=12, ignore_eos=True, output_scores=True, kv_policy=policy, weights=weights)
    prompts = [PROMPT[0].tolist(), PROMPT[0, :7].tolist()]
    fast = randomize(fbs_tiny(family, seed=1, gate_prev_skip=True), seed=2)
    assert fbs.fused.decode_ops(fast, weights).native_gates
    out = fast.generate(prompts, **kw)
    monkeypatch.setenv("FBS_NATIVE", "0")
    slow = randomize(fbs_tiny(family, seed=1, gate_prev_skip=True), seed=2)
    assert not fbs.fused.decode_ops(slow, weights).native_gates
    ref = slow.generate(prompts, **kw)
    assert 0 < ref.trace.skip_ratio < 1
    assert out.new_tokens == ref.new_tokens and torch.equal(out.trace.executed, ref.trace.executed)
    ok = ~torch.isnan(ref.trace.gate_p)
    assert torch.equal(ok, ~torch.isnan(out.trace.gate_p))
    assert (out.trace.gate_p[ok] - ref.trace.gate_p[ok]).abs().max() < 1e-5


def test_a_failed_build_falls_back_to_the_pytorch_ops(monkeypatch, caplog):
    import torch.utils.cpp_extension

    def broken(*a, **k):
        raise OSError("no compiler")

    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_failed", None)
    monkeypatch.setattr(torch.utils.cpp_extension, "load_inline", broken)
    with caplog.at_level(logging.WARNING, logger="fbs.native"):
        assert native.gate_module() is None
    assert "no compiler" in caplog.text
    model = randomize(fbs_tiny(seed=1), seed=2)
    assert not fbs.fused.decode_ops(model, "fp32").native_gates
    res = model.generate(PROMPT, max_new_tokens=6, ignore_eos=True)
    assert res.trace.skip_ratio > 0 and len(res.new_tokens[0]) == 6
