"""Stage-1 training on two processes (``accelerate launch`` with configs/accelerate_ddp.yaml: DDP, gloo on CPU)
against the same run on one process, which is the oracle.

One module-scoped scenario, on a tiny random Llama with LoRA adapters + PAW/CH/SG, 6 steps, a checkpoint
every 2 steps, 4 micro-batches of 2 x 32 tokens per step (2 per process), soft micro-batches at every third
global index (so each process mixes soft and full-compute micro-batches):

1. one process, in this pytest process: checkpoints at steps 2, 4, 6;
2. two processes: rank 1 stops when the fifth step begins, right after the step-4 checkpoint (a hook in this
   file's worker), and the test kills it with SIGKILL; the run must exit non-zero, name the failure, and
   leave the step-4 checkpoint intact;
3. two processes again: the same command resumes from step 4 and finishes.

This file is also the worker that ``accelerate launch`` starts (``python tests/test_train_multiprocess.py
SPEC.json``), so what runs under two processes is the same ``fbs.train.stage1.train`` the CLI calls.

The scenario (two launches of three Python processes that import torch and transformers) takes about 30 s of
CPU in all: 38 s of wall time on a quiet 2-core machine, but 9-17 minutes when other jobs saturate it (hence
the generous timeouts, which only guard against a hang), so its tests are marked slow (``make test-slow``).
The in-process checks at the end run with the fast suite.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
ACCELERATE_DDP = ROOT / "configs" / "accelerate_ddp.yaml"
STEPS, SAVE_EVERY, HANG_STEP = 6, 2, 4  # HANG_STEP: 0-based, the step after checkpoint 4
# Tolerance of 2 processes against 1. Every micro-batch's forward and backward is the same computation in both
# runs (same blocks, same global-index generator, one thread), so per-micro-batch gradients are bitwise equal;
# only the accumulation order differs (one process sums 4 gradients into .grad in order, two processes each sum
# 2 and gloo averages the sums), which changes fp32 gradients by ~1e-7 relative. AdamW passes that on
# unchanged where |g| >> eps, but an element whose gradient is a near-cancelling sum at the scale of Adam's
# eps (1e-8) has a large relative rounding error and its update lr * g / (|g| + eps) moves by up to ~lr * 1e-3.
# Measured (this config, 6 steps): Adam moments within 2.1e-8; 20 of 35,343 parameter elements differ by more
# than 1e-7, the largest by 5.7e-6 (lr 1e-2), and that difference does not grow with the steps. Hence: every
# element within PARAM_ATOL (3.5x the measured maximum), at most 0.1% of the elements beyond 1e-6, the moments
# within MOMENT_ATOL + 1e-4 relative; and the parameters move by more than 100x PARAM_ATOL in two steps (measured
# 1.6e-2), so a different data order, a lost micro-batch or a wrong loss scale cannot pass.
PARAM_ATOL, MOMENT_ATOL = 2e-5, 1e-7
LAUNCH_TIMEOUT = 900   # s; a loaded 2-core machine needs ~1-2 min just to import torch in three processes
EXIT_AFTER_KILL = 300  # s; a hang would last gloo's 30-minute collective timeout


def tiny_blocks(n: int = 8, t: int = 32, seed: int = 0):
    """(n, t) training blocks and 2 held-out blocks of a learnable stream (repeated 8-token patterns)."""
    from fbs.train.data import BlockData

    g = torch.Generator().manual_seed(seed)
    pat = torch.randint(0, 64, (4, 8), generator=g)
    ids = torch.stack([pat[torch.randint(0, 4, (t // 8,), generator=g)].flatten() for _ in range(n + 2)])
    return BlockData(ids[:n], None, ids[n:], None)


def run_config(out_dir: Path) -> dict:
    from conftest import tiny_config

    return dict(model="tiny", fbs=dataclasses.asdict(tiny_config()), trainable="adapters", lora_rank=4,
                block_size=32, micro_batch_size=2, batch_tokens=4 * 2 * 32, max_steps=STEPS, lr=3e-3, fbs_lr=1e-2,
                skip_every=3, lambda_compute=0.05, save_every=SAVE_EVERY, keep_checkpoints=STEPS // SAVE_EVERY,
                eval_every=0, eval_at_start=False, eval_blocks=2, eval_taus=[0.5], progress=False, tensorboard=False,
                threads=1, out_dir=str(out_dir))


# ---------------------------------------------------------------------------- the worker (one per process)
def worker(spec_path: str) -> None:
    """Run ``fbs.train.stage1.train`` as one process of the launch. Instrumented: every call of
    ``save_checkpoint`` is recorded with the caller's rank, and in the ``kill`` phase rank 1 announces its pid
    and sleeps when step HANG_STEP (0-based) begins, for the test to kill it there."""
    from conftest import tiny_hf

    from fbs.train import checkpoint as ckpt
    from fbs.train import stage1
    from fbs.train.config import TrainConfig

    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ["RANK"])
    save = ckpt.save_checkpoint

    def recorded_save(root, step, *args, **kw):
        with open(spec["saves"], "a") as f:
            f.write(f"{rank} {step}\n")
        return save(root, step, *args, **kw)

    ckpt.save_checkpoint = recorded_save
    if spec["phase"] == "kill":
        micro_step = stage1.Trainer.micro_step

        def hanging_micro_step(self, micro_index):
            if self.rank == 1 and self.step == HANG_STEP:
                tmp = Path(spec["marker"] + ".tmp")
                tmp.write_text(str(os.getpid()))
                tmp.replace(spec["marker"])
                time.sleep(3600)
            return micro_step(self, micro_index)

        stage1.Trainer.micro_step = hanging_micro_step
    stage1.train(TrainConfig.from_dict(spec["config"]), data=tiny_blocks(), base=tiny_hf())


# ---------------------------------------------------------------------------- the launches
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Launch:
    returncode: int
    stderr: str
    saves: list[tuple[int, int]]   # (rank, step) of every save_checkpoint call
    killed_pid: int | None = None


def launch(tmp: Path, out_dir: Path, phase: str) -> Launch:
    """Two processes of this file's worker under ``accelerate launch``; the phase ``kill`` SIGKILLs rank 1 once
    it waits at step HANG_STEP. Only this launch's own process group is ever signalled."""
    spec = {"phase": phase, "config": run_config(out_dir), "saves": str(tmp / f"saves-{phase}.txt"),
            "marker": str(tmp / "rank1.pid")}
    spec_path = tmp / f"spec-{phase}.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(ACCELERATE_DDP),
           "--num_processes", "2", "--main_process_port", str(_free_port()), "--num_cpu_threads_per_process", "1",
           str(Path(__file__).resolve()), str(spec_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent)}
    err_path = tmp / f"stderr-{phase}.txt"
    killed = None
    with open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=tmp, start_new_session=True)
        try:
            if phase == "kill":
                marker, deadline = Path(spec["marker"]), time.monotonic() + LAUNCH_TIMEOUT
                while not marker.is_file():
                    assert proc.poll() is None, f"the launch ended before rank 1 reached step {HANG_STEP}:\n" + \
                        err_path.read_text()[-3000:]
                    assert time.monotonic() < deadline, "rank 1 never reached the hang step"
                    time.sleep(0.2)
                killed = int(marker.read_text())
                os.kill(killed, signal.SIGKILL)
                proc.wait(timeout=EXIT_AFTER_KILL)
            else:
                proc.wait(timeout=LAUNCH_TIMEOUT)
        finally:
            if proc.poll() is None:  # a hang: end this launch's own process group, then fail
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    saves_file = Path(spec["saves"])
    saves = [tuple(map(int, line.split())) for line in saves_file.read_text().splitlines()] if saves_file.is_file() else []
    return Launch(proc.returncode, err_path.read_text(), saves, killed)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from conftest import tiny_hf

    from fbs.train.config import TrainConfig
    from fbs.train.stage1 import train

    tmp = tmp_path_factory.mktemp("multiprocess")
    old = torch.get_num_threads()
    try:
        train(TrainConfig.from_dict(run_config(tmp / "one")), data=tiny_blocks(), base=tiny_hf())
    finally:
        torch.set_num_threads(old)
    killed = launch(tmp, tmp / "two", "kill")
    after_kill = {p.name: load_file(str(p / "trainable.safetensors"))
                  for p in sorted((tmp / "two" / "checkpoints").glob("step-*"))}
    latest_after_kill = (tmp / "two" / "checkpoints" / "latest").read_text().strip()
    resumed = launch(tmp, tmp / "two", "resume")
    return dict(one=tmp / "one", two=tmp / "two", killed=killed, resumed=resumed, after_kill=after_kill,
                latest_after_kill=latest_after_kill)


