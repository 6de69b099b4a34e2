"""Medusa-1 heads (Cai et al. 2024) on the frozen FBS model: K residual blocks over its last hidden state.

Head k (k = 0..K-1) reads the final-normed hidden state at position i and predicts the token at i + 2 + k (the
model's own LM head predicts i + 1)::

    logits_k = LM_head(h + SiLU(W_k h + b_k))        h = RMSNorm_final(x_L), W_k zero-initialised

Deviation from the paper: every head shares the model's frozen LM head instead of owning a copy (on SmolLM2 a
copy is 28M parameters per head, a fifth of the model); the heads train only their residual blocks (d^2 + d
each). Training (``fbs train medusa``, :mod:`fbs.train.medusa`): self-distillation, KL to the FBS model's own
next-token distribution at the position each head predicts, backbone frozen. Decoding
(:class:`fbs.engine.drafts.HeadsDraft`): a candidate tree from the heads' top-k, verified in one pass with a tree
attention mask (or the chain of the heads' top-1).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

CONFIG_NAME = "medusa.json"
WEIGHTS_NAME = "medusa.safetensors"
TRAIN_HINT = "train heads with `fbs train medusa --out-dir DIR`"


SHORTLIST_KEY = "shortlist"


def with_shortlist(state: dict, module) -> dict:
    """``state`` plus the module's reduced draft vocabulary (``module.shortlist``: int64 token ids, or None), saved
    beside the weights (never cast with them)."""
    ids = getattr(module, "shortlist", None)
    return state if ids is None else {**state, SHORTLIST_KEY: ids.to(torch.int64).cpu()}


def take_shortlist(tensors: dict, module) -> dict:
    """Set ``module.shortlist`` from a saved file's tensors (None when it has none); the rest, for
    ``load_state_dict``."""
    tensors = dict(tensors)
    ids = tensors.pop(SHORTLIST_KEY, None)
    module.shortlist = None if ids is None else ids.to(torch.int64)
    return tensors


def frequent_tokens(blocks: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n`` most frequent token ids of ``blocks`` (ties to the smaller id), sorted by id: a draft's reduced
    vocabulary (FR-Spec; EAGLE-3's draft vocabulary) from its training data."""
    counts = torch.bincount(blocks.reshape(-1).to(torch.int64))
    n = min(n, int((counts > 0).sum()))
    order = torch.sort(-counts, stable=True).indices[:n]  # stable: equal counts keep the smaller id first
    return order.sort().values


class MedusaHeads(nn.Module):
    #: the reduced draft vocabulary (token ids) whose rows of the LM head the heads score at decode, or None (all)
    shortlist: torch.Tensor | None = None

    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.blocks = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_heads))
        for b in self.blocks:  # a fresh head starts as the model's own next-token head
            nn.init.zeros_(b.weight)
            nn.init.zeros_(b.bias)

    def forward(self, h: torch.Tensor, lm_head) -> torch.Tensor:
        """h (..., d), normed -> (K, ..., V) logits through the shared ``lm_head``."""
        return torch.stack([lm_head(h + torch.nn.functional.silu(b(h))) for b in self.blocks])

    def save(self, path: str | os.PathLike, base_fingerprint: str | None, meta: dict | None = None) -> Path:
        from ..model.checkpoint import save_module_dir

        info = {"hidden_size": self.blocks[0].in_features, "num_heads": self.num_heads,
                "base_fingerprint": base_fingerprint, **(meta or {})}
        if self.shortlist is not None:
            info["shortlist"] = int(self.shortlist.numel())
        return save_module_dir(path, with_shortlist(self.state_dict(), self), info, WEIGHTS_NAME, CONFIG_NAME)

    @classmethod
    def load(cls, path: str | os.PathLike, model=None, check_base: bool = True) -> "MedusaHeads":
        from ..model.checkpoint import read_module_dir
        from ..model.errors import CheckpointError

        info, tensors = read_module_dir(path, WEIGHTS_NAME, CONFIG_NAME, "Medusa heads", TRAIN_HINT)
        heads = cls(info["hidden_size"], info["num_heads"])
        heads.load_state_dict(take_shortlist(tensors, heads))
        if model is not None:
            if info["hidden_size"] != model.base.spec.hidden_size:
                raise CheckpointError(f"the heads in {path} are for hidden size {info['hidden_size']}, the model has "
                                      f"{model.base.spec.hidden_size}; {TRAIN_HINT}")
            fp = getattr(model.config, "base_fingerprint", None)
            if check_base and info.get("base_fingerprint") != fp:
                raise CheckpointError(f"the heads in {path} were trained on another base model (fingerprint "
                                      f"{info.get('base_fingerprint')}, this model's base has {fp}); {TRAIN_HINT}")
            heads = heads.to(model.base.embedding_weight.device, model.base.embedding_weight.dtype)
        return heads.eval()


def shipped_draft(kind: str, model):
    """The directory of the ``kind`` draft ("medusa", "eagle") shipped in the package for ``model``'s base (the
    one whose recorded base fingerprint is the model's), or None."""
    from ..model.loading import ASSETS

    fp = getattr(model.config, "base_fingerprint", None)
    if fp is None:
        return None
    for path in sorted(ASSETS.glob(f"{kind}-*")):
        info = path / f"{kind}.json"
        if info.is_file() and json.loads(info.read_text()).get("base_fingerprint") == fp:
            return path
    return None


def draft_factory(session, heads=None, path=None, check_base: bool = True, tree=None, typical: bool = False,
                  posterior_threshold: float = 0.09, posterior_alpha: float = 0.3, shortlist: bool = True):
    """``medusa`` with a heads module, saved heads (``path``), or the heads shipped for the model's base
    (:func:`shipped_draft`); the other options go to :class:`fbs.engine.drafts.HeadsDraft`."""
    from ..engine.drafts import HeadsDraft

    if heads is None:
        path = path if path is not None else shipped_draft("medusa", session.dec.m)
        if path is not None:
            heads = MedusaHeads.load(path, session.dec.m, check_base)
    return HeadsDraft(session, heads, tree=tree, typical=typical, posterior_threshold=posterior_threshold,
                      posterior_alpha=posterior_alpha, shortlist=shortlist)
