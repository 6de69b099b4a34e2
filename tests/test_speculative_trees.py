"""Token trees on the lossless verifier (fbs.engine.speculative): one pass with a tree attention mask, the kept path
compacted in the cache; Medusa's top-k tree and EAGLE-2's dynamic tree as draft sources.

Oracles: the same verifier run on each root-to-leaf branch as a chain (a tree pass must give every node the
logits its branch gives); full-depth greedy decoding (``force_compute``) token for token; the cache and chunk
states of a run that never drafted; hand-computed acceptance probabilities of the multi-candidate rule; for
sampling, the full-depth model's exact joint distribution of two tokens under a chi-square bound.
"""

import pytest
import torch

import fbs.baselines  # noqa: F401  (registers the drafts that load files)
from fbs.baselines.eagle import EagleLayer
from fbs.engine import run
from fbs.engine.loop import start
from fbs.engine.drafts import BaseDraft, Draft, parse_tree, tree_from_ranks
from fbs.engine.speculative import _ancestors, _depths, _Speculation, accept_tree, accept_typical
from test_speculative import _assert_same_state, _decoder, _model

PROMPTS = [[7, 8, 9, 10, 11, 12] * 3 + [5, 6], [201, 17, 33, 90, 4, 250, 61, 9, 128]]


def _eagle(model, seed=0, noise=0.05):
    """A fresh EAGLE layer for ``model`` with perturbed weights (so that some drafts are rejected)."""
    layer = EagleLayer.for_model(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise)
    return layer


def _oracle(full: list[list[int]], vocab: int, depth: int = 3):
    """A tree draft that knows the full-depth output: per depth a decoy child (the true token + 1) first, then the
    true token, each child of the previous true node; at the deepest level both children are decoys, so every
    round rejects there and the kept path runs through second children."""

    class Oracle(BaseDraft):
        name = "oracle"
        max_nodes = 2 * depth

        def propose(self, rows, budget):
            out = {}
            for r in rows:
                n = len(self.dec.out[r])
                truth = full[r][n:n + min(depth, budget[r])]
                tokens, parents, node = [], [], -1
                for d, t in enumerate(truth):
                    last = d == len(truth) - 1
                    tokens += [(t + 1) % vocab, (t + 2) % vocab if last else t]
                    parents += [node, node]
                    node = len(tokens) - 1
                out[r] = Draft(tokens, parents=parents)
            return out

    return Oracle


def _model_hd64(family, context: int = 128):
    """_model's gates over a tiny model with heads of 64 (the grouped AVX-512 attention kernel's width)."""
    from conftest import randomize, tiny_config, tiny_hf
    from fbs import FBSForCausalLM
    from test_speculative import DRAFTY

    seed, bias = DRAFTY[family]
    m = FBSForCausalLM.from_base(tiny_hf(family, head_dim=64, context=context), config=tiny_config()).eval()
    return randomize(m, seed=seed, gate_bias=bias)


def _verifier(dec, spec):
    """verify(tokens, parents) -> (last hidden states, logits) of one verifier pass over the nodes after the
    prefilled prompt (a chain when parents is -1, 0, 1, ...: no tree mask), then the prompt's cache and chunk
    states back."""
    P = len(dec.prompts[0])
    cache_len = [dec.cache.lengths[l][0] for l in range(dec.L)]
    chunks = {l: st.clone() for l, st in dec.chunks.items()}

    def verify(toks, pars):
        x = spec.verify_ops.embed(torch.tensor([toks]))
        pos = [[P + d for d in _depths(pars)]]
        tree = None if pars == list(range(-1, len(pars) - 1)) else (_ancestors(pars)[None], [pars])
        h, _, _ = spec.layers(spec.verify_ops, [0], x, pos, 0, dec.L, tree=tree)
        logits = spec.verify_ops.head(h)[0]
        dec.cache.crop([0], [P])  # back to the prompt's cache and chunk states
        assert [dec.cache.lengths[l][0] for l in range(dec.L)] == cache_len
        for l, st in chunks.items():
            dec.chunks[l].assign(torch.tensor([0]), st.clone())
        spec.log.states = {}
        return h[0], logits

    return verify


