"""The block weight formats q8 (GGUF Q8_0) and q4 (GGUF Q4_1) and the native multi-token step.

* Blocks: weights that are such blocks already come back exactly; a hand-computed row.
* Decoding in q4 / q8 against a float64 oracle written here: the HF model itself with every Linear of a decoded
  token (and the LM head) computing on activations quantized per 32-value block (q = round(x * 127 / max|x|), as
  llama.cpp's q8_0 does) times the dequantized block weights; the prompt's layers as HF computes them (the engine
  prefills with the HF modules). The engine must give its tokens, and logits within float rounding of it; the same
  oracle without the activation quantization must be far off (so that the test sees the quantization).
* A multi-token native step over T positions of one sequence equals T one-token steps (outputs, cache entries
  and lengths), with forced skips under ``hole`` and ``project``.
"""

import copy

import pytest
import torch
from torch import nn

from conftest import VOCAB, fbs_tiny, randomize, require_native, tiny_config, tiny_hf
from fbs import FBSForCausalLM, native
from fbs.engine.cache import CacheContext, KVCache
from fbs.engine.fused import decode_ops
from fbs.engine.quant import dequantize_blocks, quantize_blocks

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


@pytest.mark.parametrize("fmt", ["int8", "q4"])
def test_speculative_verification_in_native_steps_equals_full_depth(fmt):
    """Lossless self-drafting verifies drafts in multi-token native steps of the same format: its greedy output is
    full-depth decoding's in that format, token for token."""
    require_native("avx2")
    model = randomize(fbs_tiny(seed=7, layers=8, ch_layers=(6,)), seed=8, scale=0.1)
    prompts = [torch.randint(0, 255, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (12, 7)]
    kw = dict(max_new_tokens=16, ignore_eos=True, weights=fmt, output_scores=True)
    ref = model.generate(prompts, force_compute=True, **kw)
    out = model.generate(prompts, lossless=True, **kw)
    assert out.speculative.rejections > 0 and len(set(ref.new_tokens[0])) > 1
    assert out.new_tokens == ref.new_tokens
    for a, b in zip(out.scores, ref.scores):  # the verifier's logits are decoding's, to float rounding
        assert (a - b).abs().max() < 1e-5 * (b.max() - b.min())
    fp32 = model.generate(prompts, force_compute=True, **{**kw, "weights": "fp32"})
    assert max((a - b).abs().max() for a, b in zip(fp32.scores, ref.scores)) > 1e-3  # the format is visible
