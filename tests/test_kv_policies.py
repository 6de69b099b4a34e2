"""KV-cache policies under a budget (:mod:`fbs.engine.kvpolicy`): StreamingLLM, H2O, SnapKV, alone and with skipping.

Oracles: the full cache (a budget at least the context changes nothing), independent pure-Python references of
each policy's selection (H2O's accumulated attention and eviction, SnapKV's pooled observation-window votes),
a from-scratch StreamingLLM decoder over the HF modules that rotates keys at cache-relative positions as the
reference does, HF's own attention matrix, the decode trace (which entries each layer received), and exact
properties (each query head's weights sum to one).

Composition with skipping, the property tested: each layer's kept set is the policy applied to the sequence of
entries that layer received. Under ``hole`` a token that skips layer l wrote no entry there, so that sequence is
the prompt plus the decode tokens that ran layer l, and a layer that skips neither reads (no attention weight is
accumulated) nor changes its cache; under ``project`` every token wrote one, so every layer's sequence is every
position.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from conftest import fbs_tiny, int8_exact_, randomize, tiny_config, tiny_hf
from fbs import FBSForCausalLM
from fbs.engine.cache import CacheContext, KVCache
from fbs.engine.kvpolicy import SINKS, SNAP_KERNEL, SNAP_WINDOW, CachePolicy, make_policy
from fbs.engine.loop import run, start

BUDGETS = {"streaming": 12, "h2o": 12, "snapkv": SNAP_WINDOW + 6}


def prompt(n: int, seed: int = 0) -> list[int]:
    g = random.Random(seed)
    return [g.randrange(3, 250) for _ in range(n)]


def decode(model, prompts, **opts):
    """Run a generate call step by step, yielding (decoder, steps consumed so far) after each step."""
    dec = start(model, prompts, None, None, dict(ignore_eos=True, **opts))
    for out in run(dec):
        yield dec, out.step


# --------------------------------------------------------------------------- options
def test_options_are_checked():
    assert make_policy("full", None) is None and make_policy(None, None) is None
    with pytest.raises(ValueError, match="kv_budget"):
        make_policy("h2o", None)
    with pytest.raises(ValueError, match="applies to a cache policy"):
        make_policy("full", 8)
    with pytest.raises(ValueError, match="kv_cache must be one of"):
        make_policy("lru", 8)
    with pytest.raises(ValueError, match=f"kv_budget must be >= {SINKS + 1}"):
        make_policy("streaming", SINKS)
    with pytest.raises(ValueError, match=f"kv_budget must be >= {SNAP_WINDOW + 1}"):
        make_policy("snapkv", SNAP_WINDOW)
    m = fbs_tiny()
    with pytest.raises(ValueError, match="lossless"):
        m.generate([[1, 2, 3]], max_new_tokens=2, kv_cache="streaming", kv_budget=8, lossless=True)


def test_cache_is_allocated_to_the_budget():
    """Capacity follows the request: prompt + new tokens for the full cache, the budget + 1 under a policy
    (SnapKV: the budget + every generated entry)."""
    m = fbs_tiny()
    ids = [prompt(40)]
    for kv, budget, cap in (("full", None, 40 + 5), ("streaming", 10, 11), ("h2o", 10, 11),
                            ("snapkv", 34, 34 + 5)):
        dec = start(m, ids, None, None, dict(max_new_tokens=5, kv_cache=kv, kv_budget=budget))
        assert dec.cache.capacity == cap, kv
        assert dec.cache.k[0].shape[2] == cap


# --------------------------------------------------------------------------- budget and equivalence
@pytest.mark.parametrize("kv", ["streaming", "h2o", "snapkv"])
def test_each_policy_keeps_exactly_its_budget(kv, one_thread):
    m = randomize(fbs_tiny())
    budget, n = BUDGETS[kv], 44
    for dec, steps in decode(m, [prompt(n)], max_new_tokens=12, kv_cache=kv, kv_budget=budget, force_compute=True):
        for l in range(dec.L):
            held = dec.cache.lengths[l][0]
            want = budget + steps if kv == "snapkv" else budget
            assert held == want, (l, steps)
            kept = dec.cache.kept(l, 0)
            assert kept.shape == (2, want)
            for h in range(2):  # distinct positions, all of them in the context, the newest always kept
                assert len(set(kept[h].tolist())) == want and int(kept[h].max()) == n + steps - 1


def test_streaming_keeps_the_sinks_and_the_recent_window(one_thread):
    m = randomize(fbs_tiny())
    budget = BUDGETS["streaming"]
    for dec, steps in decode(m, [prompt(20)], max_new_tokens=10, kv_cache="streaming", kv_budget=budget,
                             force_compute=True):
        last = 20 + steps - 1
        for l in range(dec.L):
            assert sorted(dec.cache.kept(l, 0)[0].tolist()) == list(range(SINKS)) + list(
                range(last - (budget - SINKS) + 1, last + 1))


@pytest.mark.parametrize("weights", ["fp32", "hf", "int8"])
@pytest.mark.parametrize("kv", ["streaming", "h2o", "snapkv"])
def test_a_budget_at_least_the_context_equals_the_full_cache(kv, weights, one_thread):
    """Nothing is evicted: identical tokens; identical logits (H2O attends explicitly to read its weights, so its
    logits equal the full cache's to float rounding)."""
    m = randomize(fbs_tiny())
    ids = [prompt(30), prompt(22, 1)]
    full = m.generate(ids, max_new_tokens=10, weights=weights, output_scores=True, ignore_eos=True)
    res = m.generate(ids, max_new_tokens=10, weights=weights, output_scores=True, ignore_eos=True, kv_cache=kv,
                     kv_budget=40)
    assert res.new_tokens == full.new_tokens
    assert torch.equal(res.trace.executed, full.trace.executed)
    for a, b in zip(res.scores, full.scores):
        if kv == "h2o":
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        else:
            assert torch.equal(a, b)


@pytest.mark.parametrize("kv_policy", ["hole", "project"])
@pytest.mark.parametrize("kv", ["streaming", "h2o", "snapkv"])
def test_native_int8_step_evicts_like_the_pytorch_step(kv, kv_policy, one_thread):
    """The native int8 step (layers in one native call, attending over each row's filled prefix) against the fp32
    PyTorch step (whole buffer, length mask) under eviction and forced skips, on weights the int8 format stores
    exactly (no PAW / CH, no gates: the plan decides): the same tokens, logits to float rounding, the same kept
    positions at every layer. Under H2O the native step runs each layer's native halves, whose attention adds its
    weights to the accumulated scores (fbs_attn::accumulate): they equal the PyTorch step's to float rounding."""
    from fbs import native
    from fbs.engine.fused import decode_ops

    if native.int8_isa() is None:
        pytest.skip("no native int8 kernel here")
    hf = tiny_hf("llama")
    int8_exact_(hf)
    m = FBSForCausalLM.from_base(hf, config=tiny_config(paw_layers=(), ch_layers=())).eval()
    assert decode_ops(m, "int8").native_layers is not None
    plan = torch.rand(14, m.num_layers, generator=torch.Generator().manual_seed(3)) < 0.4
    plan[:, 0] = plan[:, -1] = False  # the never-skip layers
    ids = [prompt(44), prompt(39, 1)]
    kept, res = {}, {}
    for w in ("int8", "fp32"):
        steps = list(decode(m, ids, max_new_tokens=14, weights=w, output_scores=True, kv_cache=kv,
                            kv_budget=BUDGETS[kv], kv_policy=kv_policy, skip_plan=plan))
        dec = steps[-1][0]
        kept[w] = [[dec.cache.kept(l, r) for l in range(dec.L)] for r in range(2)]
        res[w] = dec
    assert res["int8"].out == res["fp32"].out
    assert all(torch.equal(a, b) for ra, rb in zip(kept["int8"], kept["fp32"]) for a, b in zip(ra, rb))
    if kv == "h2o":
        acc = [r.cache.evictor.acc for r in (res["int8"], res["fp32"])]
        assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(*acc)) and float(acc[0][1].sum()) > 1
    for a, b in zip(res["int8"].scores, res["fp32"].scores):
        ref = torch.stack(b)
        assert (torch.stack(a) - ref).abs().max() < 1e-4 * (ref.max() - ref.min())


