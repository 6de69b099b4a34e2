"""A prompt's integer products (``prefill="int8"`` and ``prefill="blocks"``, fbs.engine.prefill).

Oracles: the quantization rule computed by hand (float64 products of the dequantized codes), the HF model with its
Linear layers replaced by that rule in float64 (an independent W8A8 forward; for blocks, the q4 weights times
activations quantized per 32 values: an independent W4A8 forward), and chunking a prompt changing its output only
by rounding (each row's products depend on that row alone).
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from conftest import fbs_tiny, randomize, tiny_hf
from fbs import FBSForCausalLM, native
from fbs.engine.decoder import DecodeOptions
from fbs.engine.defaults import resolve_prefill
from fbs.engine.loop import start
from fbs.engine.prefill import bf16_linear, bf16_weight, int8_linear, quantize_rows, quantize_weight
from fbs.engine.quant import dequantize_blocks, quantize_blocks
from fbs.native import quant as native_quant


def prompt(n: int, seed: int = 0) -> list[int]:
    g = random.Random(seed)
    return [g.randrange(3, 250) for _ in range(n)]


def test_options():
    with pytest.raises(ValueError, match="prefill must be one of"):
        DecodeOptions(prefill="int4")
    assert DecodeOptions(prefill="int8").prefill == "int8"
    assert DecodeOptions(prefill="blocks", weights="q4").prefill == "blocks"
    for weights in ("fp32", "int8", "hf"):  # no block weights: the error names the fix
        with pytest.raises(ValueError, match="prefill='blocks'.*weights='q4'"):
            DecodeOptions(prefill="blocks", weights=weights)
    assert resolve_prefill("fp32", "q4") == "fp32" and resolve_prefill("int8", "fp32") == "int8"


def test_row_quantization_by_hand():
    x = torch.tensor([[0.5, -1.27, 0.0, 0.635], [0.0, 0.0, 0.0, 0.0], [3.0, 1.5, -0.75, 0.0]])
    q, s = quantize_rows(x)
    assert torch.allclose(s[:, 0], torch.tensor([0.01, 1.0, 3.0 / 127]))
    assert q.tolist() == [[50, -127, 0, 64], [0, 0, 0, 0], [127, 64, -32, 0]]  # 63.5 -> 64 (to even), 31.75 -> 32
    w = quantize_weight(torch.tensor([[2.54, -1.0], [0.0, 0.0]]))
    assert w.wt.t().tolist() == [[127, -50], [0, 0]] and w.scale.tolist() == pytest.approx([0.02, 1.0])


@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_is_the_product_of_the_dequantized_codes(bias):
    """y = (codes_x * s_x) @ (codes_w * s_w)^T (+ b): the int32 sums are exact, so only the final scaling rounds."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 96, generator=g) * torch.linspace(0.1, 4, 96)  # channels of different ranges
    w = torch.randn(40, 96, generator=g)
    b = torch.randn(40, generator=g) if bias else None
    qw = quantize_weight(w, b)
    y = int8_linear(x, qw)
    xq, sx = quantize_rows(x)
    ref = (xq.double() * sx.double()) @ (qw.wt.double() * qw.scale.double()).to(torch.float64)
    if bias:
        ref = ref + b.double()
    assert (y.double() - ref).abs().max() < 1e-5 * ref.abs().max()
    assert (y - torch.nn.functional.linear(x, w, b)).abs().max() > 1e-3  # it is not the fp32 product


def test_native_row_kernels_equal_the_reference():
    """The one-pass native quantization and scaling compute the PyTorch reference's values, bit for bit."""
    if native.module() is None:
        pytest.skip("no native extension here")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(33, 200, generator=g) * 3
    x[5] = 0.0
    x[7, 3] = 127 * 0.5  # ties at .5 after division
    q, s = native.quantize_rows(x)
    rq, rs = quantize_rows(x)
    assert torch.equal(q, rq) and torch.equal(s, rs)
    acc = torch.randint(-2 ** 20, 2 ** 20, (33, 50), generator=g, dtype=torch.int32)
    sw, b = torch.rand(50, generator=g), torch.randn(50, generator=g)
    assert torch.equal(native.scale_rows(acc, s, sw, b), acc.float().mul_(s).mul_(sw).add_(b))
    assert torch.equal(native.scale_rows(acc, s, sw), acc.float().mul_(s).mul_(sw))


def _replace_linears(ref, make):
    """``ref`` with every Linear of its decoder layers' attention and MLP replaced by ``make(linear)``."""
    for layer in ref.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, mod in list(parent.named_children()):
                if isinstance(mod, torch.nn.Linear):
                    setattr(parent, name, make(mod))
    return ref


