"""The native kernels (:mod:`fbs.native`) against what they replace: the gate's PyTorch ops
(:func:`fbs.engine.fused._gate_logit`) and int8 weight-only products (the dequantized matrix, in fp64)."""

import logging

import pytest
import torch

import fbs.engine.fused
from conftest import fbs_tiny, randomize, require_native, tiny_config, tiny_hf
from fbs import FBSForCausalLM, native
from fbs.engine.quant import dequantize, quantize_int8

PROMPT = torch.randint(0, 255, (1, 12), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def kernel():
    """The extension; skips only where there is no C++ compiler (see :func:`conftest.require_native`)."""
    return require_native()


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
    ref = fbs.engine.fused._gate_logit(y[..., off:], x, xp, terms, rel_term, ps, gate)
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
    assert fbs.engine.fused.decode_ops(fast, weights).native_gates
    out = fast.generate(prompts, **kw)
    slow = randomize(fbs_tiny(family, seed=1, gate_prev_skip=True), seed=2)
    ops = fbs.engine.fused.decode_ops(slow, weights)  # the same weights' arithmetic (native int8 too), PyTorch gate ops
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
    monkeypatch.setattr(torch.utils.cpp_extension, "load", broken)
    monkeypatch.setattr(native, "_import_built", lambda path: None)  # as on a machine with no build yet
    with caplog.at_level(logging.WARNING, logger="fbs.native"):
        assert native.module() is None
    assert "no compiler" in caplog.text
    model = randomize(fbs_tiny(seed=1), seed=2)
    assert not fbs.engine.fused.decode_ops(model, "fp32").native_gates
    res = model.generate(PROMPT, max_new_tokens=6, ignore_eos=True)
    assert res.trace.skip_ratio > 0 and len(res.new_tokens[0]) == 6


# --------------------------------------------------------------------------- int8 weight-only products
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


def test_int8_kernel_refuses_a_mismatched_packing():
    require_native("avx2")
    q, s = torch.ones(8, 32, dtype=torch.int8), torch.ones(8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="packed size"):
        native.int8_linear(torch.randn(1, 48), native.int8_pack(q), s)


@pytest.mark.parametrize("family, policy", [("llama", "project"), ("qwen2", "hole")])
def test_engine_int8_equals_fp32_on_the_dequantized_weights(isa, family, policy):
    """The int8 engine (packed weights, native products and attention, LM head included) computes what the fp32
    engine computes over the dequantized weights q * s: same tokens, logits equal up to summation order; rows of
    different lengths, a skip plan (under ``hole`` layers then hold different counts). The decoder gets its own
    LM head (a tied one is the input embedding too, which the engine keeps in fp32)."""
    hf = tiny_hf(family, 4, seed=3)
    hf.config.tie_word_embeddings = False
    with torch.no_grad():
        hf.lm_head.weight = torch.nn.Parameter(hf.lm_head.weight.detach().clone() * 1.5)
        for mod in hf.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.weight.copy_(dequantize(*quantize_int8(mod.weight)))   # exactly representable in int8 now
    model = FBSForCausalLM.from_base(hf, config=tiny_config(ch_layers=(2,))).eval()
    ops = fbs.engine.fused.decode_ops(model, "int8")
    assert ops.native_packed and ops.head_w.w.dim() == 1 and ops.layers[1].gu.w.dim() == 1
    assert ops._k_block["native_step"] and ops._k_ffn["native_step"]
    plan = torch.rand(10, 4, generator=torch.Generator().manual_seed(0)) < 0.4
    plan[:, [0, 3]] = False
    kw = dict(max_new_tokens=10, ignore_eos=True, output_scores=True, skip_plan=plan, kv_policy=policy)
    prompts = [PROMPT[0].tolist(), PROMPT[0, :5].tolist()]
    ref = model.generate(prompts, weights="fp32", **kw)
    out = model.generate(prompts, weights="int8", **kw)
    assert out.new_tokens == ref.new_tokens
    for a, b in zip(out.scores, ref.scores):
        assert 0 < (a - b).abs().max() < 1e-4 * (b.max() - b.min())


def test_without_native_int8_the_engine_keeps_the_pytorch_op(monkeypatch):
    monkeypatch.setenv("FBS_NATIVE", "0")
    ops = fbs.engine.fused.decode_ops(fbs_tiny(), "int8")
    assert not ops.native_packed and ops.head_w.w.dim() == 2 and ops.head_w.w.dtype == torch.int8


@pytest.mark.parametrize("rows", [None, [2, 0]])
@pytest.mark.parametrize("hd", [16, 64, 12])
def test_native_attention_equals_sdpa_over_the_masked_cache(isa, rows, hd):
    """Write + one-query GQA attention over each row's prefix = index writes + SDPA with the prefix mask (the
    PyTorch path of fbs.engine.fused._block_step), for the whole cache or a gathered subset of its rows; every SIMD path
    (head dims 16 / 64) and the scalar one (12, not a multiple of 8)."""
    g = torch.Generator().manual_seed(4)
    B, H, Hkv, C = 3, 6, 2, 20
    kc, vc = torch.randn(B, Hkv, C, hd, generator=g), torch.randn(B, Hkv, C, hd, generator=g)
    idx = torch.arange(B) if rows is None else torch.tensor(rows)
    b = idx.numel()
    q = torch.randn(b, 1, H, hd, generator=g).transpose(1, 2)                 # strided, as the step makes it
    k, v = torch.randn(b, 1, Hkv, hd, generator=g).transpose(1, 2), torch.randn(b, Hkv, 1, hd, generator=g)
    slots = torch.tensor([7, 0, 19][:b])
    kr, vr = kc.clone(), vc.clone()
    kr[idx, :, slots], vr[idx, :, slots] = k[:, :, 0], v[:, :, 0]
    valid = (torch.arange(C).unsqueeze(0) <= slots.unsqueeze(1))[:, None, None, :]
    ref = torch.nn.functional.scaled_dot_product_attention(q, kr[idx], vr[idx], attn_mask=valid, scale=0.3,
                                                           enable_gqa=True).transpose(1, 2).reshape(b, 1, H * hd)
    got = native.attend_one(q, k, v, kc, vc, idx, slots, 0.3)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)                        # the writes, in place
    assert torch.allclose(got, ref, atol=1e-6, rtol=1e-5)
    with pytest.raises(RuntimeError, match="slot out of range"):
        native.attend_one(q, k, v, kc, vc, idx, torch.full((b,), C), 0.3)


