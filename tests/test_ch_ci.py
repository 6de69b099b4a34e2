"""Per-block counts of the BIOS metrics and the bootstrap CIs of `fbs eval ch-table` (tiny synthetic data, no files)."""

import argparse
import json
import random

import numpy as np
import pytest

from fbs.data.metrics import (B, COUNT_COLUMNS, EPS, I, IGNORE_INDEX, LABELS, O, S, bios_report, boundary_f1,
                              macro_f1, report_from_counts, sequence_counts, sum_counts)
from fbs.data.probe import IdiomItem, dumps_record, eval_fingerprint, score
from fbs.eval import ch_table
from fbs.eval.ch_table import RecordError, record_from_dict


def random_sequences(rng: random.Random, n: int, max_len: int = 40):
    """(preds, golds) with ignored gold positions, invalid I's (leading, after O/S/ignored) and odd predictions."""
    preds, golds = [], []
    for _ in range(n):
        m = rng.randint(0, max_len)
        golds.append([rng.choice([B, I, O, S, IGNORE_INDEX]) for _ in range(m)])
        preds.append([rng.choice([B, I, I, O, S, IGNORE_INDEX]) for _ in range(m)])
    return preds, golds


def reference_report(preds, golds) -> dict:
    """Pooled metrics written independently of the count rows: the D.1 definitions over all tokens at once."""
    from fbs.data.metrics import repair_labels

    tp, fp, fn = [0] * 4, [0] * 4, [0] * 4
    pset, gset = set(), set()
    for s, (pred, gold) in enumerate(zip(preds, golds)):
        for i, (p, g) in enumerate(zip(repair_labels(pred), gold)):
            if g == IGNORE_INDEX:
                continue
            if p == g:
                tp[g] += 1
            else:
                fn[g] += 1
                if 0 <= p < 4:
                    fp[p] += 1
            if p in (B, S):
                pset.add((s, i))
            if g in (B, S):
                gset.add((s, i))

    def f1(a, b, c):
        p = a / (a + b) if a + b else 0.0
        r = a / (a + c) if a + c else 0.0
        return p, r, 2 * p * r / (p + r + EPS)

    per = {c: f1(tp[k], fp[k], fn[k])[2] for k, c in enumerate(LABELS)}
    bp, br, bf = f1(len(pset & gset), len(pset - gset), len(gset - pset))
    n = sum(g != IGNORE_INDEX for gold in golds for g in gold)
    return {"bios_f1": sum(per.values()) / 4, "per_class_f1": per, "boundary_precision": bp, "boundary_recall": br,
            "boundary_f1": bf, "n_tokens": n}


# --------------------------------------------------------------------------- (a), (b): per-sequence counts


@pytest.mark.parametrize("seed", range(5))
def test_summed_counts_are_bios_report(seed):
    preds, golds = random_sequences(random.Random(seed), 30)
    rows = sequence_counts(preds, golds)
    assert len(rows) == 30 and all(len(r) == len(COUNT_COLUMNS) for r in rows)
    rep = report_from_counts(sum_counts(rows))
    assert rep == bios_report(preds, golds)  # bit-identical: the same floats
    assert rep.to_dict() == reference_report(preds, golds)
    assert (rep.bios_f1, rep.per_class_f1) == macro_f1(preds, golds)
    assert (rep.boundary_precision, rep.boundary_recall, rep.boundary_f1) == boundary_f1(preds, golds)
    # the vectorised F1 of the bootstrap is the same arithmetic
    got = ch_table.f1_from_sums(np.array([sum_counts(rows)]))
    assert (got["bios_f1"][0], got["boundary_f1"][0]) == (rep.bios_f1, rep.boundary_f1)


