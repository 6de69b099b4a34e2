"""`fbs eval` subcommands that need no model: list, compare, table, limit parsing."""

from fbs.cli import main
from fbs.eval.cli import _parse_limits
from fbs.eval.report import make_record, save_record
from fbs.eval.stats import bootstrap_ci
from fbs.eval.tasks import Metric, TaskResult


def _record(name, acc, nll):
    ids = [f"q{i}" for i in range(len(acc))]
    tasks = {
        "mmlu": TaskResult("mmlu", "acc", {"acc": Metric(sum(acc) / len(acc), bootstrap_ci(acc), "acc")}, ids,
                           {"acc": acc}, n_total=14042, seconds=1.0),
        "ppl_c4": TaskResult("ppl_c4", "ppl", {"ppl": Metric(2.0, (1.0, 3.0), "nll", "exp_mean", False)},
                             ids, {"nll": nll}, n_total=300, seconds=1.0),
    }
    return make_record({"name": name}, tasks, 42, 40, 2.0, {"seed": 42})


def test_compare_and_table(tmp_path, capsys):
    a = _record("fbs", [1.0] * 40, [2.0] * 40)
    b = _record("base", [0.0] * 20 + [1.0] * 20, [2.5] * 40)
    save_record(a, tmp_path / "a.json")
    save_record(b, tmp_path / "b.json")
    assert main(["eval", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--bh"]) == 0
    out = capsys.readouterr().out
    assert "| mmlu | acc | 100.00 | 50.00 | +50.00* |" in out
    assert "| ppl_c4 | ppl |" in out and "q (BH)" in out
    assert main(["eval", "table", str(tmp_path / "a.json")]) == 0
    out = capsys.readouterr().out
    assert "| fbs |" in out and "n/a" in out and "100.0ᵃ" in out


def test_list_and_limits(capsys):
    assert main(["eval", "list"]) == 0
    assert "gsm8k" in capsys.readouterr().out
    assert _parse_limits("5", ["a", "b"]) == {"a": 5, "b": 5}
    assert _parse_limits("a=3,default=7", ["a", "b"]) == {"a": 3, "b": 7}
    assert _parse_limits("a=3", ["a", "b"]) == {"a": 3}
