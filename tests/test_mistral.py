"""The Mistral family (declared supported): FBS computes HF's Mistral, and sliding-window checkpoints, which FBS
cannot compute, are refused with an error that names the fix.

Oracle: HF's ``MistralForCausalLM`` (logits of the parallel forward, greedy ``generate`` and its logits).
"""

from __future__ import annotations

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from conftest import VOCAB, randomize, tiny_config
from fbs import FBSForCausalLM, UnsupportedArchitectureError

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_mistral(seed: int = 0, **kw) -> MistralForCausalLM:
    torch.manual_seed(seed)
    cfg = dict(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=128, tie_word_embeddings=False,
               eos_token_id=VOCAB - 1, bos_token_id=0, pad_token_id=0, sliding_window=None)
    return MistralForCausalLM(MistralConfig(**(cfg | kw))).eval()


# head_dim 32 with 4 heads over d = 64: the attention's width (128) is not the hidden size (as in Mistral-Nemo)
@pytest.mark.parametrize("extra", [{}, {"head_dim": 32}], ids=["default", "head_dim32"])
def test_fresh_fbs_mistral_equals_hf(extra):
    """Fresh modules (no contribution, gates that never skip): the parallel forward's logits, the greedy tokens
    and each step's logits under the fused fp32 and the HF-module decode weights equal HF's."""
    hf = tiny_mistral(**extra)
    model = FBSForCausalLM.from_base(hf, config=tiny_config()).eval()
    assert model.base.spec.model_type == "mistral" and model.base.spec.head_dim == extra.get("head_dim", 16)
    ids = torch.randint(0, VOCAB, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model(ids, gate_mode="off").logits - hf(ids).logits).abs().max() < 1e-4
    prompt = ids[:1, :9]
    ref = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20, min_new_tokens=20,
                      do_sample=False)
    with torch.no_grad():
        ref_logits = hf(ref).logits[0, prompt.shape[1] - 1:-1]
    for weights in ("hf", "fp32"):
        res = model.generate(prompt, max_new_tokens=20, ignore_eos=True, output_scores=True, weights=weights)
        assert res.sequences.tolist() == ref.tolist(), weights
        assert (res.scores[0] - ref_logits).abs().max() < 1e-4, weights
        assert res.trace.skip_ratio == 0.0


def test_trained_modules_change_mistral_and_gated_decoding_runs():
    """Non-zero modules change the logits (the equivalence above is not vacuous) and the gates skip layers;
    decoding with the fused weights gives the HF-module path's tokens and skips."""
    model = randomize(FBSForCausalLM.from_base(tiny_mistral(), config=tiny_config()).eval(), seed=2)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (model(ids, gate_mode="off").logits - model.base.hf(ids).logits).abs().max() > 1e-3
    kw = dict(max_new_tokens=16, ignore_eos=True, output_scores=True)
    ref, out = model.generate(ids, weights="hf", **kw), model.generate(ids, weights="fp32", **kw)
    assert 0 < ref.trace.skip_ratio < 1
    assert out.new_tokens == ref.new_tokens and torch.equal(out.trace.executed, ref.trace.executed)
    assert (out.scores[0] - ref.scores[0]).abs().max() < 1e-4


MISTRAL_FIX = r"load a checkpoint with a Mistral config without sliding_window \(null, or at least max_position_embeddings\)"


@pytest.mark.parametrize("extra", [{}, {"use_sliding_window": False}], ids=["plain", "use_sliding_window_false"])
def test_mistral_sliding_window_is_refused(extra):
    """HF's Mistral attends within ``sliding_window`` whenever it is below the context, whatever
    ``use_sliding_window`` says: FBS (full causal attention) refuses such a checkpoint and names the fix."""
    hf = tiny_mistral(sliding_window=16, **extra)
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():  # the window changes what HF computes: accepting it would compute another model
        full = tiny_mistral()(ids).logits
        assert (hf(ids).logits - full).abs().max() > 1e-3
    with pytest.raises(UnsupportedArchitectureError,
                       match=r"mistral checkpoint uses sliding-window attention \(window 16\); FBS supports full "
                             r"causal attention only — " + MISTRAL_FIX):
        FBSForCausalLM.from_base(hf, config=tiny_config())


def test_mistral_window_as_long_as_the_context_is_accepted_and_equals_hf():
    hf = tiny_mistral(sliding_window=128)  # = max_position_embeddings: the window never cuts anything
    model = FBSForCausalLM.from_base(hf, config=tiny_config()).eval()
    ids = torch.randint(0, VOCAB, (1, 50), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert (model(ids, gate_mode="off").logits - hf(ids).logits).abs().max() < 1e-4


def test_qwen2_sliding_layers_are_refused():
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=128, use_sliding_window=True,
                      sliding_window=16, max_window_layers=2)
    assert "sliding_attention" in cfg.layer_types
    with pytest.raises(UnsupportedArchitectureError,
                       match=r"qwen2 checkpoint uses sliding-window attention \(window 16\); .* load a checkpoint "
                             r"with use_sliding_window=False and only full_attention layer_types"):
        FBSForCausalLM.from_base(Qwen2ForCausalLM(cfg).eval(), config=tiny_config(k_max=6))
