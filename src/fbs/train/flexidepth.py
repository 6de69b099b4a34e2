"""``fbs train flexidepth``: train FlexiDepth's routers and adapters on the Stage-1 corpus and budget.

The recipe of :mod:`fbs.baselines.flexidepth` (Luo et al. 2025): the backbone is frozen, only the routers and
adapters train, with L = L_lm + alpha L_skip over the routed forward (hard routing at tau, gates scaling the
path taken). Data and budget are FBS Stage-1's (``configs/stage1_smollm2.yaml``): the same corpus through
:func:`fbs.train.stage1.load_data`, the same block order (:class:`fbs.train.data.BlockOrder`), blocks of 256
tokens, 2,048 tokens per step, 160 steps, warm-up then cosine (:func:`fbs.train.stage1.lr_factor`).

Outputs in ``out_dir``: ``log.jsonl`` (per step: loss parts, skip rate, layers used, lr, tokens/s; ``eval``
lines), ``checkpoints/`` (atomic, resumable: rerunning the command continues), ``final/``
(:meth:`FlexiDepth.save_pretrained` + ``train_meta.json``). Only the CLI imports this module.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
import yaml

from . import checkpoint as ckpt
from ..baselines.flexidepth import FlexiDepth, FlexiDepthConfig, FlexiDepthOutput, skip_loss
from ..provenance import provenance
from .common import check_recipe_fields, read_yaml_config
from .config import TrainConfigError, apply_overrides
from .data import BlockData, BlockOrder, micro_batch
from .losses import lm_loss
from .stage1 import load_data, lr_factor

logger = logging.getLogger(__name__)

META_NAME = "train_meta.json"


@dataclass
class FlexiDepthTrainConfig:
    """Every knob of the recipe; defaults match FBS Stage-1's budget where the two share a meaning."""

    model: str = "smollm2-135m"
    """Base model: a bundled name or an HF directory (frozen)."""
    flexidepth: dict = field(default_factory=dict)
    """:class:`fbs.baselines.FlexiDepthConfig` fields (layers, tau, router_reduction, adapter_reduction,
    router_init_bias, route_from); unset ones keep that class's defaults. ``--set flexidepth.tau=0.6``."""
    # ---- data (the Stage-1 pipeline) ----
    data: str = "wiki_demo"
    """``wiki_demo`` or a corpus directory from ``fbs data build``."""
    data_cache: str = "~/.cache/fbs/data/train"
    block_size: int = 256
    eval_blocks: int = 8
    max_train_blocks: int | None = None
    # ---- optimization ----
    max_steps: int = 160
    batch_tokens: int = 2048
    micro_batch_size: int = 2
    lr: float = 2.0e-3
    """Peak learning rate of the fresh routers and adapters (the paper: 1e-4 for 3 epochs of Tulu-v2 on 8B)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas (the paper's)."""
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    warmup_frac: float = 0.03
    """Linear warm-up fraction (the paper's 0.03), then cosine to ``min_lr_ratio``."""
    min_lr_ratio: float = 0.1
    alpha: float = 1.0e-3
    """Weight of the layer-skipping loss (the paper's 1e-3); larger skips more."""
    # ---- evaluation, logging, checkpoints ----
    out_dir: str = "runs/flexidepth"
    eval_every: int = 40
    """Held-out evaluation every N steps (and at start and end); 0 = start and end only."""
    save_every: int = 10
    keep_checkpoints: int = 2
    log_every: int = 1
    progress: bool = True
    seed: int = 0
    """Seed of the router and adapter initialization and of the data order."""
    threads: int = 0
    """torch intra-op threads (0 = torch's default)."""

    def __post_init__(self) -> None:
        check_recipe_fields(self, TrainConfigError, floats=("alpha",))
        if self.alpha < 0:
            raise TrainConfigError("alpha must be >= 0")
        try:
            self.flexidepth_config()
        except (TypeError, ValueError) as e:
            raise TrainConfigError(str(e)) from e

    def flexidepth_config(self) -> FlexiDepthConfig:
        return FlexiDepthConfig(**self.flexidepth)

    @property
    def accumulation(self) -> int:
        return max(1, self.batch_tokens // (self.block_size * self.micro_batch_size))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_yaml(cls, path: str | Path | None, overrides: list[str] | None = None) -> "FlexiDepthTrainConfig":
        d = read_yaml_config(path, TrainConfigError, "FlexiDepthTrainConfig")
        nested = [o for o in overrides or [] if o.startswith("flexidepth.")]
        d = apply_overrides(d, [o for o in overrides or [] if o not in nested])
        for item in nested:  # flexidepth.KEY=VALUE sets one FlexiDepthConfig field
            key, _, raw = item[len("flexidepth."):].partition("=")
            d["flexidepth"] = {**d.get("flexidepth", {}), key: yaml.safe_load(raw)}
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TrainConfigError(f"unknown FlexiDepthTrainConfig fields {unknown}")
        return cls(**d)


class StepLoss(NamedTuple):
    total: torch.Tensor      # L_lm + alpha L_skip (in the graph)
    lm: float
    skip: float              # L_skip
    skip_rate: float         # share of routed (token, layer) pairs that took the skip path
    layers_used: float       # mean layers a routed token ran (all layers, routed ones counted as computed)


def step_loss(model: FlexiDepth, input_ids: torch.Tensor, alpha: float) -> StepLoss:
    """The recipe's loss on one micro-batch: L_lm of the routed forward + alpha L_skip."""
    out = model(input_ids)
    lm, skip = lm_loss(out.logits, input_ids), skip_loss(out)
    return StepLoss(lm + alpha * skip, lm.item(), skip.item(), *_usage(model, out))


def _usage(model: FlexiDepth, out: FlexiDepthOutput) -> tuple[float, float]:
    routed = out.routed.unsqueeze(-1).expand_as(out.skips)
    skipped = (out.skips & routed).sum().item()
    n = int(out.routed.sum())
    rate = skipped / max(1, int(routed.sum()))
    return rate, model.num_layers - skipped / max(1, n)


@torch.no_grad()
def evaluate(model: FlexiDepth, eval_ids: torch.Tensor, batch_size: int = 2) -> dict[str, float]:
    """Held-out PPL under routing (exp of the mean token NLL), the share of all (token, layer) pairs of routed
    positions skipped (FBS's Skip %), and the base model's PPL on the same tokens."""
    was = model.training
    model.eval()
    nll = base_nll = skipped = pairs = tokens = 0.0
    for i in range(0, len(eval_ids), batch_size):
        ids = eval_ids[i:i + batch_size]
        out = model(ids)
        n = ids.shape[0] * (ids.shape[1] - 1)
        nll += lm_loss(out.logits, ids).item() * n
        base_nll += lm_loss(model.host(ids, gate_mode="off").logits, ids).item() * n
        skipped += (out.skips & out.routed.unsqueeze(-1)).sum().item()
        pairs += out.routed.sum().item() * model.num_layers
        tokens += n
    model.train(was)
    return {"ppl": math.exp(nll / tokens), "ppl_base": math.exp(base_nll / tokens),
            "skip_ratio": skipped / max(1.0, pairs)}


class Trainer:
    """Owns the model, the optimizer and the data order; :meth:`train_step` is one optimizer step."""

    def __init__(self, cfg: FlexiDepthTrainConfig, data: BlockData | None = None, model: FlexiDepth | None = None):
        self.cfg = cfg
        if model is None:
            torch.manual_seed(cfg.seed)
            model = FlexiDepth.from_base(cfg.model, cfg.flexidepth_config())
        self.model = model.train()
        for p in self.model.host.parameters():  # the pretrained model stays frozen
            p.requires_grad_(False)
        self.params = {n: p for n, p in self.model.named_parameters() if n.startswith(("routers.", "adapters."))}
        for p in self.params.values():
            p.requires_grad_(True)
        self.opt = torch.optim.AdamW(self.params.values(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
        self.data = data if data is not None else load_data(cfg, self.model.tokenizer)
        self.order = BlockOrder(len(self.data.train_ids), cfg.seed)
        self.step = 0

    def train_step(self) -> dict[str, float]:
        cfg, acc = self.cfg, self.cfg.accumulation
        lr = cfg.lr * lr_factor(self.step, cfg)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.zero_grad(set_to_none=True)
        t0, parts = time.perf_counter(), []
        for k in range(acc):
            batch = micro_batch(self.data, self.order, self.step * acc + k, cfg.micro_batch_size)
            loss = step_loss(self.model, batch.input_ids, cfg.alpha)
            (loss.total / acc).backward()
            parts.append(loss)
        norm = torch.nn.utils.clip_grad_norm_(self.params.values(), cfg.grad_clip or float("inf"))
        self.opt.step()
        self.step += 1
        mean = lambda f: sum(getattr(p, f) for p in parts) / len(parts)  # noqa: E731
        tokens = acc * cfg.micro_batch_size * cfg.block_size
        return {"step": self.step, "loss": mean("lm") + cfg.alpha * mean("skip"), "lm": mean("lm"),
                "skip_loss": mean("skip"), "skip_rate": mean("skip_rate"), "layers_used": mean("layers_used"),
                "lr": lr, "grad_norm": float(norm), "tokens_per_s": tokens / (time.perf_counter() - t0)}

    def evaluate(self) -> dict[str, float]:
        return {"eval": True, "step": self.step, **evaluate(self.model, self.data.eval_ids, self.cfg.micro_batch_size)}

    # ---- checkpoints ------------------------------------------------------------------------------
    @property
    def ckpt_dir(self) -> Path:
        return Path(self.cfg.out_dir) / "checkpoints"

    def save(self, rng: dict[str, Any]) -> None:
        ckpt.save_checkpoint(self.ckpt_dir, self.step, self.params, self.opt, {"config": dataclasses.asdict(self.cfg)},
                             rng, keep=self.cfg.keep_checkpoints)

    def resume(self) -> bool:
        path = ckpt.latest_checkpoint(self.ckpt_dir)
        if path is None:
            return False
        self.step = int(ckpt.load_checkpoint(path, self.params, self.opt)["step"])
        logger.info("resumed from %s (step %d)", path, self.step)
        return True

    def export(self, results: list[dict]) -> Path:
        final = Path(self.cfg.out_dir) / "final"
        self.model.save_pretrained(final)
        meta = {"config": dataclasses.asdict(self.cfg), "steps": self.step, "eval": results, "provenance": provenance()}
        (final / META_NAME).write_text(json.dumps(meta, indent=1))
        return final


def train(cfg: FlexiDepthTrainConfig, resume: bool = True, data: BlockData | None = None,
          model: FlexiDepth | None = None) -> dict:
    """Run (or resume) the recipe; returns the summary (final evaluation, export path)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_config.json").write_text(cfg.to_json())
    trainer = Trainer(cfg, data, model)
    evals = []
    with open(out / "log.jsonl", "a") as log:
        def write(rec: dict) -> None:
            log.write(json.dumps(rec) + "\n")
            log.flush()

        if not (resume and trainer.resume()):
            evals.append(trainer.evaluate())
            write(evals[-1])
        _loop(trainer, write, evals)
        evals.append(trainer.evaluate())
        write(evals[-1])
    final = trainer.export(evals)
    return {"final": str(final), "steps": trainer.step, "eval": evals[-1]}


def _loop(trainer: Trainer, write, evals: list[dict]) -> None:
    """Optimizer steps up to ``max_steps``; on Ctrl-C the state at the interrupted step's start is saved."""
    from tqdm.auto import tqdm

    cfg = trainer.cfg
    bar = tqdm(total=cfg.max_steps, initial=trainer.step, disable=not cfg.progress, desc="flexidepth", unit="step")
    while trainer.step < cfg.max_steps:
        rng = ckpt.capture_rng()
        try:
            rec = trainer.train_step()
        except KeyboardInterrupt:
            trainer.save(rng)  # parameters and optimizer change only at the step's end: still the step's start
            raise
        bar.update(1)
        bar.set_postfix(lm=f"{rec['lm']:.3f}", skip=f"{rec['skip_rate']:.3f}")
        if trainer.step % cfg.log_every == 0:
            write(rec)
        if cfg.eval_every and trainer.step % cfg.eval_every == 0 and trainer.step < cfg.max_steps:
            evals.append(trainer.evaluate())
            write(evals[-1])
        if cfg.save_every and (trainer.step % cfg.save_every == 0 or trainer.step == cfg.max_steps):
            trainer.save(ckpt.capture_rng())
    bar.close()
