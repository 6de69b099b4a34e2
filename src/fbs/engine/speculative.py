"""Lossless speculative decoding over the FBS engine: a draft proposes, full depth verifies.

Every draft is a :class:`fbs.engine.drafts.DraftSource` of one verifier, selected by name with ``draft=`` (the
registry of :mod:`fbs.engine.drafts`: prompt lookup, lookahead, a separate draft model, Medusa heads, and the three
below). The engine's own drafters, defined here:

* **FBS lossless** (``lossless=True``): the engine's own skipping decode step drafts, gates at tau;
* **Draft&Verify** (Zhang et al. 2024; ``lossless=True, skip_plan=static plan, draft_stop=...``): the same step
  with a static set of skipped layers (found by ``fbs train draft-search``), drafting until the draft's top-1
  probability falls below a threshold that follows the recent match rate;
* **Kangaroo** (Liu et al. 2024; ``lossless=True, draft_adapter=adapter, draft_stop=...``): the first N layers,
  a one-layer adapter and the shared LM head (:mod:`fbs.baselines.kangaroo`); verification resumes at layer N from the
  hidden states the draft already computed.

One round, for each active row whose last committed token t sits at position P (not yet consumed):

1. **draft** d_1..d_g, each step consuming the previous token (and writing the KV cache as any decode step does);
2. **roll back** what the verifier recomputes: K/V at positions >= P, and CH's chunk states (from a snapshot);
3. **verify**: layers ``start..L-1`` over [t, d_1..d_g] in one cached pass (:func:`fbs.model.layer.layer_step` over g+1
   tokens; rows with shorter drafts are padded and the pads cropped), giving g+1 next-token distributions;
4. **accept**: greedy, the longest prefix with d_{j+1} = argmax p_j plus argmax p_a, so the output is the
   full-depth (``force_compute``) output; sampling, speculative sampling's rule (:func:`accept_sampled`), so each
   token follows the full model's (warped) distribution;
5. **crop** every layer's cache to the kept positions, set the chunk states to those after the last kept token.

PAW keeps no state between tokens (its window is recomputed from each token's own state), so nothing of it needs
rolling back. Verification runs the HF modules (fp32 source weights, the prefill path) whatever ``weights`` the
draft uses: an int8 draft is verified in fp32, and the output equals the fp32 full-depth output.

The draft length adapts per row (``adapt_draft``): with ``draft_stop`` the threshold follows Draft&Verify's
schedule; otherwise gamma maximises the expected speed-up (:func:`fbs.engine.drafts.expected_speedup`) at the recent
acceptance rate, with the draft's cost from the byte cost model (:func:`fbs.engine.flops.step_bytes`). Gamma 0 (no
draft pays: plain full-depth steps, with a one-token probe every ``PROBE_EVERY`` rounds) is allowed.

Results: the trace describes what the verifier computed (every layer for every kept token); its TFLOPs(rel) count
everything that ran (drafts, rejected candidates, pads, verification) against plain decoding; ``result.speculative``
is a :class:`SpecStats` (passes, proposed, accepted, the draft's skip share, final gamma / threshold).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import torch

from .. import native
from .cache import CacheContext, KVCache
from .decoder import TRACE_DTYPES, DecodeTrace, StepOutput, TraceRecorder
from .drafts import (ACCEPT_DECAY, ACCEPT_PRIOR, ACCEPT_PRIOR_WEIGHT, PROBE_EVERY, BaseDraft, Draft, DraftSource,
                     Verified, acceptance_mle, best_gamma, make_draft, register_draft)
from .flops import LayerCost, step_bytes
from .fused import full_depth
from .greedy import greedy_ids
from ..model.chunk import ChunkOut, ChunkState

#: Draft&Verify's threshold schedule (their defaults): EMA weight of the match rate, target match rate, step,
#: EMA weight of the threshold.
DV_MATCH_EMA, DV_TARGET, DV_STEP, DV_THRESHOLD_EMA = 0.5, 0.9, 0.01, 0.9


# --------------------------------------------------------------------------- the cost of a draft step
def draft_step_cost(cost: LayerCost, context: float, executed_layers: float, kv_policy: str = "hole",
                    weights: str = "fp32") -> float:
    """A draft step's bytes (in the draft's ``weights``) over a full-depth fp32 step's: the verifier and the
    plain steps of gamma 0 run the fp32 HF modules whatever the draft's format, so an int8 draft costs about a
    quarter of the unit, not the ratio of two int8 steps (decoding is bandwidth-bound: :func:`fbs.engine.flops.step_bytes`)."""
    weights = "fp32" if weights == "hf" else weights
    full = step_bytes(cost, context, None, kv_policy, 1, "fp32")
    return step_bytes(cost, context, executed_layers, kv_policy, 1, weights) / full


# --------------------------------------------------------------------------- speculative sampling
def accept_sampled(p: torch.Tensor, q: torch.Tensor, drafts: list[int],
                   generator: torch.Generator | None = None) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al. 2023, Alg. 1; Chen et al. 2023) for one row.

    ``p`` (g+1, V): the target's probabilities at the g+1 verified positions; ``q`` (g, V): the draft's, from which
    ``drafts[j]`` was drawn. Draft j is kept with probability min(1, p_j(d)/q_j(d)); the first rejected one is
    replaced by a draw from norm(max(p_j - q_j, 0)); when all are kept, one more token is drawn from p_g. Every
    committed token is then distributed as under p. Returns (drafts accepted, the token drawn after them).
    """
    g = len(drafts)
    a = g
    if g:
        d = torch.tensor(drafts, device=p.device)
        pd, qd = p[:g].gather(1, d[:, None])[:, 0], q.gather(1, d[:, None])[:, 0]
        u = torch.rand(g, generator=generator, device=p.device)
        rejected = (u * qd >= pd).tolist()  # keep iff u < p(d) / q(d); q(d) > 0 as d was drawn from q
        a = rejected.index(True) if True in rejected else g
    if a < g:
        residual = (p[a] - q[a]).clamp_min(0)
        dist = residual if float(residual.sum()) > 0 else p[a]  # p == q: nothing to correct
    else:
        dist = p[g]
    return a, int(torch.multinomial(dist / dist.sum(), 1, generator=generator))


