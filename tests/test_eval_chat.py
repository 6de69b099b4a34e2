"""`fbs eval chat`: ROUGE-L and the loop detector on hand-computed cases, EOS handling, the base model's answer
NLL, and the command end to end on a tiny random model with a byte-level chat template (no files)."""

import json

import pytest
import torch

from fbs.cli import main
from fbs.data.chat import ChatItem, write_items
from fbs.eval import cli as eval_cli
from fbs.eval.chat import Answer, answer_nll, eos_ids, generate_answers, per_item_metrics
from fbs.eval.textmetrics import first_repeated_ngram, has_repeated_ngram, lcs_length, rouge_l, tail_period

from conftest import fbs_tiny

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------- metrics by hand
def test_rouge_l_hand_computed():
    # LCS of "the cat sat on the mat" / "the cat lay on the mat" is "the cat on the mat": P = R = 5/6
    a, b = "the cat sat on the mat".split(), "the cat lay on the mat".split()
    assert lcs_length(a, b) == 5
    assert rouge_l(a, b) == pytest.approx(5 / 6)
    # [1,2,3,4] vs [2,4,5]: LCS (2,4) = 2, P = 1/2, R = 2/3, F = 2PR/(P+R) = 4/7
    assert lcs_length([1, 2, 3, 4], [2, 4, 5]) == 2
    assert rouge_l([1, 2, 3, 4], [2, 4, 5]) == pytest.approx(4 / 7)
    # a subsequence, not a substring: [1,3,5] in [1,2,3,4,5]: P = 1, R = 3/5, F = 3/4
    assert rouge_l([1, 3, 5], [1, 2, 3, 4, 5]) == pytest.approx(0.75)
    assert rouge_l([1, 2], [3, 4]) == 0.0
    assert rouge_l([], []) == 1.0 and rouge_l([], [1]) == 0.0 and rouge_l([1], []) == 0.0
    assert rouge_l([7, 8, 9], [7, 8, 9]) == 1.0


def test_loop_detector_hand_computed():
    assert first_repeated_ngram(list(range(1, 9)) * 2) == (0, 8)         # an 8-gram said twice
    assert has_repeated_ngram([5] * 9)                                     # overlapping occurrences count
    assert not has_repeated_ngram([5] * 8)                                 # one 8-gram only
    assert not has_repeated_ngram(list(range(1, 8)) * 2)                   # a repeated 7-gram is not a loop
    assert not has_repeated_ngram(list(range(20)))
    seq = [9, 9] + [1, 2, 3, 4, 5, 6, 7, 8] + [0] + [1, 2, 3, 4, 5, 6, 7, 8]
    assert first_repeated_ngram(seq) == (2, 11)
    assert first_repeated_ngram([1, 2, 1, 2, 1], n=2) == (0, 2)


def test_cycle_at_the_end_hand_computed():
    assert tail_period([1, 2, 3] * 40) == 3
    assert tail_period([9] * 10 + [1, 2] * 48) == 2          # only the last 96 tokens count
    assert tail_period(list(range(48)) * 2) == 48             # the longest period allowed
    assert tail_period(list(range(49)) * 2) is None           # period 49 > 96 // 2
    assert tail_period(list(range(96))) is None
    assert tail_period([5] * 95) is None                      # shorter than the window
    assert tail_period([1, 2] * 48 + [3]) is None             # the cycle was left at the end


def test_per_item_metrics():
    base = [Answer("a", "en", [1, 2, 3, 4], True, 0, 0, base_nll=1.0),
            Answer("b", "zh", [5] * 9, False, 0, 0, base_nll=2.0)]
    sys_ = [Answer("a", "en", [2, 4, 5], False, 0, 0, base_nll=3.0),
            Answer("b", "zh", [5] * 9, False, 0, 0, base_nll=2.0)]
    v = per_item_metrics(sys_, base)
    assert v["eos"] == [0.0, 0.0] and v["loop"] == [0.0, 1.0] and v["length"] == [3.0, 9.0]
    assert v["stuck"] == [0.0, 0.0]  # 9 tokens are too few to call a cycle
    stuck = [Answer("a", "en", [4, 5] * 60, False, 0, 0, base_nll=1.0), Answer("b", "zh", [4, 5] * 60, True, 0, 0,
                                                                           base_nll=1.0)]
    assert per_item_metrics(stuck, base)["stuck"] == [1.0, 0.0]  # an answer that ended with EOS is not stuck
    assert v["rouge_l"] == pytest.approx([4 / 7, 1.0]) and v["base_nll"] == [3.0, 2.0]
    with pytest.raises(ValueError, match="must be for the same items in the same order"):
        per_item_metrics(sys_[::-1], base)


