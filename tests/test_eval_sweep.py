"""The tau sweep: per-document NLL against a hand computation, skip accounting, operating-point choice."""

from __future__ import annotations

import json

import torch

from fbs.eval.sweep import HeldoutDoc, heldout_documents, run_sweep, score, select_operating_point

from conftest import fbs_tiny, randomize, tiny_hf


def _docs(n=5, t=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = [t, t, t - 3, t, t - 3][:n]
    return [HeldoutDoc(f"d{i}", "en" if i % 2 else "zh", torch.randint(0, 200, (L,), generator=g))
            for i, L in enumerate(lens)]


def test_nll_matches_the_hf_model_document_by_document(one_thread):
    model = fbs_tiny()
    hf = tiny_hf()
    docs = _docs()
    s = score(model, docs, tau=None, name="off", batch_size=2)
    for d, nll in zip(docs, s.nll):
        logits = hf(d.input_ids[None]).logits[0, :-1]
        want = torch.nn.functional.cross_entropy(logits, d.input_ids[1:]).item()
        assert abs(nll - want) < 1e-5
    assert s.skip_ratio == 0.0


def test_skip_count_is_every_gated_pair_after_gate_from(one_thread):
    # gates with a large positive bias: p ~ 1 > tau everywhere, so exactly the gated layers are skipped
    model = randomize(fbs_tiny(), gate_bias=30.0)
    docs = _docs()
    gated = len(model.layers_cfg.gated)
    s = score(model, docs, tau=0.5, name="all", batch_size=3, gate_from=0)
    assert s.skip_ratio == gated / model.num_layers
    assert s.pairs == [len(d.input_ids) * model.num_layers for d in docs]
    # from position 2 on: the first two tokens of every document keep all their layers
    s2 = score(model, docs, tau=0.5, name="all", batch_size=3, gate_from=2)
    assert s2.skipped == [(len(d.input_ids) - 2) * gated for d in docs]


def test_operating_point_is_the_cheapest_tau_within_tolerance():
    rows = [{"tau": None, "ppl": 10.0, "tflops_rel": 1.0},
            {"tau": 0.9, "ppl": 10.1, "tflops_rel": 0.95},
            {"tau": 0.8, "ppl": 10.19, "tflops_rel": 0.90},
            {"tau": 0.7, "ppl": 10.3, "tflops_rel": 0.80}]
    assert select_operating_point(rows, base_ppl=10.0, tolerance=0.02)["tau"] == 0.8
    assert select_operating_point(rows, base_ppl=10.0, tolerance=0.0) is None


def test_sweep_rows_and_base_comparison(one_thread):
    model = randomize(fbs_tiny(), gate_bias=0.0)
    base = fbs_tiny()
    res = run_sweep(model, base, _docs(), taus=[0.99, 0.0], progress=False)
    rows = {(r["system"], r["tau"]): r for r in res["rows"]}
    assert rows[("base", None)]["vs_base"]["delta"] == 0.0
    assert rows[("fbs", 0.99)]["skip_ratio"] <= rows[("fbs", 0.0)]["skip_ratio"]
    json.dumps(res)  # serializable


def test_heldout_documents_sample_is_seeded_and_per_language(tmp_path):
    recs = [{"id": f"{lang}/{i}", "lang": lang, "text": "a b c d e " * (i + 1)} for lang in ("en", "zh")
            for i in range(6)]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))

    def tok(text, add_special_tokens=False):
        return {"input_ids": [len(w) for w in text.split()]}

    a = heldout_documents(tmp_path, tok, per_lang=3, max_tokens=7, seed=1)
    b = heldout_documents(tmp_path, tok, per_lang=3, max_tokens=7, seed=1)
    assert [d.id for d in a] == [d.id for d in b]
    assert sorted(d.lang for d in a) == ["en"] * 3 + ["zh"] * 3
    assert all(len(d.input_ids) <= 7 for d in a)