# --------------------------------------------------------------------------- StreamingLLM positions
def _streaming_reference(base, ids: list[int], budget: int, new: int) -> list[torch.Tensor]:
    """A from-scratch StreamingLLM greedy decoder over the HF modules, as the reference implements it: the cache
    stores keys before RoPE; each step rotates the n kept keys at positions 0..n-1 (their cache slots, sinks
    first, then the window in order) and the query at n. The prompt is attended in full at its true positions,
    then cut to the sinks and the last budget - SINKS entries. Returns each step's logits."""
    L = base.spec.num_layers
    raw_k = [None] * L  # (1, Hkv, n, hd) un-rotated keys, in cache order
    vals = [None] * L
    logits = []
    x = base.embed(torch.tensor([ids]))
    cos, sin = base.rope(x, torch.arange(len(ids))[None])
    zero_cos, zero_sin = base.rope(x, torch.zeros(1, len(ids), dtype=torch.long))
    for l in range(L):  # prefill: full causal attention at true positions
        xn = base.norm1(l, x)
        q = base.query(l, xn, cos, sin)
        k, v = base.key_value(l, xn, cos, sin)
        raw, _ = base.key_value(l, xn, zero_cos, zero_sin)  # position 0: RoPE is the identity
        h = x + base.attn_out(l, base.attend(q, k, v, None, causal=True))
        x = h + base.mlp(l, base.norm2(l, h))
        keep = list(range(len(ids))) if len(ids) <= budget else list(range(SINKS)) + list(
            range(len(ids) - (budget - SINKS), len(ids)))
        raw_k[l], vals[l] = raw[:, :, keep], v[:, :, keep]
    token = int(base.head(x[:, -1:])[0, -1].argmax())
    for _ in range(new):
        x = base.embed(torch.tensor([[token]]))
        for l in range(L):
            xn = base.norm1(l, x)
            n = raw_k[l].shape[2]
            qc, qs = base.rope(x, torch.tensor([[n]]))
            q = base.query(l, xn, qc, qs)
            _, v = base.key_value(l, xn, qc, qs)
            raw, _ = base.key_value(l, xn, *base.rope(x, torch.zeros(1, 1, dtype=torch.long)))
            raw_k[l] = torch.cat((raw_k[l], raw), 2)
            vals[l] = torch.cat((vals[l], v), 2)
            kc, ks = base.rope(x, torch.arange(n + 1)[None])
            from fbs.model.hf_adapter import apply_rope

            keys = apply_rope(raw_k[l], kc, ks)
            h = x + base.attn_out(l, base.attend(q, keys, vals[l], None))
            x = h + base.mlp(l, base.norm2(l, h))
            if raw_k[l].shape[2] > budget:  # evict the oldest window entry
                keep = list(range(SINKS)) + list(range(SINKS + 1, budget + 1))
                raw_k[l], vals[l] = raw_k[l][:, :, keep], vals[l][:, :, keep]
        out = base.head(x)[0, -1]
        logits.append(out)
        token = int(out.argmax())
    return logits


