"""Products with activations quantized to int8 per 32-value block and integer dot products (``csrc/quant.h``).

Weight kinds (:data:`KINDS`), each repacked once (:func:`pack`) into tiles of 16 output channels that the kernel
streams linearly: ``i8`` (int8, one scale per output channel), ``q8_0`` (int8 with an fp16 scale per 32 inputs,
GGUF's Q8_0) and ``q4_1`` (4-bit q with an fp16 scale d and min m per 32 inputs, w = d q + m, GGUF's Q4_1).
The kernels are standalone products for now; the engine's weight formats do not use them yet.
Activations are quantized per row and 32-value block, q = round(x / d) with d = max|x| / 127, inside each call.
AVX-512 VNNI (vpdpbusd) where the CPU has it, else AVX2 (maddubs); :func:`isa` says which, ``FBS_NATIVE_ISA=avx2``
forces the AVX2 path. :func:`reference` computes the same product in PyTorch (the tests' oracle and the fallback).
"""

from __future__ import annotations

import os

import torch

BLOCK, TILE = 32, 16
KINDS = {"i8": 0, "q8_0": 1, "q4_1": 2}
#: Instruction-set codes of the quantized products (``csrc/common.h``: kIsaAvx512Vnni, kIsaAvx2).
ISA_NAMES = {3: "avx512-vnni", 1: "avx2"}


def _module():
    from . import module

    return module()


def isa() -> str | None:
    """The instruction set the quantized products run here, or None (no native build or no AVX2)."""
    code = _isa_code()
    return ISA_NAMES.get(code)


def _isa_code() -> int:
    mod = _module()
    if mod is None:
        return 0
    best = int(mod.quant_isa())
    if os.environ.get("FBS_NATIVE_ISA", "").lower() == "avx2" and best >= 1:
        return 1
    return best


def _tiles(n: int, k: int) -> tuple[int, int]:
    return -(-n // TILE) * TILE, -(-k // BLOCK)


def _grouped(v: torch.Tensor, n_pad: int, kb: int) -> torch.Tensor:
    """(N_pad, kb * 32) -> (tiles, kb, 8 groups of 4 inputs, 16 channels, 4)."""
    return v.view(n_pad // TILE, TILE, kb, 8, 4).permute(0, 2, 3, 1, 4)


def _block_scales(x: torch.Tensor, n_pad: int, kb: int) -> torch.Tensor:
    """(N, kb) fp16 -> (tiles, kb, 32 bytes): each tile-block's 16 channel scales."""
    pad = torch.zeros(n_pad, kb, dtype=torch.float16)
    pad[: x.shape[0]] = x
    return pad.view(n_pad // TILE, TILE, kb).permute(0, 2, 1).contiguous().view(torch.uint8).view(n_pad // TILE, kb, 32)


def pack(kind: str, q: torch.Tensor, d: torch.Tensor | None = None, m: torch.Tensor | None = None) -> torch.Tensor:
    """The 1-D uint8 layout the kernel streams, from q (N, K) (int8; uint8 in [0, 15] for q4_1) and, for the block
    kinds, d (and m for q4_1) (N, ceil(K / 32)) fp16. Padding (to 16 channels, 32 inputs) is zero."""
    n, k = q.shape
    n_pad, kb = _tiles(n, k)
    if kind == "q4_1":
        if q.dtype != torch.uint8 or d is None or m is None:
            raise ValueError("q4_1 needs uint8 q in [0, 15] and fp16 d and m per (channel, 32-block)")
        pad = torch.zeros(n_pad, kb * BLOCK, dtype=torch.uint8)
        pad[:n, :k] = q
        g = _grouped(pad, n_pad, kb).reshape(n_pad // TILE, kb, 4, 2, 64)
        nib = (g[:, :, :, 0] | (g[:, :, :, 1] << 4)).reshape(n_pad // TILE, kb, 256)
        parts = [nib, _block_scales(d.half(), n_pad, kb), _block_scales(m.half(), n_pad, kb)]
    elif kind in ("i8", "q8_0"):
        if q.dtype != torch.int8 or (kind == "q8_0") != (d is not None):
            raise ValueError(f"{kind} needs int8 q" + (" and fp16 d per (channel, 32-block)" if kind == "q8_0" else ""))
        pad = torch.zeros(n_pad, kb * BLOCK, dtype=torch.int8)
        pad[:n, :k] = q
        parts = [_grouped(pad, n_pad, kb).reshape(n_pad // TILE, kb, 512).view(torch.uint8)]
        if d is not None:
            parts.append(_block_scales(d.half(), n_pad, kb))
    else:
        raise ValueError(f"weight kind must be one of {sorted(KINDS)}, got {kind!r}")
    return torch.cat(parts, 2).contiguous().view(-1)


def channel_scales(s: torch.Tensor) -> torch.Tensor:
    """Per-channel scales of an ``i8`` weight, padded to whole tiles, fp32."""
    out = torch.zeros(-(-s.numel() // TILE) * TILE)
    out[: s.numel()] = s.float()
    return out


def activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) fp32 -> (q (M, Kp) int8, d (M, Kp / 32) fp32) as the kernel quantizes it (PyTorch; round half to
    even, as the kernel's nearbyint)."""
    m, k = x.shape
    kp = -(-k // BLOCK) * BLOCK
    xb = torch.nn.functional.pad(x.float(), (0, kp - k)).view(m, kp // BLOCK, BLOCK)
    amax = xb.abs().amax(-1)
    d = amax / 127
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv.unsqueeze(-1)).to(torch.int8).view(m, kp)
    return q, d


def linear(x: torch.Tensor, packed: torch.Tensor, kind: str, n: int, scales: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) fp32 @ W^T for a packed weight of ``kind`` with n output channels -> (..., n) fp32."""
    code = _isa_code()
    if code == 0:
        raise RuntimeError("the quantized products need the native build on an AVX2 or AVX-512 CPU; "
                           "check fbs.native.status()")
    x2 = x.reshape(-1, x.shape[-1]).float()
    y = _module().quant_linear(x2 if x2.stride(-1) == 1 else x2.contiguous(), packed, scales, KINDS[kind], n, code)
    return y.view(*x.shape[:-1], n)


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The product the kernel computes, in float64: activations quantized as :func:`activations` does, times the
    dequantized weight w (N, K)."""
    q, d = activations(x.reshape(-1, x.shape[-1]))
    k = x.shape[-1]
    xa = (q.double().view(q.shape[0], -1, BLOCK) * d.double().unsqueeze(-1)).view(q.shape[0], -1)[:, :k]
    return (xa @ w.double().T).view(*x.shape[:-1], w.shape[0])
