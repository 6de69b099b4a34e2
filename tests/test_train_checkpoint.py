"""Atomic checkpoints: pruning, the latest pointer, exact round trip of parameters, optimizer and RNGs."""

from __future__ import annotations

import torch
from torch import nn

from fbs.train import checkpoint as ckpt


def _setup(seed: int):
    torch.manual_seed(seed)
    lin = nn.Linear(3, 2)
    opt = torch.optim.AdamW(lin.parameters(), lr=0.1)
    lin(torch.randn(4, 3)).sum().backward()
    opt.step()
    return lin, opt


def test_save_prune_latest_and_round_trip(tmp_path):
    lin, opt = _setup(0)
    gen = torch.Generator().manual_seed(5)
    named = dict(lin.named_parameters())
    for step in (1, 2, 3):
        rng = ckpt.capture_rng({"gate": gen})
        ckpt.save_checkpoint(tmp_path, step, named, opt, {"tokens_seen": step * 10}, rng, keep=2)
    dirs = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert dirs == ["step-00000002", "step-00000003"]  # pruned, no temp dirs left behind
    latest = ckpt.latest_checkpoint(tmp_path)
    assert latest.name == "step-00000003"
    expected_draw = torch.rand(3, generator=gen)  # what the generator yields after the snapshot
    expected_torch = torch.rand(2)

    other, other_opt = _setup(1)
    gen2 = torch.Generator().manual_seed(99)
    torch.manual_seed(123)
    state = ckpt.load_checkpoint(latest, dict(other.named_parameters()), other_opt, {"gate": gen2})
    assert state["step"] == 3 and state["tokens_seen"] == 30
    for k, p in lin.named_parameters():
        assert torch.equal(p, dict(other.named_parameters())[k])
    a, b = opt.state_dict(), other_opt.state_dict()
    for i in a["state"]:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(a["state"][i][key]), torch.as_tensor(b["state"][i][key]))
    assert a["param_groups"] == b["param_groups"]
    assert torch.equal(torch.rand(3, generator=gen2), expected_draw)
    assert torch.equal(torch.rand(2), expected_torch)


def test_mismatched_trainable_set_is_refused(tmp_path):
    lin, opt = _setup(0)
    ckpt.save_checkpoint(tmp_path, 1, dict(lin.named_parameters()), opt, {}, ckpt.capture_rng())
    other = nn.Linear(3, 2, bias=False)
    try:
        ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path), dict(other.named_parameters()),
                             torch.optim.AdamW(other.parameters()))
    except ValueError as e:
        assert "trainable set" in str(e)
    else:
        raise AssertionError("a checkpoint with other parameters must not load")
