"""Draft sources on the one lossless verifier (fbs.engine.drafts): prompt lookup, lookahead, a separate draft model
(specdec), Medusa heads, and the engine's own drafts by name.

Oracles: the engine at full depth (``force_compute=True``) for greedy output, token for token; for sampling, the
full-depth model's exact joint distribution of the first two sampled tokens (computed from its logits), against
which the drafted sampler's empirical distribution must pass a chi-square test; hand-made token sequences for
prompt lookup; the state of a never-drafting run after rollback.
"""

import pytest
import torch

import fbs.baselines  # noqa: F401  (registers kangaroo / specdec / medusa with their file loaders)
from conftest import fbs_tiny, randomize, tiny_hf
from fbs.baselines.kangaroo import KangarooAdapter
from fbs.baselines.medusa import MedusaHeads
from fbs.engine import run
from fbs.engine.drafts import Draft, DraftSource, draft_names, lookup_continuation
from test_speculative import _assert_same_state, _decoder, _model, shipped_smollm2  # noqa: F401  (a fixture)

REPEAT = [7, 8, 9, 10, 11, 12] * 3  # a repetitive prompt: prompt lookup and lookahead find n-grams


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [REPEAT + torch.randint(0, 255, (3,), generator=g).tolist(),
            torch.randint(0, 255, (9,), generator=g).tolist()]


def _heads(model, seed=0):
    heads = MedusaHeads(model.base.spec.hidden_size, 3)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for b in heads.blocks:
            b.weight.copy_(torch.randn(b.weight.shape, generator=g) * 0.05)
    return heads


def _sources(model):
    """(name, draft options) of every draft source, over the model (the specdec draft: another tiny HF model of
    the same vocabulary, two layers; Kangaroo: a fresh adapter after layer 2)."""
    return [
        ("fbs", None), ("plan", {"layers": "2,4"}), ("kangaroo", {"adapter": KangarooAdapter.for_model(model, 2)}),
        ("prompt-lookup", None), ("lookahead", {"ngram": 3}), ("specdec", {"model": tiny_hf("llama", 2, seed=4)}),
        ("medusa", {"heads": _heads(model)}),
    ]


def test_every_named_draft_is_registered():
    assert {"fbs", "plan", "kangaroo", "prompt-lookup", "lookahead", "specdec", "medusa"} <= set(draft_names())


@pytest.mark.parametrize("policy", ["hole", "project"])
def test_every_draft_source_greedy_equals_full_depth(policy, one_thread):
    """64 tokens for a batch of two prompts of different lengths, each draft source by name: the full-depth
    output, token for token; every source proposed something."""
    model = _model("llama")
    kw = dict(max_new_tokens=64, ignore_eos=True, kv_policy=policy)
    full = model.generate(_prompts(), force_compute=True, **kw).new_tokens
    for name, options in _sources(model):
        res = model.generate(_prompts(), draft=name, draft_options=options, draft_tokens=5, **kw)
        assert res.new_tokens == full, name
        st = res.speculative
        assert st.drafter == name and st.proposed > 0, name
        assert st.accepted + st.passes == 64, name  # each pass commits its accepted drafts plus one


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_new_draft_sources_greedy_equal_full_depth_on_other_families(family, one_thread):
    model = _model(family)
    kw = dict(max_new_tokens=48, ignore_eos=True)
    full = model.generate(_prompts(), force_compute=True, **kw).new_tokens
    for name, options in [("prompt-lookup", None), ("lookahead", None),
                          ("specdec", {"model": tiny_hf(family, 2, seed=4)}), ("medusa", {"heads": _heads(model)})]:
        assert model.generate(_prompts(), draft=name, draft_options=options, **kw).new_tokens == full, name


