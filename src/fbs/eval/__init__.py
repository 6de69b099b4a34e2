"""Quality evaluation: offline datasets, systems (base / FBS), tasks, bootstrap statistics, code sandbox,
reports, the ``fbs eval`` CLI and an lm-evaluation-harness backend. See docs/eval.md.

    from fbs.eval.systems import HFSystem, FBSSystem
    from fbs.eval.tasks import run_task
    result = run_task(HFSystem(model, tok), "arc_easy", limit=100, seed=42)
"""
