"""`fbs eval mechanism` (appendix G statistics): rank correlations, odds ratios and boundary-offset rates against
hand-computed cases, the bootstrap's unit (examples, not tokens), token classes and spans, the residual-energy
proxy against the HF model's own hidden states, and the command end to end on a tiny random model."""

import json

import numpy as np
import pytest
import torch

from fbs.cli import main
from fbs.data.bios import IdiomLexicon
from fbs.data.chat import ChatItem, write_items
from fbs.eval import mechanism as mech
from fbs.eval.mechanism import (CLASSES, boundary_offsets, classify_token, correlation_test, idiom_flags,
                                kendall_tau_b, multiplicities, odds_ratio, odds_ratio_test, spearman,
                                teacher_forced_updates, token_spans)

from conftest import fbs_tiny, randomize
from test_eval_chat import ChatByteTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------- rank correlations by hand
def test_spearman_and_kendall_hand_computed():
    # no ties: d = rank differences [0, 1, 1, 0], rho = 1 - 6 * 2 / (4 * 15) = 0.8
    # pairs: (2,3) discordant, the other 5 concordant: tau = (5 - 1) / 6
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    assert kendall_tau_b([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)
    # ties in x: ranks x = [1.5, 1.5, 3.5, 3.5], y = [1, 2, 3, 4]; Pearson = 4 / sqrt(4 * 5)
    assert spearman([1, 1, 2, 2], [1, 2, 3, 4]) == pytest.approx(4 / np.sqrt(20))
    # tau-b: 4 concordant, 0 discordant, n0 = 6, n1 = 2 (x ties), n2 = 0: 4 / sqrt(4 * 6)
    assert kendall_tau_b([1, 1, 2, 2], [1, 2, 3, 4]) == pytest.approx(4 / np.sqrt(24))
    assert kendall_tau_b([1, 2, 3, 4], [1, 1, 2, 2]) == pytest.approx(4 / np.sqrt(24))  # symmetric
    assert spearman([3, 2, 1], [1, 2, 3]) == pytest.approx(-1.0) and kendall_tau_b([3, 2, 1], [1, 2, 3]) == -1.0
    assert np.isnan(spearman([5, 5, 5], [1, 2, 3])) and np.isnan(kendall_tau_b([1, 2, 3], [4, 4, 4]))
    t = correlation_test([2, 2, 2, 2], [1, 2, 3, 4], [0, 0, 1, 1], n_resamples=10)
    assert t["value"] is None and t["status"] == "constant" and t["constant"] == "x"


def test_weights_equal_the_expanded_sample_and_scipy():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 5, 40).astype(float)            # few levels, like k(i)
    y = np.round(rng.normal(size=40), 1)                # ties in y too
    w = rng.integers(0, 4, 40)
    xe, ye = np.repeat(x, w), np.repeat(y, w)
    assert spearman(x, y, w) == pytest.approx(spearman(xe, ye), abs=1e-12)
    assert kendall_tau_b(x, y, w) == pytest.approx(kendall_tau_b(xe, ye), abs=1e-12)
    stats = pytest.importorskip("scipy.stats")
    for a, b in ((x, y), (xe, ye), (y, x + 0.5 * y)):
        assert spearman(a, b) == pytest.approx(stats.spearmanr(a, b).statistic, abs=1e-12)
        assert kendall_tau_b(a, b) == pytest.approx(stats.kendalltau(a, b, variant="b").statistic, abs=1e-12)


def test_bootstrap_resamples_examples_not_tokens():
    """Example 0 (60 tokens, x = y) carries all the correlation; nine examples of 6 noise tokens do not. Dropping
    example 0 from a resample (p = 0.9^10 = 35%) kills the correlation, so the CI over examples is wide; the same
    tokens bootstrapped one by one give a narrow CI."""
    rng = np.random.default_rng(1)
    x = [np.arange(60.0)] + [rng.normal(size=6) for _ in range(9)]
    y = [np.arange(60.0)] + [rng.normal(size=6) for _ in range(9)]
    ex = np.concatenate([np.full(len(v), i) for i, v in enumerate(x)])
    x, y = np.concatenate(x), np.concatenate(y)
    by_example = correlation_test(x, y, ex, n_resamples=400, seed=0)
    by_token = correlation_test(x, y, np.arange(len(x)), n_resamples=400, seed=0)
    assert by_example["value"] == by_token["value"] > 0.5
    assert by_example["n_examples"] == 10 and by_token["n_examples"] == len(x)
    assert by_example["ci"][0] < 0.3 < by_token["ci"][0]
    width = lambda t: t["ci"][1] - t["ci"][0]  # noqa: E731
    assert width(by_example) > 3 * width(by_token)
    # multiplicities: each resample draws E examples
    m = multiplicities(ex, 50, seed=0)
    assert m.shape == (50, 10) and (m.sum(axis=1) == 10).all()


