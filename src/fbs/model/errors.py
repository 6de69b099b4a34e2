"""The error a damaged, malformed or mismatched FBS checkpoint raises, and the one reader of its safetensors files,
shared by the checkpoint reader (:mod:`.checkpoint`), the adapters it loads (:mod:`.lora`) and Kangaroo's adapter."""

from __future__ import annotations

import os

import torch

COPY_AGAIN = "copy or download the checkpoint again"


class CheckpointError(ValueError):
    """An FBS checkpoint is missing, malformed, corrupt or made for another base model."""


def read_tensors(file: str | os.PathLike, fix: str = COPY_AGAIN) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; a truncated or damaged one raises :class:`CheckpointError` ending in
    ``fix`` (what the user should do)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except SafetensorError as e:
        raise CheckpointError(f"{file} is not a readable safetensors file ({e}): it is truncated or damaged; "
                              f"{fix}") from e