def test_hand_computed_two_sequences():
    golds = [[B, I, O, S], [O, B, I, IGNORE_INDEX, B]]
    preds = [[B, O, O, S], [I, B, B, I, S]]  # sequence 2 repairs to O B B I S (the leading I is invalid)
    rows = sequence_counts(preds, golds)
    #          B tp fp fn   I tp fp fn   O tp fp fn   S tp fp fn   boundary tp fp fn   tokens
    assert rows[0] == [1, 0, 0, 0, 0, 1, 1, 1, 0, 1, 0, 0, 2, 0, 0, 4]  # I missed as O; boundaries {0, 3} both hit
    assert rows[1] == [1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 1, 0, 2, 1, 0, 4]  # I->B, B->S; ignored position counts nowhere
    total = sum_counts(rows)
    assert total == [2, 1, 1, 0, 0, 2, 2, 1, 0, 1, 1, 0, 4, 1, 0, 8]
    rep = report_from_counts(total)
    # B: P 2/3 R 2/3; I: 0; O: P 2/3 R 1 -> 0.8; S: P 1/2 R 1 -> 2/3; boundary: P 4/5 R 1 -> 8/9
    assert rep.per_class_f1 == pytest.approx({"B": 2 / 3, "I": 0.0, "O": 0.8, "S": 2 / 3})
    assert rep.bios_f1 == pytest.approx(8 / 15)
    assert (rep.boundary_precision, rep.boundary_recall, rep.boundary_f1) == pytest.approx((0.8, 1.0, 8 / 9))
    assert rep.n_tokens == 8 and rep == bios_report(preds, golds)
    assert sum_counts([]) == [0] * len(COUNT_COLUMNS)
    with pytest.raises(ValueError, match="length"):
        sequence_counts([[B]], [[B, O]])
    with pytest.raises(ValueError, match="columns"):
        sum_counts([[1, 2, 3]])


# --------------------------------------------------------------------------- records


def make_record(preds, golds, hits, fingerprint="a" * 64, **extra) -> dict:
    """A record as `fbs probe` writes it (the probe's fields from the library's own scoring functions)."""
    rep = bios_report(preds, golds)
    return {"bios": rep.to_dict(), "idiom_accuracy": sum(hits) / len(hits) if hits else None,
            "n_eval_sequences": len(preds), "n_idiom_items": len(hits), "layer": 15, "model": "tiny",
            "block_counts": sequence_counts(preds, golds), "block_count_columns": list(COUNT_COLUMNS),
            "idiom_hits": list(hits), "eval_fingerprint": fingerprint, **extra}


def random_record(seed: int, n_blocks: int = 40, n_items: int = 30, **extra) -> dict:
    rng = random.Random(seed)
    preds, golds = random_sequences(rng, n_blocks)
    return make_record(preds, golds, [rng.randint(0, 1) for _ in range(n_items)], **extra)


def test_score_and_fingerprint():
    evaluation = [([5, 6, 7, 8], [B, I, O, S]), ([1, 2, 3, 4, 5], [O, B, I, IGNORE_INDEX, B])]
    items = [IdiomItem([1, 2, 3], (0, 2), "a"), IdiomItem([4, 5, 6], (1, 2), "b")]
    sc = score([[B, O, O, S], [I, B, B, I, S]], evaluation, [[B, I, O], [O, B, I]], items)
    assert sc.block_counts == sequence_counts([[B, O, O, S], [I, B, B, I, S]], [y for _, y in evaluation])
    assert sc.idiom_hits == [1, 0] and sc.idiom_accuracy == 0.5  # item 2's span (1, 2) is inside the chunk B I
    assert sc.report == report_from_counts(sum_counts(sc.block_counts))
    fp = eval_fingerprint(evaluation, items)
    assert sc.eval_fingerprint == fp and len(fp) == 64
    assert eval_fingerprint(evaluation[:1], items) != fp  # other blocks
    assert eval_fingerprint([(evaluation[0][0], [O] * 4), evaluation[1]], items) != fp  # other gold labels
    assert eval_fingerprint(evaluation, items[:1]) != fp and eval_fingerprint(evaluation, []) != fp
    assert score([], [], (), ()).idiom_accuracy is None


def test_dumps_record_round_trips_with_one_line_per_block():
    rec = random_record(0, n_blocks=5, n_items=4, train_loss=[2.5, 1e-05, -0.25], note="a [\n] b")
    text = dumps_record(rec)
    assert json.loads(text) == rec
    lines = text.splitlines()
    for row in rec["block_counts"]:
        assert "    [" + ", ".join(map(str, row)) + "]," in lines or "    [" + ", ".join(map(str, row)) + "]" in lines
    assert '  "idiom_hits": [' + ", ".join(map(str, rec["idiom_hits"])) + "]," in lines
    assert '  "train_loss": [2.5, 1e-05, -0.25]' in lines


