"""``fbs train segatron``: fine-tune the Segatron-style baseline (:mod:`fbs.baselines.segatron`) at CH's budget.

CH was trained by the Stage-1 recipe (``configs/stage1_smollm2.yaml``, the shipped FBS-S1 model): the corpus of
``fbs data build`` + ``fbs data label``, blocks of 256 tokens, 2,048 tokens per optimizer step, 160 steps
(327,680 tokens), LoRA rank 8 / alpha 16 on every projection of every decoder layer at lr 3e-4, the new modules at
their own lr, AdamW betas (0.9, 0.95), warm-up 4% then cosine to 10%, gradient clip 1.0. This recipe keeps every
one of those and swaps the new modules: Segatron's three segment tables instead of PAW, CH and the gates, and the
plain next-token loss (Segatron has no BIOS head, so no BIOS loss; it never sees the weak labels). The same data
order (:class:`fbs.train.data.BlockOrder`, seed 0) feeds the same blocks in the same order.

Outputs in ``out_dir``: ``log.jsonl`` (per step: loss, lr, grad norm, tokens/s; ``eval`` lines with held-out PPL
and the base's PPL on the same blocks), ``checkpoints/`` (atomic, resumable: rerunning the command continues),
``final/`` (:meth:`Segatron.save_pretrained` + ``train_meta.json``). Only the CLI imports this module.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from . import checkpoint as ckpt
from ..baselines.segatron import Segatron, SegatronConfig, SegatronError
from ..provenance import provenance
from .common import check_recipe_fields, read_yaml_config
from .config import TrainConfigError, apply_overrides
from .data import BlockData, BlockOrder, micro_batch
from .losses import lm_loss
from .stage1 import load_data, lr_factor

logger = logging.getLogger(__name__)

META_NAME = "train_meta.json"


@dataclass
class SegatronTrainConfig:
    """Every knob of the recipe; defaults are Stage-1's (``configs/stage1_smollm2.yaml``) where the two share one."""

    model: str = "smollm2-135m"
    """Base model: a bundled name or an HF directory."""
    segatron: dict = field(default_factory=dict)
    """:class:`fbs.baselines.SegatronConfig` fields (max_paragraphs, max_sentences, max_tokens, lora_rank,
    lora_alpha, lora_targets); unset ones keep that class's defaults. ``--set segatron.lora_rank=0``."""
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
    lr: float = 3.0e-4
    """Peak learning rate of the LoRA factors (Stage-1's ``lr`` for its adapters)."""
    segment_lr: float = 1.0e-3
    """Peak learning rate of the segment tables. Stage-1 gives its fresh modules 1e-2; the tables add straight into
    the residual stream of every token, so they take a tenth of it (a choice, not tuned)."""
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    warmup_frac: float = 0.04
    min_lr_ratio: float = 0.1
    # ---- evaluation, logging, checkpoints ----
    out_dir: str = "runs/segatron"
    eval_every: int = 40
    """Held-out evaluation every N steps (and at start and end); 0 = start and end only."""
    save_every: int = 10
    keep_checkpoints: int = 2
    log_every: int = 1
    progress: bool = True
    seed: int = 0
    """Seed of the LoRA initialization and of the data order."""
    threads: int = 0
    """torch intra-op threads (0 = torch's default)."""

    def __post_init__(self) -> None:
        check_recipe_fields(self, TrainConfigError, floats=("segment_lr",))
        if self.segment_lr <= 0:
            raise TrainConfigError("segment_lr must be > 0")
        try:
            self.segatron_config()
        except ValueError as e:
            raise TrainConfigError(str(e)) from e

    def segatron_config(self) -> SegatronConfig:
        try:
            return SegatronConfig(**self.segatron)
        except TypeError as e:
            raise TrainConfigError(f"segatron: {e}") from e
        except SegatronError as e:
            raise TrainConfigError(str(e)) from e

    @property
    def accumulation(self) -> int:
        return max(1, self.batch_tokens // (self.block_size * self.micro_batch_size))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_yaml(cls, path: str | Path | None, overrides: list[str] | None = None) -> "SegatronTrainConfig":
        d = read_yaml_config(path, TrainConfigError, "SegatronTrainConfig")
        nested = [o for o in overrides or [] if o.startswith("segatron.")]
        d = apply_overrides(d, [o for o in overrides or [] if o not in nested])
        for item in nested:  # segatron.KEY=VALUE sets one SegatronConfig field
            key, _, raw = item[len("segatron."):].partition("=")
            d["segatron"] = {**d.get("segatron", {}), key: yaml.safe_load(raw)}
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TrainConfigError(f"unknown SegatronTrainConfig fields {unknown}")
        return cls(**d)


@torch.no_grad()
def evaluate(model: Segatron, eval_ids: torch.Tensor, batch_size: int = 2) -> dict[str, float]:
    """Held-out PPL of the Segatron model and of its base (segment tables off, LoRA off) on the same blocks: exp of
    the mean next-token NLL over every position."""
    from ..model.lora import LoRALinear

    was = model.training
    model.eval()
    nll = base_nll = tokens = 0.0
    loras = [m for m in model.hf.modules() if isinstance(m, LoRALinear)]
    for i in range(0, len(eval_ids), batch_size):
        ids = eval_ids[i:i + batch_size]
        n = ids.shape[0] * (ids.shape[1] - 1)
        nll += lm_loss(model(ids).logits, ids).item() * n
        scales = [m.scaling for m in loras]
        try:  # the base: LoRA scaled to zero, no segment embedding
            for m in loras:
                m.scaling = 0.0
            base_nll += lm_loss(model.hf(ids).logits, ids).item() * n
        finally:
            for m, s in zip(loras, scales):
                m.scaling = s
        tokens += n
    model.train(was)
    return {"ppl": math.exp(nll / tokens), "ppl_base": math.exp(base_nll / tokens)}


class Trainer:
    """Owns the model, the optimizer and the data order; :meth:`train_step` is one optimizer step."""

    def __init__(self, cfg: SegatronTrainConfig, data: BlockData | None = None, model: Segatron | None = None):
        self.cfg = cfg
        if model is None:
            torch.manual_seed(cfg.seed)
            model = Segatron.from_base(cfg.model, cfg.segatron_config())
        self.model = model.train()
        for p in self.model.parameters():  # the pretrained weights stay frozen
            p.requires_grad_(False)
        self.params = {n: p for n, p in self.model.named_parameters()
                       if n.startswith(("paragraph.", "sentence.", "position.")) or "lora_" in n}
        for p in self.params.values():
            p.requires_grad_(True)
        groups = [{"params": [p for n, p in self.params.items() if "lora_" in n], "peak_lr": cfg.lr},
                  {"params": [p for n, p in self.params.items() if "lora_" not in n], "peak_lr": cfg.segment_lr}]
        groups = [g for g in groups if g["params"]]
        for g in groups:
            g["lr"] = g["peak_lr"]
        self.opt = torch.optim.AdamW(groups, betas=cfg.betas, weight_decay=cfg.weight_decay)
        self.data = data if data is not None else load_data(cfg, self.model.tokenizer)
        self.order = BlockOrder(len(self.data.train_ids), cfg.seed)
        self.step = 0

    def train_step(self) -> dict[str, float]:
        cfg, acc = self.cfg, self.cfg.accumulation
        factor = lr_factor(self.step, cfg)
        for group in self.opt.param_groups:
            group["lr"] = group["peak_lr"] * factor
        self.opt.zero_grad(set_to_none=True)
        t0, losses = time.perf_counter(), []
        for k in range(acc):
            batch = micro_batch(self.data, self.order, self.step * acc + k, cfg.micro_batch_size)
            loss = lm_loss(self.model(batch.input_ids).logits, batch.input_ids)
            (loss / acc).backward()
            losses.append(loss.item())
        norm = torch.nn.utils.clip_grad_norm_(self.params.values(), cfg.grad_clip or float("inf"))
        self.opt.step()
        self.step += 1
        tokens = acc * cfg.micro_batch_size * cfg.block_size
        seg = torch.stack([t.weight.detach().norm(dim=-1).mean() for t in self.model.segment_tables()]).tolist()
        return {"step": self.step, "lm": sum(losses) / len(losses), "lr": cfg.lr * factor,
                "segment_lr": cfg.segment_lr * factor, "grad_norm": float(norm),
                "segment_row_norm": dict(zip(("paragraph", "sentence", "token"), seg)),
                "tokens_per_s": tokens / (time.perf_counter() - t0)}

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

    def budget(self) -> dict:
        """What this run trains on and with: tokens seen and trainable parameters."""
        cfg = self.cfg
        return {"steps": self.step, "tokens": self.step * cfg.accumulation * cfg.micro_batch_size * cfg.block_size,
                "trainable": self.model.trainable_counts()}

    def export(self, results: list[dict]) -> Path:
        final = Path(self.cfg.out_dir) / "final"
        meta = {"config": dataclasses.asdict(self.cfg), **self.budget(), "eval": results, "provenance": provenance()}
        self.model.save_pretrained(final, {"train": {k: meta[k] for k in ("steps", "tokens", "trainable")}})
        (final / META_NAME).write_text(json.dumps(meta, indent=1))
        return final


def train(cfg: SegatronTrainConfig, resume: bool = True, data: BlockData | None = None,
          model: Segatron | None = None) -> dict:
    """Run (or resume) the recipe; returns the summary (final evaluation, export path, budget)."""
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
    return {"final": str(final), **trainer.budget(), "eval": evals[-1]}


def _loop(trainer: Trainer, write, evals: list[dict]) -> None:
    """Optimizer steps up to ``max_steps``; on Ctrl-C the state at the interrupted step's start is saved."""
    from tqdm.auto import tqdm

    cfg = trainer.cfg
    bar = tqdm(total=cfg.max_steps, initial=trainer.step, disable=not cfg.progress, desc="segatron", unit="step")
    while trainer.step < cfg.max_steps:
        rng = ckpt.capture_rng()
        try:
            rec = trainer.train_step()
        except KeyboardInterrupt:
            trainer.save(rng)  # parameters and optimizer change only at the step's end: still the step's start
            raise
        bar.update(1)
        bar.set_postfix(lm=f"{rec['lm']:.3f}")
        if trainer.step % cfg.log_every == 0:
            write(rec)
        if cfg.eval_every and trainer.step % cfg.eval_every == 0 and trainer.step < cfg.max_steps:
            evals.append(trainer.evaluate())
            write(evals[-1])
        if cfg.save_every and (trainer.step % cfg.save_every == 0 or trainer.step == cfg.max_steps):
            trainer.save(ckpt.capture_rng())
    bar.close()
