"""Draft sources of the lossless speculative verifier (:mod:`fbs.engine.speculative`), and their registry.

The verifier owns everything that makes the output exact: it asks a draft source for up to ``budget`` tokens per
row, runs the full model over [last committed token, drafts] in one cached pass, keeps the longest prefix the
target agrees with (greedy) or the speculative-sampling rule's choice (sampling), and rolls back the K/V and chunk
state of everything it rejected. A draft source only proposes, so no draft can change the output: a bad one only
costs speed.

A draft source implements :class:`DraftSource`; the verifier calls, per generate call and round::

    prefill_tap(l, rows, x)                    optional: the prompt's input of layer l (Kangaroo reads its exit layer)
    propose(rows, budget) -> {row: Draft}      tokens (and, when sampling, the distributions they were drawn from)
    rollback(rows, positions)                  forget what drafting wrote to the verifier's state at positions >= P
    verify_input(rows, seqs) -> x              the verifier's input (b, t, d) for the padded round tokens
    commit(rows, positions, kept, verified)    the round's outcome: kept tokens per row and the verifier's pass

``P`` (``positions``) is each row's position of its last committed token, which the verifier consumes first.

Sources by name (:func:`draft_names`, ``model.generate(..., draft=NAME)``, ``fbs generate --draft NAME``):

* ``fbs`` — the FBS model drafts with its gates at tau (:class:`fbs.engine.speculative.EngineDraft`);
* ``plan`` — the same step with a static skip plan (Draft&Verify; ``skip_plan=``);
* ``kangaroo`` — the first N layers, an adapter and the shared LM head (``draft_adapter=``, or
  ``draft_options={"path": DIR}`` once :mod:`fbs.baselines` is imported);
* ``prompt-lookup`` — :class:`PromptLookupDraft`: the continuation of the latest earlier occurrence of the last
  n-gram of prompt + output;
* ``lookahead`` — :class:`LookaheadDraft`: Jacobi iteration with an n-gram pool (Fu et al. 2024), one chain per pass;
* ``specdec`` — :class:`ModelDraft`: a separate causal LM with the same vocabulary and its own KV cache (Leviathan
  et al. 2023; ``draft_options={"model": hf_model}``, or ``{"path": DIR}`` of ``fbs train draft-model`` once
  :mod:`fbs.baselines` is imported);
* ``medusa`` — :class:`HeadsDraft`: Medusa-1 heads on the verifier's last hidden state, a candidate tree of their
  top-k (``{"heads": module}``, or ``{"path": DIR}`` of ``fbs train medusa`` once :mod:`fbs.baselines` is
  imported, which also finds heads shipped for the model's base);
* ``eagle`` — :class:`EagleDraft`: EAGLE-2's one-layer feature extrapolator and dynamic draft tree
  (``{"layer": module}``, or ``{"path": DIR}`` of ``fbs train eagle``).

Tree drafts (:attr:`Draft.parents`) are verified in one pass with a tree attention mask (on the PyTorch ops, or in
the native multi-token steps with each node's visibility); a tree of more nodes than a native pass takes
(:data:`fbs.native.TREE_NODES`) verifies its chain of first children instead.

Layers above the engine register more with :func:`register_draft` (the engine never imports them).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from .greedy import greedy_ids


# --------------------------------------------------------------------------- the interface
@dataclasses.dataclass
class Draft:
    """One row's proposal: ``tokens`` for positions P+1.., and ``q`` (len(tokens), V) the probabilities each token
    was drawn from when sampling (None: the tokens were chosen deterministically, a point mass: the verifier keeps
    draft j with the target's probability of it and otherwise draws from the target with that token removed).

    A token tree: ``parents[j]`` is the index in ``tokens`` of token j's parent, -1 for a child of the last
    committed token (parents come before their children); token j then sits at position P + 1 + its depth.
    Siblings are alternatives, tried in their order (put the likeliest first: a verifier that cannot run trees
    keeps the chain of first children, :meth:`chain`). Trees are deterministic proposals (``q`` None)."""

    tokens: list[int]
    q: torch.Tensor | None = None
    parents: list[int] | None = None

    def __post_init__(self):
        if self.parents is not None:
            if len(self.parents) != len(self.tokens) or any(not -1 <= p < j for j, p in enumerate(self.parents)):
                raise ValueError(f"a draft tree needs one parent per token, each -1 or an earlier token's index; "
                                 f"got parents {self.parents} for {len(self.tokens)} tokens")
            if self.q is not None:
                raise ValueError("a draft tree is a deterministic proposal: pass q=None")

    def depths(self) -> list[int]:
        """Each token's depth (1: a child of the last committed token)."""
        if self.parents is None:
            return list(range(1, len(self.tokens) + 1))
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def depth(self) -> int:
        """The longest path: the most drafts one round can accept."""
        return max(self.depths(), default=0)

    def chain(self) -> "Draft":
        """The chain of first children (the whole draft when it is a chain)."""
        if self.parents is None:
            return self
        toks, node = [], -1
        for j, p in enumerate(self.parents):
            if p == node:
                toks.append(self.tokens[j])
                node = j
        return Draft(toks)


@dataclasses.dataclass
class Verified:
    """What the verifier computed in a round, for the draft sources that learn from it: ``seqs`` the round tokens
    per row at positions P.. (``lengths`` real ones, then pads), ``hidden`` the last layer's output (b, t, d) before
    the final norm, ``logits`` the target's next-token logits (b, t, V). After a tree round a row's entries are in
    path order: the root, the kept nodes, then the others (so index j < kept is the round's j-th consumed token)."""

    seqs: list[list[int]]
    lengths: list[int]
    hidden: torch.Tensor
    logits: torch.Tensor


@runtime_checkable
class DraftSource(Protocol):
    """A draft for the verifier. ``name`` is reported as ``SpecStats.drafter``; ``start`` is the first layer the
    verifier runs (0: from the token embeddings; Kangaroo resumes at its exit layer); ``adaptive``: the verifier
    adapts the draft length to the acceptance rate (else it asks for ``draft_tokens`` every round)."""

    name: str
    start: int
    adaptive: bool

    def propose(self, rows: list[int], budget: dict[int, int]) -> dict[int, Draft]:
        """At most ``budget[r]`` tokens for each row (fewer or none is fine)."""

    def rollback(self, rows: list[int], positions: list[int]) -> None:
        """Undo what drafting wrote to the verifier's own state (K/V, chunk states) at positions >= ``positions``."""

    def verify_input(self, rows: list[int], seqs: list[list[int]]) -> torch.Tensor:
        """The verifier's input for the round tokens ``seqs`` (b, t): embeddings, or hidden states at ``start``."""

    def commit(self, rows: list[int], positions: list[int], kept: list[int], verified: Verified) -> None:
        """Row ``rows[i]`` committed ``kept[i]`` tokens at positions ``positions[i]+1..``: the verifier consumed the
        round's tokens at ``positions[i] .. positions[i]+kept[i]-1``; the last committed one is consumed next round."""

    def step_cost(self, row: int, context: float) -> float:
        """One drafted token's cost in decode steps of the verifier (for the adaptive draft length)."""

    def draft_macs(self) -> float:
        """MACs drafting spent outside the verifier's layers and LM head so far (a draft model, heads)."""


class BaseDraft:
    """Defaults of :class:`DraftSource` for drafts that keep no state in the verifier's cache: the verifier starts
    from the embeddings, nothing to roll back, drafting is free unless said otherwise."""

    name = "draft"
    start = 0
    adaptive = False
    granularity = "layer"  # of the verifier's layers the draft runs itself (none here): for the accounting

    def __init__(self, session):
        self.s, self.dec = session, session.dec

    def rollback(self, rows, positions) -> None:
        pass

    def verify_input(self, rows, seqs) -> torch.Tensor:
        return self.s.verify_ops.embed(torch.tensor(seqs, device=self.dec.dev))

    def commit(self, rows, positions, kept, verified) -> None:
        pass

    def step_cost(self, row, context) -> float:
        return 0.0

    def draft_macs(self) -> float:
        return 0.0

    def context(self, r: int) -> list[int]:
        """Row r's prompt and committed tokens."""
        return self.dec.prompts[r] + self.dec.out[r]


# --------------------------------------------------------------------------- the cost model of a round
#: Extra cost of each further token a verification pass checks, in decode steps. A pass reads the weights once
#: (one step); each further token adds its share of the activations' work (the measured cost is in BENCHMARKS.md).
VERIFY_TOKEN_COST = 0.15
#: The verifier's draft length unless the call or the draft source (its ``draft_tokens``) says otherwise.
DRAFT_TOKENS = 4
#: Decay per round of the acceptance counts behind the adaptive gamma (the last ~10 rounds weigh), and the prior.
ACCEPT_DECAY, ACCEPT_PRIOR, ACCEPT_PRIOR_WEIGHT = 0.9, 0.8, 2.0
#: A row whose drafts do not pay (gamma 0: plain full-depth steps) drafts one token every this many rounds, so
#: that its acceptance estimate can recover.
PROBE_EVERY = 8


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens a round commits when each of ``gamma`` drafts is accepted with probability ``alpha`` independently
    (Leviathan et al. 2023, Eq. 1): (1 - alpha^(gamma+1)) / (1 - alpha)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, gamma: int, draft_cost: float,
                     verify_token_cost: float = VERIFY_TOKEN_COST) -> float:
    """Tokens per unit of cost against plain decoding (one token per decode step): a draft step costs
    ``draft_cost`` decode steps, a verification pass of gamma+1 tokens 1 + ``verify_token_cost`` * gamma."""
    return expected_tokens(alpha, gamma) / (gamma * draft_cost + 1.0 + verify_token_cost * gamma)


