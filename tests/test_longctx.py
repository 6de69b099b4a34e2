"""``fbs eval long-context`` (:mod:`fbs.eval.longctx`): items, scoring through the engine, summaries, the command.

Oracles: the HF model's own logits over the whole sequence (teacher-forced decode steps of the full cache at full
depth must give the same log-probabilities), the full cache (a budget at least the context changes nothing),
hand-made answers and per-item rows with hand-computed accuracies and PPL, and the text of the items (the needle
sentence sits where the item says, at a line or sentence end near its depth).
"""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from conftest import fbs_tiny
from fbs.cli import main
from fbs.eval import longctx as lc

WORDS = ("river", "stone", "light", "green", "north", "quiet", "house", "field", "cloud", "bread")


def docs(n: int = 3, words: int = 120, seed: int = 0) -> list[tuple[str, str]]:
    g = random.Random(seed)
    return [(f"doc{i}", " ".join(g.choice(WORDS) + ("." if g.random() < 0.15 else "") for _ in range(words)))
            for i in range(n)]


def qa_rows(n: int = 3) -> list[dict]:
    g = random.Random(1)
    return [{"id": f"q{i}", "text": " ".join(g.choice(WORDS) for _ in range(90)), "question": "Is the stone green?",
             "answer": ("Yes", "No")[i % 2]} for i in range(n)]


@pytest.fixture(scope="module")
def tok():
    from test_serve import char_tokenizer

    return char_tokenizer()


def test_needle_items_are_deterministic_per_seed_and_placed_as_recorded(tok):
    cfg = lc.LongCtxConfig(model="x", lengths=(200,), budget=40, ppl_tokens=16, depths=(0.0, 0.5, 1.0),
                           needles_per_depth=2, qa_items=2)
    a = lc.build_items(cfg, tok, 200, docs(), qa_rows())
    assert a == lc.build_items(cfg, tok, 200, docs(), qa_rows())
    other = lc.build_items(lc.LongCtxConfig(**{**cfg.__dict__, "seed": 1}), tok, 200, docs(), qa_rows())
    assert [n["value"] for n in a["needle"]] != [n["value"] for n in other["needle"]]
    assert len(a["needle"]) == 6 and len(a["ppl"]) == cfg.ppl_docs and len(a["qa"]) == 2
    for it in a["needle"]:
        needle = lc.NEEDLE.format(value=it["value"])
        text = tok.decode(it["prompt"])
        assert text.count("special magic number is") == 1 and len(it["value"]) == lc.DIGITS
        at = it["at"]
        assert tok.decode(it["prompt"][at:at + len(needle)]) == needle       # one character per id
        n_hay = len(it["prompt"]) - len(needle) - len(lc.QUESTION)
        assert round(it["depth"] * n_hay) - 64 <= at <= round(it["depth"] * n_hay)
        if 0 < at < round(it["depth"] * n_hay):  # snapped back: the haystack before it ends a line or sentence
            assert text[:at].rstrip(" ")[-1] in "\n.!?"
        assert tok.decode(it["prompt"]).endswith(lc.QUESTION) and tok.decode(it["forced"]) == lc.NEEDLE_CUE
        # the whole request (prompt, fed cue, decoded answer) is the length
        assert len(it["prompt"]) + len(it["forced"]) + it["answer_tokens"] == 200
    for it in a["ppl"]:
        assert len(it["prompt"]) + len(it["forced"]) == 200 and len(it["forced"]) == 16
    for it in a["qa"]:  # " Yes" / " No" differ at their first letter: the space is fed with the cue
        assert tok.decode(it["forced"]) == lc.QA_CUE + " " and tok.convert_ids_to_tokens(it["choices"]) == ["Y", "N"]
        assert len(it["prompt"]) + len(it["forced"]) + 1 == 200


