"""`fbs eval group-b` on small hand-written bench / sweep / run files: rows, matching by method and knob, the
"not measured" cells, the lossless rows' full-depth quality, and the front statements against hand-drawn fronts."""

from __future__ import annotations

import copy
import json

import pytest

from fbs.cli import main
from fbs.eval.groupb import assemble, classify, front_ppl, markdown, pareto_front
from fbs.eval.report import make_record, save_record
from fbs.eval.tasks import Metric, TaskResult

NEW = 101  # new tokens: N - 1 = 100 decoded tokens, so decode ms / 100 = ms per token


def bench_row(system, family, decode_ms, ratio=None, kind="layer_skip", params=None, batch=1, **extra):
    row = {"system": system, "family": family, "batch_size": batch, "status": "ok", "note": "",
            "params": params or {}, "latency_ms": {"decode": {"median": decode_ms}, "total": {"median": decode_ms + 900}},
            "speedup": 5900 / (decode_ms + 900), "tflops_rel": 1.0 - (ratio or 0), "tflops_rel_exact": 1.01 - (ratio or 0),
            "method_ratio": ratio, "method_ratio_kind": kind, "probe": extra.pop("probe", {}), **extra}
    if family == "speculative":  # drafts and verification: more work than plain decoding
        row["tflops_rel"], row["tflops_rel_exact"] = 1.13, 1.14
    return row


def bench_doc():
    rows = [
        bench_row("hf-greedy", "baseline", 5000, 0.0, "none"),
        bench_row("fbs-full-compute", "fbs", 5100, 0.0, params={"force_compute": True, "weights": "fp32"}),
        bench_row("fbs-tau0.3", "fbs", 4000, 0.20, params={"tau": 0.3, "kv_policy": "project", "weights": "fp32"}),
        bench_row("fbs-tau0.5", "fbs", 4500, 0.10, params={"tau": 0.5, "kv_policy": "project", "weights": "fp32"}),
        bench_row("fbs-tau0.3-int8", "fbs", 1500, 0.20, params={"tau": 0.3, "kv_policy": "project", "weights": "int8"}),
        bench_row("fbs-tau0.3-hole", "fbs", 3900, 0.19, params={"tau": 0.3, "kv_policy": "hole"}),
        bench_row("fbs-plan50", "fbs", 3000, 0.5),
        bench_row("ffn-skipllm-t0.988", "adaptive", 4600, 0.17, "ffn_skip",
                  params={"method": "ffn-skipllm", "threshold": 0.988, "weights": "fp32"}),
        bench_row("ffn-skipllm-t0.984", "adaptive", 4200, 0.31, "ffn_skip",
                  params={"method": "ffn-skipllm", "threshold": 0.984, "weights": "fp32"}),
        bench_row("ffn-skipllm-t0.98", "adaptive", 3800, 0.48, "ffn_skip",
                  params={"method": "ffn-skipllm", "threshold": 0.98, "weights": "fp32"}),
        bench_row("flexidepth-tau0.5", "adaptive", 4400, 0.12,
                  params={"method": "flexidepth", "tau": 0.5, "route_prompt": True, "weights": "fp32"}),
        bench_row("fbs-lossless", "speculative", 4800, 0.94, "acceptance", params={"lossless": True},
                  probe={"acceptance_rate": 0.94, "verified_advance_ratio": 0.99, "tokens_per_pass": 1.14,
                         "draft_skip_ratio": 0.07}),
        bench_row("kangaroo-exit10", "speculative", 5200, 0.6, "acceptance", params={"lossless": True},
                  probe={"acceptance_rate": 0.6, "verified_advance_ratio": 0.8, "tokens_per_pass": 1.5}),
        bench_row("hf-prompt-lookup", "speculative", 4700, 0.27, "verified_advance"),
        bench_row("fbs-tau0.3", "fbs", 9000, 0.2, params={"tau": 0.3}, batch=4),
    ]
    return {"schema": "fbs.bench/1", "protocol": {"prompt_len": 512, "new_tokens": NEW, "runs": 5, "warmup": 1,
                                                  "threads": 2}, "results": rows}


