"""A static per-layer KV cache with explicit per-layer, per-row lengths, and the engine's attention context.

Under the ``hole`` policy a skipped token writes nothing at that layer, so layers (and rows) hold
different numbers of entries; each entry keeps the RoPE position it was rotated with. Occupancy is never
inferred from tensor contents: lengths are Python ints, so the hot path needs no host reads.

Buffers are preallocated at full capacity (gpt-fast's static cache). A one-token decode step writes each
row's entry at its own slot and attends over the whole buffer with a length mask, so every step has the
same shapes (what a compiled layer step needs); prefill writes and reads views of the filled part.

The entries may be stored in half precision (``kv_dtype`` fp16 or bf16, :data:`KV_DTYPES`) or as int8 codes with a
scale per entry (``int8``): a write rounds them (keys after RoPE; :func:`kv_store`), and every read converts them
back to the compute dtype (:meth:`KVCache.view`, :func:`kv_load`; the native attention converts in registers), so
attention itself still runs and accumulates in fp32. An int8 entry (one token's key or value at one KV head) is a
row of ``hd + 4`` bytes: its ``hd`` codes, then its fp32 scale (max |x| / 127, :func:`fbs.engine.quant.quantize_rows`'
rule), so an entry moves with its scale wherever entries move (eviction, rollback, a row's copy). Its keys are
stored divided by per-layer, per-channel powers of two (``key_factors``, :func:`fbs.engine.quant.key_factors`):
a read multiplies them back, the native attention multiplies the query instead (the same products, exactly).

With a cache policy (:mod:`fbs.engine.kvpolicy`: StreamingLLM, H2O, SnapKV under a budget) the cache holds only
the kept entries, still as each row's filled prefix of every layer; the policy evicts once a step's entries are
written and attended (:meth:`KVCache.settle`). A chunked prefill's later chunks attend over the kept entries plus
themselves and the policy reduces both to its budget (``Evictor.extend``); under the full cache they are appended
and attend over everything cached (causal among themselves).
"""

from __future__ import annotations

import bisect

import torch

from .. import native
from ..model.chunk import ChunkOut, ChunkState
from .defaults import KV_STORAGE
from .kvpolicy import CachePolicy, attend_scored, prompt_attention
from .quant import kv_load, kv_store, kv_width


#: the storage dtypes of ``kv_dtype`` (fp16 is the half-precision choice: three more mantissa bits than bf16 and one
#: conversion instruction each way; bf16 keeps fp32's exponent range; int8: codes and a scale per entry, module doc)
KV_DTYPES = dict(zip(KV_STORAGE, (torch.float32, torch.float16, torch.bfloat16, torch.int8)))


