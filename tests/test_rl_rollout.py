"""Stage-2 rollouts: the engine's sampled gates are the actions PPO recomputes from recorded gate inputs."""

import pytest
import torch
from conftest import fbs_tiny, randomize

from fbs.rl.rollout import RolloutOptions, action_probs, generate_trajectory, recording_gate_inputs


pytestmark = pytest.mark.usefixtures("one_thread")


def test_engine_gate_p_equals_recomputed_p_for_a_batch():
    """Under the project KV policy the engine's recorded p equals p recomputed from the replay's recorded gate
    inputs, for a batch of prompts of different lengths (left padding) and rows that stop at different lengths."""
    model = randomize(fbs_tiny("qwen3", layers=6, kv_policy="project"), seed=4)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23]]
    traj = generate_trajectory(model, prompts, RolloutOptions(max_new_tokens=10), seed=7)
    assert traj.skip.any() and (~traj.skip).any()
    assert traj.gate_p_mismatch < 1e-5
    res = model.generate(prompts, max_new_tokens=10, gate_sampling=True, seed=7, batch_policy="gather")
    engine_p = res.trace.gate_p[traj.row, traj.step, traj.layer]
    torch.testing.assert_close(action_probs(model.gates, traj.inputs), engine_p, atol=1e-5, rtol=1e-5)
    assert ((traj.c_rel > 0) & (traj.c_rel < 1.2)).all() and ((traj.skip_ratio >= 0) & (traj.skip_ratio <= 1)).all()
    assert traj.num_new.tolist() == [len(x) for x in res.new_tokens]


def test_recorded_gate_inputs_reproduce_the_parallel_forward():
    model = randomize(fbs_tiny("llama", layers=6), seed=2)
    ids = torch.randint(1, 200, (2, 9), generator=torch.Generator().manual_seed(0))
    sel = torch.zeros(2, 9, dtype=torch.bool)
    sel[0, 3:], sel[1, 5:] = True, True
    layers = model.layers_cfg.gated
    with torch.no_grad(), recording_gate_inputs(model.gates, {l: sel for l in layers}) as inputs:
        out = model(ids, gate_mode="threshold", tau=0.5, gate_from=3)
    assert sorted(inputs) == sorted(layers) and "logits" not in vars(model.gates)  # the wrapper is gone
    expect = torch.cat([out.gate_probs[..., l][sel] for l in sorted(layers)])
    torch.testing.assert_close(action_probs(model.gates, inputs), expect)
