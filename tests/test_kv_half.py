"""A half-precision KV cache (``kv_dtype`` fp16 / bf16): the native attention over half K/V against a float64 oracle
over the same rounded entries, decoding with a half cache against the fp32 cache, and the cache policies storing
what they keep under half storage."""

import random

import pytest
import torch

from conftest import fbs_tiny, int8_exact_, int8_scores, score_modes, scored_query, tiny_config, tiny_hf
from fbs import FBSForCausalLM, native
from fbs.engine.cache import KV_DTYPES, KVCache, kv_storage_dtype
from fbs.engine.decoder import DecodeOptions
from fbs.engine.defaults import default_prefill
from fbs.engine.kvpolicy import SINKS
from fbs.engine.loop import run, start
from fbs.engine.quant import kv_load, kv_store

HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}
#: max |half - fp32| of a logit relative to the fp32 logits' range: one unit roundoff of the storage (2^-11 fp16,
#: 2^-8 bf16), the relative error of one rounded entry; the tiny models stay about 10x below it
LOGIT_TOL = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}


def prompt(n: int, seed: int = 0) -> list[int]:
    g = random.Random(seed)
    return [g.randrange(3, 250) for _ in range(n)]


# --------------------------------------------------------------------------- options
def test_kv_dtype_is_checked():
    with pytest.raises(ValueError, match="kv_dtype must be one of fp32, fp16, bf16, int8, got 'fp8'"):
        DecodeOptions(kv_dtype="fp8")
    assert kv_storage_dtype("fp32", torch.bfloat16) is torch.bfloat16  # fp32: the model's own dtype
    assert kv_storage_dtype("fp16", torch.float32) is torch.float16
    assert kv_storage_dtype("int8", torch.float32) is torch.int8
    assert set(KV_DTYPES) == {"fp32", "fp16", "bf16", "int8"}


def test_a_half_cache_stores_rounded_entries_and_reads_fp32():
    """KVCache.write rounds to the storage dtype (PyTorch's cast: round to nearest even) and view returns the compute
    dtype, so SDPA (which needs one dtype) reads them."""
    c = KVCache(2, 1, 2, 8, 10, dtype=torch.float16, compute_dtype=torch.float32)
    k, v = torch.randn(1, 2, 3, 8) * 3, torch.randn(1, 2, 3, 8)
    c.write(1, [0], k, v, [[0, 1, 2]])
    assert c.k[1].dtype == torch.float16 and c.k[1].element_size() == 2
    kk, vv, mask = c.view(1, [0])
    assert kk.dtype == vv.dtype == torch.float32 and mask is None
    assert torch.equal(kk, k.half().float()) and torch.equal(vv, v.half().float())
    assert not torch.equal(kk, k)  # rounded, not kept


