"""Lossless speculative decoding (fbs.engine.speculative): FBS lossless, Draft&Verify and Kangaroo drafts, one verifier.

The oracle is the engine at full depth (``force_compute=True``): greedy lossless decoding must give its tokens, and
after a rejected draft the KV cache and chunk states must be those of a run that never drafted.
"""

import pytest
import torch

from conftest import fbs_tiny, randomize
from fbs.engine import run, start
from fbs.baselines.kangaroo import KangarooAdapter
from fbs.engine.drafts import acceptance_mle, best_gamma, expected_speedup
from fbs.engine.speculative import accept_sampled, draft_plan, draft_step_cost

#: per family, (randomize seed, gate bias) whose gates skip a fair share and whose drafts are often, not always,
#: right (teacher-forced agreement with full depth 0.67-0.81 at 24-44% skipped; measured when the test was written)
DRAFTY = {"llama": (2, 0.0), "qwen2": (1, -1.0), "qwen3": (1, 0.0)}
PROMPT = torch.randint(0, 255, (1, 12), generator=torch.Generator().manual_seed(5))


def _model(family):
    seed, bias = DRAFTY[family]
    return randomize(fbs_tiny(family), seed=seed, gate_bias=bias)


def _prompts(n=4):
    lengths = (5, 9, 9, 14)
    return [torch.randint(0, 255, (lengths[i],), generator=torch.Generator().manual_seed(10 + i)).tolist()
            for i in range(n)]


@pytest.mark.parametrize("policy", ["hole", "project"])
def test_lossless_greedy_equals_full_depth(family, policy, one_thread):
    model = _model(family)
    kw = dict(max_new_tokens=64, ignore_eos=True, kv_policy=policy, output_scores=True)
    full = model.generate(PROMPT, force_compute=True, **kw)
    res = model.generate(PROMPT, lossless=True, **kw)
    assert res.new_tokens == full.new_tokens
    st = res.speculative
    assert st.draft_skip_ratio > 0.1 and 0 < st.acceptance_rate < 1  # drafts skip, and some are rejected
    assert st.accepted + st.passes == 64  # every pass commits its accepted drafts plus one token
    assert res.trace.skip_ratio == 0 and int(res.trace.valid.sum()) == 63  # the verifier consumed every token
    assert (res.scores[0] - full.scores[0]).abs().max() < 1e-4  # the verifier's logits are full depth's


@pytest.mark.parametrize("policy", ["hole", "project"])
def test_lossless_batch_of_four(policy, one_thread):
    model = _model("llama")
    kw = dict(max_new_tokens=64, ignore_eos=True, kv_policy=policy)
    res = model.generate(_prompts(), lossless=True, **kw)
    assert res.new_tokens == model.generate(_prompts(), force_compute=True, **kw).new_tokens
    assert 0 < res.speculative.acceptance_rate < 1


def test_lossless_masks_eos_until_min_new_tokens_then_stops(one_thread):
    """EOS boosted in the LM head (seen through the HF modules): drafts and verification mask it per position until
    ``min_new_tokens``, then the row stops at it, as full-depth decoding does."""
    model = _model("llama")
    eos = model.base.hf.config.eos_token_id

    def eos_wins(_mod, _inp, out):
        out = out.clone()
        out[..., eos] += 1e3
        return out

    hook = model.base.lm_head.register_forward_hook(eos_wins)
    try:
        kw = dict(max_new_tokens=10, min_new_tokens=4, weights="hf")
        full = model.generate(PROMPT, force_compute=True, **kw).new_tokens
        res = model.generate(PROMPT, lossless=True, **kw)
    finally:
        hook.remove()
    assert len(full[0]) == 5 and full[0][-1] == eos and eos not in full[0][:4]
    assert res.new_tokens == full


def test_stream_yields_the_tokens_of_each_round(one_thread):
    model = _model("qwen2")
    kw = dict(max_new_tokens=20, ignore_eos=True, lossless=True)
    streamed = [t for step in model.stream(PROMPT, **kw) for t in step.tokens]
    assert streamed == model.generate(PROMPT, **kw).new_tokens[0]


def _decoder(model, **kw):
    return start(model, PROMPT, None, None, dict(ignore_eos=True, **kw))


