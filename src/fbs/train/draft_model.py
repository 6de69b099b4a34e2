"""Distilling the drafts of speculative decoding from the FBS model at full depth (the verifier's target).

* :func:`train_draft_model` — ``fbs train draft-model``: a student of a few of the target's layers
  (:func:`fbs.baselines.specdec.student_from_target`) trained by KL(target || student) on corpus blocks; the
  embeddings and the (tied) LM head stay the target's and frozen, the copied layers and the final norm train.
* :func:`train_medusa_heads` — ``fbs train medusa``: Medusa-1 heads (:class:`fbs.baselines.medusa.MedusaHeads`) on
  the frozen model by self-distillation: head k at position i learns the target's own next-token distribution at
  position i + 1 + k (the token i + 2 + k).

Both are resumable: a checkpoint (:mod:`fbs.train.checkpoint`: trainable tensors, optimizer, RNG, the loss curve)
every ``checkpoint_every`` steps under ``OUT/checkpoints``; the blocks of step s are a pure function of s and the
seed (:class:`fbs.train.data.BlockOrder`) and the learning rate a pure function of the step (linear warm-up, cosine
decay), so a resumed run continues exactly as the uninterrupted one. The recipe, the layers, the tokens seen and the
wall time are recorded with the result.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from pathlib import Path
from typing import Callable

import torch

from ..baselines.medusa import MedusaHeads, frequent_tokens
from ..baselines.specdec import save_draft_model, student_from_target
from ..provenance import provenance
from .checkpoint import capture_rng, latest_checkpoint, load_checkpoint, save_checkpoint
from .data import BlockOrder

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class DistilRecipe:
    """One distillation run's knobs (recorded with the result)."""

    steps: int = 1000
    lr: float = 5e-4
    warmup: int = 50
    batch_size: int = 4
    weight_decay: float = 0.0
    seed: int = 0
    checkpoint_every: int = 100
    layers: int = 5          # draft model: the student's layers
    heads: int = 4           # Medusa: K
    max_minutes: float | None = None  # wall-time bound: stop after the step that crosses it and keep the result
    feature_cache: bool = False  # Medusa / EAGLE: the target's features of every block computed once (TeacherFeatures)
    bf16: bool = False       # matrix products under bfloat16 autocast (the softmaxes and the loss stay fp32)
    shortlist: int = 0       # Medusa / EAGLE: score only the N most frequent training tokens at decode (0: all)


def _lr_factor(step: int, recipe: DistilRecipe) -> float:
    if step < recipe.warmup:
        return (step + 1) / recipe.warmup
    span = max(recipe.steps - recipe.warmup, 1)
    return 0.5 * (1 + math.cos(math.pi * min(step - recipe.warmup, span) / span))


def kl_to_teacher(teacher_logp: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) = sum_v p (log p - log q), averaged over positions; p the teacher's, q the student's."""
    s = student_logits.float().log_softmax(-1)
    return (teacher_logp.exp() * (teacher_logp - s)).sum(-1).mean()


@torch.no_grad()
def _teacher(target, ids: torch.Tensor):
    out = target(ids, gate_mode="off", output_hidden_states=True)
    return out.logits.float().log_softmax(-1), out.hidden_states[-1]


def autocast(recipe: DistilRecipe, like: torch.Tensor):
    """bfloat16 autocast on ``like``'s device when the recipe asks for it, else a no-op context."""
    return torch.autocast(like.device.type, dtype=torch.bfloat16, enabled=recipe.bf16)