# --------------------------------------------------------------------------- the native attention
@pytest.mark.parametrize("kv_dtype", ["fp16", "bf16", "int8"])
@pytest.mark.parametrize("hd", [12, 24, 64, 128])
@pytest.mark.parametrize("heads", [(6, 2), (4, 4)])
@pytest.mark.parametrize("threads", [1, 2])
def test_native_attention_over_reduced_kv_equals_float64_sdpa(isa, kv_dtype, hd, heads, threads):
    """Write + one-query attention over a half (or int8) cache: the new K/V stored as the PyTorch codec stores them
    (:func:`kv_store`: PyTorch's cast; int8: codes and a scale per entry, tests/test_kv_int8.py), and the output equal
    to a float64 SDPA over the same stored cache, decoded, within fp32 accumulation error. Head dims 64 / 128 take the
    grouped AVX-512 kernel (key ranges split across threads, tails of 16 keys), 24 the per-head AVX2 (and, on
    AVX-512, the scalar) path, 12 the scalar one; GQA (6 query heads over 2 KV heads) and one query head per KV head;
    rows that share a cache row (consecutive positions of one sequence, each seeing its own prefix) next to one of
    their own. An int8 cache on the grouped kernel with VNNI runs both with integer scores, where the oracle scores
    the query those scores use (:func:`scored_query`, the rule stated by :func:`fbs.native.int8_scores`), and
    without."""
    dt = KV_DTYPES[kv_dtype]
    H, Hkv = heads
    g = torch.Generator().manual_seed(hd + threads + H)
    B, C = 3, 300
    kc = kv_store(torch.randn(B, Hkv, C, hd, generator=g) * 2, dt)
    vc = kv_store(torch.randn(B, Hkv, C, hd, generator=g) * 3, dt)
    idx = torch.tensor([1, 1, 1, 0])  # three positions of cache row 1, one of row 0
    slots = torch.tensor([270, 271, 272, 5])
    b = idx.numel()
    q = torch.randn(b, 1, H, hd, generator=g).transpose(1, 2) * 3
    k = torch.randn(b, 1, Hkv, hd, generator=g).transpose(1, 2) * 2
    v = torch.randn(b, Hkv, 1, hd, generator=g) * 4
    kr, vr = kc.clone(), vc.clone()
    kr[idx, :, slots], vr[idx, :, slots] = kv_store(k[:, :, 0], dt), kv_store(v[:, :, 0], dt)
    valid = (torch.arange(C).unsqueeze(0) <= slots.unsqueeze(1))[:, None, None, :]
    for integer in score_modes(isa, hd, kv_dtype):
        qr, scale = (scored_query(q * 0.2), 1.0) if integer else (q.double(), 0.2)
        ref = torch.nn.functional.scaled_dot_product_attention(
            qr, kv_load(kr[idx], torch.float64), kv_load(vr[idx], torch.float64), attn_mask=valid, scale=scale,
            enable_gqa=H != Hkv)
        ref = ref.transpose(1, 2).reshape(b, 1, H * hd)
        n = torch.get_num_threads()
        torch.set_num_threads(threads)
        kw, vw = kc.clone(), vc.clone()
        try:
            with int8_scores(integer):
                got = native.attend_one(q, k, v, kw, vw, idx, slots, 0.2)
        finally:
            torch.set_num_threads(n)
        assert torch.equal(kw, kr) and torch.equal(vw, vr)  # written as the PyTorch codec writes them
        assert got.dtype == torch.float32
        assert (got.double() - ref).abs().max() < 4e-6 * ref.abs().max()


def test_native_attention_refuses_other_cache_dtypes(isa):
    q = torch.randn(1, 2, 1, 16)
    k = v = torch.randn(1, 1, 1, 16)
    kc = torch.zeros(1, 1, 4, 16, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="KV caches must be float32, float16, bfloat16 or int8"):
        native.attend_one(q, k, v, kc, kc.clone(), torch.tensor([0]), torch.tensor([0]), 1.0)
    with pytest.raises(RuntimeError, match="one shape and dtype"):
        native.attend_one(q, k, v, kc.half(), kc.bfloat16(), torch.tensor([0]), torch.tensor([0]), 1.0)


# --------------------------------------------------------------------------- decoding
def _run(model, prompts, new=10, **opts):
    return model.generate(prompts, max_new_tokens=new, ignore_eos=True, output_scores=True, force_compute=True, **opts)


