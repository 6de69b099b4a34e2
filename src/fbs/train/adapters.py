"""Training's side of LoRA: the adapters themselves live in the core (:mod:`fbs.model.lora`, which loading needs);
this module adds saving them with an export. Stage-1 wraps the backbone with :func:`add_adapters`."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from ..model.lora import (ADAPTERS_NAME, DEFAULT_TARGETS, LoRALinear, add_adapters, load_adapters,  # noqa: F401
                    merge_adapters)


def adapter_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """Adapter tensors by (deduplicated) parameter name."""
    return {k: v.detach().contiguous().cpu() for k, v in module.named_parameters() if "lora_" in k}


def save_adapters(module: nn.Module, path: str | os.PathLike) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / (ADAPTERS_NAME + ".tmp")
    save_file(adapter_state_dict(module), str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path / ADAPTERS_NAME)
    return path / ADAPTERS_NAME