def sweep_row(kind, ppl, tau=None, method=None, **extra):
    row = {"system": kind, "kind": kind, "tau": tau, "ppl": ppl, "ppl_ci": [ppl - 0.5, ppl + 0.5], "skip_ratio": 0.1}
    if method:
        row["method"] = method
    return {**row, **extra}


DOCS = [{"id": "ood-en/a/0", "lang": "en", "tokens": 512}]


def sweep_doc(rows, text="ood"):
    return {"texts": {text: {"rows": rows, "gate_from": 128, "documents": DOCS, "base_ppl": 20.0}}}


FBS_SWEEP = sweep_doc([sweep_row("base", 20.0), sweep_row("full", 18.0), sweep_row("tau", 19.0, 0.5),
                       sweep_row("tau", 21.0, 0.3), sweep_row("random", 30.0, 0.3)])
FFN_SWEEP = sweep_doc([sweep_row("base", 20.0, method="base"), sweep_row("full", 20.0, method="ffn-skipllm"),
                       sweep_row("tau", 20.5, 0.988, "ffn-skipllm"), sweep_row("tau", 22.0, 0.984, "ffn-skipllm")])
FLEXI_SWEEP = sweep_doc([sweep_row("base", 20.0, method="base"), sweep_row("full", 21.0, method="flexidepth"),
                         sweep_row("tau", 24.0, 0.5, "flexidepth", route_prompt=False)])


def mmlu(value, cost):
    n = 40
    per = [1.0] * int(value * n) + [0.0] * (n - int(value * n))
    return TaskResult("mmlu", "acc", {"acc": Metric(value, (value - 0.1, value + 0.1), "acc")},
                      [f"mmlu/x/{i}" for i in range(n)], {"acc": per}, 14042, 1.0, {"cost": cost})


NO_SKIP = {"scored_pairs": 0, "scored_skipped": 0, "decoded_pairs": 0, "decoded_skipped": 0, "decoded_tokens": 0,
           "decoded_tflops_rel_sum": 0.0}


def record(system, value, cost=NO_SKIP):
    rec = make_record(system, {"mmlu": mmlu(value, cost)}, 42, None, 1.0, {})
    return {**rec, "tasks": {k: TaskResult.from_dict(v) for k, v in rec["tasks"].items()}}


RUNS = [("base.json", record({"name": "base", "kind": "hf"}, 0.30)),
        ("fbs.json", record({"name": "FBS tau 0.3", "kind": "fbs", "tau": None, "gate_mode": "threshold",
                             "config": {"tau": 0.3}}, 0.35)),
        ("ffn.json", record({"name": "ffn t=0.988", "kind": "adaptive", "method": "ffn-skipllm", "threshold": 0.988},
                            0.30))]


def doc(**kw):
    args = dict(sweeps=[("fbs.json", FBS_SWEEP), ("ffn.json", FFN_SWEEP), ("flexi.json", FLEXI_SWEEP)], runs=RUNS)
    args.update(kw)
    return assemble(bench_doc(), **args)


def test_classify_reads_names_params_and_variants():
    rows = {r["system"]: r for r in bench_doc()["results"] if r["batch_size"] == 1}
    assert classify(rows["fbs-tau0.3"])["value"] == 0.3 and classify(rows["fbs-tau0.3"])["method"] == "fbs"
    assert classify(rows["fbs-tau0.3-int8"])["weights"] == "int8"
    assert classify(rows["fbs-tau0.3-hole"]) is None and classify(rows["fbs-plan50"]) is None
    assert classify(rows["ffn-skipllm-t0.984"])["value"] == 0.984
    assert classify(rows["kangaroo-exit10"])["value"] == 10 and classify(rows["kangaroo-exit10"])["quality"] == "fbs-full"
    assert classify({"system": "flexidepth-tau0.7"})["route_prompt"] is True  # older bench rows: FlexiDepth's own prefill
    assert classify({"system": "fbs-lossless-tau0.1-int8"})["value"] == 0.1