def kv_storage_dtype(kv_dtype: str, compute: torch.dtype) -> torch.dtype:
    """The cache's storage dtype for ``kv_dtype`` (:data:`KV_DTYPES`) under a model computing in ``compute``:
    ``fp32`` keeps the compute dtype (a bf16 model keeps a bf16 cache)."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    return compute if kv_dtype == "fp32" else KV_DTYPES[kv_dtype]


class KVCache:
    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, head_dim: int, capacity: int,
                 device=None, dtype=torch.float32, policy: CachePolicy | None = None, rope=None,
                 compute_dtype: torch.dtype | None = None, key_factors: list[torch.Tensor] | None = None):
        """``dtype``: the entries' storage dtype; ``compute_dtype`` (default ``dtype``): what :meth:`view` returns;
        ``key_factors``: per layer (Hkv, 1, hd) powers of two its keys are stored divided by
        (:func:`fbs.engine.quant.key_factors`; an int8 cache's), or None."""
        shape = (batch, num_kv_heads, capacity, kv_width(head_dim, dtype))
        self.head_dim = head_dim
        self.compute_dtype = dtype if compute_dtype is None else compute_dtype
        if key_factors is not None and len(key_factors) != num_layers:
            raise ValueError(f"key_factors: one per layer ({num_layers}), got {len(key_factors)}")
        #: per layer the factors its keys are stored divided by (None: none); queries attend multiplied by them
        self.key_factor: list[torch.Tensor | None] = list(key_factors) if key_factors is not None \
            else [None] * num_layers
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        # RoPE position of every stored entry, per layer and row (python lists: appends cost nothing)
        self.positions: list[list[list[int]]] = [[[] for _ in range(batch)] for _ in range(num_layers)]
        self.lengths = [[0] * batch for _ in range(num_layers)]  # python ints: no host syncs on the hot path
        self.capacity = capacity
        self.batch = batch
        #: the cache policy's state (None: the full cache); ``rope(positions) -> (cos, sin)``: the model's tables
        self.evictor = None if policy is None else policy.bind(self, rope)

    def get_seq_length(self, layer: int, row: int) -> int:
        return self.lengths[layer][row]

    def advance(self, layer: int, rows: list[int], positions: list[list[int]]) -> list[int]:
        """Book T new entries per row (positions[i] are row i's T positions); returns each row's first slot."""
        return self.advance_layers(range(layer, layer + 1), rows, positions)[0]

    def advance_layers(self, layers: range, rows: list[int], positions: list[list[int]]) -> list[list[int]]:
        """:meth:`advance` at each of ``layers`` (a step's native run books them together: one call per step, not
        per layer); returns per layer each row's first slot."""
        t = len(positions[0])
        out = []
        for l in layers:
            lens, held = self.lengths[l], self.positions[l]
            starts = [lens[r] for r in rows]
            if max(starts) + t > self.capacity:
                raise RuntimeError(f"KV cache capacity {self.capacity} exceeded at layer {l}")
            for i, r in enumerate(rows):
                held[r].extend(positions[i])
                lens[r] += t
            out.append(starts)
        if self.evictor is not None:
            self.evictor.booked(layers, rows, out, positions)
        return out

    def settle(self, layer: int, rows: list[int]) -> None:
        """The rows' new entries at ``layer`` are written and attended: the cache policy (if any) evicts down to its
        budget."""
        if self.evictor is not None:
            self.evictor.settle(layer, rows)

    def kept(self, layer: int, row: int) -> torch.Tensor:
        """(Hkv, n) positions of the entries ``row`` holds at ``layer``, in slot order (per KV head: a per-head
        policy keeps different positions at different heads)."""
        if self.evictor is not None:
            return self.evictor.kept(layer, row)
        return torch.tensor(self.positions[layer][row], dtype=torch.long).expand(self.k[layer].shape[1], -1)

    def write(self, layer: int, rows: list[int], k: torch.Tensor, v: torch.Tensor, positions: list[list[int]]) -> None:
        """Append T entries per row. k, v: (len(rows), Hkv, T, hd); positions[i] are row i's T positions."""
        t = k.shape[2]
        starts = self.advance(layer, rows, positions)
        if len(set(starts)) == 1 and rows == list(range(rows[0], rows[0] + len(rows))):
            s, sl = starts[0], slice(rows[0], rows[0] + len(rows))
            self.k[layer][sl, :, s:s + t] = kv_store(k, self.k[layer].dtype, self.key_factor[layer])
            self.v[layer][sl, :, s:s + t] = kv_store(v, self.v[layer].dtype)
        else:
            k, v = kv_store(k, self.k[layer].dtype, self.key_factor[layer]), kv_store(v, self.v[layer].dtype)
            for i, r in enumerate(rows):
                s = starts[i]
                self.k[layer][r, :, s:s + t] = k[i]
                self.v[layer][r, :, s:s + t] = v[i]

    def crop(self, rows: list[int], keep: list[int], layers=None) -> None:
        """Forget every entry of row ``rows[i]`` whose position is >= ``keep[i]``, at ``layers`` (default all):
        rolls back what a rejected speculative draft wrote. A row's entries are stored in position order, so it
        keeps a prefix of each layer (under ``hole`` layers hold different counts); the buffers are not cleared,
        lengths mask them out."""
        if self.evictor is not None:
            raise ValueError("rolling back entries is not supported under a KV cache policy (kv_cache='full' only)")
        for l in range(len(self.k)) if layers is None else layers:
            for r, p in zip(rows, keep):
                pos = self.positions[l][r]
                n = bisect.bisect_left(pos, p)
                del pos[n:]
                self.lengths[l][r] = n

    def view(self, layer: int, rows: list[int]):
        """Keys, values (b, Hkv, n, hd) of the rows, in the compute dtype, and a bool mask (b, 1, 1, n) of valid entries (None if all)."""
        lens = [self.lengths[layer][r] for r in rows]
        n = max(lens)
        contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
        sl = slice(rows[0], rows[0] + len(rows)) if contiguous else rows
        k, v = self.k[layer][sl, :, :n], self.v[layer][sl, :, :n]
        if k.dtype != self.compute_dtype or self.key_factor[layer] is not None:  # attention reads fp32 keys
            k, v = kv_load(k, self.compute_dtype, self.key_factor[layer]), kv_load(v, self.compute_dtype)
        if min(lens) == n:
            return k, v, None
        mask = torch.arange(n).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)  # (b, n)
        return k, v, mask.to(k.device)[:, None, None, :]

    # ---- slots (continuous batching: a row is a slot that requests join and leave) ----
    def load_row(self, row: int, src: "KVCache", src_row: int = 0) -> None:
        """Replace row ``row`` with a copy of ``src``'s row ``src_row`` (e.g. one prompt's prefill), every layer."""
        if (self.evictor is None) != (src.evictor is None) or (
                self.evictor is not None and self.evictor.policy != src.evictor.policy):
            raise ValueError("load_row between caches of different KV cache policies")
        for l in range(len(self.k)):
            n = src.lengths[l][src_row]
            if n > self.capacity:
                raise RuntimeError(f"KV cache capacity {self.capacity} exceeded at layer {l}: the row holds {n}")
            self.k[l][row, :, :n] = src.k[l][src_row, :, :n]
            self.v[l][row, :, :n] = src.v[l][src_row, :, :n]
            self.positions[l][row] = list(src.positions[l][src_row])
            self.lengths[l][row] = n
        if self.evictor is not None:
            self.evictor.load_row(row, src.evictor, src_row)

    def clear_row(self, row: int) -> None:
        """Empty row ``row`` (its stale tensors stay: lengths mask them out)."""
        for l in range(len(self.k)):
            self.positions[l][row] = []
            self.lengths[l][row] = 0
        if self.evictor is not None:
            self.evictor.clear_row(row)


