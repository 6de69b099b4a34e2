"""The quantized blocks of a GGUF's weight matrices, read as they are stored (no dequantization), keyed by the HF
parameter name they become.

SmolLM2-135M ships as Q4_1 (every projection) with a Q8_0 token embedding (also its tied LM head), and the fp32
model :func:`fbs.model.bases.load_base` converts is exactly those blocks dequantized. A weight format that keeps
the blocks (the quantized products of :mod:`fbs.native.quant`) is then the same model at a fraction of the bytes.

Block layouts (ggml): Q4_1 = fp16 d, fp16 m, 16 bytes of nibbles (low nibble element j, high nibble element
j + 16), w = d q + m; Q8_0 = fp16 d, 32 int8, w = d q. The rows of ``attn_q`` / ``attn_k`` are stored in
llama.cpp's rotary order, undone here with transformers' own permutation so rows match the HF weights.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import torch

#: GGUF tensor name parts -> the HF Llama parameter they load into.
_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
BLOCK = 32


@dataclasses.dataclass
class Blocks:
    """One (N, K) weight as stored: ``kind`` "q4_1" (q uint8 in [0, 15], d and m (N, K / 32) fp16) or "q8_0"
    (q int8, d (N, K / 32) fp16, m None)."""

    kind: str
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight the blocks stand for, computed as ggml does (fp16 scales widened to fp32)."""
        n, k = self.q.shape
        w = self.q.float().view(n, k // BLOCK, BLOCK) * self.d.float().unsqueeze(-1)
        if self.m is not None:
            w = w + self.m.float().unsqueeze(-1)
        return w.view(n, k)


def _blocks(tensor) -> Blocks | None:
    raw = np.asarray(tensor.data)
    k, n = (int(x) for x in tensor.shape)  # GGUF lists the shape innermost first
    kind = tensor.tensor_type.name
    if kind == "Q4_1":
        b = raw.reshape(n, k // BLOCK, 20)
        d, m = (torch.from_numpy(b[..., i:i + 2].copy().view(np.float16)[..., 0]) for i in (0, 2))
        qs = b[..., 4:20]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)
        return Blocks("q4_1", torch.from_numpy(q.astype(np.uint8)), d, m)
    if kind == "Q8_0":
        b = raw.reshape(n, k // BLOCK, 34)
        d = torch.from_numpy(b[..., 0:2].copy().view(np.float16)[..., 0])
        q = torch.from_numpy(b[..., 2:34].copy().view(np.int8).reshape(n, k))
        return Blocks("q8_0", q, d, None)
    return None


def _row_order(name: str, n: int, heads: int, kv_heads: int) -> torch.Tensor:
    """The HF row order of a GGUF tensor's rows (identity except for the rotary-permuted Q and K)."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    if ".attn_q." not in name and ".attn_k." not in name:
        return torch.arange(n)
    proc = LlamaTensorProcessor(config={"num_attention_heads": heads, "num_key_value_heads": kv_heads})
    return torch.from_numpy(np.ascontiguousarray(proc.process(np.arange(n), name).weights))


def read_blocks(path: str | os.PathLike, heads: int, kv_heads: int) -> dict[str, Blocks]:
    """The Q4_1 / Q8_0 weight matrices of the Llama-family GGUF at ``path`` by HF parameter name (others are
    left out), rows in HF order. ``heads`` / ``kv_heads``: the model's attention and K/V head counts."""
    from gguf import GGUFReader

    out = {}
    for t in GGUFReader(str(path)).tensors:
        parts = t.name.split(".")
        if t.name == "token_embd.weight":
            key = "model.embed_tokens.weight"
        elif parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
            key = f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"
        else:
            continue
        blocks = _blocks(t)
        if blocks is None:
            continue
        order = _row_order(t.name, blocks.q.shape[0], heads, kv_heads)
        out[key] = Blocks(blocks.kind, blocks.q[order], blocks.d[order],
                          None if blocks.m is None else blocks.m[order])
    return out