def _w8a8_reference(hf):
    """The HF model with every decoder Linear computing the int8 rule in float64 for all positions but the last,
    which keeps the float64 product (the engine runs the prompt's last token as a decode step); LM head fp32."""
    ref = copy.deepcopy(hf).double()

    class W8A8(torch.nn.Module):
        def __init__(self, lin):
            super().__init__()
            self.lin = lin
            self.qw = quantize_weight(lin.weight.detach().float(),
                                      None if lin.bias is None else lin.bias.detach().float())

        def forward(self, x):
            b, t, k = x.shape
            xq, sx = quantize_rows(x.reshape(-1, k).float())  # the engine quantizes fp32 activations
            y = (xq.double() * sx.double()) @ (self.qw.wt.double() * self.qw.scale.double())
            if self.qw.bias is not None:
                y = y + self.qw.bias.double()
            y = y.view(b, t, -1).clone()
            y[:, -1] = self.lin(x[:, -1])  # the last position: the plain product
            return y

    return _replace_linears(ref, W8A8)


def _prefill_against(family: str, reference, seed: int, **options):
    """A fresh FBS over a tiny HF model, one 40-token prompt: (model, ids, the HF model's output, ``reference(hf)``'s
    output (both with their caches), the engine's decoder after its prefill with ``options``, its next-token logits)."""
    hf = tiny_hf(family)
    m = FBSForCausalLM.from_base(hf, config=fbs_tiny(family).config).eval()
    ids = prompt(40, seed)
    with torch.no_grad():
        plain = hf(torch.tensor([ids]), use_cache=True)
        out = reference(hf)(torch.tensor([ids]), use_cache=True)
        dec = start(m, [ids], None, None, dict(max_new_tokens=1, **options))
        got = dec.prefill()[0]
    return m, ids, plain, out, dec, got


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_int8_prefill_gives_the_w8a8_reference_logits(family, one_thread):
    """Fresh FBS modules add nothing: with the int8 prefill, the prompt's cached K/V (all but the last token) are
    those of the HF model whose decoder products follow the int8 rule in float64, and the next-token logits (the
    last token runs the decode step, fp32 here) are that model's with plain products at the last position; both
    differ from the fp32 model's (the rule ran)."""
    m, ids, plain, out, dec, got = _prefill_against(family, _w8a8_reference, 3, weights="fp32", prefill="int8")
    ref, fp32 = out.logits[0, -1].float(), plain.logits[0, -1]
    scale = ref.abs().max()
    assert (got - ref).abs().max() < 2e-4 * scale
    assert (fp32 - ref).abs().max() > 10 * 2e-4 * scale
    for l in (0, len(m.base.layers) - 1):
        k_ref = out.past_key_values.layers[l].keys[0, :, :-1].float()
        k_fp32 = plain.past_key_values.layers[l].keys[0, :, :-1]
        k_got = dec.cache.k[l][0, :, :len(ids) - 1]
        tol = 2e-4 * k_ref.abs().max()
        assert (k_got - k_ref).abs().max() < tol and (k_fp32 - k_ref).abs().max() > 10 * tol


def _w4a8_reference(hf):
    """The HF model (float64) with every decoder Linear computing the q4 decode product: its weight rounded to Q4_1
    blocks, times the activations quantized per 32 values (fbs.native.quant.reference), at every position; the LM
    head likewise with Q8_0 blocks (q4 keeps the head in q8, as SmolLM2's GGUF does)."""
    ref = copy.deepcopy(hf).double()

    class W4A8(torch.nn.Module):
        def __init__(self, lin, kind="q4_1"):
            super().__init__()
            self.lin, self.w = lin, dequantize_blocks(*quantize_blocks(lin.weight, kind)).double()

        def forward(self, x):
            b, t, k = x.shape
            y = native_quant.reference(x.reshape(-1, k).float(), self.w)  # the engine quantizes fp32 activations
            if self.lin.bias is not None:
                y = y + self.lin.bias
            return y.view(b, t, -1)

    ref = _replace_linears(ref, W4A8)
    ref.lm_head = W4A8(ref.lm_head, "q8_0")
    return ref


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("threads", [1, 2])
def test_block_prefill_gives_the_w4a8_reference_logits(family, threads):
    """With ``prefill="blocks"`` a q4 prompt's products are the decode step's (q4 weights, activations per 32): the
    cached K/V and the next-token logits are those of the HF model whose decoder products follow that rule in
    float64 at every position, and differ from the fp32 model's and from the int8 prefill's."""
    if native_quant.isa() is None:
        pytest.skip("the block kernels need the native build on an AVX2 or AVX-512 CPU")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kw = dict(weights="q4", kv_dtype="fp32", prefill="blocks")
        m, ids, plain, out, dec, got = _prefill_against(family, _w4a8_reference, 4, **kw)
        with torch.no_grad():
            int8 = start(m, [ids], None, None, {**kw, "max_new_tokens": 1, "prefill": "int8"}).prefill()[0]
    finally:
        torch.set_num_threads(before)
    ref, fp32 = out.logits[0, -1].float(), plain.logits[0, -1]
    scale = ref.abs().max()
    assert (got - ref).abs().max() < 2e-4 * scale
    assert (fp32 - ref).abs().max() > 10 * 2e-4 * scale and (int8 - ref).abs().max() > 10 * 2e-4 * scale
    # an activation within float rounding of a code boundary rounds to the other code in float64: such a flip moves
    # that position's later products by about a code step, so a few positions may differ by more than rounding
    off = 0
    for l in range(len(m.base.layers)):
        k_ref = out.past_key_values.layers[l].keys[0].float()
        err = (dec.cache.k[l][0, :, :len(ids)] - k_ref).abs().amax((0, 2))  # per position
        assert err.max() < 1e-2 * k_ref.abs().max()
        off += int((err > 2e-4 * k_ref.abs().max()).sum())
    assert off <= 2, f"{off} of {len(ids) * len(m.base.layers)} cached positions beyond rounding"


