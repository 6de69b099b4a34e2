"""``fbs train eagle``: EAGLE's draft layer (:class:`fbs.baselines.eagle.EagleLayer`) on the frozen FBS model.

At every position i of a corpus block the layer reads the target's feature f_i (its last layer's output at full
depth, before the final norm) and the embedding of the token at i + 1, and learns

    loss = SmoothL1(f^_{i+1}, f_{i+1}) + w * KL(p_target(. | <= i+1) || softmax(LM_head(norm(f^_{i+1}))))

(EAGLE's feature regression plus its classification term, here as KL to the target's distribution; ``w`` is
``cls_weight``; with ``regression="normed"`` the regression compares norm(f^) with norm(f), :data:`REGRESSIONS`). The backbone, embeddings, final norm and LM head are frozen. The loop is the resumable one of
:mod:`fbs.train.draft_model` (checkpoints, pure-function data order and schedule, the wall-time bound).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.nn.functional as F

from ..baselines.eagle import EagleLayer
from ..provenance import provenance
from .draft_model import (DistilRecipe, _distil, _finished, _teacher, autocast, draft_head, evaluate_draft,
                          kl_to_teacher, teacher_source, training_vocab)

#: EAGLE's weight of the classification term against the feature regression.
CLS_WEIGHT = 0.1


def eagle_outputs(layer: EagleLayer, target, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The layer's predicted features (b, T-1, d) at positions 0..T-2 from the target's ``hidden`` (b, T, d)."""
    base = target.base
    f = hidden[:, :-1]
    e = base.embed(ids[:, 1:])
    pos = torch.arange(f.shape[1], device=f.device).expand(f.shape[0], -1)
    cos, sin = base.rope(f, pos)
    return layer(f, e, cos, sin)[0]


#: Where the feature regression is measured: ``raw``, on the last layer's output itself; ``normed`` (the default),
#: after the model's final norm (the features the LM head reads, which are what EAGLE's HF ``hidden_states[-1]``
#: are), so that the few very large dimensions of a pre-norm residual stream do not dominate the loss. On SmolLM2
#: (on-policy data, 300 steps of 2,048 tokens) held-out first-draft top-1 was 22.9 % normed against 17.3 % raw.
REGRESSIONS = ("raw", "normed")


def train_eagle(target, train_blocks: torch.Tensor, out_dir: str | Path, recipe: DistilRecipe,
                eval_blocks: torch.Tensor | None = None, resume: bool = True, stop_at: int | None = None,
                progress: bool = False, meta: dict | None = None, cls_weight: float = CLS_WEIGHT,
                regression: str = "normed") -> dict:
    """Train an EAGLE layer for the FBS ``target`` (full depth) on ``train_blocks`` (N, T); writes it to
    ``out_dir`` once the run is over (every step, or the wall-time bound). Returns the summary with held-out KL
    and top-1 agreement of the first draft token (true features in) before and after."""
    if regression not in REGRESSIONS:
        raise ValueError(f"unknown regression {regression!r}; choose from {', '.join(REGRESSIONS)}")
    out_dir = Path(out_dir)
    torch.manual_seed(recipe.seed)
    target.eval()
    base = target.base
    layer = EagleLayer.for_model(target).train()
    named = dict(layer.named_parameters())

    vocab = training_vocab(train_blocks, recipe)
    teacher = teacher_source(target, train_blocks, out_dir, recipe, progress, vocab)
    head = draft_head(target, vocab)

    def loss_of(ids, rows):
        t_logp, hidden = teacher(ids, rows)
        with autocast(recipe, hidden):
            pred = eagle_outputs(layer, target, ids, hidden)
            logits = head(base.norm(pred))
        want = hidden[:, 1:]
        if regression == "normed":
            with autocast(recipe, hidden):
                pred, want = base.norm(pred), base.norm(want)
        reg = F.smooth_l1_loss(pred.float(), want.float())
        return reg + cls_weight * kl_to_teacher(t_logp[:, 1:], logits)

    def first_draft(ids):
        _, hidden = _teacher(target, ids)
        return base.lm_head(base.norm(eagle_outputs(layer, target, ids, hidden)))

    before = evaluate_draft(first_draft, target, eval_blocks, shift=1) if eval_blocks is not None else None
    run = _distil(named, loss_of, train_blocks, out_dir, recipe, resume, stop_at, progress, "eagle")
    layer.eval()
    layer.shortlist = vocab
    summary = {"recipe": dataclasses.asdict(recipe), "cls_weight": cls_weight, "regression": regression,
               "layer_params": sum(p.numel() for p in layer.parameters()), **run,
               "loss_first": run["curve"][0] if run["curve"] else None,
               "loss_last": run["curve"][-1] if run["curve"] else None}
    if not _finished(run, recipe):
        return summary
    summary["eval_before"] = before
    summary["eval_after"] = evaluate_draft(first_draft, target, eval_blocks, shift=1) \
        if eval_blocks is not None else None
    layer.save(out_dir, target.config.base_fingerprint,
               {"training": {k: v for k, v in summary.items() if k != "curve"}, **(meta or {}),
                "provenance": provenance()})
    return summary
