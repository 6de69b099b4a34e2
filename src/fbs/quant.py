"""Weight formats of the engine's fused inference copies: fp32, bf16, and int8 weight-only.

int8 is symmetric per output channel: w ~= q * s with q in [-127, 127] (int8, (N, K)) and one bf16 scale per
output row. One-token steps run ``torch._weight_int8pack_mm`` with bf16 activations (its fast path on CPU;
with fp32 activations the kernel is slow). The residual stream, norms, biases and the KV cache stay in the
model's dtype. The engine runs many-token inputs (prefill) as GEMMs on the fp32 source weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FORMATS = ("fp32", "bf16", "int8")


class Weight:
    """One (N, K) matrix in a storage format, applied as ``x @ W^T``.

    ``w``: fp32 / bf16 / int8 data; ``s``: (N,) bf16 scales for int8, else None."""

    def __init__(self, w: torch.Tensor, fmt: str):
        if fmt not in FORMATS:
            raise ValueError(f"weight format must be one of {FORMATS}, got {fmt!r}")
        self.fmt, self.out_features = fmt, w.shape[0]
        w = w.detach()
        if fmt == "fp32":
            self.w, self.s = w.float().contiguous(), None
        elif fmt == "bf16":
            self.w, self.s = w.to(torch.bfloat16).contiguous(), None
        else:
            self.w, self.s = quantize_int8(w)

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.w, self.s

    def dequantized(self, dtype=torch.float32) -> torch.Tensor:
        return dequantize(self.w, self.s, dtype)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: (q (N, K) int8, s (N,) bf16) with w ~= q * s."""
    w = w.detach().float()
    s = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).to(torch.bfloat16)  # rounded first, so q matches it
    q = torch.round(w / s.float().unsqueeze(1)).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), s.contiguous()


def dequantize(w: torch.Tensor, s: torch.Tensor | None, dtype=torch.float32) -> torch.Tensor:
    if s is None:
        return w.to(dtype)
    return (w.to(torch.float32) * s.to(torch.float32).unsqueeze(1)).to(dtype)


def matmul(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
    """x (..., K) @ W^T in W's format, result in x's dtype. int8 and bf16 compute with bf16 activations."""
    if w.dtype == torch.int8:
        k = x.shape[-1]
        y = torch._weight_int8pack_mm(x.reshape(-1, k).to(torch.bfloat16), w, s)
        return y.view(*x.shape[:-1], w.shape[0]).to(x.dtype)
    if w.dtype != x.dtype:
        return F.linear(x.to(w.dtype), w).to(x.dtype)
    return F.linear(x, w)