def accept_tree(probs, tokens: list[int], children: list[list[int]], generator: torch.Generator | None = None,
                greedy: bool = False) -> tuple[list[int], int]:
    """Verification of a deterministic token tree for one row (SpecInfer's multi-candidate rule; Miao et al. 2024).

    Node 0 is the last committed token, node i > 0 proposes ``tokens[i]``; ``children[i]`` are node i's children
    in the order they are tried; ``probs(i)`` the target's (warped) next-token probabilities after node i. From the
    root, each child c is kept with the current distribution's probability of its token, else that token is
    removed from the distribution (renormalised) and the next child is tried; when none is kept, the next token is
    drawn from what is left. Each candidate is a point mass, so this is speculative sampling with the residual
    max(p - q, 0) after every rejection: every committed token follows the target's distribution. ``greedy``:
    keep the child equal to the argmax, then the argmax (no randomness). Returns (kept nodes, the next token)."""
    node, path = 0, []
    while True:
        p = probs(node)
        if greedy:
            best = int(p.argmax())
            nxt = next((c for c in children[node] if tokens[c] == best), None)
            if nxt is None:
                return path, best
            path.append(nxt)
            node = nxt
            continue
        moved = False
        for c in children[node]:
            tok = tokens[c]
            pt = float(p[tok])
            if pt > 0 and float(torch.rand((), generator=generator, device=p.device)) < pt:
                path.append(c)
                node, moved = c, True
                break
            if pt > 0:
                p = p.clone()
                p[tok] = 0.0
                p = p / p.sum()
        if not moved:
            return path, int(torch.multinomial(p, 1, generator=generator))


