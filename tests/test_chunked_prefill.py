"""Chunked prefill (``prefill_chunk``): each chunk runs every layer over the kept cache plus itself, then the cache
policy evicts to its budget before the next chunk.

Oracles: the HF model's own logits (full cache), the whole-prompt prefill (full cache: tokens, trace, chunk state),
the full cache (a budget that evicts nothing), and pure-Python H2O / StreamingLLM / SnapKV over what each chunk could
see (random queries and keys, and a one-layer tiny model's own queries and keys).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from conftest import fbs_tiny, randomize, tiny_hf
from fbs import FBSForCausalLM
from fbs.engine.cache import CacheContext, KVCache
from fbs.engine.kvpolicy import (DEFAULT_PREFILL_CHUNK, SINKS, SNAP_KERNEL, SNAP_WINDOW, CachePolicy, Evictor,
                                 prefill_chunk_size, prefill_chunks)
from fbs.engine.loop import start


def prompt(n: int, seed: int = 0) -> list[int]:
    g = random.Random(seed)
    return [g.randrange(3, 250) for _ in range(n)]


# --------------------------------------------------------------------------- options and chunk boundaries
def test_chunk_boundaries_and_options():
    assert prefill_chunks(10, 0) == [(0, 10)] and prefill_chunks(10, 16) == [(0, 10)]
    assert prefill_chunks(40, 16) == [(0, 8), (8, 24), (24, 40)]        # the last chunk is a full one
    assert prefill_chunks(32, 16) == [(0, 16), (16, 32)]
    assert prefill_chunks(33, 16) == [(0, 17), (17, 33)]                # no one-token chunk
    assert prefill_chunk_size(None, None) == 0
    assert prefill_chunk_size(None, CachePolicy("h2o", 8)) == DEFAULT_PREFILL_CHUNK
    assert prefill_chunk_size(0, CachePolicy("h2o", 8)) == 0 and prefill_chunk_size(7, None) == 7
    with pytest.raises(ValueError, match="prefill_chunk must be >= 0"):
        prefill_chunk_size(-1, None)
    with pytest.raises(ValueError, match=f"prefill_chunk must be >= {SNAP_WINDOW}"):
        prefill_chunk_size(16, CachePolicy("snapkv", 40))
    m = fbs_tiny()
    with pytest.raises(ValueError, match="prefill_chunk"):
        m.generate([[1, 2, 3]], max_new_tokens=2, prefill_chunk=4, lossless=True)


def test_cli_flags_reach_the_options():
    """``--prefill-chunk`` in ``fbs generate``, ``fbs eval long-context`` and ``fbs bench``."""
    from fbs.bench.runner import RunSpec, _decode_variants
    from fbs.bench.systems import FBSSystem
    from fbs.cli import build_parser
    from fbs.engine.kvpolicy import kv_cache_options

    parser = build_parser()
    args = parser.parse_args(["generate", "hi", "--kv-cache", "h2o", "--kv-budget", "8", "--prefill-chunk", "64"])
    assert kv_cache_options(args) == {"kv_cache": "h2o", "kv_budget": 8, "prefill_chunk": 64}
    assert kv_cache_options(parser.parse_args(["generate", "hi"])) == {}
    with pytest.raises(ValueError, match=f">= {SNAP_WINDOW}"):
        kv_cache_options(parser.parse_args(["generate", "hi", "--kv-cache", "snapkv", "--kv-budget", "40",
                                            "--prefill-chunk", "8"]))
    args = parser.parse_args(["eval", "long-context", "--out", "x.json", "--prefill-chunk", "256"])
    assert args.prefill_chunk == 256
    args = parser.parse_args(["bench", "--prefill-chunk", "128"])
    assert args.prefill_chunk == 128
    spec = RunSpec(prefill_chunk=128)
    (variant,) = _decode_variants([FBSSystem(name="fbs", model=None, knobs={"tau": 0.5})], spec)
    assert variant.knobs["prefill_chunk"] == 128 and variant.name == "fbs-prefill128"


# --------------------------------------------------------------------------- full cache
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("weights", ["fp32", "hf"])
def test_full_cache_chunked_prefill_gives_the_hf_models_last_logits(family, weights, one_thread):
    """Fresh FBS modules add nothing: the chunked prefill's next-token logits are the HF model's at the last
    position, and every layer caches every prompt position."""
    hf = tiny_hf(family)
    m = FBSForCausalLM.from_base(hf, config=fbs_tiny(family).config).eval()
    ids = prompt(50, 3)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    dec = start(m, [ids], None, None, dict(max_new_tokens=1, weights=weights, prefill_chunk=16))
    with torch.no_grad():
        got = dec.prefill()[0]
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-5)
    assert all(dec.cache.positions[l][0] == list(range(50)) for l in range(dec.L))


@pytest.mark.parametrize("weights", ["fp32", "int8", "q8", "q4"])
def test_full_cache_chunked_equals_whole_prompt_with_paw_ch_and_skipping(weights, one_thread):
    """With PAW and CH contributing and the gates skipping: chunked and whole-prompt prefill give the same greedy
    tokens, skip decisions, chunk boundaries and chunk state, and logits to float rounding, in every weight format
    (the prompt's layers run the same HF products either way; the decode steps run the format's)."""
    m = randomize(fbs_tiny())
    ids = [prompt(70, 1), prompt(45, 2)]
    kw = dict(max_new_tokens=12, weights=weights, output_scores=True, ignore_eos=True)
    whole = m.generate(ids, **kw)
    chunked = m.generate(ids, prefill_chunk=16, **kw)
    assert chunked.new_tokens == whole.new_tokens
    assert torch.equal(chunked.trace.executed, whole.trace.executed)
    assert 0 < whole.trace.skip_ratio < 1  # the gates decide: skipping is part of what is compared
    assert torch.equal(chunked.trace.chunk_boundary, whole.trace.chunk_boundary)
    for a, b in zip(chunked.scores, whole.scores):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
    # the CH state after the prompt: chunked (parallel form, then one online step per token) = parallel form
    states = []
    for chunk in (0, 16):
        dec = start(m, ids, None, None, dict(max_new_tokens=1, prefill_chunk=chunk))
        with torch.no_grad():
            dec.prefill()
        states.append(dec.chunks[3])
    a, b = states
    assert torch.equal(a.n_closed, b.n_closed) and torch.equal(a.open_count, b.open_count)
    torch.testing.assert_close(a.closed, b.closed, rtol=0, atol=1e-5)
    torch.testing.assert_close(a.open_sum, b.open_sum, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kv", ["streaming", "h2o", "snapkv"])
def test_a_budget_at_least_the_context_with_chunks_equals_the_full_cache(kv, one_thread):
    m = randomize(fbs_tiny())
    ids = [prompt(70, 4)]
    kw = dict(max_new_tokens=10, output_scores=True, ignore_eos=True)
    full = m.generate(ids, **kw)
    res = m.generate(ids, kv_cache=kv, kv_budget=90, prefill_chunk=SNAP_WINDOW, **kw)
    assert res.new_tokens == full.new_tokens
    assert torch.equal(res.trace.executed, full.trace.executed)
    for a, b in zip(res.scores, full.scores):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


# --------------------------------------------------------------------------- budgets after every chunk
def _record_chunks(dec) -> list[tuple[int, int, list[list[int]]]]:
    """Wrap the evictor's prefill / extend: after every call, (layer, entries held, kept positions per head)."""
    ev, seen = dec.cache.evictor, []
    for name in ("prefill", "extend"):
        fn = getattr(ev, name)

        def wrapped(l, rows, *a, _fn=fn, **k):
            out = _fn(l, rows, *a, **k)
            seen.append((l, dec.cache.lengths[l][rows[0]], dec.cache.kept(l, rows[0]).tolist()))
            return out
        setattr(ev, name, wrapped)
    return seen