def _assert_same_state(dec, ref):
    """Every layer's K/V entries (count, positions, tensors) and every chunk state equal the reference's."""
    for l in range(dec.L):
        n = ref.cache.lengths[l][0]
        assert dec.cache.lengths[l][0] == n and dec.cache.positions[l][0] == ref.cache.positions[l][0]
        torch.testing.assert_close(dec.cache.k[l][0, :, :n], ref.cache.k[l][0, :, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dec.cache.v[l][0, :, :n], ref.cache.v[l][0, :, :n], rtol=1e-5, atol=1e-5)
    for l, st in dec.chunks.items():
        other = ref.chunks[l]
        assert torch.equal(st.n_closed, other.n_closed) and torch.equal(st.open_count, other.open_count)
        torch.testing.assert_close(st.closed, other.closed, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(st.open_sum, other.open_sum, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", ["hole", "project"])
def test_rejected_draft_leaves_the_state_of_a_run_that_never_drafted(policy, one_thread):
    """After a round that rejected a draft (and at the end), the cache and chunk states equal those of full-depth
    decoding of the same tokens: the draft's K/V (fewer layers under hole, projections under project) and its
    chunk-cache updates are gone, the verifier's are in."""
    model = _model("qwen3")
    dec = _decoder(model, max_new_tokens=48, lossless=True, kv_policy=policy)

    def check():
        ref = _decoder(model, max_new_tokens=len(dec.out[0]), force_compute=True, kv_policy=policy)
        for _ in run(ref):
            pass
        assert ref.out[0] == dec.out[0]
        assert dec.cache.lengths[0][0] == PROMPT.shape[1] + len(dec.out[0]) - 1
        _assert_same_state(dec, ref)

    checked = False
    for _ in run(dec):  # tokens are yielded after their round's rollback
        if not checked and dec.spec.rejections[0] > 0:
            check()
            checked = True
    assert checked
    check()


@pytest.mark.parametrize("policy", ["hole", "project"])
def test_rounds_without_a_draft_leave_the_state_of_a_run_that_never_drafted(policy, monkeypatch, one_thread):
    """Prompt lookup with every other round's proposal withheld: the verifier's one-token passes (no draft: no log of
    CH's states) and its multi-token passes alternate, and after the run the tokens, the KV cache and every chunk state
    equal full-depth decoding's (the qwen3 tiny model has a CH layer)."""
    from fbs.engine import drafts

    model = _model("qwen3")
    assert model.ch, "the test needs a CH layer"
    real, calls = drafts.PromptLookupDraft.propose, []

    def every_other(self, rows, budget):
        calls.append(len(calls) % 2)
        return real(self, rows, budget) if calls[-1] else {}

    monkeypatch.setattr(drafts.PromptLookupDraft, "propose", every_other)
    prompt = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 9, 5, 6]])
    dec = start(model, prompt, None, None, dict(ignore_eos=True, max_new_tokens=40, draft="prompt-lookup",
                                                kv_policy=policy))
    for _ in run(dec):
        pass
    ref = start(model, prompt, None, None, dict(ignore_eos=True, max_new_tokens=len(dec.out[0]), force_compute=True,
                                                kv_policy=policy))
    for _ in run(ref):
        pass
    assert dec.out[0] == ref.out[0]
    assert dec.spec.proposed[0] > 0 and calls.count(0) > 2  # drafts were verified, and rounds went without
    _assert_same_state(dec, ref)


def test_draft_verify_static_plan_is_lossless(one_thread):
    model = _model("qwen2")
    kw = dict(max_new_tokens=48, ignore_eos=True)
    plan = draft_plan("2,4", model.num_layers)
    assert plan.tolist() == [False, False, True, False, True, False]
    res = model.generate(_prompts(2), lossless=True, skip_plan=plan, kv_policy="hole", draft_stop=0.5, **kw)
    assert res.new_tokens == model.generate(_prompts(2), force_compute=True, **kw).new_tokens
    st = res.speculative
    assert st.drafter == "plan" and abs(st.draft_skip_ratio - 2 / 6) < 1e-9
    assert st.threshold != [0.5, 0.5]  # the draft-stop threshold follows the match rate (Draft&Verify)


@pytest.mark.parametrize("exit_layer", [2, 4])
def test_kangaroo_draft_is_lossless(exit_layer, one_thread):
    """Exit before the CH layer (3: verification rebuilds the chunk state) and after it (the draft's shallow
    layers run CH and PAW for every round token, and the state after the last kept token stays)."""
    model = _model("llama")
    adapter = KangarooAdapter.for_model(model, exit_layer)
    kw = dict(max_new_tokens=40, ignore_eos=True)
    res = model.generate(_prompts(2), lossless=True, draft_adapter=adapter, draft_stop=0.05, **kw)
    assert res.new_tokens == model.generate(_prompts(2), force_compute=True, **kw).new_tokens
    assert res.speculative.drafter == "kangaroo" and res.speculative.proposed > 0


