"""The tau sweep: decode-faithful NLL against a hand computation, skip accounting, the random / static / oracle
plans, operating-point choice, tau calibration, writing tau into a checkpoint, Pareto plots, the OOD blocks."""

from __future__ import annotations

import json

import pytest
import torch

from fbs.eval.ood import build_blocks, fill_blocks
from fbs.eval.plots import pareto_plots
from fbs.eval.sweep import (HeldoutDoc, PairSaving, calibrate_tau, heldout_documents, oracle_plans, random_plans,
                            run_sweep, score, select_operating_point, static_plans, write_tau)

from conftest import fbs_tiny, randomize, tiny_hf

pytestmark = pytest.mark.usefixtures("one_thread")


def _docs(n=5, t=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = [t, t, t - 3, t, t - 3][:n]
    return [HeldoutDoc(f"d{i}", "en" if i % 2 else "zh", torch.randint(0, 200, (L,), generator=g))
            for i, L in enumerate(lens)]


def test_nll_is_that_of_the_tokens_after_the_prompt():
    model = fbs_tiny()
    hf = tiny_hf()
    docs = _docs()
    for gate_from in (1, 4):
        s = score(model, docs, tau=None, name="off", batch_size=2, gate_from=gate_from)
        for d, nll in zip(docs, s.nll):
            with torch.no_grad():
                logits = hf(d.input_ids[None]).logits[0, gate_from - 1:-1]
            want = torch.nn.functional.cross_entropy(logits, d.input_ids[gate_from:]).item()
            assert abs(nll - want) < 1e-5
        assert s.skip_ratio == 0.0 and s.kind == "full"


def test_skip_count_is_every_gated_pair_of_the_decoded_positions():
    # gates with a large positive bias: p ~ 1 > tau everywhere, so exactly the gated layers are skipped
    model = randomize(fbs_tiny(), gate_bias=30.0)
    docs = _docs()
    gated, L = len(model.layers_cfg.gated), model.num_layers
    for gate_from in (1, 3):
        s = score(model, docs, tau=0.5, name="all", batch_size=3, gate_from=gate_from)
        # decoded positions gate_from .. T-2 (the last token's layers decide no scored prediction)
        assert s.pairs == [(len(d.input_ids) - 1 - gate_from) * L for d in docs]
        assert s.skipped == [(len(d.input_ids) - 1 - gate_from) * gated for d in docs]
        assert s.skip_ratio == gated / L
    with pytest.raises(ValueError, match="shorter than gate_from"):
        score(model, docs, tau=0.5, gate_from=10)


def test_baseline_plans_match_the_gates_count():
    model = randomize(fbs_tiny(), gate_bias=0.0)
    docs = _docs()
    gate_from = 2
    rels: list = []
    score(model, docs, tau=None, gate_from=gate_from, relative_updates=rels)
    assert [tuple(u.shape) for u in rels] == [(len(d.input_ids), model.num_layers) for d in docs]
    counts = score(model, docs, tau=0.5, gate_from=gate_from).skipped
    assert sum(counts) > 0
    gated = list(model.layers_cfg.gated)
    for plans in (random_plans(model, docs, counts, gate_from, seed=1),
                  oracle_plans(model, docs, counts, rels, gate_from)):
        assert [int(p.sum()) for p in plans] == counts
        for p, d in zip(plans, docs):
            allowed = torch.zeros_like(p)
            allowed[gate_from:len(d.input_ids) - 1, gated] = True
            assert not (p & ~allowed).any()
        s = score(model, docs, plans=plans, gate_from=gate_from, kind="x")
        assert s.skipped == counts
    # the oracle takes the smallest relative updates of the window
    p, u, d = oracle_plans(model, docs, counts, rels, gate_from)[0], rels[0], docs[0]
    win = torch.zeros_like(p)
    win[gate_from:len(d.input_ids) - 1, gated] = True
    if counts[0]:
        assert u[p].max() <= u[win & ~p].min()
    # static: the same layers at every position of a block, pooled count as close as one block allows
    plans, order = static_plans(model, docs, sum(counts), rels, gate_from)
    assert sorted(order) == gated
    for p, d in zip(plans, docs):
        rows = p[gate_from:len(d.input_ids) - 1]
        assert (rows == rows[0]).all()
        assert set(torch.nonzero(rows[0]).flatten().tolist()) == set(order[:int(rows[0].sum())])
    total = sum(int(p.sum()) for p in plans)
    assert abs(total - sum(counts)) <= max(len(d.input_ids) for d in docs) / 2


def test_operating_point_is_the_cheapest_tau_within_tolerance():
    rows = [{"tau": None, "ppl": 10.0, "tflops_rel": 1.0},
            {"tau": 0.9, "ppl": 10.1, "tflops_rel": 0.95},
            {"tau": 0.8, "ppl": 10.19, "tflops_rel": 0.90},
            {"tau": 0.8, "ppl": 10.0, "tflops_rel": 0.50, "kind": "oracle"},
            {"tau": 0.7, "ppl": 10.3, "tflops_rel": 0.80}]
    assert select_operating_point(rows, base_ppl=10.0, tolerance=0.02)["tau"] == 0.8
    assert select_operating_point(rows, base_ppl=10.0, tolerance=0.02)["tflops_rel"] == 0.90
    assert select_operating_point(rows, base_ppl=10.0, tolerance=0.0) is None


def test_sweep_rows_baselines_and_plot(tmp_path):
    model = randomize(fbs_tiny(), gate_bias=0.0)
    base, control = fbs_tiny(), randomize(fbs_tiny(), seed=4)
    res = run_sweep(model, base, _docs(), taus=[0.99, 0.5, 0.0], progress=False, gate_from=2, control=control,
                    matched_taus=[0.5])
    kinds = [r["kind"] for r in res["rows"]]
    assert kinds == ["base", "control", "full", "tau", "tau", "tau", "random", "static", "oracle"]
    rows = {(r["kind"], r["tau"]): r for r in res["rows"]}
    assert rows[("base", None)]["vs_base"]["delta"] == 0.0
    assert rows[("tau", 0.99)]["skip_ratio"] <= rows[("tau", 0.5)]["skip_ratio"] <= rows[("tau", 0.0)]["skip_ratio"]
    assert rows[("random", 0.5)]["skip_ratio"] == rows[("tau", 0.5)]["skip_ratio"]
    assert rows[("oracle", 0.5)]["skip_ratio"] == rows[("tau", 0.5)]["skip_ratio"]
    assert abs(rows[("static", 0.5)]["skip_ratio"] - rows[("tau", 0.5)]["skip_ratio"]) < 0.1
    assert set(rows[("tau", 0.5)]["per_lang_skip"]) == {"en", "zh"}
    with pytest.raises(ValueError, match="matched taus"):
        run_sweep(model, base, _docs(), taus=[0.9], progress=False, gate_from=2, matched_taus=[0.5])
    json.dumps(res)  # serializable
    paths = pareto_plots([("new", {"texts": {"in": res}}), ("old", {"texts": {"in": res}})], tmp_path / "p")
    assert [p.name for p in paths] == ["p_in.png"] and paths[0].stat().st_size > 1000
    paths = pareto_plots([("new", {"texts": {"in": res}})], tmp_path / "p", x="bytes")
    assert [p.name for p in paths] == ["p_in_bytes.png"]
    old = {"rows": [{k: v for k, v in r.items() if k != "bytes_rel"} for r in res["rows"]]}
    with pytest.raises(ValueError, match="rerun"):
        pareto_plots([("old", {"texts": {"in": old}})], tmp_path / "q", x="bytes")


def _numel(*mods) -> int:
    return sum(p.numel() for m in mods for p in m.parameters())


@pytest.mark.parametrize("granularity", ["layer", "ffn"])
def test_pair_saving_from_the_modules_parameter_counts(granularity):
    """Bytes(rel) and TFLOPs(rel) per skipped pair against the tiny model's own parameter counts (fp32: 4 bytes each):
    a skipped layer keeps its input norm and K/V projections (``project``), a skipped FFN keeps the attention."""
    model = fbs_tiny(skip_granularity=granularity)
    hf = model.base.hf
    layers, n_layers = hf.model.layers, len(hf.model.layers)
    layer = _numel(layers[0].self_attn, layers[0].mlp, layers[0].input_layernorm, layers[0].post_attention_layernorm)
    attn = _numel(layers[0].self_attn, layers[0].input_layernorm)
    kv = _numel(layers[0].self_attn.k_proj, layers[0].self_attn.v_proj, layers[0].input_layernorm)
    full = n_layers * layer + _numel(hf.model.norm) + hf.lm_head.weight.numel()
    kept = attn if granularity == "ffn" else kv
    s = PairSaving.of(model)
    assert s.bytes == pytest.approx(n_layers * (layer - kept) / full, rel=1e-9)
    mlp = _numel(layers[0].mlp)
    want_macs = mlp / (mlp + _numel(layers[0].self_attn)) if granularity == "ffn" else 1.0
    assert s.macs == pytest.approx(want_macs, rel=1e-9)
    res = run_sweep(randomize(model, gate_bias=0.0), fbs_tiny(), _docs(), taus=[0.5], progress=False, gate_from=2)
    row = res["rows"][-1]
    assert row["skip_ratio"] > 0
    assert row["bytes_rel"] == pytest.approx(1 - s.bytes * row["skip_ratio"])
    assert row["tflops_rel"] == pytest.approx(1 - s.macs * row["skip_ratio"])
    assert res["rows"][0]["bytes_rel"] == 1.0


def test_calibrated_tau_hits_the_target_skip_ratio():
    model = randomize(fbs_tiny(), gate_bias=0.0)
    g = torch.Generator().manual_seed(3)
    docs = [HeldoutDoc(f"d{i}", "en", torch.randint(0, 200, (40,), generator=g)) for i in range(6)]
    for target in (0.1, 0.3):
        res = calibrate_tau(model, docs, target, gate_from=4, batch_size=3)
        assert abs(res["skip_ratio"] - target) <= 0.01
        again = score(model, docs, tau=res["tau"], gate_from=4).skip_ratio
        assert again == res["skip_ratio"] and 0.0 < res["tau"] < 1.0
    with pytest.raises(ValueError, match="cannot reach"):
        calibrate_tau(model, docs, 0.9, gate_from=4)  # only 4 of 6 layers are gated


def test_calibration_command_writes_the_tau_into_the_checkpoint(tmp_path, capsys):
    from argparse import Namespace

    from fbs.eval.cli import _calibrate

    model = randomize(fbs_tiny(), gate_bias=0.0)
    model.save_pretrained(tmp_path / "ckpt")
    g = torch.Generator().manual_seed(3)
    docs = [HeldoutDoc(f"d{i}", "en", torch.randint(0, 200, (40,), generator=g)) for i in range(6)]
    args = Namespace(target_skip=0.2, gate_from=4, batch_size=3, calib_tol=0.002, checkpoint=None,
                     out=str(tmp_path / "calib.json"), write_tau=str(tmp_path / "ckpt"))
    assert _calibrate(args, model, {"ood": docs}) == 0
    res = json.loads((tmp_path / "calib.json").read_text())
    cfg = json.loads((tmp_path / "ckpt" / "fbs_config.json").read_text())
    assert cfg["tau"] == res["tau"] and abs(res["skip_ratio"] - 0.2) <= 0.01
    assert cfg["extra"]["tau_calibration"]["text"] == "ood" and cfg["extra"]["tau_calibration"]["gate_from"] == 4
    assert f"tau={res['tau']:.6f}" in capsys.readouterr().out


def test_write_tau_into_a_checkpoint(tmp_path):
    from fbs import FBSForCausalLM

    model = fbs_tiny()
    model.save_pretrained(tmp_path / "ckpt")
    write_tau(tmp_path / "ckpt", 0.4242, {"target": 0.3, "skip_ratio": 0.301})
    cfg = json.loads((tmp_path / "ckpt" / "fbs_config.json").read_text())
    assert cfg["tau"] == 0.4242 and cfg["extra"]["tau_calibration"]["target"] == 0.3
    assert FBSForCausalLM.from_pretrained(tmp_path / "ckpt", base=tiny_hf()).config.tau == 0.4242
    with pytest.raises(FileNotFoundError, match="is not an FBS checkpoint \\(no fbs_config.json\\)"):
        write_tau(tmp_path, 0.5, {})


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
    assert all(len(d.input_ids) >= 10 for d in heldout_documents(tmp_path, tok, per_lang=6, max_tokens=20,
                                                                 min_tokens=10))


def test_ood_blocks_are_seeded_fixed_size_and_start_at_documents():
    def tokenize(text):
        return [len(w) for w in text.split()]

    docs = [(f"s/{i}", " ".join(["w" * (1 + i % 5)] * (3 + i % 7))) for i in range(40)]
    a = fill_blocks(iter(docs), tokenize, 4, 16, seed=0, source="s")
    assert a == fill_blocks(iter(docs[::-1]), tokenize, 4, 16, seed=0, source="s")  # order-independent input
    assert a != fill_blocks(iter(docs), tokenize, 4, 16, seed=1, source="s")
    texts = dict(docs)
    for names, ids in a:
        assert len(ids) == 16
        assert ids[:len(tokenize(texts[names[0]]))] == tokenize(texts[names[0]])[:16]
    with pytest.raises(ValueError, match="only"):
        fill_blocks(iter(docs[:3]), tokenize, 4, 16, seed=0, source="s")

    class Tok:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": tokenize(text)}

    sources = {"en": [("a", lambda: iter(docs)), ("b", lambda: iter(docs[5:]))], "code": [("c", lambda: iter(docs))]}
    blocks = build_blocks(Tok(), per_kind=3, block_tokens=16, sources=sources)
    assert [b["id"] for b in blocks] == ["ood-en/a/0", "ood-en/b/0", "ood-en/a/1", "ood-code/c/0", "ood-code/c/1",
                                         "ood-code/c/2"]
