"""Stage-1 recipe on a tiny random decoder: schedules, config, loss goes down, exact kill-and-resume."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from fbs.train.config import TrainConfig, TrainConfigError
from fbs.train.data import BlockData, BlockOrder, micro_batch
from fbs.train.stage1 import Trainer, evaluate, export, is_soft, load_trained, lr_factor, tau_at

from conftest import tiny_config, tiny_hf


@pytest.fixture(autouse=True)
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def tiny_data(n: int = 8, t: int = 32, seed: int = 0) -> BlockData:
    # a learnable stream: repeated short patterns
    g = torch.Generator().manual_seed(seed)
    pat = torch.randint(0, 64, (4, 8), generator=g)
    rows = [pat[torch.randint(0, 4, (t // 8,), generator=g)].flatten() for _ in range(n + 2)]
    ids = torch.stack(rows)
    return BlockData(ids[:n], None, ids[n:], None)


def tiny_train_config(tmp_path, **kw) -> TrainConfig:
    base = dict(model="tiny", fbs=dataclasses.asdict(tiny_config()), trainable="adapters", block_size=32,
                eval_blocks=2, max_steps=4, batch_tokens=128, micro_batch_size=2, lr=3e-3, fbs_lr=1e-2,
                out_dir=str(tmp_path / "run"), eval_every=0, save_every=0, progress=False, tensorboard=False,
                lora_rank=4, threads=1, skip_every=2, lambda_compute=0.05)
    base.update(kw)
    return TrainConfig(**base)


def test_schedules():
    cfg = TrainConfig(max_steps=100, warmup_frac=0.04, min_lr_ratio=0.1)
    assert lr_factor(0, cfg) == pytest.approx(0.25) and lr_factor(3, cfg) == pytest.approx(1.0)
    assert lr_factor(99, cfg) == pytest.approx(0.1, abs=2e-3)
    assert lr_factor(52, cfg) == pytest.approx(0.55, abs=2e-2)
    assert tau_at(0, cfg) == pytest.approx(0.9) and tau_at(99, cfg) == pytest.approx(0.7)
    two = TrainConfig(skip_every=2)
    assert [is_soft(m, two) for m in range(4)] == [False, True, False, True]


def test_config_yaml_overrides_and_validation(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("lr: 1.0e-4\nmax_steps: 7\nfbs: {k_max: 8}\n")
    cfg = TrainConfig.from_yaml(f, ["lr=3e-4", "fbs.gate_width=4", "eval_taus=[0.8]"])
    assert cfg.lr == 3e-4 and cfg.max_steps == 7 and cfg.fbs == {"k_max": 8, "gate_width": 4}
    assert cfg.eval_taus == (0.8,) and cfg.fbs_config().k_max == 8
    with pytest.raises(TrainConfigError, match="trainable"):
        TrainConfig(trainable="everything")
    with pytest.raises(TrainConfigError, match="unknown"):
        TrainConfig.from_yaml(f, ["learning_rate=1"])
    with pytest.raises(TrainConfigError, match="fbs"):
        TrainConfig(fbs={"k_max": 0})
    with pytest.raises(TrainConfigError, match="batch_tokens"):
        TrainConfig(batch_tokens=10)


def test_data_order_is_a_function_of_the_position():
    data = tiny_data(n=5)
    order = BlockOrder(5, seed=3)
    epoch0 = sorted(order(p) for p in range(5))
    assert epoch0 == list(range(5))
    a = micro_batch(data, order, 3, 2)
    b = micro_batch(data, BlockOrder(5, seed=3), 3, 2)
    assert torch.equal(a.input_ids, b.input_ids) and a.positions.tolist() == [6, 7]
    # two processes read disjoint positions
    r0, r1 = micro_batch(data, order, 1, 2, 0, 2), micro_batch(data, order, 1, 2, 1, 2)
    assert r0.positions.tolist() == [4, 5] and r1.positions.tolist() == [6, 7]


def test_trainable_sets(tmp_path):
    data = tiny_data()
    sizes = {}
    for ts in ("fbs", "adapters", "all"):
        tr = Trainer(tiny_train_config(tmp_path, trainable=ts), data, base=tiny_hf())
        sizes[ts] = sum(p.numel() for p in tr.named.values())
        if ts == "adapters":
            assert all(("lora_" in n) or not n.startswith("base.") for n in tr.named)
    assert sizes["fbs"] < sizes["adapters"] < sizes["all"]
    tr = Trainer(tiny_train_config(tmp_path, trainable="fbs", train_norms=True, train_layers=(-1,)), data,
                 base=tiny_hf())
    assert any("norm" in n for n in tr.named) and any(".layers.5.mlp" in n for n in tr.named)
    assert not any(".layers.4.mlp" in n for n in tr.named)


def test_training_lowers_the_loss(tmp_path):
    data = tiny_data()
    cfg = tiny_train_config(tmp_path, max_steps=12, trainable="all", lr=3e-3)
    tr = Trainer(cfg, data, base=tiny_hf())
    before = evaluate(tr.model, data.eval_ids, 0.7)[0]
    hist = tr.run()
    after = evaluate(tr.model, data.eval_ids, 0.7)[0]
    assert after.ppl_full < 0.8 * before.ppl_full
    assert sum(h["total"] for h in hist[-3:]) < sum(h["total"] for h in hist[:3])
    assert set(hist[0]) >= {"lm", "bios", "align", "preview", "gate", "compute", "distill", "lm_soft", "tokens_per_s"}
    log = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert sum("total" in r for r in log) == 12 and log[0]["step"] == 0 and "eval" in log[0]


def test_kill_and_resume_reproduces_the_uninterrupted_run(tmp_path):
    data = tiny_data()
    n_steps = 4
    full = Trainer(tiny_train_config(tmp_path / "a", max_steps=n_steps), data, base=tiny_hf())
    full.run()

    cfg = tiny_train_config(tmp_path / "b", max_steps=n_steps)
    crashed = Trainer(cfg, data, base=tiny_hf())

    def crash(step, micro):
        if step == 2 and micro == 1:  # in the middle of step 2's gradient accumulation
            raise KeyboardInterrupt("simulated crash in step 2")

    with pytest.raises(KeyboardInterrupt, match="simulated crash in step 2"):
        crashed.run(hook=crash)
    assert crashed.step == 2
    resumed = Trainer(cfg, data, base=tiny_hf())
    assert resumed.resume() and resumed.step == 2
    resumed.run()
    assert resumed.step == n_steps
    for name, p in full.named.items():
        assert torch.equal(p, resumed.named[name]), name
    # the optimizer moments match too
    sa, sb = full.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"]) for i in sa)


def test_export_and_load_trained(tmp_path):
    data = tiny_data()
    cfg = tiny_train_config(tmp_path, max_steps=2)
    tr = Trainer(cfg, data, base=tiny_hf())
    tr.run()
    with torch.no_grad():  # make the adapters matter
        for n, p in tr.named.items():
            if "lora_b" in n:
                p.add_(0.01)
    path = export(tr.model, cfg, tmp_path / "final")
    hf = tiny_hf()
    ids = data.eval_ids[:1]
    with torch.no_grad():
        hf_before = hf(ids).logits
    loaded = load_trained(path, base=hf)
    tr.model.eval()
    with torch.no_grad():
        a = tr.model(ids, gate_mode="off").logits
        b = loaded(ids, gate_mode="off").logits
        hf_after = hf(ids).logits
    torch.testing.assert_close(a, b)
    # the caller's base model is not modified: the adapters went into a private, merged copy
    torch.testing.assert_close(hf_after, hf_before, rtol=0, atol=0)
    assert not any("lora_" in n for n, _ in hf.named_parameters())
    assert not any("lora_" in n for n, _ in loaded.named_parameters())  # merged: no decode overhead


def test_cli_registers_train_stage1(tmp_path, capsys):
    from fbs.cli import main

    assert main(["train", "stage1", "--print-config", "--set", "lr=1e-4", "--max-steps", "3"]) == 0
    out = capsys.readouterr().out
    assert '"lr": 0.0001' in out and '"max_steps": 3' in out
    assert main(["train", "stage1", "--set", "trainable=nope", "--print-config"]) == 2


def test_one_micro_batch_per_step_alternates_modes(tmp_path):
    tr = Trainer(tiny_train_config(tmp_path, batch_tokens=64, max_steps=2), tiny_data(), base=tiny_hf())
    hist = tr.run()
    assert "lm" in hist[0] and "distill" in hist[0] and "lm_soft" not in hist[0]
    assert "lm_soft" in hist[1] and "lm" not in hist[1] and "distill" not in hist[1]


def test_gates_learn_the_oracle(tmp_path):
    data = tiny_data()
    cfg = tiny_train_config(tmp_path, trainable="fbs", max_steps=15, fbs_lr=2e-2, skip_every=0,
                            lambda_paw=0.0, lambda_align=0.0, fbs={**tiny_train_config(tmp_path).fbs,
                                                                   "never_skip_last": 1, "never_skip_first": 1})
    tr = Trainer(cfg, data, base=tiny_hf())
    before = evaluate(tr.model, data.eval_ids, 0.5)[0]
    tr.run()
    after = evaluate(tr.model, data.eval_ids, 0.5)[0]
    assert after.gate_oracle_spearman > 0.5 > abs(before.gate_oracle_spearman)
    assert after.mean_p > 5 * before.mean_p


def test_thresholded_straight_through_gate():
    from fbs.model.gate import straight_through

    p = torch.tensor([0.2, 0.8, 0.71], requires_grad=True)
    g = straight_through(p, tau=0.7)
    assert g.tolist() == pytest.approx([0.0, 1.0, 1.0])
    g.sum().backward()
    assert p.grad.tolist() == [1.0, 1.0, 1.0]


def test_continuing_an_adapter_run_trains_gates_on_its_backbone(tmp_path):
    data = tiny_data()
    cfg = tiny_train_config(tmp_path / "a", max_steps=2)
    tr = Trainer(cfg, data, base=tiny_hf())
    tr.run()
    with torch.no_grad():
        for n, p in tr.named.items():
            if "lora_b" in n:
                p.add_(0.01)
    first = export(tr.model, cfg, tmp_path / "first")
    with pytest.raises(ValueError, match="trainable=fbs"):
        Trainer(tiny_train_config(tmp_path / "b", init_from=str(first)), data, base=tiny_hf())
    cfg2 = tiny_train_config(tmp_path / "c", init_from=str(first), trainable="fbs", max_steps=2,
                             gate_sample="threshold", tau_start=0.9, tau_end=0.9)
    tr2 = Trainer(cfg2, data, base=tiny_hf())
    assert not any("lora_" in n for n in tr2.named)
    tr2.run()
    second = export(tr2.model, cfg2, tmp_path / "second")
    loaded = load_trained(second, base=tiny_hf())
    tr2.model.eval()
    ids = data.eval_ids[:1]
    with torch.no_grad():
        torch.testing.assert_close(tr2.model(ids, gate_mode="off").logits, loaded(ids, gate_mode="off").logits)
        torch.testing.assert_close(tr2.model(ids, gate_mode="threshold", tau=0.5).logits,
                                   loaded(ids, gate_mode="threshold", tau=0.5).logits)
    assert loaded.config.tau == 0.9
