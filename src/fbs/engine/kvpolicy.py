"""KV-cache policies under a budget (Group C of the paper's appendix F), in the engine's static cache.

``budget`` N is the number of entries a row keeps **per layer and per KV head** after each eviction. The policies:

* ``streaming`` (StreamingLLM, Xiao et al. 2023): the first :data:`SINKS` entries of the layer (attention sinks)
  plus the most recent N - SINKS. Positions as the reference handles them (RoPE at cache-relative positions): the
  query-key distance equals the number of kept entries between them. Kept keys stay rotated at their true positions
  except the sinks, which are re-rotated (from a pristine copy, so no rounding accumulates) to sit right before the
  oldest window entry; without holes that gives exactly the reference's distances (entry i of n at distance n - i).
  The same kept set at every head.
* ``h2o`` (Zhang et al. 2023): the N - N//2 most recent entries plus the N//2 heavy hitters, the older entries with
  the largest accumulated attention (the sum of every attention weight they received, summed over the query heads
  of their KV head). The weights come from the step's own attention (an explicit attention, not a second pass). Per
  KV head; true positions.
* ``snapkv`` (Li et al. 2024): at prefill, the last :data:`SNAP_WINDOW` prompt queries (the observation window) vote
  for prefix entries with their attention weights (summed over the window and the KV head's query heads), the votes
  are max-pooled along positions (kernel :data:`SNAP_KERNEL`), and the top N - window prefix entries plus the window
  are kept. Per KV head; true positions. As in the reference, generated tokens are appended without eviction: the
  cache holds N entries after prefill and N + (entries written since) while decoding.

Layout: a layer's kept entries are always the first ``lengths[l][r]`` slots of its buffers (same count at every KV
head), so the one-token step (PyTorch: whole buffer with a length mask; native: each row's prefix) runs unchanged.
A decode step appends one entry per layer it writes at slot N, attends over the N kept entries plus it, and then
the policy evicts one: the victim's slot is refilled from the tail (O(1) copies; slots are not in position order).
The recent window of ``streaming`` and ``h2o`` is a ring over the slots after the sinks / heavy hitters.

Composition with FBS skipping: eviction acts on the entries a layer holds, so under ``hole`` (a token that skips
layer l writes no entry there) each layer's kept set is the policy applied to the entries that layer received (its
own sequence of positions), a layer that skips neither reads nor changes its cache, and layers keep different
positions. Under ``project`` a skipped token's projected entry is appended and counts like any other (for ``h2o``
it enters the recent window with the score of no attention received).

Prefill: a prompt of at most ``prefill_chunk`` tokens (:data:`DEFAULT_PREFILL_CHUNK` by default under a policy)
attends over itself, then keeps the budget: only the kept entries are stored, so the cache is allocated to the
budget (plus one slot), not to the prompt. A longer prompt runs in chunks (:func:`prefill_chunks`): each later chunk
attends over the kept entries plus itself, then the policy reduces both to its budget (:meth:`Evictor.extend`):
``streaming`` keeps the sinks and the most recent entries; ``h2o`` adds each chunk's attention weights to the scores
of what it saw, then keeps the recent window and the largest scores; ``snapkv`` votes with each chunk's observation
window. Memory is then bounded by budget + chunk; the references prefill the whole prompt before evicting
(docs/kv-cache.md states the differences). ``prefill_chunk=0`` does that here too.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .. import native
from .defaults import AUTO, KV_DTYPE_CHOICES, PREFILL_CHOICES, resolve_kv_dtype, resolve_prefill
from .quant import kv_load, kv_store

#: the policies ``kv_cache=`` selects (``full``: no eviction)
POLICIES = ("full", "streaming", "h2o", "snapkv")
SINKS = 4         # StreamingLLM's attention sinks (the reference's start_size)
SNAP_WINDOW = 32  # SnapKV's observation window (the reference's LongBench setting)
SNAP_KERNEL = 7   # SnapKV's pooling kernel (max pooling, as in that setting)
#: prefill query rows per chunk of H2O's explicit attention (bounds its (chunk, prompt) weight matrix)
H2O_CHUNK = 256
#: prompt tokens per prefill chunk under a cache policy when ``prefill_chunk`` is not given: memory is bounded by
#: budget + chunk (not by the prompt), and chunks of this size still run the prompt's GEMMs at full width
DEFAULT_PREFILL_CHUNK = 512


@dataclasses.dataclass(frozen=True)
class CachePolicy:
    """A KV-cache policy and its budget (entries kept per layer, row and KV head)."""

    name: str
    budget: int

    def __post_init__(self):
        if self.name not in POLICIES[1:]:
            raise ValueError(f"kv_cache must be one of {', '.join(POLICIES)}, got {self.name!r}")
        least = {"streaming": SINKS + 1, "h2o": 1, "snapkv": SNAP_WINDOW + 1}[self.name]
        if self.budget < least:
            why = {"streaming": f"{SINKS} attention sinks plus a recent window",
                   "h2o": "at least one recent entry", "snapkv": f"its {SNAP_WINDOW}-token observation window plus "
                                                               "at least one voted entry"}[self.name]
            raise ValueError(f"kv_cache={self.name!r} keeps {why}: kv_budget must be >= {least}, got {self.budget}")

    @property
    def scores(self) -> bool:
        """The policy reads each decode step's attention weights (the step then attends explicitly)."""
        return self.name == "h2o"

    def capacity(self, prompt: int, max_new: int) -> int:
        """Slots per row the cache needs: the kept entries plus the one a step appends before evicting (SnapKV:
        every generated entry is kept)."""
        if self.name == "snapkv":
            return min(prompt, self.budget) + max_new
        return min(prompt + max_new, self.budget + 1)

    def bind(self, cache, rope=None) -> "Evictor":
        """The per-cache state of this policy. ``rope(positions (b, n) long) -> (cos, sin) (b, n, hd)``: the model's
        rotary tables (StreamingLLM re-rotates its sinks)."""
        return {"streaming": Streaming, "h2o": H2O, "snapkv": SnapKV}[self.name](self, cache, rope)