# ---------------------------------------------------------------------------- odds ratios and boundary offsets
def test_odds_ratio_hand_computed():
    # [[20, 80], [10, 90]]: OR = 20*90 / (80*10) = 2.25; se = sqrt(1/20 + 1/80 + 1/10 + 1/90) = 0.416667
    r = odds_ratio(20, 80, 10, 90)
    assert r["odds_ratio"] == pytest.approx(2.25)
    assert r["ci_woolf"] == pytest.approx([2.25 * np.exp(-1.959964 * 0.4166667), 2.25 * np.exp(1.959964 * 0.4166667)],
                                          rel=1e-6)
    assert r["ci_woolf"] == pytest.approx([0.99429, 5.09155], abs=1e-4)
    assert r["p_woolf"] == pytest.approx(0.05163, abs=1e-4) and not r["haldane"]
    h = odds_ratio(0, 10, 5, 5)  # a zero cell: 0.5 added everywhere: 0.5 * 5.5 / (10.5 * 5.5)
    assert h["haldane"] and h["odds_ratio"] == pytest.approx(0.5 / 10.5)


def test_odds_ratio_test_pools_pairs_per_example():
    # two layers counted, one not; tokens with the property: 3 of 5; build the table by hand
    skipped = np.array([[1, 1, 1], [1, 0, 1], [0, 0, 0], [1, 0, 0], [0, 0, 1]], bool)
    pairs = np.broadcast_to(np.array([True, True, False]), skipped.shape)
    prop = np.array([1, 1, 0, 1, 0], bool)
    ex = np.array([0, 0, 1, 1, 2])
    r = odds_ratio_test(prop, skipped, pairs, ex, n_resamples=200, seed=0)
    # property: skipped pairs 2 + 1 + 1 = 4 of 6; others: 0 + 0 = 0 of 4
    assert r["table"] == [[4, 2], [0, 4]] and r["skip_rate"] == pytest.approx(4 / 6) and r["skip_rate_other"] == 0
    assert r["odds_ratio"] == pytest.approx(4.5 * 4.5 / (2.5 * 0.5)) and r["haldane"]
    assert r["ci_method"] == "bootstrap over examples" and r["ci"][0] <= r["odds_ratio"] <= r["ci"][1]


def test_boundary_offsets_hand_built():
    # two examples; skipped pairs over the 2 counted layers (the third column is not counted)
    example = np.array([0, 0, 0, 0, 0, 0, 1, 1, 1])
    position = np.array([0, 1, 2, 3, 4, 5, 0, 1, 2])
    boundary = np.array([0, 0, 1, 0, 0, -1, 1, 0, 0])
    skipped = np.array([[1, 0, 1], [1, 1, 1], [0, 0, 1], [0, 1, 0], [1, 1, 0], [0, 0, 0],
                        [0, 0, 1], [1, 1, 1], [1, 0, 1]], bool)
    pairs = np.broadcast_to(np.array([True, True, False]), skipped.shape)
    m = multiplicities(example, 100, seed=0)
    rows = {r["offset"]: r for r in boundary_offsets(example, position, boundary, skipped, pairs, m)}
    # boundaries: token 2 (example 0), token 6 (example 1, position 0: nothing before it)
    assert rows[0]["tokens"] == 2 and rows[0]["skipped"] == 0 and rows[0]["skip_rate"] == 0.0
    assert rows[-1]["tokens"] == 1 and rows[-1]["skipped"] == 2 and rows[-1]["skip_rate"] == 1.0   # token 1
    assert rows[-2]["tokens"] == 1 and rows[-2]["skipped"] == 1 and rows[-2]["skip_rate"] == 0.5   # token 0
    assert rows[1]["tokens"] == 2 and rows[1]["skipped"] == 1 + 2 and rows[1]["skip_rate"] == 0.75  # tokens 3, 7
    assert rows[2]["tokens"] == 2 and rows[2]["skip_rate"] == pytest.approx(3 / 4)                  # tokens 4, 8
    assert rows[3]["tokens"] == 1 and rows[3]["skip_rate"] == 0.0   # token 5; example 1 has no position 3
    assert rows[1]["ci"][0] <= 0.75 <= rows[1]["ci"][1]