def test_streaming_rotates_at_cache_relative_positions_like_the_reference(one_thread):
    """Against the reference's position scheme (keys rotated at their cache slots every step): the same logits
    (float rounding), on a model without PAW / CH, at full depth."""
    m = fbs_tiny(paw_layers=(), ch_layers=())
    ids, budget, new = prompt(24), 10, 12
    res = m.generate([ids], max_new_tokens=new + 1, force_compute=True, output_scores=True, ignore_eos=True,
                     kv_cache="streaming", kv_budget=budget)
    with torch.no_grad():
        ref = _streaming_reference(m.base, ids, budget, new)
    for step, want in enumerate(ref):  # scores[0] is the prefill's; scores[s + 1] follow decode step s
        torch.testing.assert_close(res.scores[0][step + 1], want, rtol=0, atol=2e-4)
    far = m.generate([ids], max_new_tokens=new + 1, force_compute=True, output_scores=True, ignore_eos=True,
                     kv_cache="full")  # sanity: the window changes the output (the test can fail)
    assert not torch.allclose(far.scores[0][-1], res.scores[0][-1], atol=1e-3)


def test_streaming_decodes_past_the_models_context():
    """The window keeps decode distances within the budget: prompt + new tokens may exceed the model's positions
    (a clear error otherwise)."""
    m = fbs_tiny()
    ids = [prompt(100)]
    with pytest.raises(ValueError, match="kv_cache='streaming'"):
        m.generate(ids, max_new_tokens=40)
    res = m.generate(ids, max_new_tokens=40, ignore_eos=True, kv_cache="streaming", kv_budget=16)
    assert len(res.new_tokens[0]) == 40
    with pytest.raises(ValueError, match="exceeds the model's context"):
        m.generate([prompt(130)], max_new_tokens=2, kv_cache="streaming", kv_budget=16)