def test_kangaroo_adapter_training_distils_the_full_model(tmp_path, one_thread):
    from fbs.train.speculative import train_kangaroo_adapter

    model = _model("llama")
    blocks = model.generate(torch.randint(0, 255, (6, 4), generator=torch.Generator().manual_seed(0)),
                            max_new_tokens=28, ignore_eos=True, force_compute=True, do_sample=True, seed=0).sequences
    adapter, summary = train_kangaroo_adapter(model, blocks[:4], 3, steps=30, lr=3e-3, batch_size=2,
                                              eval_blocks=blocks[4:])
    before, after = summary["eval_before"], summary["eval_after"]
    assert after["loss"] < before["loss"] and after["top1"] > before["top1"]
    path = adapter.save(tmp_path / "kangaroo", model.config.base_fingerprint)
    loaded = KangarooAdapter.load(path, model)
    h = torch.randn(1, 5, 64)
    cos, sin = model.base.rope(h, torch.arange(5)[None])
    with torch.no_grad():
        assert torch.equal(loaded(h, cos, sin), adapter(h, cos, sin))
    kw = dict(max_new_tokens=24, ignore_eos=True)
    ids = blocks[4:, :4]
    trained = model.generate(ids, lossless=True, draft_adapter=loaded, adapt_draft=False, **kw)
    fresh = model.generate(ids, lossless=True, draft_adapter=KangarooAdapter.for_model(model, 3), adapt_draft=False,
                           **kw)
    assert trained.new_tokens == model.generate(ids, force_compute=True, **kw).new_tokens
    assert trained.speculative.acceptance_rate > fresh.speculative.acceptance_rate


def test_speculative_sampling_keeps_the_target_distribution():
    """One draft over 3 tokens, p = (.5, .3, .2), q = (.2, .5, .3): kept with min(1, p/q) = (1, .6, 2/3), so tokens
    1 and 2 are committed with q * min(1, p/q) = p = (.3, .2) and token 0 with .2 + (1 - .7) * residual(0), the
    residual max(p - q, 0) / .3 = (1, 0, 0): .5. Sampled through the function, two tokens per trial (the second
    from p1 after an accepted draft, else from the next round), the pairs follow p0 x p1."""
    p0, p1 = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.1, 0.6, 0.3])
    q0, q1 = torch.tensor([0.2, 0.5, 0.3]), torch.tensor([0.4, 0.4, 0.2])
    keep = torch.minimum(torch.ones(3), p0 / q0)
    residual = (p0 - q0).clamp_min(0) / (p0 - q0).clamp_min(0).sum()
    torch.testing.assert_close(q0 * keep + (1 - (q0 * keep).sum()) * residual, p0)

    gen = torch.Generator().manual_seed(0)
    n = 20000
    counts = torch.zeros(3, 3)
    for _ in range(n):
        out = []
        while len(out) < 2:  # rounds: draft what is left (q0 then q1), verify against (p0, p1, p1)
            qs = [q0, q1][len(out):]
            drafts = [int(torch.multinomial(q, 1, generator=gen)) for q in qs]
            ps = torch.stack([p0, p1, p1][len(out):len(out) + len(qs) + 1])
            a, nxt = accept_sampled(ps, torch.stack(qs), drafts, gen)
            out += drafts[:a] + [nxt]
        counts[out[0], out[1]] += 1
    assert (counts / n - p0[:, None] * p1[None, :]).abs().max() < 0.015  # ~4 standard errors


def test_lossless_sampling_with_top_k_one_is_greedy_and_seeded(one_thread):
    model = _model("qwen3")
    kw = dict(max_new_tokens=32, ignore_eos=True, lossless=True, do_sample=True, temperature=0.8)
    greedy = model.generate(PROMPT, max_new_tokens=32, ignore_eos=True, force_compute=True).new_tokens
    assert model.generate(PROMPT, top_k=1, seed=3, **kw).new_tokens == greedy
    a, b = model.generate(PROMPT, seed=1, **kw), model.generate(PROMPT, seed=1, **kw)
    assert a.new_tokens == b.new_tokens and a.new_tokens != greedy
    assert 0 < a.speculative.acceptance_rate < 1  # this seed exercises both acceptance and resampling


