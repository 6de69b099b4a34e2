"""The one cost model (fbs.engine.flops): bytes by weight format by hand, and the engine's counter against the
hand-checked bench formulas on real decodes."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config

from fbs import FBSConfig, FBSForCausalLM
from fbs.engine.flops import (FlopCounter, LayerCost, baseline_decode_macs, layer_macs, predicted_saving,
                       skip_trace_macs, step_bytes)

# d=64, 4 heads of 16 (2 KV heads), FFN 128, vocab 256, 4 layers
CFG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
           eos_token_id=255, bos_token_id=0, pad_token_id=0)
# one layer: matrices 36,864 weights (= MACs); output channels q 64 + k 32 + v 32 + o 64 + gate 128 + up 128 +
# down 64 = 512; two RMSNorm vectors of 64. K/V only: 4,096 weights, 64 channels, the input norm (64).
# LM head 64 x 256 plus the final norm (64). One cached key: K and V of 2 heads x 16 = 64 values.


def test_layer_bytes_by_format_by_hand():
    c = LayerCost.from_config(LlamaConfig(**CFG))
    assert (c.layer_bytes("fp32"), c.kv_proj_bytes("fp32"), c.lm_head_bytes("fp32"), c.kv_bytes_per_key("fp32")) \
        == (36864 * 4 + 128 * 4, 4096 * 4 + 64 * 4, 16384 * 4 + 64 * 4, 64 * 4)
    # bf16 / int8 weights; norms and the cache stay in the model's dtype (fp32) in the engine
    assert (c.layer_bytes("bf16"), c.lm_head_bytes("bf16")) == (36864 * 2 + 128 * 4, 16384 * 2 + 64 * 4)
    # int8: one byte per weight, a bf16 scale per output channel
    assert c.layer_bytes("int8") == 36864 + 512 * 2 + 128 * 4
    assert c.kv_proj_bytes("int8") == 4096 + 64 * 2 + 64 * 4
    assert c.lm_head_bytes("int8") == 16384 + 256 * 2 + 64 * 4
    assert c.kv_bytes_per_key("int8") == 64 * 4
    with pytest.raises(ValueError, match="weight format"):
        c.layer_bytes("int4")


def test_qwen2_biases_are_priced():
    q = LayerCost.from_config(Qwen2Config(**CFG))
    llama = LayerCost.from_config(LlamaConfig(**CFG))
    assert q.dense == llama.dense
    assert q.layer_bytes("fp32") - llama.layer_bytes("fp32") == (64 + 32 + 32) * 4  # q, k, v biases
    assert q.kv_proj_bytes("fp32") - llama.kv_proj_bytes("fp32") == (32 + 32) * 4


def test_step_bytes_and_predicted_saving_by_hand():
    c = LayerCost.from_config(LlamaConfig(**CFG))
    lb, kvp, lm, kvb = 147968, 16640, 65792, 256
    assert step_bytes(c, 10) == 4 * lb + lm + 4 * 10 * kvb
    # batch 3: weights once, the cache per row; project reads the skipped layers' K/V weights
    assert step_bytes(c, 10, 2, "project", batch=3) == 2 * lb + lm + 3 * 2 * 10 * kvb + 2 * kvp
    assert step_bytes(c, 10, 2, "hole") == 2 * lb + lm + 2 * 10 * kvb
    full = 4 * lb + lm + 40 * kvb
    assert predicted_saving(c, 10, 2, "hole") == pytest.approx(1 - (2 * lb + lm + 20 * kvb) / full)
    assert predicted_saving(c, 10, 0) == 0.0


def test_a_systems_own_roofline_prices_its_own_format_by_hand():
    """The roofline a system is held to reads the bytes of its own weight format: the engine's ``weights`` or
    llama.cpp's GGUF type (f16 K/V); the fp32 baseline stays the common yardstick."""
    from fbs.bench.roofline import MachinePeaks, decode_roofline, system_format

    c = LayerCost.from_config(LlamaConfig(**CFG))
    peaks = MachinePeaks(read_gbs=1.0, copy_gbs=1.0, gemv_gbs=1.0, matmul_gflops=1e9, threads=1)
    q4 = system_format({"weights": "q4"})
    # 4 layers of 36,864 weights at 0.5 + 4/32 bytes + norms in fp32; head q8 (1 + 2/32) + final norm; fp32 K/V
    q4_bytes = 4 * (36864 * 0.625 + 128 * 4) + 16384 * (1 + 2 / 32) + 64 * 4 + 4 * 10 * 256
    assert decode_roofline(c, peaks, 8, 4, weights=q4)["bytes_per_step"] == pytest.approx(q4_bytes)
    # the same with a half-precision cache (kv_dtype fp16 / bf16): 2 bytes per cached value, 64 values per key
    half = q4_bytes - 4 * 10 * 256 + 4 * 10 * 64 * 2
    for kvd in ("fp16", "bf16"):
        assert decode_roofline(c, peaks, 8, 4, weights=q4, kv_dtype=kvd)["bytes_per_step"] == pytest.approx(half)
    assert decode_roofline(c, peaks, 8, 4, weights=q4, kv_dtype="fp32")["bytes_per_step"] == pytest.approx(q4_bytes)
    # int8 (kv_dtype int8): 1 byte per cached value plus a 4-byte scale per entry (one per KV head, K and V:
    # 64 values = 4 entries of 16 here)
    int8 = q4_bytes - 4 * 10 * 256 + 4 * 10 * (64 + 4 * 4)
    assert decode_roofline(c, peaks, 8, 4, weights=q4, kv_dtype="int8")["bytes_per_step"] == pytest.approx(int8)
    gguf = system_format({"format": "Q4_0"})
    q40_bytes = 4 * (36864 * (0.5 + 2 / 32) + 128 * 2) + 16384 * (1 + 2 / 32) + 64 * 4 + 4 * 10 * 128
    assert decode_roofline(c, peaks, 8, 4, weights=gguf)["bytes_per_step"] == pytest.approx(q40_bytes)
    assert system_format({}) is system_format({"weights": "fp32"})
    assert system_format({"format": "IQ2_XS"}) is None


