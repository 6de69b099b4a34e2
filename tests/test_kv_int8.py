"""An int8 KV cache (``kv_dtype="int8"``): each entry (a token's key or value at one KV head) stored as its int8 codes
and one fp32 scale, ``hd + 4`` bytes. Checked against hand-computed codes, against a float64 oracle over the same
decoded entries (the native attention), against the fp32 cache (decoding), against the PyTorch step (the native
layers), and under each cache policy (what is kept, stored quantized)."""

import os
import random
import subprocess
import sys

import pytest
import torch

from conftest import cpu_isas, fbs_tiny, int8_exact_, require_native, tiny_config, tiny_hf
from test_kv_half import policy_runs
from fbs import FBSForCausalLM, native
from fbs.engine.cache import KVCache
from fbs.engine.kvpolicy import SINKS
from fbs.engine.loop import run, start
from fbs.engine.quant import KV_SCALE_BYTES, kv_load, kv_store, kv_width

#: max |int8 cache - fp32 cache| of a logit relative to the fp32 logits' range: half an int8 step of an entry's
#: largest value (1 / 254 ~ 2^-8), the relative error of one stored entry; the tiny models stay about 4x below it
LOGIT_TOL = 2.0 ** -8


def prompt(n: int, seed: int = 0) -> list[int]:
    g = random.Random(seed)
    return [g.randrange(3, 250) for _ in range(n)]


# --------------------------------------------------------------------------- the entry format
def test_an_int8_entry_is_its_codes_then_its_fp32_scale():
    """Hand-computed: scale = max |x| / 127, codes round(x / scale) to nearest even, the scale's 4 bytes after the
    codes; a zero entry has scale 1 and zero codes; decoding multiplies back."""
    x = torch.tensor([[[[0.5, -1.27, 0.0, 0.3175]], [[0.0, 0.0, 0.0, 0.0]]]])  # (1, 2, 1, 4)
    e = kv_store(x, torch.int8)
    assert e.shape == (1, 2, 1, 4 + KV_SCALE_BYTES) and e.dtype == torch.int8 and kv_width(4, torch.int8) == 8
    s = torch.tensor(1.27) / 127  # 0.01 in fp32
    assert e[0, 0, 0, :4].tolist() == [round(0.5 / float(s)), -127, 0, round(0.3175 / float(s))] == [50, -127, 0, 32]
    assert e[0, 0, 0, 4:].contiguous().view(torch.float32).item() == s.item()
    assert e[0, 1, 0, :4].tolist() == [0, 0, 0, 0] and e[0, 1, 0, 4:].contiguous().view(torch.float32).item() == 1.0
    y = kv_load(e, torch.float32)
    assert y.shape == x.shape and torch.equal(y[0, 0, 0], torch.tensor([50, -127, 0, 32]) * s)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 7, 24, generator=g) * 5
    err = (kv_load(kv_store(x, torch.int8), torch.float32) - x).abs()
    assert (err <= x.abs().amax(-1, keepdim=True) / 254 * (1 + 1e-6)).all()  # half a step of each entry's own scale
    assert kv_width(24, torch.float16) == 24 and torch.equal(kv_store(x, torch.float16), x.half())


def test_an_int8_cache_stores_entries_and_reads_fp32():
    c = KVCache(2, 2, 2, 8, 10, dtype=torch.int8, compute_dtype=torch.float32)
    assert c.k[0].shape == (2, 2, 10, 8 + KV_SCALE_BYTES)
    k, v = torch.randn(2, 2, 3, 8) * 3, torch.randn(2, 2, 3, 8)
    c.write(1, [0, 1], k, v, [[0, 1, 2]] * 2)
    kk, vv, mask = c.view(1, [1])
    assert kk.dtype == torch.float32 and mask is None
    assert torch.equal(kk, kv_load(kv_store(k[1:], torch.int8), torch.float32))
    assert torch.equal(vv, kv_load(kv_store(v[1:], torch.int8), torch.float32))


# --------------------------------------------------------------------------- the native attention
# (over an int8 cache against float64 SDPA: tests/test_kv_half.py, test_native_attention_over_reduced_kv_...)
def test_native_attention_refuses_an_int8_cache_without_room_for_the_scales(isa):
    q = torch.randn(1, 2, 1, 16)
    k = v = torch.randn(1, 1, 1, 16)
    kc = torch.zeros(1, 1, 4, 16, dtype=torch.int8)  # hd codes but no scale bytes
    with pytest.raises(RuntimeError, match="int8: hd codes and a 4-byte scale"):
        native.attend_one(q, k, v, kc, kc.clone(), torch.tensor([0]), torch.tensor([0]), 1.0)