def test_group_b_rows_match_by_method_and_knob_and_say_not_measured():
    d = doc()
    rows = {r["system"]: r for r in d["rows"]}
    assert list(rows) == ["hf-greedy", "fbs-full-compute", "fbs-tau0.3", "fbs-tau0.5", "fbs-tau0.3-int8",
                          "ffn-skipllm-t0.988", "ffn-skipllm-t0.984", "ffn-skipllm-t0.98", "flexidepth-tau0.5",
                          "fbs-lossless", "kangaroo-exit10"]
    hf, t3 = rows["hf-greedy"], rows["fbs-tau0.3"]
    assert hf["decode_ms_per_token"] == 50.0 and hf["speedup_decode"] == 1.0 and hf["ppl"]["value"] == 20.0
    assert t3["decode_ms_per_token"] == 40.0 and t3["speedup_decode"] == pytest.approx(1.25)
    assert t3["ppl"]["value"] == 21.0 and t3["ppl"]["ci95"] == [20.5, 21.5] and t3["skip_share"] == 0.2
    assert rows["fbs-tau0.5"]["ppl"]["value"] == 19.0 and rows["fbs-full-compute"]["ppl"]["value"] == 18.0
    assert rows["fbs-tau0.3-int8"]["ppl"] is None and "int8" in rows["fbs-tau0.3-int8"]["notes"][0]
    ffn = rows["ffn-skipllm-t0.984"]
    assert ffn["ppl"]["value"] == 22.0 and ffn["skip_unit"] == "FFN blocks" and ffn["skip_share"] == 0.31
    assert rows["ffn-skipllm-t0.98"]["ppl"] is None  # no sweep row at 0.98: never interpolated
    # accuracy: the ffn record is at 0.988; at 0.984 the same record stands in because MMLU skipped nothing
    assert rows["ffn-skipllm-t0.988"]["quality"]["mmlu"]["value"] == 0.30 and not rows["ffn-skipllm-t0.988"]["notes"]
    assert rows["ffn-skipllm-t0.984"]["quality"]["mmlu"]["value"] == 0.30
    assert any("full-depth value at every knob" in n for n in rows["ffn-skipllm-t0.984"]["notes"])
    assert rows["flexidepth-tau0.5"]["quality"]["mmlu"] is None  # no FlexiDepth record
    fd = rows["flexidepth-tau0.5"]
    assert fd["ppl"]["value"] == 24.0 and any("the bench row routes its prompt" in n for n in fd["notes"])
    # FBS at tau 0.5 has no record of its own: the tau-0.3 record's MMLU skipped nothing, so it is the full-depth one
    assert rows["fbs-tau0.5"]["quality"]["mmlu"]["value"] == 0.35
    # lossless: full-depth quality, said so, and the speculative ratios
    ll = rows["fbs-lossless"]
    assert ll["ppl"]["value"] == 18.0 and ll["quality"]["mmlu"]["value"] == 0.35
    assert any(n.startswith("lossless") for n in ll["notes"])
    assert (ll["acceptance"], ll["verified_advance"], ll["tokens_per_pass"], ll["skip_share"]) == (0.94, 0.99, 1.14, 0.07)
    md = markdown(d)
    assert "| FFN-SkipLLM threshold=0.98 (`ffn-skipllm-t0.98`)[" in md
    assert "| skip | 30.0 [20.0, 40.0] (n=40) | not measured | 38.0 | 1.32x / 1.26x | 0.530 | 48.0% FFN blocks | – |" in md
    assert "| FlexiDepth tau=0.5 (`flexidepth-tau0.5`)[" in md and "| not measured | 24.00 [23.50, 24.50] |" in md
    assert "0.94 (VA 0.99, 1.14 tok/pass)" in md and "17.0% FFN blocks" in md
    json.dumps(d)


def test_a_skipping_record_does_not_stand_in_for_another_knob_and_missing_inputs_are_not_measured():
    skipped = dict(NO_SKIP, scored_pairs=100, scored_skipped=20)
    runs = [("fbs.json", record({"name": "FBS", "kind": "fbs", "tau": 0.3, "gate_mode": "threshold"}, 0.35, skipped))]
    rows = {r["system"]: r for r in doc(runs=runs)["rows"]}
    assert rows["fbs-tau0.3"]["quality"]["mmlu"]["value"] == 0.35
    assert rows["fbs-tau0.5"]["quality"]["mmlu"] is None and rows["fbs-lossless"]["quality"]["mmlu"] is None
    bare = {r["system"]: r for r in doc(sweeps=[], runs=[])["rows"]}
    assert all(r["ppl"] is None and r["quality"]["mmlu"] is None for r in bare.values())
    assert "not measured" in markdown(doc(sweeps=[], runs=[]))
    with pytest.raises(ValueError, match="one sweep per method"):  # two FBS sweeps disagree at tau 0.5
        other = copy.deepcopy(FBS_SWEEP)
        other["texts"]["ood"]["rows"][2]["ppl"] = 25.0
        doc(sweeps=[("a.json", FBS_SWEEP), ("b.json", other)])
    chosen = doc(systems=["flexidepth-tau0.5", "hf-greedy"])["rows"]
    assert [r["system"] for r in chosen] == ["flexidepth-tau0.5", "hf-greedy"]


