"""TrainConfig: every knob of the Stage-1 recipe, each default defined here and only here.

Load with :meth:`TrainConfig.from_yaml` and override single fields with ``key=value`` strings
(:meth:`TrainConfig.with_overrides`; values are parsed as YAML, so ``lr=3e-4``, ``eval_taus=[0.9,0.7]``,
``fbs.k_max=8``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..model.config import FBSConfig
from .common import read_yaml_config

TRAINABLE = ("all", "fbs", "adapters")


class TrainConfigError(ValueError):
    """A TrainConfig field has an invalid value."""


@dataclass
class TrainConfig:
    # ---- model ----
    model: str = "smollm2-135m"
    """Base model: a bundled name or an HF directory."""
    init_from: str | None = None
    """Optional FBS checkpoint directory (``save_pretrained`` output) to start the FBS modules from."""
    fbs: dict = field(default_factory=dict)
    """FBSConfig overrides for a fresh model (e.g. ``{k_max: 8}``)."""
    trainable: str = "adapters"
    """What trains: ``fbs`` (only PAW/CH/SG), ``adapters`` (FBS + LoRA on the backbone linears), ``all``."""
    lora_rank: int = 8
    """LoRA rank for ``trainable: adapters``."""
    lora_alpha: float = 16.0
    """LoRA scale numerator: the update is (alpha / rank) B A x."""
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """Names of the backbone linear layers that get adapters."""
    train_norms: bool = False
    """Also train the backbone RMSNorm weights (any trainable set)."""
    train_layers: tuple[int, ...] = ()
    """Also train these whole backbone decoder layers (negative = from the end)."""

    # ---- data ----
    data: str = "wiki_demo"
    """``wiki_demo`` (English text of the llamafactory==0.9.5 sdist) or a corpus directory built by ``fbs data build``."""
    data_cache: str = "~/.cache/fbs/data/train"
    """Where tokenized wiki_demo blocks are cached (per base model, block size and eval_blocks)."""
    block_size: int = 512
    """Tokens per training block (sequence length)."""
    eval_blocks: int = 8
    """Held-out blocks (the last blocks of wiki_demo, or the corpus validation split)."""
    max_train_blocks: int | None = None
    """Use only the first N training blocks (None = all)."""
    preview_vocab_from_data: bool = True
    """Set the preview vocabulary to the top-N most frequent training tokens before training."""

    # ---- optimization ----
    max_steps: int = 200
    """Optimizer steps."""
    batch_tokens: int = 4096
    """Tokens per optimizer step, across processes; gradient accumulation makes up the rest."""
    micro_batch_size: int = 2
    """Blocks per forward (per process)."""
    lr: float = 2e-5
    """Peak learning rate of backbone parameters and adapters (paper: 2e-5 for full training)."""
    fbs_lr: float = 1e-3
    """Peak learning rate of the freshly initialised FBS modules (PAW, CH, SG)."""
    weight_decay: float = 0.0
    """AdamW weight decay (not applied to norms, biases, gates' output layer)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (0 = off)."""
    warmup_frac: float = 0.04
    """Linear warm-up fraction of max_steps (paper: 4%), then cosine decay."""
    min_lr_ratio: float = 0.1
    """Cosine decays to this fraction of the peak."""

    # ---- loss weights (paper Eq. stage1_loss) ----
    lambda_bios: float = 0.1
    """Weight of L_bios (token CE on weak BIOS labels)."""
    lambda_align: float = 0.05
    """Weight of L_align (chunk/token alignment)."""
    align_kind: str = "infonce"
    """``infonce`` (own chunk vs other chunks of the sequence) or ``cosine`` (1 - cos)."""
    align_temperature: float = 0.1
    """Temperature of the infonce alignment."""
    lambda_paw: float = 0.1
    """Weight of L_preview."""
    window_credit: float = 5.0
    """Nats credited per included preview horizon: horizon r is worth including when its CE is below this."""
    preview_floor: float = 0.1
    """Every horizon's preview CE also enters with this fixed weight (heads outside the window keep learning)."""
    lambda_gate: float = 1.0
    """Weight of L_gate (conservative regularizer)."""
    gate_max_rate: float = 0.5
    """L_gate's mean constraint: squared hinge on each layer's mean skip probability above this."""
    gate_entropy: float = 0.01
    """L_gate's entropy weight (crisp decisions)."""

    # ---- gate learning (docs/train.md) ----
    lambda_compute: float = 0.0
    """Reward per unit mean skip probability on skip micro-batches (straight-through gates). Off by default:
    with it on (0.05) the gates drifted towards skipping without learning *where* (docs/train.md, measured)."""
    lambda_distill: float = 1.0
    """Weight of the oracle distillation BCE on full-compute micro-batches."""
    oracle_rate: float = 0.3
    """Fraction of gated (token, layer) pairs the oracle labels skippable (smallest relative updates)."""
    oracle_temperature: float = 0.25
    """Softness of the oracle targets in log-update units."""
    skip_every: int = 4
    """Every ``skip_every``-th micro-batch runs soft straight-through gates; the others run full compute
    (LM loss without skipping + distillation). 1 = always soft, 0 = never soft."""
    gate_sample: str = "bernoulli"
    """How a soft micro-batch draws its hard gates: ``bernoulli`` (g ~ Bernoulli(p)) or ``threshold``
    (g = 1[p > tau(step)] with the annealed threshold, so tau_start/tau_end shape training; the paper's
    threshold-strategy ablation). Both pass d g / d p = 1 backward."""
    gate_from: int = 0
    """Positions before this are never skipped in training or held-out skip evaluation."""
    tau_start: float = 0.9
    """Gate threshold at step 0 (annealed linearly, paper §3.1.3)."""
    tau_end: float = 0.7
    """Gate threshold at the last step."""

    # ---- skip distillation (recipe: skip_distill; docs/train.md) ----
    recipe: str = "stage1"
    """``stage1``: the paper's multi-task recipe with oracle-distilled gates. ``skip_distill``: every step a
    frozen teacher pass (the base model, no adapters, no FBS) and a student pass that skips (its own gates
    at a threshold that meets the budget, plus random layer dropout); loss λ_kl KL(teacher || student) + λ_lm L_lm + the paper's
    PAW/CH terms; gates learn loss-aware targets at the ``target_skip`` budget."""
    chat_data: str | None = None
    """Directory of ``fbs data chat`` (train.jsonl): chat conversations mixed into training."""
    chat_share: float = 0.0
    """Fraction of micro-batches drawn from the chat conversations (the rest from ``data``)."""
    lambda_kl: float = 1.0
    """Weight of KL(teacher || student) (skip_distill)."""
    lambda_lm: float = 1.0
    """Weight of the next-token CE L_lm."""
    target_skip: float = 0.3
    """Target share of *all* (token, layer) pairs the gates skip (skip_distill); converted to a share of the
    gated pairs, the quantile of the loss-aware gate targets."""
    gate_targets: str = "update"
    """Skip targets of the gates (skip_distill): ``update`` — the pairs whose layer changes the token least
    (relative update ||f(h) - h|| / ||h|| on the student's own pass, below the budget quantile; DESIGN.md §7's
    oracle); ``harm`` — first-order loss change <dL/dh', h - f(h)> below the budget quantile (HarmTargets)."""
    harm_weight: float = 1.0
    """Weight of the gates' BCE towards their targets (skip_distill)."""
    drop_max: float = 0.2
    """Random layer dropout on gated layers (skip_distill): p_l = drop_max * D(l), D rising from 0 at the
    first gated layer to 1 at the last, e^(i ln2/(n-1)) - 1 (LayerSkip). Ramped in over ``drop_ramp``."""
    drop_ramp: float = 0.1
    """Fraction of max_steps over which the random dropout rate ramps from 0 to drop_max."""
    gate_start: float = 0.1
    """Fraction of max_steps after which the gates' own decisions skip (before: random dropout only, while the
    gates already learn their targets)."""
    budget_ramp: float = 0.3
    """Fraction of max_steps (from gate_start) over which the share the gates skip rises from 0 to target_skip.
    The gates skip where p > tau, the rule of inference; in training tau is the running quantile of p that
    skips the current share (:class:`fbs.train.losses.BudgetThreshold`), at inference it is calibrated the
    same way on held-out text. The last training tau is exported."""
    full_share: float = 0.0
    """Share of skip_distill micro-batches (spread evenly) whose student runs at full depth: KL to the base with
    no gate or random skip, so the adapters that learn to absorb skipping do not move full depth away from
    the base (with every micro-batch skipping, full depth's PPL on out-of-distribution text drifted up)."""
    control: bool = False
    """skip_distill without any skipping (no dropout, gates never skip): the control model that isolates the
    fine-tuning's own effect."""

    # ---- evaluation, logging, checkpoints ----
    out_dir: str = "runs/stage1"
    """Run directory: checkpoints/, log.jsonl, final/ (save_pretrained output), tensorboard/."""
    eval_every: int = 50
    """Held-out evaluation every N optimizer steps (and at the end); 0 = only at the end."""
    eval_at_start: bool = True
    """Evaluate before the first step of a fresh run (fresh FBS modules leave the base model unchanged, so
    ``ppl_full`` there is the base model's PPL)."""
    eval_taus: tuple[float, ...] = (0.9, 0.7, 0.5)
    """Extra thresholds evaluated at the end (skip ratio and PPL)."""
    save_every: int = 50
    """Atomic checkpoint every N optimizer steps (and on interrupt and at the end)."""
    keep_checkpoints: int = 2
    """How many step checkpoints to keep."""
    log_every: int = 1
    """JSONL log line every N optimizer steps."""
    progress: bool = True
    """Show a tqdm progress bar (main process)."""
    tensorboard: bool = True
    """Also write TensorBoard scalars when tensorboard is installed."""
    seed: int = 0
    """Seed of model init, data order, gate sampling."""
    threads: int = 0
    """torch intra-op threads on CPU (0 = torch default)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # YAML reads "3e-4" as a string; coerce plain numeric fields
            v = getattr(self, f.name)
            if f.type in ("float", "int") and isinstance(v, str):
                try:
                    setattr(self, f.name, float(v) if f.type == "float" else int(v))
                except ValueError:
                    raise TrainConfigError(f"{f.name} must be a number, got {v!r}") from None
        self.lora_targets = tuple(self.lora_targets)
        self.train_layers = tuple(int(x) for x in self.train_layers)
        self.betas = tuple(float(x) for x in self.betas)
        self.eval_taus = tuple(float(x) for x in self.eval_taus)

        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise TrainConfigError(msg)
        check(self.trainable in TRAINABLE, f"trainable must be one of {TRAINABLE}, got {self.trainable!r}")
        check(self.lora_rank >= 1 and self.lora_alpha > 0, "lora_rank must be >= 1 and lora_alpha > 0")
        check(self.block_size >= 8, f"block_size must be >= 8, got {self.block_size}")
        check(self.eval_blocks >= 1, f"eval_blocks must be >= 1, got {self.eval_blocks}")
        check(self.max_steps >= 1, f"max_steps must be >= 1, got {self.max_steps}")
        check(self.micro_batch_size >= 1, f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        check(self.batch_tokens >= self.block_size * self.micro_batch_size,
              f"batch_tokens ({self.batch_tokens}) must hold at least one micro-batch "
              f"({self.micro_batch_size} x {self.block_size} tokens)")
        check(self.lr > 0 and self.fbs_lr > 0, "lr and fbs_lr must be > 0")
        check(0 <= self.warmup_frac < 1, f"warmup_frac must be in [0, 1), got {self.warmup_frac}")
        check(0 <= self.min_lr_ratio <= 1, f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), f"bad betas {self.betas}")
        for name in ("lambda_bios", "lambda_align", "lambda_paw", "lambda_gate", "lambda_compute", "lambda_distill",
                     "weight_decay", "grad_clip", "gate_entropy", "window_credit", "preview_floor"):
            check(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        check(self.align_kind in ("infonce", "cosine"), f"align_kind must be infonce|cosine, got {self.align_kind!r}")
        check(self.align_temperature > 0 and self.oracle_temperature > 0, "temperatures must be > 0")
        check(0 < self.oracle_rate < 1, f"oracle_rate must be in (0, 1), got {self.oracle_rate}")
        check(0 <= self.gate_max_rate <= 1, f"gate_max_rate must be in [0, 1], got {self.gate_max_rate}")
        check(self.skip_every >= 0 and self.gate_from >= 0, "skip_every and gate_from must be >= 0")
        check(self.gate_sample in ("bernoulli", "threshold"),
              f"gate_sample must be bernoulli|threshold, got {self.gate_sample!r}")
        for name in ("tau_start", "tau_end"):
            check(0 <= getattr(self, name) <= 1, f"{name} must be in [0, 1]")
        check(all(0 <= x <= 1 for x in self.eval_taus), f"eval_taus must lie in [0, 1], got {self.eval_taus}")
        for name in ("eval_every", "save_every", "log_every", "threads"):
            check(getattr(self, name) >= 0, f"{name} must be >= 0")
        check(self.keep_checkpoints >= 1, "keep_checkpoints must be >= 1")
        check(self.recipe in ("stage1", "skip_distill"), f"recipe must be stage1|skip_distill, got {self.recipe!r}")
        check(0 <= self.chat_share < 1, f"chat_share must be in [0, 1), got {self.chat_share}")
        check(self.chat_share == 0 or self.chat_data, "chat_share > 0 needs chat_data (a `fbs data chat` directory)")
        check(0 < self.target_skip < 1, f"target_skip must be in (0, 1), got {self.target_skip}")
        check(self.gate_targets in ("update", "harm"), f"gate_targets must be update|harm, got {self.gate_targets!r}")
        for name in ("drop_max", "drop_ramp", "gate_start", "budget_ramp", "full_share"):
            check(0 <= getattr(self, name) <= 1, f"{name} must be in [0, 1], got {getattr(self, name)}")
        for name in ("lambda_kl", "lambda_lm", "harm_weight"):
            check(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        check(self.max_train_blocks is None or self.max_train_blocks >= 1, "max_train_blocks must be >= 1")
        try:
            self.fbs_config()
        except ValueError as e:
            raise TrainConfigError(f"fbs: {e}") from e

    # ------------------------------------------------------------------
    def fbs_config(self) -> FBSConfig:
        return FBSConfig.from_dict(dict(self.fbs))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise TrainConfigError(f"unknown TrainConfig fields {unknown}")
        return cls(**d)

    @classmethod
    def from_yaml(cls, path: str | Path | None, overrides: list[str] | None = None) -> "TrainConfig":
        d = read_yaml_config(path, TrainConfigError, "TrainConfig")
        return cls.from_dict(apply_overrides(d, overrides or []))

    def with_overrides(self, overrides: list[str]) -> "TrainConfig":
        return self.from_dict(apply_overrides(self.to_dict(), overrides))


def apply_overrides(d: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``key=value`` (YAML value) overrides; ``fbs.key=value`` sets one FBSConfig field."""
    d = dict(d)
    for item in overrides:
        if "=" not in item:
            raise TrainConfigError(f"override {item!r} is not key=value")
        key, raw = item.split("=", 1)
        value = yaml.safe_load(raw)
        if key.startswith("fbs."):
            d["fbs"] = {**d.get("fbs", {}), key[4:]: value}
        else:
            d[key] = value
    return d
