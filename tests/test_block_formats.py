"""The block weight formats q8 (GGUF Q8_0) and q4 (GGUF Q4_1) and the native multi-token step.

* Blocks: weights that are such blocks already come back exactly; a hand-computed row.
* Decoding in q4 / q8 against a float64 oracle written here: the HF model itself with every Linear of a decoded
  token (and the LM head) computing on activations quantized per 32-value block (q = round(x * 127 / max|x|), as
  llama.cpp's q8_0 does) times the dequantized block weights; the prompt's layers as HF computes them (the engine
  prefills with the HF modules). The engine must give its tokens, and logits within float rounding of it; the same
  oracle without the activation quantization must be far off (so that the test sees the quantization).
* A multi-token native step over T positions of one sequence equals T one-token steps (outputs, cache entries
  and lengths), with forced skips under ``hole`` and ``project``.
* The multi-row products: M rows in one call (one pass over each weight tile for up to 8 rows) equal M one-row
  calls bit for bit and the float64 product of the quantized activations, on every instruction-set path.
* LoRA kept apart: a checkpoint whose merged adapters moved its weights off the base's blocks keeps the base's exact
  blocks in q4 / q8 (where the base is such blocks) and applies the low-rank delta in fp32 apart; decoding equals a float64 oracle of (base blocks
  on quantized activations + the fp32 delta), and the shipped checkpoint's q4 logits stay close to its fp32 ones.
"""

import copy

import pytest
import torch
from torch import nn

import fbs.engine.fused
from conftest import VOCAB, fbs_tiny, randomize, require_native, tiny_config, tiny_hf
from fbs import FBSForCausalLM, native
from fbs.engine.cache import CacheContext, KVCache
from fbs.engine.fused import decode_ops
from fbs.engine.quant import Weight, dequantize_blocks, quantize_blocks
from fbs.model.lora import add_adapters, merge_adapters, merged_lowrank
from fbs.native import quant as native_quant

pytestmark = pytest.mark.usefixtures("one_thread")

KINDS = {"q4": "q4_1", "q8": "q8_0"}


