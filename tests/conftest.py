"""Shared fixtures: tiny random decoders (no files) and FBS models over them."""

from __future__ import annotations

import contextlib
import shutil

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)

from fbs import FBSConfig, FBSForCausalLM

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}
VOCAB = 256


def tiny_hf(family: str = "llama", layers: int = 6, seed: int = 0, head_dim: int = 16, context: int = 128):
    """A tiny random HF model: hidden 64, 4 query heads over 2 KV heads of 16; ``head_dim=64``: hidden 128, 2 query
    heads over 1 KV head of 64 (the head width of the grouped AVX-512 attention kernel); ``context`` positions."""
    cfg_cls, model_cls = FAMILIES[family]
    torch.manual_seed(seed)
    heads = {16: (64, 4, 2), 64: (128, 2, 1)}[head_dim]
    cfg = cfg_cls(hidden_size=heads[0], num_hidden_layers=layers, num_attention_heads=heads[1], num_key_value_heads=heads[2],
                  intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=context, tie_word_embeddings=True,
                  eos_token_id=VOCAB - 1, bos_token_id=0, pad_token_id=0)
    return model_cls(cfg).eval()


def int8_exact_(hf) -> None:
    """Round every Linear weight of an HF model to q * s, per output row with a bf16 scale s and max |q| = 127: the
    int8 format (symmetric per output channel, bf16 scales) then stores it without loss, so the int8 engine runs on
    exactly the HF model's weights."""
    with torch.no_grad():
        for mod in hf.modules():
            if isinstance(mod, torch.nn.Linear):
                w = mod.weight
                s = (w.abs().amax(1, keepdim=True) / 127).to(torch.bfloat16).float()
                s[s == 0] = 1.0  # a zero row (the padding token's tied embedding) stays zero
                q = (w / s).round().clamp(-127, 127)
                top = w.abs().argmax(1, keepdim=True)
                q.scatter_(1, top, 127 * w.gather(1, top).sign())
                w.copy_(q * s)


def tiny_config(**kw) -> FBSConfig:
    base = dict(k_max=6, preview_vocab_size=48, preview_top_k=8, preview_rank=16, chunk_rank=16, chunk_cache_size=4,
                gate_rank=8, gate_width=8, paw_layers=(1,), ch_layers=(3,), never_skip_first=1, never_skip_last=1)
    base.update(kw)
    return FBSConfig(**base)


def randomize(model: FBSForCausalLM, seed: int = 1, gate_bias: float = 0.0, scale: float = 0.2) -> FBSForCausalLM:
    """Non-zero FBS weights so PAW/CH contribute and gates skip roughly half the time."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.paw.named_parameters()) + list(model.ch.named_parameters()) + \
                list(model.gates.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * scale)
        for lin in model.gates.out.values():
            lin.weight.mul_(10)
            lin.bias.fill_(gate_bias)
    return model


@pytest.fixture(params=sorted(FAMILIES))
def family(request):
    return request.param


def fbs_tiny(family="llama", seed=0, layers=6, **cfg) -> FBSForCausalLM:
    return FBSForCausalLM.from_base(tiny_hf(family, layers, seed), config=tiny_config(**cfg)).eval()


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread; restores torch's thread count afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@contextlib.contextmanager
def recorded_fused_calls(ops, names=("ffn", "block", "attention")):
    """Record (name, layer, tokens) of every call of the fused ops' ``names`` while inside; restores them after."""
    seen = []
    for name in names:
        fn = getattr(ops, name)
        setattr(ops, name, lambda l, *a, _fn=fn, _name=name, **k: (seen.append((_name, l, a[0].shape[1])),
                                                                    _fn(l, *a, **k))[1])
    try:
        yield seen
    finally:
        for name in names:
            delattr(ops, name)