def assert_params_close(got: dict, want: dict, where: str) -> None:
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=PARAM_ATOL, rtol=0, msg=f"{where}: {name}")
    diff = torch.cat([(got[n] - want[n]).abs().flatten() for n in want])
    assert int((diff > 1e-6).sum()) <= 1e-3 * diff.numel(), f"{where}: {int((diff > 1e-6).sum())} elements beyond 1e-6"


def _checkpoint(run: Path, step: int) -> tuple[dict, dict]:
    d = run / "checkpoints" / f"step-{step:08d}"
    return load_file(str(d / "trainable.safetensors")), load_file(str(d / "optimizer.safetensors"))


def _log(run: Path) -> list[dict]:
    """The training-step lines of a run's log (the final evaluation line left out)."""
    return [r for r in map(json.loads, (run / "log.jsonl").read_text().splitlines()) if "total" in r]


# ---------------------------------------------------------------------------- the checks
@pytest.mark.slow
def test_two_processes_train_the_parameters_of_one(runs):
    for step in range(SAVE_EVERY, STEPS + 1, SAVE_EVERY):
        (p1, o1), (p2, o2) = _checkpoint(runs["one"], step), _checkpoint(runs["two"], step)
        assert p1.keys() == p2.keys() and o1.keys() == o2.keys()
        assert_params_close(p2, p1, f"step {step}")
        for name in o1:  # Adam moments and step counts
            torch.testing.assert_close(o2[name], o1[name], atol=MOMENT_ATOL, rtol=1e-4, msg=f"step {step}: {name}")
    # the tolerance is far below what training changes
    a, b = _checkpoint(runs["one"], 2)[0], _checkpoint(runs["one"], 4)[0]
    assert max(float((a[n] - b[n]).abs().max()) for n in a) > 100 * PARAM_ATOL
    # the logged losses are the global batch's, as in one process
    one, two = _log(runs["one"]), _log(runs["two"])
    assert [r["step"] for r in two] == list(range(1, STEPS + 1))
    for r1, r2 in zip(one, two):
        assert r1.keys() == r2.keys() and r2["tokens"] == r1["tokens"]
        for k in ("total", "lm", "lm_soft", "preview", "distill", "skip_rate_soft"):
            assert r2[k] == pytest.approx(r1[k], rel=1e-5, abs=1e-7), (r1["step"], k)