# --------------------------------------------------------------------------- blocks
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_weights_that_are_blocks_come_back_exactly(kind):
    g = torch.Generator().manual_seed(0)
    n, k = 24, 96
    d = (torch.rand(n, k // 32, generator=g) * 0.05 + 0.01).half()
    if kind == "q4_1":
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        q.view(n, -1, 32)[..., 0], q.view(n, -1, 32)[..., 1] = 0, 15  # ggml's quantizer maps min -> 0, max -> 15
        m = (torch.randn(n, k // 32, generator=g) * 0.1).half()
        blocks = (q, d, m)
    else:
        q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        q.view(n, -1, 32)[..., 0] = 127  # and max |w| -> 127
        blocks = (q, d)
    w = dequantize_blocks(*blocks)
    again = quantize_blocks(w, kind)
    assert all(torch.equal(a, b) for a, b in zip(again, blocks))
    assert torch.equal(dequantize_blocks(*again), w)


def test_a_q4_1_block_by_hand():
    w = torch.tensor([[0.25 * j - 1.0 for j in range(32)]])
    q, d, m = quantize_blocks(w, "q4_1")
    step = float(torch.tensor(7.75 / 15).half())  # (max - min) / 15, stored as fp16
    assert float(m) == -1.0 and float(d) == step
    assert q[0].tolist() == [min(15, max(0, round((0.25 * j) / step))) for j in range(32)]


# --------------------------------------------------------------------------- decoding against an oracle
def _act_quantized(x: torch.Tensor) -> torch.Tensor:
    """x (..., K) with each row's 32-value blocks rounded to q * max|block| / 127, q = round half to even."""
    k = x.shape[-1]
    kp = -(-k // 32) * 32
    xb = nn.functional.pad(x, (0, kp - k)).reshape(*x.shape[:-1], kp // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    q = torch.where(amax > 0, torch.round(xb * (127 / amax.clamp_min(1e-300))), torch.zeros_like(xb))
    return (q * amax / 127).reshape(*x.shape[:-1], kp)[..., :k]


class _QuantizedInput(nn.Module):
    def __init__(self, linear: nn.Linear, switch: dict | None):
        super().__init__()
        self.linear, self.switch = linear, switch

    def forward(self, x):
        on = self.switch is None or self.switch["layers"]
        return nn.functional.linear(_act_quantized(x) if on else x, self.linear.weight, self.linear.bias)


@torch.no_grad()
def _oracle_greedy(hf: nn.Module, prompt: list[int], n: int, quantize: bool) -> tuple[list[int], torch.Tensor]:
    """Greedy cached decoding of a float64 copy of ``hf`` as the engine computes a block format: the prompt's layers
    on fp32 GEMMs (the engine prefills with the HF modules), every Linear of a decoded token and the LM head on
    block-quantized activations (``quantize``; else none anywhere)."""
    ref = copy.deepcopy(hf).double()
    switch = {"layers": False}
    if quantize:
        for mod in list(ref.modules()):
            for child, sub in list(mod.named_children()):
                if isinstance(sub, nn.Linear):
                    setattr(mod, child, _QuantizedInput(sub, None if sub is ref.lm_head else switch))
    out = ref(torch.tensor([prompt]), use_cache=True)
    switch["layers"] = True
    logits, tokens, cache = [out.logits[0, -1].float()], [], out.past_key_values
    for _ in range(n - 1):
        tokens.append(int(logits[-1].argmax()))
        out = ref(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
        logits.append(out.logits[0, -1].float())
    tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits)


@pytest.mark.parametrize("fmt", ["q4", "q8"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_block_format_decoding_equals_an_activation_quantizing_oracle(fmt, family):
    require_native("avx2")
    hf = tiny_hf(family, 6, seed=3)
    with torch.no_grad():  # weights the format stores exactly; the tied embedding / LM head in q8_0
        for mod in hf.modules():
            if isinstance(mod, nn.Linear) and mod is not hf.lm_head:
                mod.weight.copy_(dequantize_blocks(*quantize_blocks(mod.weight, KINDS[fmt])))
        hf.lm_head.weight.copy_(dequantize_blocks(*quantize_blocks(hf.lm_head.weight, "q8_0")))
    model = FBSForCausalLM.from_base(hf, config=tiny_config()).eval()
    ops = decode_ops(model, fmt)
    assert ops.native_packed and sum(n is not None for n in ops.native_layers) >= 3
    assert torch.equal(ops.layers[2].gu.dequantized()[:128], hf.model.layers[2].mlp.gate_proj.weight)
    prompt = torch.randint(0, VOCAB - 1, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    out = model.generate([prompt], max_new_tokens=6, weights=fmt, force_compute=True, ignore_eos=True,
                         output_scores=True)
    tokens, logits = _oracle_greedy(hf, prompt, 6, quantize=True)
    plain = _oracle_greedy(hf, prompt, 6, quantize=False)[1]
    span = float(logits.max() - logits.min())
    err = float((out.scores[0] - logits).abs().max())
    assert out.new_tokens[0] == tokens
    assert err < 2e-3 * span
    assert float((plain - logits).abs().max()) > 10 * err  # the activation quantization is visible


# --------------------------------------------------------------------------- multi-token steps
def _filled_cache(spec, n: int, seed: int) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(spec.num_layers, 2, spec.num_kv_heads, spec.head_dim, 40)
    for layer in range(spec.num_layers):
        cache.k[layer].normal_(generator=g)
        cache.v[layer].normal_(generator=g)
        cache.lengths[layer] = [n, n - 3]
        cache.positions[layer] = [list(range(n)), list(range(n - 3))]
    return cache


def _clone(cache: KVCache) -> KVCache:
    out = copy.copy(cache)
    out.k, out.v = [t.clone() for t in cache.k], [t.clone() for t in cache.v]
    out.lengths = [list(r) for r in cache.lengths]
    out.positions = [[list(p) for p in r] for r in cache.positions]
    return out


@pytest.mark.parametrize("fmt", ["int8", "q4"])
@pytest.mark.parametrize("policy", ["hole", "project"])
def test_a_multi_token_step_equals_one_token_steps(fmt, policy):
    """T = 4 positions of cache row 1 in one native call of three layers, with positions skipping layers (forced),
    equal four one-token calls: outputs, the entries written (under hole a skipped position writes none, so the
    later positions take its slot) and the lengths."""
    require_native("avx2")
    model = randomize(fbs_tiny(seed=6, layers=8, paw_layers=(1,), ch_layers=(6,)), seed=7)
    ops = decode_ops(model, fmt)
    span = range(2, 5)
    assert all(ops.native_layers[l] is not None for l in span)
    spec, t, n = model.base.spec, 4, 10
    g = torch.Generator().manual_seed(9)
    x = torch.randn(1, t, spec.hidden_size, generator=g)
    pos = [n - 3 + j for j in range(t)]
    cos, sin = ops.rope(x, torch.tensor([pos]))
    runs = [[True, False, True, True], [True, True, False, False], [False, True, True, True]]  # layer x position
    write = policy == "project"
    many = _filled_cache(spec, n, 11)
    one = _clone(many)
    layers = [ops.native_layers[l] for l in span]
    flat_runs = [r for per_layer in runs for r in per_layer]
    ctx = CacheContext(many, {}, [1], [pos], cos, sin, policy)
    rc, rs = ops._rope_of(ctx)
    out = native.run_layers(layers, x.reshape(t, 1, -1).contiguous(), None, [], None, rc.contiguous(), rs.contiguous(),
                            many.k[2:5], many.v[2:5], torch.tensor([1] * t),
                            [many.lengths[l][1] for l in span for _ in range(t)], [False] * 3, flat_runs, [], 0, write)
    for j in range(t):
        cj, sj = ops.rope(x[:, j:j + 1], torch.tensor([[pos[j]]]))
        cx = CacheContext(one, {}, [1], [[pos[j]]], cj, sj, policy)
        res = ops.native_run(span, x[:, j], cx, None, None, None, [False] * 3, [runs[k][j] for k in range(3)],
                             None, 0, write)
        assert torch.allclose(out[0][j], res[0][0], atol=1e-6, rtol=1e-6)
    for k, l in enumerate(span):
        wrote = sum(runs[k]) if not write else t
        assert one.lengths[l][1] == n - 3 + wrote
        filled = slice(0, n - 3 + wrote)
        assert torch.allclose(many.k[l][1, :, filled], one.k[l][1, :, filled], atol=1e-6)
        assert torch.allclose(many.v[l][1, :, filled], one.v[l][1, :, filled], atol=1e-6)
        assert torch.equal(many.k[l][0], one.k[l][0])  # the other row untouched


@pytest.mark.parametrize("fmt", ["int8", "q4", "q8"])
def test_speculative_verification_in_native_steps_equals_full_depth(fmt):
    """Lossless self-drafting verifies drafts in multi-token native steps of the same format: its greedy output is
    full-depth decoding's in that format, and so are its logits, bit for bit (a PAW layer and a CH layer included:
    their products, norms and chunk steps give a position the same bits alone or among the T verified ones). Only
    that makes the output equal on a real model, where near-ties are common."""
    require_native("avx2")
    model = randomize(fbs_tiny(seed=7, layers=8, paw_layers=(1,), ch_layers=(6,)), seed=8, scale=0.1)
    prompts = [torch.randint(0, 255, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (12, 7)]
    kw = dict(max_new_tokens=16, ignore_eos=True, weights=fmt, output_scores=True)
    ref = model.generate(prompts, force_compute=True, **kw)
    out = model.generate(prompts, lossless=True, **kw)
    assert out.speculative.rejections > 0 and len(set(ref.new_tokens[0])) > 1
    assert out.new_tokens == ref.new_tokens
    for a, b in zip(out.scores, ref.scores):
        assert torch.equal(a, b)
    fp32 = model.generate(prompts, force_compute=True, **{**kw, "weights": "fp32"})
    assert max((a - b).abs().max() for a, b in zip(fp32.scores, ref.scores)) > 1e-3  # the format is visible


# --------------------------------------------------------------------------- multi-row products
@pytest.fixture(params=["avx512-vnni", "avx2"])
def quant_isa(request, monkeypatch):
    require_native("avx512_vnni" if request.param == "avx512-vnni" else "avx2")
    if request.param == "avx2":
        monkeypatch.setenv("FBS_NATIVE_ISA", "avx2")
    assert native_quant.isa() == request.param
    return request.param


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 13, 16])
@pytest.mark.parametrize("n", [40, 50])
def test_multi_row_products_equal_single_rows_and_the_float64_product(quant_isa, kind, m, n):
    """n = 40 or 50 output channels (not a multiple of the 16-channel tile; an odd and an even number of tiles, as
    the few-row kernel takes tiles in pairs), k = 200 inputs (not a multiple of the 32-block: zero-padded): M rows in
    one call equal M one-row calls exactly (each row's sums do not depend on the rows it shares a weight pass with)
    and the float64 product of the quantized activations."""
    g = torch.Generator().manual_seed(m)
    k = 200
    blocks = quantize_blocks(torch.randn(n, k, generator=g) * 0.1, kind)
    packed = native_quant.pack(kind, *blocks)
    x = torch.randn(m, k, generator=g) * torch.rand(1, k, generator=g) * 3
    y = native_quant.linear(x, packed, kind, n)
    rows = torch.cat([native_quant.linear(x[i:i + 1], packed, kind, n) for i in range(m)])
    assert torch.equal(y, rows)
    ref = native_quant.reference(x, dequantize_blocks(*blocks))
    assert (y.double() - ref).abs().max() <= 5e-6 * ref.abs().max()


# --------------------------------------------------------------------------- LoRA kept apart
def _lora_model(fmt: str, family: str = "llama", seed: int = 3):
    """A tiny model whose base weights are blocks of ``fmt`` (the LM head q8_0), with rank-4 adapters of a visible
    size merged into them (as loading a checkpoint with adapters does); returns (model, hf, base weights)."""
    hf = tiny_hf(family, 6, seed=seed)
    with torch.no_grad():
        for mod in hf.modules():
            if isinstance(mod, nn.Linear) and mod is not hf.lm_head:
                mod.weight.copy_(dequantize_blocks(*quantize_blocks(mod.weight, KINDS[fmt])))
        hf.lm_head.weight.copy_(dequantize_blocks(*quantize_blocks(hf.lm_head.weight, "q8_0")))
    base = {name: mod.weight.detach().clone() for name, mod in hf.named_modules() if isinstance(mod, nn.Linear)}
    model = FBSForCausalLM.from_base(hf, config=tiny_config()).eval()
    add_adapters(model.base.layers, rank=4, alpha=8.0)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "lora_a" in name else 0.05))
    assert merge_adapters(model.base.layers) == 7 * 6
    return model, hf, base


class _LoRAOracle(nn.Module):
    """y = base (quantized x) + b (a x): the block format with the delta apart, in float64. A prompt runs the merged
    weight (the engine's fp32 prefill: base + the exact factors), a decode step the native layers' product (the
    factors as the format stores them: fp16)."""

    def __init__(self, base: torch.Tensor, bias, lowrank, switch: dict):
        super().__init__()
        self.base, self.bias, self.switch = base.double(), bias, switch
        self.a, self.b = (t.detach().double() for t in lowrank)
        self.a16, self.b16 = (t.detach().half().double() for t in lowrank)

    def forward(self, x):
        if self.switch["layers"]:
            return nn.functional.linear(_act_quantized(x), self.base, self.bias) + (x @ self.a16.T) @ self.b16.T
        return nn.functional.linear(x, self.base, self.bias) + (x @ self.a.T) @ self.b.T


@torch.no_grad()
def _lora_oracle_greedy(hf, base: dict, prompt: list[int], n: int):
    ref = copy.deepcopy(hf).double()
    switch = {"layers": False}
    for name, mod in list(ref.named_modules()):
        for child, sub in list(mod.named_children()):
            full = f"{name}.{child}" if name else child
            if isinstance(sub, nn.Linear):
                lowrank = merged_lowrank(dict(hf.named_modules())[full])
                setattr(mod, child, _LoRAOracle(base[full], sub.bias, lowrank, switch) if lowrank is not None
                        else _QuantizedInput(sub, None if sub is ref.lm_head else switch))
    out = ref(torch.tensor([prompt]), use_cache=True)
    switch["layers"] = True
    logits, tokens, cache = [out.logits[0, -1].float()], [], out.past_key_values
    for _ in range(n - 1):
        tokens.append(int(logits[-1].argmax()))
        out = ref(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
        logits.append(out.logits[0, -1].float())
    tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits)


@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_lora_apart_keeps_the_base_blocks_and_decodes_like_its_oracle(fmt):
    require_native("avx2")
    model, hf, base = _lora_model(fmt)
    ops = decode_ops(model, fmt)
    assert ops.native_packed and sum(n is not None for n in ops.native_layers) >= 3
    layer = hf.model.layers[2]
    # the stored blocks are the base weights' own, exactly; the weight computed with is the merged one up to the
    # fp16 rounding of the delta's factors
    assert torch.equal(dequantize_blocks(*ops.layers[2].q.blocks), base["model.layers.2.self_attn.q_proj"])
    kvg = dequantize_blocks(*ops.layers[2].kvg.blocks)
    assert torch.equal(kvg[:32], base["model.layers.2.self_attn.k_proj"])
    assert torch.equal(kvg[32:64], base["model.layers.2.self_attn.v_proj"])
    gu = ops.layers[2].gu.dequantized()
    merged = torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]).detach()
    delta = merged - dequantize_blocks(*ops.layers[2].gu.blocks)
    assert all(torch.equal(t, t.half().float()) for t in ops.layers[2].gu.lowrank)
    assert (gu - merged).abs().max() < 2e-3 * delta.abs().max() and delta.abs().max() > 0.01
    prompt = torch.randint(0, VOCAB - 1, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    out = model.generate([prompt], max_new_tokens=6, weights=fmt, force_compute=True, ignore_eos=True,
                         output_scores=True)
    tokens, logits = _lora_oracle_greedy(hf, base, prompt, 6)
    span = float(logits.max() - logits.min())
    err = float((out.scores[0] - logits).abs().max())
    assert out.new_tokens[0] == tokens
    assert err < 2e-3 * span
    # the delta matters: the base blocks alone decode visibly differently
    with torch.no_grad():
        for mod in hf.modules():
            if merged_lowrank(mod) is not None:
                a, b = merged_lowrank(mod)
                mod.weight.sub_(b @ a)
                delattr(mod, "fbs_merged_lowrank")
    plain = model.generate([prompt], max_new_tokens=6, weights=fmt, force_compute=True, ignore_eos=True,
                           output_scores=True)
    assert float((plain.scores[0] - logits).abs().max()) > 10 * err


def test_lora_apart_without_native_kernels_is_the_merged_weight():
    """The PyTorch fallback (no packed kernels) adds the delta, its factors rounded to fp16 as the format stores them,
    to the dequantized base blocks once."""
    g = torch.Generator().manual_seed(4)
    base = dequantize_blocks(*quantize_blocks(torch.randn(40, 96, generator=g) * 0.1, "q4_1"))
    a, b = torch.randn(4, 96, generator=g) * 0.3, torch.randn(40, 4, generator=g) * 0.05
    merged = base + b @ a
    w = Weight(merged, "q4", packed=False, lowrank=(a, b))
    assert torch.equal(dequantize_blocks(*w.blocks), base)
    a16, b16 = a.half().float(), b.half().float()  # the format's factors: fp16
    assert torch.equal(w.lowrank[0], a16) and torch.equal(w.lowrank[1], b16)
    assert torch.equal(w.w, base + b16 @ a16)
    with pytest.raises(ValueError, match="low-rank delta"):
        Weight(merged, "q4", lowrank=(a, b[:, :3]))


@pytest.mark.parametrize("n,stacked,r,k", [(40, False, 4, 96), (40, False, 11, 96), (40, False, 11, 1536),
                                            (4099, False, 4, 96), (4099, True, 4, 96)])
@pytest.mark.parametrize("isa", [1, 2])
def test_a_packed_weights_delta_apart_adds_x_a_b_and_does_not_depend_on_threads_or_rows(n, stacked, r, k, isa):
    """The native product of a block weight with its LoRA delta apart (what a native layer computes): minus the same
    blocks without the delta it is x A^T B^T (float64 oracle); a row's result is the same bits alone or among other
    rows, and with one thread or two (a wide delta, 4 x 4,099, is split by columns over the threads). ``stacked``:
    two adapters stacked as one block-diagonal delta (rows 0-1 of A feed columns 0-2,047, rows 2-3 the others, whose
    zero blocks the kernel skips), with a zero stretch of columns that no adapter moves. Rank 11: the rows of A in a
    group of 8 (AVX-512) or two of 4 (AVX2) and three alone, each with the sums a row alone takes. ``isa``: 1 AVX2,
    2 AVX-512 (where the CPU has it). Rank 11 x 1,536 inputs: A's rows split over the threads (each its columns of T)."""
    require_native("avx2")
    if isa > native._isa_code():
        pytest.skip("this CPU has no AVX-512")
    g = torch.Generator().manual_seed(6)
    base = dequantize_blocks(*quantize_blocks(torch.randn(n, k, generator=g) * 0.1, "q4_1"))
    a, b = torch.randn(r, k, generator=g) * 0.3, torch.randn(n, r, generator=g) * 0.05
    if stacked:
        b[:2048, 2:] = 0.0
        b[2048:, :2] = 0.0
        b[1000:1040] = 0.0
    w = Weight(base + b @ a, "q4", packed=True, lowrank=(a, b))
    plain = native.packed_weight(native_quant.KINDS[w.kind], w.w, None, n, k)
    assert w.lowrank is not None
    x = torch.randn(5, k, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        y = w.native.linear(x, isa)
        alone = w.native.linear(x[3:4].contiguous(), isa)
        torch.set_num_threads(1)
        one = w.native.linear(x, isa)
        delta = y - plain.linear(x, isa)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(y, one) and torch.equal(alone[0], y[3])
    ref = (x.double() @ a.half().double().t()) @ b.half().double().t()  # the factors as stored: fp16
    assert torch.allclose(delta.double(), ref, atol=1e-5, rtol=1e-4)


def test_a_base_off_the_grid_quantizes_the_merged_weight():
    """A delta is kept apart only where the base weight is exactly blocks of the format (else it would cost reads
    and gain nothing): q8 of a q4-grid base, or an fp32 base, quantize the merged weight as without adapters."""
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(4, 96, generator=g) * 0.3, torch.randn(40, 4, generator=g) * 0.05
    for base, fmt in [(dequantize_blocks(*quantize_blocks(torch.randn(40, 96, generator=g) * 0.1, "q4_1")), "q8"),
                      (torch.randn(40, 96, generator=g) * 0.1, "q4")]:
        merged = base + b @ a
        w = Weight(merged, fmt, packed=False, lowrank=(a, b))
        plain = Weight(merged, fmt, packed=False)
        assert w.lowrank is None and all(torch.equal(x, y) for x, y in zip(w.blocks, plain.blocks))
        assert torch.equal(w.w, plain.w)
    on_grid = Weight(dequantize_blocks(*quantize_blocks(torch.randn(40, 96, generator=g), "q8_0")) + b @ a, "q8",
                     packed=False, lowrank=(a, b))
    assert on_grid.lowrank is not None


@pytest.mark.slow
def test_shipped_checkpoint_q4_is_close_to_fp32():
    """The shipped Stage-1 FBS checkpoint (LoRA adapters merged at load) in q4 with the delta apart: its next-token logits on
    a short prompt stay close to fp32's, closer than q4 of the merged weights (rounded onto a grid) gets."""
    require_native("avx2")
    from fbs.model.loading import load_fbs

    model = load_fbs("smollm2-135m", "stage1").eval()
    assert any(merged_lowrank(m) is not None for m in model.base.layers.modules())
    prompt = [[1, 504, 3458, 282, 4649, 314, 1345, 30, 378, 3458, 282, 5206, 314]]
    kw = dict(max_new_tokens=4, force_compute=True, ignore_eos=True, output_scores=True)
    fp32 = model.generate(prompt, weights="fp32", **kw)
    q4 = model.generate(prompt, weights="q4", **kw)
    for mod in model.base.layers.modules():  # forget the factors: q4 then rounds the merged weights
        if merged_lowrank(mod) is not None:
            delattr(mod, "fbs_merged_lowrank")
    fbs.engine.fused._FUSED.pop(model)  # the q4 copies are rebuilt without them
    rounded = model.generate(prompt, weights="q4", **kw)
    ref = fp32.scores[0]
    span = float(ref.max() - ref.min())
    err = float((q4.scores[0] - ref).abs().max())
    assert q4.new_tokens == fp32.new_tokens
    assert err < 0.05 * span
    assert err < float((rounded.scores[0] - ref).abs().max())