def _tiny_fbs(paw=(), ch=()):
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**CFG)).eval()
    cfg = FBSConfig(k_max=4, preview_vocab_size=48, preview_top_k=8, preview_rank=16, chunk_rank=16,
                    chunk_cache_size=4, gate_rank=8, gate_width=8, paw_layers=paw, ch_layers=ch,
                    never_skip_first=1, never_skip_last=1)
    return FBSForCausalLM.from_base(hf, config=cfg).eval()


@pytest.mark.parametrize("policy", ["project", "hole"])
def test_engine_exact_tflops_equal_the_hand_checked_formulas(policy):
    """No PAW/CH and a forced plan (no gate evaluated): the engine's exact TFLOPs(rel) is the layer MACs of
    skip_trace_macs over plain decoding's, with nothing else on top."""
    model = _tiny_fbs()
    plan = torch.tensor([False, True, True, False])
    ids = torch.randint(1, 200, (1, 7))
    res = model.generate(ids, max_new_tokens=5, min_new_tokens=5, ignore_eos=True, skip_plan=plan, kv_policy=policy)
    cost = LayerCost.of(model.base.spec)
    executed = plan.logical_not().expand(1, 4, 4)  # 4 decode steps (the 5th token is never fed)
    inv, macs = skip_trace_macs(cost, executed, 7, policy)
    base_inv, base_macs = baseline_decode_macs(cost, 7, 5)
    assert res.trace.tflops_rel == pytest.approx(inv / base_inv) == pytest.approx(0.5)
    assert res.trace.tflops_rel_exact == pytest.approx(macs / base_macs)


def _trace(executed, kv_written, context_len, valid, gate_p=None, granularity="layer"):
    B, N, L = executed.shape
    gate_p = torch.full((B, N, L), float("nan")) if gate_p is None else gate_p
    return types.SimpleNamespace(executed=executed, kv_written=kv_written, context_len=context_len, valid=valid,
                                 gate_p=gate_p, window_k=torch.full((B, N), -1), skip_granularity=granularity)


def test_bytes_relative_by_hand():
    model = _tiny_fbs()
    counter = FlopCounter(model)
    lb, kvp, lm, kvb = 147968, 16640, 65792, 256
    # one row, positions 7 and 8 decoded (third entry invalid); layer 1 skipped at step 0 under project
    ex = torch.ones(1, 3, 4, dtype=torch.bool)
    ex[0, 0, 1] = False
    tr = _trace(ex, torch.ones_like(ex), torch.tensor([[7, 8, 9]]), torch.tensor([[True, True, False]]))
    read = 7 * lb + kvp + 2 * lm + ((8 * 3 + 9 * 4) * kvb)  # step 0 attends 8 keys in 3 layers, step 1 9 in 4
    base = 8 * lb + 2 * lm + (8 + 9) * 4 * kvb
    assert counter.bytes_relative(tr, "fp32") == pytest.approx(read / base)
    # full depth on the bare engine reads exactly what the base model reads
    full = _trace(torch.ones_like(ex), torch.ones_like(ex), tr.context_len, tr.valid)
    assert counter.bytes_relative(full, "int8") == pytest.approx(1.0)