class TeacherFeatures:
    """The frozen target's last-layer features (before the final norm) at full depth, for every training block,
    computed once (Medusa and EAGLE learn from nothing else of the target: its next-token distribution is
    ``head(feature)``, :meth:`logp`). Stored in bfloat16 under ``bf16`` (half the memory; the features then feed a
    draft, they are not compared bit for bit), else in fp32 (the uncached loop's exact values), in ``path`` (safetensors, written atomically), so a resumed run reads them back instead
    of recomputing; a file for other blocks is an error naming the fix."""

    def __init__(self, target, blocks: torch.Tensor, path: str | Path | None = None, batch_size: int = 8,
                 bf16: bool = False, progress: bool = False):
        from safetensors.torch import load_file, save_file

        from .speculative import _bar

        self.target = target
        digest = _blocks_digest(blocks)
        if path is not None and Path(path).is_file():
            data = load_file(str(path))
            if bytes(data["digest"].tolist()).decode() != digest:
                raise ValueError(f"{path} holds the features of other training blocks; delete it (or use another "
                                 "--out-dir) to compute them for these")
            self.hidden = data["hidden"]
            return
        out = []
        bar = _bar(len(blocks), "target features", "block", progress)
        with torch.no_grad(), torch.autocast(blocks.device.type, dtype=torch.bfloat16, enabled=bf16):
            for i in range(0, len(blocks), batch_size):
                out.append(_teacher(target, blocks[i:i + batch_size])[1].to(torch.bfloat16 if bf16 else torch.float32))
                bar.update(len(out[-1]))
        bar.close()
        self.hidden = torch.cat(out)
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(str(path) + ".tmp")
            save_file({"hidden": self.hidden, "digest": torch.tensor(list(digest.encode()), dtype=torch.uint8)},
                      str(tmp))
            tmp.replace(path)

    def __getitem__(self, rows: torch.Tensor) -> torch.Tensor:
        return self.hidden[rows].float()

    @torch.no_grad()
    def logp(self, hidden: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """The target's next-token log-probabilities from its features (over ``vocab`` only, renormalised, if
        given)."""
        return draft_head(self.target, vocab)(self.target.base.norm(hidden)).float().log_softmax(-1)


def _blocks_digest(blocks: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(blocks.to(torch.int64).contiguous().numpy().tobytes()).hexdigest()


def draft_head(target, vocab: torch.Tensor | None = None):
    """The target's frozen LM head over normed states, restricted to the tokens ``vocab`` (the draft's shortlist)
    when given."""
    head = target.base.lm_head
    w = head.weight.detach()  # frozen: no gradient for the head's 28M weights
    b = None if getattr(head, "bias", None) is None else head.bias.detach()
    if vocab is not None:
        w, b = w[vocab], None if b is None else b[vocab]
    return lambda x: torch.nn.functional.linear(x, w, b)


def training_vocab(train_blocks: torch.Tensor, recipe: DistilRecipe) -> torch.Tensor | None:
    """The draft's shortlist (:func:`fbs.baselines.medusa.frequent_tokens` of the training blocks) when the recipe
    asks for one, else None. Its drafts are trained over it as well: the KL to the target's distribution
    renormalised over the shortlist, which is all the draft scores at decode (and V / N times cheaper)."""
    return frequent_tokens(train_blocks, recipe.shortlist) if recipe.shortlist else None


def teacher_source(target, train_blocks: torch.Tensor, out_dir: Path, recipe: DistilRecipe, progress: bool,
                   vocab: torch.Tensor | None = None):
    """``teacher(ids, rows) -> (logp, hidden)`` for the loss: from :class:`TeacherFeatures` when the recipe caches
    them (``rows`` index the training blocks), else a forward pass of the target over ``ids``; ``logp`` over
    ``vocab`` only (renormalised) when given."""
    if not recipe.feature_cache:
        def forward(ids, rows):
            logp, hidden = _teacher(target, ids)
            return (logp if vocab is None else logp[..., vocab].log_softmax(-1)), hidden

        return forward
    feats = TeacherFeatures(target, train_blocks, out_dir / "features.safetensors", bf16=recipe.bf16,
                            progress=progress)

    def teacher(ids, rows):
        hidden = feats[rows]
        with autocast(recipe, hidden):
            return feats.logp(hidden, vocab), hidden

    return teacher


def _distil(named: dict[str, torch.nn.Parameter], loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
            train_blocks: torch.Tensor, out_dir: Path, recipe: DistilRecipe, resume: bool, stop_at: int | None,
            progress: bool, what: str) -> dict:
    """The shared resumable loop: AdamW over ``named``, ``loss_of(ids, rows)`` per step (``rows``: the blocks'
    indices in ``train_blocks``). Returns the curve and timings."""
    from .speculative import _bar

    opt = torch.optim.AdamW(list(named.values()), lr=recipe.lr, weight_decay=recipe.weight_decay)
    order = BlockOrder(len(train_blocks), recipe.seed)
    root = out_dir / "checkpoints"
    step, curve, wall = 0, [], 0.0
    last = latest_checkpoint(root) if resume else None
    if last is not None:
        state = load_checkpoint(last, named, opt)
        step, curve, wall = state["step"], list(state["curve"]), float(state["wall_s"])
        logger.info("%s: resumed at step %d from %s", what, step, last)
    end = recipe.steps if stop_at is None else min(stop_at, recipe.steps)
    bar = _bar(end - step, what, "step", progress)
    t0 = time.perf_counter()
    limit = None if recipe.max_minutes is None else 60.0 * recipe.max_minutes
    timed_out = False
    while step < end:
        if limit is not None and wall + time.perf_counter() - t0 >= limit:
            timed_out = True
            break
        rng = capture_rng()
        for g in opt.param_groups:
            g["lr"] = recipe.lr * _lr_factor(step, recipe)
        idx = torch.tensor([order(step * recipe.batch_size + j) for j in range(recipe.batch_size)])
        loss = loss_of(train_blocks[idx], idx)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        curve.append(loss.item())
        step += 1
        bar.update(1)
        bar.set_postfix(kl=f"{curve[-1]:.3f}", refresh=False)
        crossing = limit is not None and wall + time.perf_counter() - t0 >= limit
        if step % recipe.checkpoint_every == 0 or step == end or crossing:
            save_checkpoint(root, step, dict(named), opt, {"curve": curve, "wall_s": wall + time.perf_counter() - t0,
                                                           "recipe": dataclasses.asdict(recipe)}, rng)
    bar.close()
    return {"steps_done": step, "curve": curve, "wall_s": wall + time.perf_counter() - t0,
            "tokens": step * recipe.batch_size * train_blocks.shape[1], "stopped_for_time": timed_out}


def _finished(run: dict, recipe: DistilRecipe) -> bool:
    """The run is over: every step done, or stopped by its wall-time bound (its result is then saved as is)."""
    return run["steps_done"] >= recipe.steps or run["stopped_for_time"]


@torch.no_grad()
def evaluate_draft(draft_logits: Callable[[torch.Tensor], torch.Tensor], target, blocks: torch.Tensor,
                   shift: int = 0, batch_size: int = 4) -> dict:
    """Held-out KL(target || draft) and top-1 agreement (the greedy acceptance of a one-token draft).
    ``draft_logits(ids)`` (b, T - shift, V) predicts what the target predicts ``shift`` positions later."""
    kl = top1 = n = 0.0
    for i in range(0, len(blocks), batch_size):
        ids = blocks[i:i + batch_size]
        t_logp = _teacher(target, ids)[0][:, shift:]
        s = draft_logits(ids).float()
        k = t_logp.shape[0] * t_logp.shape[1]
        kl += kl_to_teacher(t_logp, s).item() * k
        top1 += (s.argmax(-1) == t_logp.argmax(-1)).float().sum().item()
        n += k
    return {"kl": kl / n, "top1": top1 / n}


def train_draft_model(target, train_blocks: torch.Tensor, out_dir: str | Path, recipe: DistilRecipe,
                      eval_blocks: torch.Tensor | None = None, resume: bool = True, stop_at: int | None = None,
                      progress: bool = False, meta: dict | None = None) -> dict:
    """Distil a ``recipe.layers``-layer student from the FBS ``target`` (full depth) on ``train_blocks`` (N, T);
    writes the student to ``out_dir`` (:func:`fbs.baselines.specdec.save_draft_model`) once ``recipe.steps`` are
    done (``stop_at``: stop earlier after a checkpoint, as an interrupted run). Returns the summary."""
    out_dir = Path(out_dir)
    torch.manual_seed(recipe.seed)
    target.eval()
    student, layers = student_from_target(target, recipe.layers)
    student.train()
    emb = student.get_input_embeddings().weight
    head = student.get_output_embeddings().weight
    named = {k: p for k, p in student.named_parameters() if p is not emb and p is not head}
    for p in (emb, head):
        p.requires_grad_(False)

    def loss_of(ids, rows):
        t_logp, _ = _teacher(target, ids)
        with autocast(recipe, ids):
            logits = student(input_ids=ids).logits
        return kl_to_teacher(t_logp, logits)

    def logits(ids):
        return student(input_ids=ids).logits

    before = evaluate_draft(logits, target, eval_blocks) if eval_blocks is not None else None  # the copied layers
    run = _distil(named, loss_of, train_blocks, out_dir, recipe, resume, stop_at, progress, "draft model")
    student.eval()
    summary = {"recipe": dataclasses.asdict(recipe), "layers": layers, "target_layers": target.num_layers,
               "student_params": sum(p.numel() for p in student.parameters()), **run,
               "loss_first": run["curve"][0] if run["curve"] else None,
               "loss_last": run["curve"][-1] if run["curve"] else None}
    if not _finished(run, recipe):
        return summary
    summary["eval_before"] = before
    summary["eval_after"] = evaluate_draft(logits, target, eval_blocks) if eval_blocks is not None else None
    info = {"layers": layers, "base_fingerprint": target.config.base_fingerprint,
            "training": {k: v for k, v in summary.items() if k != "curve"}, **(meta or {}), "provenance": provenance()}
    save_draft_model(student, out_dir, info)
    (out_dir / "curve.json").write_text(json.dumps(run["curve"]))
    return summary


def train_medusa_heads(target, train_blocks: torch.Tensor, out_dir: str | Path, recipe: DistilRecipe,
                       eval_blocks: torch.Tensor | None = None, resume: bool = True, stop_at: int | None = None,
                       progress: bool = False, meta: dict | None = None) -> dict:
    """Train ``recipe.heads`` Medusa heads on the frozen FBS ``target`` (full depth); writes them to ``out_dir``
    once ``recipe.steps`` are done. Returns the summary (held-out KL / top-1 of head 0 before and after)."""
    out_dir = Path(out_dir)
    torch.manual_seed(recipe.seed)
    target.eval()
    base = target.base
    heads = MedusaHeads(base.spec.hidden_size, recipe.heads).to(base.embedding_weight.dtype).train()
    named = dict(heads.named_parameters())
    K = recipe.heads

    vocab = training_vocab(train_blocks, recipe)
    teacher = teacher_source(target, train_blocks, out_dir, recipe, progress, vocab)
    head = draft_head(target, vocab)

    def loss_of(ids, rows):
        t_logp, hidden = teacher(ids, rows)
        losses = []
        with autocast(recipe, hidden):
            h = base.norm(hidden)
            for k, block in enumerate(heads.blocks):
                t = ids.shape[1] - 1 - k
                if t <= 0:
                    break
                hk = h[:, :t]
                losses.append(kl_to_teacher(t_logp[:, 1 + k:], head(hk + torch.nn.functional.silu(block(hk)))))
        return torch.stack(losses).mean()

    def head0(ids):
        _, hidden = _teacher(target, ids)
        return heads(base.norm(hidden[:, :-1]), base.lm_head)[0]

    before = evaluate_draft(head0, target, eval_blocks, shift=1) if eval_blocks is not None else None  # fresh heads
    run = _distil(named, loss_of, train_blocks, out_dir, recipe, resume, stop_at, progress, "medusa")
    heads.eval()
    heads.shortlist = vocab
    summary = {"recipe": dataclasses.asdict(recipe), "heads": K,
               "head_params": sum(p.numel() for p in heads.parameters()), **run,
               "loss_first": run["curve"][0] if run["curve"] else None,
               "loss_last": run["curve"][-1] if run["curve"] else None}
    if not _finished(run, recipe):
        return summary
    summary["eval_before"] = before
    summary["eval_after"] = evaluate_draft(head0, target, eval_blocks, shift=1) if eval_blocks is not None else None
    heads.save(out_dir, target.config.base_fingerprint,
               {"training": {k: v for k, v in summary.items() if k != "curve"}, **(meta or {}),
                "provenance": provenance()})
    return summary