@pytest.mark.parametrize("weights,prefill", [("fp32", "int8"), ("q4", "int8"), ("q4", "blocks")])
def test_integer_prefill_in_chunks_equals_the_whole_prompt(weights, prefill, one_thread):
    """Each row's products depend on that row alone, so a prompt prefilled in chunks differs from the whole prompt
    only where attention over the cache rounds differently (as with fp32 GEMMs), which an activation's int8 code can
    turn into one code step (~1 % of that row's largest value): the same greedy tokens and skip decisions, logits
    within half a percent of their range, with PAW, CH and skipping."""
    m = randomize(fbs_tiny())
    ids = [prompt(70, 1), prompt(45, 2)]
    kw = dict(max_new_tokens=10, weights=weights, output_scores=True, ignore_eos=True, prefill=prefill)
    whole = m.generate(ids, **kw)
    chunked = m.generate(ids, prefill_chunk=16, **kw)
    assert chunked.new_tokens == whole.new_tokens
    assert torch.equal(chunked.trace.executed, whole.trace.executed)
    for a, b in zip(chunked.scores, whole.scores):
        assert (a - b).abs().max() < 5e-3 * (b.max() - b.min())
    fp32 = m.generate(ids, **{**kw, "prefill": "fp32"})
    assert any(not torch.equal(a[0], b[0]) for a, b in zip(fp32.scores, whole.scores))  # a different prefill ran


def test_bf16_linear_is_the_rounded_product_of_the_rounded_operands():
    """y = bf16(bf16(x) @ bf16(w)^T) (+ b in fp32): the operands rounded once, the sums exact enough that the one
    rounding of the result decides it (an entry may differ where fp32 and float64 sums lie on two sides of a bf16
    rounding boundary, at most one bf16 step); not the fp32 product."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(37, 96, generator=g) * torch.linspace(0.1, 4, 96)
    w, b = torch.randn(40, 96, generator=g), torch.randn(40, generator=g)
    y = bf16_linear(x, bf16_weight(w, b))
    exact = x.bfloat16().double() @ w.bfloat16().double().t()
    ref = exact.bfloat16().double() + b.double()
    step = exact.abs() * 2.0 ** -7  # one bf16 step of the result
    assert ((y.double() - ref).abs() <= step + 1e-6).all()
    assert (y.double() == ref.float().double()).float().mean() > 0.97
    assert (y - torch.nn.functional.linear(x, w, b)).abs().max() > 1e-2


def _bf16_reference(hf):
    """The HF model (float64) with every decoder Linear computing the bf16 rule at every position: operands rounded to
    bf16, the product rounded to bf16, the bias added (fp32 values); the LM head float64."""
    ref = copy.deepcopy(hf).double()

    class BF16(torch.nn.Module):
        def __init__(self, lin):
            super().__init__()
            self.w = lin.weight.detach().float().bfloat16().double()
            self.b = None if lin.bias is None else lin.bias.detach().float().double()

        def forward(self, x):
            y = (x.float().bfloat16().double() @ self.w.t()).bfloat16().double()  # the engine rounds fp32 activations
            return y if self.b is None else y + self.b

    return _replace_linears(ref, BF16)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("weights", ["fp32", "q4"])
def test_bf16_prefill_gives_the_bf16_reference_logits(family, weights, one_thread):
    """With ``prefill="bf16"`` every prompt position, the last included, runs the bf16 rule: the cached K/V and the
    next-token logits are those of the HF model whose decoder products follow it in float64 (to a bf16 step where a
    sum lies at a rounding boundary), and differ from the fp32 model's; the decode format's layer weights are not used
    (under q4 the K/V are the same; its logits come from the q4 format's own LM head, in q8)."""
    m, ids, plain, out, dec, got = _prefill_against(family, _bf16_reference, 6, weights=weights, kv_dtype="fp32",
                                                    prefill="bf16")
    ref, fp32 = out.logits[0, -1].float(), plain.logits[0, -1]
    scale = ref.abs().max()
    err, far = (got - ref).abs().max(), (fp32 - ref).abs().max()
    if weights == "fp32":
        assert err < 2e-3 * scale and far > 5 * err, (err, far, scale)
    for l in (0, len(m.base.layers) - 1):
        k_ref = out.past_key_values.layers[l].keys[0].float()
        k_got = dec.cache.k[l][0, :, :len(ids)]
        k_fp32 = plain.past_key_values.layers[l].keys[0]
        assert (k_got - k_ref).abs().max() < 5 * (k_fp32 - k_ref).abs().max() / 10
