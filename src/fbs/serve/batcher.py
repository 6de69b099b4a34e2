"""Continuous batching over the FBS engine: requests join and leave a running batch at token boundaries.

The engine's ``Decoder`` decodes a fixed batch of prompts from the first token to the last. Here it is
composed differently:

* Every request gets its own one-row decoder (``engine.start``). Its options (tau, sampling, stop rules,
  structure protection), its prefill, its sampling, its trace recorder and its final
  :class:`~fbs.engine.GenerationResult` are those of ``fbs.engine.generate`` for that prompt.
* After the prefill, the request's K/V entries and chunk states move into a free row (a *slot*) of a
  :class:`SlotBatch`, a decoder whose rows are slots. Each scheduler tick runs one batched ``decode_step``
  over the busy slots under the engine's batch policy (gather / all / majority), then hands each row's logits
  and trace record back to its request's decoder, which samples and checks stopping as ``generate`` does.
* A finished, cancelled or timed-out request frees its slot at the next token boundary; a waiting request
  takes it before the next step.

Options that change how a whole batch runs (KV policy, batch policy, never-skip layers, ``force_compute``,
Bernoulli gates, weight format, KV cache policy and budget) form the batch key: requests with different keys decode in separate batches,
stepped in turn. tau and structure protection are per row (:meth:`SlotBatch._row_tau`).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable

import torch

from ..engine import (CAPACITY_STEP, VALIDATORS, DecodeOptions, GenerationResult, Decoder, finish, run, start,
                      TraceRecorder)

logger = logging.getLogger(__name__)

#: DecodeOptions fields that must agree within one batch (the rest are per request).
BATCH_FIELDS = ("batch_policy", "force_compute", "gate_sampling", "never_skip", "weights", "kv_cache", "kv_budget",
                "kv_dtype", "prefill")
#: Names of the per-step records of :class:`fbs.engine.TraceRecorder`.
_RECORDS = TraceRecorder.FIELDS


class SlotBatch(Decoder):
    """A decoder whose ``slots`` rows are slots over one static KV cache.

    A decode step attends over the cache's whole capacity (masked), so the capacity follows the members: the
    longest prompt + max_new_tokens among them, rounded up to ``CAPACITY_STEP``, at most ``capacity``. It grows
    when a longer request joins and shrinks back when the batch has emptied.

    A member is the one-row decoder of a request (after its prefill). The batch's own ``prompts[slot]`` is the
    member's context so far (prompt + consumed tokens), so the engine's ``decode_step(0, ...)`` places every
    row at its own position; the step's trace record (step 0 of a fresh recorder) moves to the member's
    recorder at the member's own step.
    """

    def __init__(self, model, key_opts: DecodeOptions, slots: int, capacity: int, tokenizer=None):
        super().__init__(model, [[0]] * slots, dataclasses.replace(key_opts, max_new_tokens=1), tokenizer)
        self.max_capacity = capacity
        self.prompts = [[] for _ in range(slots)]
        self.members: list[Decoder | None] = [None] * slots
        self.owners: list[object] = [None] * slots
        self.active = []
        self._fit(1)  # the base class sized its cache for the placeholder prompts

    def _fit(self, need: int) -> None:
        """Make the cache hold ``need`` positions per row (busy rows are copied over)."""
        cap = min(-(-need // CAPACITY_STEP) * CAPACITY_STEP, self.max_capacity)
        if need > self.max_capacity:
            raise ValueError(f"a row needs {need} positions; the batch holds at most {self.max_capacity}")
        old = getattr(self, "cache", None)
        if old is not None and old.batch == self.B and (old.capacity >= cap if self.active else old.capacity == cap):
            return
        self.cache = self.new_cache(cap)
        for r in self.active:
            self.cache.load_row(r, old, r)

    def join(self, dec: Decoder, owner=None) -> int:
        """Move a prefilled one-row decoder into a free slot; returns the slot. Its own cache is released."""
        slot = self.members.index(None)
        n, new = len(dec.prompts[0]), dec.opts.max_new_tokens
        self._fit(n + new if self.kv is None else self.kv.capacity(n, new))  # a cache policy: its budget
        self.cache.load_row(slot, dec.cache, 0)
        rows = torch.tensor([slot], device=self.dev)
        for l, state in dec.chunks.items():
            self.chunks[l].assign(rows, state)
        self.prompts[slot] = list(dec.prompts[0]) + dec.out[0][:-1]  # the newest token is not consumed yet
        dec.cache = None
        self.members[slot], self.owners[slot] = dec, owner
        self.active = sorted(self.active + [slot])
        return slot

    def leave(self, slot: int) -> None:
        self.cache.clear_row(slot)
        self.members[slot] = self.owners[slot] = None
        self.prompts[slot] = []
        self.active = [r for r in self.active if r != slot]

    def step(self) -> list[int]:
        """One decode step for every busy slot (in ``active`` order): each member's next token, sampled by the
        member (its own sampling options and generator). The members' out lists are not extended here."""
        rows = list(self.active)
        tokens = [self.members[r].out[0][-1] for r in rows]
        self.rec = TraceRecorder(self.B, 1, self.L)
        logits = self.decode_step(0, tokens)  # (b, V)
        picked = []
        for i, r in enumerate(rows):
            member = self.members[r]
            step = len(member.out[0]) - 1  # the member's decode step that consumed its newest token
            for name in _RECORDS:
                getattr(member.rec, name)[0][step] = getattr(self.rec, name)[r][0]
            self.prompts[r].append(tokens[i])
            picked.append(member.pick(logits[i:i + 1], [0])[0])
        return picked

    def _row_tau(self, row: int) -> float:
        """The member's own tau (its request's, raised on structure tokens when it protects structure)."""
        return self.members[row]._row_tau(0)