def accept_typical(probs, tokens: list[int], children: list[list[int]], threshold: float, alpha: float,
                   generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Medusa's typical acceptance (Cai et al. 2024) over a token tree: a node is acceptable when the target's
    probability of its token after its parent exceeds min(``threshold``, ``alpha`` * exp(-entropy)); the longest
    path of acceptable nodes from the root is kept (the first in tree order on ties) and the next token is drawn
    from the target's distribution after its last node. Faster than :func:`accept_tree` at high temperature, but
    the output no longer follows the target's distribution exactly."""
    best: list[int] = []
    stack: list[tuple[int, list[int]]] = [(0, [])]
    while stack:
        node, path = stack.pop()
        if len(path) > len(best):
            best = path
        kids = children[node]
        if not kids:
            continue
        p = probs(node)
        ent = float(-(p * p.clamp_min(1e-30).log()).sum())
        cut = min(threshold, alpha * float(torch.exp(torch.tensor(-ent))))
        for c in reversed(kids):  # popped in tree order
            if float(p[tokens[c]]) > cut:
                stack.append((c, path + [c]))
    last = best[-1] if best else 0
    return best, int(torch.multinomial(probs(last), 1, generator=generator))


# --------------------------------------------------------------------------- results
@dataclasses.dataclass
class SpecStats:
    """What one lossless generate call did; counts are means per row (appendix B.4's sums per sequence)."""

    drafter: str             # the draft source's name: fbs (gates) | plan (static skip plan: Draft&Verify) |
                             # kangaroo | prompt-lookup | lookahead | specdec | medusa | ...
    rows: int
    passes: float            # target passes, the prompt's included (K)
    proposed: float          # drafted tokens sent to verification (sum of m_t)
    accepted: float          # drafted tokens accepted (sum of a_t)
    rejections: float        # passes that rejected a draft (a_t < m_t): with ``accepted``, the MLE of the
                             # per-draft acceptance rate (:func:`acceptance_mle`)
    draft_steps: float       # one-token draft passes
    draft_skip_ratio: float  # share of the draft passes' (token, layer) pairs not executed
    gamma: list[int]         # per row: the draft length at the end (adapted)
    threshold: list[float]   # per row: the draft-stop threshold at the end (adapted with draft_stop)
    nodes: float = 0.0       # drafted tokens verified: ``proposed`` counts a token tree's depth, this all its nodes

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    @property
    def verified_advance_ratio(self) -> float | None:
        """Committed tokens per verified position: sum(a_t + 1) / sum(m_t + 1)."""
        return (self.accepted + self.passes) / (self.proposed + self.passes) if self.proposed else None

    @property
    def tokens_per_pass(self) -> float:
        return (self.accepted + self.passes) / self.passes if self.passes else 0.0

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(acceptance_rate=self.acceptance_rate, verified_advance_ratio=self.verified_advance_ratio,
                   tokens_per_pass=self.tokens_per_pass)
        return out


# --------------------------------------------------------------------------- chunk states per token
class _ChunkLog:
    """CH chunk states after each token of the current round, per (CH layer, row), from the cache contexts'
    trails; after verification every row gets the state after its last kept token."""

    def __init__(self, dev):
        self.dev = dev
        self.states: dict[tuple[int, int], list] = {}

    def add(self, ctx) -> None:
        for l, seq in (ctx.trail or {}).items():
            for i, r in enumerate(ctx.rows):
                idx = torch.tensor([i], device=self.dev)
                self.states.setdefault((l, r), []).extend(st.select(idx) for st in seq)

    def keep(self, chunks, last: dict[int, int]) -> None:
        """Row r keeps its state after round token ``last[r]`` (its last consumed one); the log starts over."""
        for (l, r), seq in self.states.items():
            if r in last:
                chunks[l].assign(torch.tensor([r], device=self.dev), seq[last[r]])
        self.states = {}


# --------------------------------------------------------------------------- a token tree in one pass
def _depths(parents: list[int]) -> list[int]:
    """Node depths of a tree given as parent indices (the root, node 0, has parent -1 and depth 0)."""
    out: list[int] = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def _ancestors(parents: list[int]) -> torch.Tensor:
    """(t, t) bool: [i, j] when node j is node i or one of its ancestors (the tree attention mask)."""
    t = len(parents)
    m = torch.eye(t, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            m[i] |= m[p]
    return m


class _TreeContext(CacheContext):
    """The verifier's cache context for a token tree: node j of row i attends to the row's cached entries and to
    the round's nodes ``mask[i, j]`` marks (its ancestors and itself), and CH's chunk head steps each node from its
    parent's state (the round's nodes are in topological order). The K/V of every node are written; the verifier
    compacts the kept path afterwards (:meth:`_Speculation._compact`). Attention: the native layers' attention
    halves with the tree's visibility (``tree_bits``, :func:`fbs.native.tree_bits`) where the ops run native
    multi-token steps (``native_steps``), else PyTorch's SDPA under the mask (:meth:`attend`)."""

    def __init__(self, ctx: CacheContext, mask: torch.Tensor, parents: list[list[int]], native_steps: bool = False):
        self.__dict__.update(ctx.__dict__)
        self.native_chunk = False  # the chunk head steps each node from its parent's state (:meth:`chunk`)
        self.native_many = self.native_tree_chunk = native_steps
        self.tree, self.parents = mask, parents
        self.tree_bits = native.tree_bits(mask) if native_steps else None

    def attend(self, l: int, q, k, v, hole=None) -> torch.Tensor:
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        if self.cache.evictor is not None:
            raise ValueError("tree verification rolls entries back, which a KV cache policy cannot (kv_cache='full')")
        t = q.shape[2]
        self.cache.write(l, self.rows, k, v, self.positions)
        kk, vv, _ = self.cache.view(l, self.rows)
        n = kk.shape[2]
        mask = torch.zeros(len(self.rows), t, n, dtype=torch.bool, device=q.device)
        for i, r in enumerate(self.rows):
            end = self.cache.lengths[l][r]
            mask[i, :, :end - t] = True
            mask[i, :, end - t:end] = self.tree[i]
        return sdpa(q, kk, vv, attn_mask=mask[:, None], scale=self.scaling, enable_gqa=k.shape[1] != q.shape[1])

    def chunk(self, l: int, head, xn: torch.Tensor, hole=None) -> ChunkOut:
        root = self.chunks[l].select(self.rows_t)
        states: list[ChunkState] = []
        steps = []
        for j in range(xn.shape[1]):
            pars = [p[j] for p in self.parents]
            st = root.clone() if all(p < 0 for p in pars) else _gather_states(root, states, pars)
            if self.native_tree_chunk:  # the native step a chain pass and decoding take, on the node's own state
                c, logits, start = native.chunk_step(head, xn[:, j:j + 1], torch.arange(len(pars)), st)
                steps.append((c, logits, start))
            else:
                steps.append(head.step(xn[:, j:j + 1], st))
            states.append(st)
            if self.trail is not None:
                self.trail.setdefault(l, []).append(st)
        c, logits, bound = zip(*steps)
        return ChunkOut(torch.cat(c, 1), torch.cat(logits, 1), torch.stack(bound, 1), None, None)


def _gather_states(root: ChunkState, states: list[ChunkState], parents: list[int]) -> ChunkState:
    """Row i's state is ``states[parents[i]]``'s row i (``root``'s for parent -1), copied."""
    src = [root if p < 0 else states[p] for p in parents]
    out = ChunkState.__new__(ChunkState)
    for name in ("closed", "n_closed", "open_sum", "open_count"):
        setattr(out, name, torch.stack([getattr(st, name)[i] for i, st in enumerate(src)]).clone())
    return out


# --------------------------------------------------------------------------- drafters
class EngineDraft(BaseDraft):
    """The engine's own decode step drafts: FBS gates at tau, a static skip plan (Draft&Verify), or a baseline's
    ``skip_policy`` (:mod:`fbs.baselines`). Drafting writes the verifier's own cache and chunk states, which
    :meth:`rollback` restores."""

    start = 0  # verification runs every layer, from the embeddings
    adaptive = True

    def __init__(self, spec: "_Speculation"):
        super().__init__(spec)
        policy = getattr(self.dec, "skipper", None) is not None
        self.name = "policy" if policy else "plan" if self.dec.plan is not None else "fbs"
        self.granularity = self.dec.granularity
        self.snapshot: dict = {}

    @property
    def kind(self) -> str:
        return self.name

    def propose(self, rows, budget):
        return self.s.draft_by_steps(self, rows, budget)

    def begin(self, rows: list[int]) -> None:
        rt = torch.tensor(rows, device=self.dec.dev)
        self.snapshot = {l: st.select(rt) for l, st in self.dec.chunks.items()}

    def step(self, rows: list[int], steps: list[int], tokens: list[int]) -> torch.Tensor:
        dec = self.dec
        dec.active = rows
        logits = dec.decode_step(steps, tokens)
        self.s.draft_head_rows += len(rows)
        rec = dec.rec
        for r, s in zip(rows, steps):  # what the draft ran, for the accounting (the recorder is reused)
            self.s.draft_log[r].append((list(rec.executed[r][s]), list(rec.kv[r][s]), list(rec.p[r][s]), rec.k[r][s]))
        return logits

    def finish(self, rows: list[int], steps: list[int], tokens: list[int]) -> None:
        """A row's last draft token is consumed by the verifier only."""

    def executed_layers(self, row: int) -> float:
        return self.s.share[row] * self.dec.L

    def step_cost(self, row: int, context: float) -> float:
        return draft_step_cost(self.dec.flops.cost, context, self.executed_layers(row), self.dec.policy,
                               self.dec.opts.weights)

    def rollback(self, rows: list[int], positions: list[int]) -> None:
        self.dec.cache.crop(rows, positions)
        rt = torch.tensor(rows, device=self.dec.dev)
        for l, st in self.snapshot.items():
            self.dec.chunks[l].assign(rt, st)


class KangarooDraft(BaseDraft):
    """Kangaroo: the first ``exit_layer`` layers (full depth, the decode step's arithmetic), the adapter with its
    own one-layer KV cache, the shared LM head. Every round token goes through the shallow layers (the last draft
    token too: its hidden state feeds verification, which starts at the exit layer)."""

    name = kind = "kangaroo"
    granularity = "layer"
    adaptive = True

    def __init__(self, spec: "_Speculation", adapter):
        super().__init__(spec)
        self.adapter = adapter
        self.start = adapter.exit_layer
        base = self.dec.m.base.spec
        if not 0 < self.start < self.dec.L:
            raise ValueError(f"the adapter exits after layer {self.start}, the model has {self.dec.L} layers")
        self.cache = KVCache(1, self.dec.B, base.num_kv_heads, base.head_dim, self.dec.cache.capacity, self.dec.dev,
                             self.dec.m.base.embedding_weight.dtype)
        self.hidden: dict[int, list[torch.Tensor]] = {}

    def prefill_tap(self, l: int, rows: list[int], x: torch.Tensor) -> None:
        """The prompt's hidden states at the exit layer write the adapter's K/V (``Decoder.prefill``'s tap)."""
        if l == self.start:
            self._write(rows, [list(range(x.shape[1]))] * len(rows), x)

    def _ctx(self, rows, pos, x) -> CacheContext:
        """The adapter's layer of its own cache, as the engine's context (no CH, no PAW)."""
        cos, sin = self.dec.ops.rope(x, torch.tensor(pos, device=x.device))
        return CacheContext(self.cache, {}, rows, pos, cos, sin, "project", scaling=self.adapter.scaling)

    def _write(self, rows, pos, x) -> None:
        ctx = self._ctx(rows, pos, x)
        ctx.write(0, *self.adapter.kv(x, ctx.cos, ctx.sin))

    def propose(self, rows, budget):
        return self.s.draft_by_steps(self, rows, budget)

    def begin(self, rows: list[int]) -> None:
        self.hidden = {r: [] for r in rows}

    def _shallow(self, rows, steps, tokens) -> tuple[torch.Tensor, list[list[int]]]:
        """Layers 0..exit-1 for one token per row (they write the cache: exact entries); keeps the hidden states."""
        dec = self.dec
        pos = [[len(dec.prompts[r]) + s] for r, s in zip(rows, steps)]
        x = dec.ops.embed(torch.tensor(tokens, device=dec.dev).view(-1, 1))
        x, ks, _ = self.s.layers(dec.ops, rows, x, pos, 0, self.start)
        ex = [l < self.start for l in range(dec.L)]
        for i, r in enumerate(rows):
            self.hidden[r].append(x[i:i + 1])
            k = -1 if ks is None else int(ks[i, 0])
            self.s.draft_log[r].append((ex, ex, [float("nan")] * dec.L, k))
        return x, pos

    def step(self, rows: list[int], steps: list[int], tokens: list[int]) -> torch.Tensor:
        x, pos = self._shallow(rows, steps, tokens)
        ctx = self._ctx(rows, pos, x)
        self.s.adapter_calls += len(rows)
        self.s.draft_head_rows += len(rows)
        self.s.adapter_keys += sum(self.cache.lengths[0][r] + 1 for r in rows)
        h = self.adapter(x, ctx.cos, ctx.sin, lambda q, k, v: ctx.attend(0, q, k, v))
        return self.adapter.logits(h, self.dec.m.base.lm_head)[:, 0]

    def finish(self, rows: list[int], steps: list[int], tokens: list[int]) -> None:
        self._shallow(rows, steps, tokens)

    def executed_layers(self, row: int) -> float:
        c = self.dec.flops.cost
        return self.start + c.attn_proj / c.dense

    def step_cost(self, row: int, context: float) -> float:
        return draft_step_cost(self.dec.flops.cost, context, self.executed_layers(row), self.dec.policy,
                               self.dec.opts.weights)

    def rollback(self, rows: list[int], positions: list[int]) -> None:
        """The draft wrote nothing at layers >= exit (the verifier's), and exact entries below."""

    def verify_input(self, rows: list[int], seqs: list[list[int]]) -> torch.Tensor:
        t = len(seqs[0])
        xs = [torch.cat(self.hidden[r] + [self.hidden[r][-1]] * (t - len(self.hidden[r])), 1) for r in rows]
        return torch.cat(xs, 0)

    def commit(self, rows: list[int], positions: list[int], kept: list[int], verified: Verified) -> None:
        """Crop the adapter's cache; a row that kept its whole round also needs the adapter's entry of the last
        round token (consumed by the shallow layers only)."""
        lengths = verified.lengths
        self.cache.crop(rows, [p + k for p, k in zip(positions, kept)])
        full = [i for i, r in enumerate(rows) if kept[i] == lengths[i]]
        if full:
            x = torch.cat([self.hidden[rows[i]][kept[i] - 1] for i in full], 0)
            self._write([rows[i] for i in full], [[positions[i] + kept[i] - 1] for i in full], x)


# --------------------------------------------------------------------------- one generate call
class _Speculation:
    """The state of one lossless generate call over an engine decoder (cache, chunk states, sampling, EOS)."""

    def __init__(self, dec):
        self.dec, o = dec, dec.opts
        # the native formats verify in their own multi-token steps (the output is then decoding's in that format);
        # the other fused copies verify with the HF modules they keep for many-token inputs
        self.verify_ops = dec.ops if getattr(dec.ops, "native_packed", False) else getattr(dec.ops, "hf", dec.ops)
        self.log = _ChunkLog(dec.dev)
        B = dec.B
        self.draft_log: list[list] = [[] for _ in range(B)]      # the current round's draft passes, per row
        self.draft_rounds: list[tuple[int, list]] = []          # (P, passes) of every finished round and row
        self.verify_rounds: list[tuple[int, int, list]] = []    # (P, tokens, PAW k per token)
        self.adapter_calls = self.adapter_keys = self.head_rows = 0
        self.draft_head_rows = 0                                # draft tokens scored by the target's LM head
        self.drafter: DraftSource = self._drafter(o)
        self.typical = getattr(self.drafter, "acceptance", "exact") == "typical" and o.do_sample
        self.tree_nodes = max(int(getattr(self.drafter, "max_nodes", 0) or 0), o.draft_tokens)
        # token trees: on the PyTorch ops; in the native multi-token steps, with the tree's visibility, when asked
        # (``native_trees``; up to native.TREE_NODES tokens a pass, the root included); else each tree's chain of
        # first children
        native_ops = getattr(self.verify_ops, "native_packed", False)
        self.trees = self.drafter.start == 0 and (
            not native_ops or (o.native_trees and self.tree_nodes + 1 <= native.TREE_NODES))
        if self.trees and self.tree_nodes > o.draft_tokens:  # room in the cache for a whole tree past the context
            need = max(len(p) for p in dec.prompts) + o.max_new_tokens + self.tree_nodes + 1
            if need > dec.cache.capacity:
                dec.cache = dec.new_cache(need)
        self.gamma = [o.draft_tokens] * B
        self.threshold = [o.draft_stop] * B
        self.match = [0.0] * B
        self.succ = [ACCEPT_PRIOR * ACCEPT_PRIOR_WEIGHT] * B
        self.fail = [(1 - ACCEPT_PRIOR) * ACCEPT_PRIOR_WEIGHT] * B
        self.share = [1.0] * B                                  # EMA of the draft's executed share of layers
        self.passes, self.proposed, self.accepted, self.draft_steps = [1] * B, [0] * B, [0] * B, [0] * B
        self.rejections = [0] * B
        self.nodes = [0] * B                                    # draft tokens verified (tree nodes included)
        self.idle = [0] * B                                     # rounds a row spent at gamma 0
        self.final = TraceRecorder(B, o.max_new_tokens, dec.L)  # what the verifier computed, per kept token
        self.draft_s = 0.0                                      # seconds in the draft source while decoding

    def _drafter(self, o) -> DraftSource:
        """The call's draft source: ``draft`` by name (or factory), else Kangaroo with ``draft_adapter``, else the
        engine's own step (gates, or the static ``skip_plan``)."""
        if o.draft is not None:
            return make_draft(o.draft, self, o.draft_options)
        if o.draft_adapter is not None:
            return KangarooDraft(self, o.draft_adapter)
        return EngineDraft(self)

    # ---- one round -----------------------------------------------------------
    def round(self, rows: list[int]) -> dict[int, list[int]]:
        """Draft, verify, accept and commit for the active ``rows``; returns each row's committed tokens."""
        dec, o = self.dec, self.dec.opts
        n = {r: len(dec.out[r]) for r in rows}
        P = [len(dec.prompts[r]) + n[r] - 1 for r in rows]
        budget = {r: min(self._gamma_now(r), o.max_new_tokens - n[r] - 1) for r in rows}
        t0 = time.perf_counter()  # the draft source's own time (propose, rollback, commit): the cost of drafting
        proposals = self.drafter.propose(rows, budget)
        self.draft_s += time.perf_counter() - t0
        props = {}
        for r in rows:
            d = proposals.get(r) or Draft([])
            if d.parents is not None and not self.trees:
                d = d.chain()  # this verifier runs chains only (native steps without native_trees, or too many nodes)
            if d.depth() > budget[r] or (d.parents is not None and len(d.tokens) > self.tree_nodes):
                raise ValueError(f"draft {self.drafter.name!r} proposed {len(d.tokens)} tokens of depth {d.depth()} "
                                 f"for a budget of {budget[r]} (at most {self.tree_nodes} tree nodes)")
            props[r] = d
        drafts = {r: list(props[r].tokens) for r in rows}
        tree = self.trees and (any(props[r].parents is not None for r in rows) or self.typical)
        t0 = time.perf_counter()
        self.drafter.rollback(rows, P)
        self.draft_s += time.perf_counter() - t0
        seqs = [[dec.out[r][-1]] + drafts[r] for r in rows]
        t = max(len(s) for s in seqs)
        if tree:  # node 0 the last committed token; pads are children of it (cropped below)
            parents = [[-1] + [p + 1 for p in (props[r].parents if props[r].parents is not None else
                                               range(-1, len(drafts[r]) - 1))] + [0] * (t - len(seqs[i]))
                       for i, r in enumerate(rows)]
            padded = [s + [s[0]] * (t - len(s)) for s in seqs]
            depths = [_depths(par) for par in parents]
            positions = [[p + d for d in dep] for p, dep in zip(P, depths)]
            mask = torch.stack([_ancestors(par) for par in parents]).to(dec.dev)
        else:
            padded = [s + [s[-1]] * (t - len(s)) for s in seqs]  # pads follow the real tokens; cropped below
            positions = [[p + j for j in range(t)] for p in P]
        x = self.drafter.verify_input(rows, padded)
        # a chain pass over one token per row (no draft this round) keeps that token, and its chunk steps leave the
        # state after it in place: no log of CH's states to roll back (a tree pass commits them only through the log)
        x, ks, bounds = self.layers(self.verify_ops, rows, x, positions, self.drafter.start, dec.L,
                                    tree=(mask, parents) if tree else None, log=t > 1 or tree)
        raw = self.verify_ops.head(x).float()                   # (b, t, V)
        self.head_rows += raw.shape[0] * t
        committed = {}
        kept, last = [], {}
        for i, r in enumerate(rows):
            if tree:
                tokens, a, order = self._accept_tree(raw[i], padded[i], parents[i], depths[i], len(seqs[i]), n[r])
                perm = torch.tensor(order, device=x.device)
                for v in (x, raw, ks, bounds):  # path order from here on
                    if v is not None:
                        v[i] = v[i].index_select(0, perm.to(v.device))
                padded[i] = [padded[i][j] for j in order]
            else:
                tokens, a = self._accept(raw[i], drafts[r], props[r].q, n[r])
                order = list(range(t))
            committed[r] = self._commit(r, tokens, raw[i], n[r])
            c = len(committed[r])
            kept.append(c)
            last[r] = order[c - 1]
            if tree:
                self._compact(r, t, P[i], order[:c])
            self._record(r, n[r], P[i], c, ks[i] if ks is not None else None, bounds[i] if bounds is not None else None)
            self.verify_rounds.append((P[i], t, [-1] * t if ks is None else ks[i].tolist()))
            self.nodes[r] += len(drafts[r])
            self._adapt(r, min(a, c - 1), props[r].depth(), P[i])
        dec.cache.crop(rows, [p + c for p, c in zip(P, kept)])
        self.log.keep(dec.chunks, last)
        lengths = [len(s) for s in seqs]
        t0 = time.perf_counter()
        self.drafter.commit(rows, P, kept, Verified(padded, lengths, x, raw))
        self.draft_s += time.perf_counter() - t0
        for r in rows:
            if self.draft_log[r]:
                self.draft_rounds.append((len(dec.prompts[r]) + n[r] - 1, self.draft_log[r]))
            self.draft_log[r] = []
        return committed

    def _accept_tree(self, raw: torch.Tensor, tokens: list[int], parents: list[int], depths: list[int], real: int,
                     n: int) -> tuple[list[int], int, list[int]]:
        """A tree round's tokens for one row from the verifier's logits (t, V) at its nodes: the kept path's
        tokens plus one (:func:`accept_tree`, or :func:`accept_typical` when the draft asks for it), the number of
        kept drafts, and the node order with the consumed path first (root, kept nodes, then the rest)."""
        dec, o = self.dec, self.dec.opts
        logits = raw.clone()
        if dec.eos and o.min_new_tokens > 0:  # the token after node j is generated token n + depth_j
            low = [j for j, d in enumerate(depths) if n + d < o.min_new_tokens]
            if low:
                logits[torch.tensor(low)[:, None], torch.tensor(list(dec.eos))[None]] = float("-inf")
        children: list[list[int]] = [[] for _ in tokens]
        for j in range(1, real):  # the real nodes only; pads have no place in the tree
            children[parents[j]].append(j)
        memo: dict[int, torch.Tensor] = {}

        def probs(j: int) -> torch.Tensor:
            if j not in memo:
                memo[j] = logits[j] if not o.do_sample else dec.warp(logits[j]).softmax(-1)
            return memo[j]

        if o.do_sample and self.typical:
            path, nxt = accept_typical(probs, tokens, children, *self.drafter.posterior, generator=dec.gen)
        else:
            path, nxt = accept_tree(probs, tokens, children, dec.gen, greedy=not o.do_sample)
        order = [0] + path
        order += [j for j in range(len(tokens)) if j not in set(order)]
        return [tokens[j] for j in path] + [nxt], len(path), order

    def _compact(self, r: int, t: int, p: int, nodes: list[int]) -> None:
        """After a tree round, row r's cache holds the round's t nodes last at every verified layer: move the
        consumed ones (``nodes``, in path order) to the round's first slots at positions p, p+1, ...; the rest are
        cropped with the round."""
        cache = self.dec.cache
        c = len(nodes)
        for l in range(self.drafter.start, self.dec.L):
            base = cache.lengths[l][r] - t
            if nodes != list(range(c)):
                idx = torch.tensor([base + j for j in nodes], device=cache.k[l].device)
                cache.k[l][r, :, base:base + c] = cache.k[l][r].index_select(1, idx)
                cache.v[l][r, :, base:base + c] = cache.v[l][r].index_select(1, idx)
            cache.positions[l][r][base:] = [p + j for j in range(c)]
            cache.lengths[l][r] = base + c

    def _gamma_now(self, r: int) -> int:
        """The row's draft length this round: its gamma, or a one-token probe every PROBE_EVERY rounds at gamma 0
        (a draft source that does not adapt gets ``draft_tokens``)."""
        if self.gamma[r] > 0 or not self.drafter.adaptive:
            return self.gamma[r]
        self.idle[r] += 1
        return 1 if self.idle[r] % PROBE_EVERY == 0 else 0

    def draft_by_steps(self, drafter, rows: list[int], budget: dict[int, int]) -> dict[int, Draft]:
        """A step drafter's proposal (``begin(rows)``, ``step(rows, steps, tokens) -> logits``, ``finish``): token
        by token, greedy or sampled from the warped draft logits (EOS masked as the engine does), up to
        ``budget[r]`` tokens per row, fewer when the draft's top-1 probability drops below the row's threshold.
        Rows with budget 0 only ``finish`` their last committed token."""
        dec = self.dec
        n = {r: len(dec.out[r]) for r in rows}
        drafts, q = self._draft(drafter, rows, n, budget)
        return {r: Draft(drafts[r], q[r]) for r in rows}

    def _draft(self, drafter, rows, n, budget):
        dec = self.dec
        drafts = {r: [] for r in rows}
        q = {r: [] for r in rows}
        drafter.begin(rows)
        idle = [r for r in rows if budget[r] == 0]
        if idle:  # no draft: the verifier consumes the last committed token alone
            drafter.finish(idle, [n[r] - 1 for r in idle], [dec.out[r][-1] for r in idle])
        drafting = [r for r in rows if budget[r] > 0]
        cur = {r: dec.out[r][-1] for r in drafting}
        j = 0
        while drafting:
            steps = [n[r] - 1 + j for r in drafting]
            logits = drafter.step(drafting, steps, [cur[r] for r in drafting]).float()
            logits = self._mask_eos(logits[:, None], [s + 1 for s in steps])[:, 0]
            toks, probs, conf = self._draw(logits)
            going, stopped = [], []
            for i, r in enumerate(drafting):
                self.draft_steps[r] += 1
                drafts[r].append(toks[i])
                if probs is not None:
                    q[r].append(probs[i])
                done = len(drafts[r]) >= budget[r] or conf[i] < self.threshold[r]
                (stopped if done else going).append(r)
                cur[r] = toks[i]
            if stopped:
                drafter.finish(stopped, [n[r] + j for r in stopped], [cur[r] for r in stopped])
            drafting, j = going, j + 1
        return drafts, {r: torch.stack(v) if v else None for r, v in q.items()}

    def _draw(self, logits: torch.Tensor):
        """Draft tokens (b,), the draft's probabilities (b, V) when sampling, and its top-1 probabilities (only
        read with ``draft_stop``: else ones)."""
        o = self.dec.opts
        if not o.do_sample:
            toks = greedy_ids(logits)
            return toks, None, logits.softmax(-1).amax(-1).tolist() if o.draft_stop > 0 else [1.0] * len(toks)
        probs = self.dec.warp(logits).softmax(-1)
        toks = torch.multinomial(probs, 1, generator=self.dec.gen)[:, 0].tolist()
        return toks, probs, probs.amax(-1).tolist()

    def _mask_eos(self, logits: torch.Tensor, first: list[int], copy: bool = False) -> torch.Tensor:
        """Mask EOS in ``logits`` (b, t, V) where the predicted token's index (``first[i] + j``) is below
        ``min_new_tokens``, as the engine's pick does: in place, or (``copy``) in a copy made only when something is
        masked."""
        dec = self.dec
        rows = [(i, dec.opts.min_new_tokens - f) for i, f in enumerate(first) if dec.opts.min_new_tokens > f]
        if not dec.eos or not rows:
            return logits
        if copy:
            logits = logits.clone()
        eos = list(dec.eos)
        for i, k in rows:
            logits[i, :k, eos] = float("-inf")
        return logits

    def _accept(self, raw: torch.Tensor, drafts: list[int], q, n: int) -> tuple[list[int], int]:
        """The round's tokens for one row from the verifier's logits (t, V): accepted drafts plus one."""
        logits = self._mask_eos(raw[None], [n], copy=True)[0]  # raw stays the verifier's logits
        g = len(drafts)
        if not self.dec.opts.do_sample:
            target = greedy_ids(logits[:g + 1])
            a = 0
            while a < g and drafts[a] == target[a]:
                a += 1
            return drafts[:a] + [target[a]], a
        p = self.dec.warp(logits[:g + 1]).softmax(-1)
        if q is None:  # deterministic drafts: a point mass on each
            q = torch.zeros(g, p.shape[-1], device=p.device)
            q[torch.arange(g), torch.tensor(drafts, dtype=torch.long)] = 1.0
        a, nxt = accept_sampled(p, q, drafts, self.dec.gen)
        return drafts[:a] + [nxt], a

    def _commit(self, r: int, tokens: list[int], raw: torch.Tensor, n: int) -> list[int]:
        dec = self.dec
        out = []
        for j, tok in enumerate(tokens):
            dec.out[r].append(tok)
            out.append(tok)
            if dec.opts.output_scores:
                dec.scores[r].append(raw[j].clone())
            if dec.structure is not None:
                dec.depth[r] = max(0, dec.depth[r] + dec.structure.depth_delta[tok])
            if dec.finished(r, tok):
                break
        return out

    def _record(self, r, n, p, c, ks, bounds) -> None:
        """The verifier consumed round tokens 0..c-1 (generated tokens n-1 .. n+c-2) at full depth."""
        f, L = self.final, self.dec.L
        for j in range(c):
            s = n - 1 + j
            f.executed[r][s], f.kv[r][s] = [True] * L, [True] * L
            f.ctx[r][s], f.valid[r][s] = p + j, True
            if ks is not None:
                f.k[r][s] = int(ks[j])
            if bounds is not None:
                f.bound[r][s] = bool(bounds[j])
        self.passes[r] += 1

    def _adapt(self, r: int, a: int, g: int, context: int) -> None:
        """Draft counts, then the row's next draft length (or threshold) from its recent acceptance."""
        o = self.dec.opts
        self.proposed[r] += g
        self.accepted[r] += a
        self.rejections[r] += int(a < g)
        steps = self.draft_log[r]
        if steps and isinstance(self.drafter, EngineDraft):
            share = sum(sum(ex) for ex, *_ in steps) / (len(steps) * self.dec.L)
            self.share[r] = 0.7 * self.share[r] + 0.3 * share
        if g == 0 or not o.adapt_draft:
            return
        self.succ[r] = ACCEPT_DECAY * self.succ[r] + a
        self.fail[r] = ACCEPT_DECAY * self.fail[r] + (1.0 if a < g else 0.0)
        if o.draft_stop > 0:  # Draft&Verify: the threshold follows the match rate
            self.match[r] = DV_MATCH_EMA * self.match[r] + (1 - DV_MATCH_EMA) * a / g
            th = self.threshold[r]
            new = th + DV_STEP if self.match[r] < DV_TARGET else (th if g == self.gamma[r] else th - DV_STEP)
            self.threshold[r] = min(max(DV_THRESHOLD_EMA * th + (1 - DV_THRESHOLD_EMA) * new, 0.0), 0.999)
            return
        if not self.drafter.adaptive:
            return
        alpha = acceptance_mle(self.succ[r], self.fail[r])
        cost = self.drafter.step_cost(r, context)
        self.gamma[r] = best_gamma(alpha, cost, o.draft_tokens, min_gamma=0)

    # ---- the verifier's pass (and Kangaroo's shallow layers) ------------------
    def layers(self, ops, rows, x, pos, start: int, stop: int, tree=None, log: bool = True):
        """Layers start..stop-1 at full depth over x (b, t, d) at positions ``pos``, writing the cache; returns the
        output, PAW's k (b, t) at its first layer and CH's boundaries (b, t) at its first layer (None if not run).
        ``tree``: (ancestor mask (b, t, t), parents per row) of a token tree (:class:`_TreeContext`). ``log``: record
        CH's state after each token (:class:`_ChunkLog`); without it a chain pass leaves the state after its last
        token."""
        dec = self.dec
        cos, sin = ops.rope(x, torch.tensor(pos, device=dec.dev))
        ctx = dec.context(rows, pos, cos, sin)
        ctx.trail = {} if log else None
        ctx.native_many = True
        if tree is not None:
            ctx = _TreeContext(ctx, *tree, native_steps=getattr(ops, "native_packed", False))
        found = {}

        def on_layer(l, out):
            if out.paw is not None and l == dec.m.layers_cfg.paw[0]:
                found["ks"] = out.paw.k_hard.reshape(len(rows), -1)
            if out.ch is not None and l == dec.m.layers_cfg.ch[0]:
                found["bounds"] = out.ch.boundary.reshape(len(rows), -1)

        x = full_depth(dec.m, ops, x, ctx, range(start, stop), on_layer)
        self.log.add(ctx)
        return x, found.get("ks"), found.get("bounds")

    # ---- accounting ------------------------------------------------------------
    def _trace(self, rounds, granularity: str) -> DecodeTrace | None:
        """The passes of ``rounds`` [(P, [(executed, kv, gate logit, k), ...]), ...] as one trace, a row per round
        (each round starts from a cache holding every position < P at every layer)."""
        if not rounds:
            return None
        L, S = self.dec.L, max(len(steps) for _, steps in rounds)
        rec = TraceRecorder(len(rounds), S, L)
        for i, (p, steps) in enumerate(rounds):
            for j, (ex, kv, gp, k) in enumerate(steps):
                rec.executed[i][j], rec.kv[i][j], rec.p[i][j], rec.k[i][j] = ex, kv, gp, k
                rec.ctx[i][j], rec.valid[i][j] = p + j, True
        fields = {k: torch.tensor(v, dtype=TRACE_DTYPES[k]) for k, v in rec.rows(S).items()}
        return DecodeTrace(**fields, tflops_rel=0.0, tflops_rel_exact=0.0, fallback=[], skip_granularity=granularity)

    def tflops(self, trace: DecodeTrace) -> tuple[float, float]:
        """(tflops_rel, tflops_rel_exact) of everything that ran while decoding (drafts, rejected candidates, pads,
        verification, adapter), against plain decoding of the tokens the verifier consumed (``trace``)."""
        counter, L = self.dec.flops, self.dec.L
        c = counter.cost
        ref = counter.counts(trace)
        if ref.tokens == 0:
            return 0.0, 0.0
        ran = [l >= self.drafter.start for l in range(L)]
        verify = [(p, [(ran, ran, [float("nan")] * L, k) for k in ks]) for p, _, ks in self.verify_rounds]
        inv = macs = 0.0
        for passes in (self._trace(self.draft_rounds, self.drafter.granularity), self._trace(verify, "layer")):
            if passes is not None:
                n = counter.counts(passes)
                inv, macs = inv + n.invocations, macs + n.layers + n.overhead
        inv += self.adapter_calls * c.attn_proj / c.dense
        macs += self.adapter_calls * c.attn_proj + self.adapter_keys * c.per_key
        macs += (self.head_rows + self.draft_head_rows) * c.lm_head + self.drafter.draft_macs()
        return inv / (ref.tokens * L), macs / ref.baseline

    def stats(self) -> SpecStats:
        B = self.dec.B
        steps = [s for _, rnd in self.draft_rounds for s in rnd]
        executed = sum(sum(ex) for ex, *_ in steps)
        return SpecStats(
            drafter=self.drafter.name, rows=B, passes=sum(self.passes) / B, proposed=sum(self.proposed) / B,
            accepted=sum(self.accepted) / B, rejections=sum(self.rejections) / B, draft_steps=sum(self.draft_steps) / B,
            nodes=sum(self.nodes) / B,
            draft_skip_ratio=1.0 - executed / (len(steps) * self.dec.L) if steps else 0.0,
            gamma=list(self.gamma), threshold=list(self.threshold))


def run_lossless(dec) -> Iterator[StepOutput]:
    """The engine's generate loop for ``lossless=True`` (``fbs.engine.run`` delegates here): yields the tokens
    each round commits, one :class:`fbs.engine.StepOutput` per token index."""
    spec = dec.spec = _Speculation(dec)
    t0 = time.perf_counter()
    tap = getattr(spec.drafter, "prefill_tap", None)
    logits = torch.stack(dec.prefill(tap=tap))
    dec.timings = {"prefill_s": time.perf_counter() - t0}
    t1 = time.perf_counter()
    tokens = dec.pick(logits, dec.active)
    step = 0
    for r, t in zip(dec.active, tokens):
        dec.out[r].append(t)
        if dec.structure is not None:
            dec.depth[r] = max(0, dec.depth[r] + dec.structure.depth_delta[t])
    yield StepOutput(step, list(dec.active), list(tokens))
    rows = [r for r, t in zip(dec.active, tokens) if not dec.finished(r, t)]
    while rows:
        committed = spec.round(rows)
        for k in range(max(len(v) for v in committed.values())):
            step += 1
            have = [r for r in rows if len(committed[r]) > k]
            yield StepOutput(step, have, [committed[r][k] for r in have])
        rows = [r for r in rows if not dec.finished(r, dec.out[r][-1])]
    dec.rec = spec.final
    dec.timings["decode_s"] = time.perf_counter() - t1
    dec.timings["total_s"] = time.perf_counter() - t0
    dec.timings["draft_s"] = spec.draft_s  # of decode_s: the draft source's share


def draft_plan(layers, num_layers: int) -> torch.Tensor:
    """A Draft&Verify skip set as the engine's static plan (L,): ``layers`` is a list of layer indices, a comma
    list ("3,5,7") or a JSON file with a ``layers`` list (``fbs train draft-search`` writes one)."""
    import json
    from pathlib import Path

    if isinstance(layers, str):
        path = Path(layers)
        layers = json.loads(path.read_text())["layers"] if path.is_file() else \
            [int(x) for x in layers.split(",") if x.strip()]
    plan = torch.zeros(num_layers, dtype=torch.bool)
    plan[list(layers)] = True
    return plan


# --------------------------------------------------------------------------- the engine's own drafts by name
def _fbs_draft(spec) -> EngineDraft:
    """``fbs``: the FBS model's own step at its tau (or with ``skip_plan``, if given, as the engine always did)."""
    return EngineDraft(spec)


def _plan_draft(spec, layers=None) -> EngineDraft:
    """``plan``: a static skip plan drafts (Draft&Verify): ``skip_plan=`` or ``draft_options={"layers": ...}``
    (a comma list or the JSON of ``fbs train draft-search``)."""
    dec = spec.dec
    if layers is not None:
        dec.plan = draft_plan(layers, dec.L).expand(dec.opts.max_new_tokens, dec.L).tolist()
    if dec.plan is None:
        raise ValueError("draft 'plan' drafts with a static skip plan: pass skip_plan= or draft_options={'layers': "
                         "'3,5'} (fbs generate --draft-layers; search one with `fbs train draft-search`)")
    return EngineDraft(spec)


def _kangaroo_draft(spec, adapter=None) -> KangarooDraft:
    adapter = adapter if adapter is not None else spec.dec.opts.draft_adapter
    if adapter is None:
        raise ValueError("draft 'kangaroo' needs an adapter: draft_adapter= (or draft_options={'path': DIR} with "
                         "fbs.baselines imported); train one with `fbs train kangaroo`")
    return KangarooDraft(spec, adapter)


register_draft("fbs", _fbs_draft)
register_draft("plan", _plan_draft)
register_draft("kangaroo", _kangaroo_draft)