def test_needle_answers_and_accuracies_on_hand_made_cases():
    assert lc.needle_correct(" 4829137.", "4829137") and lc.needle_correct("4829137 is it", "4829137")
    assert not lc.needle_correct(" 48291370", "4829137") and not lc.needle_correct(" 12 4829137", "4829137")
    assert not lc.needle_correct(" none", "4829137") and not lc.needle_correct(" 482913", "4829137")
    rows = {"ppl": [{"nll": 6.0, "tokens": 3, "decode_s": 1.0, "decode_steps": 4},
                    {"nll": 2.0, "tokens": 1, "decode_s": 3.0, "decode_steps": 4}],
            "needle": [{"depth": 0.1, "correct": True, "prefill_s": 1.0}, {"depth": 0.1, "correct": False,
                                                                            "prefill_s": 3.0},
                       {"depth": 0.9, "correct": True, "prefill_s": 2.0}],
            "qa": [{"correct": False, "prefill_s": 5.0}]}
    s = lc.summarize(rows, executed=30, pairs=40, cap=10)
    assert s["ppl"] == pytest.approx(math.exp(8 / 4)) and s["ppl_tokens"] == 4
    assert s["decode_tok_s"] == pytest.approx(8 / 4)
    assert s["needle_acc"] == pytest.approx(2 / 3) and s["needle_acc_by_depth"] == {"0.1": 0.5, "0.9": 1.0}
    assert s["qa_acc"] == 0 and s["ttft_s"] == 2.5 and s["skip_ratio"] == pytest.approx(0.25)


def test_systems_are_named_and_checked():
    assert lc.system_options("base", 64) == {"model": "base", "policy": "full", "opts": {"force_compute": True}}
    assert lc.system_options("h2o", 64)["opts"] == {"kv_cache": "h2o", "kv_budget": 64, "force_compute": True}
    assert lc.system_options("fbs+snapkv", 64) == {"model": "fbs", "policy": "snapkv",
                                                   "opts": {"kv_cache": "snapkv", "kv_budget": 64}}
    with pytest.raises(ValueError, match="unknown system 'fbs\\+lru'"):
        lc.system_options("fbs+lru", 64)
    with pytest.raises(ValueError, match="unknown system"):
        lc.LongCtxConfig(systems=("full",))


def test_fed_tokens_score_like_the_hf_forward(one_thread):
    """Full cache, every layer: the log-probabilities of the fed tokens equal HF's logits over the whole sequence;
    a cache policy whose budget holds the whole context gives the same ones."""
    m = fbs_tiny()
    g = random.Random(3)
    ids = [g.randrange(3, 250) for _ in range(48)]
    prompt, forced = ids[:40], ids[40:]
    with torch.no_grad():
        ref = torch.log_softmax(m.base.hf(torch.tensor([ids])).logits[0].float(), -1)
    want = [ref[40 + i - 1, t].item() for i, t in enumerate(forced)][1:]
    full = lc.feed(m, None, prompt, forced, 0, {"force_compute": True})
    assert full.decode_steps == len(forced) - 1 and full.capacity == 48
    torch.testing.assert_close(torch.tensor(full.logprobs), torch.tensor(want), rtol=0, atol=1e-4)
    assert full.executed == full.pairs == full.decode_steps * 6
    for kv in ("streaming", "h2o", "snapkv"):
        r = lc.feed(m, None, prompt, forced, 0, {"force_compute": True, "kv_cache": kv, "kv_budget": 48})
        torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(full.logprobs), rtol=0, atol=1e-5)
    # generation after the fed tokens is greedy decoding of prompt + forced
    gen = lc.feed(m, None, prompt, forced, 4, {"force_compute": True})
    res = m.generate([ids], max_new_tokens=4, ignore_eos=True, force_compute=True)
    assert gen.generated == res.new_tokens[0]


def test_a_small_budget_allocates_the_budget_not_the_context(one_thread):
    m = fbs_tiny()
    ids = [random.Random(4).randrange(3, 250) for _ in range(100)]
    caps = {kv: lc.feed(m, None, ids[:90], ids[90:], 2, {"kv_cache": kv, "kv_budget": 40}).capacity
            for kv in ("streaming", "h2o", "snapkv")}
    assert caps == {"streaming": 41, "h2o": 41, "snapkv": 40 + 12}


def base_row(rec: dict, length: int) -> dict:
    return next(r for r in rec["rows"] if (r["system"], r["length"]) == ("base", length))


