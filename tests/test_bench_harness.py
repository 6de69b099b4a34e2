"""Timing harness: exactly N new tokens whatever the model says, match rates, prompts, memory probe."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fbs import FBSConfig, FBSForCausalLM
from fbs.bench.harness import BenchConfig, PeakRSS, batches, build_prompts, match_rates, measure
from fbs.bench.systems import FBSSystem, hf_greedy

EOS = 255
CFG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
           eos_token_id=EOS, bos_token_id=0, pad_token_id=0)


def eos_loving_llama() -> LlamaForCausalLM:
    """A tiny model whose EOS logit is huge at every position: it wants to stop immediately."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CFG)).eval()

    def boost_eos(module, args, out):
        out = out.clone()
        out[..., EOS] += 1e4
        return out

    model.lm_head.register_forward_hook(boost_eos)
    return model


class ByteTokenizer:
    """Stand-in tokenizer: one id per byte, folded into the tiny vocabulary."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1 + b % 250 for b in text.encode()]}


def test_the_model_really_wants_eos():
    model = eos_loving_llama()
    ids = torch.randint(1, 200, (1, 8))
    assert model(ids).logits[0, -1].argmax().item() == EOS


@pytest.mark.parametrize("batch", [1, 2])
def test_hf_generates_exactly_n_tokens_despite_eos(batch):
    model = eos_loving_llama()
    prompts = torch.randint(1, 200, (2, 8))
    res = measure(hf_greedy(model), prompts, BenchConfig(prompt_len=8, new_tokens=7, batch_size=batch, warmup=0,
                                                         runs=1, num_prompts=2))
    assert res.status == "ok", res.note
    assert res.outputs.shape == (2, 7)
    assert not (res.outputs == EOS).any()  # EOS was masked until N tokens existed, never emitted


def test_fbs_engine_generates_exactly_n_tokens_despite_eos():
    cfg = FBSConfig(k_max=4, preview_vocab_size=48, preview_top_k=8, preview_rank=16, chunk_rank=16,
                    chunk_cache_size=4, gate_rank=8, gate_width=8, paw_layers=(0,), ch_layers=(3,),
                    never_skip_first=1, never_skip_last=1)
    fbs = FBSForCausalLM.from_base(eos_loving_llama(), config=cfg).eval()
    prompts = torch.randint(1, 200, (2, 8))
    res = measure(FBSSystem("fbs", fbs, {"force_compute": True}), prompts,
                  BenchConfig(prompt_len=8, new_tokens=6, warmup=0, runs=1, num_prompts=2))
    assert res.status == "ok", res.note
    assert res.outputs.shape == (2, 6)


def test_timings_are_split_and_consistent():
    model = eos_loving_llama()
    prompts = torch.randint(1, 200, (1, 8))
    res = measure(hf_greedy(model), prompts, BenchConfig(prompt_len=8, new_tokens=5, warmup=1, runs=3,
                                                         num_prompts=1))
    assert res.prefill_s.median > 0 and res.decode_s.median > 0
    assert res.prefill_s.median + res.decode_s.median <= res.total_s.max * 1.0001
    assert res.peak_rss_mb >= res.rss_before_mb > 0


def test_match_rates():
    ref = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    out = torch.tensor([[1, 2, 3, 4], [5, 6, 0, 8]])
    assert match_rates(out, ref) == (pytest.approx(87.5), pytest.approx(50.0))


def test_prompts_are_deterministic_and_exact_length():
    tok = ByteTokenizer()
    a, b = build_prompts(tok, 3, 64), build_prompts(tok, 3, 64)
    assert a.shape == (3, 64) and torch.equal(a, b)
    assert not torch.equal(a[0], a[1])  # windows come from different parts of the text
    assert build_prompts(tok, 1, 5000, text="short text ").shape == (1, 5000)  # repeats short text


def test_batches_wrap_around_the_prompt_set():
    p = torch.arange(3).view(3, 1)
    assert [b.flatten().tolist() for b in batches(p, 2)] == [[0, 1]]
    assert [b.flatten().tolist() for b in batches(p, 4)] == [[0, 1, 2, 0]]


def test_peak_rss_sees_an_allocation():
    """64 MB of fresh anonymous pages (an mmap of its own, every page written): a tensor of that size could reuse
    memory the allocator keeps resident after earlier tests, which the RSS would not see."""
    import mmap

    with PeakRSS() as mem:
        buf = mmap.mmap(-1, 64 * 2**20)
        for off in range(0, len(buf), 4096):
            buf[off] = 1
    buf.close()
    assert mem.peak_mb - mem.before_mb > 32


def test_bench_config_validates():
    with pytest.raises(ValueError, match="new_tokens must be >= 1, got 0"):
        BenchConfig(new_tokens=0)


def test_draft_runs_budget_measures_assisted_generation_on_the_first_prompts_only():
    """A slow draft-model system gets no warm-up, N runs and N probed prompts; under greedy its output must
    still equal the target's own greedy output (assisted generation is lossless)."""
    from fbs.bench.report import markdown, result_record
    from fbs.bench.systems import hf_assisted

    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(**CFG)).eval()
    draft = LlamaForCausalLM(LlamaConfig(**{**CFG, "num_hidden_layers": 1})).eval()
    prompts = torch.randint(1, 200, (3, 8))
    cfg = BenchConfig(prompt_len=8, new_tokens=6, warmup=2, runs=3, num_prompts=3)
    system = hf_assisted(target, draft, num_assistant_tokens=3, max_runs=1)
    calls = []
    real = system.generate
    system.generate = lambda ids, n, probe=False: calls.append(probe) or real(ids, n, probe)
    res = measure(system, prompts, cfg)
    assert res.status == "ok", res.note
    assert calls == [True, False]  # one probe run (the first prompt), no warm-up, one measured run
    assert res.budget == {"warmup": 0, "runs": 1, "probe_prompts": 1}
    greedy = measure(hf_greedy(target), prompts, cfg)
    assert greedy.budget == {"warmup": 2, "runs": 3, "probe_prompts": 3}
    assert torch.equal(res.outputs, greedy.outputs[:1])
    assert 0.0 <= res.probe["acceptance_rate"] <= 1.0
    rec = result_record(res, cfg.new_tokens, greedy.total_s.median, match_rates(res.outputs, greedy.outputs[:1]),
                        None)
    assert rec["budget"] == res.budget and rec["token_match_pct"] == 100.0
    doc = {"protocol": {"prompt_len": 8, "new_tokens": 6, "runs": 3, "warmup": 2},
           "environment": {"cpu": "x", "torch_threads": 1, "torch": "t"}, "results": [rec]}
    assert "| hf-assisted (1 run, 0 warm-up, 1 prompt matched) | 1 |" in markdown(doc)


