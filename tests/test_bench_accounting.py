"""TFLOPs(rel) accounting of the benchmark: hand-computed values for known plans, HF counting, FBS cross-check."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fbs import FBSConfig, FBSForCausalLM
from fbs.engine.flops import LayerCost, baseline_decode_macs, skip_trace_macs
from fbs.bench.accounting import speculative_ratios
from fbs.bench.systems import FBSSystem, forced_plan, hf_greedy, hf_prompt_lookup

# d=64, 4 heads of 16 (2 KV heads), FFN 128, vocab 256, 4 layers
CFG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
           eos_token_id=255, bos_token_id=0, pad_token_id=0)


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**CFG)).eval()


def tiny_fbs(model) -> FBSForCausalLM:
    cfg = FBSConfig(k_max=4, preview_vocab_size=48, preview_top_k=8, preview_rank=16, chunk_rank=16,
                    chunk_cache_size=4, gate_rank=8, gate_width=8, paw_layers=(0,), ch_layers=(3,),
                    never_skip_first=1, never_skip_last=1)
    return FBSForCausalLM.from_base(model, config=cfg).eval()


def test_layer_cost_by_hand():
    c = LayerCost.from_config(LlamaConfig(**CFG))
    # q, o: 64x64 each; k, v: 64x32 each; FFN: 3 x 64x128; QK^T + AV: 2 x 4 heads x 16 per key; head 64x256
    assert (c.attn_proj, c.kv_proj, c.ffn, c.per_key, c.lm_head) == (12288, 4096, 24576, 128, 16384)
    assert c.layer_macs(10) == 12288 + 24576 + 1280


def test_tflops_rel_of_a_known_plan_by_hand():
    c = LayerCost.from_config(LlamaConfig(**CFG))
    T = 5
    # 2 decode steps (positions 5, 6), 4 layers; step 0 skips layers 1 and 2, step 1 skips layer 1
    executed = torch.tensor([[[1, 0, 0, 1], [1, 0, 1, 1]]], dtype=torch.bool)
    dense, per_key, kv, head = 36864, 128, 4096, 16384

    inv, macs = skip_trace_macs(c, executed, T, kv_policy="project")
    assert inv == 5  # paper Eq.: 5 of 8 layer invocations -> TFLOPs(rel) 0.625
    keys = (6 + 7) + 7 + (6 + 7)  # an executed token at position p attends p + 1 keys (layers 0, 2, 3)
    assert macs == 5 * dense + keys * per_key + 3 * kv + 2 * head  # 3 skipped invocations write K/V

    base_inv, base_macs = baseline_decode_macs(c, T, new_tokens=3)
    assert base_inv == 8 and base_macs == 8 * dense + 4 * (6 + 7) * per_key + 2 * head
    assert inv / base_inv == pytest.approx(0.625)

    # hole: step 0 wrote nothing at layer 2, so step 1 sees the 5 prompt keys and itself there, not 7
    _, macs_hole = skip_trace_macs(c, executed, T, kv_policy="hole")
    keys_hole = (6 + 7) + 6 + (6 + 7)
    assert macs_hole == 5 * dense + keys_hole * per_key + 2 * head


def test_forced_plan_respects_never_skip():
    plan = forced_plan(30, 0.25, never_skip={0, 1, 24, 25, 26, 27, 28, 29})
    assert int(plan.sum()) == 8 and not plan[[0, 1, 24, 29]].any()


def test_hf_greedy_counts_exactly_plain_decoding():
    m = tiny_llama()
    ids = torch.randint(1, 200, (1, 12))
    out = hf_greedy(m).generate(ids, 6, probe=True)
    assert out.stats["tflops_rel"] == pytest.approx(1.0)
    assert out.stats["tflops_rel_exact"] == pytest.approx(1.0)


def test_learned_prompt_length_counts_exactly_plain_decoding():
    """A draft model's counter learns its prompt length from the first pass; on plain greedy decoding that
    must reproduce the hand formula for N - 1 decode steps over a 12-token prompt."""
    from fbs.model.hf_adapter import DecodeCallCounter

    m = tiny_llama()
    ids = torch.randint(1, 200, (1, 12))
    with DecodeCallCounter(m, None) as c:
        m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    cost = LayerCost.from_config(m.config)
    assert c.prompt_len == 12
    assert (c.invocations, cost.counted_macs(c.dec_tokens, c.dec_keys, c.lm_rows)) == baseline_decode_macs(cost, 12, 6)


def test_assisted_generation_counts_the_draft_models_work():
    from fbs.bench.systems import hf_assisted

    target = tiny_llama()
    torch.manual_seed(1)
    draft = LlamaForCausalLM(LlamaConfig(**{**CFG, "num_hidden_layers": 1})).eval()
    ids = torch.randint(1, 200, (1, 12))
    stats = hf_assisted(target, draft, num_assistant_tokens=3).generate(ids, 8, probe=True).stats
    alone = hf_assisted(target, None).missing  # no draft: the system says why it cannot run
    assert alone
    # the draft proposes every candidate the target verifies, one draft forward per proposed token at least
    d_cost, t_cost = LayerCost.from_config(draft.config), LayerCost.from_config(target.config)
    _, base = baseline_decode_macs(t_cost, 12, 8)
    assert stats["draft_macs_rel"] * base >= stats["proposed"] * (d_cost.dense + d_cost.lm_head) - 1e-6
    assert stats["draft_macs_rel"] > 0


def test_speculative_ratios_from_passes():
    # 10 new tokens in 4 target passes proposing 3, 3, 3, 0 candidates: 6 accepted of 9
    r = speculative_ratios([3, 3, 3, 0], 10)
    assert r["accepted"] == 6 and r["acceptance_rate"] == pytest.approx(6 / 9)
    assert r["verified_advance_ratio"] == pytest.approx(10 / 13)


def test_prompt_lookup_counts_verification_compute():
    m = tiny_llama()
    ids = torch.arange(1, 9).repeat(1, 3)  # repetitive prompt: n-gram lookup proposes candidates
    out = hf_prompt_lookup(m, num_tokens=4).generate(ids, 8, probe=True)
    assert out.stats["passes"] >= 1 and out.stats["tflops_rel"] >= 1.0  # verifying candidates costs compute
    assert out.sequences.shape[1] == ids.shape[1] + 8


def test_fbs_forced_plan_matches_hand_value_and_engine():
    fbs = tiny_fbs(tiny_llama())
    plan = torch.tensor([False, True, False, False])  # skip layer 1 of 4 on every decode step
    ids = torch.randint(1, 200, (1, 10))
    out = FBSSystem("plan", fbs, {"skip_plan": plan, "kv_policy": "project"}).generate(ids, 5, probe=True)
    assert out.stats["tflops_rel"] == pytest.approx(0.75)  # the engine's paper-Eq. value
    assert out.stats["bench_tflops_rel"] == pytest.approx(0.75)  # recomputed here from the trace
    assert out.stats["layer_skip_ratio"] == pytest.approx(0.25)
    assert 0.75 < out.stats["tflops_rel_exact"] < 1.0  # attention/LM head/K/V projections/overhead on top
