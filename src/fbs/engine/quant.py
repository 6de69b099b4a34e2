"""Weight formats of the engine's fused inference copies: fp32, bf16, and int8 weight-only.

int8 is symmetric per output channel: w ~= q * s with q in [-127, 127] (int8, (N, K)) and one bf16 scale per
output row. One-token steps run the native int8 kernel (:func:`fbs.native.int8_linear`: fp32 activations, the
weights repacked once at load, ``packed=True``) where it is available (eager CPU decoding with AVX2 or AVX-512),
else ``torch._weight_int8pack_mm`` with bf16 activations (its fast path on CPU; with fp32 activations that kernel
is slow). The residual stream, norms, biases and the KV cache stay in the model's dtype. The engine runs
many-token inputs (prefill) as GEMMs on the fp32 source weights.

``fp32-onednn`` keeps fp32 weights in oneDNN's blocked layout (packed once at load) and runs every product
through oneDNN's linear (``torch.ops.mkldnn._linear_pointwise``). On this 2-core CPU its batch-1 GEMV reads
weights faster than ``F.linear`` (``scripts/gemv_floor.py`` measures both). It is fp32 arithmetic with a different
summation order: logits differ from ``fp32`` by float rounding (~1e-5 relative), not bit for bit. CPU only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import native

FORMATS = ("fp32", "bf16", "int8", "fp32-onednn")


class Weight:
    """One (N, K) matrix in a storage format, applied as ``x @ W^T``.

    ``w``: fp32 / bf16 / int8 data; ``s``: (N,) bf16 scales for int8, else None. ``packed`` (int8 only): ``w`` in
    the native kernel's 1-D layout (:func:`fbs.native.int8_pack`); the caller checks :func:`fbs.native.int8_isa`."""

    def __init__(self, w: torch.Tensor, fmt: str, packed: bool = False):
        if fmt not in FORMATS:
            raise ValueError(f"weight format must be one of {FORMATS}, got {fmt!r}")
        self.fmt, self.out_features, self.in_features = fmt, w.shape[0], w.shape[1]
        self.packed = packed and fmt == "int8"
        w = w.detach()
        if fmt == "fp32":
            self.w, self.s = w.float().contiguous(), None
        elif fmt == "bf16":
            self.w, self.s = w.to(torch.bfloat16).contiguous(), None
        elif fmt == "fp32-onednn":
            if w.device.type != "cpu" or not torch.backends.mkldnn.is_available():
                raise ValueError("weights='fp32-onednn' needs a CPU build of torch with oneDNN (mkldnn); use 'fp32'")
            self.w, self.s = w.float().contiguous().to_mkldnn(), None
        else:
            self.w, self.s = quantize_int8(w)
            if self.packed:
                self.w = native.int8_pack(self.w)

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.w, self.s

    def dequantized(self, dtype=torch.float32) -> torch.Tensor:
        w = self.w.to_dense() if self.w.is_mkldnn else self.w
        if self.packed:
            w = native.int8_unpack(w, self.out_features, self.in_features)
        return dequantize(w, self.s, dtype)


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
    """x (..., K) @ W^T in W's format, result in x's dtype. bf16 and (unpacked) int8 compute with bf16 activations,
    packed int8 (1-D ``w``, :class:`Weight` ``packed=True``) with fp32 ones in the native kernel."""
    if w.is_mkldnn:  # fp32-onednn: packed fp32, oneDNN's linear
        return torch.ops.mkldnn._linear_pointwise(x.float(), w, None, "none", [], "").to(x.dtype)
    if w.dtype == torch.int8:
        if w.dim() == 1:
            return native.int8_linear(x, w, s)
        k = x.shape[-1]
        y = torch._weight_int8pack_mm(x.reshape(-1, k).to(torch.bfloat16), w, s)
        return y.view(*x.shape[:-1], w.shape[0]).to(x.dtype)
    if w.dtype != x.dtype:
        return F.linear(x.to(w.dtype), w).to(x.dtype)
    return F.linear(x, w)
