"""The native kernels (:mod:`fbs.native`) against what they replace: the gate's PyTorch ops
(:func:`fbs.fused._gate_logit`) and int8 weight-only products (the dequantized matrix, in fp64)."""

import logging

import pytest
import torch

import fbs.fused
from conftest import fbs_tiny, randomize, tiny_config, tiny_hf
from fbs import FBSForCausalLM, native
from fbs.quant import dequantize, quantize_int8

PROMPT = torch.randint(0, 255, (1, 12), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def kernel():
    if native.module() is None:
        pytest.skip("no C++ toolchain here: the engine uses the PyTorch ops")
    return native.module()


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
def test_engine_with_native_gates_decides_like_the_pytorch_ops(kernel, family, policy, weights):
    kw = dict(max_new_tokens=12, ignore_eos=True, output_scores=True, kv_policy=policy, weights=weights)
    prompts = [PROMPT[0].tolist(), PROMPT[0, :7].tolist()]
    fast = randomize(fbs_tiny(family, seed=1, gate_prev_skip=True), seed=2)
    assert fbs.fused.decode_ops(fast, weights).native_gates
    out = fast.generate(prompts, **kw)
    slow = randomize(fbs_tiny(family, seed=1, gate_prev_skip=True), seed=2)
    ops = fbs.fused.decode_ops(slow, weights)  # the same weights' arithmetic (native int8 too), PyTorch gate ops
    ops.native_gates = False
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
        assert native.module() is None
    assert "no compiler" in caplog.text
    model = randomize(fbs_tiny(seed=1), seed=2)
    assert not fbs.fused.decode_ops(model, "fp32").native_gates
    res = model.generate(PROMPT, max_new_tokens=6, ignore_eos=True)
    assert res.trace.skip_ratio > 0 and len(res.new_tokens[0]) == 6


# --------------------------------------------------------------------------- int8 weight-only products
def _isas():
    have = native.int8_isa()
    return [] if have is None else ["avx2"] if have == "avx2" else ["avx2", "avx512"]


@pytest.fixture(params=["avx2", "avx512"])
def isa(request, kernel, monkeypatch):
    if request.param not in _isas():
        pytest.skip(f"no {request.param} on this CPU")
    monkeypatch.setenv("FBS_NATIVE_ISA", request.param)
    assert native.int8_isa() == request.param
    return request.param


@pytest.mark.parametrize("n, k", [(13, 40), (7, 16), (64, 48), (130, 576)])
def test_int8_pack_roundtrip(n, k):
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=torch.Generator().manual_seed(n * k))
    p = native.int8_pack(q)
    assert p.dim() == 1 and p.numel() == -(-n // 4) * 4 * -(-k // 16) * 16
    assert torch.equal(native.int8_unpack(p, n, k), q)


@pytest.mark.parametrize("n, k", [(13, 40), (7, 16), (64, 48), (130, 576)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
def test_int8_kernel_equals_the_dequantized_product(isa, n, k, rows):
    """Every instruction set, ragged tiles (N not a multiple of 4), K not a multiple of 16, 1-9 activation rows."""
    g = torch.Generator().manual_seed(31 * n + k + rows)
    q, s = quantize_int8(torch.randn(n, k, generator=g))
    p, exact = native.int8_pack(q), dequantize(q, s, torch.float64)
    x = torch.randn(rows, 1, k, generator=g)
    ref = x.double() @ exact.T
    got = native.int8_linear(x, p, s)
    assert got.shape == (rows, 1, n) and got.dtype == torch.float32
    assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    view = torch.randn(rows, 2 * k, generator=g)[:, k:]                  # a strided row view is read right too
    ref = view.double() @ exact.T
    assert torch.allclose(native.int8_linear(view, p, s).double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_int8_kernel_refuses_a_mismatched_packing(kernel):
    if native.int8_isa() is None:
        pytest.skip("no AVX2 here")
    q, s = torch.ones(8, 32, dtype=torch.int8), torch.ones(8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="packed size"):
        native.int8_linear(torch.randn(1, 48), native.int8_pack(q), s)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_engine_int8_equals_fp32_on_the_dequantized_weights(isa, family):
    """The int8 engine (packed weights, native kernel, LM head included) computes what the fp32 engine computes
    over the dequantized weights q * s: same tokens, logits equal up to summation order. The decoder gets its own
    LM head (a tied one is the input embedding too, which the engine keeps in fp32)."""
    hf = tiny_hf(family, 4, seed=3)
    hf.config.tie_word_embeddings = False
    with torch.no_grad():
        hf.lm_head.weight = torch.nn.Parameter(hf.lm_head.weight.detach().clone() * 1.5)
        for mod in hf.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.weight.copy_(dequantize(*quantize_int8(mod.weight)))   # exactly representable in int8 now
    model = FBSForCausalLM.from_base(hf, config=tiny_config(ch_layers=(2,))).eval()
    ops = fbs.fused.decode_ops(model, "int8")
    assert ops.native_int8 and ops.head_w.w.dim() == 1 and ops.layers[1].gu.w.dim() == 1
    kw = dict(max_new_tokens=10, ignore_eos=True, output_scores=True, force_compute=True)
    prompts = [PROMPT[0].tolist(), PROMPT[0, :5].tolist()]
    ref = model.generate(prompts, weights="fp32", **kw)
    out = model.generate(prompts, weights="int8", **kw)
    assert out.new_tokens == ref.new_tokens
    for a, b in zip(out.scores, ref.scores):
        assert 0 < (a - b).abs().max() < 1e-4 * (b.max() - b.min())


def test_without_native_int8_the_engine_keeps_the_pytorch_op(monkeypatch):
    monkeypatch.setenv("FBS_NATIVE", "0")
    ops = fbs.fused.decode_ops(fbs_tiny(), "int8")
    assert not ops.native_int8 and ops.head_w.w.dim() == 2 and ops.head_w.w.dtype == torch.int8