# ---------------------------------------------------------------------------- a byte-level chat model
class ChatByteTokenizer:
    """Bytes as ids 1..250; 251/252 open/close a turn; a chat template in three lines."""

    pad_token_id = 0
    eos_token_id = 255
    name_or_path = "chat-bytes"

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1 + b % 250 for b in text.encode("utf-8")]}

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True, return_dict=False):
        ids = []
        for m in messages:
            ids += [251] + self(f"{m['role']}: {m['content']}")["input_ids"] + [252]
        return ids + ([251] + self("assistant: ")["input_ids"] if add_generation_prompt else [])

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids if i <= 250)


def _items():
    en = [ChatItem(f"alpaca_en/{i}", "en", f"Name {w}.", "", "ref")
          for i, w in enumerate(("a colour", "a fruit", "a city", "a tree"))]
    zh = [ChatItem(f"alpaca_zh/{i}", "zh", q, "", "ref") for i, q in enumerate(("说一种颜色。", "说一个城市。"))]
    return en + zh


def _lively(model):
    """A tiny random decoder with weights x8: varied greedy answers instead of one repeated token."""
    with torch.no_grad():
        for p in model.base.parameters():
            p.mul_(8)
    return model


def _gated_only(model, seed=3):
    """Random gate weights, PAW/CH left at their zero init: at full depth the model is exactly the base."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.gates.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def test_eos_ends_an_answer_and_is_not_part_of_it():
    model, tok = _lively(fbs_tiny(seed=1)), ChatByteTokenizer()
    items = _items()[:3]
    prompts = [tok.apply_chat_template([{"role": "user", "content": it.prompt}], add_generation_prompt=True)
               for it in items]
    free, _ = generate_answers(model, tok, items, prompts, None, eos=[255], max_new_tokens=8, batch_size=2)
    stop = free[0].tokens[2]  # make the first answer's third token the EOS
    got, stats = generate_answers(model, tok, items, prompts, None, eos=[stop], max_new_tokens=8, batch_size=2)
    first = free[0].tokens.index(stop)
    assert got[0].eos and got[0].tokens == free[0].tokens[:first]
    for a, f in zip(got, free):
        if stop not in f.tokens:
            assert not a.eos and a.tokens == f.tokens and len(a.tokens) == 8
    assert all(a.skipped == 0 and a.pairs > 0 for a in got) and stats.to_dict()["tflops_rel"] == 1.0


def test_answer_nll_is_teacher_forced_with_the_prompt_as_context():
    model = fbs_tiny()
    prompts = [[3, 4, 5, 6], [7, 8]]
    answers = [Answer("x", "en", [10, 11, 12], True, 0, 0), Answer("y", "en", [13, 14], False, 0, 0)]
    got = answer_nll(model, prompts, answers, eos=[255], batch_tokens=16)
    for p, a, v in zip(prompts, answers, got):
        target = a.tokens + ([255] if a.eos else [])
        ids = torch.tensor([p + target])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids, gate_mode="off").logits[0, :-1], -1)
        want = -logp[len(p) - 1:].gather(-1, torch.tensor(target)[:, None]).mean()
        assert v == pytest.approx(float(want), abs=1e-5)
    assert answer_nll(model, prompts, answers, eos=[255], batch_tokens=1) == pytest.approx(got, abs=1e-5)


# ---------------------------------------------------------------------------- the command end to end
def test_eval_chat_command_end_to_end(tmp_path, monkeypatch):
    base = _lively(fbs_tiny(seed=1))
    tok = ChatByteTokenizer()
    loaders = {"checkpoint": lambda: _gated_only(_lively(fbs_tiny(seed=1))),
               "control": lambda: _lively(fbs_tiny(seed=2))}
    monkeypatch.setattr(eval_cli, "_load_chat_models", lambda args: (base, tok, loaders, 0.5))
    write_items(tmp_path / "heldout.jsonl", _items())
    out, cache = tmp_path / "chat.json", tmp_path / "base_answers.json"
    argv = ["eval", "chat", "--items", str(tmp_path / "heldout.jsonl"), "--taus", "0.0,0.5", "--control", "ctrl",
            "--max-new-tokens", "10", "--batch-size", "4", "--out", str(out), "--base-cache", str(cache),
            "--no-progress", "--samples", "1"]
    assert main(argv) == 0
    res = json.loads(out.read_text())
    recs = {r["name"]: r for r in res["systems"]}
    assert list(recs) == ["base", "fbs full depth", "fbs tau 0", "fbs tau 0.5", "control full depth"]
    assert all(r["n"] == 6 and set(r["per_lang"]) == {"en", "zh"} for r in recs.values())
    # full depth of a checkpoint whose PAW/CH are zero is the base model: identical answers
    for name in ("base", "fbs full depth"):
        m = recs[name]["metrics"]
        assert m["rouge_l"]["value"] == 1.0 and m["eos"]["vs_base"]["delta"] == 0.0
        assert recs[name]["skip_ratio"] == 0.0
    assert [it["tokens"] for it in recs["fbs full depth"]["items"]] == [it["tokens"] for it in recs["base"]["items"]]
    # tau 0 skips every gated layer of every decoded token (4 of 6 layers)
    assert recs["fbs tau 0"]["skip_ratio"] == pytest.approx(4 / 6)
    assert recs["fbs tau 0"]["tflops_rel"] == pytest.approx(2 / 6)
    # the summary is the mean of the per-item values
    tau0 = recs["fbs tau 0"]
    assert tau0["metrics"]["loop"]["value"] == pytest.approx(sum(it["loop"] for it in tau0["items"]) / 6)
    assert tau0["metrics"]["length"]["value"] == pytest.approx(sum(len(it["tokens"]) for it in tau0["items"]) / 6)
    assert set(res["demo"]["answers"]) == set(recs)
    md = out.with_suffix(".md").read_text()
    assert "| fbs tau 0.5 | 0.50 | 6 |" in md and "## zh" in md and "## Sample answers" in md
    assert "alpaca_zh/0" in md and "make demo" in md
    # a second run reuses the cached base answers
    data = json.loads(cache.read_text())
    assert sorted(data["items"]) == sorted(it.id for it in _items())
    data["items"]["alpaca_en/0"]["text"] = "FROM THE CACHE"
    cache.write_text(json.dumps(data))
    assert main(argv[:5] + ["0.5", "--no-full"] + argv[8:]) == 0  # base and tau 0.5 only
    res2 = json.loads(out.read_text())
    assert [r["name"] for r in res2["systems"]] == ["base", "fbs tau 0.5"]
    assert res2["systems"][0]["items"][0]["text"] == "FROM THE CACHE"


def test_reference_weights_decode_the_base_with_other_engine_weights(tmp_path, monkeypatch):
    """`--reference-weights fp32,int8,int8:bf16`: fp32 reproduces the base answers exactly (ROUGE-L 1); int8 gives the
    answers of the base model decoded by the engine in int8, every layer run; `int8:bf16` those with a bf16 KV
    cache."""
    base, tok = _lively(fbs_tiny(seed=1)), ChatByteTokenizer()
    loaders = {"checkpoint": lambda: _gated_only(_lively(fbs_tiny(seed=1)))}
    monkeypatch.setattr(eval_cli, "_load_chat_models", lambda args: (base, tok, loaders, 0.5))
    items = _items()
    write_items(tmp_path / "heldout.jsonl", items)
    out = tmp_path / "chat.json"
    argv = ["eval", "chat", "--items", str(tmp_path / "heldout.jsonl"), "--no-full", "--taus", "0.5",
            "--reference-weights", "fp32,int8,int8:bf16", "--max-new-tokens", "10", "--batch-size", "4", "--out", str(out),
            "--base-cache", str(tmp_path / "cache.json"), "--no-progress"]
    assert main(argv) == 0
    recs = {r["name"]: r for r in json.loads(out.read_text())["systems"]}
    assert list(recs) == ["base", "fbs tau 0.5", "base, fp32 weights", "base, int8 weights",
                          "base, int8 weights, bf16 KV cache"]
    assert recs["base, fp32 weights"]["metrics"]["rouge_l"]["value"] == 1.0
    prompts = [tok.apply_chat_template([{"role": "user", "content": it.prompt}], add_generation_prompt=True)
               for it in items]
    want, _ = generate_answers(base, tok, items, prompts, None, eos=eos_ids(base, tok), max_new_tokens=10,
                               batch_size=4, weights="int8")
    assert [it["tokens"] for it in recs["base, int8 weights"]["items"]] == [a.tokens for a in want]
    assert recs["base, int8 weights"]["skip_ratio"] == 0.0
    half, _ = generate_answers(base, tok, items, prompts, None, eos=eos_ids(base, tok), max_new_tokens=10,
                               batch_size=4, weights="int8", kv_dtype="bf16")
    assert [it["tokens"] for it in recs["base, int8 weights, bf16 KV cache"]["items"]] == [a.tokens for a in half]
    assert [a.tokens for a in half] != [a.tokens for a in want]  # the bf16 cache moved some answers: it was used
    for bad in ("int4", "int8:fp8", "int8:fp16:int4", "int8:fp16:int8:x"):
        with pytest.raises(SystemExit, match="is not W, W:KV or W:KV:P"):
            main(argv[:8] + [bad] + argv[9:])
