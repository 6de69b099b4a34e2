"""Decoding engine: no leakage, cache consistency, parallel == cached under hard gates, true skipping."""

import pytest
import torch

from conftest import fbs_tiny, randomize

PROMPT = torch.randint(0, 255, (1, 12), generator=torch.Generator().manual_seed(5))


def _ids(seed, n=24, batch=1):
    return torch.randint(0, 255, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("policy", ["project", "hole"])
def test_suffix_invariance_main_and_preview(family, policy):
    """Appendix C.4 tests 1-2: position i's logits and preview distributions ignore tokens after i."""
    model = randomize(fbs_tiny(family))
    a = _ids(0)
    b = a.clone()
    i = 11
    b[0, i + 1:] = _ids(1)[0, i + 1:]
    with torch.no_grad():
        oa = model(a, kv_policy=policy)
        ob = model(b, kv_policy=policy)
    assert oa.skips[0, : i + 1].sum() > 0, "skipping must be on for the test to mean anything"
    assert (oa.logits[0, : i + 1] - ob.logits[0, : i + 1]).abs().max() < 1e-6
    pa, pb = oa.preview_logits.softmax(-1), ob.preview_logits.softmax(-1)
    assert (pa[:, 0, : i + 1] - pb[:, 0, : i + 1]).abs().max() < 1e-6
    assert (oa.logits[0, i + 2:] - ob.logits[0, i + 2:]).abs().max() > 1e-3  # the suffix does matter later


@pytest.mark.parametrize("policy", ["project", "hole"])
def test_cache_consistency_recompute_vs_cache(policy):
    """Appendix C.4 test 3: greedy tokens from the KV-cached engine equal recomputing every step."""
    model = randomize(fbs_tiny(), gate_bias=0.0)
    res = model.generate(PROMPT, max_new_tokens=16, ignore_eos=True, kv_policy=policy)
    assert 0 < res.trace.skip_ratio < 1
    seq = PROMPT.clone()
    with torch.no_grad():
        for _ in range(16):
            out = model(seq, kv_policy=policy, gate_from=PROMPT.shape[1])
            seq = torch.cat([seq, out.logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert res.sequences.tolist() == seq.tolist()


@pytest.mark.parametrize("policy", ["project", "hole"])
def test_parallel_hard_gates_equal_cached_decoding(policy):
    """The parallel forward with the engine's executed skip plan reproduces its logits (both KV policies)."""
    model = randomize(fbs_tiny("qwen3"), seed=1)
    res = model.generate(PROMPT, max_new_tokens=12, ignore_eos=True, kv_policy=policy, output_scores=True)
    tr = res.trace
    assert tr.skip_ratio > 0.1
    t0 = PROMPT.shape[1]
    plan = torch.zeros(1, res.sequences.shape[1], model.num_layers, dtype=torch.bool)
    n = tr.valid[0].sum().item()  # decode steps fed tokens t0 .. t0+n-1
    plan[0, t0:t0 + n] = ~tr.executed[0, :n]
    with torch.no_grad():
        out = model(res.sequences, gate_mode="plan", skip_plan=plan, kv_policy=policy)
    assert (out.logits[0, t0 - 1:-1] - res.scores[0]).abs().max() < 1e-4


def test_skipped_layer_does_no_work():
    """Through the HF modules (weights="hf"), forward hooks see every call of a skipped layer's modules."""
    model = fbs_tiny()
    layer = model.base.layers[2]
    calls = {"q": 0, "k": 0, "o": 0, "mlp": 0}
    hooks = [mod.register_forward_hook(lambda *_, key=key: calls.__setitem__(key, calls[key] + 1))
             for key, mod in (("q", layer.self_attn.q_proj), ("k", layer.self_attn.k_proj),
                              ("o", layer.self_attn.o_proj), ("mlp", layer.mlp))]
    plan = torch.zeros(model.num_layers, dtype=torch.bool)
    plan[2] = True
    try:
        kw = dict(max_new_tokens=8, ignore_eos=True, weights="hf")
        model.generate(PROMPT, skip_plan=plan, kv_policy="hole", **kw)
        assert calls == {"q": 1, "k": 1, "o": 1, "mlp": 1}  # prefill only
        calls.update(q=0, k=0, o=0, mlp=0)
        res = model.generate(PROMPT, skip_plan=plan, kv_policy="project", **kw)
        assert calls == {"q": 1, "k": 8, "o": 1, "mlp": 1}  # project: only K/V of the 7 decoded tokens
        assert not res.trace.executed[0, :7, 2].any() and res.trace.executed[0, :7, 3].all()
        calls.update(q=0, k=0, o=0, mlp=0)
        model.generate(PROMPT, **kw)
        assert calls == {"q": 8, "k": 8, "o": 8, "mlp": 8}
    finally:
        for h in hooks:
            h.remove()


@pytest.mark.parametrize("policy, kv_policy", [("gather", "hole"), ("gather", "project"), ("all", "hole"),
                                                ("majority", "project")])
def test_batch_equals_single_runs(policy, kv_policy):
    """A batch of 4 gives each row the tokens of its own run: under gather the gates' own single run; under
    all / majority (which override some rows' decisions) a single run forced to the row's executed plan."""
    model = randomize(fbs_tiny(), seed=3)
    prompts = [_ids(s, n)[0].tolist() for s, n in ((10, 5), (11, 9), (12, 9), (13, 14))]
    batch = model.generate(prompts, max_new_tokens=10, ignore_eos=True, batch_policy=policy, kv_policy=kv_policy)
    tr = batch.trace
    assert tr.intended_skip_ratio > 0 and tr.skip_ratio > 0
    for r, p in enumerate(prompts):
        if policy == "gather":
            single = model.generate([p], max_new_tokens=10, ignore_eos=True, kv_policy=kv_policy)
            assert torch.equal(tr.executed[r], single.trace.executed[0])
        else:
            single = model.generate([p], max_new_tokens=10, ignore_eos=True, kv_policy=kv_policy,
                                    skip_plan=~tr.executed[r] & tr.valid[r, :, None])
        assert batch.new_tokens[r] == single.new_tokens[0]
    if policy == "all":  # a layer runs for every row unless all rows skip: executed >= not-intended
        assert (tr.executed | tr.intended_skip)[tr.valid].all()
        assert tr.skip_ratio <= tr.intended_skip_ratio
    if policy != "gather":  # one decision per (step, layer) for the whole batch
        assert (tr.executed == tr.executed[:1]).all()
    if policy == "majority":
        votes = tr.intended_skip[:, :-1].sum(0) * 2 > tr.executed.shape[0]     # (N-1, L)
        assert torch.equal(~tr.executed[0, :-1], votes)


def test_eos_stop_and_min_new_tokens():
    model = fbs_tiny()
    eos = model.base.hf.config.eos_token_id

    def eos_wins(_mod, _inp, out):
        out = out.clone()
        out[..., eos] += 1e3
        return out

    model.base.lm_head.register_forward_hook(eos_wins)  # seen through the HF modules (weights="hf")
    res = model.generate(PROMPT, max_new_tokens=10, weights="hf")
    assert res.new_tokens[0] == [eos]
    res = model.generate(PROMPT, max_new_tokens=10, min_new_tokens=4, weights="hf")
    assert len(res.new_tokens[0]) == 5 and res.new_tokens[0][-1] == eos and eos not in res.new_tokens[0][:4]
    res = model.generate(PROMPT, max_new_tokens=10, ignore_eos=True, weights="hf")
    assert len(res.new_tokens[0]) == 10


def test_sampling_is_seeded_and_top_k_one_is_greedy():
    model = randomize(fbs_tiny())
    kw = dict(max_new_tokens=12, ignore_eos=True, do_sample=True, temperature=1.5, top_p=0.9)
    a = model.generate(PROMPT, seed=1, **kw).new_tokens
    b = model.generate(PROMPT, seed=1, **kw).new_tokens
    c = model.generate(PROMPT, seed=2, **kw).new_tokens
    assert a == b and a != c
    greedy = model.generate(PROMPT, max_new_tokens=12, ignore_eos=True).new_tokens
    assert model.generate(PROMPT, max_new_tokens=12, ignore_eos=True, do_sample=True, top_k=1, seed=3).new_tokens == greedy


def test_stream_yields_the_generated_tokens():
    model = randomize(fbs_tiny())
    streamed = [t for step in model.stream(PROMPT, max_new_tokens=9, ignore_eos=True) for t in step.tokens]
    assert streamed == model.generate(PROMPT, max_new_tokens=9, ignore_eos=True).new_tokens[0]


def test_never_skip_and_force_compute():
    model = randomize(fbs_tiny())
    with torch.no_grad():
        for lin in model.gates.out.values():  # every gate says skip (p = 0.99)
            lin.weight.zero_()
            lin.bias.fill_(5.0)
    res = model.generate(PROMPT, max_new_tokens=8, ignore_eos=True)
    ex = res.trace.executed[0, :7]
    assert ex[:, 0].all() and ex[:, -1].all() and not ex[:, 1:-1].any()
    res = model.generate(PROMPT, max_new_tokens=8, ignore_eos=True, never_skip=(2,))
    assert res.trace.executed[0, :7, 2].all()
    res = model.generate(PROMPT, max_new_tokens=8, ignore_eos=True, force_compute=True)
    assert res.trace.skip_ratio == 0.0


def test_gate_sampling_inference_is_seeded():
    model = randomize(fbs_tiny(), gate_bias=0.0)
    a = model.generate(PROMPT, max_new_tokens=8, ignore_eos=True, gate_sampling=True, seed=4)
    b = model.generate(PROMPT, max_new_tokens=8, ignore_eos=True, gate_sampling=True, seed=4)
    assert torch.equal(a.trace.executed, b.trace.executed)


class CharTokenizer:
    """A stand-in tokenizer: token i is one character; '{' and '}' are ids 10 and 11."""

    chars = "abcdefghij{}\n:,()[]" + "x" * 237
    eos_token_id, pad_token_id, all_special_ids = 255, 0, []

    def __len__(self):
        return 256

    def decode(self, ids, **_):
        return "".join(self.chars[i] for i in ids)

    def convert_ids_to_tokens(self, ids):
        return [self.chars[i] for i in ids]

    def convert_tokens_to_string(self, toks):
        return "".join(toks)


def test_fallback_rerun_when_validator_fails():
    model = randomize(fbs_tiny(), gate_bias=0.0)
    tok = CharTokenizer()
    calls = []

    def validator(text):
        calls.append(text)
        return False  # always invalid: every row is regenerated once at fallback_tau

    res = model.generate(PROMPT, max_new_tokens=6, ignore_eos=True, tokenizer=tok, validator=validator,
                         fallback_tau=1.0)
    assert res.trace.fallback == [True] and len(calls) == 1
    assert res.trace.skip_ratio == 0.0  # tau 1.0: the rerun skipped nothing
    assert res.new_tokens == model.generate(PROMPT, max_new_tokens=6, ignore_eos=True, tau=1.0).new_tokens


def test_structure_protection_blocks_skipping_inside_brackets():
    model = randomize(fbs_tiny(), gate_bias=0.0)
    with torch.no_grad():
        for lin in model.gates.out.values():
            lin.weight.zero_()
            lin.bias.fill_(5.0)  # gates skip everything they can
    prompt = [[1, 2, 10, 3]]  # "bc{d": an open brace
    res = model.generate(prompt, max_new_tokens=5, ignore_eos=True, tokenizer=CharTokenizer(),
                         protect_structure=True)
    assert res.trace.skip_ratio == 0.0
    assert model.generate(prompt, max_new_tokens=5, ignore_eos=True).trace.skip_ratio > 0.5


def test_hole_policy_cache_lengths_and_positions_are_explicit():
    model = fbs_tiny()
    plan = torch.zeros(model.num_layers, dtype=torch.bool)
    plan[2] = True
    from fbs.engine import run, start

    dec = start(model, PROMPT, None, None, dict(max_new_tokens=6, ignore_eos=True, skip_plan=plan, kv_policy="hole"))
    for _ in run(dec):
        pass
    t0 = PROMPT.shape[1]
    # 5 decode steps fed tokens at positions t0..t0+4; layer 2 stored none of them, layer 3 all
    assert dec.cache.get_seq_length(2, 0) == t0 and dec.cache.get_seq_length(3, 0) == t0 + 5
    assert dec.cache.positions[3][0] == list(range(t0 + 5)) and dec.cache.positions[2][0] == list(range(t0))