# --------------------------------------------------------------------------- decoding
def _run(model, prompts, new=10, **opts):
    return model.generate(prompts, max_new_tokens=new, ignore_eos=True, output_scores=True, force_compute=True, **opts)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_decoding_with_an_int8_cache_stays_within_tolerance_of_fp32(family, weights, one_thread):
    """The first token's logits (the prompt's prefill, fresh fp32 K/V) are the fp32 cache's exactly; every later
    step's, up to the first token where the runs part, within :data:`LOGIT_TOL` of the fp32 cache's relative to
    their range and not equal. fp32 weights read the cache through :meth:`KVCache.view` (decoded, SDPA); int8 runs
    the native layers (codes converted and scaled in registers)."""
    m = fbs_tiny(family, seed=2)
    prompts = [prompt(20), prompt(9, 1)]
    ref = _run(m, prompts, weights=weights)
    out = _run(m, prompts, weights=weights, kv_dtype="int8")
    compared = 0
    for r in range(len(prompts)):
        a, b = out.scores[r], ref.scores[r]
        assert torch.equal(a[0], b[0])
        same = 1
        while same < len(b) and out.new_tokens[r][same - 1] == ref.new_tokens[r][same - 1]:
            same += 1
        for j in range(1, same):
            err = (a[j] - b[j]).abs().max()
            assert 0 < err < LOGIT_TOL * (b[j].max() - b[j].min()), (r, j, float(err))
            compared += 1
    assert compared >= 10


def test_native_layers_over_an_int8_cache_equal_the_pytorch_step(isa, one_thread):
    """The native int8 layers over an int8 cache against the per-op PyTorch step over its own int8 cache (weights the
    int8 format stores exactly, every layer run): the same tokens, logits within a small fraction of the int8
    tolerance (the two compute K in a different fp32 order, so a code may land one step apart), the cached codes at
    most one step apart with scales to fp32 rounding."""
    hf = tiny_hf("llama")
    int8_exact_(hf)
    m = FBSForCausalLM.from_base(hf, config=tiny_config(paw_layers=(), ch_layers=())).eval()
    prompts = [prompt(20), prompt(9, 1)]
    decs = {}
    for w in ("int8", "fp32"):
        dec = start(m, prompts, None, None, dict(max_new_tokens=8, ignore_eos=True, output_scores=True, weights=w,
                                                  force_compute=True, kv_dtype="int8"))
        for _ in run(dec):
            pass
        decs[w] = dec
    a, b = decs["int8"], decs["fp32"]
    assert a.out == b.out
    hd = a.cache.head_dim
    for l in range(a.L):
        assert a.cache.k[l].dtype == torch.int8
        n = a.cache.lengths[l][0]
        assert n == b.cache.lengths[l][0]
        for ca, cb in ((a.cache.k[l], b.cache.k[l]), (a.cache.v[l], b.cache.v[l])):
            ea, eb = ca[:, :, :n], cb[:, :, :n]
            assert (ea[..., :hd].int() - eb[..., :hd].int()).abs().max() <= 1
            sa, sb = kv_load(ea, torch.float32), kv_load(eb, torch.float32)
            assert (sa - sb).abs().max() <= sb.abs().max() / 100
    for sa, sb in zip(a.scores, b.scores):
        ref = torch.stack(sb)
        assert (torch.stack(sa) - ref).abs().max() < LOGIT_TOL / 4 * (ref.max() - ref.min())


# --------------------------------------------------------------------------- cache policies
@pytest.mark.parametrize("kv", ["streaming", "h2o", "snapkv"])
@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_policies_store_what_they_keep_in_int8(kv, weights, one_thread):
    """Under a cache policy with int8 storage: the budget is kept at every layer, the kept positions at layer 0
    (where keys depend only on the token and its position) are the fp32 cache's, and so are its stored entries,
    quantized: exactly :func:`kv_store` of the fp32 cache's entries (keys over the cache's key factors) for the
    window / voted entries (an eviction moves an entry with its scale), within one code step for StreamingLLM's
    re-rotated sinks."""
    full, q8, keep = policy_runs(kv, weights, "int8")
    hd = q8.cache.head_dim
    for l in range(q8.L):
        assert q8.cache.k[l].dtype == torch.int8 and q8.cache.lengths[l][0] == keep
    pos_q, pos_f = q8.cache.kept(0, 0), full.cache.kept(0, 0)
    if kv != "h2o":  # H2O's heavy hitters follow attention sums, which the rounding may reorder at near ties
        assert torch.equal(pos_q, pos_f)
    if torch.equal(pos_q, pos_f):
        kq = q8.cache.k[0][0, :, :keep]
        kf = kv_store(full.cache.k[0][0, :, :keep], torch.int8, q8.cache.key_factor[0])
        start_ = SINKS if kv == "streaming" else 0
        assert torch.equal(kq[:, start_:], kf[:, start_:])
        assert torch.equal(q8.cache.v[0][0, :, :keep], kv_store(full.cache.v[0][0, :, :keep], torch.int8))
        if kv == "streaming":
            assert (kq[:, :SINKS, :hd].int() - kf[:, :SINKS, :hd].int()).abs().max() <= 1


def test_the_integer_scores_follow_the_environment_switch():
    """``FBS_INT8_SCORES=0`` turns the integer scores off for the process (fbs.native.int8_scores); unset, they are on
    exactly where the CPU has AVX-512 VNNI; the switch turns them on and off in a running process."""
    require_native()
    probe = "from fbs import native; print(native.int8_scores())"
    env = {k: v for k, v in os.environ.items() if k != "FBS_INT8_SCORES"}
    off = subprocess.run([sys.executable, "-c", probe], env={**env, "FBS_INT8_SCORES": "0"}, capture_output=True,
                         text=True, check=True)
    assert off.stdout.strip() == "False"
    vnni = "avx512_vnni" in cpu_isas()
    before = native.int8_scores()
    try:
        assert native.int8_scores(True) is vnni
        assert native.int8_scores(False) is False
    finally:
        native.int8_scores(before)