@pytest.mark.slow
def test_long_context_command_end_to_end(tmp_path, capsys, monkeypatch):
    """The command on a tiny random model saved to disk: every system at two lengths in this process, then a rerun
    that resumes (nothing recomputed) and one system in its own process (peak RSS recorded)."""
    from test_serve import tiny_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = tiny_model(positions=512)
        model.base.hf.save_pretrained(tmp_path / "base")
        model.tokenizer.save_pretrained(tmp_path / "base")
        model.save_pretrained(tmp_path / "ckpt")
        (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"id": k, "text": t}) + "\n" for k, t in docs()))
        monkeypatch.setattr(lc, "qasper_items", qa_rows)
        out = tmp_path / "res" / "lc.json"
        common = ["eval", "long-context", "--model", str(tmp_path / "base"), "--checkpoint", str(tmp_path / "ckpt"),
                  "--kv-budget", "40", "--ppl-tokens", "16", "--depths", "0.2,0.8", "--qa-items", "2",
                  "--docs", str(tmp_path / "docs.jsonl"), "--out", str(out)]
        argv = [*common, "--lengths", "160,240", "--work-dir", str(tmp_path / "work"), "--in-process"]
        assert main(argv) == 0
        rec = json.loads(out.read_text())
        assert [(r["system"], r["length"]) for r in rec["rows"]] == [(s, L) for L in (160, 240)
                                                                     for s in lc.DEFAULT_SYSTEMS]
        items = [json.loads(line) for line in (tmp_path / "res" / "lc_items.jsonl").read_text().splitlines()]
        assert len(items) == 2 * (2 + 2 + 2) and all("prompt" not in i for i in items)
        for r in rec["rows"]:
            per = rec["per_item"][f"{r['system']}@{r['length']}"]
            assert r["needle_acc"] == sum(x["correct"] for x in per["needle"]) / 2
            assert r["ppl"] == pytest.approx(math.exp(sum(x["nll"] for x in per["ppl"]) / (2 * 15)))
            assert (r["skip_ratio"] > 0) == r["system"].startswith("fbs")
            if r["policy"] in ("streaming", "h2o"):
                assert r["kv_capacity_slots"] == 41
        base = {r["length"]: r for r in rec["rows"] if r["system"] == "base"}
        assert base[240]["kv_capacity_slots"] == 240  # the requests: prompt + fed + decoded = the length
        assert "| fbs+h2o |" in out.with_suffix(".md").read_text() and rec["provenance"]["git_commit"] is not None
        capsys.readouterr()
        assert main(argv) == 0 and capsys.readouterr().out.count("done before") == 16
        assert json.loads(out.read_text())["rows"] == rec["rows"]
        # another cache storage is another part: run again, its cache counted in int8 entries (hd codes + a 4-byte
        # scale against hd fp32 values: 20 / 64 bytes for the tiny model's heads of 16)
        assert main([*common, "--lengths", "160", "--work-dir", str(tmp_path / "work"), "--in-process",
                     "--systems", "base", "--kv-dtype", "int8"]) == 0
        assert "done before" not in capsys.readouterr().out
        q = json.loads(out.read_text())["rows"][0]
        assert q["kv_dtype"] == "int8" and base_row(rec, 160)["kv_dtype"] == "fp32"
        assert q["kv_cache_mb"] == pytest.approx(base_row(rec, 160)["kv_cache_mb"] * 20 / 64)
        assert q["ppl"] != base_row(rec, 160)["ppl"] and q["ppl"] == pytest.approx(base_row(rec, 160)["ppl"], rel=0.05)
        assert main([*common, "--lengths", "160", "--work-dir", str(tmp_path / "empty"), "--collect-only"]) == 0
        assert json.loads(out.read_text())["missing"] == [f"{s}@160" for s in lc.DEFAULT_SYSTEMS]
        assert "Not run yet" in out.with_suffix(".md").read_text()
        assert main([*common, "--systems", "snapkv", "--lengths", "160", "--work-dir", str(tmp_path / "work2")]) == 0
        row = json.loads(out.read_text())["rows"][0]
        assert row["system"] == "snapkv" and row["peak_rss_mb"] >= row["rss_after_load_mb"] > 0
        assert row["ppl"] == pytest.approx(next(r["ppl"] for r in rec["rows"] if (r["system"], r["length"]) ==
                                                ("snapkv", 160)), rel=1e-6)
    finally:
        torch.set_num_threads(threads)