def test_record_checks():
    rec = random_record(1)
    assert record_from_dict(rec).n_blocks == 40
    old = {k: v for k, v in rec.items() if k not in ("block_counts", "idiom_hits", "eval_fingerprint")}
    with pytest.raises(RecordError, match=r"old\.json: no per-block counts .*re-run `fbs probe` / `fbs eval ch`"):
        record_from_dict(old, "old.json")
    with pytest.raises(RecordError, match="do not reproduce"):
        record_from_dict(rec | {"bios": rec["bios"] | {"bios_f1": 0.5}})
    with pytest.raises(RecordError, match="scored 41 blocks"):
        record_from_dict(rec | {"n_eval_sequences": 41})
    with pytest.raises(RecordError, match="block_count_columns"):
        record_from_dict(rec | {"block_count_columns": list(reversed(COUNT_COLUMNS))})
    no_items = record_from_dict(random_record(2, n_items=0))
    assert no_items.point()["idiom_accuracy"] is None
    assert ch_table.bootstrap_cis(no_items, 50)["idiom_accuracy"] is None


# --------------------------------------------------------------------------- (c), (d), (f): bootstrap


@pytest.mark.parametrize("seed", range(3))
def test_ci_contains_the_point_estimate(seed):
    rec = record_from_dict(random_record(seed, n_blocks=60, n_items=80))
    cis = ch_table.bootstrap_cis(rec, 300, seed=seed)
    for m in ch_table.METRICS:
        assert cis[m]["ci_low"] <= cis[m]["value"] <= cis[m]["ci_high"]
        assert cis[m]["ci_low"] < cis[m]["ci_high"]
    assert cis["bios_f1"]["value"] == rec.data["bios"]["bios_f1"]
    assert cis["idiom_accuracy"]["value"] == rec.data["idiom_accuracy"]


def test_identical_blocks_give_a_degenerate_ci():
    preds, golds = random_sequences(random.Random(3), 1, max_len=30)
    rec = record_from_dict(make_record(preds * 25, golds * 25, [1] * 10))
    cis = ch_table.bootstrap_cis(rec, 200)
    for m in ch_table.METRICS:
        assert cis[m]["ci_low"] == cis[m]["value"] == cis[m]["ci_high"]
    assert cis["idiom_accuracy"]["value"] == 1.0


def test_resamples_are_bootstrap_indices():
    from fbs.eval.stats import bootstrap_indices

    w = ch_table.resample_weights(7, 5, seed=3)
    idx = bootstrap_indices(7, 5, seed=3)
    assert w.shape == (5, 7) and (w.sum(axis=1) == 7).all()
    assert all((w[r] == np.bincount(idx[r], minlength=7)).all() for r in range(5))


def test_paired_with_itself_is_exactly_zero():
    rec = record_from_dict(random_record(4))
    same = ch_table.paired_cis(rec, rec, 200)
    for m in ch_table.METRICS:
        r = same[m]
        assert (r.delta, r.ci_low, r.ci_high, r.p_value) == (0.0, 0.0, 0.0, 1.0)
    assert same["idiom_accuracy"].n == 30 and same["bios_f1"].n == 40


def test_paired_difference_uses_the_same_resamples():
    rng = random.Random(5)
    preds, golds = random_sequences(rng, 50)
    a = record_from_dict(make_record(golds, golds, [1] * 20))  # perfect predictions
    b = record_from_dict(make_record(preds, golds, [0] * 20))
    res = ch_table.paired_cis(a, b, 300)
    for m in ch_table.METRICS:
        assert res[m].delta > 0 and res[m].ci_low > 0 and res[m].p_value == 0.0
    assert res["idiom_accuracy"].delta == 1.0
    assert res["bios_f1"].delta == a.point()["bios_f1"] - b.point()["bios_f1"]


def test_mismatched_fingerprints_raise():
    a = record_from_dict(random_record(6), "a.json")
    b = record_from_dict(random_record(6, eval_fingerprint="b" * 64), "b.json")
    with pytest.raises(RecordError, match="a.json and b.json were scored on different evaluation data"):
        ch_table.paired_cis(a, b, 10)
    with pytest.raises(RecordError, match="different evaluation data"):
        ch_table.ch_table([a, b], base=a, n_resamples=10)
    ch_table.ch_table([a, b], n_resamples=10)  # unpaired CIs need no common data


# --------------------------------------------------------------------------- (e): CLI