def make_policy(kv_cache: str | None, kv_budget: int | None) -> CachePolicy | None:
    """The :class:`CachePolicy` of ``kv_cache`` / ``kv_budget`` (None for the full cache)."""
    if kv_cache in (None, "full"):
        if kv_budget is not None:
            raise ValueError("kv_budget applies to a cache policy: pass kv_cache='streaming', 'h2o' or 'snapkv'")
        return None
    if kv_budget is None:
        raise ValueError(f"kv_cache={kv_cache!r} needs kv_budget (entries kept per layer and KV head)")
    return CachePolicy(kv_cache, int(kv_budget))


def prefill_chunk_size(prefill_chunk: int | None, policy: CachePolicy | None) -> int:
    """Tokens per prefill chunk (0: the whole prompt at once). ``None``: :data:`DEFAULT_PREFILL_CHUNK` under a cache
    policy, the whole prompt under the full cache; 0: the whole prompt; N > 0: chunks of N tokens."""
    if prefill_chunk is None:
        return DEFAULT_PREFILL_CHUNK if policy is not None else 0
    if prefill_chunk < 0:
        raise ValueError(f"prefill_chunk must be >= 0 (0: the whole prompt at once), got {prefill_chunk}")
    if policy is not None and policy.name == "snapkv" and 0 < prefill_chunk < SNAP_WINDOW:
        raise ValueError(f"kv_cache='snapkv' votes with the last {SNAP_WINDOW} queries of each prefill chunk: "
                         f"prefill_chunk must be >= {SNAP_WINDOW} (or 0 for the whole prompt), got {prefill_chunk}")
    return int(prefill_chunk)


def prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     native_causal: bool = False) -> torch.Tensor:
    """A prompt's (or prompt chunk's) causal attention, q (b, H, T, hd), k / v (b, Hkv, S, hd) with the queries at
    the last T of the S positions (S = T: a fresh prompt; S > T: a chunk after S - T entries every query sees) ->
    (b, H, T, hd): :func:`fbs.native.causal_attention` with ``native_causal`` where it runs (the engine asks for it
    under the native formats), else SDPA."""
    o = native.causal_attention(q, k, v, scale) if native_causal else None
    if o is not None:
        return o
    gqa = k.shape[1] != q.shape[1]
    t, s = q.shape[2], k.shape[2]
    if s == t:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=chunk_mask(t, s, q.device), scale=scale, enable_gqa=gqa)


def chunk_mask(t: int, s: int, device) -> torch.Tensor:
    """(1, 1, t, s) bool: t queries at the last t of s positions, each seeing every position up to its own."""
    return (torch.arange(s, device=device) <= s - t + torch.arange(t, device=device)[:, None])[None, None]


def prefill_chunks(length: int, chunk: int) -> list[tuple[int, int]]:
    """(start, end) of the prefill chunks of a prompt of ``length`` tokens: chunks of ``chunk`` tokens aligned to the
    prompt's end (the last chunk is a full one, so SnapKV's last observation window is the prompt's last tokens); the
    first takes the remainder, merged into the next when it would be a single token (a one-token chunk would run the
    decode step's format instead of the prefill's). ``chunk`` 0: one chunk."""
    if chunk <= 0 or length <= chunk:
        return [(0, length)]
    first = length % chunk or chunk
    if first == 1:
        first += chunk
    return [(0, first)] + [(s, s + chunk) for s in range(first, length, chunk)]