class ScriptedSystem:
    """A stand-in system that logs its calls: (name, 'probe'|'timed', first prompt id); optionally fails."""

    family = "baseline"
    params: dict = {}

    def __init__(self, name, log, fail_on_call=None, max_runs=None):
        self.name, self.log, self.fail_on_call, self.max_runs = name, log, fail_on_call, max_runs
        self.calls = 0

    def unavailable(self, batch_size):
        return ""

    def generate(self, ids, n, probe=False):
        from fbs.bench.harness import GenOutput

        self.calls += 1
        if self.calls == self.fail_on_call:
            raise RuntimeError("boom")
        self.log.append((self.name, "probe" if probe else "timed", int(ids[0, 0])))
        return GenOutput(torch.cat([ids, ids[:, :1].repeat(1, n)], dim=1), 0.001, 0.002, {})


def test_interleaved_rounds_run_every_system_in_turn_with_its_own_budget():
    from fbs.bench.harness import measure_interleaved

    log = []
    prompts = torch.arange(1, 4).view(3, 1).repeat(1, 4)  # three prompts, first ids 1, 2, 3
    a, b = ScriptedSystem("a", log), ScriptedSystem("b", log, max_runs=1)
    rounds = []
    res = measure_interleaved([a, b], prompts, BenchConfig(prompt_len=4, new_tokens=2, warmup=1, runs=2,
                                                           num_prompts=3), lambda k, i, n: rounds.append((k, i, n)))
    assert log == [("a", "probe", 1), ("a", "probe", 2), ("a", "probe", 3), ("b", "probe", 1),  # b: first prompt
                   ("a", "timed", 1),                                   # warm-up round (b has none)
                   ("a", "timed", 1), ("b", "timed", 1),                # measured round 1
                   ("a", "timed", 2)]                                   # measured round 2 (b's budget is 1 run)
    assert rounds == [("probe a", 0, 2), ("probe b", 1, 2), ("warm-up", 0, 1), ("run", 0, 2), ("run", 1, 2)]
    assert [r.budget["runs"] for r in res] == [2, 1] and [len(r.outputs) for r in res] == [3, 1]
    assert res[0].decode_s.median == pytest.approx(0.002) and res[0].peak_rss_mb > 0


def test_interleaved_failure_drops_only_the_failing_system():
    from fbs.bench.harness import measure_interleaved

    log = []
    prompts = torch.ones(2, 4, dtype=torch.long)
    bad, good = ScriptedSystem("bad", log, fail_on_call=4), ScriptedSystem("good", log)  # 2 probes, 1 warm, then fail
    res = measure_interleaved([bad, good], prompts, BenchConfig(prompt_len=4, new_tokens=2, warmup=1, runs=3,
                                                                num_prompts=2))
    assert (res[0].status, res[0].note) == ("failed", "RuntimeError: boom")
    assert res[1].status == "ok" and len([e for e in log if e[:2] == ("good", "timed")]) == 4
    assert [e for e in log if e[0] == "bad"][-1] == ("bad", "timed", 1)  # nothing after the failure