def _branches(parents: list[int], leaves) -> list[list[int]]:
    """Each leaf's root-to-leaf path of node indices."""
    out = []
    for leaf in leaves:
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        out.append(path[::-1])
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("weights,hd", [("fp32", 16), ("int8", 16), ("int8", 64), ("q4", 64)])
def test_a_tree_pass_equals_verifying_each_branch_separately(family, weights, hd, one_thread):
    """Seven nodes over the cached prompt (CH and PAW active): each node's logits and last hidden state equal
    those of the chain root..node verified alone from the same cache and chunk states. fp32: the PyTorch ops (SDPA
    under the tree mask); int8 / q4: the native layers' attention with the tree's visibility (heads of 16: the
    portable masked head; of 64 on AVX-512: the grouped kernel), against the same format's chain passes."""
    model = _model(family) if hd == 16 else _model_hd64(family)
    dec = _decoder(model, max_new_tokens=8, draft="prompt-lookup", weights=weights)
    spec = _Speculation(dec)
    dec.prefill()
    verify = _verifier(dec, spec)
    tokens = [5, 40, 41, 99, 7, 7, 130, 3]   # node 0: the root (the last committed token)
    parents = [-1, 0, 0, 1, 1, 2, 4, 6]
    depths = _depths(parents)
    h_tree, logits_tree = verify(tokens, parents)
    for path in _branches(parents, (3, 5, 7)):  # the leaves: every node lies on one of their branches
        h, logits = verify([tokens[j] for j in path], list(range(-1, len(path) - 1)))
        assert [depths[j] for j in path] == list(range(len(path)))
        torch.testing.assert_close(logits_tree[path], logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(h_tree[path], h, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("weights,kv_dtype", [("int8", "fp32"), ("q4", "int8")])
def test_a_tree_node_is_bit_identical_to_its_chain_across_a_key_range(weights, kv_dtype, one_thread):
    """The grouped AVX-512 attention splits each query's keys into ranges of 128 slots (csrc/attention.h); a tree
    node reads the round's keys it sees at the slots its chain will hold them at, so across a range boundary too
    (a 124-token prompt, the round's 8 nodes at slots 124-131, the kept path then compacted to 124-127) every node's
    logits equal its chain's bit for bit, the property that keeps tree verification lossless (before, nodes whose
    ancestors sat past the boundary merged their softmax ranges differently, and greedy outputs parted)."""
    from conftest import require_native
    from fbs.native import quant as native_quant

    require_native("avx512")
    if weights == "q4" and native_quant.isa() is None:
        pytest.skip("no native block-quantized kernels here")
    model = _model_hd64("llama", context=256)
    prompt = [(7 * i) % 240 + 5 for i in range(124)]
    dec = start(model, [prompt], None, None, dict(ignore_eos=True, max_new_tokens=8, draft="prompt-lookup",
                                                  weights=weights, kv_dtype=kv_dtype))
    spec = _Speculation(dec)
    dec.prefill()
    verify = _verifier(dec, spec)
    tokens = [5, 40, 41, 99, 7, 7, 130, 3]
    parents = [-1, 0, 0, 1, 1, 2, 4, 6]
    _, logits_tree = verify(tokens, parents)
    for path in _branches(parents, (3, 5, 7)):
        _, chain = verify([tokens[j] for j in path], list(range(-1, len(path) - 1)))
        assert torch.equal(logits_tree[path], chain), path


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("policy", ["hole", "project"])
def test_tree_drafts_greedy_equal_full_depth(family, policy, one_thread):
    """64 tokens for two prompts: the oracle tree (the right tokens in second children), Medusa's top-k tree and
    EAGLE-2's dynamic tree each give the full-depth tokens; the oracle's rounds keep their whole second-child
    path (two tokens a round plus the target's own) as counted by hand."""
    model = _model(family)
    kw = dict(max_new_tokens=64, ignore_eos=True, kv_policy=policy)
    full = model.generate(PROMPTS, force_compute=True, **kw).new_tokens
    from test_speculative_drafts import _heads

    V = model.base.spec.vocab_size
    for name, draft, options in [("oracle", _oracle(full, V), None), ("medusa", "medusa", {"heads": _heads(model)}),
                                 ("eagle", "eagle", {"layer": _eagle(model)})]:
        res = model.generate(PROMPTS, draft=draft, draft_options=options, draft_tokens=5, **kw)
        assert res.new_tokens == full, name
        st = res.speculative
        assert st.accepted + st.passes == 64 and st.nodes > st.proposed > 0, name
        if name == "oracle":  # 20 rounds keep 2 of depth 3 (decoys only at the third level), then at budget 2 one
            assert (st.accepted, st.passes, st.proposed) == (41, 23, 62)  # is kept, then a round with no draft


@pytest.mark.parametrize("name", ["oracle", "eagle"])
def test_after_tree_rounds_the_cache_equals_a_never_drafting_run(name, one_thread):
    """Rejected tree nodes are gone and the kept path sits at its positions: every layer's K/V and the chunk states
    equal those of full-depth decoding of the same tokens (project policy: the verifier wrote every layer)."""
    model = _model("qwen2")
    kw = dict(max_new_tokens=40, kv_policy="project")
    ref = _decoder(model, force_compute=True, **kw)
    for _ in run(ref):
        pass
    draft = _oracle([ref.out[0]], model.base.spec.vocab_size) if name == "oracle" else "eagle"
    options = {"layer": _eagle(model, noise=0.2)} if name == "eagle" else None
    dec = _decoder(model, draft=draft, draft_options=options, draft_tokens=4, **kw)
    for _ in run(dec):
        pass
    assert dec.out[0] == ref.out[0] and dec.spec.rejections[0] > 0
    _assert_same_state(dec, ref)


def test_the_tree_rule_keeps_the_targets_distribution():
    """Candidates 1 then 0 under p = (.5, .3, .2): node 1 is kept with .3; else 0 with .7 * (.5 / .7) = .5; else 2
    is drawn (.2). Greedy keeps the child equal to the argmax."""
    p = torch.tensor([0.5, 0.3, 0.2])
    tokens, children = [9, 1, 0], [[1, 2], [], []]
    gen = torch.Generator().manual_seed(0)
    n, first = 20000, torch.zeros(3)
    for _ in range(n):
        path, nxt = accept_tree(lambda j: p, tokens, children, gen)
        first[tokens[path[0]] if path else nxt] += 1
    assert (first / n - p).abs().max() < 0.012  # ~4 standard errors
    assert accept_tree(lambda j: torch.tensor([0.1, 0.2, 0.7]) if j == 0 else p, [9, 1, 2], [[1, 2], [], []],
                       greedy=True) == ([2], 0)


def test_typical_acceptance_keeps_the_longest_confident_path():
    """Medusa's rule: a node is kept when its probability exceeds min(threshold, alpha * exp(-entropy)) of its
    parent's distribution; the longest such path wins and the next token comes from its last node."""
    peaked = torch.tensor([0.96, 0.02, 0.02])   # entropy .196: alpha * exp(-H) = .247
    flat = torch.tensor([0.34, 0.33, 0.33])     # entropy 1.099: alpha * exp(-H) = .100
    skewed = torch.tensor([0.9, 0.05, 0.05])    # entropy .394: alpha * exp(-H) = .202
    tokens, children = [5, 0, 1, 2], [[1, 2], [3], [], []]
    gen = torch.Generator().manual_seed(0)
    # root -> node 1 (token 0, .96 > min(.09, .247)): kept; root -> node 2 (token 1, .02): not kept;
    # node 1 -> node 3 (token 2): .33 > min(.09, .100) under flat, kept; .05 < min(.09, .202) under skewed, not
    path, nxt = accept_typical({0: peaked, 1: flat, 3: flat}.__getitem__, tokens, children, 0.09, 0.3, gen)
    assert path == [1, 3] and nxt in (0, 1, 2)
    path, _ = accept_typical({0: peaked, 1: skewed}.__getitem__, tokens, children, 0.09, 0.3, gen)
    assert path == [1]


def test_candidate_trees_from_ranks():
    assert parse_tree("chain") is None and parse_tree(None)[:3] == ((0,), (1,), (2,))
    assert parse_tree("0;1;0,0;0,1") == ((0,), (1,), (0, 0), (0, 1))
    with pytest.raises(ValueError, match="contain every path's parent"):
        parse_tree("0;1,1")
    top = torch.tensor([[10, 11, 12], [20, 21, 22], [30, 31, 32]])
    d = tree_from_ranks(parse_tree("0;1;0,0;0,1;1,0;0,0,0"), top, 2)
    assert d.tokens == [10, 11, 20, 21, 20] and d.parents == [-1, -1, 0, 0, 1] and d.depth() == 2
    assert d.chain().tokens == [10, 20]
    with pytest.raises(ValueError, match="one parent per token"):
        Draft([1, 2], parents=[-1, 1])


@pytest.mark.slow
def test_tree_sampling_keeps_the_full_models_distribution(one_thread):
    """2,000 rows sample three tokens; the tree after the first token offers the two likeliest second tokens as
    siblings: the first two tokens' empirical joint distribution passes a chi-square test at the 0.1 % level
    against the full-depth model's exact one (top-k 3: 9 pairs, 8 degrees of freedom)."""
    from test_speculative_drafts import _exact_pairs

    model = _model("llama")
    prompt = [4, 30, 52, 52, 147, 243, 194, 194, 9, 10, 11, 12, 7, 8, 9, 10, 11, 12, 7, 8]
    exact = _exact_pairs(model, prompt, 3)
    best = {}
    for (t1, t2), p in sorted(exact.items(), key=lambda kv: -kv[1]):
        best.setdefault(t1, [])
        if len(best[t1]) < 2:
            best[t1].append(t2)

    class Siblings(BaseDraft):
        name = "siblings"
        max_nodes = 2

        def propose(self, rows, budget):
            out = {}
            for r in rows:
                first = self.dec.out[r][-1]
                if budget[r] >= 1 and first in best:
                    out[r] = Draft(best[first], parents=[-1, -1])
            return out

    n = 2000
    res = model.generate([prompt] * n, draft=Siblings, do_sample=True, top_k=3, seed=11, max_new_tokens=3,
                         ignore_eos=True, draft_tokens=2)
    counts = {}
    for row in res.new_tokens:
        counts[(row[0], row[1])] = counts.get((row[0], row[1]), 0) + 1
    assert set(counts) <= set(exact)
    chi2 = sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in exact.items())
    assert chi2 < 26.12, (chi2, counts, exact)  # chi-square quantile 0.999, 8 degrees of freedom
    st = res.speculative
    assert 0 < st.accepted < st.proposed == 1  # per row: one round, of depth 1; some rows kept a sibling


def test_bench_runs_group_a_on_the_verifier(one_thread, tmp_path):
    """``fbs bench``'s Group A systems (the draft names) run on the engine's verifier with their saved drafts and
    reproduce the full-depth output; a missing trained draft gives a row naming the command that makes it."""
    from fbs.baselines.medusa import MedusaHeads
    from fbs.baselines.specdec import save_draft_model, student_from_target
    from fbs.bench.harness import BenchConfig, measure
    from fbs.bench.runner import RunSpec, build_systems

    model = _model("llama")
    fp = model.config.base_fingerprint
    student, layers = student_from_target(model, 2)
    save_draft_model(student, tmp_path / "s", {"layers": layers, "base_fingerprint": fp})
    MedusaHeads(model.base.spec.hidden_size, 2).save(tmp_path / "m", fp)
    _eagle(model).save(tmp_path / "e", fp)
    paths = {"specdec": str(tmp_path / "s"), "medusa": str(tmp_path / "m"), "eagle": str(tmp_path / "e")}
    spec = RunSpec(systems=("group-a",), group_a_paths=paths, draft_tokens=3)
    systems = build_systems(model.base.hf, None, model, spec)
    assert [s.name for s in systems] == ["draft-prompt-lookup", "lookahead", "specdec", "medusa", "eagle"]
    prompts = torch.randint(0, 255, (2, 10), generator=torch.Generator().manual_seed(1))
    cfg = BenchConfig(prompt_len=10, new_tokens=12, warmup=0, runs=1, num_prompts=2)
    full = model.generate(prompts, force_compute=True, max_new_tokens=12, ignore_eos=True, min_new_tokens=12)
    for system in systems:
        res = measure(system, prompts, cfg)
        assert res.status == "ok", (system.name, res.note)
        assert res.probe["drafter"] == system.knobs["draft"] and res.probe["passes"] + res.probe["accepted"] == 12
        assert torch.equal(res.outputs[:, -12:], full.sequences[:, -12:]), system.name
    missing = build_systems(model.base.hf, None, model, RunSpec(systems=("specdec", "medusa", "eagle")))
    assert [s.unavailable(1).split("`")[1].split(" --")[0] for s in missing] == [
        "fbs train draft-model", "fbs train medusa", "fbs train eagle"]
    twice = build_systems(model.base.hf, None, model, RunSpec(systems=("lookahead", "medusa"), group_a_paths=paths,
                                                              native_trees=True))
    assert [(s.name, s.knobs.get("native_trees", False)) for s in twice] == [
        ("lookahead", False), ("lookahead-trees", True), ("medusa", False), ("medusa-trees", True)]


@pytest.mark.parametrize("weights,kv_dtype", [("int8", "fp32"), ("q4", "fp32"), ("q4", "int8")])
def test_native_formats_verify_whole_trees(weights, kv_dtype, one_thread):
    """With ``native_trees`` the native multi-token steps verify whole token trees (nodes > proposed, as on the
    PyTorch ops), without it each tree's chain of first children (nodes == proposed); both give full depth's output
    in that format (and KV cache storage: an int8 cache's entries move with their scales when the kept path is
    compacted): the oracle tree and Medusa's top-k tree, heads of 16 and of 64."""
    from test_speculative_drafts import _heads

    for model in (_model("llama"), _model_hd64("llama")):
        kw = dict(max_new_tokens=32, ignore_eos=True, weights=weights, kv_dtype=kv_dtype)
        full = model.generate(PROMPTS, force_compute=True, **kw).new_tokens
        V = model.base.spec.vocab_size
        for name, draft, options in [("oracle", _oracle(full, V), None),
                                     ("medusa", "medusa", {"heads": _heads(model)})]:
            for trees in (True, False):
                res = model.generate(PROMPTS, draft=draft, draft_options=options, draft_tokens=5,
                                     native_trees=trees, **kw)
                st = res.speculative
                assert res.new_tokens == full, (name, trees)
                assert (st.nodes > st.proposed > 0) if trees else (st.nodes == st.proposed > 0), (name, trees)


def test_medusa_typical_acceptance_samples_within_the_warped_support(one_thread):
    """Typical acceptance is opt-in for sampling (it does not keep the target's distribution): every token comes
    from the target's top-k at its position (the kept nodes passed the confidence cut under it, the next one is
    drawn from it), checked against the full-depth forward over the sampled sequence; greedy ignores it."""
    from test_speculative_drafts import _heads

    model = _model("llama")
    heads = _heads(model)
    opts = {"heads": heads, "typical": True, "posterior_threshold": 0.01}
    res = model.generate(PROMPTS, draft="medusa", draft_options=opts, do_sample=True, top_k=5, seed=3,
                         max_new_tokens=24, ignore_eos=True, draft_tokens=3)
    st = res.speculative
    assert st.accepted > 0
    for row, prompt in zip(res.new_tokens, PROMPTS):
        logits = model(torch.tensor([prompt + row]), gate_mode="off").logits[0, len(prompt) - 1:-1]
        top = logits.topk(5, -1).indices
        assert all(t in top[j].tolist() for j, t in enumerate(row)), row
    greedy = model.generate(PROMPTS, draft="medusa", draft_options=opts, max_new_tokens=24, ignore_eos=True)
    assert greedy.new_tokens == model.generate(PROMPTS, force_compute=True, max_new_tokens=24,
                                               ignore_eos=True).new_tokens