def best_gamma(alpha: float, draft_cost: float, max_gamma: int, verify_token_cost: float = VERIFY_TOKEN_COST,
               min_gamma: int = 1) -> int:
    """The draft length in min_gamma..max_gamma with the highest :func:`expected_speedup` (gamma 0 is plain
    decoding, speed-up 1: the answer when no draft pays)."""
    return max(range(min_gamma, max_gamma + 1), key=lambda g: expected_speedup(alpha, g, draft_cost, verify_token_cost))


def acceptance_mle(accepted: float, failures: float) -> float:
    """Per-draft acceptance rate under the geometric model: rounds that accepted a of g drafts give a successes and,
    when a < g, one failure (a round accepting all is censored)."""
    total = accepted + failures
    return accepted / total if total > 0 else ACCEPT_PRIOR


# --------------------------------------------------------------------------- registry
#: name -> factory(session, **options) -> DraftSource
_REGISTRY: dict[str, Callable[..., Any]] = {}


def register_draft(name: str, factory: Callable[..., Any]) -> None:
    """Make ``factory(session, **draft_options)`` the draft source called ``name`` (replacing an earlier one: a
    layer that can load artifacts from files registers a factory that also accepts ``path``)."""
    _REGISTRY[name] = factory


def draft_names() -> list[str]:
    return sorted(_REGISTRY)


def default_draft_tokens(draft) -> int:
    """The draft length (most tokens a round drafts) when a call does not set ``draft_tokens``: the draft source's
    own ``draft_tokens`` attribute (of a registered name or a factory), else :data:`DRAFT_TOKENS`."""
    factory = draft if callable(draft) else _REGISTRY.get(draft)
    return int(getattr(factory, "draft_tokens", DRAFT_TOKENS))


def make_draft(name, session, options: dict | None) -> DraftSource:
    """The draft source ``name`` (a registered name, or a factory ``f(session, **options)``) for one generate call."""
    options = dict(options or {})
    factory = name if callable(name) else _REGISTRY.get(name)
    if factory is None:
        raise ValueError(f"unknown draft {name!r}; registered drafts: {', '.join(draft_names())}")
    try:
        inspect.signature(factory).bind(session, **options)
    except TypeError as e:
        hint = "; draft_options={'path': ...} loads files once fbs.baselines is imported (the fbs command does)" \
            if "path" in options else ""
        raise ValueError(f"draft {getattr(name, '__name__', name)!r} does not take the options {sorted(options)} "
                         f"({e}){hint}") from e
    return factory(session, **options)