def test_native_rms_norm_equals_hf(kernel):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(40, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(40, generator=torch.Generator().manual_seed(1)))
    x = torch.randn(3, 1, 40, generator=torch.Generator().manual_seed(2)) * 5
    assert torch.allclose(native.rms_norm(x, norm.weight.detach(), 1e-5), norm(x).detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n, k, bias", [(1, 40, True), (64, 16, False), (1024, 64, False), (7, 576, True)])
def test_row_independent_products(kernel, n, k, bias):
    """linear_rows: the float64 product within fp32 rounding, and each row's bits the same whether it is computed
    alone or among M rows (a batch of 3-d rows too): torch's GEMM does not promise the second."""
    g = torch.Generator().manual_seed(n + k)
    w, x = torch.randn(n, k, generator=g), torch.randn(2, 9, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    y = native.linear_rows(x, w, b)
    ref = x.double() @ w.double().t() + (0 if b is None else b.double())
    assert y.shape == (2, 9, n) and torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5 * k ** 0.5)
    for i in range(2):
        for j in range(9):
            assert torch.equal(native.linear_rows(x[i, j:j + 1], w, b)[0], y[i, j])
    with pytest.raises(RuntimeError, match="weight"):
        native.linear_rows(x, w[:, :-1])


@pytest.mark.parametrize("n_vocab, k_max, fixed_k", [(48, 6, None), (64, 15, None), (1030, 15, None), (64, 6, 3)])
def test_paw_step_equals_the_module_in_float64(kernel, n_vocab, k_max, fixed_k):
    """paw_step against ParafoveaWindow.forward in float64 (every horizon, the hard window): z and zlow to fp32
    rounding, k and the window exactly; a row's bits alone equal its bits among 7 and on one thread or two; a row whose
    window is empty previews nothing. Preview vocabularies with and without a tail of 32 keys."""
    from fbs.model.config import FBSConfig
    from fbs.model.preview import ParafoveaWindow

    d, top_k = 40, 8
    g = torch.Generator().manual_seed(n_vocab + k_max)
    paw = ParafoveaWindow(FBSConfig(k_max=k_max, preview_vocab_size=n_vocab, preview_top_k=top_k, preview_rank=16,
                                    fixed_k=fixed_k), d)
    with torch.no_grad():
        for p in paw.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        paw.window.bias.fill_(1.0)
    emb = torch.randn(n_vocab, d, generator=g)
    keys = paw.vocab_proj(emb).detach()
    x = torch.randn(1, 7, d, generator=g)
    x[0, 3] = -4 * paw.window.weight.detach()[0] / paw.window.weight.detach().norm()  # an empty window (k = 0)
    got = native.paw_step(native.paw_weights(paw, keys, emb), x)
    with torch.no_grad():
        ref = paw.double()(x.double(), emb.double(), keys.double(), soft=False)
    assert got.k_hard.tolist() == ref.k_hard.tolist() and torch.equal(got.weights, ref.weights.float())
    assert fixed_k is not None or (got.k_hard[0, 3] == 0 and 0 < got.k_hard.max() < k_max)
    assert torch.allclose(got.zlow.double(), ref.zlow, rtol=1e-4, atol=1e-5)
    assert torch.allclose(got.z.double(), ref.z, rtol=1e-4, atol=1e-5)
    assert got.z.abs().max() > 0.1 and (fixed_k is not None or not got.z[0, 3].any())
    w = native.paw_weights(paw.float(), keys, emb)
    for j in range(7):
        assert torch.equal(native.paw_step(w, x[:, j:j + 1]).z[0, 0], got.z[0, j])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(native.paw_step(w, x).zlow, got.zlow)
    finally:
        torch.set_num_threads(threads)


def test_status_records_what_the_engine_runs_with(kernel, monkeypatch):
    st = native.status()
    assert st["enabled"] and st["loaded"] and st["build_error"] is None
    assert st["int8_isa"] == native.int8_isa() and st["int8_isa"] in (None, "avx2", "avx512")
    monkeypatch.setenv("FBS_NATIVE", "0")
    assert native.status()["enabled"] is False


# --------------------------------------------------------------------------- the whole layer in one call
def _per_op(ops) -> None:
    """The per-op int8 step: no native whole layers, no native layer halves (PAW / CH layers)."""
    ops.native_layers = ops._native_all = ops.native_decode = None


def _plain_layers(model) -> list[int]:
    return [l for l in range(model.base.spec.num_layers) if str(l) not in model.paw and str(l) not in model.ch]


@pytest.mark.parametrize("family, policy", [("llama", "project"), ("qwen2", "hole"), ("llama", "hole")])
@pytest.mark.parametrize("batch_policy", ["gather", "all", "majority"])
def test_native_layers_decide_and_compute_like_the_per_op_step(isa, family, policy, batch_policy):
    """The int8 step with each run of plain layers in one native call (per layer: norm, K/V + gate, threshold
    decision under the batch policy, cache writes, attention, FFN of the running rows; the gates' relative update
    and previous-skip inputs carried from layer to layer inside the call) against the same weights' per-op step
    (native products and attention, PyTorch elsewhere, Python decisions): same tokens, same executed / intended /
    written pairs, gate probabilities and logits equal up to float rounding; rows of three lengths."""
    kw = dict(max_new_tokens=12, ignore_eos=True, output_scores=True, kv_policy=policy, weights="int8",
              batch_policy=batch_policy)
    prompts = [PROMPT[0].tolist(), PROMPT[0, :7].tolist(), PROMPT[0, :3].tolist()]
    cfg = dict(layers=8, ch_layers=(6,), gate_prev_skip=True)  # native runs: layer 0, layers 2-5 (gated), layer 7
    fast = randomize(fbs_tiny(family, seed=1, **cfg), seed=2)
    ops = fbs.engine.fused.decode_ops(fast, "int8")
    assert [l for l, n in enumerate(ops.native_layers) if n is not None] == _plain_layers(fast) == [0, 2, 3, 4, 5, 7]
    assert all(n is not None for n in ops.native_decode)  # a decode step runs PAW (1) and CH (6) natively too
    out = fast.generate(prompts, **kw)
    slow = randomize(fbs_tiny(family, seed=1, **cfg), seed=2)
    _per_op(fbs.engine.fused.decode_ops(slow, "int8"))
    ref = slow.generate(prompts, **kw)
    assert 0 < ref.trace.skip_ratio < 1 and out.new_tokens == ref.new_tokens
    for name in ("executed", "intended_skip", "kv_written", "chunk_boundary", "window_k"):  # CH: native step too
        assert torch.equal(getattr(out.trace, name), getattr(ref.trace, name)), name
    ok = ~torch.isnan(ref.trace.gate_p)
    assert torch.equal(ok, ~torch.isnan(out.trace.gate_p))
    assert (out.trace.gate_p[ok] - ref.trace.gate_p[ok]).abs().max() < 1e-5
    for a, b in zip(out.scores, ref.scores):
        assert (a - b).abs().max() < 1e-5 * (b.max() - b.min())


@pytest.mark.parametrize("policy", ["project", "hole"])
@pytest.mark.parametrize("weights", ["int8", "q4"])
def test_paw_and_ch_layers_in_the_native_run_equal_their_native_halves(isa, policy, weights):
    """A decode step's PAW and CH layers inside the native run (PAW's and CH's kernels between the layer's attention
    and FFN, the gates after PAW reading its new zlow, a skipped CH row joining the chunk cache under ``project``)
    against the same layers composed in Python from their native halves and the same kernels: same tokens and trace
    (window k, boundaries, decisions), logits to float rounding (the gates' preview terms: one
    product in the call against torch's). Batch of three rows, gates skipping part of the time."""
    if weights == "q4":
        require_native("avx2")
    kw = dict(max_new_tokens=12, ignore_eos=True, output_scores=True, kv_policy=policy, weights=weights,
              batch_policy="gather")
    prompts = [PROMPT[0].tolist(), PROMPT[0, :7].tolist(), PROMPT[0, :3].tolist()]
    cfg = dict(layers=8, paw_layers=(2,), ch_layers=(5,), gate_prev_skip=True)
    fast = randomize(fbs_tiny("llama", seed=3, **cfg), seed=6, gate_bias=-1.0)  # CH runs 2/3 of the time
    assert fbs.engine.fused.decode_ops(fast, weights).native_decode is not None
    out = fast.generate(prompts, **kw)
    slow = randomize(fbs_tiny("llama", seed=3, **cfg), seed=6, gate_bias=-1.0)
    fbs.engine.fused.decode_ops(slow, weights).native_decode = None
    ref = slow.generate(prompts, **kw)
    assert 0 < ref.trace.skip_ratio < 1 and out.new_tokens == ref.new_tokens
    assert (ref.trace.window_k > 0).any() and ref.trace.chunk_boundary.any() and not ref.trace.chunk_boundary.all()
    for name in ("executed", "intended_skip", "kv_written", "chunk_boundary", "window_k"):
        assert torch.equal(getattr(out.trace, name), getattr(ref.trace, name)), name
    for a, b in zip(out.scores, ref.scores):
        assert (a - b).abs().max() < 1e-5 * (b.max() - b.min())


@pytest.mark.parametrize("policy", ["project", "hole"])
def test_native_layers_follow_a_plan_like_the_per_op_step(isa, policy):
    """A skip plan per step (no gates): the native runs execute and record what the per-op step does, same tokens;
    under ``hole`` the layers' caches then hold different counts."""
    plan = torch.rand(10, 8, generator=torch.Generator().manual_seed(12)) < 0.4
    plan[:, [0, 7]] = False
    kw = dict(max_new_tokens=10, ignore_eos=True, output_scores=True, weights="int8", skip_plan=plan,
              kv_policy=policy)
    prompts = [PROMPT[0].tolist(), PROMPT[0, :7].tolist(), PROMPT[0, :3].tolist()]
    fast = randomize(fbs_tiny(seed=3, layers=8, ch_layers=(6,)), seed=4)
    out = fast.generate(prompts, **kw)
    slow = randomize(fbs_tiny(seed=3, layers=8, ch_layers=(6,)), seed=4)
    _per_op(fbs.engine.fused.decode_ops(slow, "int8"))
    ref = slow.generate(prompts, **kw)
    assert out.new_tokens == ref.new_tokens and 0 < ref.trace.skip_ratio < 1
    for name in ("executed", "intended_skip", "kv_written"):
        assert torch.equal(getattr(out.trace, name), getattr(ref.trace, name)), name
    assert torch.equal(out.trace.intended_skip[0, :-1], plan[:9])  # the last token is never fed back
    for a, b in zip(out.scores, ref.scores):
        assert (a - b).abs().max() < 1e-5 * (b.max() - b.min())


def test_native_layers_batch_equals_single_runs(isa):
    """Under ``gather`` a row's arithmetic does not depend on the other rows (the int8 kernel keeps one accumulator
    per row, attention is per row): a batch of 4 gives each row its single run's tokens and decisions, logits
    equal up to the rounding of the batched prefill and PAW / CH layers (PyTorch GEMMs)."""
    model = randomize(fbs_tiny(seed=4), seed=5)
    prompts = [torch.randint(0, 255, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 9, 9, 14)]
    kw = dict(max_new_tokens=10, ignore_eos=True, output_scores=True, weights="int8")
    batch = model.generate(prompts, **kw)
    assert 0 < batch.trace.skip_ratio < 1
    for r, p in enumerate(prompts):
        single = model.generate([p], **kw)
        assert batch.new_tokens[r] == single.new_tokens[0]
        assert torch.equal(batch.trace.executed[r], single.trace.executed[0])
        b = single.scores[0]
        assert (batch.scores[r] - b).abs().max() < 1e-5 * (b.max() - b.min())


@pytest.mark.parametrize("write_skipped", [False, True])
def test_native_layer_skipped_rows_keep_x_and_write_only_their_kv(isa, write_skipped):
    """One native layer call with forced decisions: a skipped row's output is its input bit for bit (no row runs:
    the input tensor itself comes back), it writes its rotated K/V only when asked (``project``), and a running
    row's output is the per-op step's."""
    model = randomize(fbs_tiny(seed=6), seed=7)
    ops = fbs.engine.fused.decode_ops(model, "int8")
    l = _plain_layers(model)[1]
    res = model.generate([PROMPT[0].tolist()] * 2, max_new_tokens=2, ignore_eos=True, weights="int8",
                         force_compute=True)
    assert len(res.new_tokens[0]) == 2
    from fbs.engine.cache import CacheContext, KVCache

    spec, n = model.base.spec, PROMPT.shape[1]
    g = torch.Generator().manual_seed(8)
    cache = KVCache(spec.num_layers, 2, spec.num_kv_heads, spec.head_dim, 32)
    for layer in range(spec.num_layers):  # a filled prefix of n entries per row
        cache.k[layer].normal_(generator=g)
        cache.v[layer].normal_(generator=g)
        cache.lengths[layer] = [n, n]
        cache.positions[layer] = [list(range(n)), list(range(n))]
    x = torch.randn(2, 1, spec.hidden_size, generator=g)
    pos = torch.tensor([[n], [n]])
    cos, sin = ops.rope(x, pos)
    ctx = CacheContext(cache, {}, [0, 1], [[n], [n]], cos, sin, "project" if write_skipped else "hole")
    before_k = cache.k[l].clone()
    one = range(l, l + 1)
    same, last_in, logits, skip, run = ops.native_run(one, x, ctx, None, None, None, [False], [False, False], None, 0,
                                                      write_skipped)[:5]
    assert same is x and last_in is x and skip == [True, True] and run == [False, False]
    assert all(v != v for v in logits)  # NaN: no gate ran
    written = not torch.equal(cache.k[l], before_k)
    assert written == write_skipped and cache.lengths[l] == ([n + 1] * 2 if write_skipped else [n, n])
    if write_skipped:  # the entry is the per-op step's rotated K of RMSNorm_1(x)
        k, v = ops.kv(l, ops.norm1(l, x), ctx)
        assert torch.allclose(cache.k[l][:, :, n], k[:, :, 0], atol=1e-5)
        assert torch.allclose(cache.v[l][:, :, n], v[:, :, 0], atol=1e-5)
    # row 1 runs: its output is the per-op block over the same cache state; row 0 keeps x
    ref_cache = KVCache(spec.num_layers, 2, spec.num_kv_heads, spec.head_dim, 32)
    for name in ("k", "v", "lengths", "positions"):
        setattr(ref_cache, name, [t.clone() if torch.is_tensor(t) else [list(r) if isinstance(r, list) else r
                                                                         for r in t] for t in getattr(cache, name)])
    new = ops.native_run(one, x, ctx, None, None, None, [False], [False, True], None, 0, write_skipped)[0]
    assert torch.equal(new[0], x[0])
    ref_ctx = CacheContext(ref_cache, {}, [1], [[n]], cos[1:], sin[1:], "hole")
    keep = ops._native_all
    ops._native_all = None  # the per-op block (native products and attention, PyTorch elsewhere)
    try:
        ref = ops.block(l, x[1:], ops.norm1(l, x[1:]), ref_ctx)
    finally:
        ops._native_all = keep
    assert torch.allclose(new[1:], ref, atol=1e-5, rtol=1e-5)


def test_qwen3_layers_stay_per_op():
    """Qwen3's per-head Q/K norms are not in the native layer: every Qwen3 layer runs the per-op step."""
    require_native("avx2")
    layers = fbs.engine.fused.decode_ops(fbs_tiny("qwen3"), "int8").native_layers
    assert layers is None or all(n is None for n in layers)


@pytest.mark.parametrize("policy", ["project", "hole"])
def test_native_int8_drafts_keep_lossless_decoding_lossless(isa, policy):
    """Speculative self-drafting with the native int8 step as the draft (gated, skipping, rolled back on rejection,
    chunk states included) and the verifier: the output is full-depth int8 decoding's, token for token."""
    model = randomize(fbs_tiny(seed=1, layers=8, ch_layers=(6,)), seed=2)
    prompts = [PROMPT[0].tolist(), PROMPT[0, :7].tolist()]
    ref = model.generate(prompts, max_new_tokens=16, ignore_eos=True, force_compute=True, kv_policy=policy,
                         weights="int8")
    out = model.generate(prompts, max_new_tokens=16, ignore_eos=True, lossless=True, weights="int8", kv_policy=policy)
    assert out.speculative.draft_skip_ratio > 0 and out.speculative.rejections > 0
    assert out.new_tokens == ref.new_tokens


def test_a_stale_build_lock_does_not_block_loading():
    """A build killed mid-way leaves torch's lock file in the build directory, which would make every later load
    wait forever; a finished build is imported without it, and a build removes it under its own OS-released lock."""
    import subprocess
    import sys

    require_native()
    lock = native._build_dir() / "lock"
    lock.touch()
    code = "from fbs import native; assert native.module() is not None"
    run = subprocess.run([sys.executable, "-c", code], timeout=600, capture_output=True, text=True)
    lock.unlink(missing_ok=True)
    assert run.returncode == 0, run.stderr[-2000:]


@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("threads", [1, 2])
def test_native_attention_of_consecutive_positions_equals_sdpa(isa, hd, threads):
    """Queries that read the same cached K/V (the heads of one KV head, and T positions of one sequence, as a
    multi-token step has them: same cache row, consecutive slots, each seeing its own prefix) next to a row of its
    own, over a cache long enough to be split into key ranges across threads (AVX-512: the grouped kernel, its
    ranges merged; AVX2: one task per query): equal to index writes + SDPA with each query's causal prefix mask."""
    g = torch.Generator().manual_seed(hd + threads)
    B, H, Hkv, C = 3, 6, 2, 700
    kc, vc = torch.randn(B, Hkv, C, hd, generator=g), torch.randn(B, Hkv, C, hd, generator=g)
    idx = torch.tensor([1, 1, 1, 1, 0])          # four positions of cache row 1, one of row 0
    slots = torch.tensor([600, 601, 602, 603, 5])
    b = idx.numel()
    q = torch.randn(b, 1, H, hd, generator=g).transpose(1, 2) * 3
    k = torch.randn(b, 1, Hkv, hd, generator=g).transpose(1, 2) * 2  # new keys that weigh
    v = torch.randn(b, Hkv, 1, hd, generator=g) * 4
    kr, vr = kc.clone(), vc.clone()
    kr[idx, :, slots], vr[idx, :, slots] = k[:, :, 0], v[:, :, 0]
    valid = (torch.arange(C).unsqueeze(0) <= slots.unsqueeze(1))[:, None, None, :]
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), kr[idx].double(), vr[idx].double(),
                                                           attn_mask=valid, scale=0.2, enable_gqa=True)
    ref = ref.transpose(1, 2).reshape(b, 1, H * hd)
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = native.attend_one(q, k, v, kc, vc, idx, slots, 0.2)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)
    tol = 2e-6 * ref.abs().max()
    assert (got.double() - ref).abs().max() < tol
    # the causal mask is visible: the first position would differ if it saw its successors' keys
    late = torch.nn.functional.scaled_dot_product_attention(q[:1].double(), kr[1:2].double(), vr[1:2].double(),
                                                            attn_mask=valid[3:4], scale=0.2, enable_gqa=True)
    assert (late.transpose(1, 2).reshape(1, 1, -1) - ref[:1]).abs().max() > 50 * tol