def test_constant_k_and_missing_ch_are_reported_not_nan():
    n, n_layers = 12, 4
    rng = np.random.default_rng(2)
    t = mech.TokenTable(example=np.repeat([0, 1, 2], 4), position=np.tile(np.arange(4), 3), k=np.full(n, 3),
                        surprisal=rng.random(n), entropy=rng.random(n), entropy_next=rng.random(n),
                        cls=np.zeros(n, int), idiom=np.zeros(n, bool), boundary=np.full(n, -1),
                        executed=rng.random((n, n_layers)) < 0.5, gate_p=rng.random((n, n_layers)),
                        rel_update=rng.random((n, n_layers)), langs=["en"] * 3, gated=(1, 2))
    res = mech._clean(mech.analyse(t, n_resamples=20))
    ku = res["k_uncertainty"]
    assert ku["status"] == "constant" and "constant (= 3)" in ku["note"] and ku["tests"] == []
    assert res["boundaries"]["status"] == "no CH layer"
    assert res["counts"]["tokens"] == n and res["counts"]["gated_pairs"] == 2 * n
    assert [r["skipped"] for r in res["layers"]] == (~t.executed).sum(axis=0).tolist()
    assert "constant (= 3)" in mech.markdown(res | {"config": {"tau": 0.5, "n_resamples": 20}})
    json.dumps(res, allow_nan=False)  # every NaN became null


# ---------------------------------------------------------------------------- token properties
def test_classify_token():
    cases = {" the": "function_word", "The": "function_word", "的": "function_word", "但是": "function_word",
             ",": "punctuation", " (": "punctuation", ".\n": "punctuation", "，": "punctuation", "==": "punctuation",
             "。": "punctuation", "42": "digit", " 7": "digit", "def": "code_keyword", " return": "code_keyword",
             "None": "code_keyword", "none": "other", " if": "function_word", "\n": "whitespace",
             "  \n\t": "whitespace", "cat": "other", "猫": "other", "x1": "other", "": "other", "'s": "other"}
    assert {t: classify_token(t) for t in cases} == cases
    assert set(cases.values()) == set(CLASSES)


class Utf8Bytes:
    """One token per UTF-8 byte: a Chinese character spans three tokens, incomplete prefixes decode to U+FFFD."""

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_token_spans_and_idiom_flags():
    tok = Utf8Bytes()
    ids = tok.encode("他一帆风顺, ok")
    text, spans = token_spans(tok, ids)
    assert text == "他一帆风顺, ok"
    # the three bytes of each character share its span
    assert spans[:6] == [(0, 1)] * 3 + [(1, 2)] * 3 and spans[15:] == [(5, 6), (6, 7), (7, 8), (8, 9)]
    flags = idiom_flags(text, spans, IdiomLexicon(["一帆风顺", "风顺了吧"]))
    assert flags == [False] * 3 + [True] * 12 + [False] * 4
    assert [classify_token(text[a:b]) for a, b in spans][15:] == ["punctuation", "whitespace", "other", "other"]


def test_relative_update_is_the_base_models_hidden_state_change():
    """A fresh FBS (PAW/CH at zero) at full depth is its base model: the proxy from HF's own hidden states."""
    model = fbs_tiny(seed=4)
    prompt, answer = [3, 4, 5, 6, 7], [9, 10, 11]
    got = teacher_forced_updates(model, prompt, answer)
    with torch.no_grad():
        hs = model.base.hf(torch.tensor([prompt + answer]), output_hidden_states=True).hidden_states
    p, n_layers = len(prompt), model.num_layers
    for layer in range(n_layers - 1):  # HF's last hidden state is after the final norm
        a, b = hs[layer][0, p:], hs[layer + 1][0, p:]
        want = (b - a).norm(dim=-1) / a.norm(dim=-1)
        assert torch.allclose(got[:, layer], want, rtol=1e-4, atol=1e-6)
    assert got.shape == (len(answer), n_layers)


# ---------------------------------------------------------------------------- the command end to end
WORDS = ["the", " ", ",", "7", "def", "cat", "\n", "。", "的", "一", "帆", "风", "顺"]


