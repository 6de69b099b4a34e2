"""PAW and CH on their own: parallel vs online forms, truncation, window weights, validators."""

import math

import torch

from conftest import tiny_config
from fbs.engine import VALIDATORS
from fbs.model.chunk import ChunkHead, ChunkState
from fbs.model.preview import ParafoveaWindow, soft_window_weights


def _rand_module(mod, seed=0, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return mod


def test_chunk_parallel_equals_online():
    cfg = tiny_config(chunk_cache_size=3)
    head = _rand_module(ChunkHead(cfg, 32))
    xn = torch.randn(2, 30, 32, generator=torch.Generator().manual_seed(1))
    write = torch.rand(2, 30, generator=torch.Generator().manual_seed(2)) > 0.2
    with torch.no_grad():
        par = head(xn, write=write)
        state = ChunkState(2, 3, cfg.chunk_rank, None, torch.float32)
        for t in range(30):
            for r in range(2):
                if not write[r, t]:
                    continue
                sub = state.select(torch.tensor([r]))
                c, logits, start = head.step(xn[r:r + 1, t:t + 1], sub)
                state.assign(torch.tensor([r]), sub)
                assert torch.allclose(c[0, 0], par.c[r, t], atol=1e-5)
                assert bool(start[0]) == bool(par.boundary[r, t])
    assert par.boundary.sum() > 5 and (~par.boundary & write).sum() > 5  # both chunk starts and continuations


def test_chunk_prefill_state_equals_online_state():
    cfg = tiny_config(chunk_cache_size=4)
    head = _rand_module(ChunkHead(cfg, 32), seed=3)
    xn = torch.randn(1, 25, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        _, par_state = head(xn, return_state=True)
        state = ChunkState(1, 4, cfg.chunk_rank, None, torch.float32)
        for t in range(25):
            head.step(xn[:, t:t + 1], state)
    assert torch.equal(par_state.n_closed, state.n_closed) and torch.equal(par_state.open_count, state.open_count)
    assert torch.allclose(par_state.open_sum, state.open_sum, atol=1e-5)
    assert torch.allclose(par_state.closed, state.closed, atol=1e-5)


def test_soft_window_weights_hand_computed():
    w = soft_window_weights(torch.tensor([[2.0]]), k_max=3, gamma=4.0)[0, 0]
    expected = [1 / (1 + math.exp(-4 * (2 - r + 0.5))) for r in (1, 2, 3)]
    assert torch.allclose(w, torch.tensor(expected), atol=1e-6)


def test_paw_truncated_decode_equals_full_window_and_k_zero_gives_zero():
    for comp in ("conv", "mean", "linear", "none"):
        cfg = tiny_config(paw_compression=comp, k_max=6)
        paw = _rand_module(ParafoveaWindow(cfg, 32), seed=5)
        emb = torch.randn(cfg.preview_vocab_size, 32)
        keys = paw.vocab_proj(emb)
        xn = torch.randn(4, 1, 32, generator=torch.Generator().manual_seed(6))
        with torch.no_grad():
            full = paw(xn, emb, keys, soft=False)
            trunc = paw(xn, emb, keys, soft=False, truncate=True)
        assert torch.allclose(full.z, trunc.z, atol=1e-5), comp
        assert (full.k_hard < cfg.k_max).all()


def test_paw_fixed_k_mode_and_expectation_paths_agree():
    cfg = tiny_config(fixed_k=3, k_max=6)
    paw = _rand_module(ParafoveaWindow(cfg, 32), seed=7)
    emb = torch.randn(cfg.preview_vocab_size, 32)
    keys = paw.vocab_proj(emb)
    xn = torch.randn(1, 40, 32)  # 40 x 6 rows: dense path; 1 row below: gather path
    with torch.no_grad():
        out = paw(xn, emb, keys, soft=True)
        assert (out.k_hard == 3).all() and torch.equal(out.weights[0, 0], torch.tensor([1., 1, 1, 0, 0, 0]))
        logits = paw.horizon_logits(xn, keys, 6)
        dense = paw.expected_embeddings(logits, emb)
        gathered = paw.expected_embeddings(logits[:1, :1, :2], emb)
    assert torch.allclose(dense[0, 0, :2], gathered[0, 0], atol=1e-5)


def test_paw_decode_paths_equal_the_training_paths():
    """Decoding's weighted embedding bags equal the dense masked product (the 'other' class, here in every top-K,
    embeds to zero), and the hand-written depthwise conv equals nn.Conv1d with groups = channels."""
    from fbs.model.preview import _depthwise3

    cfg = tiny_config(k_max=6)
    paw = _rand_module(ParafoveaWindow(cfg, 32), seed=9)
    emb = torch.randn(cfg.preview_vocab_size, 32)
    logits = torch.randn(40, 6, cfg.preview_vocab_size + 1, generator=torch.Generator().manual_seed(10))
    logits[..., -1] = 10.0                                   # 'other' wins every horizon's top-K
    with torch.no_grad():
        dense = paw.expected_embeddings(logits, emb)         # 240 rows: the dense path
        bags = torch.cat([paw.expected_embeddings(logits[i:i + 1], emb) for i in range(40)])
        assert torch.allclose(bags, dense, atol=1e-5)
        u = torch.randn(2, 1, 5, 32, generator=torch.Generator().manual_seed(11))
        ref = paw.conv(u.reshape(2, 5, 32).transpose(1, 2)).transpose(1, 2).reshape(2, 1, 5, 32)
        assert torch.allclose(_depthwise3(u, paw.conv.weight, paw.conv.bias), ref, atol=1e-5)


def test_paw_row_wise_horizon_heads_equal_the_batched_heads_and_do_not_depend_on_other_rows():
    """Decoding's horizon heads (every product through a row-independent ``linear``, the horizons' mixing matrices
    in one stacked product) equal the training path's einsum, and a row's logits are the same bits alone or among
    other rows (what verifying T positions at once relies on). The oracle ``linear`` is a float64 product per row."""
    cfg = tiny_config(k_max=6)
    paw = _rand_module(ParafoveaWindow(cfg, 32), seed=12)
    emb = torch.randn(cfg.preview_vocab_size, 32)
    keys = paw.vocab_proj(emb).detach()
    xn = torch.randn(3, 2, 32, generator=torch.Generator().manual_seed(13))

    def rows(x, w, b=None):  # each row on its own, in float64
        y = torch.stack([(r.double() @ w.double().t()) for r in x.reshape(-1, x.shape[-1])])
        y = y if b is None else y + b.double()
        return y.float().reshape(*x.shape[:-1], w.shape[0])

    with torch.no_grad():
        for h in (1, 4, 6):
            ref = paw.horizon_logits(xn, keys, h)
            got = paw.horizon_logits(xn, keys, h, linear=rows)
            assert got.shape == ref.shape == (3, 2, h, cfg.preview_vocab_size + 1)
            assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), h
            alone = paw.horizon_logits(xn[1:2, 1:], keys, h, linear=rows)
            assert torch.equal(alone[0, 0], got[1, 1]), h


def test_validators():
    assert VALIDATORS["json"]('{"a": [1, 2]}') and not VALIDATORS["json"]('{"a": [1, 2}')
    assert VALIDATORS["brackets"]("f(a[0], {b})") and not VALIDATORS["brackets"]("f(a[0)]")
    assert VALIDATORS["python"]("def f(x):\n    return x\n") and not VALIDATORS["python"]("def f(x) return")


def test_fused_gates_equal_module_gates():
    from fbs.model.gate import SkipGates

    for gate_input in ("both", "residual", "preview"):
        cfg = tiny_config(gate_input=gate_input)
        gates = _rand_module(SkipGates(cfg, 32, (1, 2, 4)), seed=8)
        fused = gates.fused()
        xn, rel = torch.randn(3, 1, 32), torch.rand(3, 1)
        zlow = torch.randn(3, 1, cfg.preview_rank)
        with torch.no_grad():
            for l in (1, 2, 4):
                assert torch.allclose(fused.logits(l, xn, rel, fused.preview_terms(zlow)),
                                      gates.logits(l, xn, rel, zlow), atol=1e-5), (gate_input, l)
