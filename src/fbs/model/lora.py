"""A tiny LoRA: low-rank adapters on the backbone's linear layers (Hu et al. 2021), no peft needed.

``add_adapters`` replaces each targeted ``nn.Linear`` of the decoder layers by a :class:`LoRALinear`
that keeps the frozen base weight and adds ``(alpha / r) * B A x`` with B = 0 at start, so a fresh
adapter changes nothing. The HF submodules keep their names (``q_proj`` ...), so
:class:`fbs.model.hf_adapter.BaseDecoder` calls them unchanged.

This is the core's part, which loading a checkpoint needs (wrap, load, merge: :mod:`fbs.model.loading`);
training adds adapters with :func:`add_adapters` and saves them with :mod:`fbs.train.adapters`.

:func:`merge_adapters` leaves each merged linear's factors on it (:func:`merged_lowrank`), so that a block
weight format can quantize the base weight (a GGUF's own blocks) and apply the low-rank delta apart
(:mod:`fbs.engine.quant`) instead of rounding the merged weight off the base's grid.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
from torch import nn

from .errors import CheckpointError, read_tensors

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTERS_NAME = "adapters.safetensors"
#: the attribute a merged linear keeps its adapter's factors in: (a (r, in), b (out, r)), delta = b @ a
MERGED_ATTR = "fbs_merged_lowrank"


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base = base
        self.rank, self.scaling = rank, alpha / rank
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, dtype=base.weight.dtype))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, dtype=base.weight.dtype))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))

    @property
    def weight(self) -> torch.Tensor:  # some callers read .weight (shapes, dtype)
        return self.base.weight

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t() @ self.lora_b.t()) * self.scaling  # (..., out)

    def delta_factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(a, b) with the adapter's delta = b @ a, the scaling folded into b (the merge's own arithmetic)."""
        return self.lora_a, self.scaling * self.lora_b

    def merged_weight(self) -> torch.Tensor:
        a, b = self.delta_factors()
        return self.base.weight + b @ a


def add_adapters(layers: nn.ModuleList, rank: int = 8, alpha: float = 16.0,
                 targets: tuple[str, ...] = DEFAULT_TARGETS) -> list[str]:
    """Wrap the targeted linears of every decoder layer; returns the wrapped module names."""
    wrapped = []
    for li, layer in enumerate(layers):
        for name, mod in list(layer.named_modules()):
            leaf = name.rsplit(".", 1)[-1]
            if leaf in targets and isinstance(mod, nn.Linear):
                parent = layer.get_submodule(name.rsplit(".", 1)[0]) if "." in name else layer
                setattr(parent, leaf, LoRALinear(mod, rank, alpha))
                wrapped.append(f"{li}.{name}")
    if not wrapped:
        raise ValueError(f"no linear layer named {targets} found in the decoder layers")
    return wrapped


def load_adapters(model: nn.Module, path: str | os.PathLike, rank: int, alpha: float,
                  targets: tuple[str, ...] = DEFAULT_TARGETS) -> None:
    """Wrap ``model.base.layers`` and load ``adapters.safetensors`` from ``path`` (strict on LoRA keys and shapes).

    Adapters that do not fit the backbone (other layers, targets, rank or widths) or an unreadable file raise
    :class:`fbs.model.errors.CheckpointError`."""
    file = Path(path) / ADAPTERS_NAME
    sd = read_tensors(file)
    add_adapters(model.base.layers, rank, alpha, targets)
    own = {k: p for k, p in model.named_parameters() if "lora_" in k}
    shapes = [f"{k}: file {tuple(sd[k].shape)}, backbone {tuple(p.shape)}" for k, p in sorted(own.items())
              if k in sd and sd[k].shape != p.shape]
    if set(own) != set(sd) or shapes:
        raise CheckpointError(
            f"the LoRA adapters in {file} do not fit this backbone (rank {rank}, targets {list(targets)}): missing "
            f"{sorted(set(own) - set(sd))[:3]}, unexpected {sorted(set(sd) - set(own))[:3]}, shape mismatches "
            f"{shapes[:3]}; load the checkpoint onto the base model it was trained on, with the lora_rank / "
            "lora_targets recorded in its config (extra.stage1)")
    with torch.no_grad():
        for k, p in own.items():
            p.copy_(sd[k])


@torch.no_grad()
def merge_adapters(layers: nn.ModuleList) -> int:
    """Fold every adapter into its base weight and unwrap it (for export); returns how many were merged. Each
    unwrapped linear keeps the factors of its delta (:func:`merged_lowrank`)."""
    n = 0
    for layer in layers:
        for name, mod in list(layer.named_modules()):
            if isinstance(mod, LoRALinear):
                a, b = mod.delta_factors()
                mod.base.weight.copy_(mod.merged_weight())
                setattr(mod.base, MERGED_ATTR, (a.detach().clone(), b.detach().clone()))
                parent = layer.get_submodule(name.rsplit(".", 1)[0]) if "." in name else layer
                setattr(parent, name.rsplit(".", 1)[-1], mod.base)
                n += 1
    return n


def merged_lowrank(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The factors (a (r, in), b (out, r)) of the adapter :func:`merge_adapters` folded into ``linear``'s weight
    (weight = base + b @ a, computed as the merge did), or None when it merged none."""
    return getattr(linear, MERGED_ATTR, None)