# --------------------------------------------------------------------------- prompt lookup
def lookup_match(seq: list[int], max_ngram: int, min_ngram: int, budget: int) -> tuple[list[int], int]:
    """Prompt lookup: for n from ``max_ngram`` down to ``min_ngram``, the last n tokens of ``seq`` are searched for
    earlier in ``seq``; at the latest earlier occurrence, the (at most ``budget``) tokens that followed it are the
    proposal. Returns the proposal and the n that matched, ([], 0) when nothing matches.

    One pass over the earlier occurrences of the last token (found by ``list.index``, in C): each one's match
    length backwards (up to ``max_ngram``); the longest n wins, at its latest occurrence."""
    L = len(seq)
    if L < 2:
        return [], 0
    cap = min(max_ngram, L - 1)
    last, best_n, best_j = seq[-1], 0, -1
    j = -1
    while True:  # occurrences j <= L - 2 of the last token, in order (a later one replaces an equal n)
        try:
            j = seq.index(last, j + 1, L - 1)
        except ValueError:
            break
        n = 1
        while n < cap and n <= j and seq[j - n] == seq[L - 1 - n]:
            n += 1
        if n >= best_n:
            best_n, best_j = n, j
    if best_n < min_ngram:
        return [], 0
    return seq[best_j + 1:best_j + 1 + budget], best_n


def lookup_continuation(seq: list[int], max_ngram: int, min_ngram: int, budget: int) -> list[int]:
    """:func:`lookup_match`'s proposal alone."""
    return lookup_match(seq, max_ngram, min_ngram, budget)[0]


class PromptLookupDraft(BaseDraft):
    """Prompt lookup decoding (Saxena 2023; HF's ``prompt_lookup_num_tokens``) on the engine's verifier: the draft
    is the continuation of the latest earlier occurrence of the last ``max_ngram``..``min_ngram`` tokens in the
    prompt and the output so far. Free to propose; pays where the output copies its context (code edits,
    summaries, retrieval).

    ``adapt`` (default): a proposal's length follows how often the verifier kept proposals of the same match
    length n in this row so far. Per (row, n) the kept and rejected drafts give an acceptance rate
    (:func:`acceptance_mle`, from the prior :data:`ACCEPT_PRIOR`), and the proposal is cut to the length that
    maximises the expected speed-up of a free draft (:func:`best_gamma`; each drafted token costs the verifier
    :data:`VERIFY_TOKEN_COST` of a step), possibly to nothing: a 1-token match in chat is rarely continued the same
    way, a 3-token match in code often is. A match length whose proposals are withheld proposes one token every
    :data:`PROBE_EVERY` matches, so that its estimate can recover. ``adapt=False``: every match proposes the
    whole budget.

    Defaults (``max_ngram`` 6, up to :attr:`draft_tokens` = 12 tokens a round): a simulation of the verifier's rounds
    over full depth's own greedy outputs (the Stage-1 model, q4, 512 -> 128; it reproduces the engine's round counts
    exactly) gave 64 code prompts 3,680 rounds against 4,131 for max_ngram 3 and 4 tokens, 11 % fewer, for 13 % more
    verified tokens (8,174 against 7,204); chat prompts 1,401 against 1,423. Longer n-grams pick the occurrence that
    goes on the same way; a long match in code keeps going past 4 tokens."""

    name = "prompt-lookup"
    draft_tokens = 12  # the verifier's draft length for this source unless the call sets draft_tokens

    def __init__(self, session, max_ngram: int = 6, min_ngram: int = 1, adapt: bool = True):
        super().__init__(session)
        if not 1 <= int(min_ngram) <= int(max_ngram):
            raise ValueError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if not isinstance(adapt, bool):
            raise ValueError(f"prompt lookup's adapt is true or false, got {adapt!r}")
        self.max_ngram, self.min_ngram, self.adapt = int(max_ngram), int(min_ngram), adapt
        self.counts: dict[tuple[int, int], list[float]] = {}  # (row, n) -> [kept drafts, rejections]
        self.withheld: dict[tuple[int, int], int] = {}        # (row, n) -> matches proposed nothing
        self.pending: dict[int, tuple[int, int]] = {}         # row -> (n, length) of its proposal this round

    def _counts(self, key: tuple[int, int]) -> list[float]:
        """[kept drafts, rejections] of matches of ``key`` = (row, n), starting from the prior."""
        prior = [ACCEPT_PRIOR * ACCEPT_PRIOR_WEIGHT, (1 - ACCEPT_PRIOR) * ACCEPT_PRIOR_WEIGHT]
        return self.counts.setdefault(key, prior)

    def _length(self, key: tuple[int, int], found: int) -> int:
        """How many of the ``found`` tokens a match of ``key`` = (row, n) proposes."""
        g = best_gamma(acceptance_mle(*self._counts(key)), 0.0, found, min_gamma=0)
        if g == 0:
            self.withheld[key] = self.withheld.get(key, 0) + 1
            if self.withheld[key] % PROBE_EVERY == 0:
                g = 1
        return g

    def propose(self, rows, budget):
        out = {}
        for r in rows:
            if budget[r] <= 0:
                continue
            tokens, n = lookup_match(self.context(r), self.max_ngram, self.min_ngram, budget[r])
            if tokens and self.adapt:
                tokens = tokens[:self._length((r, n), len(tokens))]
                if tokens:
                    self.pending[r] = (n, len(tokens))
            out[r] = Draft(tokens)
        return out

    def commit(self, rows, positions, kept, verified) -> None:
        for r, c in zip(rows, kept):
            if r not in self.pending:
                continue
            n, g = self.pending.pop(r)
            a = min(c - 1, g)  # the drafts kept (a round commits them and the target's next token)
            counts = self._counts((r, n))
            counts[0] += a
            counts[1] += 1.0 if a < g else 0.0