def test_drafts_that_copy_the_target_are_all_accepted(one_thread):
    """A draft model that is the target's own backbone with the FBS modules at zero (an untrained FBS model equals
    its base) drafts exactly the target's greedy tokens: every draft is accepted, so 40 tokens take the prompt's
    pass and 8 rounds (7 of 4 drafts + 1, then 3 + 1). With the draft length adapted, a draft as costly as the
    target does not pay: gamma falls to 0 (plain steps)."""
    model = fbs_tiny("llama", seed=2)  # untrained FBS modules: the model computes its base
    kw = dict(max_new_tokens=40, ignore_eos=True)
    opts = {"model": tiny_hf("llama", 6, seed=2)}
    res = model.generate(_prompts(), draft="specdec", draft_options=opts, draft_tokens=4, adapt_draft=False, **kw)
    assert res.new_tokens == model.generate(_prompts(), force_compute=True, **kw).new_tokens
    assert res.speculative.acceptance_rate == 1.0 and res.speculative.passes == 9
    # the FBS model itself as the draft model (it drafts with its backbone), the draft length adapted
    adapted = model.generate(_prompts(), draft="specdec", draft_options={"model": model}, draft_tokens=4, **kw)
    assert adapted.new_tokens == res.new_tokens and adapted.speculative.gamma == [0, 0]