def test_work_counts_drafts_and_verification(one_thread):
    """A full-depth draft (force_compute) with gamma 4, not adapted, over 21 tokens: the prompt's pass commits 1,
    then 4 rounds of 4 draft steps + a 5-token verification commit 5 each; 36 token passes of every layer
    against plain decoding's 20."""
    model = _model("llama")
    res = model.generate(PROMPT, max_new_tokens=21, ignore_eos=True, lossless=True, force_compute=True,
                         draft_tokens=4, adapt_draft=False)
    st = res.speculative
    assert (st.passes, st.proposed, st.accepted, st.draft_steps) == (5, 16, 16, 16)
    assert res.trace.tflops_rel == pytest.approx(36 / 20)
    assert res.trace.tflops_rel_exact > res.trace.tflops_rel  # 16 extra LM-head rows and attention over drafts


def test_cost_model_of_a_round():
    assert expected_speedup(0.5, 1, 0.5) == pytest.approx(1.5 / (0.5 + 1 + 0.15))
    assert expected_speedup(1.0, 3, 0.0, verify_token_cost=0.0) == 4.0
    assert best_gamma(0.95, 0.1, 8) > best_gamma(0.3, 0.1, 8) == 1
    assert acceptance_mle(6, 2) == 0.75


def test_an_int8_draft_is_priced_against_the_fp32_verifier_step():
    """The verifier (and gamma-0 steps) run fp32 whatever the draft's format: a full-depth int8 draft costs the int8
    step's bytes over the fp32 step's (hand-computed from the parameter counts), not 1, so drafting can pay."""
    from fbs.engine.flops import LayerCost

    model = fbs_tiny()
    cost = LayerCost.of(model.base.spec)
    hf = model.base.hf
    n = lambda *ms: sum(p.numel() for m in ms for p in m.parameters())  # noqa: E731
    layer = hf.model.layers[0]
    matrices = n(layer.self_attn, layer.mlp)
    rows = sum(m.out_features for m in (*[getattr(layer.self_attn, k) for k in ("q_proj", "k_proj", "v_proj", "o_proj")],
                                         layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj))
    vectors = n(layer.input_layernorm, layer.post_attention_layernorm)
    head = hf.lm_head.weight.numel()
    L, d, vocab = cost.num_layers, cost.hidden_size, cost.vocab_size
    fp32 = 4 * (L * (matrices + vectors) + head + d)
    from fbs.engine.flops import weight_format

    f = weight_format("int8")
    int8 = (L * (matrices * f.weight + rows * f.scale + vectors * f.activation) + head * f.weight + vocab * f.scale
            + d * f.activation)
    assert draft_step_cost(cost, 0, L, "hole", "int8") == pytest.approx(int8 / fp32, rel=1e-9)
    assert draft_step_cost(cost, 0, L, "hole", "fp32") == pytest.approx(1.0)
    assert draft_step_cost(cost, 0, L, "hole", "int8") < 0.35


def test_draft_search_measures_acceptance_and_prices_the_draft(one_thread):
    from fbs.train.speculative import search_draft_layers

    model = _model("llama")
    best, history = search_draft_layers(model, _prompts(2), new_tokens=12, gamma=3)
    empty = history[0]
    assert empty.layers == [] and empty.alpha == 1.0 and empty.draft_cost == 1.0  # the full model drafts itself
    assert best in history and best.speedup >= empty.speedup
    assert set(best.layers) <= set(model.layers_cfg.gated)
    assert all(0.0 <= c.alpha <= 1.0 and 0 < c.draft_cost <= 1.0 for c in history)


def test_draft_search_with_max_layers_runs_every_round_and_keeps_the_best_set(one_thread):
    from fbs.train.speculative import search_draft_layers

    model = _model("llama")
    best, history = search_draft_layers(model, _prompts(2), new_tokens=8, gamma=3, max_layers=2)
    pool = len(model.layers_cfg.gated)
    assert len(history) == 1 + pool + (pool - 1), "two full rounds, whether or not a round improved"
    assert best.speedup == max(c.speedup for c in history)


def test_bench_runs_the_lossless_systems(one_thread, tmp_path):
    from fbs.bench.harness import BenchConfig, measure
    from fbs.bench.runner import RunSpec, build_systems

    model = _model("llama")
    KangarooAdapter.for_model(model, 2).save(tmp_path / "k", model.config.base_fingerprint)
    spec = RunSpec(systems=("fbs-lossless", "draft-verify", "kangaroo"), draft_layers="2,3",
                   kangaroo=str(tmp_path / "k"), lossless_taus=(0.9,))
    systems = build_systems(model.base.hf, None, model, spec)
    assert [s.name for s in systems] == ["fbs-lossless", "fbs-lossless-tau0.9", "draft-verify", "kangaroo-exit2"]
    assert systems[1].knobs["tau"] == 0.9 and systems[1].params["lossless"]
    prompts = torch.randint(0, 255, (2, 10), generator=torch.Generator().manual_seed(1))
    cfg = BenchConfig(prompt_len=10, new_tokens=12, warmup=0, runs=1, num_prompts=2)
    for system in systems:
        res = measure(system, prompts, cfg)
        assert res.status == "ok", res.note
        p = res.probe
        assert res.family == "speculative" and p["passes"] + p["accepted"] == pytest.approx(12)
        assert p["method_ratio"] == p["acceptance_rate"] and p["tflops_rel"] > 0
    missing = build_systems(model.base.hf, None, model, RunSpec(systems=("draft-verify", "kangaroo")))
    assert all("fbs train" in s.unavailable(1) for s in missing)