@pytest.mark.parametrize("kv", ["h2o", "snapkv"])
def test_policies_without_a_window_keep_the_models_context(kv):
    """H2O and SnapKV keep true positions, so a request past the model's positions gets the clear error (naming
    the window policy); a prompt longer than the context is refused under every policy (it is attended in full)."""
    m = fbs_tiny()
    with pytest.raises(ValueError, match="exceeds the model's context of 128.*kv_cache='streaming'"):
        m.generate([prompt(100)], max_new_tokens=40, kv_cache=kv, kv_budget=BUDGETS[kv])
    for policy in ("full", "streaming", kv):
        budget = None if policy == "full" else BUDGETS[policy]
        with pytest.raises(ValueError, match="prompt of 130 tokens .* shorten the prompt"):
            m.generate([prompt(130)], max_new_tokens=1, kv_cache=policy, kv_budget=budget)


# --------------------------------------------------------------------------- H2O
def _ctx(cache, rows, positions, heads_q):
    t = len(positions[0])
    cos = torch.ones(len(rows), t, 4)
    return CacheContext(cache, {}, rows, positions, cos, torch.zeros_like(cos), "project", scaling=1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_native_h2o_eviction_moves_what_the_pytorch_eviction_moves(dtype, monkeypatch):
    """The native eviction (csrc/evict.cpp) against H2O's PyTorch eviction on random caches, scores with ties
    (rounded to a coarse grid) and ring slots, two rows of three: every tensor equal after the step."""
    from fbs import native
    from fbs.engine import kvpolicy

    if native.module() is None:
        pytest.skip("needs the native build")
    g = torch.Generator().manual_seed(0)
    B, hkv, cap, hd, budget = 3, 2, 12, 8, 10

    def state():
        cache = KVCache(1, B, hkv, hd, cap, dtype=dtype, policy=CachePolicy("h2o", budget))
        ev = cache.evictor
        cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=g))
        cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=g))
        ev.acc[0].copy_((torch.rand(ev.acc[0].shape, generator=g) * 4).round() / 4)  # ties
        ev.pos[0].copy_(torch.randint(0, 1000, ev.pos[0].shape, generator=g))
        return cache, ev

    for trial in range(4):
        ref, ev_ref = state()
        got, ev_got = state()
        for a, b in ((ref.k[0], got.k[0]), (ref.v[0], got.v[0]), (ev_ref.acc[0], ev_got.acc[0]),
                     (ev_ref.pos[0], ev_got.pos[0])):
            b.copy_(a)
        idx = torch.tensor([2, 0])
        old = torch.randint(ev_ref.fixed, budget, (2,), generator=g)
        new_entry = got.k[0][2, :, budget].clone()
        with monkeypatch.context() as mp:
            mp.setattr(kvpolicy.native, "h2o_evict", lambda *a: False)  # the PyTorch moves
            ev_ref._evict(0, [2, 0], idx, old)
        assert native.h2o_evict(got.k[0], got.v[0], ev_got.acc[0], ev_got.pos[0], idx, old, ev_got.fixed, budget)
        for a, b in ((ref.k[0], got.k[0]), (ref.v[0], got.v[0]), (ev_ref.acc[0], ev_got.acc[0]),
                     (ev_ref.pos[0], ev_got.pos[0])):
            assert torch.equal(a, b), trial
        assert torch.equal(got.k[0][2, :, old[0]], new_entry)  # the new entry took the ring slot (by definition)
        assert (ev_got.acc[0][idx, :, budget] == 0).all()


