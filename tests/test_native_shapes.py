"""The native kernels (:mod:`fbs.native`) at the shapes of real models, each instruction set forced in turn.

int8 products up to K = 8,960 (Qwen2.5-1.5B's FFN) and N = 49,152 (SmolLM2's vocabulary), with N and K tails that
are not multiples of the 4-channel tile or the 16-byte chunk; one-query attention at head dims 64 / 80 / 128 (and
72, which on an AVX-512 run takes the AVX2 code, 100, which takes the scalar code, and 256, the largest it takes)
over a cache of a thousand positions; RMSNorm at model widths; whole decoder layers with head dims 64 / 80 / 128
and an FFN of width 8,960. References: PyTorch in float64 (products, attention, RMSNorm) and HF's own model (the
layers, on weights the int8 format stores exactly).
"""

import functools

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from conftest import cpu_isas, int8_exact_, require_native, tiny_config
from fbs import FBSForCausalLM, native
from fbs.engine.fused import decode_ops
from fbs.engine.quant import dequantize, quantize_int8

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- int8 weight-only products
@functools.lru_cache(maxsize=None)
def _weights(n: int, k: int):
    """(packed, scales, q * s in float64) of a random (n, k) matrix, made once per session."""
    q, s = quantize_int8(torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)))
    return native.int8_pack(q), s, dequantize(q, s, torch.float64)


# (N, K): SmolLM2's LM head (49,152 x 576); Qwen2.5-1.5B's down projection (1,536 x 8,960) with 3 channels past
# the last whole tile; K = 8,967, 7 values past the last whole chunk; Qwen2.5-1.5B's gate and up (2 x 8,960 x 1,536)
PRODUCTS = [pytest.param(49152, 576, id="vocab-head"), pytest.param(1539, 8960, id="down-n-tail"),
            pytest.param(1536, 8967, id="down-k-tail"),
            pytest.param(17920, 1536, id="gate-up", marks=pytest.mark.slow)]


@pytest.mark.parametrize("n, k", PRODUCTS)
@pytest.mark.parametrize("rows", [1, 5])
def test_int8_product_at_model_shapes(isa, n, k, rows):
    """x (rows, K) @ (q * s)^T equals the float64 product within float32 rounding of the K-term sums (at most
    5e-7 of the sum of |terms| per output), and the tail of K counts: dropping it misses by far more."""
    p, s, exact = _weights(n, k)
    g = torch.Generator().manual_seed(rows + k)
    x = torch.randn(rows, k, generator=g)
    x[:, -(k % 16 or 16):] *= 4.0                                        # the last (partial) chunk weighs in
    got = native.int8_linear(x, p, s).double()
    assert got.shape == (rows, n)
    ref, bound = x.double() @ exact.T, x.double().abs() @ exact.abs().T  # bound: sum over k of |x_k w_k|
    err = ((got - ref).abs() / bound).max().item()
    assert err < 5e-7
    tail = k % 16 or 16
    untailed = x[:, :-tail].double() @ exact[:, :-tail].T
    assert ((untailed - ref).abs() / bound).max() > 1000 * 5e-7


# --------------------------------------------------------------------------- one-query attention
# (head dim, query heads, KV heads): SmolLM2 (64, 9, 3), Phi-2-like (80, 32 heads, MHA), Qwen2.5-1.5B (128, 12, 2);
# 72: AVX2 code inside an AVX-512 run (not a multiple of 16); 100: the scalar code (not a multiple of 8); 256: the
# largest head the kernel takes
HEADS = [(64, 9, 3), (80, 32, 32), (128, 12, 2), (72, 6, 2), (100, 4, 4), (256, 4, 1)]