def cpu_isas() -> set[str]:
    """The native kernels' code paths this CPU can run, from what it reports: "avx2" (AVX2 + FMA), "avx512"
    (AVX-512F + FMA) and "avx512_vnni" (AVX-512F/BW + VNNI + FMA, the quantized products); read from
    /proc/cpuinfo, else from torch's CPU capability."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        pass
    if not flags:
        cap = torch.backends.cpu.get_cpu_capability().lower()  # "avx512", "avx2", "default", ...
        return {"avx512": {"avx2", "avx512"}, "avx2": {"avx2"}}.get(cap, set())
    return {name for name, need in (("avx2", {"avx2", "fma"}), ("avx512", {"avx512f", "fma"}),
                                    ("avx512_vnni", {"avx512f", "avx512bw", "avx512_vnni", "fma"})) if need <= flags}


def require_native(isa: str | None = None):
    """The native extension (:mod:`fbs.native`) for a test, and with ``isa`` its int8 kernel on that code path.

    Skips only where the machine cannot run it: no C++ compiler, or a CPU that does not report ``isa``. Everywhere
    else a missing kernel fails the test (a build error, ``FBS_NATIVE=0``, or a kernel that does not run an
    instruction set the CPU reports), so native tests cannot pass by skipping on a machine that should run them."""
    from fbs import native

    if native.module() is None:
        if not native.enabled():
            pytest.fail("FBS_NATIVE=0 disables the native kernels these tests check; unset it")
        if shutil.which("c++") is None and shutil.which("g++") is None:
            pytest.skip("no C++ compiler here: the engine uses the PyTorch ops")
        pytest.fail(f"the native kernels did not build although a C++ compiler exists: {native._failed}")
    cpu = cpu_isas()
    widest = "avx512" if "avx512" in cpu else "avx2" if "avx2" in cpu else None
    runs = {2: "avx512", 1: "avx2"}.get(native.module().int8_isa())  # the kernel's own pick, FBS_NATIVE_ISA aside
    if runs != widest:
        pytest.fail(f"this CPU reports {widest or 'neither AVX2 nor AVX-512'} but the native int8 kernel runs {runs}")
    if ("avx512_vnni" in cpu) != (native.module().quant_isa() == 3):
        pytest.fail(f"this CPU reports {'' if 'avx512_vnni' in cpu else 'no '}AVX-512 VNNI but the quantized products "
                    f"pick instruction set {native.module().quant_isa()}")
    if isa is not None and isa not in cpu:
        pytest.skip(f"this CPU does not report {isa}")
    return native.module()


@pytest.fixture(params=["avx2", "avx512"])
def isa(request, monkeypatch):
    """Each code path of the native int8 kernel in turn (``FBS_NATIVE_ISA``); skips only where the CPU lacks it."""
    from fbs import native

    require_native(request.param)
    monkeypatch.setenv("FBS_NATIVE_ISA", request.param)
    assert native.int8_isa() == request.param
    return request.param


def score_modes(isa: str, hd: int, kv_dtype: str = "int8") -> list[bool]:
    """The ways attention scores this case here: with integer scores and without (:func:`fbs.native.int8_scores`)
    where they apply (an int8 cache on the grouped AVX-512 kernel, hd a multiple of 64, a CPU with VNNI); else only
    the one path there is (False)."""
    applies = kv_dtype == "int8" and isa == "avx512" and hd % 64 == 0 and "avx512_vnni" in cpu_isas()
    return [True, False] if applies else [False]


@contextlib.contextmanager
def int8_scores(on: bool):
    """Integer scores over int8 caches on (where the CPU has them) or off inside the block, as before after it."""
    from fbs import native

    before = native.int8_scores()
    native.int8_scores(on)
    try:
        yield
    finally:
        native.int8_scores(before)


def scored_query(q: torch.Tensor) -> torch.Tensor:
    """The query (last dimension a multiple of 32, fp32, already scaled) that the integer scores of an int8 cache
    score with, in float64, by the rule :func:`fbs.native.int8_scores` states: per 32 values s = max |q| / 127,
    hi = round(q * (127 / max |q|)) and lo = round(r * 254 (127 / max |q|)) with r = q - s hi rounded once, codes
    clamped to +-127; q' = s hi + (s / 254) lo, s and s / 254 as fp32 values."""
    x = q.float().reshape(*q.shape[:-1], -1, 32)
    amax = x.abs().amax(-1, keepdim=True)
    s = amax / 127
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    hi = torch.round(x * inv).clamp(-127, 127)
    r = (x.double() - hi.double() * s.double()).float()  # x - s hi with one rounding (a fused multiply-add)
    lo = torch.round(r * (254 * inv)).clamp(-127, 127)
    out = hi.double() * s.double() + lo.double() * (s / 254).double()
    return out.reshape(q.shape)
