"""A held-out block of token ids, the unit the sweeps score (:mod:`fbs.eval.sweep`, :mod:`fbs.eval.ood`)."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class HeldoutDoc:
    id: str
    lang: str
    input_ids: torch.Tensor  # (T,)