def test_h2o_accumulates_hand_computed_scores():
    """q = 0: every query spreads its weight evenly over the keys it sees. A prompt of 4: key j receives
    sum_{i >= j} 1 / (i + 1) from each of the 2 query heads of its KV head; one decode step adds 1 / 5 each."""
    cache = KVCache(1, 1, 1, 4, 6, policy=CachePolicy("h2o", 5))
    q, k, v = torch.zeros(1, 2, 4, 4), torch.randn(1, 1, 4, 4), torch.randn(1, 1, 4, 4)
    _ctx(cache, [0], [[0, 1, 2, 3]], 2).attend(0, q, k, v)
    acc = cache.evictor.acc[0][0, 0]
    want = [2 * sum(1 / (i + 1) for i in range(j, 4)) for j in range(4)]
    assert acc[:4].tolist() == pytest.approx(want, abs=1e-6) and acc[4:].abs().sum() == 0
    _ctx(cache, [0], [[4]], 2).attend(0, torch.zeros(1, 2, 1, 4), torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4))
    assert acc[:5].tolist() == pytest.approx([w + 2 / 5 for w in want] + [2 / 5], abs=1e-6)


def _h2o_reference(qs, ks, budget, prompt_len):
    """Pure Python H2O over one KV head with ``g`` query heads: qs[i] = [per query head (hd,)], ks[i] = (hd,).
    The prompt attends in full (causal), then keeps its last budget - budget // 2 entries and the budget // 2
    earlier ones with the largest accumulated weight; each later token attends over the kept entries and
    itself, adds its weights, and the lowest-scored non-recent entry is evicted. Returns the kept positions
    after the prompt and after each step."""
    heavy, recent = budget // 2, budget - budget // 2
    acc: dict[int, float] = {}
    kept: list[int] = []

    def attend(i, keys):
        for qh in qs[i]:
            s = [sum(a * b for a, b in zip(qh, ks[j])) for j in keys]
            mx = max(s)
            e = [math.exp(x - mx) for x in s]
            for j, w in zip(keys, e):
                acc[j] = acc.get(j, 0.0) + w / sum(e)

    for i in range(prompt_len):
        attend(i, list(range(i + 1)))
    kept = list(range(prompt_len))
    if prompt_len > budget:
        old = kept[:prompt_len - recent]
        kept = sorted(sorted(old, key=lambda j: -acc[j])[:heavy]) + kept[prompt_len - recent:]
    out = [sorted(kept)]
    for i in range(prompt_len, len(ks)):
        attend(i, kept + [i])
        kept = kept + [i]
        if len(kept) > budget:
            window = sorted(kept)[-recent:]
            cand = [j for j in kept if j not in window]
            kept.remove(min(cand, key=lambda j: acc[j]))
        out.append(sorted(kept))
    return out


def test_h2o_keeps_the_largest_accumulated_attention():
    """The engine's cache (prefill + one-token steps through CacheContext.attend) against the pure-Python H2O,
    per KV head, with 2 query heads per KV head and random queries and keys."""
    g = torch.Generator().manual_seed(2)
    hkv, grp, hd, budget, n_prompt, n = 2, 2, 4, 6, 9, 20
    q = torch.randn(1, hkv * grp, n, hd, generator=g) * 4
    k = torch.randn(1, hkv, n, hd, generator=g)
    v = torch.randn(1, hkv, n, hd, generator=g)
    cache = KVCache(1, 1, hkv, hd, budget + 1, policy=CachePolicy("h2o", budget))
    _ctx(cache, [0], [list(range(n_prompt))], hkv * grp).attend(0, q[:, :, :n_prompt], k[:, :, :n_prompt],
                                                               v[:, :, :n_prompt])
    got = [[sorted(cache.kept(0, 0)[h].tolist()) for h in range(hkv)]]
    for i in range(n_prompt, n):
        _ctx(cache, [0], [[i]], hkv * grp).attend(0, q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1])
        assert cache.lengths[0][0] == budget
        got.append([sorted(cache.kept(0, 0)[h].tolist()) for h in range(hkv)])
    for h in range(hkv):
        qs = [[q[0, h * grp + j, i].tolist() for j in range(grp)] for i in range(n)]
        ref = _h2o_reference(qs, k[0, h].tolist(), budget, n_prompt)
        assert [step[h] for step in got] == ref, h
    assert any(s[0] != s[1] for s in got)  # the heads keep different sets: a shared set would fail the test