@pytest.mark.parametrize("hd, heads, kv_heads", HEADS, ids=[f"hd{h[0]}" for h in HEADS])
def test_one_query_attention_at_model_head_dims(isa, hd, heads, kv_heads):
    """Rows written at slots 1,099 / 600 / 0 of a 1,100-position cache, gathered out of order: the cache writes are
    exact and the output equals float64 SDPA over each row's filled prefix (GQA) to float32 rounding (1e-6 of the
    largest |V|)."""
    g = torch.Generator().manual_seed(hd)
    B, C = 4, 1100
    kc, vc = torch.randn(B, kv_heads, C, hd, generator=g), torch.randn(B, kv_heads, C, hd, generator=g)
    idx, slots = torch.tensor([3, 0, 2]), torch.tensor([1099, 600, 0])
    b = idx.numel()
    q = torch.randn(b, 1, heads, hd, generator=g).transpose(1, 2) * 2    # (b, H, 1, hd), strided as the step makes it
    k, v = torch.randn(b, kv_heads, 1, hd, generator=g), torch.randn(b, kv_heads, 1, hd, generator=g)
    kr, vr = kc.clone(), vc.clone()
    kr[idx, :, slots], vr[idx, :, slots] = k[:, :, 0], v[:, :, 0]
    valid = (torch.arange(C).unsqueeze(0) <= slots.unsqueeze(1))[:, None, None, :]
    scale = hd ** -0.5
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), kr[idx].double(), vr[idx].double(), attn_mask=valid, scale=scale,
        enable_gqa=heads != kv_heads).transpose(1, 2).reshape(b, 1, heads * hd)
    got = native.attend_one(q, k, v, kc, vc, idx, slots, scale)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)
    assert (got.double() - ref).abs().max() < 1e-6 * vr.abs().max()
    # row 2 attends over its own entry only: its output is that V, per KV head group
    assert torch.allclose(got[2, 0].view(heads, hd), v[2, :, 0].repeat_interleave(heads // kv_heads, 0), atol=1e-6)


# --------------------------------------------------------------------------- RMSNorm
@pytest.mark.parametrize("d", [576, 1536, 8960, 1539])
def test_rms_norm_at_model_widths(d):
    """HF's RMSNorm in float64 (a width that is not a multiple of 16 included). Its code path is picked by the CPU
    at load time (target clones), not by ``FBS_NATIVE_ISA``."""
    require_native()
    g = torch.Generator().manual_seed(d)
    w = torch.randn(d, generator=g)
    x = torch.randn(3, 1, d, generator=g) * 7
    xd = x.double()
    ref = w.double() * (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6))
    got = native.rms_norm(x, w, 1e-6)
    assert (got.double() - ref).abs().max() < 5e-7 * ref.abs().max()


# --------------------------------------------------------------------------- whole layers
# family, head dim, query heads, KV heads, FFN width: widths that are multiples of 16, as the native layer needs;
# the last, Qwen2.5-1.5B's layer shapes (d = 1,536)
LAYERS = [pytest.param("llama", 64, 3, 1, 512, id="hd64"), pytest.param("qwen2", 80, 4, 2, 640, id="hd80-bias"),
          pytest.param("llama", 128, 2, 1, 8960, id="hd128-ffn8960"),
          pytest.param("qwen2", 128, 12, 2, 8960, id="qwen2.5-1.5b", marks=pytest.mark.slow)]
VOCAB = 250  # not a multiple of the 4-channel tile: the int8 LM head has a tail


@functools.lru_cache(maxsize=None)
def _decoder(family: str, hd: int, heads: int, kv_heads: int, inter: int):
    """An HF decoder of 3 layers at these attention / FFN shapes with int8-exact weights, and its FBS model."""
    cfg_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[family]
    torch.manual_seed(hd)
    cfg = cfg_cls(hidden_size=heads * hd, num_hidden_layers=3, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  head_dim=hd, intermediate_size=inter, vocab_size=VOCAB, max_position_embeddings=128,
                  tie_word_embeddings=False, eos_token_id=VOCAB - 1, bos_token_id=0, pad_token_id=0)
    hf = model_cls(cfg).eval()
    int8_exact_(hf)
    model = FBSForCausalLM.from_base(hf, config=tiny_config(paw_layers=(), ch_layers=())).eval()
    return hf, model


@pytest.mark.parametrize("family, hd, heads, kv_heads, inter", LAYERS)
def test_native_layers_at_model_head_dims(isa, family, hd, heads, kv_heads, inter):
    """The int8 step with all layers in one native call per token (norms, K/V, the gate of layer 1, attention,
    FFN) on weights the int8 format stores exactly: each row's tokens are HF's greedy choices and its logits HF's
    (teacher-forced on the generated sequence) to float32 rounding; prompts of 40, 17 and 5 tokens."""
    hf, model = _decoder(family, hd, heads, kv_heads, inter)
    ops = decode_ops(model, "int8")
    assert ops.native_layers is not None and all(n is not None for n in ops.native_layers)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in (40, 17, 5)]
    res = model.generate(prompts, max_new_tokens=6, ignore_eos=True, output_scores=True, weights="int8")
    assert res.trace.skip_ratio == 0.0
    for r, prompt in enumerate(prompts):
        seq = prompt + res.new_tokens[r]
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0, len(prompt) - 1:-1]
        assert res.new_tokens[r] == ref.argmax(-1).tolist()
        assert (res.scores[r] - ref).abs().max() < 1e-5 * (ref.max() - ref.min())