def add_kv_cache_arguments(p) -> None:
    """``--kv-cache`` / ``--kv-budget`` / ``--kv-dtype`` / ``--prefill-chunk`` / ``--prefill`` on an argparse parser
    (``fbs generate``, ``fbs eval run``)."""
    p.add_argument("--kv-cache", choices=POLICIES, default="full",
                   help="KV cache policy: full (default), streaming (StreamingLLM: 4 sinks + recent window), h2o "
                        "(heavy hitters + recent), snapkv (observation-window votes at prefill)")
    p.add_argument("--kv-budget", type=int,
                   help="entries a --kv-cache policy keeps per layer and KV head (required with one)")
    p.add_argument("--kv-dtype", choices=KV_DTYPE_CHOICES, default=AUTO,
                   help="storage of the KV cache's entries: fp32, fp16 or bf16 (half the bytes), or int8 (codes and a "
                        "scale per entry: about a quarter); attention converts them back and accumulates in fp32; "
                        "auto (default): int8 under the quantized --weights (q4, q8, int8), else fp32 "
                        "(fbs.engine.defaults)")
    add_prefill_chunk_argument(p)
    add_prefill_argument(p)


def add_prefill_argument(p) -> None:
    """``--prefill {auto,fp32,bf16,int8,blocks}`` on an argparse parser."""
    p.add_argument("--prefill", choices=PREFILL_CHOICES, default=AUTO,
                   help="how a prompt's products run: fp32 (the HF modules' GEMMs), bf16 (bf16 GEMMs: AMX / "
                        "AVX-512 BF16; keys about 3x closer to fp32's than blocks'), blocks (q4 / q8: the decode "
                        "format's own weights and kernels, activations per 32 values, as decode steps compute them) "
                        "or int8 (int8 weights per channel x int8 activations per token: int8 GEMMs); both integer "
                        "prefills are faster on long prompts and move free-running answers more than q4 does "
                        "(blocks a third as much as int8; docs/eval.md); auto (default): fp32 (fbs.engine.defaults)")


def add_prefill_chunk_argument(p) -> None:
    """``--prefill-chunk N`` on an argparse parser."""
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help=f"prompt tokens per prefill chunk: each chunk runs every layer over the kept cache plus "
                        f"itself, then the cache policy evicts to its budget (default: {DEFAULT_PREFILL_CHUNK} under "
                        f"a --kv-cache policy, the whole prompt under the full cache; 0: the whole prompt)")


def kv_cache_options(args, weights: str = "fp32") -> dict:
    """DecodeOptions fields of parsed ``--kv-cache`` / ``--kv-budget`` / ``--kv-dtype`` / ``--prefill-chunk`` /
    ``--prefill`` (checked: a clear error when they do not fit together); ``auto`` resolved under ``weights`` (the
    run's resolved weight format)."""
    policy = make_policy(args.kv_cache, args.kv_budget)
    chunk = getattr(args, "prefill_chunk", None)
    out = {} if args.kv_cache == "full" else {"kv_cache": args.kv_cache, "kv_budget": args.kv_budget}
    kv_dtype = resolve_kv_dtype(getattr(args, "kv_dtype", "fp32"), weights)
    if kv_dtype != "fp32":
        out["kv_dtype"] = kv_dtype
    prefill = resolve_prefill(getattr(args, "prefill", "fp32"), weights)
    if prefill != "fp32":
        out["prefill"] = prefill
    if chunk is not None:
        prefill_chunk_size(chunk, policy)
        out["prefill_chunk"] = chunk
    return out


