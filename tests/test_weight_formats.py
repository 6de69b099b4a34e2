"""The bf16 and int8 decode weights (without the native kernel: torch's ops, bf16 activations) against a reference
that computes the same rounding with HF's modules.

The reference is HF's model with every Linear weight replaced by what the format stores (bf16, or int8 times its
bf16 scale, dequantized by hand from the quantizer's output), its input rounded to bf16 and its output (before
the bias) rounded to bf16: what the fused step's matmuls do. As in the engine, the prompt runs through the
original fp32 model (prefill), the prompt's last position and every decode step through the reference.

The reference sums in another order, so now and then a value that lies on a bf16 rounding boundary rounds the
other way (one ulp), and later layers and steps carry that on. Hence the checks: the prompt's last position (one
matmul) within one ulp; every logit within two ulps of the largest; on average at most half as far from the
reference as from the fp32 model (most cases here are exact: 0; where oneDNN's bf16 GEMM runs on AMX tiles, which
sum in another order, a boundary flips within the first steps of Qwen2 / Qwen3 and the rest carry it: 2.7x closer,
measured on such a CPU); the tokens the reference clearly prefers.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import MistralConfig, MistralForCausalLM

from conftest import VOCAB, tiny_config, tiny_hf
from fbs import FBSForCausalLM
from fbs.engine.fused import decode_ops
from fbs.engine.quant import dequantize, quantize_int8

pytestmark = pytest.mark.usefixtures("one_thread")
BF16 = torch.bfloat16
NEW = 32
SEEDS = {"llama": 1, "qwen2": 2, "qwen3": 3, "mistral": 4}


def base(family: str) -> nn.Module:
    """A tiny HF decoder with weights (and Qwen2's biases) at std 0.1: logits spread over a few units."""
    if family == "mistral":
        torch.manual_seed(0)
        hf = MistralForCausalLM(MistralConfig(hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
                                              num_key_value_heads=2, intermediate_size=128, vocab_size=VOCAB,
                                              max_position_embeddings=128, tie_word_embeddings=True,
                                              sliding_window=None)).eval()
    else:
        hf = tiny_hf(family)
    g = torch.Generator().manual_seed(SEEDS[family])
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 2 or name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return hf


def stored(w: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt == "bf16":
        return w.to(BF16).float()
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    return q.float() * s.float().unsqueeze(1)


def rounded_reference(hf: nn.Module, fmt: str) -> nn.Module:
    """A copy of ``hf`` whose Linear layers compute as the fused step's matmuls do in ``fmt`` (see the module doc);
    the LM head gets its own weight (the embedding keeps the fp32 one, as in the engine)."""
    ref = copy.deepcopy(hf)

    def post(mod, args, out):
        b = mod.bias
        return out.to(BF16).float() if b is None else (out - b).to(BF16).float() + b

    for mod in ref.modules():
        if isinstance(mod, nn.Linear):
            mod.weight = nn.Parameter(stored(mod.weight.detach(), fmt), requires_grad=False)
            mod.register_forward_pre_hook(lambda mod, args: (args[0].to(BF16).float(),))
            mod.register_forward_hook(post)
    return ref


@torch.no_grad()
def decode_logits(prefill: nn.Module, step: nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """(N, V) logits that chose each of ``tokens``: the prompt through ``prefill`` (its cache and last hidden
    state), the head and every later token through ``step``."""
    out = prefill.model(torch.tensor([prompt]), use_cache=True)
    cache, logits = out.past_key_values, [step.lm_head(out.last_hidden_state[:, -1:])[0, 0]]
    for t in tokens[:-1]:
        o = step(torch.tensor([[t]]), past_key_values=cache, use_cache=True)
        cache = o.past_key_values
        logits.append(o.logits[0, -1])
    return torch.stack(logits)


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at |x| (8 significant bits)."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - 7)


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_decode_weights_equal_the_rounded_reference(family, fmt, monkeypatch):
    monkeypatch.setenv("FBS_NATIVE", "0")  # int8: torch's op with bf16 activations, the portable path
    hf = base(family)
    model = FBSForCausalLM.from_base(hf, config=tiny_config()).eval()
    ops = decode_ops(model, fmt)
    assert not getattr(ops, "native_packed", False) and ops.head_w.w.dim() == 2
    assert ops.head_w.w.dtype == {"bf16": BF16, "int8": torch.int8}[fmt]
    prompt = torch.randint(0, VOCAB - 1, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    res = model.generate([prompt], max_new_tokens=NEW, ignore_eos=True, output_scores=True, weights=fmt,
                         force_compute=True)
    tokens, got = res.new_tokens[0], res.scores[0]
    ref = decode_logits(hf, rounded_reference(hf, fmt), prompt, tokens)
    fp32 = decode_logits(hf, hf, prompt, tokens)
    err, off = (got - ref).abs(), (got - fp32).abs()
    assert (err[0] <= bf16_ulp(torch.maximum(got[0].abs(), ref[0].abs())) + 1e-6).all(), err[0].max()
    assert err.max() <= 2 * bf16_ulp(ref.abs().max()), err.max()
    assert err.mean() <= off.mean() / 2, (err.mean(), off.mean())
    assert (off > 1e-5).float().mean() > 0.5  # the format's rounding shows against fp32
    top2 = ref.topk(2, -1).values
    clear = top2[:, 0] - top2[:, 1] > 4 * bf16_ulp(top2[:, 0])
    assert clear.sum() > NEW // 2
    assert (ref.argmax(-1) == torch.tensor(tokens))[clear].all()  # the reference chose the engine's tokens