# --------------------------------------------------------------------------- lookahead
class LookaheadDraft(BaseDraft):
    """Lookahead decoding (Fu et al. 2024), training-free: a Jacobi window and an n-gram pool, verified in one pass.

    Per row it keeps a Jacobi window (a guess for each of the next W positions) and an n-gram pool (at most G
    (N-1)-gram continuations per first token, newest first). Each round proposes a token tree of up to
    ``candidates`` pool continuations of the last committed token and the window's guesses for positions
    P+1..P+W, merged where they share a prefix (a trie: siblings differ in token), verified in one pass with the
    tree attention mask:

    * branch 0: the newest continuation followed by the window's guesses for the positions after it (what a chain
      verifier keeps: the chain of first children, which is the whole draft with ``tree=False``);
    * branches 1..: the other continuations, newest first;
    * the window branch: the window's guesses from P+1 on (the lookahead branch; under a chain verifier, branch 0
      carries it).

    The verifier's pass is at the same time one Jacobi iteration of the window branch: the target's prediction
    after each of its nodes at depth d >= kept becomes the guess for position P+d+1, and the diagonals of
    successive iterations (a guess, then the prediction the target made after seeing it, ...) become n-grams of
    the pool, as do the n-grams of the committed output.

    What differs from the paper: the lookahead branch is the window's one chain (its guesses at each position
    conditioned on the earlier guesses), not a separate 2-D window of the last N-1 iterations in the same pass.
    ``window`` is W (at most ``draft_tokens``), ``ngram`` N, ``pool`` G, ``candidates`` the continuations verified
    per pass (default G), ``tree=False`` one chain per pass (branch 0).
    """

    name = "lookahead"

    def __init__(self, session, window: int | None = None, ngram: int = 3, pool: int | None = None,
                 seed: int = 0, candidates: int | None = None, tree: bool = True):
        super().__init__(session)
        limit = self.dec.opts.draft_tokens
        self.W = int(window) if window is not None else limit
        if not 1 <= self.W <= limit or int(ngram) < 2:
            raise ValueError(f"lookahead needs 1 <= window <= draft_tokens ({limit}) and ngram >= 2, got window "
                             f"{self.W}, ngram {ngram}; raise draft_tokens for a wider window")
        self.N, self.G = int(ngram), int(pool) if pool is not None else self.W
        self.C = int(candidates) if candidates is not None else self.G
        if self.G < 1 or not 1 <= self.C <= self.G:
            raise ValueError(f"lookahead needs pool >= 1 and 1 <= candidates <= pool, got pool {self.G}, "
                             f"candidates {self.C}")
        self.tree = bool(tree)
        # branch 0 and the window branch (W nodes each) and the other candidates' (N-1 nodes each)
        self.max_nodes = 2 * self.W + (self.C - 1) * (self.N - 1) if self.tree else 0
        self.gen = torch.Generator().manual_seed(seed)
        B = self.dec.B
        self.window: list[dict[int, int]] = [{} for _ in range(B)]        # absolute position -> guessed token
        self.diag: list[dict[int, tuple]] = [{} for _ in range(B)]        # position -> n-gram ending at its token
        self.pool: list[dict[int, list[tuple]]] = [{} for _ in range(B)]  # first token -> continuations, newest first
        self.indexed = [len(p) + 1 for p in self.dec.prompts]             # the end of the next output n-gram to add
        # this round, per row: the tree (tokens, parents; parents None: a chain) and the node ids (1-based: 0 is the
        # root) of branch 0 and of the window branch
        self.round: dict[int, tuple[list[int], list[int] | None, list[int], list[int]]] = {}

    def _add(self, r: int, gram: tuple) -> None:
        conts = self.pool[r].setdefault(gram[0], [])
        tail = gram[1:]
        if tail in conts:
            conts.remove(tail)
        conts.insert(0, tail)
        del conts[self.G:]

    def _filler(self, r: int) -> int:
        """A guess for a position the window has none for: a random token of the row's context (as the paper
        initialises its window)."""
        ctx = self.context(r)
        return ctx[int(torch.randint(len(ctx), (1,), generator=self.gen))]

    def propose(self, rows, budget):
        out = {}
        for r in rows:
            g = min(budget[r], self.W)
            if g <= 0:
                self.round.pop(r, None)
                continue
            ctx = self.context(r)
            P = len(ctx) - 1
            conts = [list(c)[:g] for c in self.pool[r].get(ctx[-1], [])[:self.C if self.tree else 1]]
            win = self.window[r]
            guesses = [win[P + 1 + j] if P + 1 + j in win else self._filler(r) for j in range(g)]
            first = conts[0] if conts else []
            branches = [first + guesses[len(first):]]  # branch 0: the newest continuation, then the window's guesses
            if self.tree:
                branches += conts[1:] + [guesses]
            tokens, parents, ids = self._trie(branches)
            chain = all(p == j - 1 for j, p in enumerate(parents))
            self.round[r] = (tokens, None if chain else parents, ids[0], ids[-1])
            out[r] = Draft(tokens) if chain else Draft(tokens, parents=parents)
        return out

    @staticmethod
    def _trie(branches: list[list[int]]) -> tuple[list[int], list[int], list[list[int]]]:
        """The branches merged into a token tree (shared prefixes once; children in the order of first insertion):
        tokens, parents (-1: a child of the root), and each branch's node ids (1-based: the root is 0)."""
        tokens: list[int] = []
        parents: list[int] = []
        children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        ids = []
        for br in branches:
            node, path = -1, []
            for t in br:
                key = (node, t)
                if key not in children:
                    children[key] = len(tokens)
                    tokens.append(t)
                    parents.append(node)
                node = children[key]
                path.append(node + 1)
            ids.append(path)
        return tokens, parents, ids

    def commit(self, rows, positions, kept, verified) -> None:
        pred = greedy_ids(verified.logits)
        for i, r in enumerate(rows):
            P, c = positions[i], kept[i]
            t = verified.lengths[i]
            ctx = self.context(r)
            tokens, parents, first, window = self.round.pop(r, ([], None, [], []))
            if parents is None or not self.s.trees:
                # a chain, or a tree of which the verifier ran the chain of first children (branch 0, nodes 1..):
                # node j sits at verified index j, and branch 0 carries the window's guesses
                jac = [j for j in (window if parents is None else first) if j < t]
                where = {j: j for j in range(t)}
            else:  # a tree round: the verifier put the root, the kept path, then the other nodes in their order
                jac = window
                where = _tree_order(tokens, parents, ctx[P + 1:P + c])
            nodes = [0] + jac
            tok = {0: verified.seqs[i][0]}
            for j in jac:
                tok[j] = verified.seqs[i][where[j]]
            after = {j: pred[i][where[j]] for j in nodes}
            # Jacobi: the target's prediction after each window node past the kept ones guesses the next position
            win = {q: v for q, v in self.window[r].items() if q > P + c}
            for d, j in enumerate(nodes):
                if d >= c:
                    win[P + d + 1] = after[j]
            self.window[r] = win
            # diagonals of successive iterations: the guess at P+d, then what the target predicted after it
            diag = self.diag[r]
            new = {}
            for d, j in enumerate(nodes):
                prev = diag.get(P + d)
                gram = (prev if prev is not None and prev[-1] == tok[j] else (tok[j],)) + (after[j],)
                gram = gram[-self.N:]
                new[P + d + 1] = gram
                if len(gram) == self.N:
                    self._add(r, gram)
            self.diag[r] = {q: v for q, v in {**diag, **new}.items() if q > P + c - self.N}
            # n-grams of the committed output
            for end in range(max(self.indexed[r], self.N), len(ctx) + 1):  # n-grams ending in an output token
                self._add(r, tuple(ctx[end - self.N:end]))


