"""The Stage-1 recipe (paper §3.1.3): continual pretraining of FBS with the multi-task loss.

Pieces, top-down: :func:`train` builds a :class:`Trainer` and runs it. The trainer owns the model, the
optimizer, the data order and the RNGs; one optimizer step is :meth:`Trainer.train_step` (gradient
accumulation over :meth:`Trainer.micro_step`), evaluation is :func:`evaluate`.

Gate learning (docs/train.md): micro-batches alternate between

* full compute (``gate_mode="off"``): L_lm without skipping keeps the no-skip quality, and the gates
  regress towards the relative-update oracle of this very pass (L_distill, DESIGN.md §7);
* soft straight-through gates (``gate_mode="soft"``, appendix E.2): the LM loss under sampled skips
  teaches the backbone (adapters) to tolerate skipping and gives the gates the ST gradient, while
  -λ_compute·mean p rewards skipping.

Learning rate: linear warm-up over 4% of the steps, cosine decay to ``min_lr_ratio``; a pure function of
the step. The gate threshold used for held-out skip evaluation anneals linearly 0.9 -> 0.7.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from .. import FBSForCausalLM
from ..model.causal_lm import BACKBONE_NAME, SkipTraining
from ..model.checkpoint import write_manifest
from ..model.gate import relative_updates
from ..model.loading import load_checkpoint, load_fbs
from ..provenance import provenance
from . import checkpoint as ckpt
from .config import TrainConfig
from .data import Batch, BlockData, BlockOrder, corpus_blocks, micro_batch, top_tokens, wiki_demo_blocks
from .adapters import LoRALinear, add_adapters, save_adapters
from .losses import (BudgetThreshold, HarmTargets, LossParts, LossWeights, SkipDistillLoss, Stage1Loss, distill_loss,
                     lm_loss, oracle_targets)

logger = logging.getLogger(__name__)

META_NAME = "train_meta.json"


# ---------------------------------------------------------------------------- schedules
def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of the peak LR at optimizer step ``step`` (0-based): warm-up then cosine."""
    warm = max(1, round(cfg.warmup_frac * cfg.max_steps)) if cfg.warmup_frac > 0 else 0
    if step < warm:
        return (step + 1) / warm
    progress = (step - warm) / max(1, cfg.max_steps - warm)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def tau_at(step: int, cfg: TrainConfig) -> float:
    """Gate threshold annealed linearly from tau_start (step 0) to tau_end (last step)."""
    frac = step / max(1, cfg.max_steps - 1)
    return cfg.tau_start + (cfg.tau_end - cfg.tau_start) * min(1.0, frac)


