"""Paired (per interleaved round) comparisons of the benchmark: hand-computed oracles on synthetic results.

No model and no timing: SystemResults are built from run lists whose per-round ratios are known exactly.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from fbs.bench import report
from fbs.bench.harness import PairedRatio, Summary, SystemResult, paired_decode, paired_ratio, sign_test_p
from fbs.bench.runner import PAIRED_SAVING_KEYS, decode_vs_ref, skip_saving

FULL = [1.0, 2.0, 4.0, 0.5, 0.25]  # decode s per round at full depth: a large drift; powers of 2 keep x * q / x exact


def result(name: str, decode: list[float], family: str = "fbs", interleaved: bool = True, bytes_rel: float = 1.0,
           skip: float = 0.0, status: str = "ok") -> SystemResult:
    """A measured system: decode runs as given, prefill a tenth of them, total their sum."""
    return SystemResult(name=name, family=family, batch_size=1,
                        params={"weights": "fp32", "batch_policy": "gather", "compile": False},
                        ratio_kind="layer_skip" if family == "fbs" else None, status=status,
                        prefill_s=Summary.of([d / 10 for d in decode]), decode_s=Summary.of(decode),
                        total_s=Summary.of([1.1 * d for d in decode]), peak_rss_mb=100.0, rss_before_mb=90.0,
                        probe={"layer_skip_ratio": skip, "bytes_rel": bytes_rel},
                        budget={"warmup": 0, "runs": len(decode), "probe_prompts": 1}, interleaved=interleaved)


# ----------------------------------------------------------------------------------------------- paired_ratio


def test_ratio_statistics_match_a_hand_computation():
    a = [0.9, 1.6, 4.0, 0.55]  # ratios 0.9, 0.8, 1.0, 1.1
    b = [1.0, 2.0, 4.0, 0.5]
    pr = paired_ratio(a, b)
    assert pr.ratio_mean == pytest.approx(0.95)
    assert pr.ratio_median == pytest.approx(0.95)  # (0.9 + 1.0) / 2
    assert pr.n == 4 and pr.n_resamples == 1000
    assert pr.ci_low <= pr.ratio_mean <= pr.ci_high
    assert 0.8 <= pr.ci_low < pr.ci_high <= 1.1  # the mean of a resample lies within the ratios' range
    # sign test: one tie (round 3) dropped; 2 of the 3 others faster -> P(X >= 2), X ~ Bin(3, 1/2) = 4/8
    assert pr.p_below_one == pytest.approx(0.5)


def test_equal_per_round_savings_give_a_degenerate_ci_whatever_the_drift():
    pr = paired_ratio([0.9 * x for x in FULL], FULL)
    assert pr.ratio_mean == pytest.approx(0.9) and pr.ratio_median == pytest.approx(0.9)
    assert pr.ci_low == pr.ci_high == pr.ratio_mean  # every resample has the same mean


def test_bootstrap_is_seeded_and_uses_the_eval_indices():
    import numpy as np

    from fbs.eval.stats import bootstrap_indices

    a, b = [1.0, 0.7, 0.95, 0.8, 1.2, 0.9], [1.0] * 6
    assert paired_ratio(a, b, seed=3) == paired_ratio(a, b, seed=3)
    means = np.asarray(a)[bootstrap_indices(6, 1000, seed=3)].mean(axis=1)
    pr = paired_ratio(a, b, seed=3)
    assert (pr.ci_low, pr.ci_high) == pytest.approx(tuple(np.percentile(means, [2.5, 97.5])))


def test_clusters_resample_prompts_not_rounds():
    """Two prompts, each timed in 8 rounds: one always 1.0x, the other always 2.0x. Rounds resampled, the mean of 16
    draws rarely strays far from 1.5; prompts resampled (2 clusters), a resample's mean is 1.0, 1.5 or 2.0 with
    probabilities 1/4, 1/2, 1/4, so the 95 % interval is [1.0, 2.0]. The sign test counts prompts: 0 of 2 faster."""
    b = [1.0] * 16
    a = [1.0 if r % 2 == 0 else 2.0 for r in range(16)]
    clusters = [r % 2 for r in range(16)]
    rounds, prompts = paired_ratio(a, b), paired_ratio(a, b, clusters=clusters)
    assert rounds.ratio_mean == prompts.ratio_mean == pytest.approx(1.5)
    assert 1.2 < rounds.ci_low and rounds.ci_high < 1.8 and rounds.n_clusters is None
    assert (prompts.ci_low, prompts.ci_high) == (1.0, 2.0) and prompts.n_clusters == 2 and prompts.n == 16
    assert prompts.p_below_one == 1.0  # no prompt faster: P(X >= 0) over the one prompt that is not a tie
    assert prompts.by_cluster == (1.0, 2.0) and rounds.by_cluster is None  # each prompt's mean, in prompt order
    one_each = paired_ratio([0.9, 0.8, 1.1], [1.0] * 3, clusters=[5, 6, 7])  # one round per cluster: the rounds' CI
    assert one_each == dataclasses.replace(paired_ratio([0.9, 0.8, 1.1], [1.0] * 3), n_clusters=3,
                                           by_cluster=pytest.approx((0.9, 0.8, 1.1)))
    with pytest.raises(ValueError, match="equal numbers of rounds"):
        paired_ratio(a[:3], b[:3], clusters=[0, 0, 1])
    with pytest.raises(ValueError, match="one cluster per round"):
        paired_ratio(a[:3], b[:3], clusters=[0, 1])


def test_paired_decode_resamples_the_prompts_both_results_share():
    b = result("full", [1.0] * 16)
    a = result("draft", [1.0 if r % 2 == 0 else 2.0 for r in range(16)])
    assert paired_decode(a, b).n_clusters is None  # no clusters: rounds
    a.clusters = b.clusters = [r % 2 for r in range(16)]
    assert (paired_decode(a, b).ci_low, paired_decode(a, b).ci_high) == (1.0, 2.0)
    b.clusters = None  # only one side knows its prompts: rounds
    assert paired_decode(a, b).n_clusters is None


def test_sign_test_tail():
    assert sign_test_p(10, 10) == pytest.approx(2**-10)
    assert sign_test_p(0, 10) == 1.0
    assert sign_test_p(2, 3) == pytest.approx(0.5)
    assert sign_test_p(0, 0) == 1.0
    with pytest.raises(ValueError, match="wins <= n"):
        sign_test_p(4, 3)


@pytest.mark.parametrize("a, b, match", [([1.0, 2.0], [1.0], "equal-length"), ([], [], "non-empty"),
                                         ([1.0], [0.0], "positive")])
def test_paired_ratio_rejects_unpairable_input(a, b, match):
    with pytest.raises(ValueError, match=match):
        paired_ratio(a, b)


def test_paired_decode_needs_interleaved_ok_results_of_equal_length():
    full = result("fbs-full-compute", FULL)
    assert isinstance(paired_decode(result("s", FULL), full), PairedRatio)
    assert paired_decode(result("s", FULL, interleaved=False), full) is None
    assert paired_decode(result("s", FULL[:3]), full) is None  # a reduced budget does not pair
    assert paired_decode(result("s", FULL, status="failed"), full) is None
    assert paired_decode(result("s", FULL), result("f", [0.0] + FULL[1:])) is None


# ----------------------------------------------------------------------------------------------- skip_saving


def test_paired_saving_of_a_system_that_saves_in_every_round():
    # 10 rounds, the full engine's time drifting by 2x; the skipping one saves exactly 3 % in each round
    full_runs = [1.0, 1.2, 1.5, 2.0, 1.8, 1.1, 0.9, 1.3, 1.7, 1.4]
    full = result("fbs-full-compute", full_runs, bytes_rel=1.02)
    skipping = result("fbs-tau0.5", [0.97 * x for x in full_runs], bytes_rel=0.918, skip=0.1)  # predicted 10 %
    sv = skip_saving(skipping, [full, skipping])
    assert sv["reference"] == "fbs-full-compute" and sv["predicted"] == pytest.approx(0.1)
    assert sv["paired_saving_mean"] == pytest.approx(0.03) and sv["paired_saving_median"] == pytest.approx(0.03)
    assert sv["paired_ci_low"] == pytest.approx(0.03) and sv["paired_ci_high"] == pytest.approx(0.03)
    assert sv["paired_p_value"] == pytest.approx(2**-10) and sv["paired_n"] == 10
    assert sv["captured_paired"] == pytest.approx(0.3)
    # the unpaired estimate from the medians is still there
    assert sv["measured"] == pytest.approx(1 - Summary.of(skipping.decode_s.runs).median / full.decode_s.median)
    assert sv["captured"] == pytest.approx(sv["measured"] / 0.1)


def test_paired_saving_of_a_system_that_never_saves():
    full = result("fbs-full-compute", FULL, bytes_rel=1.02)
    slower = result("fbs-tau0.5", [1.05 * x for x in FULL], bytes_rel=0.918, skip=0.1)
    sv = skip_saving(slower, [full, slower])
    assert sv["paired_saving_mean"] == pytest.approx(-0.05)
    assert sv["paired_p_value"] == 1.0 and sv["captured_paired"] == pytest.approx(-0.5)


def test_paired_saving_ci_is_the_mirrored_ratio_ci():
    full = result("fbs-full-compute", FULL, bytes_rel=1.0)
    mixed = [0.9, 2.0, 3.8, 0.52, 0.225]  # savings 10 %, 0 %, 5 %, -4 %, 10 %
    skipping = result("fbs-plan25", mixed, bytes_rel=0.8, skip=0.25)
    sv = skip_saving(skipping, [full, skipping])
    pr = paired_ratio(mixed, FULL)
    assert sv["paired_saving_mean"] == pytest.approx(1 - pr.ratio_mean) == pytest.approx(0.042)
    assert sv["paired_saving_median"] == pytest.approx(0.05)
    assert (sv["paired_ci_low"], sv["paired_ci_high"]) == pytest.approx((1 - pr.ci_high, 1 - pr.ci_low))
    assert sv["paired_ci_low"] <= sv["paired_saving_mean"] <= sv["paired_ci_high"]
    assert sv["paired_p_value"] == pytest.approx(sign_test_p(3, 4))  # one round ties; 3 of the other 4 saved


def test_gates_that_skip_nothing_report_their_cost_as_a_negative_saving():
    # tau 1: every gate evaluated, none fires; the gates' columns make its bytes a little larger than full depth's
    full = result("fbs-full-compute", FULL, bytes_rel=1.0)
    gates = result("fbs-tau1.0", [1.04 * x for x in FULL], bytes_rel=1.001, skip=0.0)
    sv = skip_saving(gates, [full, gates])
    assert sv["predicted"] == pytest.approx(-0.001) and sv["captured"] is None and sv["captured_paired"] is None
    assert sv["paired_saving_mean"] == pytest.approx(-0.04) and sv["paired_p_value"] == 1.0
    assert skip_saving(full, [full, gates]) is None  # the reference itself
    assert skip_saving(result("hf-greedy", FULL, family="baseline"), [full]) is None


def test_unpaired_runs_keep_the_median_estimate_and_null_paired_keys():
    full = result("fbs-full-compute", FULL, bytes_rel=1.0, interleaved=False)
    skipping = result("fbs-tau0.5", [0.9 * x for x in FULL], bytes_rel=0.8, skip=0.2, interleaved=False)
    sv = skip_saving(skipping, [full, skipping])
    assert sv["measured"] == pytest.approx(0.1) and sv["captured"] == pytest.approx(0.5)
    assert all(sv[k] is None for k in PAIRED_SAVING_KEYS)


# ----------------------------------------------------------------------------------------------- vs the reference


def test_decode_vs_reference_row():
    ref = result("hf-greedy", FULL, family="baseline")
    fast = result("fbs-tau0.5", [0.8 * x for x in FULL])
    got = decode_vs_ref(fast, ref)
    assert got["reference"] == "hf-greedy" and got["n"] == 5
    assert got["ratio_mean"] == pytest.approx(0.8) and got["ratio_median"] == pytest.approx(0.8)
    assert got["ci_low"] == pytest.approx(0.8) and got["ci_high"] == pytest.approx(0.8)
    assert decode_vs_ref(ref, ref)["ratio_mean"] == 1.0
    assert decode_vs_ref(result("x", FULL, interleaved=False), ref) is None and decode_vs_ref(fast, None) is None


# ----------------------------------------------------------------------------------------------- serialization


def document(results: list[SystemResult], interleave: bool = True) -> dict:
    """A bench document with the given results as records, through JSON text like a saved file."""
    ref = results[0]
    records = [report.result_record(r, 6, ref.total_s.median, (100.0, 100.0), None, skip_saving(r, results),
                                    decode_vs_ref(r, ref)) for r in results]
    doc = {"schema": report.SCHEMA_VERSION, "created": "", "command": "test", "model": {},
           "protocol": {"prompt_len": 16, "new_tokens": 6, "warmup": 0, "runs": 5, "interleave": interleave},
           "environment": {"cpu": "test", "torch_threads": 1, "torch": "x"}, "machine": {}, "results": records,
           "long_context": []}
    return json.loads(json.dumps(doc))


def test_records_keep_runs_in_ms_and_round_trip_to_system_results():
    runs = [0.0123, 0.0456, 0.0111, 0.0999, 0.05]
    res = [result("hf-greedy", runs, family="baseline"), result("fbs-full-compute", FULL, bytes_rel=1.02),
           result("fbs-tau0.5", [0.97 * x for x in FULL], bytes_rel=0.918, skip=0.1)]
    doc = document(res)
    report.validate(doc)
    dec = doc["results"][0]["latency_ms"]["decode"]
    assert dec["runs"] == pytest.approx([1e3 * x for x in runs]) and dec["median"] == pytest.approx(45.6)
    assert doc["results"][2]["decode_vs_ref_paired"]["reference"] == "hf-greedy"
    back = report.results_from_doc(doc)
    for orig, got in zip(res, back):
        for field in ("prefill_s", "decode_s", "total_s"):
            o, g = getattr(orig, field), getattr(got, field)
            assert g.runs == pytest.approx(o.runs) and g.median == pytest.approx(o.median)
            assert g.std == pytest.approx(o.std)
        assert (got.name, got.family, got.ratio_kind, got.status, got.params, got.probe, got.budget) == \
               (orig.name, orig.family, orig.ratio_kind, orig.status, orig.params, orig.probe, orig.budget)
        assert got.interleaved
    # the loaded results give the same paired saving as the measured ones
    sv = skip_saving(back[2], back)
    assert sv["paired_saving_mean"] == pytest.approx(0.03) and sv["paired_n"] == 5


def old_document() -> dict:
    """A document as written before per-run values and paired estimates existed."""
    doc = document([result("hf-greedy", FULL, family="baseline"), result("fbs-full-compute", FULL, bytes_rel=1.02),
                    result("fbs-tau0.5", [0.97 * x for x in FULL], bytes_rel=0.918, skip=0.1)], interleave=False)
    del doc["protocol"]["interleave"]
    for r in doc["results"]:
        del r["decode_vs_ref_paired"]
        for s in r["latency_ms"].values():
            del s["runs"]
        if r["skip_saving"]:
            r["skip_saving"] = {k: r["skip_saving"][k] for k in ("reference", "predicted", "measured", "captured")}
    return doc


def test_old_documents_without_runs_still_load(tmp_path):
    doc = old_document()
    back = report.results_from_doc(doc)
    assert [r.decode_s.runs for r in back] == [[], [], []] and not any(r.interleaved for r in back)
    assert back[0].decode_s.median == pytest.approx(1.0) and back[0].decode_s.std > 0
    sv = skip_saving(back[2], back)  # recomputed from an old file: the median estimate only
    assert sv["measured"] == pytest.approx(0.03) and sv["paired_saving_mean"] is None
    assert decode_vs_ref(back[2], back[0]) is None
    md = report.markdown(doc)
    assert "| fbs-tau0.5 | 1 | 10.0 | 10.0 | 3.0 | 30 | – | – | – |" in md  # paired columns empty

    # the evaluation's readers of bench JSON
    from fbs.eval.groupb import _decode_ms
    from fbs.eval.report import bench_latency

    path = tmp_path / "bench.json"
    path.write_text(json.dumps(doc))
    assert bench_latency(path, "fbs-tau0.5") == pytest.approx(1e3 * 1.1 * 0.97)
    assert _decode_ms(doc["results"][1], 6) == pytest.approx(1e3 * 1.0 / 5)


def test_markdown_shows_the_paired_saving_with_its_ci():
    full_runs = [1.0, 1.2, 1.5, 2.0, 1.8, 1.1, 0.9, 1.3, 1.7, 1.4]
    doc = document([result("hf-greedy", full_runs, family="baseline"),
                    result("fbs-full-compute", full_runs, bytes_rel=1.02),
                    result("fbs-tau0.5", [0.97 * x for x in full_runs], bytes_rel=0.918, skip=0.1)])
    md = report.markdown(doc)
    assert "Paired saving (%) [95% CI]" in md
    assert "| 3.0 [3.0, 3.0] | <0.001 | 30 |" in md


# ----------------------------------------------------------------------------------------------- the harness


class StubSystem:
    """Generates nothing real: reports a fixed decode time per call (the harness's own wall-clock is unused)."""

    family = "fbs"
    params: dict = {}

    def __init__(self, name: str, decode_s: float, max_runs: int | None = None):
        self.name, self.decode_s, self.max_runs = name, decode_s, max_runs

    def unavailable(self, batch_size):
        return ""

    def generate(self, ids, n, probe=False):
        import torch

        from fbs.bench.harness import GenOutput

        return GenOutput(torch.cat([ids, ids[:, :1].repeat(1, n)], dim=1), 0.001, self.decode_s, {})


def test_interleaved_measurement_keeps_pairable_runs_and_sequential_does_not_pair():
    import torch

    from fbs.bench.harness import BenchConfig, measure, measure_interleaved

    prompts = torch.ones(2, 4, dtype=torch.long)
    cfg = BenchConfig(prompt_len=4, new_tokens=2, warmup=1, runs=4, num_prompts=2)
    a, b, slow = StubSystem("a", 0.004), StubSystem("b", 0.005), StubSystem("slow", 0.05, max_runs=2)
    ra, rb, rslow = measure_interleaved([a, b, slow], prompts, cfg)
    assert ra.interleaved and ra.decode_s.runs == [0.004] * 4 and rslow.decode_s.runs == [0.05] * 2
    assert paired_decode(ra, rb).ratio_mean == pytest.approx(0.8)
    assert paired_decode(rslow, ra) is None  # its reduced budget ran 2 of the 4 rounds
    alone = measure(a, prompts, cfg)
    assert not alone.interleaved and alone.decode_s.runs == [0.004] * 4 and paired_decode(alone, rb) is None


def test_recompute_fills_comparisons_a_saved_document_lacks(tmp_path):
    """`fbs bench recompute`: a document saved without the gate row's comparison (as before gated rows that skip
    nothing got one) gets it from its saved runs; rows of another batch size are not compared across sizes."""
    from fbs.bench.runner import recompute_comparisons
    from fbs.cli import main

    full = result("fbs-full-compute", FULL, bytes_rel=1.0)
    gates = result("fbs-tau1", [1.04 * x for x in FULL], bytes_rel=1.001, skip=0.0)
    b2 = [dataclasses.replace(r, batch_size=2) for r in (full, gates)][1:]  # a B = 2 gate row without its reference
    doc = document([full, gates, *b2])
    for r in doc["results"]:
        r["skip_saving"] = r["decode_vs_ref_paired"] = None
    new = recompute_comparisons(doc)
    assert doc["results"][1]["skip_saving"] is None  # the input is not modified
    sv = new["results"][1]["skip_saving"]
    assert sv["reference"] == "fbs-full-compute" and sv["paired_saving_mean"] == pytest.approx(-0.04)
    assert new["results"][1]["decode_vs_ref_paired"]["ratio_mean"] == pytest.approx(1.04)
    assert new["results"][2]["skip_saving"] is None  # B = 2 has no full-depth row
    assert new["results"][2]["decode_vs_ref_paired"]["reference"] == "fbs-tau1"  # its own batch's first row
    assert new["results"][0]["latency_ms"] == doc["results"][0]["latency_ms"]

    src = tmp_path / "bench.json"
    src.write_text(json.dumps({**doc, "model": {"name": "tiny"}}))
    assert main(["bench", "recompute", str(src), "--out-dir", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "bench.json").read_text())["results"][1]["skip_saving"] == sv
    assert "| fbs-tau1 | 1 | 0.0 |" in (tmp_path / "out" / "bench.md").read_text()
    assert main(["bench", "recompute", str(tmp_path / "none.json"), "--out-dir", str(tmp_path)]) == 2