def test_h2o_prefill_scores_equal_hf_attention_matrix(one_thread):
    """On the tiny model (no PAW / CH): after the prompt, each layer's accumulated scores are the column sums of
    HF's own attention matrix (eager, ``output_attentions``), summed over each KV head's query heads; the kept
    heavy hitters are the largest of them."""
    m = fbs_tiny(paw_layers=(), ch_layers=())
    ids, budget = prompt(30), 16
    hf = m.base.hf
    hf.config._attn_implementation = "eager"
    try:
        with torch.no_grad():
            attn = hf(torch.tensor([ids]), output_attentions=True).attentions
    finally:
        hf.config._attn_implementation = "sdpa"
    dec = start(m, [ids], None, None, dict(max_new_tokens=1, kv_cache="h2o", kv_budget=budget, force_compute=True))
    with torch.no_grad():
        dec.prefill()
    heavy, recent = budget // 2, budget - budget // 2
    for l, a in enumerate(attn):
        cols = a[0].sum(1).view(2, 2, -1).sum(1)                                         # (Hkv, T)
        kept = dec.cache.kept(l, 0)
        acc = dec.cache.evictor.acc[l][0]
        for h in range(2):
            torch.testing.assert_close(acc[h, :budget], cols[h, kept[h]], rtol=0, atol=1e-4)
            top = cols[h, :30 - recent].topk(heavy).indices.sort().values
            assert kept[h].tolist() == top.tolist() + list(range(30 - recent, 30))


# --------------------------------------------------------------------------- SnapKV
def test_snapkv_keeps_the_top_pooled_votes():
    """Against a pure-Python SnapKV: the window's softmax weights (causal) summed over the window queries and the
    KV head's query heads, max-pooled over positions (the engine's votes equal them), and the kept entries are
    a top budget - window set of them plus the window."""
    g = torch.Generator().manual_seed(1)
    hkv, grp, hd, t, budget = 2, 2, 4, SNAP_WINDOW + 12, SNAP_WINDOW + 4
    q = torch.randn(1, hkv * grp, t, hd, generator=g) * 2
    k = torch.randn(1, hkv, t, hd, generator=g)
    cache = KVCache(1, 1, hkv, hd, budget + 2, policy=CachePolicy("snapkv", budget))
    _ctx(cache, [0], [list(range(t))], hkv * grp).attend(0, q, k, torch.randn(1, hkv, t, hd, generator=g))
    prefix = t - SNAP_WINDOW
    for h in range(hkv):
        votes = [0.0] * prefix
        for i in range(prefix, t):
            for j in range(grp):
                qh = q[0, h * grp + j, i].tolist()
                s = [sum(a * b for a, b in zip(qh, k[0, h, c].tolist())) for c in range(i + 1)]
                mx = max(s)
                e = [math.exp(x - mx) for x in s]
                for c in range(prefix):
                    votes[c] += e[c] / sum(e)
        r = SNAP_KERNEL // 2
        pooled = [max(votes[max(0, c - r):c + r + 1]) for c in range(prefix)]
        assert cache.evictor.votes(q, k, 1.0)[0, h].tolist() == pytest.approx(pooled, abs=1e-5)
        kept = cache.kept(0, 0)[h].tolist()
        voted, rest = kept[:budget - SNAP_WINDOW], [c for c in range(prefix) if c not in kept]
        assert kept[budget - SNAP_WINDOW:] == list(range(prefix, t)) and voted == sorted(voted), h
        # a top set (max pooling ties neighbours; any order among equal votes is a top set)
        assert min(pooled[c] for c in voted) >= max(pooled[c] for c in rest) - 1e-6, h
    assert cache.lengths[0][0] == budget