class CacheContext:
    """Where a layer step's K/V go during decoding: some rows of a :class:`KVCache`, their chunk caches and
    positions. ``cos``/``sin`` (b, T, hd) are the rows' rotary tables for the T new tokens."""

    soft_window = False
    truncate = True  # PAW computes horizons up to max k(t) only
    #: when a dict, :meth:`chunk` appends per CH layer the rows' chunk state after each token it consumes (a
    #: speculative verifier keeps the state after the last accepted token)
    trail: dict[int, list[ChunkState]] | None = None
    #: one-token chunk steps run :func:`fbs.native.chunk_step` in place (the engine's native int8 step sets it)
    native_chunk = False
    #: several new tokens per row run the native layers of the decode format (a speculative verifier sets it;
    #: :func:`fbs.engine.fused.full_depth`), not the HF modules' GEMMs of a prefill
    native_many = False
    #: a prompt's attention over an empty cache runs :func:`fbs.native.causal_attention` (the decoder sets it under the
    #: native formats; the fp32 and bf16 formats keep SDPA, HF's own)
    native_causal = False
    #: the row-independent product PAW computes with (:func:`fbs.native.linear_rows`; the decoder sets it for its
    #: steps and a verifier's passes, so that a position gets the same bits alone or among T). None: torch's
    linear = None
    #: per PAW layer the arguments of :func:`fbs.native.paw_step` (the decoder sets them with :attr:`linear`, where
    #: the kernel takes its module); None: the module's own forward with :attr:`linear`
    native_paw: dict | None = None

    def __init__(self, cache: KVCache, chunks: dict[int, ChunkState], rows: list[int], positions: list[list[int]],
                 cos: torch.Tensor, sin: torch.Tensor, policy: str, preview_emb=None, preview_keys=None,
                 scaling: float = 1.0):
        self.cache, self.chunks, self.rows, self.positions = cache, chunks, rows, positions
        self.cos, self.sin, self.policy, self.scaling = cos, sin, policy, scaling
        self.preview_emb, self.preview_keys = preview_emb, preview_keys or {}
        self.all_rows = rows == list(range(cache.batch))
        self._rows_t = None
        self._slots: dict[tuple[int, ...], torch.Tensor] = {}

    @property
    def rows_t(self) -> torch.Tensor:
        if self._rows_t is None:
            self._rows_t = torch.tensor(self.rows, device=self.cos.device)
        return self._rows_t

    def select(self, idx: list[int]) -> "CacheContext":
        """The context of a subset of these rows (``idx`` indexes ``self.rows``)."""
        ti = torch.tensor(idx, device=self.cos.device)
        sub = CacheContext(self.cache, self.chunks, [self.rows[i] for i in idx], [self.positions[i] for i in idx],
                           self.cos.index_select(0, ti), self.sin.index_select(0, ti), self.policy,
                           self.preview_emb, self.preview_keys, self.scaling)
        sub.native_chunk, sub.linear, sub.native_paw = self.native_chunk, self.linear, self.native_paw  # same kernels
        return sub

    # ---- attention --------------------------------------------------------
    def attend(self, l: int, q, k, v, hole=None) -> torch.Tensor:
        """Write the rows' K/V, then attend over everything cached at layer l (causal among the new tokens)."""
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        t = q.shape[2]
        fresh = all(self.cache.lengths[l][r] == 0 for r in self.rows)
        evictor = self.cache.evictor
        if t > 1 and evictor is not None:  # a prompt (or a prefill chunk after kept entries) under a cache policy:
            #                                 it attends, then the policy keeps its budget
            if fresh:
                return evictor.prefill(l, self.rows, q, k, v, self.positions, self.scaling, self.native_causal)
            return evictor.extend(l, self.rows, q, k, v, self.positions, self.scaling, self.native_causal)
        self.cache.write(l, self.rows, k, v, self.positions)
        gqa = k.shape[1] != q.shape[1]
        if t > 1 and fresh:  # prefill of an empty cache: plain causal attention over the new tokens (fast path)
            return prompt_attention(q, k, v, self.scaling, self.native_causal)
        kk, vv, mask = self.cache.view(l, self.rows)
        if t > 1 and mask is None and hole is None and self.attention_scores(l) is None:
            # a prompt chunk (or a verified draft) after as many cached entries in every row: the chunk's own causal
            # attention over them and itself
            o = prompt_attention(q, kk, vv, self.scaling, self.native_causal)
            self.settle(l)
            return o
        if t > 1:  # tokens after cached ones (a verified draft): causal among them, each row up to its own length
            n = kk.shape[2]
            lens = torch.tensor([self.cache.lengths[l][r] for r in self.rows], device=q.device)
            last = lens[:, None] - t + torch.arange(t, device=q.device)          # (b, t) slot of each new token
            mask = (torch.arange(n, device=q.device) <= last[..., None])[:, None]  # (b, 1, t, n)
        acc = self.attention_scores(l)
        if acc is not None:
            o = attend_scored(q, kk, vv, mask, self.scaling, acc, self.rows_t)
        else:
            o = sdpa(q, kk, vv, attn_mask=mask, scale=self.scaling, enable_gqa=gqa)
        self.settle(l)
        return o

    def write(self, l: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append the rows' K/V without attending (a skipped token's entry under ``project``)."""
        self.cache.write(l, self.rows, k, v, self.positions)
        self.settle(l)

    def settle(self, l: int) -> None:
        """The step's entries at layer l are written and attended: the cache policy evicts (no-op without one)."""
        if self.cache.evictor is not None:
            self.cache.evictor.settle(l, self.rows)

    def attention_scores(self, l: int) -> torch.Tensor | None:
        """(B, Hkv, C) accumulated attention weights of layer l's entries when the cache policy keeps them (H2O):
        the step's attention then adds its weights (:func:`fbs.engine.kvpolicy.attend_scored`)."""
        evictor = self.cache.evictor
        return None if evictor is None else evictor.scores(l)

    def decode_slots(self, l: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """For a one-token step of fixed shapes: the layer's full K/V buffers, each row's slot (b,) for its new
        entry, and the row indices (None when the step covers every row of the cache, in order). Books the
        entries; the caller writes them (see :func:`fbs.engine.fused.attend_static`)."""
        slots = self._slot_tensor(tuple(self.cache.advance(l, self.rows, self.positions)))
        return self.cache.k[l], self.cache.v[l], slots, None if self.all_rows else self.rows_t

    def _slot_tensor(self, starts: tuple[int, ...]) -> torch.Tensor:
        """One tensor per distinct slot list of the step (every layer's, unless layers skip under ``hole``)."""
        slots = self._slots.get(starts)
        if slots is None:
            slots = self._slots[starts] = torch.tensor(starts, device=self.cos.device)
        return slots

    def book(self, layers: range, wrote: list[bool] | None) -> None:
        """Book the entries a native run (:meth:`fbs.engine.fused.FusedOps.native_run`) wrote at ``layers``: every
        row's at every layer (``wrote`` None) or those flagged (layer-major, one flag per row and layer); it wrote
        them at each row's current length."""
        b = len(self.rows)
        if wrote is None or all(wrote):
            self.cache.advance_layers(layers, self.rows, self.positions)
            if self.cache.evictor is not None:
                self.cache.evictor.settle_layers(layers, self.rows)
            return
        for k, l in enumerate(layers):
            flags = wrote[k * b:(k + 1) * b]
            if any(flags):
                idx = [i for i, w in enumerate(flags) if w]
                rows = [self.rows[i] for i in idx]
                self.cache.advance(l, rows, [self.positions[i] for i in idx])
                self.cache.settle(l, rows)

    # ---- PAW --------------------------------------------------------------
    def preview(self, l: int, paw, xn: torch.Tensor) -> PreviewOut:
        """PAW layer l's preview of the new tokens' normalized states ``xn`` (b, T, d), hard window: the native step
        where the decoder set it for this layer, else the module with :attr:`linear`."""
        weights = None if self.native_paw is None else self.native_paw.get(l)
        if weights is not None:
            return native.paw_step(weights, xn)
        return paw(xn, self.preview_emb, self.preview_keys[str(l)], soft=self.soft_window, truncate=self.truncate,
                   linear=self.linear)

    # ---- chunk head -------------------------------------------------------
    def chunk(self, l: int, head, xn: torch.Tensor, hole=None) -> ChunkOut:
        rows = self.rows_t
        if xn.shape[1] > 1 and all(p[0] == 0 for p in self.positions):  # a prompt from scratch: the parallel form
            out, state = head(xn, return_state=True)
            self.chunks[l].assign(rows, state)
            return out
        if self.native_chunk and xn.shape[1] == 1 and self.trail is None:
            return ChunkOut(*native.chunk_step(head, xn, rows, self.chunks[l]), None, None)
        if self.native_chunk:  # several tokens (a verifier's): the native step of each, as decoding runs them
            steps = []
            for j in range(xn.shape[1]):
                steps.append(native.chunk_step(head, xn[:, j:j + 1], rows, self.chunks[l]))
                if self.trail is not None:
                    self.trail.setdefault(l, []).append(self.chunks[l].select(rows))
            c, logits, bound = zip(*steps)
            return ChunkOut(torch.cat(c, 1), torch.cat(logits, 1), torch.stack(bound, 1), None, None)
        state = self.chunks[l].select(rows)
        steps = []
        for j in range(xn.shape[1]):  # tokens after cached ones: one online step each
            steps.append(head.step(xn[:, j:j + 1], state))
            if self.trail is not None:
                self.trail.setdefault(l, []).append(state.clone())
        self.chunks[l].assign(rows, state)
        if len(steps) == 1:
            return ChunkOut(*steps[0], None, None)
        c, logits, bound = zip(*steps)
        return ChunkOut(torch.cat(c, 1), torch.cat(logits, 1), torch.stack(bound, 1), None, None)

    def chunk_write(self, l: int, head, xn: torch.Tensor) -> None:
        """``project`` for a skipped CH layer: the token joins the chunk cache, nothing is added to its state."""
        rows = self.rows_t
        if self.native_chunk and xn.shape[1] == 1:
            native.chunk_step(head, xn, rows, self.chunks[l], attend=False)
            return
        state = self.chunks[l].select(rows)
        head.step(xn, state, attend=False)
        self.chunks[l].assign(rows, state)