@pytest.fixture(scope="module")
def shipped_smollm2():
    from fbs import FBSForCausalLM
    from fbs.model.loading import shipped_checkpoint

    path = shipped_checkpoint("smollm2-135m", "stage1")
    if path is None:
        pytest.fail("src/fbs/assets/fbs-smollm2-135m-stage1 is missing")
    try:
        return FBSForCausalLM.from_pretrained(path).eval()
    except ValueError as e:  # package missing: make test installs it, so this is a set-up bug
        pytest.fail(f"SmolLM2 base model unavailable: {e}")


def test_lossless_on_the_shipped_smollm2_under_both_kv_policies(shipped_smollm2):
    """The shipped Stage-1 model drafting at tau 0.1 (about a third of the layers skipped, so drafts get rejected):
    48 tokens equal to full depth under hole and project."""
    model = shipped_smollm2
    ids = model.tokenizer("Photosynthesis converts light energy into chemical energy. In plants, it takes place in",
                          return_tensors="pt").input_ids
    kw = dict(max_new_tokens=48, ignore_eos=True)
    full = model.generate(ids, force_compute=True, **kw).new_tokens
    for policy in ("hole", "project"):
        res = model.generate(ids, lossless=True, tau=0.1, kv_policy=policy, **kw)
        assert res.new_tokens == full, policy
        st = res.speculative
        assert st.draft_skip_ratio > 0.2 and 0 < st.acceptance_rate < 1


@pytest.mark.parametrize("fmt", ["q4", "int8"])
def test_verified_logits_are_decodings_bit_for_bit_on_the_shipped_smollm2(shipped_smollm2, fmt):
    """The shipped model (PAW, CH and LoRA factors kept apart in q4) in a native format, on a chat prompt: with a
    self-draft and with prompt lookup, every verified position's logits equal one-token decoding's bit for bit, so
    greedy output is full depth's whatever the near-ties (before they were equal only to float rounding, and chat
    outputs diverged from full depth's on most prompts)."""
    model = shipped_smollm2
    from fbs.data.chat import render_user_turn as render

    ids = [render(model.tokenizer, "Explain why the sky is blue, briefly.")]
    kw = dict(max_new_tokens=40, ignore_eos=True, weights=fmt, output_scores=True)
    full = model.generate(ids, force_compute=True, **kw)
    for draft in ("fbs", "prompt-lookup"):
        res = model.generate(ids, draft=draft, **kw)
        assert res.speculative.passes < 40, draft  # some drafts were accepted: positions were verified together
        assert res.new_tokens == full.new_tokens, draft
        assert all(torch.equal(a, b) for a, b in zip(res.scores, full.scores)), draft


def test_command_line_options_select_the_drafts(tmp_path):
    from fbs.cli import _lossless_options, build_parser

    model = _model("llama")
    KangarooAdapter.for_model(model, 2).save(tmp_path / "k", model.config.base_fingerprint)
    (tmp_path / "set.json").write_text('{"layers": [2, 3]}')

    def options(*argv):
        return _lossless_options(build_parser().parse_args(["generate", "hi", *argv]), model)

    assert options() == {} and options("--lossless") == {"lossless": True}
    dv = options("--draft-layers", str(tmp_path / "set.json"), "--draft-stop", "0.5")
    assert dv["skip_plan"].tolist() == [False, False, True, True, False, False] and dv["draft_stop"] == 0.5
    k = options("--kangaroo", str(tmp_path / "k"), "--draft-tokens", "6")
    assert k["lossless"] and k["draft_adapter"].exit_layer == 2 and k["draft_tokens"] == 6
    for argv, name in ((["kangaroo", "--exit-layer", "3", "--out-dir", "x"], "cmd_kangaroo"),
                       (["draft-search", "--out", "x.json"], "cmd_draft_search")):
        assert build_parser().parse_args(["train", *argv]).func.__name__ == name