def test_bytes_relative_batch_reads_weights_once_per_step():
    """Two rows skipping different layers: a layer's weights are read if any row runs it."""
    model = _tiny_fbs()
    counter = FlopCounter(model)
    lb, lm, kvb = 147968, 65792, 256
    ex = torch.ones(2, 1, 4, dtype=torch.bool)
    ex[0, 0, 1] = False
    ex[1, 0, 2] = False
    tr = _trace(ex, ex.clone(), torch.tensor([[5], [5]]), torch.ones(2, 1, dtype=torch.bool))  # hole
    read = 4 * lb + lm + 2 * 3 * 6 * kvb
    base = 4 * lb + lm + 2 * 4 * 6 * kvb
    assert counter.bytes_relative(tr) == pytest.approx(read / base)
    both = ex.clone()
    both[:, 0, 1] = False
    tr2 = _trace(both, both.clone(), tr.context_len, tr.valid)  # both rows skip layer 1: its weights stay unread
    assert counter.bytes_relative(tr2) < counter.bytes_relative(tr)


def test_bytes_relative_counts_gate_parameters():
    model = _tiny_fbs()
    counter = FlopCounter(model)
    ex = torch.ones(1, 1, 4, dtype=torch.bool)
    gate_p = torch.tensor([[[float("nan"), 0.1, 0.1, float("nan")]]])
    plain = _trace(ex, ex.clone(), torch.tensor([[5]]), torch.ones(1, 1, dtype=torch.bool))
    gated = _trace(ex, ex.clone(), plain.context_len, plain.valid, gate_p)
    g = model.gates
    params = sum(p.numel() for l in ("1", "2") for p in [*g.hidden[l].parameters(), *g.out[l].parameters()])
    params += sum(p.numel() for p in g.resid_proj.parameters())
    base = 4 * 147968 + 65792 + 4 * 6 * 256
    assert counter.bytes_relative(gated) - counter.bytes_relative(plain) == pytest.approx(4 * params / base)


def test_engine_ffn_granularity_prices_the_attention_of_skipped_pairs():
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**CFG)).eval()
    cfg = FBSConfig(k_max=4, preview_vocab_size=48, preview_top_k=8, preview_rank=16, chunk_rank=16,
                    chunk_cache_size=4, gate_rank=8, gate_width=8, paw_layers=(), ch_layers=(),
                    never_skip_first=1, never_skip_last=1, skip_granularity="ffn")
    model = FBSForCausalLM.from_base(hf, config=cfg).eval()
    plan = torch.tensor([False, True, True, False])
    res = model.generate(torch.randint(1, 200, (1, 7)), max_new_tokens=5, min_new_tokens=5, ignore_eos=True,
                         skip_plan=plan)
    cost = LayerCost.of(model.base.spec)
    executed = plan.logical_not().expand(1, 4, 4)
    macs = layer_macs(cost, executed, torch.ones_like(executed), 7, ~executed) + 4 * cost.lm_head
    _, base_macs = baseline_decode_macs(cost, 7, 5)
    assert res.trace.tflops_rel_exact == pytest.approx(macs / base_macs)
    assert res.trace.tflops_rel == pytest.approx((2 + 2 * cost.attn_proj / cost.dense) / 4)


def test_ffn_granularity_saves_the_ffn_only():
    """skip_granularity='ffn': a skipped pair still runs attention over its keys and reads attention weights."""
    model = _tiny_fbs()
    counter = FlopCounter(model)
    c = counter.cost
    ex = torch.ones(1, 1, 4, dtype=torch.bool)
    ex[0, 0, 1] = False  # layer 1's FFN skipped for the one decoded token at position 5 (6 keys)
    tr = _trace(ex, torch.ones_like(ex), torch.tensor([[5]]), torch.ones(1, 1, dtype=torch.bool), granularity="ffn")
    paper, exact = counter.relative(tr)
    assert paper == pytest.approx((3 + 12288 / 36864) / 4)
    base = 4 * (36864 + 6 * 128) + 16384
    assert exact == pytest.approx((3 * (36864 + 6 * 128) + 12288 + 6 * 128 + 16384) / base)
    # attention weights: matrices 12,288, channels q 64 + k 32 + v 32 + o 64 = 192, the input norm 64
    attn = 12288 * 4 + 64 * 4
    assert c.attn_bytes("fp32") == attn and c.attn_bytes("int8") == 12288 + 192 * 2 + 64 * 4
    read = 3 * 147968 + attn + 65792 + 4 * 6 * 256
    assert counter.bytes_relative(tr) == pytest.approx(read / (4 * 147968 + 65792 + 4 * 6 * 256))