def accumulation_steps(cfg: TrainConfig, world: int) -> int:
    """Micro-batches per process and optimizer step. The global batch is ``accumulation_steps(cfg, 1)``
    micro-batches whatever the number of processes, so it must split evenly over them."""
    one = max(1, cfg.batch_tokens // (cfg.block_size * cfg.micro_batch_size))
    if one % world:
        raise ValueError(f"batch_tokens={cfg.batch_tokens} makes {one} micro-batches of {cfg.micro_batch_size} x "
                         f"{cfg.block_size} tokens per step, which do not split over {world} processes: the global "
                         f"batch would differ from one process's. Use a batch_tokens that is a multiple of "
                         f"{cfg.block_size * cfg.micro_batch_size * world}.")
    return one // world


def micro_generator(cfg: TrainConfig, micro_index: int, device=None) -> torch.Generator:
    """The generator of global micro-batch ``micro_index`` (gate sampling, layer dropout): a pure function of
    the seed and the index, so the draws do not depend on the number of processes, and resuming needs no
    generator state."""
    return torch.Generator(device=device).manual_seed((cfg.seed * 1_000_003 + 7919 * micro_index + 1) % 2**63)


def is_soft(micro_index: int, cfg: TrainConfig) -> bool:
    if cfg.recipe == "skip_distill":
        return False  # every skip-distillation micro-batch is the same kind
    return cfg.skip_every > 0 and micro_index % cfg.skip_every == cfg.skip_every - 1


def chat_before(micro_index: int, share: float) -> int:
    """Chat micro-batches among micro-batches 0 .. micro_index - 1 (micro-batch m is chat when this count
    grows from m to m + 1): spread evenly, a pure function of the index."""
    return math.floor(micro_index * share + 1e-9)


def is_chat(micro_index: int, share: float) -> bool:
    return chat_before(micro_index + 1, share) > chat_before(micro_index, share)


def is_full_depth(micro_index: int, cfg: TrainConfig) -> bool:
    """skip_distill micro-batches whose student runs every layer (``full_share`` of them, spread evenly)."""
    return is_chat(micro_index, cfg.full_share)


def drop_depth_curve(model: FBSForCausalLM) -> torch.Tensor:
    """(L,) D(l) of LayerSkip's layer dropout over the gated layers: e^(i ln2 / (n-1)) - 1 for the i-th gated
    layer (0 at the first, 1 at the last), 0 on never-skip layers."""
    gated = model.layers_cfg.gated
    d = torch.zeros(model.num_layers)
    n = len(gated)
    for i, l in enumerate(gated):
        d[l] = math.exp(i * math.log(2) / max(1, n - 1)) - 1 if n > 1 else 1.0
    return d


@contextlib.contextmanager
def adapters_disabled(module: nn.Module):
    """Within the block every LoRA adapter of ``module`` is off: the backbone computes the base model."""
    loras = [m for m in module.modules() if isinstance(m, LoRALinear)]
    scales = [m.scaling for m in loras]
    for m in loras:
        m.scaling = 0.0
    try:
        yield
    finally:
        for m, sc in zip(loras, scales):
            m.scaling = sc


# ---------------------------------------------------------------------------- processes
def make_accelerator():
    """The run's :class:`accelerate.Accelerator` (DDP with ``find_unused_parameters``: soft and full-compute
    micro-batches use different parameters).

    Launched as several processes (``accelerate launch --multi_gpu``, ``torchrun``: ``WORLD_SIZE`` > 1) on a
    machine without CUDA, accelerate would give each process a single-process state of its own (it picks the
    CPU group only with ``--cpu``, whose launcher starts one process without mpirun): every process would
    train the whole run alone and write the same checkpoints. Here they join one gloo group instead, and a
    launch whose processes did not join one group is refused."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs
    from accelerate.utils.environment import get_int_from_env

    world = get_int_from_env(["WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"], 1)
    cpu = world > 1 and not torch.cuda.is_available()
    acc = Accelerator(cpu=cpu, kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
    if acc.num_processes != world:
        raise RuntimeError(f"launched as {world} processes, but accelerate set up {acc.num_processes} "
                           f"({acc.distributed_type}): the processes would train independently")
    return acc


def check_distributed(acc) -> None:
    """One process or data parallel (DDP, replicated parameters) only. FSDP and DeepSpeed shard parameters or
    optimizer state (checkpoints here save ``named_parameters()`` and ``optimizer.state_dict()`` of the main
    process, and evaluation runs the unwrapped model), and DeepSpeed steps inside ``backward`` (gradient
    accumulation here uses ``no_sync``); neither has been run. Refused rather than saving shards."""
    from accelerate.utils import DistributedType

    if acc.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        raise NotImplementedError(
            f"fbs train supports one process or DDP (accelerate config: configs/accelerate_ddp.yaml), not "
            f"{acc.distributed_type.value}: its sharded parameters / optimizer state and its own gradient "
            "accumulation are not handled by this trainer's checkpoints and loop (docs/train.md, 'Several processes')")


class _ZeroGradient(torch.autograd.Function):
    """A 0 whose backward gives its input an exact zero gradient (never NaN, whatever the input holds)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.shape = x.shape
        return x.new_zeros(())

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.new_zeros(()).expand(ctx.shape)


def tie_outputs(total: torch.Tensor, out) -> torch.Tensor:
    """``total`` + 0, with a zero gradient for every output tensor of ``out`` that requires grad.

    Under DDP with ``find_unused_parameters`` a parameter that produced an output must receive a gradient, or
    the next step fails ("Expected to have finished reduction in the prior iteration"): this happens whenever a
    loss term is absent from a micro-batch (no BIOS labels, a zero weight). Every process, one or many, adds
    the tie, so an absent term gives a zero gradient (not none) everywhere and the updates stay equal."""
    for f in dataclasses.fields(out):
        v = getattr(out, f.name)
        for t in (v if isinstance(v, tuple) else (v,)):
            if torch.is_tensor(t) and t.requires_grad:
                total = total + _ZeroGradient.apply(t)
    return total


# ---------------------------------------------------------------------------- model and parameters
def build_model(cfg: TrainConfig, base: nn.Module | None = None) -> FBSForCausalLM:
    """The FBS model of ``cfg`` (``base``: an HF model instance to wrap instead of ``cfg.model``)."""
    torch.manual_seed(cfg.seed)
    if cfg.init_from:
        _check_init_from(cfg)
    src = base if base is not None else (None if cfg.init_from else cfg.model)  # None: the checkpoint's own base
    model = load_fbs(src, cfg.init_from, shipped=False, config=None if cfg.init_from else cfg.fbs_config())
    if cfg.trainable == "adapters":
        add_adapters(model.base.layers, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)
    return model


def _backbone_delta_files(path: Path) -> list[Path]:
    from .adapters import ADAPTERS_NAME

    return [f for f in (path / ADAPTERS_NAME, path / BACKBONE_NAME) if f.is_file()]


def _check_init_from(cfg: TrainConfig) -> None:
    """A run started from a Stage-1 export that changed the backbone can only be exported faithfully when
    it trains the FBS modules alone (the export then carries the init's backbone files unchanged) or the
    whole backbone (the export then holds every backbone tensor)."""
    if not _backbone_delta_files(Path(cfg.init_from)):
        return
    if cfg.trainable == "fbs" and not cfg.train_norms and not cfg.train_layers:
        return
    if cfg.trainable == "all":
        return
    raise ValueError(
        f"init_from={cfg.init_from} carries trained backbone tensors (LoRA adapters / norms); continuing it with "
        f"trainable={cfg.trainable!r} (or train_norms / train_layers) would export a checkpoint that cannot "
        "represent both. Use trainable=fbs (gates, PAW, CH on the init's backbone) or trainable=all.")


def select_trainable(model: FBSForCausalLM, cfg: TrainConfig) -> dict[str, nn.Parameter]:
    """Set requires_grad by ``cfg.trainable`` (+ norms / whole layers); returns the trainable params by name."""
    fbs_ids = {id(p) for p in model.fbs_parameters()}
    n_layers = model.num_layers
    extra_layers = {l % n_layers for l in cfg.train_layers}
    for name, p in model.named_parameters():
        if cfg.trainable == "all" or id(p) in fbs_ids:
            on = True
        else:
            on = cfg.trainable == "adapters" and "lora_" in name
            on |= cfg.train_norms and "norm" in name.rsplit(".", 2)[-2]
            on |= any(f".layers.{l}." in name for l in extra_layers)
        p.requires_grad_(on)
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def build_optimizer(model: FBSForCausalLM, named: dict[str, nn.Parameter], cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with four groups: {FBS, backbone} x {decay, no decay}; each group remembers its peak LR."""
    fbs_ids = {id(p) for p in model.fbs_parameters()}
    groups: dict[tuple[bool, bool], list] = {}
    for name, p in named.items():
        no_decay = p.dim() < 2 or "norm" in name or name.endswith(".bias")
        groups.setdefault((id(p) in fbs_ids, no_decay), []).append(p)
    param_groups = [
        {"params": ps, "peak_lr": cfg.fbs_lr if is_fbs else cfg.lr, "lr": cfg.fbs_lr if is_fbs else cfg.lr,
         "weight_decay": 0.0 if nd else cfg.weight_decay}
        for (is_fbs, nd), ps in sorted(groups.items())
    ]
    return torch.optim.AdamW(param_groups, betas=cfg.betas)


def load_data(cfg: TrainConfig, tokenizer) -> BlockData:
    """Token blocks of ``cfg.data``; wiki_demo blocks are cached (safetensors) under ``cfg.data_cache``."""
    if cfg.data == "wiki_demo":
        from safetensors.torch import load_file, save_file

        name = "".join(c if c.isalnum() else "_" for c in str(cfg.model))
        cache = Path(cfg.data_cache).expanduser() / f"wiki_demo-{name}-{cfg.block_size}-{cfg.eval_blocks}.safetensors"
        if cache.is_file():
            t = load_file(str(cache))
            data = BlockData(t["train_ids"], None, t["eval_ids"], None)
        else:
            data = wiki_demo_blocks(tokenizer, cfg.block_size, cfg.eval_blocks)
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(".tmp")
            save_file({"train_ids": data.train_ids.contiguous(), "eval_ids": data.eval_ids.contiguous()}, str(tmp))
            tmp.replace(cache)
        if cfg.max_train_blocks:
            data = data._replace(train_ids=data.train_ids[: cfg.max_train_blocks])
        return data
    return corpus_blocks(cfg.data, tokenizer, cfg.block_size, cfg.eval_blocks, cfg.max_train_blocks)


def gate_mask(model: FBSForCausalLM, b: int, t: int, gate_from: int, device=None) -> torch.Tensor:
    """(B, T, L) bool: the (token, layer) pairs a gate may skip."""
    m = torch.zeros(b, t, model.num_layers, dtype=torch.bool, device=device)
    m[:, gate_from:, list(model.layers_cfg.gated)] = True
    return m


# ---------------------------------------------------------------------------- evaluation
@dataclass
class EvalResult:
    tau: float
    ppl_full: float          # nothing skipped
    ppl_skip: float          # threshold gates at tau
    skip_ratio: float        # skipped / all (token, layer) pairs incl. never-skip layers (the paper's Skip %)
    ppl_random: float        # random per-(token, layer) skips at the same ratio on the gated layers
    ppl_oracle: float        # the relative-update oracle at the same ratio
    gate_oracle_spearman: float  # rank correlation of p with -(relative update) over gated pairs (full pass)
    mean_p: float

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rho of two 1-D tensors (:func:`fbs.eval.stats.spearman`); 0 when one is constant."""
    from ..eval.stats import spearman

    rho = spearman(a.detach().double().cpu().numpy(), b.detach().double().cpu().numpy())
    return 0.0 if math.isnan(rho) else rho


@torch.no_grad()
def evaluate(model: FBSForCausalLM, eval_ids: torch.Tensor, taus: float | list[float], gate_from: int = 0,
             micro_batch_size: int = 2, seed: int = 0) -> list[EvalResult]:
    """Held-out PPL with nothing skipped, with threshold skipping at each tau, and with random and oracle
    skips at the same per-batch ratio (teacher-forced parallel forward, ``project`` KV semantics).
    The full-compute pass is shared by all taus."""
    taus = [taus] if isinstance(taus, float) else list(taus)
    was_training = model.training
    model.eval()
    g = torch.Generator().manual_seed(seed)
    full_nll, n_tok, gated_total, all_total, psum = 0.0, 0, 0.0, 0.0, 0.0
    acc = {tau: dict(skip=0.0, random=0.0, oracle=0.0, skipped=0.0) for tau in taus}
    ps, us = [], []
    dev = next(model.parameters()).device
    for i in range(0, len(eval_ids), micro_batch_size):
        ids = eval_ids[i:i + micro_batch_size].to(dev)
        b, t = ids.shape
        mask = gate_mask(model, b, t, gate_from, dev)
        ntok = b * (t - 1)
        full = model(ids, gate_mode="off", output_hidden_states=True)
        full_nll += float(lm_loss(full.logits, ids)) * ntok
        u = relative_updates(full.hidden_states)  # (B, T, L)
        ps.append(full.gate_probs[mask].float().cpu()), us.append(u[mask].float().cpu())
        psum += float(full.gate_probs[mask].sum())
        gated_total += float(mask.sum())
        all_total += b * t * model.num_layers
        n_tok += ntok
        for tau in taus:
            out = model(ids, gate_mode="threshold", tau=tau, gate_from=gate_from)
            acc[tau]["skip"] += float(lm_loss(out.logits, ids)) * ntok
            k = int(out.skips[mask].sum())
            acc[tau]["skipped"] += k
            # random and oracle plans with exactly k skipped gated pairs
            rand_plan, oracle_plan = torch.zeros_like(mask), torch.zeros_like(mask)
            if k:
                flat = mask.flatten().nonzero().squeeze(-1)
                rand_plan.view(-1)[flat[torch.randperm(len(flat), generator=g)[:k].to(dev)]] = True
                score = u.masked_fill(~mask, float("inf")).flatten()
                oracle_plan.view(-1)[score.topk(k, largest=False).indices] = True
                for name, plan in (("random", rand_plan), ("oracle", oracle_plan)):
                    o = model(ids, gate_mode="plan", skip_plan=plan, gate_from=0)
                    acc[tau][name] += float(lm_loss(o.logits, ids)) * ntok
            else:
                acc[tau]["random"] += float(lm_loss(full.logits, ids)) * ntok
                acc[tau]["oracle"] += float(lm_loss(full.logits, ids)) * ntok
    model.train(was_training)
    rho = _spearman(torch.cat(ps), -torch.cat(us).clamp_min(1e-8).log())
    ppl = lambda nll: math.exp(nll / n_tok)  # noqa: E731
    return [EvalResult(tau, ppl(full_nll), ppl(a["skip"]), a["skipped"] / all_total, ppl(a["random"]),
                       ppl(a["oracle"]), rho, psum / max(gated_total, 1)) for tau, a in acc.items()]


# ---------------------------------------------------------------------------- the trainer
class Trainer:
    """Owns model, optimizer, data order and RNGs of one Stage-1 run."""

    def __init__(self, cfg: TrainConfig, data: BlockData, model: FBSForCausalLM | None = None,
                 accelerator=None, base: nn.Module | None = None):
        self.cfg = cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.acc = accelerator or make_accelerator()
        check_distributed(self.acc)
        self.rank, self.world = self.acc.process_index, self.acc.num_processes
        self.accum = accumulation_steps(cfg, self.world)  # before the model: a bad geometry fails at once
        self.model = model if model is not None else build_model(cfg, base)
        if cfg.preview_vocab_from_data and not cfg.init_from:
            n = self.model.preview_ids.numel()
            self.model.set_preview_vocab(top_tokens(data.train_ids, n, self.model.base.spec.vocab_size))
        self.named = select_trainable(self.model, cfg)
        self.optimizer = build_optimizer(self.model, self.named, cfg)
        self.wrapped, self.optimizer = self.acc.prepare(self.model, self.optimizer)
        self.data, self.order = data, BlockOrder(len(data.train_ids), cfg.seed)
        self.loss_fn = Stage1Loss(
            LossWeights(lm=cfg.lambda_lm, bios=cfg.lambda_bios, align=cfg.lambda_align, paw=cfg.lambda_paw, gate=cfg.lambda_gate,
                        compute=cfg.lambda_compute, distill=cfg.lambda_distill),
            cfg.window_credit, cfg.align_kind, cfg.align_temperature, cfg.gate_max_rate, cfg.gate_entropy,
            cfg.preview_floor)
        self.step = 0
        self.tokens_seen = 0
        self.out_dir = Path(cfg.out_dir)
        self.ckpt_dir = self.out_dir / "checkpoints"
        self.history: list[dict] = []
        self._stop = False       # this process was asked to stop (SIGTERM)
        self._stop_all = False   # some process was: all leave the loop after the same step
        self.distill = cfg.recipe == "skip_distill"
        if self.distill:
            self._init_distill()
            if self.world > 1:
                logger.warning("skip_distill on %d processes: the budget threshold and the harm targets are kept "
                               "per process (not equal to a one-process run)", self.world)

    def _init_distill(self) -> None:
        cfg, model = self.cfg, self.model
        self.loss_fn = SkipDistillLoss(cfg.lambda_kl, cfg.lambda_lm, cfg.lambda_bios, cfg.lambda_align, cfg.lambda_paw,
                                       cfg.window_credit, cfg.align_kind, cfg.align_temperature, cfg.preview_floor)
        gated_share = cfg.target_skip * model.num_layers / max(1, len(model.layers_cfg.gated))
        if gated_share >= 1:
            raise ValueError(f"target_skip={cfg.target_skip} needs {gated_share:.0%} of the gated layers "
                             f"{model.layers_cfg.gated}: allow more layers to skip (fbs.never_skip_first/last)")
        self.gated_share = gated_share
        self.harm = HarmTargets(gated_share, cfg.harm_weight)
        self.budget = BudgetThreshold()
        self.drop_depth = drop_depth_curve(model).to(self.acc.device)
        # the teacher is the base model: the backbone itself with adapters off, or a frozen copy when it trains
        self.teacher = copy.deepcopy(model.base.hf).eval().requires_grad_(False) if cfg.trainable == "all" else None
        self.chat = None
        if cfg.chat_share > 0:
            from ..data.chat import chat_blocks, read_items

            blocks = chat_blocks(read_items(Path(cfg.chat_data) / "train.jsonl"), model.tokenizer, cfg.block_size)
            self.chat = BlockData(blocks, None, blocks[:0], None)
            self.chat_order = BlockOrder(len(blocks), cfg.seed + 1)
            logger.info("chat data: %d blocks of %d tokens, %.0f%% of micro-batches", len(blocks), cfg.block_size,
                        100 * cfg.chat_share)

    # ---- state ----
    def resume(self, path: str | Path | None = None) -> bool:
        """Restore the newest (or the given) checkpoint; False when there is none."""
        path = Path(path) if path else ckpt.latest_checkpoint(self.ckpt_dir)
        if path is None:
            return False
        state = ckpt.load_checkpoint(path, self.named, self.optimizer)
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        if self.distill:
            self.harm.load_state_dict(state.get("harm", {}))
            self.budget.tau = state.get("gate_tau")
        logger.info("resumed from %s at step %d", path, self.step)
        return True

    def save(self, rng: dict[str, Any], barrier: bool = True) -> None:
        """The main process writes the checkpoint (parameters and optimizer state are replicated, so its copy
        is everyone's); the others wait for it unless ``barrier`` is off (on an interrupt, when the other
        processes may never reach the barrier)."""
        if self.acc.is_main_process:
            state = {"tokens_seen": self.tokens_seen, "config": self.cfg.to_dict(), "accum": self.accum,
                     "world": self.world}
            if self.distill:
                state["harm"] = self.harm.state_dict()
                state["gate_tau"] = self.budget.tau
            ckpt.save_checkpoint(self.ckpt_dir, self.step, self.named, self.optimizer, state, rng,
                                 self.cfg.keep_checkpoints)
        if barrier:
            self.acc.wait_for_everyone()

    # ---- one step ----
    def _batch(self, micro_index: int) -> Batch:
        """Global micro-batch ``micro_index`` (the same blocks whichever process runs it)."""
        cfg = self.cfg
        size = cfg.micro_batch_size
        if self.distill and self.chat is not None:
            if is_chat(micro_index, cfg.chat_share):
                return micro_batch(self.chat, self.chat_order, chat_before(micro_index, cfg.chat_share), size)
            return micro_batch(self.data, self.order, micro_index - chat_before(micro_index, cfg.chat_share), size)
        return micro_batch(self.data, self.order, micro_index, size)

    @torch.no_grad()
    def teacher_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, T, V) logits of the base model: no adapters, no FBS modules."""
        if self.teacher is not None:
            return self.teacher(input_ids=ids).logits
        model = self.acc.unwrap_model(self.wrapped)
        with adapters_disabled(model.base.layers):
            return model.base.hf(input_ids=ids).logits

    def distill_micro_step(self, micro_index: int):
        """One skip-distillation micro-batch: teacher pass, then the student under gates + random dropout."""
        cfg = self.cfg
        batch = self._batch(micro_index)
        ids = batch.input_ids.to(self.acc.device)
        bios = batch.bios_labels.to(self.acc.device) if batch.bios_labels is not None else None
        b, t = ids.shape
        mask = gate_mask(self.model, b, t, cfg.gate_from, ids.device)
        teacher = self.teacher_logits(ids)
        gen = micro_generator(cfg, micro_index, ids.device)
        frac = self.step / max(1, cfg.max_steps)
        tau, force = 1.0, None  # tau 1.0: p > tau never holds, the gates do not skip
        if not (cfg.control or is_full_depth(micro_index, cfg)):
            rate = cfg.drop_max * (min(1.0, frac / cfg.drop_ramp) if cfg.drop_ramp > 0 else 1.0)
            u = torch.rand(b, t, self.model.num_layers, generator=gen, device=ids.device)
            force = (u < rate * self.drop_depth) & mask
            tau = self.budget.current()
        self.harm.n_pairs = max(1, int(mask.sum())) * self.accum
        model = self.acc.unwrap_model(self.wrapped)
        by_harm = cfg.gate_targets == "harm" and not cfg.control
        hook = model.gates.logit_hook(self.harm) if by_harm else contextlib.nullcontext()
        with hook:
            out = self.wrapped(ids, gate_mode="soft", gate_from=cfg.gate_from, soft_window=True, generator=gen,
                               soft_sample="threshold", tau=tau,
                               skip_training=SkipTraining(force_skip=force, straight_through=by_harm,
                                                          detach_gate_inputs=True))
        if not cfg.control:
            self.budget.update(out.gate_probs.detach()[mask], self.gate_share(frac))
        parts = self.loss_fn(out, teacher, ids, model.preview_targets(ids), mask, tau, bios)
        if cfg.gate_targets == "update" and not cfg.control:
            targets = oracle_targets(out.layer_updates, mask, self.gated_share, temperature=1e-3)
            gate = distill_loss(out.gate_probs, targets.round(), mask)
            parts = parts._replace(total=parts.total + cfg.harm_weight * gate)
        return parts._replace(total=tie_outputs(parts.total, out))

    def gate_share(self, frac: float) -> float:
        """Share of the gated pairs the gates skip at training progress ``frac``: 0 before gate_start, then a
        linear ramp to the budget over budget_ramp."""
        cfg = self.cfg
        if frac < cfg.gate_start:
            return 0.0
        ramp = min(1.0, (frac - cfg.gate_start) / cfg.budget_ramp) if cfg.budget_ramp > 0 else 1.0
        return ramp * self.gated_share

    def micro_step(self, micro_index: int) -> LossParts:
        cfg = self.cfg
        if self.distill:
            return self.distill_micro_step(micro_index)
        batch: Batch = self._batch(micro_index)
        ids = batch.input_ids.to(self.acc.device)
        bios = batch.bios_labels.to(self.acc.device) if batch.bios_labels is not None else None
        b, t = ids.shape
        mask = gate_mask(self.model, b, t, cfg.gate_from, ids.device)
        targets = self.model.preview_targets(ids)
        if is_soft(micro_index, cfg):
            out = self.wrapped(ids, gate_mode="soft", gate_from=cfg.gate_from, soft_window=True,
                               generator=micro_generator(cfg, micro_index, ids.device), soft_sample=cfg.gate_sample,
                               tau=tau_at(self.step, cfg))
            skip_targets = None
        else:
            out = self.wrapped(ids, gate_mode="off", soft_window=True, output_hidden_states=True)
            with torch.no_grad():
                u = relative_updates(tuple(h.detach() for h in out.hidden_states))
                skip_targets = oracle_targets(u, mask, cfg.oracle_rate, cfg.oracle_temperature)
        parts = self.loss_fn(out, ids, targets, mask, bios_labels=bios, skip_targets=skip_targets)
        return parts._replace(total=tie_outputs(parts.total, out))

    def train_step(self, hook: Callable[[int, int], None] | None = None) -> dict[str, float]:
        """One optimizer step over the global batch; returns its averaged loss parts.

        The global batch is global micro-batches s·A·W .. (s+1)·A·W - 1 (A = ``accum`` per process, W
        processes); process r runs (s·A + j)·W + r for j < A. Which blocks a micro-batch reads, whether it is a
        soft one and its random draws are functions of its global index; each micro-batch's loss is divided
        by A and DDP averages over the W processes, so any W computes the gradient of one process's step."""
        for group in self.optimizer.param_groups:
            group["lr"] = group["peak_lr"] * lr_factor(self.step, self.cfg)
        totals: dict[str, float] = {}
        n_soft = 0
        for j in range(self.accum):
            m = (self.step * self.accum + j) * self.world + self.rank
            if hook is not None:
                hook(self.step, j)
            sync = j == self.accum - 1
            ctx = self.acc.no_sync(self.wrapped) if not sync else _nullcontext()
            with ctx:
                parts = self.micro_step(m)
                self.acc.backward(parts.total / self.accum)
            if self.distill and self.cfg.gate_targets == "harm":
                self.harm.update()
            soft = is_soft(m, self.cfg)
            n_soft += soft
            for k, v in parts.scalars().items():
                if k == "distill" and soft:
                    continue  # distillation only runs on full-compute micro-batches
                key = f"{k}_soft" if k in ("lm", "skip_rate") and soft else k
                totals[key] = totals.get(key, 0.0) + v
        if self.cfg.grad_clip:
            self.acc.clip_grad_norm_(list(self.named.values()), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        totals, n_soft, self._stop_all = self._merge_processes(totals, n_soft)
        n_all = self.accum * self.world
        n_full = n_all - n_soft
        out = {}
        for k, v in totals.items():
            denom = n_soft if k.endswith("_soft") else (n_full if k in ("lm", "skip_rate", "distill") else n_all)
            out[k] = v / max(denom, 1)
        if self.distill:
            out["gate_tau"] = self.budget.current()
            if self.cfg.gate_targets == "harm":  # the harm threshold exists only for harm targets
                out["harm_threshold"] = self.harm.threshold or 0.0
                out["target_rate"] = self.harm.last_target_rate
        self.step += 1
        self.tokens_seen += n_all * self.cfg.micro_batch_size * self.cfg.block_size
        return out

    def _merge_processes(self, totals: dict[str, float], n_soft: int) -> tuple[dict[str, float], int, bool]:
        """Every process's loss sums and soft micro-batch count (so the logged means are the global batch's, as
        in one process), and whether any process was asked to stop (so all stop after the same step)."""
        if self.world == 1:
            return totals, n_soft, self._stop
        mine = (totals, n_soft, self._stop)
        every: list = [None] * self.world
        torch.distributed.all_gather_object(every, mine)
        merged: dict[str, float] = {}
        for t, _, _ in every:
            for k, v in t.items():
                merged[k] = merged.get(k, 0.0) + v
        return merged, sum(e[1] for e in every), any(e[2] for e in every)

    def _stopping(self) -> bool:
        """Stop before the next step: one process stops on its own flag at once; several stop on the flag they
        agreed on after the last step (a process that left the loop alone would hang the others)."""
        return self._stop if self.world == 1 else self._stop_all

    # ---- the loop ----
    def run(self, stop_after: int | None = None, hook: Callable[[int, int], None] | None = None) -> list[dict]:
        """Train to ``max_steps`` (or ``stop_after`` steps); checkpoints on interrupt/SIGTERM."""
        cfg = self.cfg
        log = _Logger(self.out_dir, self.acc.is_main_process, cfg.tensorboard)
        bar = _progress(cfg, self.step, self.acc.is_main_process)
        old = install_sigterm(self)
        if cfg.eval_at_start and self.step == 0:
            log.write({"step": 0, "eval": self.evaluate([self.eval_tau()])[0].to_dict()})
        rng = ckpt.capture_rng()
        t0, tok0 = time.perf_counter(), self.tokens_seen
        try:
            while self.step < cfg.max_steps and (stop_after is None or self.step < stop_after) and not self._stopping():
                rng = ckpt.capture_rng()
                parts = self.train_step(hook)
                tps = (self.tokens_seen - tok0) / max(time.perf_counter() - t0, 1e-9)
                rec = {"step": self.step, "tokens": self.tokens_seen, "lr": self.optimizer.param_groups[0]["lr"],
                       "tau": tau_at(self.step - 1, cfg), "tokens_per_s": tps, **parts}
                if cfg.log_every and self.step % cfg.log_every == 0:
                    log.write(rec)
                self.history.append(rec)
                if bar is not None:
                    bar.update(1)
                    show = {k: parts[k] for k in ("lm", "lm_soft", "kl", "skip_rate", "gate_rate", "preview_ce",
                                                  "window_k", "compute", "distill") if k in parts}
                    bar.set_postfix({k: f"{v:.3f}" for k, v in show.items()} | {"tok_s": f"{tps:.0f}"})
                if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.max_steps:
                    log.write({"step": self.step, "eval": self.evaluate([self.eval_tau()])[0].to_dict()})
                if cfg.save_every and self.step % cfg.save_every == 0:
                    self.save(ckpt.capture_rng())
        except KeyboardInterrupt:
            logger.warning("interrupted at step %d: saving a checkpoint", self.step)
            self.optimizer.zero_grad(set_to_none=True)
            # the snapshot taken when the unfinished step began; no barrier: the other processes are being
            # interrupted too, or blocked in a collective of the unfinished step
            self.save(rng, barrier=False)
            raise
        finally:
            signal.signal(signal.SIGTERM, old) if old is not None else None
            if bar is not None:
                bar.close()
            log.close()
        if not (cfg.save_every and self.step % cfg.save_every == 0):
            self.save(ckpt.capture_rng())
        return self.history

    def eval_tau(self) -> float:
        """The threshold held-out skipping is evaluated at now: the budget's (skip_distill) or the annealed tau."""
        return self.budget.current() if self.distill else tau_at(max(0, self.step - 1), self.cfg)

    def evaluate(self, taus: list[float]) -> list[EvalResult]:
        model = self.acc.unwrap_model(self.wrapped)
        return evaluate(model, self.data.eval_ids, taus, self.cfg.gate_from, self.cfg.micro_batch_size, self.cfg.seed)

    def finish(self) -> dict:
        """Final held-out evaluation at the annealed tau and ``eval_taus``; export to ``out_dir/final``."""
        cfg = self.cfg
        final_tau = self.eval_tau() if self.distill else cfg.tau_end
        results = [r.to_dict() for r in self.evaluate(sorted({final_tau, *cfg.eval_taus}, reverse=True))]
        if self.acc.is_main_process:
            export(self.acc.unwrap_model(self.wrapped), cfg, self.out_dir / "final", results, final_tau)
            _Logger(self.out_dir, True, False).write({"step": self.step, "final_eval": results})
        self.acc.wait_for_everyone()
        return {"step": self.step, "tokens": self.tokens_seen, "eval": results}


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def install_sigterm(trainer: Trainer):
    """SIGTERM requests a checkpoint after the current step (main thread only)."""
    def handler(signum, frame):
        logger.warning("SIGTERM: stopping after this step")
        trainer._stop = True
    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        return None


def _progress(cfg: TrainConfig, initial: int, main: bool):
    if not (cfg.progress and main):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=cfg.max_steps, initial=initial, desc="stage1", unit="step", dynamic_ncols=True)


class _Logger:
    """JSONL log (appended, so a resumed run continues the file) plus TensorBoard scalars when available."""

    def __init__(self, out_dir: Path, main: bool, tensorboard: bool):
        self.f, self.tb = None, None
        if not main:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        self.f = open(out_dir / "log.jsonl", "a")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out_dir / "tensorboard"))
            except ImportError:
                self.tb = None

    def write(self, rec: dict) -> None:
        if self.f is None:
            return
        self.f.write(json.dumps(rec, sort_keys=True) + "\n")
        self.f.flush()
        if self.tb is not None:
            flat = {k: v for k, v in rec.items() if isinstance(v, (int, float))}
            flat.update({f"eval/{k}": v for k, v in rec.get("eval", {}).items() if isinstance(v, (int, float))})
            for k, v in flat.items():
                self.tb.add_scalar(k, v, rec["step"])

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
        if self.tb is not None:
            self.tb.close()