@pytest.mark.slow
def test_checkpoints_are_written_once_by_the_main_process(runs):
    assert runs["killed"].saves == [(0, 2), (0, 4)]
    assert runs["resumed"].saves == [(0, 6)]
    ck = runs["two"] / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step-00000002", "step-00000004", "step-00000006"]
    assert (ck / "latest").read_text().strip() == "step-00000006"
    assert (runs["two"] / "final" / "train_meta.json").is_file()  # the export, written by the main process
    lines = [json.loads(x) for x in (runs["two"] / "log.jsonl").read_text().splitlines()]
    assert sum("final_eval" in r for r in lines) == 1  # one logger: the main process's
    assert json.loads((runs["two"] / "train_config.json").read_text())["max_steps"] == STEPS


@pytest.mark.slow
def test_a_killed_rank_fails_the_run_and_keeps_the_checkpoints(runs):
    killed = runs["killed"]
    assert killed.returncode != 0
    # the launcher names the failed process and the signal that ended it
    assert "SIGKILL" in killed.stderr and f"{killed.killed_pid}" in killed.stderr, killed.stderr[-3000:]
    # nothing already checkpointed was lost or half-written, and no step after it was saved
    assert runs["latest_after_kill"] == "step-00000004"
    assert sorted(runs["after_kill"]) == ["step-00000002", "step-00000004"]
    assert_params_close(runs["after_kill"]["step-00000004"], _checkpoint(runs["one"], 4)[0], "kept step 4")


@pytest.mark.slow
def test_two_processes_resume_to_the_one_process_result(runs):
    resumed = runs["resumed"]
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = [r["step"] for r in _log(runs["two"])]
    assert steps == list(range(1, STEPS + 1))  # steps 5 and 6 once, after the four of the killed launch
    assert_params_close(_checkpoint(runs["two"], STEPS)[0], _checkpoint(runs["one"], STEPS)[0], "resumed")


# ---------------------------------------------------------------------------- in-process checks
def test_the_global_batch_must_split_over_the_processes(tmp_path):
    from fbs.train.config import TrainConfig
    from fbs.train.stage1 import accumulation_steps

    cfg = TrainConfig.from_dict({**run_config(tmp_path), "batch_tokens": 6 * 2 * 32})
    assert [accumulation_steps(cfg, w) for w in (1, 2, 3, 6)] == [6, 3, 2, 1]
    with pytest.raises(ValueError, match="do not split over 4 processes"):
        accumulation_steps(cfg, 4)


def test_only_rank_zero_may_write_a_checkpoint_and_stale_temp_dirs_go(tmp_path, monkeypatch):
    from torch import nn

    from fbs.train import checkpoint as ckpt

    lin = nn.Linear(2, 2)
    opt = torch.optim.AdamW(lin.parameters())
    stale = tmp_path / ".tmp-step-00000003-999999"  # a writer killed mid-save
    stale.mkdir()
    (stale / "trainable.safetensors").write_bytes(b"partial")
    ckpt.save_checkpoint(tmp_path, 3, dict(lin.named_parameters()), opt, {}, ckpt.capture_rng())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000003"]
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    with pytest.raises(RuntimeError, match="only rank 0"):
        ckpt.save_checkpoint(tmp_path, 4, dict(lin.named_parameters()), opt, {}, ckpt.capture_rng())
    assert ckpt.latest_checkpoint(tmp_path).name == "step-00000003"


@pytest.mark.parametrize("name", ["fsdp", "deepspeed"])
def test_sharded_setups_are_refused_not_silently_checkpointed(name):
    from accelerate.commands.config.config_args import load_config_from_file

    from fbs.train.stage1 import check_distributed

    cfg = load_config_from_file(str(ROOT / "configs" / f"accelerate_{name}.yaml"))  # accelerate parses the file
    with pytest.raises(NotImplementedError, match="DDP"):
        check_distributed(type("Acc", (), {"distributed_type": cfg.distributed_type})())


if __name__ == "__main__":
    worker(sys.argv[1])