def _tree_order(tokens: list[int], parents: list[int], accepted: list[int]) -> dict[int, int]:
    """Where each node of a verified tree sits in the verifier's output (the root, the kept path, then the other
    nodes in their order; :class:`Verified`), by node id (1-based, 0: the root). The kept path is the one that
    spells ``accepted``, the drafted tokens the round kept: siblings of a trie differ in token, so it is unique."""
    path, node = [], -1
    for tok in accepted:
        node = next((j for j, p in enumerate(parents) if p == node and tokens[j] == tok), None)
        if node is None:
            break
        path.append(node + 1)
    order = [0] + path + [j for j in range(1, len(tokens) + 1) if j not in set(path)]
    return {j: k for k, j in enumerate(order)}


# --------------------------------------------------------------------------- a separate draft model
def draft_lm_head(dec, shortlist: torch.Tensor | None = None, scatter: bool = True):
    """The LM head a draft runs on its own states: the decode ops' (the decode format's product, e.g. q8 under q4,
    :meth:`fbs.engine.fused.FusedOps.lm_head`) where they have one, else the model's. Only proposals read it: the
    verifier's logits decide what is kept.

    With ``shortlist`` (token ids; FR-Spec's and EAGLE-3's reduced draft vocabulary) the head scores only those
    tokens (their rows of the head, in the same format: :meth:`fbs.engine.fused.FusedOps.lm_head_rows`) and gives
    every other token -inf, so a proposal reads len(shortlist) / V of the head's bytes. Its logits at the listed
    tokens are the full head's (same rows, same product). ``scatter=False``: the (..., len(shortlist)) logits of
    the listed tokens alone, in shortlist order."""
    if shortlist is None:
        return getattr(dec.ops, "lm_head", None) or dec.m.base.lm_head
    rows_of = getattr(dec.ops, "lm_head_rows", None)
    if rows_of is not None:
        part = rows_of(shortlist)
    else:
        w = dec.m.base.lm_head.weight[shortlist.to(dec.m.base.lm_head.weight.device)]
        part = lambda x: torch.nn.functional.linear(x, w)  # noqa: E731
    if not scatter:
        return part
    vocab = dec.m.base.spec.vocab_size
    ids = shortlist.to(dec.m.base.embedding_weight.device)

    def head(x: torch.Tensor) -> torch.Tensor:
        y = part(x)
        out = y.new_full((*y.shape[:-1], vocab), float("-inf"))
        out[..., ids] = y
        return out

    return head


def _shortlist(module) -> torch.Tensor | None:
    """A draft module's reduced vocabulary (its ``shortlist`` buffer), or None (the full vocabulary)."""
    ids = getattr(module, "shortlist", None)
    return ids if ids is not None and ids.numel() else None


def _linear_params(module: torch.nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))


class ModelDraft(BaseDraft):
    """Speculative decoding with a separate draft model (Leviathan et al. 2023; Chen et al. 2023): any HF causal LM
    whose vocabulary matches the target's, with its own KV cache per row (HF's ``DynamicCache``), drafts token by
    token; the verifier keeps what the target agrees with and the draft's cache is cropped to the kept tokens.

    ``model``: an HF ``PreTrainedModel`` (e.g. the student of ``fbs train draft-model``) or an
    :class:`fbs.FBSForCausalLM`, which drafts with its backbone (the FBS modules do not run in the draft: a draft
    only changes speed, never the output)."""

    name = "specdec"
    adaptive = True

    def __init__(self, session, model=None):
        super().__init__(session)
        if model is None:
            raise ValueError("draft 'specdec' needs a draft model: draft_options={'model': hf_model} or, with "
                             "fbs.baselines imported, {'path': DIR} of `fbs train draft-model`")
        hf = getattr(getattr(model, "base", None), "hf", model)  # an FBSForCausalLM drafts with its backbone
        vocab = hf.get_output_embeddings().weight.shape[0]
        want = self.dec.m.base.spec.vocab_size
        if vocab != want:
            raise ValueError(f"the draft model's vocabulary has {vocab} tokens, the target's {want}; a draft must share "
                             "the target's tokenizer (train one with `fbs train draft-model`)")
        self.hf = hf.eval()
        self.dev = next(hf.parameters()).device
        self.caches: dict[int, Any] = {}
        self.seq: dict[int, list[int]] = {}
        self.fed = 0  # tokens the draft model consumed (for its MACs)
        self.macs_per_token = _linear_params(hf)
        self.cost = self.macs_per_token / max(_linear_params(self.dec.m.base.hf), 1)

    def _cache(self, r: int):
        from transformers import DynamicCache

        if r not in self.caches:
            self.caches[r] = DynamicCache()
        return self.caches[r]

    def propose(self, rows, budget):
        return self.s.draft_by_steps(self, rows, budget)

    def begin(self, rows) -> None:
        for r in rows:
            self.seq[r] = self.context(r)

    def step(self, rows, steps, tokens) -> torch.Tensor:
        """Next-token logits (b, V) after each row's ``tokens`` at generated index ``steps`` (position prompt +
        step); first catches the draft's cache up with the committed tokens it has not seen."""
        out = []
        for r, s, tok in zip(rows, steps, tokens):
            pos = len(self.dec.prompts[r]) + s
            self.seq[r] = self.seq[r][:pos] + [tok]
            cache = self._cache(r)
            have = cache.get_seq_length()
            ids = torch.tensor([self.seq[r][have:pos + 1]], device=self.dev)
            self.fed += ids.shape[1]
            logits = self.hf(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]
            out.append(logits.to(self.dec.dev))
        return torch.stack(out)

    def finish(self, rows, steps, tokens) -> None:
        """The last draft token is consumed by the verifier only (the draft catches up next round)."""

    def commit(self, rows, positions, kept, verified) -> None:
        for r, p, c in zip(rows, positions, kept):
            cache = self.caches.get(r)
            have = cache.get_seq_length() if cache is not None else 0
            if have > p + c:
                cache.crop(p + c - have)  # a negative count removes that many entries (every transformers version)

    def step_cost(self, row, context) -> float:
        return self.cost

    def draft_macs(self) -> float:
        return float(self.fed * self.macs_per_token)


