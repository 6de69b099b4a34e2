"""A static per-layer KV cache with explicit per-layer, per-row lengths.

Under the ``hole`` policy a skipped token writes nothing at that layer, so layers (and rows) hold
different numbers of entries; each entry keeps the RoPE position it was rotated with. Occupancy is never
inferred from tensor contents.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, head_dim: int, capacity: int,
                 device=None, dtype=torch.float32):
        shape = (batch, num_kv_heads, capacity, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        # RoPE position of every stored entry, per layer and row (python lists: appends cost nothing)
        self.positions: list[list[list[int]]] = [[[] for _ in range(batch)] for _ in range(num_layers)]
        self.lengths = [[0] * batch for _ in range(num_layers)]  # python ints: no host syncs on the hot path
        self.capacity = capacity

    def get_seq_length(self, layer: int, row: int) -> int:
        return self.lengths[layer][row]

    def write(self, layer: int, rows: list[int], k: torch.Tensor, v: torch.Tensor, positions: list[list[int]]) -> None:
        """Append T entries per row. k, v: (len(rows), Hkv, T, hd); positions[i] are row i's T positions."""
        t = k.shape[2]
        lens = self.lengths[layer]
        starts = [lens[r] for r in rows]
        if max(starts) + t > self.capacity:
            raise RuntimeError(f"KV cache capacity {self.capacity} exceeded at layer {layer}")
        if len(set(starts)) == 1 and rows == list(range(rows[0], rows[0] + len(rows))):
            s, sl = starts[0], slice(rows[0], rows[0] + len(rows))
            self.k[layer][sl, :, s:s + t] = k
            self.v[layer][sl, :, s:s + t] = v
        else:
            for i, r in enumerate(rows):
                s = starts[i]
                self.k[layer][r, :, s:s + t] = k[i]
                self.v[layer][r, :, s:s + t] = v[i]
        for i, r in enumerate(rows):
            self.positions[layer][r].extend(positions[i])
            lens[r] += t

    def view(self, layer: int, rows: list[int]):
        """Keys, values (b, Hkv, n, hd) of the rows and a bool mask (b, 1, 1, n) of valid entries (None if all)."""
        lens = [self.lengths[layer][r] for r in rows]
        n = max(lens)
        contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
        sl = slice(rows[0], rows[0] + len(rows)) if contiguous else rows
        k, v = self.k[layer][sl, :, :n], self.v[layer][sl, :, :n]
        if min(lens) == n:
            return k, v, None
        mask = torch.arange(n).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)  # (b, n)
        return k, v, mask.to(k.device)[:, None, None, :]