class WordTokenizer(ChatByteTokenizer):
    """test_eval_chat's byte ids and chat template; id i decodes to WORDS[i % 13] (ids > 250: nothing)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(WORDS[i % len(WORDS)] for i in ids if i <= 250)


def test_eval_mechanism_end_to_end(tmp_path, monkeypatch):
    model = randomize(fbs_tiny(seed=2), seed=3, gate_bias=0.0)
    with torch.no_grad():  # weights x8: varied greedy answers instead of one repeated token
        for p in model.base.parameters():
            p.mul_(8)
    tok = WordTokenizer()
    items = [ChatItem("alpaca_en/0", "en", "Name a colour.", "", "ref"),
             ChatItem("alpaca_zh/0", "zh", "说一种颜色。", "", "ref")]
    write_items(tmp_path / "heldout.jsonl", items)
    monkeypatch.setattr(mech, "_load_model", lambda args: (model, tok))
    monkeypatch.setattr(mech, "_load_lexicon", lambda args: IdiomLexicon(["一帆风顺"]))
    out = tmp_path / "mech"
    assert main(["eval", "mechanism", "--items", str(tmp_path / "heldout.jsonl"), "--tau", "0.5",
                 "--max-new-tokens", "12", "--batch-size", "2", "--resamples", "50", "--out", str(out),
                 "--no-progress"]) == 0
    res = json.loads((out / "mechanism.json").read_text())
    assert set(res) >= {"config", "examples", "counts", "k_uncertainty", "layers", "heatmaps", "skip_energy",
                        "odds_ratios", "boundaries", "fdr", "plots"}
    assert res["config"]["tau"] == 0.5 and res["config"]["gated"] == [1, 2, 3, 4] and res["config"]["ch_layers"] == [3]
    # an independent decode of the same prompts: the per-layer counts are the trace's
    prompts = [tok.apply_chat_template([{"role": "user", "content": it.prompt}], add_generation_prompt=True)
               for it in items]
    ref = model.generate(prompts, max_new_tokens=12, tau=0.5, eos_token_id=[255], tokenizer=tok)
    tr = ref.trace
    valid = tr.valid.unsqueeze(-1)
    executed = (tr.executed & valid).sum(dim=(0, 1)).tolist()
    assert [r["executed"] for r in res["layers"]] == executed
    assert [r["skipped"] for r in res["layers"]] == [int(tr.valid.sum()) - e for e in executed]
    assert res["counts"]["tokens"] == int(tr.valid.sum()) == sum(e["tokens"] - 1 for e in res["examples"])
    assert res["counts"]["skip_ratio"] == pytest.approx(tr.skip_ratio)
    # schemas of the analyses
    ku = res["k_uncertainty"]
    assert ku["status"] in ("ok", "constant", "no_k") and sum(ku["k_histogram"].values()) == ku["tokens_with_k"]
    assert ku["tokens_with_k"] == int(((tr.window_k >= 0) & tr.valid).sum())
    for t in ku["tests"]:
        assert {"group", "measure", "method", "value", "n_tokens", "n_examples", "status"} <= set(t)
        assert t["group"] in ("all", "en", "zh") and t["measure"] in ("surprisal", "entropy", "entropy_next")
    assert [r["layer"] for r in res["skip_energy"]["per_layer"]] == [1, 2, 3, 4]
    assert len(res["skip_energy"]["quintiles"]) == 5
    props = [r["property"] for r in res["odds_ratios"]]
    assert props[:len(CLASSES)] == list(CLASSES) and "idiom" in props
    assert len(res["heatmaps"]["class"]["skip_rate"]) == len(CLASSES)
    assert all(len(row) == 6 for row in res["heatmaps"]["position"]["skip_rate"])
    assert sum(res["heatmaps"]["position"]["tokens"]) == res["counts"]["tokens"]
    tests = [t for t in ku["tests"] + res["skip_energy"]["per_layer"] + res["odds_ratios"]
             if t.get("p_value") is not None]
    assert all("q_value" in t and t["q_value"] >= t["p_value"] for t in tests)
    assert res["fdr"]["q"] == 0.05 and res["fdr"]["tests"] >= len(tests)
    b = res["boundaries"]
    assert b["boundary_tokens"] == int((tr.chunk_boundary & tr.valid).sum())
    if b["status"] == "ok":
        assert [o["offset"] for o in b["offsets"]] == [-2, -1, 0, 1, 2, 3]
    # the token file: a header with the run's config, one line per prompt, the trace's skipped layers and k per token
    header, *lines = [json.loads(x) for x in (out / "mechanism_tokens.jsonl").read_text().splitlines()]
    assert header == {"format": mech.TRACE_FORMAT, "version": mech.TRACE_VERSION, "config": res["config"]}
    assert [x["id"] for x in lines] == [it.id for it in items]
    for r, x in enumerate(lines):
        assert x["answer"] == ref.new_tokens[r]
        for t in x["tokens"]:
            i = t["i"]
            assert t["skipped"] == (~tr.executed[r, i]).nonzero().view(-1).tolist() and t["k"] == int(tr.window_k[r, i])
            assert t["class"] == classify_token(WORDS[x["answer"][i] % len(WORDS)] if x["answer"][i] <= 250 else "")
    for name in res["plots"]:
        assert (out / name).stat().st_size > 0
    md = (out / "mechanism.md").read_text()
    assert "## 1. Lookahead k(i) vs uncertainty" in md and "## 5. Skip rate around chunk boundaries" in md
