"""Issue 15's CPU protocol: stratified seeded subsets and their id files, decode-faithful scoring (gates from the
context's end = the engine's teacher-forced decode), BH across tasks in the main table, and `fbs eval run
--protocol` end to end on a hand-made scorer (no model files, no data packages)."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from fbs.cli import main
from fbs.engine import start
from fbs.eval import cli as eval_cli
from fbs.eval import tasks as T
from fbs.eval.datasets import MCExample
from fbs.eval.report import cost_summary, load_record, make_record, markdown_table
from fbs.eval.stats import bootstrap_indices
from fbs.eval.systems import FBSSystem
from fbs.eval.tasks import ProtocolTask, TaskResult, protocol_items, run_multiple_choice, select_stratified

from conftest import fbs_tiny, randomize
from test_eval_scoring import ByteTokenizer, NextByteSystem

pytestmark = pytest.mark.usefixtures("one_thread")

SIZES = {"algebra": 30, "biology": 25, "chemistry": 10}


def _items(sizes=SIZES):
    return [MCExample(f"mmlu/{s}/{i}", ("ab",) * 2, ("c", "x"), gold=0) for s, n in sizes.items() for i in range(n)]


# ---------------------------------------------------------------------------- subsets
def test_stratified_subset_is_deterministic_and_stratified():
    items = _items()
    a, b = select_stratified(items, 20, seed=42), select_stratified(items, 20, seed=42)
    assert [x.id for x in a] == [x.id for x in b]
    counts = {s: sum(x.id.startswith(f"mmlu/{s}/") for x in a) for s in SIZES}
    assert counts == {"algebra": 20, "biology": 20, "chemistry": 10}  # a smaller stratum is taken whole
    assert len({x.id for x in a}) == 50
    assert [items.index(x) for x in a] == sorted(items.index(x) for x in a)  # set order kept
    c = select_stratified(items, 20, seed=7)
    assert {x.id for x in c} != {x.id for x in a}
    assert {s: sum(x.id.startswith(f"mmlu/{s}/") for x in c) for s in SIZES} == counts
    # a stratum's draw does not depend on the other strata
    alone = select_stratified(_items({"algebra": 30}), 20, seed=42)
    assert [x.id for x in alone] == [x.id for x in a if x.id.startswith("mmlu/algebra/")]


def test_protocol_ids_file_is_written_then_read(tmp_path):
    items = _items()
    entry = ProtocolTask("mmlu", per_stratum=5)
    got, rec = protocol_items("cpu", entry, items, 42, tmp_path)
    path = tmp_path / "mmlu.ids.json"
    saved = json.loads(path.read_text())
    assert saved["ids"] == [x.id for x in got] == rec["ids"] and saved["n"] == 15 and saved["n_total"] == 65
    assert saved["strata"] == {"mmlu/algebra": 5, "mmlu/biology": 5, "mmlu/chemistry": 5}
    # the file is the source of truth: edit it and the next call runs exactly those ids (in set order)
    saved["ids"] = ["mmlu/chemistry/9", "mmlu/algebra/3"]
    path.write_text(json.dumps(saved))
    again, _ = protocol_items("cpu", entry, items[::-1], 42, tmp_path)
    assert sorted(x.id for x in again) == ["mmlu/algebra/3", "mmlu/chemistry/9"]
    with pytest.raises(ValueError, match="seed"):
        protocol_items("cpu", entry, items, 43, tmp_path)
    with pytest.raises(ValueError, match="not in the mmlu data"):
        protocol_items("cpu", entry, _items({"algebra": 30}), 42, tmp_path)
    plain, _ = protocol_items("cpu", ProtocolTask("arc", size=7), items, 42, None)  # no dir: nothing written
    assert plain == T.select(items, 7, 42) and not (tmp_path / "arc.ids.json").exists()


def test_cpu_protocol_sizes_are_those_of_issue_15():
    cpu = {e.task: e for e in T.PROTOCOLS["cpu"]}
    assert cpu["mmlu"].per_stratum == 20
    assert {t: cpu[t].size for t in ("arc_easy", "arc_challenge", "hellaswag", "gsm8k", "mbpp")} == \
        {"arc_easy": 500, "arc_challenge": 500, "hellaswag": 500, "gsm8k": 250, "mbpp": 200}
    assert cpu["humaneval"].size is None and cpu["idiom_zh"].size is None
    assert all(not cpu[t].run and cpu[t].note for t in ("cmmlu", "ceval", "cmath", "humaneval_x", "bbh", "chat"))
    assert all(e.task in T.TASKS for e in cpu.values() if e.run)


def test_cpu_small_subsets_are_drawn_from_the_cpu_subsets():
    """cpu-small's ids are a subset of cpu's (a later cpu run reruns them), about half of each, same strata."""
    small = {e.task: e for e in T.PROTOCOLS["cpu-small"]}
    cpu = {e.task: e for e in T.PROTOCOLS["cpu"]}
    assert {t for t, e in small.items() if e.run} == {t for t, e in cpu.items() if e.run}
    items = _items({"algebra": 30, "biology": 40, "chemistry": 25})
    big = {x.id for x in T.draw_protocol_items(cpu["mmlu"], items, 42)}
    part = T.draw_protocol_items(small["mmlu"], items, 42)
    assert {x.id for x in part} < big and len(part) == 3 * small["mmlu"].per_stratum
    flat = _items({"x": 1500})
    for task in ("arc_easy", "hellaswag", "gsm8k", "mbpp"):
        outer = {x.id for x in T.draw_protocol_items(cpu[task], flat, 42)}
        inner = T.draw_protocol_items(small[task], flat, 42)
        assert len(inner) == small[task].size < len(outer) and {x.id for x in inner} < outer
        # not simply the first ones of the larger subset
        assert [x.id for x in inner] != [x.id for x in flat if x.id in outer][:len(inner)]


# ---------------------------------------------------------------------------- decode-faithful scoring
def _engine_logprob(model, ctx, cont, tau):
    """log p(cont | ctx) decoded by the engine: ctx prefilled, each true continuation token fed back."""
    dec = start(model, [ctx], None, None, dict(max_new_tokens=len(cont), tau=tau, ignore_eos=True))
    total = 0.0
    with torch.inference_mode():
        logits = torch.stack(dec.prefill())  # (1, V): the prediction of cont[0]
        for step, t in enumerate(cont):
            total += float(torch.log_softmax(logits.float(), -1)[0, t])
            if step + 1 < len(cont):
                logits = dec.decode_step(step, [t])
    return total


@pytest.mark.parametrize("policy", ["project", "hole"])
def test_loglikelihood_gates_from_the_context_end_like_decoding(policy):
    model = randomize(fbs_tiny(kv_policy=policy), gate_bias=0.0)
    system = FBSSystem(model, ByteTokenizer(), tau=0.5)
    g = torch.Generator().manual_seed(0)
    pairs = [(torch.randint(1, 250, (n,), generator=g).tolist(), torch.randint(1, 250, (k,), generator=g).tolist())
             for n, k in ((7, 5), (12, 9), (3, 1))]
    scores = system.score_tokens(pairs)
    for (ctx, cont), s in zip(pairs, scores):
        assert s.logprob == pytest.approx(_engine_logprob(model, ctx, cont, 0.5), abs=1e-4)
    # the decoded positions are the continuation tokens but the last: 4 + 8 + 0 of them, 6 layers each
    cost = system.cost_counters()
    assert cost["scored_pairs"] == (4 + 8 + 0) * 6 and 0 < cost["scored_skipped"] < cost["scored_pairs"]
    # gating the context too is a different (not decode-faithful) score
    every = FBSSystem(model, ByteTokenizer(), tau=0.5, score_gates="all").score_tokens(pairs)
    assert max(abs(a.logprob - b.logprob) for a, b in zip(every, scores)) > 1e-3


# ---------------------------------------------------------------------------- main table: BH across tasks
def _result(task, values):
    return run_multiple_choice(_Fixed(values), [MCExample(f"{task}/{i}", ("q",) * 2, ("a", "b"), 0)
                                                for i in range(len(values))], task, len(values))


class _Fixed(NextByteSystem):
    """Answers item i correctly iff values[i]: the option scores are set by hand through the request order."""

    def __init__(self, values):
        super().__init__(ByteTokenizer())
        self.values = list(values)

    def loglikelihood(self, requests, progress=False):
        from fbs.eval.systems import Score

        out = []
        for k in range(len(requests)):
            right = self.values[k // 2]
            out.append(Score(-1.0 if (k % 2 == 0) == right else -2.0, 1, True))
        return out


def test_main_table_bh_over_each_systems_tasks_hand_computed():
    n = 40
    base_vals = {"arc_easy": [0] * n, "arc_challenge": [1] * n, "hellaswag": [0] * n}
    fbs_vals = {"arc_easy": [1] * n,                   # better everywhere: p = 0
                "arc_challenge": [1] * n,              # identical: p = 1
                "hellaswag": [1, 1] + [0] * (n - 2)}   # better on two items: p = 2 P(neither is resampled)
    base = make_record({"name": "base", "kind": "hf"}, {t: _result(t, v) for t, v in base_vals.items()}, 42, None,
                       1.0, {})
    fbs = make_record({"name": "fbs", "kind": "fbs"}, {t: _result(t, v) for t, v in fbs_vals.items()}, 42, None,
                      1.0, {})
    idx = bootstrap_indices(n, 1000, seed=0)
    p3 = 2 * float(np.mean(~((idx == 0) | (idx == 1)).any(axis=1)))
    assert 0.1 < p3 < 0.5  # about 2 (1 - 2/40)^40 = 0.26
    # BH over the three tasks: sorted p = 0, p3, 1 -> q = min_j>=i p_(j) m / j = 0, min(1.5 p3, 1), 1
    q = {"arc_easy": 0.0, "hellaswag": 1.5 * p3, "arc_challenge": 1.0}
    b, f = _roundtrip(base), _roundtrip(fbs)
    md = markdown_table([b, f], base=b)
    rows = {line.split(" | ")[1]: line for line in md.splitlines() if line.startswith("| fbs | ")}
    for task, qv in q.items():
        assert rows[task].split(" | ")[-3] == f"{qv:.3f}"
    assert "| 100.00 | [100.00, 100.00] | 40 / 40 | +100.00 [+100.00, +100.00] | 0.000 | 0.000 |" in rows["arc_easy"]
    main_row = next(line for line in md.splitlines() if line.startswith("| fbs | ") and "ARC" not in line
                    and "arc" not in line)
    assert "100.0*" in main_row  # ARC-E: q = 0 < 0.01
    assert "| 5.0 |" in main_row  # HellaSwag: not significant after BH (no *)


def _roundtrip(rec):
    return {**rec, "tasks": {k: TaskResult.from_dict(v) for k, v in rec["tasks"].items()}}


def test_cost_summary_pools_the_tasks():
    res = _result("gsm8k", [1, 0])
    a, b = dataclasses.replace(res), dataclasses.replace(res, details={})
    a.details = {"cost": {"decoded_tokens": 10, "decoded_pairs": 60, "decoded_skipped": 6, "decoded_tflops_rel_sum": 9.0,
                          "scored_pairs": 0, "scored_skipped": 0}}
    b.details = {"cost": {"decoded_tokens": 30, "decoded_pairs": 180, "decoded_skipped": 54,
                          "decoded_tflops_rel_sum": 21.0, "scored_pairs": 12, "scored_skipped": 3}}
    rec = {"system": {"kind": "fbs"}, "tasks": {"x": a, "y": b}}
    assert cost_summary(rec) == {"decode_skip": 60 / 240, "tflops_rel": 30 / 40, "scored_skip": 3 / 12}
    assert cost_summary({"system": {"kind": "hf"}, "tasks": {}}) == {"decode_skip": 0.0, "tflops_rel": 1.0,
                                                                     "scored_skip": 0.0}


# ---------------------------------------------------------------------------- the command
def test_eval_run_protocol_end_to_end(tmp_path, monkeypatch, capsys):
    items = [MCExample(f"toy/{s}/{i}", ("ab",) * 2, ("c", "x"), gold=i % 2) for s in "pq" for i in range(6)]
    monkeypatch.setitem(T.TASKS, "toy", T.TaskSpec("toy", "mc", lambda: items, "toy"))
    monkeypatch.setitem(T.TASKS, "toy2", T.TaskSpec("toy2", "mc", lambda: items[:5], "toy"))
    monkeypatch.setitem(T.PROTOCOLS, "cpu", (ProtocolTask("toy", per_stratum=4, note="4 per letter"),
                                             ProtocolTask("toy2", size=3),
                                             ProtocolTask("cmmlu", note="no offline copy", run=False)))
    monkeypatch.setattr(eval_cli, "build_system", lambda args: NextByteSystem(ByteTokenizer()))
    ids_dir, out = tmp_path / "ids", tmp_path / "run.json"
    argv = ["eval", "run", "--protocol", "cpu", "--ids-dir", str(ids_dir), "--out", str(out), "--no-progress"]
    assert main(argv + ["--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "toy" in text and "8 of     12" in text and "cmmlu          not run: no offline copy" in text
    assert not out.exists()
    ids = json.loads((ids_dir / "toy.ids.json").read_text())["ids"]
    assert len(ids) == 8 and sum(i.startswith("toy/p/") for i in ids) == 4
    assert main(argv + ["--tasks", "toy,cmmlu"]) == 0
    rec = load_record(out)
    res = rec["tasks"]["toy"]
    assert res.ids == ids and res.n_total == 12
    assert res.per_example["acc"] == [float(int(i.rsplit("/", 1)[1]) % 2 == 0) for i in ids]  # "c" follows "b"
    assert rec["protocol"]["not_run"] == {"cmmlu": "no offline copy"}
    assert rec["protocol"]["tasks"]["toy"]["n"] == 8
    assert "[1/1] toy: 8 of 12 examples" in capsys.readouterr().out
    # a second piece of the same protocol run adds its task and keeps what the first said
    assert main(argv + ["--tasks", "toy2", "--append"]) == 0
    rec = load_record(out)
    assert list(rec["tasks"]) == ["toy", "toy2"] and rec["tasks"]["toy2"].n == 3
    assert set(rec["protocol"]["tasks"]) == {"toy", "toy2"} and "cmmlu" in rec["protocol"]["not_run"]
    with pytest.raises(SystemExit, match="--limit and --protocol exclude each other"):
        main(argv + ["--limit", "3"])
