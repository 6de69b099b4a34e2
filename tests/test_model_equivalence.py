"""With gates forced to compute and fresh (zero-contribution) modules, FBS computes the base model."""

import pytest
import torch

from conftest import fbs_tiny, randomize, tiny_hf, tiny_config
from fbs import FBSForCausalLM


def test_parallel_logits_equal_hf(family):
    hf = tiny_hf(family)
    model = FBSForCausalLM.from_base(hf, config=tiny_config()).eval()
    ids = torch.randint(0, 256, (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
        out = model(ids, gate_mode="off")
        thr = model(ids)  # fresh gates: p = 0.018 < tau, nothing skipped
    assert (out.logits - ref).abs().max() < 1e-4
    assert (thr.logits - ref).abs().max() < 1e-4
    assert thr.skips.sum() == 0


def test_padded_batch_matches_hf(family):
    hf = tiny_hf(family)
    model = FBSForCausalLM.from_base(hf, config=tiny_config()).eval()
    ids = torch.randint(1, 255, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    with torch.no_grad():
        ref = hf(ids[1:, 4:]).logits
        out = model(ids, attention_mask=mask, gate_mode="off").logits
    assert (out[1, 4:] - ref[0]).abs().max() < 1e-4


def test_cached_decoding_logits_and_greedy_tokens_equal_hf(family):
    hf = tiny_hf(family)
    model = FBSForCausalLM.from_base(hf, config=tiny_config()).eval()
    ids = torch.randint(0, 255, (1, 10), generator=torch.Generator().manual_seed(2))
    res = model.generate(ids, max_new_tokens=32, ignore_eos=True, output_scores=True)
    ref = hf.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False, attention_mask=torch.ones_like(ids))
    assert res.sequences.tolist() == ref.tolist()
    with torch.no_grad():
        full = hf(res.sequences).logits[0, ids.shape[1] - 1:-1]  # logits that chose each new token
    assert (res.scores[0] - full).abs().max() < 1e-4
    assert res.trace.skip_ratio == 0.0 and res.trace.tflops_rel == 1.0


def test_randomized_modules_change_outputs_but_gate_off_keeps_attention_path():
    # sanity for the tests above: non-zero modules do change the logits (the equivalence is not vacuous)
    model = randomize(fbs_tiny())
    hf = model.base.hf
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (model(ids, gate_mode="off").logits - hf(ids).logits).abs().max() > 1e-3


def test_rope_rows_of_the_table_equal_the_rotary_modules_own_call(family):
    """BaseDecoder.rope reads rows of one table of the HF rotary module's values: for scattered positions (B, T), one
    position alone, and positions past the table's first size (it grows), the bits of the module's call on exactly
    those positions."""
    base = FBSForCausalLM.from_base(tiny_hf(family, 4, 0), config=tiny_config()).base
    x = torch.randn(3, 4, base.spec.hidden_size)
    g = torch.Generator().manual_seed(3)
    for positions in (torch.randint(0, 900, (3, 4), generator=g), torch.tensor([[17]]),
                      torch.randint(1000, 5000, (3, 4), generator=g), torch.arange(4).view(1, 4)):
        cos, sin = base.rope(x[:positions.shape[0], :positions.shape[1]], positions)
        ref_cos, ref_sin = base.rotary(x[:positions.shape[0], :positions.shape[1]], positions)
        assert cos.shape == ref_cos.shape and torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    assert base._rope_table[0].shape[0] > 1024  # it grew past its first size