@pytest.mark.parametrize("kv, budget", [("streaming", 12), ("h2o", 12), ("snapkv", SNAP_WINDOW + 6)])
def test_each_policy_keeps_exactly_its_budget_after_every_chunk(kv, budget, one_thread):
    m = randomize(fbs_tiny())
    n, chunk = 100, SNAP_WINDOW
    dec = start(m, [prompt(n, 5)], None, None, dict(max_new_tokens=4, kv_cache=kv, kv_budget=budget,
                                                    prefill_chunk=chunk, force_compute=True))
    seen = _record_chunks(dec)
    with torch.no_grad():
        dec.prefill()
    bounds = prefill_chunks(n, chunk)
    assert len(seen) == dec.L * len(bounds)
    for i, (l, held, kept) in enumerate(seen):
        end = bounds[i // dec.L][1]
        assert l == i % dec.L and held == min(budget, end)
        for heads in kept:
            assert len(set(heads)) == held and max(heads) == end - 1 and min(heads) >= 0
            if end <= budget:
                assert heads == list(range(end))
            elif kv == "streaming":  # the sinks and the most recent positions of what the chunk could see
                assert sorted(heads) == list(range(SINKS)) + list(range(end - (budget - SINKS), end))
            else:  # the newest entries are always kept (H2O's recent window, SnapKV's observation window)
                recent = budget - budget // 2 if kv == "h2o" else SNAP_WINDOW
                assert set(range(end - recent, end)) <= set(heads)
    assert dec.cache.capacity == (budget + 4 if kv == "snapkv" else budget + 1)


def test_streaming_sinks_are_rotated_next_to_the_window_after_each_chunk(one_thread):
    """After a chunk the sinks' keys are their first rotation re-rotated to sit right before the oldest window
    entry (what a decode step's eviction leaves), not a rotation of an already re-rotated key."""
    m = fbs_tiny(paw_layers=(), ch_layers=())
    n, budget = 80, 12
    whole = start(m, [prompt(n, 6)], None, None, dict(max_new_tokens=1, force_compute=True))
    dec = start(m, [prompt(n, 6)], None, None, dict(max_new_tokens=1, kv_cache="streaming", kv_budget=budget,
                                                    prefill_chunk=16, force_compute=True))
    with torch.no_grad():
        dec.prefill()
        whole.prefill()
    base = m.base
    oldest = n - (budget - SINKS)
    delta = torch.tensor([[oldest - SINKS]])
    cos, sin = base.rope(base.embedding_weight[:1], delta)
    one, _ = base.rope(base.embedding_weight[:1], torch.zeros(1, 1, dtype=torch.long))
    from fbs.engine.kvpolicy import _rotate
    # layer 0's input is the embedding: its sinks' keys equal the full cache's, re-rotated by the distance
    want = _rotate(whole.cache.k[0][:1, :, :SINKS], cos / one[..., :1], sin / one[..., :1])
    torch.testing.assert_close(dec.cache.k[0][:1, :, :SINKS], want, rtol=0, atol=1e-5)
    torch.testing.assert_close(dec.cache.k[0][:1, :, SINKS:budget], whole.cache.k[0][:1, :, oldest:n], rtol=0,
                               atol=1e-5)


# --------------------------------------------------------------------------- H2O against a reference
def _softmax(s: list[float]) -> list[float]:
    mx = max(s)
    e = [math.exp(x - mx) for x in s]
    return [x / sum(e) for x in e]


def _h2o_chunked_reference(qs, ks, budget: int, bounds) -> tuple[list[list[int]], dict[int, float]]:
    """Pure-Python H2O over one KV head, chunk by chunk: each query of a chunk attends over the entries kept
    after the previous chunk plus the chunk's tokens up to itself, adding its weights (per query head) to their
    scores; then the budget - budget // 2 most recent positions stay, plus the budget // 2 older ones with the
    largest scores. Returns the kept positions after each chunk and the final scores."""
    heavy = budget // 2
    recent = budget - heavy
    acc: dict[int, float] = {}
    kept: list[int] = []
    out = []
    for s, e in bounds:
        for i in range(s, e):
            keys = kept + list(range(s, i + 1))
            for qh in qs[i]:
                for j, w in zip(keys, _softmax([sum(a * b for a, b in zip(qh, ks[j])) for j in keys])):
                    acc[j] = acc.get(j, 0.0) + w
        cand = sorted(kept + list(range(s, e)))
        if len(cand) > budget:
            window, older = cand[-recent:], cand[:-recent]
            cand = sorted(sorted(older, key=lambda j: -acc[j])[:heavy]) + window
        kept = cand
        out.append(list(kept))
    return out, acc


def _ctx(cache, positions, t):
    cos = torch.ones(1, t, 4)
    return CacheContext(cache, {}, [0], positions, cos, torch.zeros_like(cos), "project", scaling=1.0)


def test_h2o_chunked_keeps_what_the_reference_keeps():
    """Random queries and keys through CacheContext.attend chunk by chunk (2 query heads per KV head): the kept set
    after every chunk and the accumulated scores equal the pure-Python reference, per KV head."""
    g = torch.Generator().manual_seed(3)
    hkv, grp, hd, budget, n = 2, 2, 4, 8, 40
    bounds = prefill_chunks(n, 7)
    q = torch.randn(1, hkv * grp, n, hd, generator=g) * 3
    k = torch.randn(1, hkv, n, hd, generator=g)
    v = torch.randn(1, hkv, n, hd, generator=g)
    cache = KVCache(1, 1, hkv, hd, budget + 1, policy=CachePolicy("h2o", budget))
    got = []
    for s, e in bounds:
        _ctx(cache, [list(range(s, e))], e - s).attend(0, q[:, :, s:e], k[:, :, s:e], v[:, :, s:e])
        got.append([sorted(cache.kept(0, 0)[h].tolist()) for h in range(hkv)])
    for h in range(hkv):
        qs = [[q[0, h * grp + j, i].tolist() for j in range(grp)] for i in range(n)]
        ref, acc = _h2o_chunked_reference(qs, k[0, h].tolist(), budget, bounds)
        assert [step[h] for step in got] == ref, h
        kept = cache.kept(0, 0)[h].tolist()
        assert cache.evictor.acc[0][0, h, :budget].tolist() == pytest.approx([acc[j] for j in kept], abs=1e-5)
    assert any(s[0] != s[1] for s in got)  # the heads keep different sets


def test_h2o_chunked_on_a_tiny_model_keeps_what_the_reference_keeps(one_thread):
    """A one-layer tiny model (its layer's input is the embedding, so its queries and keys do not depend on what
    was evicted): the engine's kept set after chunked prefill equals the reference over the HF module's own
    rotated queries and keys."""
    m = fbs_tiny(layers=1, paw_layers=(), ch_layers=(), never_skip_first=0, never_skip_last=0)
    ids, budget, chunk = prompt(60, 7), 16, 12
    dec = start(m, [ids], None, None, dict(max_new_tokens=1, kv_cache="h2o", kv_budget=budget, prefill_chunk=chunk,
                                           force_compute=True))
    with torch.no_grad():
        dec.prefill()
        base = m.base
        x = base.embed(torch.tensor([ids]))
        cos, sin = base.rope(x, torch.arange(60).view(1, -1))
        xn = base.norm1(0, x)
        q = base.query(0, xn, cos, sin) * m.base.scaling  # the scale folded into the queries
        k, _ = base.key_value(0, xn, cos, sin)
    grp = q.shape[1] // k.shape[1]
    for h in range(k.shape[1]):
        qs = [[q[0, h * grp + j, i].tolist() for j in range(grp)] for i in range(60)]
        ref, _ = _h2o_chunked_reference(qs, k[0, h].tolist(), budget, prefill_chunks(60, chunk))
        assert sorted(dec.cache.kept(0, 0)[h].tolist()) == ref[-1], h


# --------------------------------------------------------------------------- SnapKV against a reference
def test_snapkv_chunked_votes_with_each_chunks_window():
    """Pure-Python SnapKV per chunk: the chunk's last SNAP_WINDOW queries vote (softmax over the kept entries and the
    chunk up to themselves) for the kept entries and the chunk's earlier tokens, votes max-pooled over that order;
    a top budget - window set stays plus the window."""
    g = torch.Generator().manual_seed(4)
    hkv, grp, hd, budget, n, chunk = 2, 2, 4, SNAP_WINDOW + 6, 3 * SNAP_WINDOW + 10, SNAP_WINDOW + 4
    q = torch.randn(1, hkv * grp, n, hd, generator=g) * 2
    k = torch.randn(1, hkv, n, hd, generator=g)
    v = torch.randn(1, hkv, n, hd, generator=g)
    cache = KVCache(1, 1, hkv, hd, budget + 2, policy=CachePolicy("snapkv", budget))
    kept = [[] for _ in range(hkv)]
    for s, e in prefill_chunks(n, chunk):
        before = [list(c) for c in kept]
        _ctx(cache, [list(range(s, e))], e - s).attend(0, q[:, :, s:e], k[:, :, s:e], v[:, :, s:e])
        for h in range(hkv):
            kept[h] = cache.kept(0, 0)[h].tolist()
            cand = before[h] + list(range(s, e))
            if len(cand) <= budget:
                assert kept[h] == cand
                continue
            w0 = len(cand) - SNAP_WINDOW
            votes = [0.0] * w0
            for a in range(w0, len(cand)):
                for j in range(grp):
                    qh = q[0, h * grp + j, cand[a]].tolist()
                    weights = _softmax([sum(x * y for x, y in zip(qh, k[0, h, c].tolist())) for c in cand[:a + 1]])
                    for c in range(w0):
                        votes[c] += weights[c]
            r = SNAP_KERNEL // 2
            pooled = [max(votes[max(0, c - r):c + r + 1]) for c in range(w0)]
            voted = kept[h][:budget - SNAP_WINDOW]
            assert kept[h][budget - SNAP_WINDOW:] == cand[w0:] and voted == sorted(voted)
            idx = [cand.index(p) for p in voted]
            rest = [c for c in range(w0) if c not in idx]
            assert min(pooled[c] for c in idx) >= max(pooled[c] for c in rest) - 1e-6, h
    assert cache.lengths[0][0] == budget


def test_evictor_extend_refuses_rows_of_different_lengths():
    cache = KVCache(1, 2, 1, 4, 10, policy=CachePolicy("h2o", 8))
    cache.lengths[0] = [3, 4]
    with pytest.raises(RuntimeError, match="different numbers of entries"):
        Evictor.extend(cache.evictor, 0, [0, 1], torch.zeros(2, 1, 2, 4), torch.zeros(2, 1, 2, 4),
                       torch.zeros(2, 1, 2, 4), [[4, 5], [4, 5]], 1.0)