def last_layer_output(dec, x: torch.Tensor) -> torch.Tensor:
    """The last layer's output (b, n, d) over prompts whose input of that layer is ``x`` (b, n, d), computed at full
    depth in a scratch cache (the decoder's prefill returns only the next-token logits; drafts that read the
    target's last hidden states get them this way, for one more layer of prefill work)."""
    from ..model.chunk import ChunkState
    from ..model.layer import layer_step
    from .cache import CacheContext, KVCache

    base, cfg = dec.m.base, dec.m.config
    spec = base.spec
    b, n = x.shape[0], x.shape[1]
    ops = getattr(dec.ops, "hf", dec.ops)
    cache = KVCache(dec.L, b, spec.num_kv_heads, spec.head_dim, n, x.device, x.dtype)
    chunks = {c: ChunkState(b, cfg.chunk_cache_size, cfg.chunk_rank, x.device, x.dtype) for c in dec.chunks}
    pos = torch.arange(n, device=x.device).expand(b, n)
    cos, sin = ops.rope(x, pos)
    ctx = CacheContext(cache, chunks, list(range(b)), [list(range(n))] * b, cos, sin, dec.policy, dec.emb_v,
                       dec.keys_v, base.scaling)
    return layer_step(dec.m, ops, dec.L - 1, x, ctx).x


# --------------------------------------------------------------------------- draft heads (Medusa)
#: Medusa's default sparse candidate tree: each path lists, per depth d, the rank among head d-1's top-k of the
#: token at that depth (a prefix-closed set: every path's parent is in it). 11 nodes, depth 4.
MEDUSA_TREE = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
               (0, 0, 0, 0))


def parse_tree(tree) -> tuple[tuple[int, ...], ...] | None:
    """A candidate tree as rank paths: None or "tree" (:data:`MEDUSA_TREE`), "chain" (None: the top-1 chain), a
    sequence of paths, or the text form "0;1;0,0;0,1" (paths separated by ';', ranks by ','). The paths are
    sorted by depth then rank (parents first) and must be prefix-closed."""
    if tree is None or tree == "tree":
        return MEDUSA_TREE
    if tree == "chain":
        return None
    if isinstance(tree, (int, float)):
        tree = str(tree)
    if isinstance(tree, str):
        try:
            tree = [tuple(int(x) for x in part.split(",")) for part in tree.split(";") if part.strip()]
        except ValueError as e:
            raise ValueError(f"a candidate tree is 'chain', 'tree' or rank paths like '0;1;0,0;0,1', got {tree!r}") \
                from e
    paths = sorted({tuple(int(x) for x in p) for p in tree}, key=lambda p: (len(p), p))
    have = set(paths)
    bad = [p for p in paths if not p or min(p) < 0 or (len(p) > 1 and p[:-1] not in have)]
    if bad or not paths:
        raise ValueError(f"a candidate tree's paths must be non-empty, of ranks >= 0, and contain every path's "
                         f"parent; bad: {bad or 'no paths'}")
    return tuple(paths)


def tree_from_ranks(paths, top: torch.Tensor, depth: int) -> Draft:
    """The draft tree of ``paths`` (rank paths, parents first) up to ``depth``: the token at depth d of a path
    with last rank k is ``top[d - 1, k]`` (``top`` (D, R) each depth's candidates, best first)."""
    index: dict[tuple, int] = {}
    tokens, parents = [], []
    for p in paths:
        if len(p) > depth or p[-1] >= top.shape[1]:
            continue
        index[p] = len(tokens)
        tokens.append(int(top[len(p) - 1, p[-1]]))
        parents.append(index[p[:-1]] if len(p) > 1 else -1)
    return Draft(tokens, parents=parents)


