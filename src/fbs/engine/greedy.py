"""The greedy choice of a token: per row, the first index of the largest logit, as Python ints."""

from __future__ import annotations

import numpy as np
import torch


def greedy_ids(logits: torch.Tensor) -> list:
    """``logits`` (..., V) -> the argmax over the last dimension as (nested) Python ints, torch.argmax's values (the
    first maximal index; a NaN counts as maximal). fp32 CPU tensors go through NumPy: torch's argmax over a
    49,152-wide row takes ~60 us on the project's 2-core machine, NumPy's ~4 (a greedy decode step is ~4 ms);
    other devices and dtypes keep torch's."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return np.argmax(logits.contiguous().numpy(), -1).tolist()
    return logits.argmax(-1).tolist()