def accept(dec: Decoder, token: int) -> bool:
    """Book a new token for a one-row decoder as ``engine.run`` does; True when the row is finished."""
    dec.out[0].append(token)
    if dec.structure is not None:
        dec.depth[0] = max(0, dec.depth[0] + dec.structure.depth_delta[token])
    return dec.finished(0, token)


# --------------------------------------------------------------------------- the scheduler
@dataclasses.dataclass
class Limits:
    """What the server admits. Each default lives here only."""

    max_concurrent: int = 8        # requests decoding at once (slots)
    max_queue: int = 64            # requests waiting for a slot; more are refused (HTTP 429)
    timeout_s: float = 600.0       # from arrival to the last token; past it the request fails (HTTP 408)
    max_tokens: int = 1024         # largest max_tokens a request may ask for
    context_length: int = 2048     # prompt + max_tokens, per request (the KV cache holds this many per slot)

    def __post_init__(self):
        for name in ("max_concurrent", "max_tokens", "context_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


class QueueFull(Exception):
    """Every slot is busy and the queue is full."""


class RequestTimeout(Exception):
    """The request did not finish within the server's timeout."""


@dataclasses.dataclass
class Event:
    """What the scheduler tells a request's consumer: ``token`` (new ids), ``done`` (the result, why it stopped
    and the FBS summary) or ``error``."""

    kind: str
    tokens: list[int] = dataclasses.field(default_factory=list)
    result: GenerationResult | None = None
    finish_reason: str | None = None
    summary: dict | None = None
    error: Exception | None = None


_ids = itertools.count()


class Request:
    """One generation: prompt ids, DecodeOptions fields, and a callback for its :class:`Event` s (called from
    the scheduler thread: it must not block)."""

    def __init__(self, prompt: list[int], options: dict, on_event: Callable[[Event], None]):
        self.id = next(_ids)
        self.prompt, self.options, self.on_event = list(prompt), dict(options), on_event
        self.arrived = time.monotonic()
        self.deadline = float("inf")
        self.cancelled = False
        # owned by the scheduler thread
        self.dec: Decoder | None = None
        self.batch: SlotBatch | None = None
        self.slot: int | None = None
        self.holds_slot = False  # counted in the scheduler's busy slots (from admission to release)
        self.fallback = False
        self.solo = None  # lossless requests: the engine's speculative token iterator (decoded alone, not in a batch)
        self.queued_s = 0.0  # arrival to admission
        self.started = 0.0   # perf_counter at the first token (decode timing)


class Scheduler:
    """Runs the engine in one thread: admits waiting requests into free slots, steps every batch once per
    tick, emits tokens, frees slots. ``submit`` and ``cancel`` are safe from any thread."""

    def __init__(self, model, tokenizer=None, limits: Limits | None = None, defaults: dict | None = None):
        self.model, self.tok = model, tokenizer
        self.limits = limits or Limits()
        self.defaults = dict(defaults or {})  # DecodeOptions fields every request starts from (e.g. weights)
        self._cond = threading.Condition()
        self._waiting: collections.deque[Request] = collections.deque()
        self._busy = 0
        self._batches: dict[tuple, SlotBatch] = {}
        self._solo: list[Request] = []  # lossless requests: one draft/verify round at a time, outside the batches
        self._default_key: tuple | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        self._external = False  # run_here drives the engine from its caller's thread
        self.counts = collections.Counter()

    # ---- any thread ---------------------------------------------------------
    def start(self) -> "Scheduler":
        """Run the engine in a thread of its own (unless :meth:`run_here` drives it from the caller's)."""
        if self._thread is None and not self._external:
            self._thread = threading.Thread(target=self._loop, name="fbs-scheduler", daemon=True)
            self._thread.start()
        return self

    def use_caller_thread(self) -> None:
        """From now on :meth:`start` starts no thread: the engine runs where :meth:`run_here` is called."""
        self._external = True

    def run_here(self, until: Callable[[], bool] | None = None, poll_s: float = 0.1) -> None:
        """Run the engine in the calling thread until :meth:`stop` (or ``until()`` turns true, checked at least
        every ``poll_s`` while idle); :meth:`start` then starts no thread of its own.

        Why: libgomp throttles the spin-waits of a thread team started outside the process's first thread when the
        process holds more OpenMP threads than CPUs, so on a small machine whose main thread already ran parallel
        work (loading the model) the engine decodes about 3x slower in a second thread (2 cores: 19.6 against
        6.7 ms a token, measured). ``fbs serve`` therefore runs the engine in its main thread and the HTTP server
        in another."""
        self.use_caller_thread()
        self._loop(until, poll_s)

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def submit(self, req: Request) -> None:
        """Queue a request; raises :class:`QueueFull` when it cannot even wait."""
        with self._cond:
            if self._busy + len(self._waiting) >= self.limits.max_concurrent + self.limits.max_queue:
                self.counts["rejected"] += 1
                raise QueueFull(f"{self._busy} requests are decoding and {len(self._waiting)} are waiting "
                                f"(max_concurrent={self.limits.max_concurrent}, max_queue={self.limits.max_queue})")
            req.deadline = req.arrived + self.limits.timeout_s
            self._waiting.append(req)
            self._cond.notify_all()

    def cancel(self, req: Request) -> None:
        """The client went away: the request stops and frees its slot at the next token boundary."""
        with self._cond:
            req.cancelled = True
            self._cond.notify_all()

    def status(self) -> dict:
        with self._cond:
            return {"slots": {"max": self.limits.max_concurrent, "busy": self._busy},
                    "queue": {"max": self.limits.max_queue, "waiting": len(self._waiting)},
                    "batches": len(self._batches), "counts": dict(self.counts)}

    # ---- the scheduler thread -----------------------------------------------
    def _loop(self, until: Callable[[], bool] | None = None, poll_s: float = 0.1) -> None:
        with torch.inference_mode():
            while True:
                with self._cond:
                    while not self._stop and not self._waiting and not self._busy:
                        if until is not None and until():
                            self._stop = True
                            break
                        self._cond.wait(poll_s if until is not None else None)
                    if self._stop:
                        break
                self._tick()
        for req in (list(self._waiting) + [o for b in self._batches.values() for o in b.owners if o is not None]
                    + list(self._solo)):
            self._fail(req, RuntimeError("the server is shutting down"))

    def _tick(self) -> None:
        self._reap()
        self._admit()
        for key, batch in list(self._batches.items()):
            if batch.active:
                self._decode(batch)
            if not batch.active and key != self._default_key:
                del self._batches[key]  # an idle batch of a rare key: give its cache back
        for req in list(self._solo):
            self._advance(req)

    def _reap(self) -> None:
        """Drop cancelled and timed-out requests, waiting or decoding."""
        now = time.monotonic()
        with self._cond:
            gone = [r for r in self._waiting if r.cancelled or now > r.deadline]
            for r in gone:
                self._waiting.remove(r)
        for batch in self._batches.values():
            gone += [o for o in batch.owners if o is not None and (o.cancelled or now > o.deadline)]
        gone += [r for r in self._solo if r.cancelled or now > r.deadline]
        for req in gone:
            if req.cancelled:
                self._release(req)
                self._count("cancelled")
            else:
                self._fail(req, RequestTimeout(f"request timed out after {self.limits.timeout_s:g} s"), "timed_out")

    def _admit(self) -> None:
        while True:
            with self._cond:
                if not self._waiting or self._busy >= self.limits.max_concurrent:
                    return
                req = self._waiting.popleft()
                req.holds_slot = True
                self._busy += 1
            try:
                self._prefill(req)
            except Exception as e:  # noqa: BLE001 - one bad request must not stop the server
                logger.exception("request %d failed in prefill", req.id)
                self._fail(req, e)

    def _prefill(self, req: Request) -> None:
        req.queued_s = time.monotonic() - req.arrived
        t0 = time.perf_counter()
        dec = start(self.model, [req.prompt], None, self.tok, {**self.defaults, **req.options})
        if dec.opts.lossless:
            # lossless: the engine's own speculative loop (draft at tau, verify at full depth) runs for this row
            # alone; each tick hands out one committed token (a new round is computed when they run out)
            req.dec, req.solo, req.started = dec, run(dec), time.perf_counter()
            self._solo.append(req)
            return
        token = dec.pick(torch.stack(dec.prefill()), [0])[0]
        dec.timings = {"prefill_s": time.perf_counter() - t0}
        req.dec, req.started = dec, time.perf_counter()
        self._emit(req, Event("token", [token]))
        if accept(dec, token):
            self._complete(req)
            return
        batch = self._batch_for(dec)
        req.batch, req.slot = batch, batch.join(dec, req)

    def _batch_for(self, dec: Decoder) -> SlotBatch:
        o = dec.opts
        never = tuple(sorted({l % dec.L for l in o.never_skip}))
        key = (dec.policy, o.batch_policy, o.force_compute, o.gate_sampling, never, o.weights, o.kv_cache, o.kv_budget,
               o.kv_dtype, o.prefill)
        batch = self._batches.get(key)
        if batch is None:
            fields = {name: getattr(o, name) for name in BATCH_FIELDS}
            key_opts = DecodeOptions(kv_policy=dec.policy, **{**fields, "never_skip": never})
            batch = SlotBatch(self.model, key_opts, self.limits.max_concurrent, self.limits.context_length, self.tok)
            self._batches[key] = batch
            if self._default_key is None:
                self._default_key = key
        return batch

    def _decode(self, batch: SlotBatch) -> None:
        rows = list(batch.active)
        try:
            tokens = batch.step()
        except Exception as e:  # noqa: BLE001 - the batch's state is suspect: fail its requests, drop it
            logger.exception("decode step failed")
            for r in rows:
                self._fail(batch.owners[r], e)
            for key in [k for k, b in self._batches.items() if b is batch]:
                del self._batches[key]
            return
        for r, token in zip(rows, tokens):
            req = batch.owners[r]
            self._emit(req, Event("token", [token]))
            if accept(req.dec, token):
                self._complete(req)

    def _advance(self, req: Request) -> None:
        """One token of a lossless request (its prefill happens in the first call)."""
        try:
            out = next(req.solo)
        except StopIteration:  # the speculative loop ended: it set the timings and the final trace
            self._complete(req)
            return
        except Exception as e:  # noqa: BLE001 - one bad request must not stop the server
            logger.exception("lossless request %d failed", req.id)
            self._fail(req, e)
            return
        self._emit(req, Event("token", list(out.tokens)))

    def _complete(self, req: Request) -> None:
        dec = req.dec
        self._leave_batch(req)
        if req.solo is None:
            decode_s = time.perf_counter() - req.started
            dec.timings.update(decode_s=decode_s, total_s=dec.timings["prefill_s"] + decode_s)
        result = finish(dec)
        check = dec.opts.validator
        if check is not None and not req.fallback:
            check = VALIDATORS[check] if isinstance(check, str) else check
            if not check(self.tok.decode(result.new_tokens[0], skip_special_tokens=True)):
                # appendix E.9: rerun the row at the conservative tau; it keeps its claim on a slot
                req.fallback = True
                req.options = {**req.options, "tau": dec.opts.fallback_tau, "validator": None}
                try:
                    self._prefill(req)
                except Exception as e:  # noqa: BLE001
                    self._fail(req, e)
                return
        self._release(req)
        result.trace.fallback = [req.fallback]
        out = result.new_tokens[0]
        if out and out[-1] in dec.eos:
            reason = "stop"
        else:
            reason = "length" if len(out) >= dec.opts.max_new_tokens else "stop"  # else a stop string ended it
        tr = result.trace
        summary = {"skip_ratio": tr.skip_ratio, "tflops_rel": tr.tflops_rel, "tflops_rel_exact": tr.tflops_rel_exact,
                   "tau": dec.tau, "kv_policy": dec.policy, "batch_policy": dec.opts.batch_policy,
                   "kv_cache": dec.opts.kv_cache, "kv_budget": dec.opts.kv_budget, "kv_dtype": dec.opts.kv_dtype,
                   "prefill": dec.opts.prefill, "fallback": req.fallback, "queue_s": req.queued_s,
                   **{k: result.timings[k] for k in ("prefill_s", "decode_s")}}
        if result.speculative is not None:  # lossless: acceptance, tokens per verify pass, the draft's skip share
            summary["lossless"] = result.speculative.to_dict()
        self._count("completed")
        self._emit(req, Event("done", result=result, finish_reason=reason, summary=summary))

    def _leave_batch(self, req: Request) -> None:
        if req.batch is not None:
            req.batch.leave(req.slot)
            req.batch, req.slot = None, None

    def _release(self, req: Request) -> None:
        """Give the request's slot back, if it holds one (a waiting request does not)."""
        self._leave_batch(req)
        if req in self._solo:
            self._solo.remove(req)
            req.solo = None
        req.dec = None
        if req.holds_slot:
            req.holds_slot = False
            with self._cond:
                self._busy -= 1

    def _fail(self, req: Request, error: Exception, count: str = "failed") -> None:
        self._release(req)
        with self._cond:
            if req in self._waiting:
                self._waiting.remove(req)
        self._count(count)
        self._emit(req, Event("error", error=error))

    def _count(self, name: str, n: int = 1) -> None:
        with self._cond:  # status() reads the counters from the HTTP thread
            self.counts[name] += n

    def _emit(self, req: Request, event: Event) -> None:
        self._count("generated_tokens", len(event.tokens))
        try:
            req.on_event(event)
        except Exception:  # noqa: BLE001 - a consumer that went away (closed event loop) must not stop decoding
            logger.debug("request %d: event not delivered", req.id, exc_info=True)