# --------------------------------------------------------------------------- skips only where the machine lacks it
def test_native_tests_fail_instead_of_skipping_where_the_machine_can_run_them(monkeypatch):
    """:func:`conftest.require_native`, which every native test calls: no extension where a compiler exists, or a
    kernel that runs a narrower instruction set than the CPU reports, fails; no compiler or no AVX2 skips."""
    import shutil
    from types import SimpleNamespace

    import conftest

    # the extension's ISA probes: the int8 kernel's, and the quantized products' (3: VNNI, 1: AVX2)
    kernel = lambda code, q=1: SimpleNamespace(int8_isa=lambda: code, quant_isa=lambda: q)  # noqa: E731
    monkeypatch.setattr(conftest, "cpu_isas", lambda: {"avx2", "avx512"})
    monkeypatch.setattr(native, "module", lambda: None)
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/" + name)
    with pytest.raises(pytest.fail.Exception, match="did not build although a C[+][+] compiler exists"):
        require_native()
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(pytest.skip.Exception, match="no C[+][+] compiler"):
        require_native()
    monkeypatch.setattr(native, "module", lambda: kernel(1))
    with pytest.raises(pytest.fail.Exception, match="reports avx512 but the native int8 kernel runs avx2"):
        require_native()
    monkeypatch.setattr(conftest, "cpu_isas", lambda: {"avx2", "avx512", "avx512_vnni"})
    monkeypatch.setattr(native, "module", lambda: kernel(2, q=1))
    with pytest.raises(pytest.fail.Exception, match="reports AVX-512 VNNI but the quantized products pick"):
        require_native()
    monkeypatch.setattr(native, "module", lambda: kernel(2, q=3))
    assert require_native("avx512_vnni").quant_isa() == 3
    monkeypatch.setattr(native, "module", lambda: kernel(1))
    monkeypatch.setattr(conftest, "cpu_isas", lambda: {"avx2"})
    assert require_native("avx2").int8_isa() == 1
    with pytest.raises(pytest.skip.Exception, match="does not report avx512"):
        require_native("avx512")
    monkeypatch.setattr(conftest, "cpu_isas", lambda: set())
    monkeypatch.setattr(native, "module", lambda: kernel(0, q=0))
    with pytest.raises(pytest.skip.Exception, match="does not report avx2"):
        require_native("avx2")


def test_cpu_isas_agree_with_torch():
    """What /proc/cpuinfo reports and what torch dispatches to (its capability can be capped, never raised)."""
    cap = torch.backends.cpu.get_cpu_capability().lower()
    have = cpu_isas()
    if cap == "avx512":
        assert have >= {"avx2", "avx512"}
    elif cap == "avx2":
        assert "avx2" in have