def test_front_by_hand():
    pts = [(46.0, 20.5, "a"), (42.0, 22.0, "b"), (50.0, 21.0, "c")]  # c is slower and worse than a: off the front
    front = pareto_front(pts)
    assert [p[2] for p in front] == ["b", "a"]
    assert front_ppl(front, 44.0) == pytest.approx(21.25) and front_ppl(front, 60.0) == 20.5
    assert front_ppl(front, 41.0) is None


def test_front_statements_on_below_and_above():
    f = doc()["fronts"]
    ffn = f["ffn-skipllm"]
    # FFN-SkipLLM's front: (42 ms, 22.0), (46 ms, 20.5). FBS: tau 0.3 (40, 21.0) is faster than every point,
    # tau 0.5 (45, 19.0) is below the front's 20.875 there, full depth (51, 18.0) below its 20.5
    assert ffn["verdict"] == "on or below"
    where = {v["system"]: (v["where"], v["front_ppl"]) for v in ffn["points"]}
    assert where["fbs-tau0.3"] == ("outside", None)
    assert where["fbs-tau0.5"][0] == "on or below" and where["fbs-tau0.5"][1] == pytest.approx(20.875)
    assert where["fbs-full-compute"] == ("on or below", 20.5)
    assert "ffn-skipllm-t0.988" in ffn["statement"] and "ffn-skipllm-t0.984" in ffn["statement"]  # both dominated
    # a FlexiDepth that is better: FBS is above its front, and the statement says where
    better = copy.deepcopy(FLEXI_SWEEP)
    better["texts"]["ood"]["rows"][2]["ppl"] = 15.0
    fd = doc(sweeps=[("fbs.json", FBS_SWEEP), ("flexi.json", better)])["fronts"]
    assert fd["flexidepth"]["verdict"] == "above"
    assert "NOT on or below the FlexiDepth front at 2 of 3 points" in fd["flexidepth"]["statement"]
    assert "fbs-tau0.5 (45.0 ms/token, PPL 19.00 vs the front's 15.00" in fd["flexidepth"]["statement"]
    assert fd["ffn-skipllm"]["verdict"] is None and "not measured" in fd["ffn-skipllm"]["statement"]


def test_group_b_command_writes_json_and_markdown(tmp_path, capsys):
    paths = {}
    for name, obj in (("bench", bench_doc()), ("fbs", FBS_SWEEP), ("ffn", FFN_SWEEP), ("flexi", FLEXI_SWEEP)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(obj))
    runs = []
    for name, rec in RUNS:
        runs.append(tmp_path / f"run_{name}")
        save_record({**rec, "tasks": {k: v.to_dict() for k, v in rec["tasks"].items()}}, runs[-1])
    out = tmp_path / "gb" / "group_b.json"
    argv = ["eval", "group-b", "--bench", str(paths["bench"]), "--sweeps", str(paths["fbs"]), str(paths["ffn"]),
            str(paths["flexi"]), "--runs", *map(str, runs), "--out", str(out)]
    assert main(argv) == 0
    saved = json.loads(out.read_text())
    assert saved["schema"] == "fbs.group-b/1" and len(saved["rows"]) == 11
    assert saved["warnings"] == [] and saved["rows"][2]["ppl"]["value"] == 21.0
    assert out.with_suffix(".md").read_text() + "\n" == capsys.readouterr().out.split(f"wrote {out}")[0]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": []}))
    assert main(["eval", "group-b", "--bench", str(bad), "--out", str(out)]) == 2
    assert "not an `fbs bench` JSON" in capsys.readouterr().err
