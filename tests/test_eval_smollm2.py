"""Slow: the real SmolLM2 base vs a fresh FBS with nothing skipped, through `fbs eval` tasks and through the
lm-eval backend with generated offline task YAMLs (run with `pytest -m slow tests/test_eval_smollm2.py`)."""

import numpy as np
import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def systems():
    import torch

    from fbs import FBSForCausalLM
    from fbs.eval.systems import FBSSystem, HFSystem
    from fbs.model.bases import load_base

    torch.set_num_threads(1)
    model, tok = load_base("smollm2-135m")
    fbs = FBSForCausalLM.from_base(model)
    return HFSystem(model, tok, name="base"), FBSSystem(fbs, tok, gate_mode="off", name="fbs-off")


@pytest.mark.parametrize("task, limit", [("mmlu", 4), ("arc_easy", 4), ("ppl_c4", 3), ("gsm8k", 1)])
def test_fbs_eval_identical_to_base(systems, task, limit):
    from fbs.eval.tasks import run_task

    base, fbs = systems
    rb, rf = run_task(base, task, limit=limit), run_task(fbs, task, limit=limit)
    assert rb.ids == rf.ids
    for key in rb.per_example:
        np.testing.assert_allclose(rf.per_example[key], rb.per_example[key], atol=1e-4, rtol=0)
    if "generations" in rb.details:
        assert rf.details["generations"] == rb.details["generations"]


def test_lm_eval_backend_identical_to_base(systems, tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from fbs.eval.lm_eval_backend import FBSLM, write_task_files

    write_task_files(tmp_path, tasks=["arc_easy"], limit=4, seed=42)
    tm = TaskManager(include_path=str(tmp_path), include_defaults=False)
    out = [simple_evaluate(model=FBSLM(s), tasks=["fbs_arc_easy"], task_manager=tm, log_samples=True)
           for s in systems]
    sb, sf = (o["samples"]["fbs_arc_easy"] for o in out)
    assert len(sb) == len(sf) == 4
    for a, b in zip(sb, sf):
        np.testing.assert_allclose([r[0] for r in a["filtered_resps"]], [r[0] for r in b["filtered_resps"]], atol=1e-4)
        assert a["acc"] == b["acc"]
