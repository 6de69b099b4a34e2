"""Stage-2 rollouts: the engine's sampled gates are the actions PPO recomputes."""

import pytest
import torch
from conftest import fbs_tiny, randomize

from fbs.rl.rollout import RolloutOptions, decode_episodes, gate_logprobs


pytestmark = pytest.mark.usefixtures("one_thread")


def test_engine_gate_p_matches_parallel_recompute():
    """Under the project KV policy the engine's recorded p equals the plan-replayed parallel forward's p,
    for a batch of prompts of different lengths (left padding) and rows that stop at different lengths."""
    model = randomize(fbs_tiny("qwen3", layers=6, kv_policy="project"), seed=4)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    acts, engine_p, c_rel, skip, n_new, p = decode_episodes(model, prompts, RolloutOptions(max_new_tokens=10), seed=7)
    assert p == 7 and acts.action_mask.any() and acts.skip_plan.any() and (~acts.skip_plan & acts.action_mask).any()
    _, probs = gate_logprobs(model, acts, p)
    m = acts.action_mask
    torch.testing.assert_close(probs[m], engine_p[m], atol=1e-5, rtol=1e-5)
    assert not (acts.skip_plan & ~m).any()
    assert ((c_rel > 0) & (c_rel < 1.2)).all() and ((skip >= 0) & (skip <= 1)).all()