# --------------------------------------------------------------------------- composition with skipping
def _received(dec, row: int, layer: int, steps: int) -> list[int]:
    """Positions whose entry layer ``layer`` received for ``row``: the prompt, then each consumed decode token
    whose trace says it wrote K/V there."""
    n = len(dec.prompts[row])
    return list(range(n)) + [dec.rec.ctx[row][s] for s in range(steps) if dec.rec.kv[row][s][layer]]


@pytest.mark.parametrize("kv_policy", ["hole", "project"])
def test_streaming_with_skipping_keeps_what_each_layer_received(kv_policy, one_thread):
    m = randomize(fbs_tiny(), gate_bias=0.0)
    budget = BUDGETS["streaming"]
    ids = [prompt(14), prompt(9, 1)]
    differ = False
    for dec, steps in decode(m, ids, max_new_tokens=24, kv_cache="streaming", kv_budget=budget, kv_policy=kv_policy,
                             tau=0.5):
        for r in range(2):
            sets = []
            for l in range(dec.L):
                seq = _received(dec, r, l, steps)
                want = seq if len(seq) <= budget else seq[:SINKS] + seq[-(budget - SINKS):]
                assert sorted(dec.cache.kept(l, r)[0].tolist()) == want, (kv_policy, steps, r, l)
                sets.append(tuple(want))
            differ |= len(set(sets)) > 1
    assert differ == (kv_policy == "hole")  # under hole the layers that skipped hold other positions
    assert dec.rec.executed != [[[True] * dec.L] * 24] * 2


@pytest.mark.parametrize("kv_policy", ["hole", "project"])
def test_h2o_with_skipping_a_skipped_layer_reads_nothing(kv_policy, one_thread):
    """Without eviction (a large budget), each layer's accumulated weight per KV head is exactly (query heads per
    KV head) x (queries that attended there): the prompt plus the tokens that ran the layer. A skipped layer
    accumulates nothing (under ``project`` its entry is written but nothing is attended)."""
    m = randomize(fbs_tiny(), gate_bias=0.0)
    for dec, steps in decode(m, [prompt(10)], max_new_tokens=16, kv_cache="h2o", kv_budget=64, kv_policy=kv_policy,
                             tau=0.5):
        for l in range(dec.L):
            ran = sum(dec.rec.executed[0][s][l] for s in range(steps))
            total = dec.cache.evictor.acc[l][0].sum(-1)
            torch.testing.assert_close(total, torch.full((2,), 2.0 * (10 + ran)), rtol=0, atol=1e-4)
            assert dec.cache.lengths[l][0] == len(_received(dec, 0, l, steps))
    assert any(not dec.rec.executed[0][s][l] for s in range(steps) for l in range(dec.L))


@pytest.mark.parametrize("kv_policy", ["hole", "project"])
@pytest.mark.parametrize("kv", ["h2o", "snapkv"])
def test_per_head_policies_with_skipping_keep_the_budget_and_the_recent(kv, kv_policy, one_thread):
    """Each layer holds exactly min(budget, entries received) (SnapKV: after the prompt, plus what it received
    since); H2O's recent window is the last entries that layer received."""
    m = randomize(fbs_tiny(), gate_bias=0.0)
    budget = BUDGETS[kv]
    n = 44
    for dec, steps in decode(m, [prompt(n)], max_new_tokens=16, kv_cache=kv, kv_budget=budget, kv_policy=kv_policy,
                             tau=0.5):
        for l in range(dec.L):
            seq = _received(dec, 0, l, steps)
            kept = dec.cache.kept(l, 0)
            if kv == "snapkv":
                assert kept.shape[1] == budget + len(seq) - n
                assert all(kept[h, budget:].tolist() == seq[n:] for h in range(2))
            else:
                assert kept.shape[1] == min(budget, len(seq))
                recent = seq[-(budget - budget // 2):]
                assert all(set(recent) <= set(kept[h].tolist()) for h in range(2))