@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hd", [16, 64])
@pytest.mark.parametrize("threads", [1, 2])
def test_native_attention_accumulates_its_own_weights(isa, hd, kv_dtype, threads):
    """H2O's accumulated attention from the attention pass itself (``acc``): the softmax weights of every query,
    summed over the query heads of each KV head and over the positions of a multi-token step that share a cache row,
    added to what ``acc`` held; equal to float64 softmax(scale q K^T) over each query's causal prefix of the same
    (rounded) cache. hd 64 under AVX-512 takes the grouped kernel (weights kept per key range, scaled by the merged
    softmax), over more than one range; hd 16 the per-head kernels. The output is what the call without ``acc``
    gives, bit for bit (the accumulation changes nothing it computes)."""
    g = torch.Generator().manual_seed(hd + threads)
    B, H, Hkv, C = 3, 6, 2, 700
    kc = (torch.randn(B, Hkv, C, hd, generator=g) * 2).to(kv_dtype)
    vc = torch.randn(B, Hkv, C, hd, generator=g).to(kv_dtype)
    idx = torch.tensor([1, 1, 1, 0])              # three positions of cache row 1, one of row 0; row 2 untouched
    slots = torch.tensor([300, 301, 302, 650])
    b = idx.numel()
    q = torch.randn(b, 1, H, hd, generator=g).transpose(1, 2) * 2
    k = torch.randn(b, 1, Hkv, hd, generator=g).transpose(1, 2) * 2
    v = torch.randn(b, Hkv, 1, hd, generator=g)
    acc0 = torch.rand(B, Hkv, C, generator=g)
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        plain = native.attend_one(q, k, v, kc.clone(), vc.clone(), idx, slots, 0.2)
        acc = acc0.clone()
        got = native.attend_one(q, k, v, kc, vc, idx, slots, 0.2, acc=acc)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(got, plain)
    ref = acc0.double()
    keys = kc.double()  # the call wrote the new keys (rounded to the cache's dtype) into kc
    for i in range(b):
        for h in range(H):
            s = 0.2 * keys[idx[i], h // (H // Hkv), :slots[i] + 1] @ q[i, h, 0].double()
            ref[idx[i], h // (H // Hkv), :slots[i] + 1] += torch.softmax(s, 0)
    assert (acc.double() - ref).abs().max() < 2e-6 * ref.max()  # fp32 sums of up to 9 weights per entry
    assert torch.equal(acc[2], acc0[2]) and torch.equal(acc[0, :, 651:], acc0[0, :, 651:])
    assert (acc - acc0).sum() == pytest.approx(b * H, rel=1e-5)  # every query's weights sum to one


@pytest.mark.parametrize("threads", [1, 2])
def test_native_attention_of_a_query_does_not_depend_on_its_call(isa, threads):
    """A query's attention output is the same, bit for bit, whether it runs alone (a one-token decode step) or next
    to other positions of its sequence (a verifier's multi-token step) and other rows (a batch): the grouped kernel
    splits keys into ranges at fixed offsets, so what a query sums, and in which order, depends on its own prefix
    only. Greedy speculative decoding is exact only if this holds."""
    g = torch.Generator().manual_seed(threads)
    B, H, Hkv, hd, C = 3, 9, 3, 64, 900
    kc, vc = torch.randn(B, Hkv, C, hd, generator=g), torch.randn(B, Hkv, C, hd, generator=g)
    idx = torch.tensor([1, 1, 1, 1, 0, 2])       # four positions of cache row 1, one of rows 0 and 2
    slots = torch.tensor([611, 612, 613, 614, 40, 850])
    b = idx.numel()
    q = torch.randn(b, 1, H, hd, generator=g).transpose(1, 2) * 3
    k = torch.randn(b, 1, Hkv, hd, generator=g).transpose(1, 2) * 2
    v = torch.randn(b, Hkv, 1, hd, generator=g) * 4
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = native.attend_one(q, k, v, kc, vc, idx, slots, 0.125)
        for i in range(b):  # alone, over the cache the batched call filled
            kr, vr = kc.clone(), vc.clone()
            one = native.attend_one(q[i:i + 1], k[i:i + 1], v[i:i + 1], kr, vr, idx[i:i + 1], slots[i:i + 1], 0.125)
            assert torch.equal(one[0], got[i]), i
            # and with the other positions of its row only (as verification without a batch)
            row = (idx == idx[i]).nonzero().flatten()
            part = native.attend_one(q[row], k[row], v[row], kc.clone(), vc.clone(), idx[row], slots[row], 0.125)
            assert torch.equal(part[(row == i).nonzero().item()], got[i]), i
    finally:
        torch.set_num_threads(n)


@pytest.mark.parametrize("threads", [1, 2])
def test_causal_attention_equals_float64_sdpa(threads):
    """A prompt's causal attention in one flash-style pass (fbs.native.causal_attention) against float64 SDPA: GQA
    groups of 1, 3 and 7 query heads, head dims 16 to 128, lengths not a multiple of the query or key blocks (1, 37,
    100, 130), chunks after earlier entries (40 queries after 130 keys, 17 after 1), two rows, strided queries; the
    result does not depend on the thread count (bit for bit)."""
    require_native("avx512")
    before = torch.get_num_threads()
    g = torch.Generator().manual_seed(3)
    try:
        for b, h, hkv, t, s, hd in [(1, 9, 3, 130, 130, 64), (2, 4, 4, 37, 37, 16), (1, 14, 2, 100, 100, 128),
                                    (1, 3, 1, 1, 1, 32), (1, 9, 3, 40, 170, 64), (2, 4, 2, 17, 18, 16)]:
            q = torch.randn(b, t, h, hd, generator=g).transpose(1, 2)  # as a projection's heads: strided
            k, v = torch.randn(b, hkv, s, hd, generator=g) * 2, torch.randn(b, hkv, s, hd, generator=g)
            torch.set_num_threads(threads)
            got = native.causal_attention(q, k, v, hd ** -0.5)
            torch.set_num_threads(3 - threads)
            other = native.causal_attention(q, k, v, hd ** -0.5)
            # the queries are the last t of s positions: query i sees keys 0 .. s - t + i
            mask = torch.arange(s) <= s - t + torch.arange(t)[:, None]
            ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask,
                                                                   enable_gqa=True, scale=hd ** -0.5)
            assert got.shape == (b, h, t, hd) and torch.equal(got, other)
            assert (got.double() - ref).abs().max() < 1e-5 * ref.abs().max()
    finally:
        torch.set_num_threads(before)
    assert native.causal_attention(torch.randn(1, 2, 8, 24), torch.randn(1, 2, 8, 24), torch.randn(1, 2, 8, 24),
                                   1.0) is None  # a head dim it does not take: the caller keeps SDPA
    with pytest.raises(RuntimeError, match="k and v"):
        native.module().causal_attention(torch.randn(1, 4, 8, 16), torch.randn(1, 3, 8, 16), torch.randn(1, 3, 8, 16),
                                         1.0)