# --------------------------------------------------------------------------- attention that returns its weights
def attend_scored(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, mask: torch.Tensor | None, scale: float,
                  acc: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Attention of ``q`` (b, H, T, hd) over ``keys`` / ``vals`` (b, Hkv, n, hd) (GQA: query head h reads KV head
    h // (H / Hkv), HF's order) under the bool ``mask`` (b, 1, T or 1, n; True = attend), computed explicitly so that
    its weights, summed over the queries and the KV head's query heads, are added to ``acc[idx]`` (acc (B, Hkv, >= n),
    idx (b,) its rows). Returns (b, H, T, hd) in q's dtype."""
    b, h, t, hd = q.shape
    hkv, n = keys.shape[1], keys.shape[2]
    qg = q.reshape(b, hkv, h // hkv, t, hd)
    s = torch.matmul(qg, keys.unsqueeze(2).transpose(-1, -2)).float() * scale      # (b, Hkv, g, T, n)
    if mask is not None:
        s = s.masked_fill(~mask.unsqueeze(2), float("-inf"))
    w = s.softmax(-1)
    o = torch.matmul(w.to(vals.dtype), vals.unsqueeze(2))                           # (b, Hkv, g, T, hd)
    acc[:, :, :n].index_add_(0, idx, w.sum((2, 3)))
    return o.reshape(b, h, t, hd).to(q.dtype)


def _gather(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """x (b, Hkv, T[, hd]) at the slots ``keep`` (b, Hkv, n) of each head."""
    if x.dim() == 3:
        return x.gather(2, keep)
    return x.gather(2, keep.unsqueeze(-1).expand(*keep.shape, x.shape[-1]))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's RoPE rotation x cos + rotate_half(x) sin; x (b, Hkv, n, hd), cos / sin (b, n, hd)."""
    half = x.shape[-1] // 2
    return x * cos.unsqueeze(1) + torch.cat((-x[..., half:], x[..., :half]), -1) * sin.unsqueeze(1)


# --------------------------------------------------------------------------- per-cache state
class Evictor:
    """A policy's state over one :class:`fbs.engine.cache.KVCache`. The cache calls :meth:`booked` when entries are
    booked, :meth:`settle` once they are written and attended, :meth:`prefill` for a fresh prompt."""

    #: slots [0, fixed) are outside the recent window's ring (sinks / heavy hitters); the ring is [fixed, budget)
    fixed = 0

    def __init__(self, policy: CachePolicy, cache, rope):
        self.policy, self.cache, self.rope, self.budget = policy, cache, rope, policy.budget
        n_layers, batch = len(cache.k), cache.batch
        #: per layer and row, the ring slot of the oldest recent entry (None: nothing evicted yet, slots in order)
        self.ring: list[list[int | None]] = [[None] * batch for _ in range(n_layers)]

    # ---- hooks ----------------------------------------------------------------
    def scores(self, l: int) -> torch.Tensor | None:
        """(B, Hkv, C) accumulated attention of layer l's entries, when the policy keeps it (the step adds to it)."""
        return None

    def booked(self, layers: range, rows: list[int], starts: list[list[int]], positions: list[list[int]]) -> None:
        """Entries of ``rows`` were booked at each of ``layers``, at ``starts`` (per layer, per row) with
        ``positions``."""

    def settle(self, l: int, rows: list[int]) -> None:
        """The rows' new entries at layer l are written and attended: evict those rows back to the budget. A
        one-token step appends at most one entry per layer, so at most one is evicted."""
        due = self._due(l, rows)
        if not due:
            return
        idx = torch.tensor(due, device=self.cache.k[l].device)
        old = torch.tensor([self.ring[l][r] for r in due], device=idx.device)
        self._evict(l, due, idx, old)
        self._advance_ring(l, due)
        self._after(l, due, idx)

    def _due(self, l: int, rows: list[int]) -> list[int]:
        """The rows over the budget at layer l (by one entry each; their first eviction set up)."""
        lens = self.cache.lengths[l]
        over = [r for r in rows if lens[r] > self.budget]
        if any(lens[r] != self.budget + 1 for r in over):
            raise RuntimeError(f"layer {l} holds more than one entry over the KV budget {self.budget}: multi-token "
                               "writes after the prompt are not supported under a cache policy")
        ring = self.ring[l]
        for r in over:
            if ring[r] is None:
                self._first_eviction(l, r)
        return over

    def _advance_ring(self, l: int, rows: list[int]) -> None:
        """After the eviction at layer l: the new entry (slot N) sits in the ring slot of the oldest recent one, which
        becomes the newest; the rows hold the budget again."""
        width = self.budget - self.fixed
        pos, ring, lens = self.cache.positions[l], self.ring[l], self.cache.lengths[l]
        for r in rows:
            o = ring[r]
            pos[r][o] = pos[r].pop()
            ring[r] = self.fixed + (o - self.fixed + 1) % width
            lens[r] = self.budget

    def settle_layers(self, layers: range, rows: list[int]) -> None:
        """:meth:`settle` at each of ``layers`` (a native run's layers, booked together)."""
        for l in layers:
            self.settle(l, rows)

    def _first_eviction(self, l: int, r: int) -> None:
        self.ring[l][r] = self.fixed

    def _evict(self, l: int, rows: list[int], idx: torch.Tensor, old: torch.Tensor) -> None:
        """Drop one entry per row and head; the new entry (slot N) takes the ring slot ``old`` of the oldest recent
        entry, which leaves the window."""
        raise NotImplementedError

    def _after(self, l: int, rows: list[int], idx: torch.Tensor) -> None:
        pass

    def _move(self, tensors, idx: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Per row (and head, when ``dst`` is (b, Hkv)), copy slot ``src`` to slot ``dst`` in each tensor."""
        for t in tensors:
            if dst.dim() == 1:
                t[idx, :, dst] = t[idx, :, src]
            else:
                heads = torch.arange(t.shape[1], device=idx.device)
                t[idx[:, None], heads[None, :], dst] = t[idx, :, src]

    # ---- prefill --------------------------------------------------------------
    def prefill(self, l: int, rows: list[int], q, k, v, positions: list[list[int]], scale: float,
                native_causal: bool = False) -> torch.Tensor:
        """Attention of a fresh prompt (q (b, H, T, hd), rotated k / v (b, Hkv, T, hd)) over itself
        (:func:`prompt_attention`); stores the kept entries (all of them when T <= budget). Returns (b, H, T, hd)."""
        o = prompt_attention(q, k, v, scale, native_causal)
        self._store(l, rows, k, v, positions, self._select(k, positions) if k.shape[2] > self.budget else None)
        return o

    def _select(self, k, positions) -> torch.Tensor:
        """(b, Hkv, budget) prompt slots kept (prompt longer than the budget)."""
        raise NotImplementedError

    def extend(self, l: int, rows: list[int], q, k, v, positions: list[list[int]], scale: float,
               native_causal: bool = False) -> torch.Tensor:
        """A prefill chunk after earlier ones (chunked prefill): the chunk's queries (b, H, T, hd) attend over the
        rows' kept entries plus the chunk itself (causal among its tokens); then the kept entries and the chunk's
        (k, v) (b, Hkv, T, hd) are reduced to the budget by the policy's rule (:meth:`_select_extended`) and stored
        in slots [0, n), as a fresh prefill stores them. Every row of ``rows`` holds the same number of entries
        (the rows of one prefill group). Returns (b, H, T, hd)."""
        c = self.cache
        n = c.lengths[l][rows[0]]
        if any(c.lengths[l][r] != n for r in rows):
            raise RuntimeError(f"layer {l}: a prefill chunk's rows hold different numbers of entries")
        idx = torch.tensor(rows, device=k.device)
        t = k.shape[2]
        kk = torch.cat((kv_load(c.k[l][idx, :, :n], k.dtype, c.key_factor[l]), k), 2)
        vv = torch.cat((kv_load(c.v[l][idx, :, :n], v.dtype), v), 2)
        # every kept entry precedes the chunk; the chunk is causal among its own tokens
        o, acc = self._attend_extended(l, idx, q, kk, vv, scale, n, native_causal)
        new = torch.tensor(positions, device=k.device)[:, None, :].expand(-1, k.shape[1], -1)
        pos = torch.cat((self._held_positions(l, rows, idx, n), new), 2)          # (b, Hkv, n + T)
        keep = self._select_extended(q, kk, pos, acc, scale) if n + t > self.budget else None
        self._store(l, rows, self._pristine(l, rows, kk), vv, pos, keep, acc)
        return o

    def _attend_extended(self, l, idx, q, kk, vv, scale, n, native_causal=False):
        """The chunk's attention over kept + chunk entries (:func:`prompt_attention`), and (H2O) the accumulated
        scores (b, Hkv, n + T); returns (output, scores or None)."""
        return prompt_attention(q, kk, vv, scale, native_causal), None

    def _held_positions(self, l, rows, idx, n) -> torch.Tensor:
        """(b, Hkv, n) positions of the rows' kept entries at layer l, in slot order."""
        pos = torch.tensor([self.cache.positions[l][r] for r in rows], dtype=torch.long, device=idx.device)
        return pos.view(len(rows), 1, n).expand(-1, self.cache.k[l].shape[1], -1)

    def _pristine(self, l, rows, kk) -> torch.Tensor:
        """The keys to store, rotated at their own positions (StreamingLLM swaps its re-rotated sinks back)."""
        return kk

    def _select_extended(self, q, kk, pos, acc, scale) -> torch.Tensor:
        """(b, Hkv, budget) slots of kept + chunk entries (positions ``pos`` (b, Hkv, N)) that stay."""
        raise NotImplementedError

    def _store(self, l, rows, k, v, positions, keep: torch.Tensor | None, acc: torch.Tensor | None = None) -> None:
        """Store entries k / v (b, Hkv, T, hd) of ``positions`` (per row a list of T, or (b, Hkv, T) per head),
        reduced to the slots ``keep`` (b, Hkv, n) when given, in the rows' slots [0, n)."""
        c = self.cache
        if keep is not None:
            k, v = _gather(k, keep), _gather(v, keep)
            if acc is not None:
                acc = _gather(acc, keep)
        n = k.shape[2]
        idx = torch.tensor(rows, device=k.device)
        c.k[l][idx, :, :n] = kv_store(k, c.k[l].dtype, c.key_factor[l])  # a half / int8 cache stores them rounded
        c.v[l][idx, :, :n] = kv_store(v, c.v[l].dtype)
        if acc is not None:
            self.scores(l)[idx, :, :n] = acc
        pos = positions if isinstance(positions, torch.Tensor) else torch.tensor(
            positions, device=k.device)[:, None, :].expand(-1, k.shape[1], -1)            # (b, Hkv, T)
        kept = pos if keep is None else pos.gather(2, keep)                               # (b, Hkv, n)
        for i, r in enumerate(rows):
            c.positions[l][r] = kept[i, 0].tolist()
            c.lengths[l][r] = n
            self.ring[l][r] = None if keep is None else self.fixed
        self._stored(l, rows, idx, kept, keep is not None)

    def _stored(self, l, rows, idx, kept: torch.Tensor, evicted: bool) -> None:
        pass

    # ---- introspection and slots ----------------------------------------------
    def kept(self, l: int, r: int) -> torch.Tensor:
        """(Hkv, n) positions of the entries row r holds at layer l, in slot order."""
        pos = torch.tensor(self.cache.positions[l][r], dtype=torch.long)
        return pos.expand(self.cache.k[l].shape[1], -1)

    def load_row(self, row: int, src: "Evictor", src_row: int) -> None:
        """Copy ``src``'s state of row ``src_row`` (the cache has copied its entries and lengths already)."""
        for l in range(len(self.ring)):
            self.ring[l][row] = src.ring[l][src_row]

    def clear_row(self, row: int) -> None:
        for l in range(len(self.ring)):
            self.ring[l][row] = None


class Streaming(Evictor):
    """StreamingLLM: :data:`SINKS` sinks + a recent window, sinks re-rotated next to the window (module doc)."""

    fixed = SINKS

    def __init__(self, policy, cache, rope):
        super().__init__(policy, cache, rope)
        if rope is None:
            raise ValueError("the streaming policy re-rotates its sinks: bind it with the model's rope")
        b, hkv, _, w = cache.k[0].shape
        #: per layer, the sinks' keys as first rotated (at ``sink_pos``) and stored, so re-rotations never compound
        #: rounding
        self.sink_k = [torch.zeros(b, hkv, SINKS, w, dtype=cache.k[0].dtype, device=cache.k[0].device)
                       for _ in cache.k]
        self.sink_pos: list[list[list[int]]] = [[[] for _ in range(b)] for _ in cache.k]
        self._memo: tuple = (None, None)

    def _first_eviction(self, l, r):
        super()._first_eviction(l, r)
        self.sink_k[l][r] = self.cache.k[l][r, :, :SINKS]
        self.sink_pos[l][r] = self.cache.positions[l][r][:SINKS]

    def settle(self, l, rows):
        self.settle_layers(range(l, l + 1), rows)

    def settle_layers(self, layers, rows):
        """:meth:`Evictor.settle` at each of ``layers``, their tensor work together (a step's native run books all its
        layers at once): the new entries moved in one copy, the sinks re-rotated in one pass per shift."""
        c, n = self.cache, self.budget
        dst, src, placed = [], [], []
        for l in layers:
            due = self._due(l, rows)
            for r in due:  # the new entry (slot N) into the ring slot of the oldest recent one, which leaves
                o = self.ring[l][r]
                for t in (c.k[l], c.v[l]):
                    dst.append(t[r, :, o])
                    src.append(t[r, :, n])
            self._advance_ring(l, due)
            placed += [(l, r) for r in due]
        if placed:
            torch._foreach_copy_(dst, src)
            self._place_sinks(placed)

    def _place_sinks(self, placed: list[tuple[int, int]]) -> None:
        """Rotate the sinks of each (layer, row) in ``placed`` to the positions just before its oldest window entry
        (at the ring slot), from their pristine copy; the pairs that share a shift (usually all of a step's) in one
        pass."""
        c = self.cache
        groups: dict[tuple, list[tuple[int, int]]] = {}
        for l, r in placed:
            pos, first = c.positions[l][r], self.ring[l][r]
            shift = tuple(pos[first] - SINKS + i - p for i, p in enumerate(self.sink_pos[l][r]))
            groups.setdefault((shift, c.key_factor[l] is None), []).append((l, r))
        for (shift, plain), pairs in groups.items():
            if self._memo[0] != shift:
                cos, sin = self.rope(torch.tensor([shift], device=c.k[0].device))
                one, _ = self.rope(torch.zeros(1, 1, dtype=torch.long, device=c.k[0].device))
                s = one[..., :1]  # the rope's attention scaling (cos at 0): the re-rotation is a pure rotation
                self._memo = (shift, (cos / s, sin / s))
            cos, sin = self._memo[1]
            sinks = torch.stack([self.sink_k[l][r] for l, r in pairs])                # (g, Hkv, SINKS, W)
            f = None if plain else torch.stack([c.key_factor[l] for l, _ in pairs])  # (g, Hkv, 1, hd)
            # rotated in the tables' dtype (fp32), stored in the cache's
            new = kv_store(_rotate(kv_load(sinks, cos.dtype, f), cos, sin), sinks.dtype, f)
            torch._foreach_copy_([c.k[l][r, :, :SINKS] for l, r in pairs], list(new.unbind(0)))

    def _select(self, k, positions):
        t = k.shape[2]
        keep = list(range(SINKS)) + list(range(t - (self.budget - SINKS), t))
        return torch.tensor(keep, device=k.device).expand(k.shape[0], k.shape[1], -1)

    def _pristine(self, l, rows, kk):
        """The sinks as first rotated (the cache holds them re-rotated next to the window once it evicted)."""
        evicted = [i for i, r in enumerate(rows) if self.ring[l][r] is not None]
        if not evicted:
            return kk
        kk = kk.clone()
        for i in evicted:
            kk[i, :, :SINKS] = kv_load(self.sink_k[l][rows[i]], kk.dtype, self.cache.key_factor[l])
        return kk

    def _select_extended(self, q, kk, pos, acc, scale):
        """The :data:`SINKS` first positions and the budget - SINKS most recent ones, in position order."""
        order = pos[:, :1].argsort(-1)                                                  # (b, 1, N)
        keep = torch.cat((order[..., :SINKS], order[..., order.shape[-1] - (self.budget - SINKS):]), -1)
        return keep.expand(-1, pos.shape[1], -1)

    def _stored(self, l, rows, idx, kept, evicted):
        if evicted:
            self.sink_k[l][idx] = self.cache.k[l][idx, :, :SINKS]
            for r in rows:
                self.sink_pos[l][r] = self.cache.positions[l][r][:SINKS]
            self._place_sinks([(l, r) for r in rows])

    def load_row(self, row, src, src_row):
        super().load_row(row, src, src_row)
        for l in range(len(self.ring)):
            self.sink_k[l][row] = src.sink_k[l][src_row]
            self.sink_pos[l][row] = list(src.sink_pos[l][src_row])


class _PerHead(Evictor):
    """Per-head kept sets: true positions per (row, KV head, slot) in a tensor, (B, Hkv, C)."""

    def __init__(self, policy, cache, rope):
        super().__init__(policy, cache, rope)
        # one tensor for all layers (each layer's a contiguous view of it): a step books every layer's entry of a row
        # in one fill
        self._pos = torch.zeros((len(cache.k), *cache.k[0].shape[:3]), dtype=torch.long, device=cache.k[0].device)
        self.pos = list(self._pos.unbind(0))

    def booked(self, layers, rows, starts, positions):
        if len(positions[0]) != 1:
            raise RuntimeError("multi-token writes after the prompt are not supported under a cache policy")
        if all(s == starts[0] for s in starts):  # every layer at the same slots (no layer skipped by a row)
            for r, s, p in zip(rows, starts[0], positions):  # one fill per row: cheaper than index tensors
                self._pos[layers.start:layers.stop, r, :, s] = p[0]
            return
        for l, st in zip(layers, starts):
            for r, s, p in zip(rows, st, positions):
                self.pos[l][r, :, s] = p[0]

    def _stored(self, l, rows, idx, kept, evicted):
        self.pos[l][idx, :, :kept.shape[2]] = kept

    def kept(self, l, r):
        return self.pos[l][r, :, :self.cache.lengths[l][r]].cpu()

    def _held_positions(self, l, rows, idx, n):
        return self.pos[l][idx, :, :n]

    def load_row(self, row, src, src_row):
        super().load_row(row, src, src_row)
        for l in range(len(self.ring)):
            n = self.cache.lengths[l][row]
            self.pos[l][row, :, :n] = src.pos[l][src_row, :, :n]


class H2O(_PerHead):
    """H2O: heavy hitters by accumulated attention + a recent window, per KV head (module doc)."""

    def __init__(self, policy, cache, rope):
        super().__init__(policy, cache, rope)
        self.fixed = policy.budget // 2  # heavy hitters; the recent window is the rest of the budget
        self.acc = [torch.zeros(cache.k[0].shape[:3], dtype=torch.float32, device=cache.k[0].device)
                    for _ in cache.k]

    def scores(self, l):
        return self.acc[l]

    def _evict(self, l, rows, idx, old):
        """The oldest recent entry leaves the window and competes with the heavy hitters: the lowest accumulated
        score among them is evicted (per head); the new entry takes the ring slot."""
        c, acc, h = self.cache, self.acc[l], self.fixed
        if native.h2o_evict(c.k[l], c.v[l], acc, self.pos[l], idx, old, h, self.budget):
            return  # the same moves in one native call
        cand = torch.cat((acc[idx, :, :h], acc[idx, :, old].unsqueeze(-1)), -1)       # (b, Hkv, h + 1)
        worst = cand.argmin(-1)
        victim = torch.where(worst == h, old[:, None], worst)                          # (b, Hkv) slot
        self._move((c.k[l], c.v[l], acc, self.pos[l]), idx, old, victim)
        self._move((c.k[l], c.v[l], acc, self.pos[l]), idx, torch.full_like(old, self.budget), old)
        acc[idx, :, self.budget] = 0  # the tail slot's next entry starts with no attention received

    def prefill(self, l, rows, q, k, v, positions, scale, native_causal=False):
        """Explicit attention over the prompt in query chunks (its weights are the first accumulated scores)."""
        b, h, t, _ = q.shape
        acc = torch.zeros(b, k.shape[1], t, dtype=torch.float32, device=q.device)
        every = torch.arange(b, device=q.device)
        outs = []
        for s in range(0, t, H2O_CHUNK):
            e = min(t, s + H2O_CHUNK)
            mask = (torch.arange(t, device=q.device) <= torch.arange(s, e, device=q.device)[:, None])[None, None]
            outs.append(attend_scored(q[:, :, s:e], k[:, :, :e], v[:, :, :e], mask[..., :e], scale, acc, every))
        keep = None
        if t > self.budget:
            recent = self.budget - self.fixed
            heavy = acc[:, :, :t - recent].topk(self.fixed, -1).indices.sort(-1).values     # (b, Hkv, fixed)
            window = torch.arange(t - recent, t, device=q.device).expand(b, k.shape[1], -1)
            keep = torch.cat((heavy, window), -1)
        self._store(l, rows, k, v, positions, keep, acc)
        return torch.cat(outs, 2)

    def _attend_extended(self, l, idx, q, kk, vv, scale, n, native_causal=False):
        """Explicit attention in query chunks; the kept entries carry their accumulated scores, the chunk's start at
        zero, and every query of the chunk adds its weights (what each could see: kept entries and the chunk up to
        itself)."""
        b, _, t, _ = q.shape
        mask = chunk_mask(t, n + t, q.device)
        acc = torch.cat((self.acc[l][idx, :, :n], torch.zeros(b, kk.shape[1], t, dtype=torch.float32,
                                                               device=q.device)), 2)
        every = torch.arange(b, device=q.device)
        outs = []
        for s in range(0, t, H2O_CHUNK):
            e = min(t, s + H2O_CHUNK)
            outs.append(attend_scored(q[:, :, s:e], kk[:, :, :n + e], vv[:, :, :n + e], mask[:, :, s:e, :n + e],
                                      scale, acc, every))
        return torch.cat(outs, 2), acc

    def _select_extended(self, q, kk, pos, acc, scale):
        """The budget - budget // 2 most recent positions, plus the budget // 2 older entries with the largest
        accumulated scores (per KV head), each in position order."""
        order = pos.argsort(-1)                                                         # (b, Hkv, N)
        recent = self.budget - self.fixed
        older, window = order[..., :order.shape[-1] - recent], order[..., order.shape[-1] - recent:]
        heavy = older.gather(2, acc.gather(2, older).topk(self.fixed, -1).indices)
        heavy = heavy.gather(2, pos.gather(2, heavy).argsort(-1))
        return torch.cat((heavy, window), -1)

    def load_row(self, row, src, src_row):
        super().load_row(row, src, src_row)
        for l in range(len(self.ring)):
            n = self.cache.lengths[l][row]
            self.acc[l][row] = 0
            self.acc[l][row, :, :n] = src.acc[l][src_row, :, :n]

    def clear_row(self, row):
        super().clear_row(row)
        for a in self.acc:
            a[row] = 0


class SnapKV(_PerHead):
    """SnapKV: observation-window votes at prefill, pooled, top-k kept; no eviction while decoding (module doc)."""

    def settle(self, l, rows):
        pass

    def prefill(self, l, rows, q, k, v, positions, scale, native_causal=False):
        o = prompt_attention(q, k, v, scale, native_causal)
        keep = self.votes_keep(q, k, scale) if k.shape[2] > self.budget else None
        self._store(l, rows, k, v, positions, keep)
        return o

    def votes(self, q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
        """(b, Hkv, N - window) pooled votes of the observation window for the entries before it. ``k`` (b, Hkv, N,
        hd): the entries in position order; ``q`` (b, H, T, hd): the queries of its last T entries (T = N for a
        whole prompt; a prefill chunk after kept entries has T < N)."""
        b, h, t, hd = q.shape
        hkv, n, w = k.shape[1], k.shape[2], SNAP_WINDOW
        obs = q[:, :, t - w:].reshape(b, hkv, h // hkv, w, hd)
        s = torch.matmul(obs, k.unsqueeze(2).transpose(-1, -2)).float() * scale         # (b, Hkv, g, w, N)
        causal = torch.arange(n, device=q.device) <= torch.arange(n - w, n, device=q.device)[:, None]
        weights = s.masked_fill(~causal, float("-inf")).softmax(-1)
        vote = weights[..., :n - w].sum((2, 3))                                          # (b, Hkv, N - w)
        return F.max_pool1d(vote, SNAP_KERNEL, stride=1, padding=SNAP_KERNEL // 2)

    def votes_keep(self, q, k, scale) -> torch.Tensor:
        n, w = k.shape[2], SNAP_WINDOW
        top = self.votes(q, k, scale).topk(self.budget - w, -1).indices.sort(-1).values
        return torch.cat((top, torch.arange(n - w, n, device=q.device).expand(*top.shape[:2], -1)), -1)

    def _select_extended(self, q, kk, pos, acc, scale):
        """The chunk's observation window (its last :data:`SNAP_WINDOW` queries) votes over the kept entries and the
        chunk (kept entries are in position order, the chunk follows them: pooling runs over that order)."""
        return self.votes_keep(q, kk, scale)


__all__ = ["POLICIES", "CachePolicy", "Evictor", "make_policy", "add_kv_cache_arguments", "add_prefill_chunk_argument",
           "kv_cache_options", "attend_scored", "prefill_chunk_size", "prefill_chunks", "SINKS", "SNAP_WINDOW",
           "SNAP_KERNEL", "DEFAULT_PREFILL_CHUNK"]