class HeadsDraft(BaseDraft):
    """Medusa-1 (Cai et al. 2024) drafts: K heads on the verifier's last hidden state before the last committed
    token (at P-1, the state whose LM head chose the token at P) each predict one further token (head k, from 0,
    the token at P+1+k). The prompt's last hidden state comes from the last layer run once more over the prompt
    (:func:`last_layer_output`), so the first round drafts too.

    ``tree``: the candidate tree from the heads' top-k (:func:`parse_tree`; default :data:`MEDUSA_TREE`), verified
    in one pass with a tree attention mask; ``"chain"``: the heads' top-1 chain (sampling: each head's warped
    distribution, drawn from). Trees are deterministic proposals, so sampling keeps the target's distribution with
    the verifier's exact rule for them (:func:`fbs.engine.speculative.accept_tree`); ``typical=True`` uses Medusa's
    typical acceptance instead (faster, not the target's distribution).

    ``heads``: a module with ``num_heads`` mapping final-normed hidden states (b, d) and the model's LM head to
    (K, b, V) logits (:class:`fbs.baselines.medusa.MedusaHeads`). Heads with a ``shortlist`` score only those
    tokens (:func:`draft_lm_head`) unless ``shortlist=False``."""

    name = "medusa"

    def __init__(self, session, heads=None, tree=None, typical: bool = False, posterior_threshold: float = 0.09,
                 posterior_alpha: float = 0.3, shortlist: bool = True):
        super().__init__(session)
        if heads is None:
            raise ValueError("draft 'medusa' needs heads: draft_options={'heads': module} or, with fbs.baselines "
                             "imported, {'path': DIR} of `fbs train medusa`")
        self.heads = heads.eval()
        self.tree = parse_tree(tree)
        self.max_nodes = len(self.tree) if self.tree is not None else 0
        self.acceptance = "typical" if typical else "exact"
        self.posterior = (float(posterior_threshold), float(posterior_alpha))
        self.hidden: dict[int, torch.Tensor] = {}
        self.calls = 0
        head = self.dec.m.base.lm_head
        short = _shortlist(heads) if shortlist else None
        self.lm_head = draft_lm_head(self.dec, short)
        rows = head.weight.shape[0] if short is None else short.numel()
        self.macs_per_call = _linear_params(heads) + heads.num_heads * rows * head.weight.shape[1]  # each head: LM head
        self.cost = self.macs_per_call / max(heads.num_heads, 1) / max(_linear_params(self.dec.m.base.hf), 1)

    def propose(self, rows, budget):
        out = {}
        live = [r for r in rows if budget[r] > 0 and r in self.hidden]
        if not live:
            return out
        h = self.dec.m.base.norm(torch.cat([self.hidden[r] for r in live]))
        logits = self.heads(h, self.lm_head).float()  # (K, b, V)
        self.calls += len(live)
        o = self.dec.opts
        ranks = 1 + max((max(p) for p in self.tree), default=0) if self.tree is not None else 1
        for i, r in enumerate(live):
            k = min(budget[r], logits.shape[0])
            lg = logits[:k, i]
            if self.tree is not None:
                out[r] = tree_from_ranks(self.tree, lg.topk(min(ranks, lg.shape[-1]), -1).indices, k)
            elif o.do_sample:
                q = self.dec.warp(lg).softmax(-1)
                out[r] = Draft(torch.multinomial(q, 1, generator=self.dec.gen)[:, 0].tolist(), q)
            else:
                out[r] = Draft(greedy_ids(lg))
        return out

    def prefill_tap(self, l: int, rows: list[int], x: torch.Tensor) -> None:
        """The prompt's last hidden state (the last layer run once more over the prompt), so that the first
        round drafts too."""
        if l == self.dec.L - 1:
            h = last_layer_output(self.dec, x)
            for i, r in enumerate(rows):
                self.hidden[r] = h[i, -1:]

    def commit(self, rows, positions, kept, verified) -> None:
        for i, (r, c) in enumerate(zip(rows, kept)):
            self.hidden[r] = verified.hidden[i, c - 1:c]  # the state after the last consumed token

    def step_cost(self, row, context) -> float:
        return self.cost

    def draft_macs(self) -> float:
        return float(self.calls * self.macs_per_call)


