"""Weight formats of the engine's fused inference copies: fp32, bf16, int8 weight-only, and the block formats q8
and q4.

int8 is symmetric per output channel: w ~= q * s with q in [-127, 127] (int8, (N, K)) and one bf16 scale per
output row. One-token steps run the native int8 kernel (:func:`fbs.native.int8_linear`: fp32 activations, the
weights repacked once at load, ``packed=True``) where it is available (eager CPU decoding with AVX2 or AVX-512),
else ``torch._weight_int8pack_mm`` with bf16 activations (its fast path on CPU; with fp32 activations that kernel
is slow). The residual stream, norms and biases stay in the model's dtype.

``q8`` and ``q4`` are GGUF's Q8_0 and Q4_1 blocks (:func:`quantize_blocks`): per output channel and 32 inputs,
an fp16 scale d (q8: w ~= d q, q int8) or an fp16 scale d and min m (q4: w ~= d q + m, q in [0, 15]), rounded to
nearest. A checkpoint whose weights are already such blocks (SmolLM2-135M ships as a Q4_1 GGUF with a Q8_0
embedding) gets its own blocks back exactly, so q4 is then the same weights at a fraction of the bytes. q4 keeps
the LM head in q8 (as that GGUF does). Their products run natively with the activations quantized to int8 per
32-value block and integer dot products (:mod:`fbs.native.quant`: AVX-512 VNNI, else AVX2); where those kernels
are missing (no build, no AVX2, not a CPU) the blocks are dequantized to fp32 once and used as fp32 weights.

A weight with a LoRA adapter merged into it (``lowrank``: the factors :func:`fbs.model.lora.merged_lowrank`
keeps) whose base weight (weight - b @ a) is exactly blocks of the format (a GGUF checkpoint's own blocks, e.g. the
Q4_1 layers of SmolLM2 in q4) is stored as those blocks plus the fp32 delta, applied apart: y = W_blocks x + b (a x).
The merged weight has left the base's grid, and rounding it back onto a grid costs far more than the base's own
quantization did. A base that is not such blocks (q8 of a Q4_1 checkpoint, any fp32 checkpoint) gains nothing
from the delta apart, which costs reads of the fp32 factors every step: its merged weight is quantized as usual.
Without the native kernels the delta is added to the dequantized fp32 weight once (the same product up to float
rounding).

``fp32-onednn`` keeps fp32 weights in oneDNN's blocked layout (packed once at load) and runs every product
through oneDNN's linear (``torch.ops.mkldnn._linear_pointwise``). On this 2-core CPU its batch-1 GEMV reads
weights faster than ``F.linear`` (``scripts/gemv_floor.py`` measures both). It is fp32 arithmetic with a different
summation order: logits differ from ``fp32`` by float rounding (~1e-5 relative), not bit for bit. CPU only.

The KV cache's entries (:mod:`fbs.engine.cache`) are stored as the cache's dtype says (:func:`kv_store`,
:func:`kv_load`): fp32, fp16 or bf16 values, or int8 entries of ``hd + 4`` bytes, one per token and KV head: the
entry's codes (:func:`quantize_rows`: symmetric, max |x| -> 127) followed by its fp32 scale, the layout the native
attention reads (``fbs_attn::Entry`` in csrc/attention.h). An int8 cache's keys are stored divided by per-channel
powers of two calibrated per model (:func:`key_factors`), and queries multiplied by them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .. import native
from ..native import quant as native_quant

FORMATS = ("fp32", "bf16", "int8", "q8", "q4", "fp32-onednn")
#: the block formats: GGUF kind of their matrices and of their LM head
BLOCK_FORMATS = {"q8": ("q8_0", "q8_0"), "q4": ("q4_1", "q8_0")}


class BlockMeta(NamedTuple):
    """What :func:`matmul` needs besides a block format's packed bytes (it takes the place of int8's scales): the
    GGUF kind, the output width and the low-rank delta applied apart (a (r, K), b (N, r); None when none)."""

    kind: str
    n: int
    a: torch.Tensor | None = None
    b: torch.Tensor | None = None


class Weight:
    """One (N, K) matrix in a storage format, applied as ``x @ W^T``.

    ``w``: fp32 / bf16 / int8 data; ``s``: (N,) bf16 scales for int8, else None. ``packed`` (int8 and the block
    formats): ``w`` in the native kernels' 1-D layout (:func:`fbs.native.int8_pack`, :func:`fbs.native.quant.pack`)
    and :attr:`native` the :class:`fbs.native.PackedWeight` a native layer streams; the caller checks that the
    kernels exist here (:func:`fbs.native.int8_isa`, :func:`fbs.native.quant.isa`). ``kind`` overrides a block
    format's GGUF kind (the LM head of q4 is q8_0). ``lowrank`` (a (r, K), b (N, r)): w includes the delta b @ a
    (a merged LoRA adapter); where the rows of w - b @ a that the delta moves are exactly blocks of the format (the
    base weights of a GGUF checkpoint), a block format stores the blocks of w - b @ a and applies the delta apart,
    its factors rounded to fp16 (the kernel's storage); otherwise, and in the other formats, w itself."""

    def __init__(self, w: torch.Tensor, fmt: str, packed: bool = False, kind: str | None = None,
                 lowrank: tuple[torch.Tensor, torch.Tensor] | None = None):
        if fmt not in FORMATS:
            raise ValueError(f"weight format must be one of {FORMATS}, got {fmt!r}")
        self.fmt, self.out_features, self.in_features = fmt, w.shape[0], w.shape[1]
        self.packed = packed and (fmt == "int8" or fmt in BLOCK_FORMATS)
        self.native = None
        self.blocks = None
        self.lowrank = None
        w = w.detach()
        device = w.device
        if fmt in BLOCK_FORMATS:
            self.kind = kind or BLOCK_FORMATS[fmt][0]
            if lowrank is not None:
                a, b = (t.detach().float().cpu().contiguous() for t in lowrank)
                if a.dim() != 2 or b.dim() != 2 or a.shape[1] != w.shape[1] or b.shape != (w.shape[0], a.shape[0]):
                    raise ValueError(f"a low-rank delta of a {tuple(w.shape)} weight needs a (r, {w.shape[1]}) and "
                                     f"b ({w.shape[0]}, r), got {tuple(a.shape)} and {tuple(b.shape)}")
                base = w.float().cpu() - b @ a  # the base up to the rounding of the merge (an ulp of w)
                blocks = quantize_blocks(base, self.kind)
                # the rows the delta moves must be such blocks (rows without a delta are quantized as they are)
                moved = b.abs().amax(1) > 0
                off = (dequantize_blocks(*blocks) - base)[moved].abs()
                half = (a.half().float(), b.half().float())  # the delta's factors are stored in fp16 (half the
                #                                               bytes a step reads; their rounding is ~5e-4 of each)
                if moved.any() and float(off.max()) <= 4 * torch.finfo(torch.float32).eps * float(w.abs().max()) \
                        and all(bool(torch.isfinite(t).all()) for t in half):
                    self.lowrank, self.blocks = half, blocks
            if self.blocks is None:
                self.blocks = quantize_blocks(w, self.kind)
            if self.packed:
                self.w = native_quant.pack(self.kind, *self.blocks)
                self.native = native.packed_weight(native_quant.KINDS[self.kind], self.w, None, *w.shape)
                if self.lowrank is not None:
                    a, b = self.lowrank
                    self.native.set_lowrank(a, b.t().contiguous())
                self.s = BlockMeta(self.kind, self.out_features, *(self.lowrank or (None, None)))
            else:
                self.w, self.s = self.dequantized().to(device), None
            return
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
                self.native = native.packed_weight(native.INT8_F32, self.w, self.s, *w.shape)

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.w, self.s

    def dequantized(self, dtype=torch.float32) -> torch.Tensor:
        """The weight the format computes with, as a dense (N, K) tensor (a block format's delta included)."""
        if self.blocks is not None:
            w = dequantize_blocks(*self.blocks)
            if self.lowrank is not None:
                a, b = self.lowrank
                w = w + b @ a
            return w.to(dtype)
        w = self.w.to_dense() if self.w.is_mkldnn else self.w
        if self.packed:
            w = native.int8_unpack(w, self.out_features, self.in_features)
        return dequantize(w, self.s, dtype)


def native_kernels() -> dict[str, str | None]:
    """Per weight format, the native products its one-token and multi-token steps run on this machine (with their
    instruction set), or None where the PyTorch ops run (fp32 / bf16 always; the others without the native build
    or the CPU's instruction sets). Builds the native extension if it is not built yet."""
    i8 = native.int8_isa()
    blocks = native_quant.isa() if i8 is not None else None
    return {"fp32": None, "bf16": None, "fp32-onednn": None,
            "int8": None if i8 is None else f"int8 weights x fp32 activations ({i8})",
            "q8": None if blocks is None else f"q8_0 weights x int8 activations per 32 ({blocks})",
            "q4": None if blocks is None else f"q4_1 weights x int8 activations per 32, q8_0 head ({blocks})"}


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (int8 codes (M, K), scales (M, 1)): symmetric per row, max |x| -> 127 (a zero row: scale 1),
    rounded to nearest even. The rule of a prompt's int8 activations (:mod:`fbs.engine.prefill`) and of an int8 KV
    cache's entries (:func:`fbs.engine.cache.kv_store`); the reference of the native kernel
    (:func:`fbs.native.quantize_rows`)."""
    amax = x.abs().amax(1, keepdim=True)
    sx = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return torch.round(x / sx).to(torch.int8), sx


#: bytes an int8 KV entry keeps after its codes: its fp32 scale (:func:`kv_store`)
KV_SCALE_BYTES = 4


def kv_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one stored KV entry (a token's key or value at one KV head): ``head_dim``, or with int8 its codes
    and its scale's bytes."""
    return head_dim + KV_SCALE_BYTES if dtype == torch.int8 else head_dim


def kv_store(x: torch.Tensor, dtype: torch.dtype, factor: torch.Tensor | None = None) -> torch.Tensor:
    """Entries x (..., hd) as stored in a cache of ``dtype``: cast (half precision rounds to nearest even), or for int8
    each entry's codes and scale (:func:`quantize_rows` per entry), (..., hd + 4) int8. ``factor`` (broadcastable to
    x, powers of two): keys are stored divided by it (:func:`key_factors`)."""
    if factor is not None:
        x = x / factor
    if dtype != torch.int8:
        return x.to(dtype)
    lead, hd = x.shape[:-1], x.shape[-1]
    rows = x.detach().reshape(-1, hd).float()
    # the native pass where it runs (a prompt's K/V: one pass instead of six ATen ops; the same bits), else the reference
    fast = None if torch.compiler.is_compiling() else native.quantize_rows(rows)
    q, s = fast if fast is not None else quantize_rows(rows)
    return torch.cat((q, s.view(torch.int8)), 1).view(*lead, hd + KV_SCALE_BYTES)


def kv_load(e: torch.Tensor, dtype: torch.dtype, factor: torch.Tensor | None = None) -> torch.Tensor:
    """Stored entries ``e`` (:func:`kv_store`) as values of ``dtype`` (int8: codes times scale; times ``factor``
    where they were stored divided by it)."""
    if e.dtype != torch.int8:
        x = e.to(dtype)
    else:
        hd = e.shape[-1] - KV_SCALE_BYTES
        scale = e[..., hd:].contiguous().view(torch.float32)                                  # (..., 1)
        x = (e[..., :hd].to(torch.float32) * scale).to(dtype)
    return x if factor is None else x * factor.to(dtype)


def key_factors(keys: torch.Tensor) -> torch.Tensor:
    """Per-channel key factors of one layer from calibration keys (Hkv, n, hd) (after RoPE): (Hkv, 1, hd) powers of
    two. An int8 cache stores each key divided by them and the attention multiplies its query by them, so q . k is
    unchanged (exactly: powers of two), while a channel that is large in every key (Qwen's outlier channels) no longer
    sets the one scale of every entry and crushes the others to a few codes. The rule: a rotary channel pair (i,
    i + hd/2, rotated together, so one factor commutes with RoPE) gets sqrt of its largest norm over the keys
    (SmoothQuant's alpha = 1/2), relative to the head's geometric mean, rounded to a power of two. Pairs that are zero
    in every key get 1."""
    h, _, hd = keys.shape
    half = hd // 2
    k = keys.detach().float()
    norm = (k[..., :half] ** 2 + k[..., half:] ** 2).sqrt().amax(1)                           # (Hkv, hd / 2)
    live = norm > 0
    log = torch.where(live, 0.5 * torch.log2(norm.clamp_min(1e-30)), torch.zeros_like(norm))
    mean = (log * live).sum(1, keepdim=True) / live.sum(1, keepdim=True).clamp_min(1)
    e = torch.where(live, torch.round(log - mean), torch.zeros_like(log))
    f = torch.exp2(e)
    return torch.cat((f, f), 1).view(h, 1, hd).contiguous()


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: (q (N, K) int8, s (N,) bf16) with w ~= q * s."""
    w = w.detach().float()
    s = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).to(torch.bfloat16)  # rounded first, so q matches it
    q = torch.round(w / s.float().unsqueeze(1)).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), s.contiguous()


def quantize_blocks(w: torch.Tensor, kind: str) -> tuple:
    """GGUF blocks of w (N, K) per output channel and 32 inputs (K zero-padded to a multiple of 32), rounded to
    nearest as ggml's reference quantizer does: ``q4_1`` -> (q uint8 in [0, 15], d, m), m = min, d = (max - min) / 15;
    ``q8_0`` -> (q int8, d), d = max|w| / 127; d and m fp16 (N, K / 32). Weights that are such blocks already come
    back exactly."""
    w = w.detach().float().cpu()
    n, k = w.shape
    kp = -(-k // native_quant.BLOCK) * native_quant.BLOCK
    wb = F.pad(w, (0, kp - k)).view(n, kp // native_quant.BLOCK, native_quant.BLOCK)
    if kind == "q4_1":
        lo, hi = wb.amin(-1), wb.amax(-1)
        d, m = ((hi - lo) / 15).half(), lo.half()
        inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros_like(lo))
        q = torch.round((wb - m.float().unsqueeze(-1)) * inv.unsqueeze(-1)).clamp_(0, 15).to(torch.uint8)
        return q.view(n, kp)[:, :k].contiguous(), d, m
    if kind == "q8_0":
        d = (wb.abs().amax(-1) / 127).half()
        inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros(d.shape))
        q = torch.round(wb * inv.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
        return q.view(n, kp)[:, :k].contiguous(), d
    raise ValueError(f"block kind must be q4_1 or q8_0, got {kind!r}")


def dequantize_blocks(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 (N, K) weight of :func:`quantize_blocks`' blocks, as ggml dequantizes them (d q [+ m] in fp32)."""
    n, k = q.shape
    kp = -(-k // native_quant.BLOCK) * native_quant.BLOCK
    qb = F.pad(q.float(), (0, kp - k)).view(n, kp // native_quant.BLOCK, native_quant.BLOCK)
    w = qb * d.float().unsqueeze(-1)
    if m is not None:
        w = w + m.float().unsqueeze(-1)
    return w.view(n, kp)[:, :k].contiguous()


def dequantize(w: torch.Tensor, s: torch.Tensor | None, dtype=torch.float32) -> torch.Tensor:
    if s is None:
        return w.to(dtype)
    return (w.to(torch.float32) * s.to(torch.float32).unsqueeze(1)).to(dtype)


def matmul(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
    """x (..., K) @ W^T in W's format, result in x's dtype. bf16 and (unpacked) int8 compute with bf16 activations,
    packed int8 (1-D ``w``, :class:`Weight` ``packed=True``) with fp32 ones in the native kernel."""
    if isinstance(s, BlockMeta):  # a packed block format: the native quantized product (+ its delta, apart)
        y = native_quant.linear(x, w, s.kind, s.n)
        if s.a is not None:
            y = y + (x.float() @ s.a.t()) @ s.b.t()
        return y.to(x.dtype)
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
