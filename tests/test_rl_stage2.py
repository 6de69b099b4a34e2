"""Stage-2 recipe end to end on a tiny model: 2 PPO steps, JSONL reward decomposition, resume, export."""

import argparse
import json

import pytest
import torch
from conftest import fbs_tiny, randomize

from fbs.rl.pool import PoolItem
from fbs.rl.stage2 import Stage2Config, Stage2ConfigError, prompt_order, train_stage2


pytestmark = pytest.mark.usefixtures("one_thread")


class CharTokenizer:
    """Byte-level stand-in for a tokenizer: ids 1..250."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [1 + b % 250 for b in text.encode("utf-8")][:40]}


def _pool(n=5):
    return [PoolItem(f"t/{i}", "mmlu", f"Q{i}?", ("x", "y", "z", "w"), i % 4, f"Q{i}?\nA. x\nB. y\n",
                     f"Answer: {'ABCD'[i % 4]}. {'xyzw'[i % 4]}") for i in range(n)]


def test_stage2_two_steps_end_to_end_and_resume(tmp_path):
    cfg = Stage2Config(out_dir=str(tmp_path / "run"), max_steps=2, batch_size=3, max_new_tokens=5, progress=False,
                       save_every=1, lr=1e-2)
    model = randomize(fbs_tiny("llama", layers=6), seed=5)
    backbone = {n: p.detach().clone() for n, p in model.named_parameters() if not n.startswith("gates.")}
    gates = {n: p.detach().clone() for n, p in model.gates.named_parameters()}
    summary = train_stage2(cfg, model=model, pool=_pool(), tokenizer=CharTokenizer())
    assert summary["steps"] == 2
    log = [json.loads(ln) for ln in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [0, 1]
    for r in log:
        assert abs(r["reward"] - (r["compute_term"] - r["quality_penalty"])) < 1e-6
        assert 0 <= r["skip_ratio"] <= 1 and r["gate_p_mismatch"] < 1e-4 and r["actions"] > 0
    assert log[0]["kl_ref"] > 0  # the first update already moves away from the Stage-1 gates
    assert all(torch.equal(p, backbone[n]) for n, p in model.named_parameters() if n in backbone)
    assert any(not torch.equal(p, gates[n]) for n, p in model.gates.named_parameters())
    assert (tmp_path / "run" / "final" / "fbs_model.safetensors").is_file()
    # resume: a new run with max_steps=3 continues from step 2's checkpoint and runs one step
    cfg3 = Stage2Config(**{**cfg.to_dict(), "max_steps": 3})
    fresh = randomize(fbs_tiny("llama", layers=6), seed=5)
    summary = train_stage2(cfg3, model=fresh, pool=_pool(), tokenizer=CharTokenizer())
    log = [json.loads(ln) for ln in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert summary["steps"] == 3 and [r["step"] for r in log] == [0, 1, 2]


def test_removed_fields_name_the_reason():
    with pytest.raises(Stage2ConfigError, match="gates only"):
        Stage2Config.from_dict({"train_paw": True})
    with pytest.raises(Stage2ConfigError, match="normalised"):
        Stage2Config.from_dict({"baseline": "batch_mean"})
    with pytest.raises(Stage2ConfigError, match="quality"):
        Stage2Config(quality="bleu")


def test_shipped_config_parses():
    from pathlib import Path

    cfg = Stage2Config.from_yaml(Path(__file__).parents[1] / "configs" / "stage2_smollm2.yaml")
    assert cfg.batch_size >= 8 and cfg.kl_coef > 0


def test_prompt_order_covers_pool_each_epoch():
    seen = [i for s in range(5) for i in prompt_order(10, s, 2, seed=3)]
    assert sorted(seen) == list(range(10))
    assert prompt_order(10, 7, 2, 3) == prompt_order(10, 7, 2, 3)


def test_cli_registers_under_train():
    from fbs.rl.cli import register
    from fbs.train.cli import register as register_train

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    register_train(sub)
    register(sub)
    args = parser.parse_args(["train", "stage2", "--max-steps", "3", "--set", "alpha=0.2", "--print-config"])
    assert args.max_steps == 3 and args.print_config
    lone = argparse.ArgumentParser().add_subparsers(dest="command")
    register(lone)
    assert "stage2" in lone.choices