# --------------------------------------------------------------------------- EAGLE-2
class EagleDraft(BaseDraft):
    """EAGLE-2 (Li et al. 2024): a one-layer draft over the target's features extrapolates them, and a dynamic
    draft tree grows where the draft is confident.

    The layer (:class:`fbs.baselines.eagle.EagleLayer`) keeps its own K/V per row, of entries made from true
    target features only: entry i reads the target's feature f_i and the token at i + 1, and its output predicts
    f_{i+1}. The prompt's features come from the target's last layer run once more over the prompt's input of
    that layer (:meth:`prefill_tap`: one extra layer of prefill); each round's consumed tokens add theirs from the
    verifier's pass (:meth:`commit`). Nothing speculative is stored, so nothing is rolled back.

    A round's tree: the root is the last entry, whose output gives the candidates of depth 1 (top ``topk``,
    scored by their draft log-probability); at each further depth the ``topk`` best-scored nodes of the deepest
    level are expanded (their predicted features are fed back with their tokens, attending to the row's entries
    and their ancestors), each adding its ``topk`` children scored by the path's summed log-probability; finally
    the ``nodes`` best-scored nodes (with their ancestors) form the tree, ordered by depth then score.
    ``depth`` defaults to ``draft_tokens``. Tree candidates are deterministic: sampling keeps the target's
    distribution with the verifier's exact rule. A layer with a ``shortlist`` scores only those tokens
    (:func:`draft_lm_head`) unless ``shortlist=False``."""

    name = "eagle"

    def __init__(self, session, layer=None, depth: int | None = None, topk: int = 4, nodes: int = 16,
                 shortlist: bool = True):
        super().__init__(session)
        if layer is None:
            raise ValueError("draft 'eagle' needs a trained layer: draft_options={'layer': module} or, with "
                             "fbs.baselines imported, {'path': DIR} of `fbs train eagle`")
        limit = self.dec.opts.draft_tokens
        self.depth = int(depth) if depth is not None else limit
        if not 1 <= self.depth <= limit or int(topk) < 1 or int(nodes) < 1:
            raise ValueError(f"eagle needs 1 <= depth <= draft_tokens ({limit}), topk >= 1 and nodes >= 1, got depth "
                             f"{self.depth}, topk {topk}, nodes {nodes}; raise draft_tokens for a deeper tree")
        self.layer = layer.eval()
        self.topk, self.max_nodes = int(topk), int(nodes)
        base = self.dec.m.base
        self.base = base
        self.k: dict[int, torch.Tensor] = {}   # row -> (Hkv, n, hd) keys of the entries at positions 0..n-1
        self.v: dict[int, torch.Tensor] = {}
        self.root: dict[int, torch.Tensor] = {}     # row -> (d,) the last entry's output (predicts f_P)
        self.pending: dict[int, torch.Tensor] = {}  # row -> the prompt's features, waiting for the next token
        self.layer_rows = self.head_rows = 0
        self.layer_macs = _linear_params(layer)
        short = _shortlist(layer) if shortlist else None
        # the tree is scored in the shortlist's own space (its log-softmax equals the scattered head's there):
        # top-k over N, not V, logits; token ids through ``vocab``
        self.lm_head = draft_lm_head(self.dec, short, scatter=False)
        self.vocab = None if short is None else short.tolist()
        self.head_macs = base.lm_head.weight.numel() if short is None else short.numel() * base.spec.hidden_size

    # ---- entries from true features --------------------------------------------
    def prefill_tap(self, l: int, rows: list[int], x: torch.Tensor) -> None:
        """The prompt's input of the last layer: run that layer once more for the prompt's features."""
        if l == self.dec.L - 1:
            feats = last_layer_output(self.dec, x)
            for i, r in enumerate(rows):
                self.pending[r] = feats[i]

    def _extend(self, r: int, feats: torch.Tensor, tokens: list[int], start: int) -> None:
        """Entries at positions start.. from true features (c, d) and the tokens after them."""
        f = feats[None].to(self.base.embedding_weight.dtype)
        e = self.base.embed(torch.tensor([tokens], device=f.device))
        cos, sin = self.base.rope(f, torch.arange(start, start + len(tokens), device=f.device)[None])
        past = (self.k[r][None], self.v[r][None]) if r in self.k else None
        h, k, v = self.layer(f, e, cos, sin, past)
        self.k[r] = k[0] if past is None else torch.cat([self.k[r], k[0]], 1)
        self.v[r] = v[0] if past is None else torch.cat([self.v[r], v[0]], 1)
        self.root[r] = h[0, -1]
        self.layer_rows += len(tokens)

    def _catch_up(self, r: int) -> None:
        """The prompt's entries, once the token after the prompt is known."""
        if r in self.pending:
            feats = self.pending.pop(r)
            ctx = self.context(r)
            self._extend(r, feats, ctx[1:feats.shape[0] + 1], 0)

    @torch.no_grad()
    def commit(self, rows, positions, kept, verified) -> None:
        for i, (r, p, c) in enumerate(zip(rows, positions, kept)):
            self._catch_up(r)
            ctx = self.context(r)
            self._extend(r, verified.hidden[i, :c], ctx[p + 1:p + c + 1], p)

    # ---- the dynamic tree --------------------------------------------------------
    def _logp(self, h: torch.Tensor) -> torch.Tensor:
        self.head_rows += h.shape[0]
        return self.lm_head(self.base.norm(h)).float().log_softmax(-1)

    @torch.no_grad()
    def propose(self, rows, budget):
        out = {}
        for r in rows:
            self._catch_up(r)
            depth = min(budget[r], self.depth)
            if depth > 0 and r in self.root:
                out[r] = self._tree(r, depth)
        return out

    def _top(self, lp: torch.Tensor) -> tuple[list[list[float]], list[list[int]]]:
        """Each row's top-``topk`` (log-probabilities, token ids) of ``lp`` (rows, N or V)."""
        top = lp.topk(min(self.topk, lp.shape[-1]), dim=-1)
        ids = top.indices.tolist()
        if self.vocab is not None:
            ids = [[self.vocab[i] for i in row] for row in ids]
        return top.values.tolist(), ids

    def _tree(self, r: int, depth: int) -> Draft:
        P = len(self.context(r)) - 1
        K = self.topk
        (vals,), (toks,) = self._top(self._logp(self.root[r][None]))
        # node: [token, parent, depth, score, predicted feature or None]
        nodes = [[t, -1, 1, s, None] for s, t in zip(vals, toks)]
        level = list(range(len(nodes)))
        tk, tv, done = [], [], []  # keys / values of expanded nodes, their node indices
        for d in range(1, depth):
            sel = sorted(level, key=lambda j: -nodes[j][3])[:K]
            feats = torch.stack([self.root[r] if nodes[j][1] < 0 else nodes[nodes[j][1]][4] for j in sel])[None]
            e = self.base.embed(torch.tensor([[nodes[j][0] for j in sel]], device=feats.device))
            pos = torch.full((1, len(sel)), P + d - 1, device=feats.device)
            cos, sin = self.base.rope(feats, pos)
            n = self.k[r].shape[1]
            past = (torch.cat([self.k[r]] + tk, 1)[None], torch.cat([self.v[r]] + tv, 1)[None])
            mask = torch.zeros(len(sel), n + len(done) + len(sel), dtype=torch.bool, device=feats.device)
            mask[:, :n] = True
            for i, j in enumerate(sel):
                mask[i, n + len(done) + i] = True
                a = nodes[j][1]
                while a >= 0:
                    mask[i, n + done.index(a)] = True
                    a = nodes[a][1]
            h, k, v = self.layer(feats, e, cos, sin, past, mask[None, None])
            self.layer_rows += len(sel)
            tk.append(k[0])
            tv.append(v[0])
            done.extend(sel)
            vals, toks = self._top(self._logp(h[0]))
            level = []
            for i, j in enumerate(sel):
                nodes[j][4] = h[0, i]
                for s, t in zip(vals[i], toks[i]):
                    level.append(len(nodes))
                    nodes.append([t, j, d + 1, nodes[j][3] + s, None])
        keep: set[int] = set()
        for j in sorted(range(len(nodes)), key=lambda j: -nodes[j][3]):
            chain = []
            a = j
            while a >= 0 and a not in keep:
                chain.append(a)
                a = nodes[a][1]
            if len(keep) + len(chain) <= self.max_nodes:
                keep.update(chain)
            if len(keep) >= self.max_nodes:
                break
        order = sorted(keep, key=lambda j: (nodes[j][2], -nodes[j][3]))
        index = {j: i for i, j in enumerate(order)}
        return Draft([nodes[j][0] for j in order], parents=[index.get(nodes[j][1], -1) for j in order])

    def draft_macs(self) -> float:
        return float(self.layer_rows * self.layer_macs + self.head_rows * self.head_macs)


register_draft("prompt-lookup", PromptLookupDraft)
register_draft("lookahead", LookaheadDraft)
register_draft("specdec", ModelDraft)
register_draft("medusa", HeadsDraft)
register_draft("eagle", EagleDraft)
