"""`fbs eval merge` / `fbs eval run --append` (fbs.eval.report.merge_records): one system's evaluation run as pieces.

Oracle: a committed protocol record split into two pieces by task and merged back equals the original's tasks and
protocol plan; pieces of different systems or protocols, or with a repeated task, are refused."""

import argparse
import copy
import json
from pathlib import Path

import pytest

from fbs.eval.cli import cmd_merge
from fbs.eval.report import load_record, merge_records

RECORD = Path(__file__).resolve().parents[1] / "results" / "protocol_cpu-small" / "base.json"


def _pieces():
    rec = json.loads(RECORD.read_text())
    names = list(rec["tasks"])
    a, b = copy.deepcopy(rec), copy.deepcopy(rec)
    a["tasks"] = {k: rec["tasks"][k] for k in names[:4]}
    b["tasks"] = {k: rec["tasks"][k] for k in names[4:]}
    for piece in (a, b):
        piece["protocol"]["tasks"] = {k: v for k, v in rec["protocol"]["tasks"].items() if k in piece["tasks"]}
    a["wall_seconds"], b["wall_seconds"] = 10.0, 20.0
    return rec, a, b


def test_merge_of_split_pieces_is_the_original():
    rec, a, b = _pieces()
    merged = merge_records(a, b)
    assert merged["tasks"] == rec["tasks"]
    assert merged["protocol"]["tasks"] == rec["protocol"]["tasks"]
    assert merged["wall_seconds"] == 30.0


def test_merge_refuses_other_system_or_protocol():
    _, a, b = _pieces()
    other = copy.deepcopy(b)
    other["system"]["name"] = "someone else"
    with pytest.raises(ValueError, match="not 'someone else'"):
        merge_records(a, other)
    other = copy.deepcopy(b)
    other["protocol"]["seed"] = 7
    with pytest.raises(ValueError, match="seed 7"):
        merge_records(a, other)


def test_cli_merge_writes_record_and_refuses_repeated_tasks(tmp_path):
    rec, a, b = _pieces()
    pa, pb, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "m.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    assert cmd_merge(argparse.Namespace(records=[str(pa), str(pb)], out=str(out))) == 0
    merged = json.loads(out.read_text())
    assert merged["tasks"] == rec["tasks"]  # as JSON: same tasks, same numbers
    assert set(load_record(out)["tasks"]) == set(rec["tasks"])
    assert out.with_suffix(".md").read_text().startswith("# ")
    with pytest.raises(SystemExit, match="repeats task"):
        cmd_merge(argparse.Namespace(records=[str(pa), str(pa)], out=str(tmp_path / "x.json")))