def _main(argv):
    from fbs.eval import cli

    parser = argparse.ArgumentParser(prog="fbs")
    cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_table_and_json(tmp_path, capsys):
    rng = random.Random(7)
    preds, golds = random_sequences(rng, 30)
    probe = make_record(preds, golds, [rng.randint(0, 1) for _ in range(20)])
    ch = make_record(golds, golds, [1] * 20, predictor="trained CH", layer=24, checkpoint="ckpt",
                     shipped_checkpoint=True)
    (tmp_path / "probe.json").write_text(dumps_record(probe))
    (tmp_path / "ch.json").write_text(dumps_record(ch))
    out = tmp_path / "t" / "table.json"
    argv = ["eval", "ch-table", str(tmp_path / "probe.json"), str(tmp_path / "ch.json"), "--base",
            str(tmp_path / "probe.json"), "--labels", "base probe,CH", "--resamples", "100", "--out", str(out)]
    assert _main(argv) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0].startswith("| row | predictor | layer | model | checkpoint | BIOS-F1 [95% CI] |")
    assert "Δ idiom accuracy [95% CI]" in lines[0]
    assert lines[2].startswith("| base probe | linear probe | 15 | tiny | frozen base | ")
    assert "| 30 / 20 | base | base | base |" in lines[2]
    # gold labels as predictions: every boundary and idiom right (BIOS-F1 < 1: the gold has invalid I's)
    assert lines[3].startswith("| CH | trained CH | 24 | tiny | ckpt (shipped) | ")
    assert "| 1.000 [1.000, 1.000] | 1.000 [1.000, 1.000] | 30 / 20 |" in lines[3]
    assert "Benjamini–Hochberg over the table's 3 comparisons" in text
    table = json.loads(out.read_text())
    assert table["n_resamples"] == 100 and table["n_comparisons"] == 3 and len(table["rows"]) == 2
    base_row, ch_row = table["rows"]
    assert base_row["is_base"] and base_row["delta"] is None
    assert base_row["bios_f1"]["value"] == probe["bios"]["bios_f1"]
    d = ch_row["delta"]["bios_f1"]
    assert d["delta"] == ch["bios"]["bios_f1"] - probe["bios"]["bios_f1"] and 0 <= d["p_value"] <= d["q_value"] <= 1
    assert f"{d['delta']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}] q {d['q_value']:.3f}" in lines[3]

    # without --base: CIs only, file names as labels
    assert _main(["eval", "ch-table", str(tmp_path / "ch.json"), "--resamples", "20"]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[2].startswith("| ch | trained CH |") and "Δ" not in text

    # clear errors: an old record, other evaluation data, wrong label count
    old = {k: v for k, v in probe.items() if k not in ("block_counts", "idiom_hits", "eval_fingerprint")}
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert _main(["eval", "ch-table", str(tmp_path / "old.json")]) == 2
    assert "re-run `fbs probe` / `fbs eval ch` with this version" in capsys.readouterr().err
    (tmp_path / "other.json").write_text(dumps_record(ch | {"eval_fingerprint": "c" * 64}))
    assert _main(["eval", "ch-table", str(tmp_path / "other.json"), "--base", str(tmp_path / "probe.json")]) == 2
    assert "different evaluation data" in capsys.readouterr().err
    assert _main(["eval", "ch-table", str(tmp_path / "ch.json"), "--labels", "a,b"]) == 2
    assert "2 labels for 1 records" in capsys.readouterr().err


# --------------------------------------------------------------------------- the records of `fbs eval ch`


def test_run_ch_record_carries_the_counts(one_thread):
    from conftest import fbs_tiny, randomize
    from test_eval_ch import ForcedBios

    from fbs.eval import chunks

    model = randomize(fbs_tiny())
    model.ch["3"].bios = ForcedBios([B, I, O, B, S, B, I, I])
    evaluation = [([5, 9, 3, 7, 1, 2, 8, 6], [B, I, I, O, S, B, I, O]), ([4, 4, 6], [B, I, IGNORE_INDEX])]
    items = [IdiomItem([1, 2, 3], (0, 2), "exact B I"), IdiomItem([1, 2, 3, 4, 5, 6], (3, 5), "B S: two chunks")]
    res = chunks.run_ch(model, evaluation, items)
    assert res.block_counts == sequence_counts([[B, I, O, B, S, B, I, I], [B, I, O]], [y for _, y in evaluation])
    assert res.idiom_hits == [1, 0] and res.eval_fingerprint == eval_fingerprint(evaluation, items)
    assert res.block_count_columns == list(COUNT_COLUMNS)
    rec = record_from_dict(json.loads(dumps_record(res.to_dict() | {"predictor": "trained CH"})))
    assert rec.point() == {"bios_f1": res.bios["bios_f1"], "boundary_f1": res.bios["boundary_f1"],
                           "idiom_accuracy": 0.5}
