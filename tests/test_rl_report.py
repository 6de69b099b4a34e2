"""Stage-2 reports: windowed means of the reward decomposition and the grid table, on a hand-made log."""

from __future__ import annotations

import json

import pytest

from fbs.rl.report import decomposition_table, grid_table, read_log, read_sweep, windows


def _run(tmp_path, name, alpha, beta, rewards):
    d = tmp_path / name
    d.mkdir()
    (d / "stage2_config.json").write_text(json.dumps({"alpha": alpha, "beta": beta}))
    recs = [{"step": i + 1, "reward": r, "compute_term": 2 * r, "quality_penalty": r, "delta_nll": 0.5,
             "skip_ratio": 0.1 * (i + 1), "tflops_rel": 1 - 0.1 * (i + 1)} for i, r in enumerate(rewards)]
    # a resumed run rewrites step 2: the last record wins
    lines = [json.dumps(r) for r in recs] + [json.dumps({**recs[1], "reward": 9.0})]
    (d / "log.jsonl").write_text("\n".join(lines) + "\n")
    return d


def test_windows_average_consecutive_steps(tmp_path):
    recs = read_log(_run(tmp_path, "a", 0.1, 0.1, [1.0, 2.0, 3.0, 4.0]))
    assert [r["reward"] for r in recs] == [1.0, 9.0, 3.0, 4.0]
    w = windows(recs, 2)
    assert [(a, b) for a, b, _ in w] == [(1, 2), (3, 4)]
    assert w[0][2]["reward"] == pytest.approx(5.0) and w[1][2]["skip_ratio"] == pytest.approx(0.35)
    assert "| 1-2 |" in decomposition_table(recs, 2)


def test_grid_table_reports_alpha_beta_and_tail_means(tmp_path):
    a = _run(tmp_path, "a", 0.1, 0.1, [1.0, 2.0, 3.0])
    b = _run(tmp_path, "b", 0.2, 0.05, [0.0, 0.0, 0.5])
    table = grid_table([a, b], last=2)
    row_b = next(line for line in table.splitlines() if line.startswith("| b |"))
    assert "| 0.2 | 0.05 | 3 |" in row_b and "+4.7500" in row_b  # mean reward of steps 2 (rewritten: 9.0) and 3


def test_missing_log_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="Stage-2 run directory"):
        read_log(tmp_path)


def test_upto_cuts_every_run_at_the_same_step(tmp_path):
    a = _run(tmp_path, "a", 0.1, 0.1, [1.0, 2.0, 3.0, 4.0])
    assert [r["step"] for r in read_log(a, upto=3)] == [1, 2, 3]
    row = next(line for line in grid_table([a], last=1, upto=3).splitlines() if line.startswith("| a |"))
    assert "| 3 |" in row and "+3.0000" in row


def _sweep(tmp_path, run, name, skip, ppl):
    rows = [{"system": "base", "tau": None, "skip_ratio": 0.0, "tflops_rel": 1.0, "ppl": 15.0},
            {"system": "fbs (nothing skipped)", "tau": None, "skip_ratio": 0.0, "tflops_rel": 1.0, "ppl": 12.5},
            {"system": "fbs", "tau": 0.3, "skip_ratio": skip, "tflops_rel": 1 - skip, "ppl": ppl}]
    path = tmp_path / name
    path.write_text(json.dumps({"rows": rows, "checkpoint": str(run / "final")}))
    return path


def test_grid_table_adds_the_held_out_operating_point_of_each_run(tmp_path):
    a = _run(tmp_path, "a", 0.1, 0.1, [1.0, 2.0])
    b = _run(tmp_path, "b", 0.2, 0.1, [1.0, 2.0])
    run, held = read_sweep(_sweep(tmp_path, a, "sa.json", 0.125, 14.0))
    assert run == a.resolve() and held == {"base": 15.0, "no_skip": 12.5, "taus": {0.3: (0.125, 0.875, 14.0)}}
    table = grid_table([a, b], last=1, sweeps=[tmp_path / "sa.json"])
    assert "held-out Skip % @ τ=0.3" in table.splitlines()[0]
    row_a = next(line for line in table.splitlines() if line.startswith("| a |"))
    row_b = next(line for line in table.splitlines() if line.startswith("| b |"))
    assert row_a.endswith("| 12.50 | 12.5% | 14.00 |")
    assert row_b.endswith("| – | – | – |")  # no sweep for run b
    with pytest.raises(ValueError, match="fbs eval sweep"):
        read_sweep(tmp_path / "a" / "stage2_config.json")