# ---------------------------------------------------------------------------- export and entry point
def export(model: FBSForCausalLM, cfg: TrainConfig, path: Path, results: list[dict] | None = None,
           tau: float | None = None) -> Path:
    """``save_pretrained`` (FBS weights) + adapters / other trained backbone tensors + metadata."""
    import shutil

    from safetensors.torch import save_file

    inherited = _backbone_delta_files(Path(cfg.init_from)) if cfg.init_from and cfg.trainable == "fbs" else []
    tau = cfg.tau_end if tau is None else tau
    if not inherited:
        model.config = model.config.replace(tau=tau, extra={**model.config.extra, "stage1": {
            "recipe": cfg.recipe, "trainable": cfg.trainable, "lora_rank": cfg.lora_rank,
            "lora_alpha": cfg.lora_alpha, "lora_targets": list(cfg.lora_targets)}})
    else:  # the backbone is the init's: keep its adapter metadata and files
        model.config = model.config.replace(tau=tau)
    model.save_pretrained(path)
    for f in inherited:
        shutil.copyfile(f, path / f.name)
    if cfg.trainable == "adapters":
        save_adapters(model, path)
    fbs_ids = {id(p) for p in model.fbs_parameters()}
    backbone = {n: p.detach().contiguous().cpu() for n, p in model.named_parameters()
                if p.requires_grad and id(p) not in fbs_ids and "lora_" not in n}
    if backbone:
        save_file(backbone, str(path / BACKBONE_NAME))
    write_manifest(path)  # the integrity record covers the adapters / backbone tensors written after the FBS weights
    (path / META_NAME).write_text(json.dumps({"config": cfg.to_dict(), "eval": results or [],
                                                     "provenance": provenance()}, indent=1))
    return path


def load_trained(path: str | Path, base: nn.Module | None = None) -> FBSForCausalLM:
    """Load an :func:`export` directory: FBS weights, adapters and trained backbone tensors
    (:func:`fbs.model.loading.load_checkpoint` applies them)."""
    return load_checkpoint(Path(path), base=base).eval()


def train(cfg: TrainConfig, resume: bool = True, data: BlockData | None = None,
          base: nn.Module | None = None) -> dict:
    """Run the whole recipe: data, model, (resume), train, final evaluation and export."""
    model = build_model(cfg, base)
    if data is None:
        tok = model.tokenizer
        if tok is None:
            raise ValueError(f"base model {cfg.model!r} has no tokenizer; pass data explicitly")
        data = load_data(cfg, tok)
    trainer = Trainer(cfg, data, model=model)
    if resume:
        trainer.resume()
    if trainer.step == 0 and trainer.acc.is_main_process:
        trainer.out_dir.mkdir(parents=True, exist_ok=True)
        (trainer.out_dir / "train_config.json").write_text(cfg.to_json())
    trainer.run()
    return trainer.finish()