@pytest.mark.parametrize("kv_dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_decoding_with_a_half_cache_stays_within_tolerance_of_fp32(kv_dtype, family, weights, one_thread):
    """Every layer run from the same prompts: the first token's logits (the prompt's prefill, fresh fp32 K/V) are the
    fp32 cache's exactly; every later step's, up to the first token where the two runs part (a near tie), within
    :data:`LOGIT_TOL` of the fp32 cache's relative to their range, and not equal (the cache is read rounded). fp32
    weights attend with the PyTorch step (SDPA over the converted cache); int8 runs the native layers (the half
    entries converted in registers) on a CPU with their kernels."""
    m = fbs_tiny(family, seed=2)
    prompts = [prompt(20), prompt(9, 1)]
    ref = _run(m, prompts, weights=weights)
    out = _run(m, prompts, weights=weights, kv_dtype=kv_dtype)
    compared = 0
    for r in range(len(prompts)):
        a, b = out.scores[r], ref.scores[r]
        assert torch.equal(a[0], b[0])
        same = 1
        while same < len(b) and out.new_tokens[r][same - 1] == ref.new_tokens[r][same - 1]:
            same += 1
        for j in range(1, same):
            err = (a[j] - b[j]).abs().max()
            assert 0 < err < LOGIT_TOL[kv_dtype] * (b[j].max() - b[j].min()), (r, j, float(err))
            compared += 1
    assert compared >= 10


@pytest.mark.slow
def test_smollm2_greedy_tokens_with_an_fp16_cache_equal_fp32(one_thread):
    """SmolLM2-135M, a short chat prompt, 24 greedy tokens: an fp16 cache gives the fp32 cache's tokens with int8
    weights (native layers, fp32 activations) and fp32 weights (PyTorch step). Not asserted for q4 / q8: their
    activations are requantized to int8 per block in every product, so any perturbation (here the rounded cache)
    may flip a rounding step and move a logit by far more than the perturbation; on this prompt q4 parts at a near
    tie (top-2 margin 0.03) after 11 tokens."""
    from fbs.model.bases import load_base

    hf, tok = load_base("smollm2-135m")
    m = FBSForCausalLM.from_base(hf, tokenizer=tok).eval()
    text = tok.apply_chat_template([{"role": "user", "content": "Name three rivers of Europe."}],
                                   add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    for weights in ("int8", "fp32"):
        ref = m.generate([ids], max_new_tokens=24, force_compute=True, ignore_eos=True, weights=weights)
        out = m.generate([ids], max_new_tokens=24, force_compute=True, ignore_eos=True, weights=weights,
                         kv_dtype="fp16")
        assert out.new_tokens == ref.new_tokens, weights


@pytest.mark.parametrize("kv_dtype", ["fp16", "bf16"])
def test_native_layers_over_a_half_cache_equal_the_pytorch_step(isa, kv_dtype, one_thread):
    """The native int8 layers over a half cache against the per-op PyTorch step over the same half cache (weights
    the int8 format stores exactly, every layer run): same tokens, logits to fp32 rounding; the caches hold the
    same rounded entries."""
    hf = tiny_hf("llama")
    int8_exact_(hf)
    m = FBSForCausalLM.from_base(hf, config=tiny_config(paw_layers=(), ch_layers=())).eval()
    prompts = [prompt(20), prompt(9, 1)]
    decs = {}
    for w in ("int8", "fp32"):
        dec = start(m, prompts, None, None, dict(max_new_tokens=8, ignore_eos=True, output_scores=True, weights=w,
                                                  force_compute=True, kv_dtype=kv_dtype))
        for _ in run(dec):
            pass
        decs[w] = dec
    a, b = decs["int8"], decs["fp32"]
    assert a.out == b.out
    for l in range(a.L):
        assert a.cache.k[l].dtype == HALF[kv_dtype]
        n = a.cache.lengths[l][0]
        assert n == b.cache.lengths[l][0]
        diff = (a.cache.k[l][:, :, :n].float() - b.cache.k[l][:, :, :n].float()).abs().max()
        assert diff <= 4 * torch.finfo(HALF[kv_dtype]).eps * b.cache.k[l].float().abs().max()
    for sa, sb in zip(a.scores, b.scores):
        ref = torch.stack(sb)
        assert (torch.stack(sa) - ref).abs().max() < 1e-4 * (ref.max() - ref.min())


# --------------------------------------------------------------------------- cache policies
def policy_runs(kv: str, weights: str, storage: str):
    """The tiny model decoding 10 tokens after a 44-token prompt under policy ``kv`` (budget 12, SnapKV 40) with an
    fp32 cache and with ``storage``: (fp32 run, ``storage`` run, entries each layer keeps at the end), both having
    produced the same tokens (so layer 0 saw the same inputs)."""
    budget = {"streaming": 12, "h2o": 12, "snapkv": 40}[kv]
    m = fbs_tiny("llama", seed=3)
    ids = [prompt(44)]
    decs = {}
    for dt in ("fp32", storage):
        dec = start(m, ids, None, None, dict(max_new_tokens=10, ignore_eos=True, weights=weights, force_compute=True,
                                             kv_cache=kv, kv_budget=budget, kv_dtype=dt))
        for _ in run(dec):
            pass
        decs[dt] = dec
    assert decs[storage].out == decs["fp32"].out
    return decs["fp32"], decs[storage], budget if kv != "snapkv" else budget + 9  # SnapKV appends what it decodes


@pytest.mark.parametrize("kv", ["streaming", "h2o", "snapkv"])
@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_policies_store_what_they_keep_in_half(kv, weights, one_thread):
    """Under a cache policy with fp16 storage: the budget is kept at every layer, the kept positions at layer 0
    (where keys depend only on the token and its position) are the fp32 cache's, and so are its stored entries,
    rounded: exactly for the window / voted entries, within two fp16 steps for StreamingLLM's re-rotated sinks."""
    full, half, keep = policy_runs(kv, weights, "fp16")
    for l in range(half.L):
        assert half.cache.k[l].dtype == torch.float16 and half.cache.lengths[l][0] == keep
    pos_h, pos_f = half.cache.kept(0, 0), full.cache.kept(0, 0)
    if kv != "h2o":  # H2O's heavy hitters follow attention sums, which the rounding may reorder at near ties
        assert torch.equal(pos_h, pos_f)
    if torch.equal(pos_h, pos_f):
        kh, kf = half.cache.k[0][0, :, :keep].float(), full.cache.k[0][0, :, :keep].half().float()
        start_ = SINKS if kv == "streaming" else 0
        assert torch.equal(kh[:, start_:], kf[:, start_:])
        assert torch.equal(half.cache.v[0][0, :, :keep].float(), full.cache.v[0][0, :, :keep].half().float())
        if kv == "streaming":
            step = 2 * torch.finfo(torch.float16).eps * kf[:, :SINKS].abs().max()
            assert (kh[:, :SINKS] - kf[:, :SINKS]).abs().max() <= step


# --------------------------------------------------------------------------- command line
from test_cli_e2e import NEW, PROMPT, api_text, chat_ids, run_cli, saved  # noqa: E402,F401  (the saved tiny model)


def test_generate_kv_dtype_flag_equals_the_api(saved, capsys):  # noqa: F811
    """``fbs generate --kv-dtype fp16``: the API's text with ``kv_dtype="fp16"``, the dtype in the JSON summary; an
    unknown dtype is refused by the parser."""
    import json

    ref, text = api_text(saved.model, chat_ids(), max_new_tokens=NEW, kv_dtype="fp16")
    code, out, _ = run_cli(capsys, ["generate", PROMPT, *saved.args, "--max-new-tokens", str(NEW), "--json",
                                    "--kv-dtype", "fp16"])
    doc = json.loads(out)
    assert code == 0 and doc["text"] == text and doc["kv_dtype"] == "fp16"
    assert doc["skip_ratio"] == pytest.approx(ref.trace.skip_ratio)
    with pytest.raises(SystemExit):
        run_cli(capsys, ["generate", PROMPT, *saved.args, "--kv-dtype", "fp8"])


def test_eval_run_kv_dtype_flag_reaches_generation(saved):  # noqa: F811
    """``fbs eval run --system fbs --kv-dtype bf16``: the generation kwargs carry it and the name says so; the base
    system refuses it (it has no engine cache)."""
    from fbs.cli import build_parser
    from fbs.eval.cli import build_system

    system = build_system(build_parser().parse_args(["eval", "run", "--system", "fbs", *saved.args,
                                                     "--kv-dtype", "bf16"]))
    assert system.generate_kwargs == {"kv_dtype": "bf16"} and "kv-dtype=bf16" in system.name
    with pytest.raises(ValueError, match="--kv-dtype .* --system fbs"):
        build_system(build_parser().parse_args(["eval", "run", "--system", "base", "--model", saved.base,
                                                "--kv-dtype", "bf16"]))


def test_bench_runs_each_fbs_system_once_per_kv_dtype():
    """``fbs bench --kv-dtype fp32,fp16``: each FBS system twice, the fp16 one named ``-kvfp16`` with the knob;
    unknown or repeated dtypes are refused."""
    from fbs.bench.runner import RunSpec, _decode_variants
    from fbs.bench.systems import FBSSystem

    spec = RunSpec(kv_dtypes=("fp32", "fp16"), weights=("q4",))
    sys_ = FBSSystem(name="fbs-full-compute", model=None, knobs={"force_compute": True})
    rows = {s.name: s.knobs for s in _decode_variants([sys_], spec)}
    pre = default_prefill("q4")  # auto: bf16 on a CPU with AMX-BF16, else fp32 (named where it is not fp32)
    p = "" if pre == "fp32" else f"-{pre}prefill"
    assert set(rows) == {f"fbs-full-compute-q4{p}", f"fbs-full-compute-q4-kvfp16{p}"}
    assert rows[f"fbs-full-compute-q4-kvfp16{p}"]["kv_dtype"] == "fp16" and "kv_dtype" not in rows[f"fbs-full-compute-q4{p}"]
    for bad in (("fp8",), ("fp16", "fp16"), ()):
        with pytest.raises(ValueError, match="kv_dtype"):
            RunSpec(kv_dtypes=bad)