def test_prompt_lookup_proposes_the_continuation_of_the_latest_match():
    # the last 3-gram (1, 2, 3) occurs at 0 and 4: the latest earlier occurrence (4) is followed by 7, 1, 2
    assert lookup_continuation([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 3, 1, 3) == [7, 1, 2]
    assert lookup_continuation([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 3, 1, 10) == [7, 1, 2, 3]  # up to the end
    # no 3- or 2-gram match: the 1-gram (6) occurs at 2, followed by 9, 1
    assert lookup_continuation([4, 5, 6, 9, 1, 6], 3, 1, 2) == [9, 1]
    assert lookup_continuation([4, 5, 6, 9, 1, 6], 3, 2, 2) == []  # min_ngram 2: no match
    assert lookup_continuation([1, 2, 3], 3, 1, 4) == []


def test_prompt_lookup_sizes_its_proposals_by_the_acceptance_of_their_match_length():
    """With ``adapt`` a proposal is cut to the length that maximises a free draft's expected speed-up at the
    acceptance its match length has had in this row (geometric model, prior 0.8 of weight 2, each drafted token
    0.15 of a step: the oracle below is that formula written out); every proposal of a 1-token match rejected, its
    length falls from the budget to nothing, then a one-token probe every 8th match; a 3-token match in the same
    row and the other row keep the whole budget; ``adapt=False`` always proposes the whole budget."""
    from types import SimpleNamespace

    from fbs.engine.drafts import PromptLookupDraft

    def oracle(kept, rejected, found):  # argmax_g E[tokens] / cost, E = sum_{i<=g} alpha^i, cost = 1 + 0.15 g
        alpha = kept / (kept + rejected)
        return max(range(found + 1), key=lambda g: sum(alpha ** i for i in range(g + 1)) / (1 + 0.15 * g))

    one = [5, 6, 7, 8, 9, 5]                  # only the 1-gram (5) matches: 6, 7, 8, 9 follow it
    three = [1, 2, 3, 4, 4, 4, 4, 1, 2, 3]    # the 3-gram (1, 2, 3) matches: 4, 4, 4, 4 follow it
    dec = SimpleNamespace(prompts=[one, three], out=[[], []])
    draft = PromptLookupDraft(SimpleNamespace(dec=dec))
    kept, rejected, lengths, want = 1.6, 0.4, [], []
    for _ in range(30):
        got = draft.propose([0, 1], {0: 4, 1: 4})
        assert got[1].tokens == [4, 4, 4, 4]
        lengths.append(len(got[0].tokens))
        want.append(oracle(kept, rejected, 4))
        draft.commit([0, 1], [5, 9], [1, 5], None)  # row 0: nothing kept; row 1: all four kept
        if want[-1]:
            rejected += 1
    probes = [i for i, (g, w) in enumerate(zip(lengths, want)) if w == 0 and g]
    assert want[0] == 4 and 0 in want and want == sorted(want, reverse=True)
    assert [g if w else 0 for g, w in zip(lengths, want)] == want          # the oracle wherever it proposes
    assert probes and all(lengths[i] == 1 for i in probes)                # a withheld match probes one token
    withheld = [i for i, w in enumerate(want) if w == 0]
    assert probes == [i for k, i in enumerate(withheld, 1) if k % 8 == 0]
    plain = PromptLookupDraft(SimpleNamespace(dec=dec), adapt=False)
    for _ in range(5):
        assert len(plain.propose([0], {0: 4})[0].tokens) == 4
        plain.commit([0], [5], [1], None)


def test_prompt_lookup_on_a_copying_model_accepts_its_proposals(one_thread):
    """A model that continues a repeated pattern: prompt lookup proposes the pattern, the verifier accepts it."""
    model = _model("llama")
    ids = [REPEAT]
    full = model.generate(ids, force_compute=True, max_new_tokens=16, ignore_eos=True).new_tokens[0]
    # the proposals are what lookup_continuation gives on prompt + output; some are accepted whenever the model's
    # greedy output repeats an earlier n-gram's continuation
    res = model.generate(ids, draft="prompt-lookup", max_new_tokens=16, ignore_eos=True)
    assert res.new_tokens[0] == full and res.speculative.proposed > 0


def test_prompt_lookup_prefers_the_longest_match_and_drafts_its_own_length(one_thread):
    """Up to 6 tokens of context are matched (the longest n first, then the latest occurrence): the 5-gram's earlier
    continuation wins over a later 3-gram's. Unless the call sets draft_tokens, prompt lookup drafts up to 12 tokens
    a round and every other source 4 (each source's ``draft_tokens``)."""
    from fbs.engine.drafts import lookup_match

    seq = [1, 2, 3, 4, 5, 70, 71, 9, 3, 4, 5, 80, 81, 1, 2, 3, 4, 5]
    assert lookup_match(seq, 6, 1, 2) == ([70, 71], 5)   # (1..5) at 0; the later (3, 4, 5) at 8 goes on with 80
    assert lookup_match(seq, 3, 1, 2) == ([80, 81], 3)   # max_ngram 3: the latest 3-gram
    model = _model("llama")
    kw = dict(max_new_tokens=4, ignore_eos=True)
    assert model.generate([REPEAT], draft="prompt-lookup", **kw).speculative.gamma == [12]
    assert model.generate([REPEAT], draft="prompt-lookup", draft_tokens=5, **kw).speculative.gamma == [5]
    assert model.generate([REPEAT], draft="lookahead", **kw).speculative.gamma == [4]


def test_lookahead_rejects_a_window_wider_than_the_verifier():
    model = _model("llama")
    with pytest.raises(ValueError, match="window <= draft_tokens"):
        model.generate(_prompts(), draft="lookahead", draft_options={"window": 9}, draft_tokens=4)


def test_lookahead_pool_grows_from_jacobi_iterations_and_output(one_thread):
    """After decoding, the pool holds n-grams (keyed by their first token) and every committed n-gram of the output
    is among them or was displaced by newer ones (at most G per key)."""
    model = _model("llama")
    dec = _decoder(model, max_new_tokens=32, draft="lookahead", draft_options={"ngram": 3, "pool": 2})
    for _ in run(dec):
        pass
    pool = dec.spec.drafter.pool[0]
    assert pool and all(1 <= len(v) <= 2 and all(len(c) == 2 for c in v) for v in pool.values())
    out = dec.out[0]
    last = tuple(out[-3:])
    assert last[1:] in pool[last[0]]  # the newest output n-gram was added last: first in its list


@pytest.mark.parametrize("name", ["lookahead", "specdec", "medusa"])
def test_rollback_leaves_the_state_of_a_run_that_never_drafted(name, one_thread):
    """After rejected drafts, every layer's K/V and the chunk states equal those of full-depth decoding of the same
    tokens (project policy: the verifier wrote every layer)."""
    model = _model("qwen2")
    options = dict(_sources(model))[name]
    dec = _decoder(model, max_new_tokens=40, draft=name, draft_options=options, kv_policy="project",
                   adapt_draft=False)
    for _ in run(dec):
        pass
    assert dec.spec.rejections[0] > 0
    ref = _decoder(model, max_new_tokens=len(dec.out[0]), force_compute=True, kv_policy="project")
    for _ in run(ref):
        pass
    assert ref.out[0] == dec.out[0]
    _assert_same_state(dec, ref)


def _exact_pairs(model, prompt, top_k):
    """The full-depth model's joint distribution of the first two sampled tokens under top-k (k * k pairs)."""
    def probs(ids):
        res = model.generate([ids], force_compute=True, max_new_tokens=1, ignore_eos=True, output_scores=True)
        logits = res.scores[0][0]
        kth = logits.topk(top_k).values[-1]
        return logits.masked_fill(logits < kth, float("-inf")).softmax(-1)

    p1 = probs(prompt)
    out = {}
    for t1 in p1.nonzero()[:, 0].tolist():
        p2 = probs(prompt + [t1])
        for t2 in p2.nonzero()[:, 0].tolist():
            out[(t1, t2)] = float(p1[t1] * p2[t2])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["specdec", "lookahead", "prompt-lookup"])
def test_drafted_sampling_keeps_the_full_models_distribution(name, one_thread):
    """2,000 rows sample three tokens with the draft (one seeded call; rows draw independently): the first two
    tokens' empirical joint distribution passes a chi-square test at the 0.1 % level against the full-depth model's
    exact joint distribution (top-k 3: 9 pairs, 8 degrees of freedom), and drafts were both accepted and
    rejected. The second token is always a verified draft's outcome (a stochastic draft model's q, or a point-mass
    proposal)."""
    model = _model("llama")
    # the model's top-3 first tokens (52, 147, 194) occur in the prompt, followed by tokens the model may sample
    # next: prompt lookup proposes a second token in every row, sometimes accepted
    prompt = [4, 30, 52, 52, 147, 243, 194, 194, 9, 10, 11, 12, 7, 8, 9, 10, 11, 12, 7, 8]
    exact = _exact_pairs(model, prompt, 3)
    options = {"model": tiny_hf("llama", 2, seed=4)} if name == "specdec" else None
    n = 2000
    res = model.generate([prompt] * n, draft=name, draft_options=options, do_sample=True, top_k=3, seed=11,
                         max_new_tokens=3, ignore_eos=True, draft_tokens=2)
    counts = {}
    for row in res.new_tokens:
        counts[(row[0], row[1])] = counts.get((row[0], row[1]), 0) + 1
    assert set(counts) <= set(exact)
    chi2 = sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in exact.items())
    assert chi2 < 26.12, (chi2, counts, exact)  # chi-square quantile 0.999, 8 degrees of freedom
    st = res.speculative
    assert st.proposed >= 1 and 0 < st.acceptance_rate < 1


