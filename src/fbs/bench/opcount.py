"""Deterministic cost counts of the engine's decode steps: ATen calls dispatched and host reads, no clocks.

Timing a decode step on a shared machine is noisy; the per-token Python overhead of a one-token step is
mostly a count of small operator calls and of device-to-host reads, which do not vary from run to run.
:func:`count_decode_steps` records, for every ``Decoder.decode_step`` call inside the block, one
:class:`StepCount`:

* ``ops``: top-level ATen calls (calls issued from Python or from a compiled graph's wrapper, each one trip
  through the dispatcher; the ops an ATen call runs internally are not counted again), from the profiler's
  event tree, so eager and ``torch.compile``d steps are counted alike;
* ``compiled``: calls of compiled regions (``torch.compile``), whose kernels are not ATen calls;
* ``host_reads``: ``Tensor.tolist`` / ``item`` / ``__bool__`` / ``__float__`` / ``__int__`` / ``__index__``
  calls (each reads device memory on the host: a synchronization on an accelerator);
* ``py_calls``: Python-level function calls (``sys.setprofile``'s call events; C functions not included), a
  count of the interpreter's share of the step (compiled steps: dynamo's guard code included).

    python -m fbs.bench.opcount                       # the shipped SmolLM2 FBS model, a few tokens
    python -m fbs.bench.opcount --base smollm2-135m --new-tokens 4 --weights fp32,int8 --compile

The table gives, per setting, the median per-token counts and, for gated settings, the difference to
``force_compute`` per gated layer.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import statistics
import sys

import torch

from ..engine import Decoder

_HOST_READS = ("tolist", "item", "__bool__", "__float__", "__int__", "__index__")


@dataclasses.dataclass
class StepCount:
    ops: int                                    # top-level ATen calls
    all_ops: int                                # every ATen call, those inside other ATen calls included
    compiled: int                               # compiled-region calls
    host_reads: int                             # tolist / item / bool / float / int / index on a tensor
    py_calls: int                               # Python function calls (the interpreter's work, roughly)
    by_name: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # top-level ATen calls


@contextlib.contextmanager
def count_host_reads():
    """Count host reads (see the module doc) while inside; yields a one-element list holding the count."""
    n = [0]
    real = {name: getattr(torch.Tensor, name) for name in _HOST_READS}

    def wrap(fn):
        def counted(self, *a, **k):
            n[0] += 1
            return fn(self, *a, **k)
        return counted

    for name, fn in real.items():
        setattr(torch.Tensor, name, wrap(fn))
    try:
        yield n
    finally:
        for name, fn in real.items():
            setattr(torch.Tensor, name, fn)


def _count_events(events) -> tuple[int, int, int, collections.Counter]:
    ops, all_ops, compiled, names = 0, 0, 0, collections.Counter()
    for e in events:
        aten = e.name.startswith("aten::")
        all_ops += aten
        if e.cpu_parent is not None:
            continue
        if aten:
            ops += 1
            names[e.name] += 1
        elif e.name.startswith("Torch-Compiled Region"):
            compiled += 1
    return ops, all_ops, compiled, names


@contextlib.contextmanager
def count_python_calls():
    """Count Python function calls while inside (the profile hook of this thread); yields a one-element list."""
    n = [0]

    def hook(frame, event, arg):
        if event == "call":
            n[0] += 1

    old = sys.getprofile()
    sys.setprofile(hook)
    try:
        yield n
    finally:
        sys.setprofile(old)


@contextlib.contextmanager
def count_calls():
    """Count ATen calls, compiled-region calls, host reads and Python calls of the code run inside; yields a list
    that holds one :class:`StepCount` once the block ends."""
    out: list[StepCount] = []
    with count_host_reads() as reads, torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        with count_python_calls() as py:
            yield out
    ops, all_ops, compiled, names = _count_events(p.events())
    out.append(StepCount(ops, all_ops, compiled, reads[0], py[0] - reads[0], names))


@contextlib.contextmanager
def count_decode_steps():
    """Yields a list that receives a :class:`StepCount` per ``decode_step`` of the engine run inside the block
    (prefill, sampling and the trace's finishing are not counted)."""
    steps: list[StepCount] = []
    real = Decoder.decode_step

    def counted(self, *a, **k):
        with count_calls() as c:
            out = real(self, *a, **k)
        steps.extend(c)
        return out

    Decoder.decode_step = counted
    try:
        yield steps
    finally:
        Decoder.decode_step = real


def median_count(steps: list[StepCount]) -> StepCount:
    """The median of each count over steps (``by_name``: the last step's)."""
    med = lambda f: int(statistics.median(getattr(s, f) for s in steps))  # noqa: E731
    return StepCount(med("ops"), med("all_ops"), med("compiled"), med("host_reads"), med("py_calls"),
                     steps[-1].by_name)


def decode_counts(model, input_ids, new_tokens: int = 4, **options) -> tuple[StepCount, object]:
    """Per-token counts of ``model.generate``'s decode steps (the median over the ``new_tokens - 1`` steps; the
    first token comes from the prefill) and the generation result."""
    with count_decode_steps() as steps:
        res = model.generate(input_ids, max_new_tokens=new_tokens, ignore_eos=True, **options)
    return median_count(steps), res


# --------------------------------------------------------------------------- command line
def _settings(model, bare, weights: list[str], compile_modes: list[bool]):
    for fmt in weights:
        for comp in compile_modes:
            kw = dict(weights=fmt, compile=comp)
            yield f"{fmt}{' compile' if comp else ''}", [
                ("bare", bare, dict(kw, force_compute=True)),
                ("force_compute", model, dict(kw, force_compute=True)),
                ("tau=1", model, dict(kw, tau=1.0)),
                ("tau", model, dict(kw)),
            ]


def main(argv: list[str] | None = None) -> None:
    from ..model.loading import load_fbs
    from ..model.causal_lm import FBSForCausalLM

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="smollm2-135m")
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--weights", default="fp32,int8")
    ap.add_argument("--compile", action="store_true", help="also count the compiled step (compiles on first use)")
    ap.add_argument("--names", action="store_true", help="list the gated - force_compute difference by op name")
    args = ap.parse_args(argv)
    model = load_fbs(args.base, args.checkpoint).eval()
    bare = FBSForCausalLM.from_base(model.base.hf, config=model.config.replace(paw_layers=(), ch_layers=())).eval()
    ids = torch.randint(0, model.base.spec.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
    n_gated = len(model.layers_cfg.gated)
    print(f"{args.base}: {model.num_layers} layers, {n_gated} gated; per decode token (median of "
          f"{args.new_tokens - 1} steps)")
    print(f"{'setting':<14} {'system':<14} {'aten':>6} {'all':>6} {'compiled':>9} {'reads':>6} {'python':>7} "
          f"{'skip':>6}  (x - force_compute) / gated layer")
    for label, rows in _settings(model, bare, args.weights.split(","), [False] + [True] * args.compile):
        ref = None
        for name, m, kw in rows:
            c, res = decode_counts(m, ids, args.new_tokens, **kw)
            diff = ""
            if name == "force_compute":
                ref = c
            elif name != "bare" and ref is not None:
                per = lambda f: (getattr(c, f) - getattr(ref, f)) / n_gated  # noqa: E731
                diff = (f"aten {per('ops'):+.2f}, all {per('all_ops'):+.2f}, compiled {per('compiled'):+.2f}, "
                        f"reads {per('host_reads'):+.2f}, python {per('py_calls'):+.2f}")
            print(f"{label:<14} {name:<14} {c.ops:>6} {c.all_ops:>6} {c.compiled:>9} {c.host_reads:>6} "
                  f"{c.py_calls:>7} {res.trace.skip_ratio:>6.3f}  {diff}")
            if args.names and name == "tau=1" and ref is not None:
                delta = {k: c.by_name[k] - ref.by_name[k] for k in set(c.by_name) | set(ref.by_name)}
                print("    " + ", ".join(f"{k[6:]} {v:+d}" for k, v in sorted(delta.items(), key=lambda kv: -kv[1])
                                         if v))


if __name__ == "__main__":
    main()