def test_a_point_mass_draft_is_accepted_with_the_targets_probability():
    """The verifier's rule for a deterministic proposal d (q = point mass): keep it with probability p(d), else draw
    from p with d removed; hand-computed for p = (.5, .3, .2), d = 1: P(1) = .3, P(0) = .7 * 5/7 = .5, P(2) = .2."""
    from fbs.engine.speculative import accept_sampled

    p = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.2, 0.6]])
    q = torch.tensor([[0.0, 1.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    n = 20000
    counts = torch.zeros(3)
    kept = 0
    for _ in range(n):
        a, nxt = accept_sampled(p, q, [1], gen)
        counts[1 if a == 1 else nxt] += 1
        kept += a
    assert (counts / n - p[0]).abs().max() < 0.012 and abs(kept / n - 0.3) < 0.012  # ~4 standard errors


def test_a_custom_draft_source_plugs_in_as_a_factory(one_thread):
    """The protocol is public: a factory returning a draft that always proposes token 3 is verified like any."""
    from fbs.engine.drafts import BaseDraft

    class Threes(BaseDraft):
        name = "threes"

        def propose(self, rows, budget):
            return {r: Draft([3] * budget[r]) for r in rows}

    model = _model("llama")
    kw = dict(max_new_tokens=20, ignore_eos=True)
    res = model.generate(_prompts(), draft=Threes, **kw)
    assert isinstance(res.speculative, object) and res.speculative.drafter == "threes"
    assert res.new_tokens == model.generate(_prompts(), force_compute=True, **kw).new_tokens
    assert isinstance(Threes.__new__(Threes), DraftSource)


def test_bad_draft_names_and_missing_artifacts_are_clear_errors(tmp_path):
    model = _model("llama")
    with pytest.raises(ValueError, match="unknown draft 'nope'.*registered drafts: .*lookahead"):
        model.generate(_prompts(), draft="nope")
    with pytest.raises(ValueError, match="fbs train draft-search"):
        model.generate(_prompts(), draft="plan")
    with pytest.raises(ValueError, match="fbs train draft-model"):
        model.generate(_prompts(), draft="specdec", draft_options={"path": str(tmp_path)})
    with pytest.raises(ValueError, match="fbs train medusa"):
        model.generate(_prompts(), draft="medusa", draft_options={"path": str(tmp_path)})
    with pytest.raises(ValueError, match="fbs train kangaroo"):
        model.generate(_prompts(), draft="kangaroo", draft_options={"path": str(tmp_path)})
    with pytest.raises(ValueError, match="vocabulary"):
        from transformers import LlamaConfig, LlamaForCausalLM

        other = LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=64, vocab_size=100))
        model.generate(_prompts(), draft="specdec", draft_options={"model": other})


@pytest.mark.slow
def test_draft_sources_on_the_shipped_smollm2(shipped_smollm2):
    """The shipped SmolLM2 model, 64 tokens after a prompt that invites copying, under both KV policies: every
    new draft source gives the full-depth tokens (the draft model: an undistilled 5-layer student of the target,
    whose drafts are all rejected; Medusa: fresh heads, each the model's own next-token head, as a tree, and the
    shipped heads; EAGLE: an untrained layer started from the last one, as a dynamic tree, and the shipped one)."""
    from fbs.baselines.specdec import student_from_target

    model = shipped_smollm2
    text = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n")
    ids = model.tokenizer(text, return_tensors="pt").input_ids
    kw = dict(max_new_tokens=64, ignore_eos=True)
    full = model.generate(ids, force_compute=True, **kw).new_tokens
    student, _ = student_from_target(model, 5)
    from fbs.baselines.eagle import EagleLayer
    from fbs.baselines.medusa import shipped_draft

    sources = [("prompt-lookup", None), ("lookahead", {"ngram": 4}), ("specdec", {"model": student}),
               ("medusa", {"heads": MedusaHeads(model.base.spec.hidden_size, 3)}),
               ("eagle", {"layer": EagleLayer.for_model(model)})]
    for name in ("medusa", "eagle"):  # the drafts shipped for SmolLM2, found without a path
        if shipped_draft(name, model) is not None:
            sources.append((name, None))
    for policy in ("hole", "project"):
        for name, options in sources:
            res = model.generate(ids, draft=name, draft_options=options, draft_tokens=5, adapt_draft=False,
                                 kv_policy=policy, **kw)
            assert res.new_tokens == full, (name, policy)
            st = res.speculative
            assert st.proposed > 0 and (st.accepted > 0 or name == "specdec"), (name, policy)  # undistilled: ~0


def test_draft_options_a_source_does_not_take_are_a_clear_error():
    model = _model("llama")
    with pytest.raises(ValueError, match=r"draft 'lookahead' does not take the options \['ngramz'\]"):
        model.generate(_prompts(), draft="lookahead", draft_options={"ngramz": 3})
    with pytest.raises(ValueError, match="draft_options configure a draft source"):
        model.generate(_prompts(), draft_options={"ngram": 3})


# --------------------------------------------------------------------------- lookahead: G candidates in one pass
def _lookahead_rounds(model, prompt, n, **options):
    """Decode ``n`` tokens with lookahead, logging per round (tokens generated before it, the proposal, the window
    branch's tokens, the kept count and the window after the round)."""
    from fbs.engine import start

    dec = start(model, [list(prompt)], None, None, dict(ignore_eos=True, max_new_tokens=n, draft="lookahead",
                                                        draft_options=options or None, adapt_draft=False))
    it = run(dec)
    next(it)  # the prompt's pass: the verifier and its draft source exist from here on
    drafter = dec.spec.drafter
    propose, commit = drafter.propose, drafter.commit
    log = []

    def logged_propose(rows, budget):
        out = propose(rows, budget)
        if 0 in out:
            tokens, parents, first, window = drafter.round[0]
            log.append({"n": len(dec.out[0]), "draft": out[0], "window_tokens": [tokens[j - 1] for j in window]})
        return out

    def logged_commit(rows, positions, kept, verified):
        commit(rows, positions, kept, verified)
        if log and log[-1]["n"] == positions[0] - len(dec.prompts[0]) + 1:
            log[-1].update(P=positions[0], kept=kept[0], window=dict(drafter.window[0]))

    drafter.propose, drafter.commit = logged_propose, logged_commit
    for _ in it:
        pass
    return dec, log


def test_lookahead_tree_keeps_the_longest_branch_the_target_agrees_with(one_thread):
    """Verifying the tree of G candidates in one pass equals verifying each branch on its own: against the
    full-depth output (what a branch verified alone keeps is its longest prefix equal to it), every round keeps the
    longest such prefix over all of its branches plus the target's own token; the output is full depth's, and
    some rounds verified several branches at once (more nodes than depth)."""
    model = _model("llama")
    prompt = _prompts()[0]
    full = model.generate([prompt], force_compute=True, max_new_tokens=64, ignore_eos=True).new_tokens[0]
    dec, log = _lookahead_rounds(model, prompt, 64, ngram=3)
    assert dec.out[0] == full
    trees = 0
    for rnd in log:
        d, n = rnd["draft"], rnd["n"]
        parents = d.parents if d.parents is not None else list(range(-1, len(d.tokens) - 1))
        depth = d.depths()
        alone = 0  # the longest branch prefix the target agrees with, each node checked with its ancestors
        for j in range(len(d.tokens)):
            path, a = [], j
            while a >= 0:
                path.append(a)
                a = parents[a]
            if all(d.tokens[k] == full[n + depth[k] - 1] for k in path):
                alone = max(alone, depth[j])
        assert rnd["kept"] == alone + 1, rnd
        trees += sum(p == -1 for p in parents) > 1
    assert trees > 0 and dec.spec.nodes[0] > dec.spec.proposed[0]


def test_lookahead_window_takes_the_targets_predictions_after_its_branch(one_thread):
    """The Jacobi step through the tree: after each round the window's guess for every position past the kept ones
    is the full-depth model's greedy prediction after the window branch's tokens, wherever the verifier put that
    branch's nodes in its pass (a forward over the committed context plus the branch is the oracle)."""
    from fbs.engine.drafts import _tree_order

    model = _model("qwen2")
    prompt = _prompts()[1]
    checked = moved = 0
    dec, log = _lookahead_rounds(model, prompt, 64, ngram=3)
    out = dec.out[0]
    for rnd in log:
        P, c, toks, d_ = rnd["P"], rnd["kept"], rnd["window_tokens"], rnd["draft"]
        ctx = (prompt + out)[:P + 1]
        logits = model(torch.tensor([ctx + toks]), gate_mode="off").logits[0]
        for d in range(c, len(toks) + 1):
            assert rnd["window"][P + d + 1] == int(logits[P + d].argmax()), (rnd, d)
            checked += 1
        if d_.parents is not None:  # the kept path ran through a later branch: the pass moved the window's nodes
            where = _tree_order(d_.tokens, d_.parents, out[rnd["n"]:rnd["n"] + c - 1])
            moved += any(k != j for j, k in where.items())
    assert checked > 0 and moved > 0


def test_lookahead_trie_and_the_verifiers_node_order():
    from fbs.engine.drafts import LookaheadDraft, _tree_order

    tokens, parents, ids = LookaheadDraft._trie([[5, 6, 7], [5, 8], [9]])
    assert (tokens, parents, ids) == ([5, 6, 7, 8, 9], [-1, 0, 1, 0, -1], [[1, 2, 3], [1, 4], [5]])
    # kept 5 then 8: the verifier's order is the root, nodes 1 and 4, then 2, 3, 5
    assert _tree_order(tokens, parents, [5, 8]) == {0: 0, 1: 1, 4: 2, 2: 3, 3: 4, 5: 5}
    assert _tree_order(tokens, parents, []) == {j: j for j in range(6)}


def test_lookahead_as_one_chain_and_as_a_native_tree(one_thread):
    """``tree=False`` proposes one chain per pass (nodes == depth); int8 ops verify its whole trie in their native
    multi-token steps with ``native_trees`` (nodes > depth), its chain of first children without: each gives full
    depth's tokens in its format."""
    model = _model("llama")
    kw = dict(max_new_tokens=48, ignore_eos=True)
    full = model.generate(_prompts(), force_compute=True, **kw).new_tokens
    chain = model.generate(_prompts(), draft="lookahead", draft_options={"tree": False}, **kw)
    assert chain.new_tokens == full and chain.speculative.nodes == chain.speculative.proposed > 0
    full8 = model.generate(_prompts(), force_compute=True, weights="int8", **kw).new_tokens
    native = model.generate(_prompts(), draft="lookahead", weights="int8", native_trees=True, **kw)
    assert native.new_tokens == full8
    assert native.speculative.nodes > native.speculative.proposed > 0
    chains = model.generate(_prompts(), draft="lookahead", weights="int8", **kw)
    assert chains.new_tokens == full8 and chains.speculative.nodes == chains.speculative.proposed > 0
    with pytest.raises(ValueError, match="candidates <= pool"):
        model.generate(_prompts(), draft="lookahead", draft_options={"pool": 2, "candidates": 3}, **kw)


def test_the_verifier_times_its_draft_source(one_thread):
    """``timings["draft_s"]``: the time in the draft source's propose / rollback / commit, part of decode; a draft
    that sleeps 2 ms per proposal shows at least that much."""
    import time

    from fbs.engine.drafts import BaseDraft

    class Slow(BaseDraft):
        name = "slow"
        calls = 0

        def propose(self, rows, budget):
            Slow.calls += 1
            time.sleep(0.002)
            return {r: Draft([3] * budget[r]) for r in rows}

    model = _model("llama")
    res = model.generate(_prompts(), draft=Slow, max_new_tokens=12, ignore_eos=True)
    t = res.timings
    assert Slow.calls > 0 and 0.002 * Slow.calls <= t["draft_s"] <= t["decode_s"]
    assert "draft_s" not in model.generate(_prompts(), max_new_tokens=4, ignore_eos=True).timings


@pytest.mark.parametrize("weights", ["q4", "q8", "fp32"])
def test_drafts_run_the_lm_head_in_the_decode_format(weights, one_thread):
    """Medusa's heads and EAGLE's layer read the LM head the decode ops hold (:func:`draft_lm_head`): the format's
    own product over normed states, the final norm and head of the ops' ``head`` to rounding; the HF ops keep the
    model's head."""
    from fbs.engine.drafts import draft_lm_head

    model = _model("llama")
    dec = _decoder(model, max_new_tokens=4, weights=weights)
    head = draft_lm_head(dec)
    assert head == dec.ops.lm_head
    x = torch.randn(3, 1, model.base.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    ref = dec.ops.head(x)
    got = head(model.base.norm(x))
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()
    fp32 = model.base.lm_head(model.base.norm(x))
    assert torch.equal(got, fp32) == (weights == "fp32")  # q8 / q4 formats: not the fp32 product
    assert draft_lm_head(_decoder(model, max_new_tokens=4, weights="hf")) is model.base.lm_head


@pytest.mark.parametrize("weights", ["q4", "int8", "fp32"])
def test_a_shortlisted_draft_head_scores_its_tokens_as_the_full_head_does(weights, one_thread):
    """FR-Spec's reduced draft vocabulary (:func:`draft_lm_head` with ``shortlist``): at the listed tokens the
    logits are the full decode-format head's bit for bit (oracle: that head), -inf elsewhere; Medusa heads and an
    EAGLE layer carrying a shortlist still decode exactly full depth's tokens."""
    from fbs.baselines.eagle import EagleLayer
    from fbs.engine.drafts import draft_lm_head

    model = _model("llama")
    dec = _decoder(model, max_new_tokens=4, weights=weights)
    ids = torch.tensor([3, 17, 40, 41, 99, 200, 254])
    x = model.base.norm(torch.randn(3, 1, model.base.spec.hidden_size, generator=torch.Generator().manual_seed(0)))
    full, short = draft_lm_head(dec)(x), draft_lm_head(dec, ids)(x)
    assert torch.equal(short[..., ids], full[..., ids])
    rest = torch.ones(full.shape[-1], dtype=torch.bool)
    rest[ids] = False
    assert bool(torch.isneginf(short[..., rest]).all())
    kw = dict(max_new_tokens=16, ignore_eos=True, weights=weights)
    ref = model.generate(_prompts(), force_compute=True, **kw).new_tokens
    heads, layer = _heads(model), EagleLayer.for_model(model)
    for name, opts, module in (("medusa", {"heads": heads}, heads), ("eagle", {"layer": layer}, layer)):
        module.shortlist = torch.arange(0, 256, 3)  # a third of the vocabulary
        res = model.generate(_prompts(), draft=name, draft_options=opts, **kw)
        assert res.new_tokens == ref, name
        assert res.speculative.proposed > 0


def test_shortlists_are_the_most_frequent_tokens_and_survive_save_and_load(tmp_path):
    from fbs.baselines.eagle import EagleLayer
    from fbs.baselines.medusa import frequent_tokens

    blocks = torch.tensor([[5, 5, 5, 9, 9, 2], [7, 7, 9, 1, 5, 2]])  # counts: 5:4, 9:3, 2:2, 7:2, 1:1
    assert frequent_tokens(blocks, 3).tolist() == [2, 5, 9]  # 2 and 7 tie at 2: the smaller id
    assert frequent_tokens(blocks, 4).tolist() == [2, 5, 7, 9] and frequent_tokens(blocks, 99).tolist() == [1, 2, 5, 7, 9]
    model = _model("llama")
    heads, layer = _heads(model), EagleLayer.for_model(model)
    for module, cls in ((heads, MedusaHeads), (layer, EagleLayer)):
        module.shortlist = torch.tensor([1, 60000, 2 ** 40])  # int64, past float16's exact range
        kw = {"dtype": torch.float16} if cls is EagleLayer else {}
        module.save(tmp_path / cls.__name__, model.config.base_fingerprint, **kw)
        back = cls.load(tmp_path / cls.__name__, model)
        assert back.shortlist.dtype == torch.int64 and back.shortlist.tolist() == [1, 60000, 2 ** 40]
        module.shortlist = None
        module.save(tmp_path / (cls.__name__ + "0"), model.config.base_fingerprint)
        assert cls.load(tmp_path / (cls.__name__ + "0"), model).shortlist is None


def test_prompt_lookup_simulation_gives_the_engines_rounds(one_thread):
    """scripts/simulate_prompt_lookup.py replays prompt lookup over full depth's greedy outputs: its rounds and
    drafted tokens equal the engine's verify passes (the prompt's excluded) and proposed tokens, for two settings
    and two prompts (one repetitive, one random)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "simulate_prompt_lookup.py"
    spec = importlib.util.spec_from_file_location("simulate_prompt_lookup", path)
    sim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sim)
    model = _model("llama")
    kw = dict(max_new_tokens=24, ignore_eos=True)
    drafted = 0
    for setting in ({"max_ngram": 3, "draft_tokens": 4}, {"max_ngram": 6, "draft_tokens": 12}):
        opts = {"max_ngram": setting["max_ngram"]}
        for prompt in _prompts():
            full = model.generate([prompt], force_compute=True, **kw).new_tokens[0]
            st = model.generate([prompt], draft="prompt-lookup", draft_options=opts,
                                draft_tokens=setting["draft_tokens"], **kw).speculative
            got = sim.simulate([(prompt, full)], **setting)
            assert (got["rounds"], got["drafted"], got["kept"]) == (st.passes - 1, st.proposed, st.accepted)
            drafted += got["drafted"]
    assert drafted > 0  # some rounds verified drafts


def test_lookup_match_equals_the_brute_force_search():
    """lookup_match's one pass over the last token's occurrences against its definition written out: for n from
    max_ngram down, the latest i with seq[i:i+n] == the last n tokens (i + n <= len - 1), on random short
    sequences over small vocabularies (many repeats)."""
    import random

    from fbs.engine.drafts import lookup_match

    def brute(seq, max_ngram, min_ngram, budget):
        L = len(seq)
        for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
            for i in range(L - n - 1, -1, -1):
                if seq[i:i + n] == seq[L - n:]:
                    return seq[i + n:i + n + budget], n
        return [], 0

    rng = random.Random(0)
    for _ in range(5000):
        seq = [rng.randrange(rng.randint(1, 6)) for _ in range(rng.randint(0, 30))]
        hi = rng.randint(1, 7)
        args = (seq, hi, rng.randint(1, hi), rng.randint(1, 5))
        assert lookup_match(*args) == brute(*args), args
